"""A seccomp filter for model code: the system calls a sandbox has no use for and that reach
past its namespaces or its uid, refused with EPERM.

Why a filter on top of namespaces and an unprivileged uid: a few kernel facilities are shared
with the host whatever namespace a process is in, or are large attack surfaces that ordinary
Python never needs. Refused here:

* new namespaces other than the two a forker clones sandboxes into (PID and mount, which need
  privileges model code does not have): above all user namespaces, which would give model code
  capabilities inside them, and with them the kernel's mount and network configuration
  surface (`unshare` and `setns` entirely; `clone` with such a flag; `clone3`, whose flags a
  filter cannot read, gets ENOSYS so that libc falls back to `clone`);
* the new mount API, `umount2`, `pivot_root`, `chroot` (`mount` itself stays: each sandbox
  mounts its own /proc and tmpfs while still root; without privileges it fails anyway);
* the kernel keyrings (`add_key`, `keyctl`, `request_key`): the user keyring belongs to the uid,
  not to the call, so it would carry data from one call of a slot to the next;
* System V IPC and POSIX message queues: their objects belong to the IPC namespace, which all
  sandboxes of a zygote share, so they would outlive the call;
* sockets other than TCP/UDP (which the network namespace confines to a down loopback): unix
  sockets reach host services by path and concurrent sandboxes by abstract name; netlink,
  packet and vsock sockets reach the kernel or the hypervisor. `socketpair` stays allowed for
  connected unix stream/seqpacket pairs (asyncio and multiprocessing use them), which nothing
  outside the call can reach;
* debugging and kernel interfaces (`ptrace`, `process_vm_*`, `bpf`, `perf_event_open`,
  `userfaultfd`, `io_uring_*`, `syslog`, `kcmp`, `pidfd_getfd`, modules, kexec, swap, quotas,
  clocks, `acct`, `reboot`, `fanotify_init`, handles, x86's `modify_ldt`/`iopl`/`ioperm`).

Installed once per forker, after `PR_SET_NO_NEW_PRIVS` (no setuid binary can raise privileges
afterwards), and inherited by every sandbox it clones: the kernel compiles a filter when it is
installed, which per sandbox was a measurable part of a trivial call. The forker's own work
(receiving fds, cloning into PID and mount namespaces) and each sandbox's setup (mounts, the uid
drop) are all allowed. Known for x86_64 and aarch64; elsewhere `prepare()` is False.

A second, tiny filter (`install_limits_filter`) is stacked by each sandbox once it has set its
call's limits: from then on no process of the call can set a `LOCKED_LIMITS` limit (setrlimit,
or prlimit64 with a new limit; reading one stays allowed). Why: the sandbox is PID 1 of its
namespace, and the kernel drops the signals a limit sends to an init without a handler
(SIGXCPU, SIGXFSZ), so the only way the kernel ends it for a limit is the SIGKILL at
RLIMIT_CPU's hard limit (RLIMIT_RTTIME's likewise, for a real-time task). The worker tells that kill, the program's, from a kill from outside the
call (ours: an infrastructure error, retried and never shown) by the CPU time the sandbox used;
a program that lowered its own limit would be killed below the configured one and look like
the second. This rule cannot be in the forker's filter: the sandbox itself sets these limits
when its call (and so its timeout) arrives, in the same process that then runs the model's code.
Other limits cannot cause such a kill: RLIMIT_FSIZE's SIGXFSZ is dropped for an init (the write
fails with EFBIG), the memory and file limits fail calls.
"""
from __future__ import annotations

import ctypes
import errno
import platform
import resource
import socket
import struct

from rstarjax.env.isolation import prctl

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
X32_SYSCALL_BIT = 0x40000000

# classic BPF opcodes
LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
AND = 0x54  # BPF_ALU | BPF_AND | BPF_K
RET = 0x06  # BPF_RET | BPF_K

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little endian)
NR, ARCH = 0, 4


def arg(i: int) -> int:
    return 16 + 8 * i  # low 32 bits of args[i]


def arg_high(i: int) -> int:
    return arg(i) + 4  # high 32 bits of args[i]


# every CLONE_NEW* flag except NEWNS and NEWPID, which forkers use (and model code cannot)
CLONE_REFUSED = 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x40000000 | 0x80
SOCK_TYPE_MASK = 0xF

# (audit arch, numbers of the syscalls used below); aarch64 uses the generic table
_DENIED = (
    "unshare", "setns", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr", "add_key", "keyctl", "request_key", "shmget", "shmat", "shmctl",
    "shmdt", "semget", "semop", "semctl", "semtimedop", "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open",
    "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr", "ptrace", "process_vm_readv",
    "process_vm_writev", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "acct",
    "swapon", "swapoff", "reboot", "syslog", "quotactl", "quotactl_fd", "lookup_dcookie", "vhangup",
    "name_to_handle_at", "open_by_handle_at", "kcmp", "pidfd_getfd", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "fanotify_init", "modify_ldt", "iopl", "ioperm",
)
SYSCALLS = {
    "x86_64": (0xC000003E, {
        "socket": 41, "socketpair": 53, "clone": 56, "clone3": 435, "unshare": 272, "setns": 308, "mount": 165,
        "umount2": 166, "pivot_root": 155, "chroot": 161, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "move_mount": 429, "open_tree": 428, "mount_setattr": 442, "add_key": 248, "keyctl": 250,
        "request_key": 249, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "bpf": 321,
        "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
        "finit_module": 313, "delete_module": 176, "acct": 163, "swapon": 167, "swapoff": 168, "reboot": 169,
        "syslog": 103, "quotactl": 179, "quotactl_fd": 443, "lookup_dcookie": 212, "vhangup": 153,
        "name_to_handle_at": 303, "open_by_handle_at": 304, "kcmp": 312, "pidfd_getfd": 438,
        "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159, "fanotify_init": 300,
        "modify_ldt": 154, "iopl": 172, "ioperm": 173, "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67,
        "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70,
        "msgctl": 71, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243,
        "mq_notify": 244, "mq_getsetattr": 245, "setrlimit": 160, "prlimit64": 302,
    }),
    "aarch64": (0xC00000B7, {
        "socket": 198, "socketpair": 199, "clone": 220, "clone3": 435, "unshare": 97, "setns": 268, "mount": 40,
        "umount2": 39, "pivot_root": 41, "chroot": 51, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "move_mount": 429, "open_tree": 428, "mount_setattr": 442, "add_key": 217, "keyctl": 219,
        "request_key": 218, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "bpf": 280,
        "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
        "finit_module": 273, "delete_module": 106, "acct": 89, "swapon": 224, "swapoff": 225, "reboot": 142,
        "syslog": 116, "quotactl": 60, "quotactl_fd": 443, "lookup_dcookie": 18, "vhangup": 58,
        "name_to_handle_at": 264, "open_by_handle_at": 265, "kcmp": 272, "pidfd_getfd": 438,
        "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171, "fanotify_init": 262,
        "shmget": 194, "shmat": 196, "shmctl": 195, "shmdt": 197, "semget": 190, "semop": 193, "semctl": 191,
        "semtimedop": 192, "msgget": 186, "msgsnd": 189, "msgrcv": 188, "msgctl": 187, "mq_open": 180,
        "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184, "mq_getsetattr": 185,
        "setrlimit": 164, "prlimit64": 261,
    }),
}

# The limits whose excess the kernel punishes with SIGKILL, the one signal of a limit that ends a
# PID 1 (see the module docstring): fixed for the rest of a call once its sandbox has set them.
LOCKED_LIMITS = (resource.RLIMIT_CPU, resource.RLIMIT_RTTIME)


def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def refuse(err: int) -> bytes:
    return ins(RET, RET_ERRNO | err)


def build_program(machine: str | None = None) -> bytes | None:
    """The filter as raw `struct sock_filter` instructions, or None on an unknown architecture."""
    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        return None
    arch, nr = SYSCALLS[machine]
    eperm = refuse(errno.EPERM)
    prog = [ins(LD_ABS, ARCH), ins(JEQ, arch, 1, 0), ins(RET, RET_KILL_PROCESS), ins(LD_ABS, NR)]
    if machine == "x86_64":  # refuse the x32 ABI, whose numbers would bypass the table
        prog += [ins(JGE, X32_SYSCALL_BIT, 0, 1), eperm]
    for name in _DENIED:
        if name in nr:
            prog += [ins(JEQ, nr[name], 0, 1), eperm]
    prog += [ins(JEQ, nr["clone3"], 0, 1), refuse(errno.ENOSYS)]
    # clone: a refused namespace flag -> EPERM
    prog += [ins(JEQ, nr["clone"], 0, 4), ins(LD_ABS, arg(0)), ins(JSET, CLONE_REFUSED, 0, 1), eperm,
             ins(RET, RET_ALLOW)]
    # socket(domain): TCP/UDP only (confined by the network namespace)
    prog += [ins(JEQ, nr["socket"], 0, 5), ins(LD_ABS, arg(0)), ins(JEQ, socket.AF_INET, 2, 0),
             ins(JEQ, socket.AF_INET6, 1, 0), eperm, ins(RET, RET_ALLOW)]
    # socketpair(AF_UNIX, SOCK_STREAM | SOCK_SEQPACKET, ...): connected pairs nobody else can reach
    prog += [ins(JEQ, nr["socketpair"], 0, 8), ins(LD_ABS, arg(0)), ins(JEQ, socket.AF_UNIX, 0, 4),
             ins(LD_ABS, arg(1)), ins(AND, SOCK_TYPE_MASK), ins(JEQ, socket.SOCK_STREAM, 2, 0),
             ins(JEQ, socket.SOCK_SEQPACKET, 1, 0), eperm, ins(RET, RET_ALLOW)]
    prog.append(ins(RET, RET_ALLOW))
    return b"".join(prog)


def _is_locked_limit(resource_arg: int, jump_if_locked: int, jump_if_not: int) -> list[bytes]:
    """Load the syscall's resource argument (an unsigned int to the kernel: its low half is all
    it reads) and jump by whether it names a LOCKED_LIMITS entry (offsets from the last
    instruction)."""
    prog = [ins(LD_ABS, arg(resource_arg))]
    n = len(LOCKED_LIMITS)
    for i, limit in enumerate(LOCKED_LIMITS):
        left = n - 1 - i  # comparisons after this one
        prog.append(ins(JEQ, limit, left + jump_if_locked, 0 if left else jump_if_not))
    return prog


def build_limits_program(machine: str | None = None) -> bytes | None:
    """The filter a sandbox stacks once its limits are set: setrlimit of a LOCKED_LIMITS limit,
    and prlimit64 that sets one (a non-NULL new limit, either half of the pointer), get EPERM;
    getrlimit and prlimit64 with new=NULL (what `resource.getrlimit` calls) are allowed. As raw
    `struct sock_filter` instructions, or None on an unknown architecture."""
    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        return None
    arch, nr = SYSCALLS[machine]
    eperm, allow = refuse(errno.EPERM), ins(RET, RET_ALLOW)
    prog = [ins(LD_ABS, ARCH), ins(JEQ, arch, 1, 0), ins(RET, RET_KILL_PROCESS), ins(LD_ABS, NR)]
    if machine == "x86_64":  # the x32 ABI's numbers would bypass the table (the forker's filter refuses it too)
        prog += [ins(JGE, X32_SYSCALL_BIT, 0, 1), eperm]
    # setrlimit(resource, rlim)
    check = _is_locked_limit(0, 0, 1) + [eperm, allow]
    prog += [ins(JEQ, nr["setrlimit"], 0, len(check))] + check
    # prlimit64(pid, resource, new, old): only a non-NULL `new` sets anything
    new_limit_set = [ins(LD_ABS, arg(2)), ins(JEQ, 0, 0, 2), ins(LD_ABS, arg_high(2)), ins(JEQ, 0, 1, 0),
                     eperm, allow]
    check = _is_locked_limit(1, 0, len(new_limit_set) - 1) + new_limit_set
    prog += [ins(JEQ, nr["prlimit64"], 0, len(check) - 1)] + check
    return b"".join(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_program: ctypes.Array | None = None
_fprog: _SockFprog | None = None
_limits_program: ctypes.Array | None = None
_limits_fprog: _SockFprog | None = None


def _loadable(raw: bytes) -> tuple[ctypes.Array, _SockFprog]:
    """A program as prctl(PR_SET_SECCOMP) takes it (the buffer must live as long as the header)."""
    buffer = ctypes.create_string_buffer(raw, len(raw))
    return buffer, _SockFprog(len(raw) // 8, ctypes.addressof(buffer))


def prepare() -> bool:
    """Build both filters once (in the zygote); forkers and sandboxes inherit them ready to install."""
    global _program, _fprog, _limits_program, _limits_fprog
    raw, limits_raw = build_program(), build_limits_program()
    if raw is None or limits_raw is None:
        return False
    _program, _fprog = _loadable(raw)
    _limits_program, _limits_fprog = _loadable(limits_raw)
    return True


def available() -> bool:
    return _fprog is not None


def install() -> None:
    """No new privileges, then the filter: from here on it applies to this process (a forker)
    and every process it starts."""
    if prctl(PR_SET_NO_NEW_PRIVS, 1) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if _fprog is not None and prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(_fprog)) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def install_limits_filter() -> None:
    """Lock LOCKED_LIMITS for this process and all it starts (a sandbox, once it has set its
    call's limits; no new privileges is already set, by its forker's `install`). Small, so the
    kernel compiles it in microseconds per call."""
    if _limits_fprog is None:
        raise OSError(errno.ENOSYS, "the limits filter was not prepared")
    if prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(_limits_fprog)) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP (limits)")

"""Kernel isolation: namespaces and mounts, for the zygote (once) and for each sandbox.

Zygote-wide, set up once before anything is forked (`setup_zygote`):
* a network namespace with only a down loopback: no TCP/UDP connection leaves it;
* an IPC namespace: whatever System V or POSIX IPC object exists dies with the executor (model
  code cannot create any: see seccomp.py);
* a mount namespace in which every host mount is read-only (except /proc, /sys, the cgroup
  mounts and the device nodes), so no world-writable host directory (/var/tmp, /run/lock, ...)
  can keep a file; /tmp and /var/tmp are covered by empty root-owned tmpfs (a checkout or
  virtualenv below /tmp is bound back so that it stays importable), and the interpreter is made
  readable where it lives in a closed home directory (`expose_python_tree`).

Per sandbox, by the flags it is cloned with (see forker.py) and `mount_call_filesystems`:
* a PID namespace (the sandbox is its PID 1: everything it starts dies with it) with its own
  /proc, which shows the call's processes and nothing of the host;
* a mount namespace with two fresh size-limited tmpfs: its working directory (also HOME and
  TMPDIR) and /dev/shm. A call cannot fill another's space, and everything it wrote is gone
  with its last process: there is nothing to clean up.

Only the standard library is imported (the zygote loads this module).
"""
from __future__ import annotations

import ctypes
import os
import sys
import sysconfig

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 0x400, 0x800, 0x200000, 0x1000000
_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
# Left writable: kernel interfaces (writes need root or are per-process), device nodes.
KEEP_WRITABLE = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devtmpfs", "devpts"})
CALL_INODES = 65536  # files + directories per call tmpfs

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
_names = {name: ctypes.create_string_buffer(name.encode()) for name in ("rj-zygote", "rj-worker", "rj-forker", "rj-sandbox")}


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    """prctl(option, arg2, arg3, 0, 0); returns 0 or -1 (errno in ctypes.get_errno())."""
    return _prctl(option, arg2, arg3, 0, 0)


def set_process_name(name: str) -> None:
    """What `ps` and `top` show for this process: rj-zygote, rj-worker, rj-forker, rj-sandbox."""
    prctl(PR_SET_NAME, ctypes.addressof(_names[name]))


def libc_call(name: str, *args) -> int:
    """Call a libc function; returns 0 or the errno (never raises)."""
    rc = getattr(_libc, name)(*args)
    return 0 if rc == 0 else (ctypes.get_errno() or -1)


def mount(source: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes | None = None) -> int:
    return libc_call("mount", source, target.encode(), fstype, flags, data)


# --------------------------------------------------------------------------------------------
# zygote-wide


def setup_zygote(config: dict) -> dict:
    """Cut the network, privatise and freeze the file system view; report what the kernel allowed."""
    info = {"root": os.geteuid() == 0, "netns": False, "ipcns": False, "mountns": False, "private_tmp": False,
            "host_readonly": False}
    if not config.get("isolate", True):
        return info
    info["netns"] = libc_call("unshare", CLONE_NEWNET) == 0
    info["ipcns"] = libc_call("unshare", CLONE_NEWIPC) == 0
    if not (info["root"] and libc_call("unshare", CLONE_NEWNS) == 0):
        return info
    info["mountns"] = True
    if mount(b"none", "/", None, MS_REC | MS_PRIVATE) != 0:  # nothing we mount reaches the host
        return info
    ok = True
    for path, size in (("/tmp", config["tmp_bytes"]), ("/var/tmp", 1 << 20)):
        if os.path.isdir(path):
            keep = open_children_holding(path, code_roots())
            mounted = mount(b"tmpfs", path, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=%d,mode=0755" % size) == 0
            ok &= mounted and bind_back(path, keep)
    info["private_tmp"] = ok
    info["exposed"] = expose_python_tree()
    os.makedirs(config["workdir_root"], mode=0o755, exist_ok=True)  # each call mounts its own tmpfs here
    info["host_readonly"] = make_host_readonly(keep_writable=("/tmp",) if ok else ())
    return info


def _mountinfo() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, per-mount options) of every mount, in mount order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fields = left.split()
            point = fields[4].encode().decode("unicode_escape") if "\\" in fields[4] else fields[4]
            out.append((point, right.split()[0], set(fields[5].split(","))))
    return out


def make_host_readonly(keep_writable: tuple[str, ...] = ()) -> bool:
    """Bind-remount every mount of our namespace read-only (keeping its other flags), except
    kernel interfaces, device nodes and `keep_writable` (our own root-owned /tmp, where the
    workers make per-call directories when calls cannot have their own mounts). True when
    every one of them is read-only now."""
    ok = True
    for point, fstype, options in _mountinfo():
        if fstype in KEEP_WRITABLE or "ro" in options or point in keep_writable:
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for name in options:
            flags |= _MOUNT_FLAGS.get(name, 0)
        ok &= mount(None, point, None, flags) == 0
    return ok


def python_tree() -> list[str]:
    """Directories an unprivileged sandbox must be able to read to import and to run python."""
    paths = {sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        paths.add(sysconfig.get_paths()[key])
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    return sorted(os.path.realpath(p) for p in paths)


def code_roots() -> list[str]:
    """Where the code the sandboxes run lives: the Python tree and rstarjax's own checkout
    (an editable install is not on sys.path; its import hook points into the checkout)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return python_tree() + [os.path.realpath(package_root)]


def open_children_holding(mount_point: str, paths: list[str]) -> dict[str, int]:
    """O_PATH handles to the direct children of `mount_point` that contain any of `paths`,
    taken before a tmpfs covers `mount_point` (afterwards they are unreachable by name)."""
    prefix = os.path.realpath(mount_point).rstrip("/") + "/"
    children = {p[len(prefix):].split("/")[0] for p in paths if p.startswith(prefix)}
    return {c: os.open(prefix + c, os.O_PATH) for c in children if os.path.isdir(prefix + c)}


def bind_back(mount_point: str, handles: dict[str, int]) -> bool:
    """Bind-mount each held child back into the fresh tmpfs at `mount_point`."""
    ok = True
    for child, fd in handles.items():
        try:
            target = os.path.join(mount_point, child)
            os.mkdir(target, 0o755)
            ok &= mount(f"/proc/self/fd/{fd}".encode(), target, None, MS_BIND | MS_REC) == 0
        finally:
            os.close(fd)
    return ok


def first_closed_ancestor(path: str) -> str | None:
    """The outermost ancestor of `path` that others cannot traverse (mode lacks o+x)."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        try:
            if not os.stat(current).st_mode & 0o001:
                return current
        except OSError:
            return None
    return None


def expose_python_tree() -> list[str]:
    """In our private mount namespace, make the interpreter readable to the sandbox uid.

    Python often lives under a 0700 home (/root/.pyenv). We never change host permissions:
    instead a 0755 tmpfs covers the closed directory (hiding the rest of it, e.g. /root/.ssh,
    from sandboxes) and only the needed child directories are bind-mounted back into it.
    """
    plan: dict[str, set[str]] = {}
    for path in python_tree():
        closed = first_closed_ancestor(path)
        if closed is None or closed == path:
            continue
        child = path[len(closed) + 1 :].split("/")[0]
        plan.setdefault(closed, set()).add(child)
    exposed = []
    for closed, children in plan.items():
        handles = {c: os.open(os.path.join(closed, c), os.O_PATH) for c in children}
        if mount(b"tmpfs", closed, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755") != 0:
            for fd in handles.values():
                os.close(fd)
            continue
        if bind_back(closed, handles):
            exposed.extend(os.path.join(closed, c) for c in children)
    return exposed


def probe_unprivileged_imports(uid: int) -> bool:
    """Can `uid` read the standard library? (If not, dropping to it would break every import.)"""
    stdlib = sysconfig.get_paths()["stdlib"]
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.listdir(stdlib)
            with open(os.path.join(stdlib, "statistics.py"), "rb"):
                pass
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


# --------------------------------------------------------------------------------------------
# per sandbox (in the child, as root, before the uid drop)


def mount_call_filesystems(workdir: str, uid: int | None, disk_bytes: int, own_proc: bool) -> None:
    """In the sandbox's own mount namespace: /proc of its PID namespace, and fresh tmpfs for its
    working directory (owned by its uid) and /dev/shm. Raises OSError when the kernel refuses."""
    owner = b"" if uid is None else b",uid=%d,gid=%d" % (uid, uid)
    size = b"size=%d,nr_inodes=%d" % (disk_bytes, CALL_INODES)
    steps = [(b"tmpfs", workdir, b"tmpfs", MS_NOSUID | MS_NODEV, size + b",mode=0700" + owner),
             (b"tmpfs", "/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, size + b",mode=1777")]
    if own_proc:
        steps.append((b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None))
    for source, target, fstype, flags, data in steps:
        err = mount(source, target, fstype, flags, data)
        if err:
            raise OSError(err, f"mount {fstype.decode()} on {target}: {os.strerror(err)}")

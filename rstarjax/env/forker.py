"""The forker: the clean process image every sandbox of a slot is cloned from.

Why: a sandbox is a copy of the process it is forked from. A worker holds the calls it is
handling (code, stdin, outputs, and the gold answers of verifications), and freed leftovers of
earlier ones, so a fork of the worker let model code read them: a reward channel. Each worker
therefore forks, before it reads anything, one forker per slot. A forker never receives call
data: its only input is "clone a sandbox on these four fds" (the sandbox's stdout, stderr and
result pipes and its channel socket); the call reaches the sandbox afterwards, over that
channel (wire.send_call). Its memory is the worker's at start: the zygote's preloaded
libraries and nothing else. Verification runs in such sandboxes too, so the process holding
a gold answer (a worker) never forks anything model code runs in.

The forker clones with CLONE_PARENT: the sandbox is the worker's child, so the worker reaps it,
reads its exit status and gets its pidfd exactly as if it had forked it, while the fork itself
(page tables: the expensive part) happens in the forker, off the worker's event loop. It also
clones straight into the sandbox's PID and mount namespaces, inside the slot's cgroups and under
its seccomp filter (which the forker joined and installed once): nothing is moved per call.

Raw `clone` from Python: CPython's own fork hooks run around it (PyOS_BeforeFork /
PyOS_AfterFork_Child, as os.fork does: import lock, at-fork handlers, thread state), and
glibc's cached thread id in the child is set by the kernel (CLONE_CHILD_SETTID on the field
glibc's fork uses, found by `probe_tid_offset`), so the child is what os.fork would have made.
glibc's own pthread_atfork handlers do not run; the forker is single-threaded, so no lock they
would reset can be held.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import signal
import socket
import struct
import sys
import threading
import time

from rstarjax.env import cgroups, isolation, sandbox, seccomp
from rstarjax.env.isolation import CLONE_NEWNS, CLONE_NEWPID

CLONE_PARENT = 0x00008000
CLONE_CHILD_CLEARTID = 0x00200000
CLONE_CHILD_SETTID = 0x01000000
# syscall number of clone, and whether the child-tid pointer is its 4th (x86_64) or 5th argument
CLONE_SYSCALL = {"x86_64": (56, 3), "aarch64": (220, 4)}
REPLY = struct.Struct("=q")  # the new sandbox's pid, or -errno

_api = ctypes.pythonapi
_syscall = ctypes.PyDLL(None, use_errno=True).syscall  # PyDLL: the GIL stays held, as in os.fork
_syscall.restype = ctypes.c_long
_libc = ctypes.CDLL(None, use_errno=True)
_libc.pthread_self.restype = ctypes.c_void_p


def become_realtime() -> bool:
    """SCHED_FIFO at the lowest real-time priority, children reset to normal scheduling at fork
    (workers and forkers, where the kernel allows it).

    Why: a worker's loop is the dispatch path, and so is a forker's clone. Under the fair
    scheduler, even at nice -20, a worker lost the CPU several times per call to sandboxes and
    its neighbours and waited ~13 ms per call runnable but not running (/proc/<pid>/schedstat,
    2-core machine): the batches it had not read yet waited with it. As SCHED_FIFO it waits ~0.
    It is safe because neither ever spins (both block whenever they have nothing to start) and
    their CPU is a few ms per call; sandboxes never inherit it (SCHED_RESET_ON_FORK) and cannot
    ask for it (unprivileged, no RLIMIT_RTPRIO); the kernel's RT throttling bounds it anyway."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
    except (OSError, AttributeError):  # unprivileged, or a container without an RT budget
        return False
    return True


def probe_tid_offset() -> int | None:
    """Offset of glibc's cached thread id in its thread descriptor (pthread_self()): the int
    equal to the caller's tid, at the same offset in two threads. None if not unique."""

    def candidates() -> set[int]:
        base, tid = _libc.pthread_self(), threading.get_native_id()
        words = (ctypes.c_int32 * 512).from_address(base)
        return {4 * i for i, word in enumerate(words) if word == tid}

    found = {}
    thread = threading.Thread(target=lambda: found.setdefault("thread", candidates()))
    thread.start()
    thread.join()
    wait_thread_gone(thread.native_id)
    both = candidates() & found.get("thread", set())
    return both.pop() if len(both) == 1 else None


def wait_thread_gone(tid: int | None, timeout_s: float = 2.0) -> None:
    """Until the OS thread ``tid`` of this process has ended (``join`` returns before it has:
    the thread still runs glibc's exit, which takes allocator locks). A raw ``clone`` while
    it runs can copy a held lock into the child, whose first allocation then waits forever:
    the likely cause of a zygote probe child that hung in its start-up once, in a CI run."""
    deadline = time.monotonic() + timeout_s
    while tid is not None and os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
        time.sleep(0.001)


def exited_ok(pid: int, timeout_s: float) -> bool | None:
    """Wait for child ``pid``: whether it exited with status 0, or None when it was still
    running after ``timeout_s`` (then it is killed and reaped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def clone_flags(host: dict) -> int:
    """The namespaces every sandbox is cloned into, as far as the probes allowed (`host`: what
    the zygote found, see CodeExecutor.isolation)."""
    flags = 0
    if host.get("pidns"):
        flags |= CLONE_NEWPID
    if host.get("call_mounts"):
        flags |= CLONE_NEWNS
    return flags


def clone(flags: int, tid_offset: int | None, sibling: bool = True) -> int:
    """fork() with extra clone flags; with `sibling`, the child is the caller's parent's child.
    Returns 0 in the child, the child's pid in the caller; raises OSError."""
    nr, ctid_arg = CLONE_SYSCALL[platform.machine()]
    args = [ctypes.c_long(0)] * 5
    flags |= signal.SIGCHLD | (CLONE_PARENT if sibling else 0)
    if tid_offset is not None:
        flags |= CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID
        args[ctid_arg] = ctypes.c_long(_libc.pthread_self() + tid_offset)
    args[0] = ctypes.c_long(flags)
    _api.PyOS_BeforeFork()
    pid = _syscall(ctypes.c_long(nr), *args)
    if pid == 0:
        _api.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    _api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


def supported() -> bool:
    return platform.machine() in CLONE_SYSCALL


def probe_clone_flags(flags: int, tid_offset: int | None, timeout_s: float = 10.0) -> bool:
    """Can this process clone a child into these namespaces? (A throwaway child, which exits at
    once; one that has not within ``timeout_s`` is killed and the probe tried once more, so a
    child stuck in its start-up can neither hang the zygote nor outlive it.)"""
    for _ in range(2):
        try:
            pid = clone(flags, tid_offset, sibling=False)
        except OSError:
            return False
        if pid == 0:
            os._exit(0)
        ok = exited_ok(pid, timeout_s)
        if ok is not None:
            return ok
    return False


def serve(ctl: socket.socket, worker_pid: int, confinement: "sandbox.Confinement", limits: "sandbox.SandboxLimits",
          flags: int, tid_offset: int | None, cgroup_dirs: list[str], realtime: bool, filtered: bool) -> None:
    """A forker's life: join the slot's cgroups, install the seccomp filter (with `filtered`;
    every sandbox inherits it), then clone one sandbox per request. Never returns; exits when
    its worker closes the control socket or dies.

    A request is the sandbox's working directory (the same mount point for every call when
    calls have their own mounts) and its four fds; the reply is the pid (or -errno)."""
    status = 0
    try:
        isolation.set_process_name("rj-forker")
        sandbox.set_parent_death_signal()  # cleared by fork; then make sure the worker still exists
        if os.getppid() != worker_pid:
            return
        cgroups.join(cgroup_dirs)
        if realtime:
            become_realtime()
        if filtered:
            seccomp.install()
        while True:
            msg, fds, _, _ = socket.recv_fds(ctl, 4096, 4)
            if not msg:
                return
            if len(fds) != 4:  # never from our worker; ignore rather than guess
                for fd in fds:
                    os.close(fd)
                continue
            try:
                pid = clone(flags, tid_offset)
            except OSError as exc:
                pid = -(exc.errno or 1)
            if pid == 0:
                ctl.close()
                own = dataclasses.replace(confinement, workdir=msg.decode())
                sandbox.child_main(limits, own, dict(zip(("stdout", "stderr", "result", "channel"), fds)))
            for fd in fds:
                os.close(fd)
            ctl.send(REPLY.pack(pid))
    except BaseException:  # noqa: BLE001 - a forker that fails ends; its worker sees EOF and ends too
        status = 1
    finally:
        os._exit(status)


def _no_repair(*args, **kwargs) -> None:
    return None


def skip_threading_fork_repair() -> bool:
    """In a worker, before its forkers exist: make `threading`'s after-fork handler a no-op for
    the sandboxes they clone.

    Why: CPython runs that handler in every forked child; it rebuilds the registry of threads
    and its locks and costs a sandbox about 70 copy-on-write page faults (~0.3 ms of the ~6 ms
    of CPU a trivial call costs on 2 cores). A forker runs one thread and holds none of those
    locks when it clones, so what a sandbox inherits is already what the handler would rebuild.
    Checked, not assumed: the process must have one thread, and a forked probe must find itself
    the main thread and be able to start and join a thread; otherwise the handler is restored.
    Only on CPython 3.11, whose handler this reasoning was checked against."""
    if sys.version_info[:2] != (3, 11) or threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        return False
    handler = getattr(threading, "_after_fork", None)
    if handler is None or handler.__code__.co_freevars:
        return False
    original = handler.__code__
    handler.__code__ = _no_repair.__code__
    pid = os.fork()
    if pid == 0:
        ok = threading.current_thread() is threading.main_thread() and threading.active_count() == 1
        thread = threading.Thread(target=_no_repair)
        thread.start()
        thread.join(5)
        os._exit(0 if ok and not thread.is_alive() and threading.active_count() == 1 else 1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        handler.__code__ = original
        return False
    return True

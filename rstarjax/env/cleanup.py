"""Removing what sandboxes leave behind, by both halves of the pool.

After each call, in the worker (``worker.py``), where the sandbox had no PID namespace or no
private mounts: the call's directory tree (``remove_tree``: any depth), the processes of its
uid (``sweep_uid``) or, without a uid drop either, whatever was re-parented to the worker
(``kill_orphans``), and its files in the shared /dev/shm (``sweep_shm``).

Around a whole pool, in the trainer (``executor.py``): every process left under its uid range
at ``close`` (``kill_uid_range``), and at start the scratch directories of executors killed
before their ``close`` (``remove_stale_sandbox_dirs``).

Only the standard library is imported (the zygote loads this module through the worker).
"""
from __future__ import annotations

import os
import signal
import tempfile
import time

# ---- after each call (the worker) ------------------------------------------------------------
def remove_tree(path: str) -> None:
    """Remove a directory tree of any depth, without recursion and without long paths: each
    subdirectory is first moved up next to the others, so every directory is emptied at depth
    one. (A hostile call can build a tree deeper than Python's recursion limit or PATH_MAX.)"""
    try:
        os.rmdir(path)  # the usual case: the call left nothing behind
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    counter = 0
    try:
        pending: list[str | None] = [None]  # None: `path` itself; else a name inside it
        while pending:
            name = pending.pop()
            try:
                fd = top if name is None else os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
            except OSError:
                continue
            try:
                for entry in os.scandir(fd):
                    try:
                        if not entry.is_dir(follow_symlinks=False):
                            os.unlink(entry.name, dir_fd=fd)
                        elif name is None:
                            pending.append(entry.name)
                        else:
                            while True:
                                counter += 1
                                moved = f".removing-{counter}"
                                try:
                                    os.stat(moved, dir_fd=top, follow_symlinks=False)
                                except FileNotFoundError:
                                    break
                            os.rename(entry.name, moved, src_dir_fd=fd, dst_dir_fd=top)
                            pending.append(moved)
                    except OSError:
                        pass
            finally:
                if fd != top:
                    os.close(fd)
            if name is not None:
                try:
                    os.rmdir(name, dir_fd=top)
                except OSError:
                    pass
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        pass


def sweep_uid(uid: int | None) -> None:
    """Without a PID namespace: kill whatever a call of ``uid`` left behind (double forks,
    setsid), from a fork that takes that uid (a kill(-1) as ``uid`` reaches only its processes)."""
    if uid is None:
        return
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def sweep_shm(uid: int | None) -> None:
    """Without call mounts: remove what ``uid`` left in the shared /dev/shm."""
    if uid is None:
        return
    try:
        with os.scandir("/dev/shm") as entries:
            for entry in entries:
                try:
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        if entry.is_dir(follow_symlinks=False):
                            remove_tree(entry.path)
                        else:
                            os.unlink(entry.path)
                except OSError:
                    pass
    except OSError:
        pass


def kill_orphans(keep: set[int]) -> None:
    """Weakest fallback (no PID namespace, no uid drop): the calling worker is a child
    subreaper, so what a call double-forked away is re-parented to it. Kill every child of this
    process whose pid is not in ``keep`` (its forkers and live sandboxes). (A daemon of a call
    still running in another slot dies early: acceptable.)"""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in keep:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me:
            try:
                os.kill(int(entry), signal.SIGKILL)
                os.waitpid(int(entry), 0)
            except (ProcessLookupError, ChildProcessError):
                pass


# ---- around a pool (the trainer) ------------------------------------------------------------
def kill_uid_range(base: int, count: int, timeout: float = 5.0) -> None:
    """SIGKILL every process whose real uid is in [base, base + count) until none is left (one
    may still be forking when the first signal lands). Needs root."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
            except (OSError, StopIteration, ValueError):
                continue
            if base <= uid < base + count:
                found = True
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if not found:
            return
        time.sleep(0.01)


SANDBOX_DIR_PREFIX = "rstarjax-sandbox-"


def _live_command_lines() -> list[bytes]:
    """The command lines of the processes this user may read (``/proc/PID/cmdline``)."""
    lines = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    lines.append(f.read())
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return lines


def remove_stale_sandbox_dirs(root: str | None = None) -> list[str]:
    """Remove the sandbox directories (``rstarjax-sandbox-*`` in ``root``, default the temp
    directory) that executors killed before their ``close`` left behind; return them.

    Stale means: ours, empty (the sandboxes' files live in the zygote's private /tmp), and named
    by no live process: every executor's zygote has its directory on its command line for its
    whole life, so a live executor's directory, of this version or an older one, is never
    taken. Removing an empty directory that an executor created a moment ago but has not yet
    handed to its zygote is harmless: the zygote makes it again (``os.makedirs``)."""
    root = root or tempfile.gettempdir()
    try:
        candidates = [os.path.join(root, n) for n in os.listdir(root) if n.startswith(SANDBOX_DIR_PREFIX)]
    except OSError:
        return []
    if not candidates:
        return []
    in_use = b"\0".join(_live_command_lines())
    removed = []
    for path in candidates:
        try:
            if (os.stat(path).st_uid != os.geteuid() or not os.path.isdir(path) or os.listdir(path)
                    or path.encode() in in_use):
                continue
            os.rmdir(path)  # fails, harmlessly, if something was put in it meanwhile
        except OSError:
            continue
        removed.append(path)
    return removed

"""The zygote and its execution workers (run as a separate, clean interpreter).

Process tree (pool.py starts the zygote with `python zygote.py CONFIG_JSON`):

    trainer (CodeExecutor)                         root PID namespace, untouched
      zygote      numpy/sympy/scipy/math_verify imported once; own network + mount namespace
        worker i  forked from the zygote on request; an event loop running <= `slots` sandboxes
          sandbox forked per call; PID 1 of a fresh PID namespace; unprivileged uid per slot

Why a separate interpreter rather than a fork of the trainer: the trainer has JAX threads (fork
after threads is unsafe) and its environment holds secrets. The zygote starts from a scrubbed
environment and never imports jax.

Wire format everywhere: 4-byte big-endian length + UTF-8 JSON. Nothing is unpickled: sandboxes
are hostile and a worker runs as root.
"""
from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
import time

HEADER = struct.Struct(">I")
# Re-warming a slot waits for this much quiet unless a call needs the sandbox now: at low
# concurrency the next call (sent as soon as the previous answer arrives) then finds a warm
# sandbox and is read at once, instead of waiting behind the fork that re-warms the slot.
WARM_WHEN_QUIET_S = 0.005
MAX_FRAME = 256 << 20
MAX_RESULT_BYTES = 4 << 20  # the child's JSON line on fd 3


def _bootstrap_package() -> None:
    """Import rstarjax.env.* without running rstarjax/__init__.py (which may import jax)."""
    import types

    env_dir = os.path.dirname(os.path.abspath(__file__))
    pkg_dir = os.path.dirname(env_dir)
    for name, path in (("rstarjax", pkg_dir), ("rstarjax.env", env_dir)):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [path]
            sys.modules[name] = module


# --------------------------------------------------------------------------------------------
# framing


def send_frame(sock: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(HEADER.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket):
    header = recv_exact(sock, HEADER.size)
    if header is None:
        return None
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    body = recv_exact(sock, n)
    if body is None:
        return None
    return json.loads(body)


class FrameReader:
    """Incremental decoder for a non-blocking socket."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> list:
        self.buf += data
        out = []
        while len(self.buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
            if len(self.buf) < HEADER.size + n:
                break
            out.append(json.loads(bytes(self.buf[HEADER.size : HEADER.size + n])))
            del self.buf[: HEADER.size + n]
        return out


# --------------------------------------------------------------------------------------------
# capped output capture


class CappedBuffer:
    """Keeps the first and last `cap // 2` bytes of a stream; counts what it drops."""

    def __init__(self, cap: int):
        self.half = max(cap // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            excess = len(self.tail) - self.half
            if excess > 0:
                self.dropped += excess
                del self.tail[:excess]

    def text(self) -> str:
        head = bytes(self.head).decode("utf-8", errors="replace")
        tail = bytes(self.tail).decode("utf-8", errors="replace")
        if self.dropped:
            return f"{head}\n... [{self.dropped} bytes truncated] ...\n{tail}"
        return head + tail


# --------------------------------------------------------------------------------------------
# isolation probing (in the zygote, once)


def setup_zygote_isolation(config: dict) -> dict:
    """Cut the network and give sandboxes a private /tmp; report what the kernel allowed."""
    from rstarjax.env import sandbox

    info = {"root": os.geteuid() == 0, "netns": False, "mountns": False, "private_tmp": False}
    if not config.get("isolate", True):
        return info
    # Network: a fresh namespace holds only a down loopback -> no connection succeeds. The
    # zygote talks to the trainer over inherited socketpairs, which do not need a network.
    info["netns"] = sandbox.libc_call("unshare", sandbox.CLONE_NEWNET) == 0
    if info["root"] and sandbox.libc_call("unshare", sandbox.CLONE_NEWNS) == 0:
        info["mountns"] = True
        # Make every mount private so nothing we mount propagates to the host.
        if sandbox.libc_call("mount", b"none", b"/", None, sandbox.MS_REC | sandbox.MS_PRIVATE, None) == 0:
            ok = True
            # /tmp and /var/tmp are not writable by sandboxes (they get a fresh per-call
            # directory as cwd, HOME and TMPDIR), so no call can fill them for the next one;
            # /dev/shm stays world-writable (multiprocessing needs it), small, and is swept
            # after every call.
            for path, mode, size in ((b"/tmp", b"0755", config["tmpfs_bytes"]), (b"/var/tmp", b"0755", 1 << 20),
                                     (b"/dev/shm", b"1777", 64 << 20)):
                if os.path.isdir(path):
                    # A checkout or virtualenv under /tmp (CI clones, say) must stay importable.
                    keep = open_children_holding(path.decode(), code_roots())
                    opts = b"size=%d,mode=%s" % (size, mode)
                    flags = sandbox.MS_NOSUID | sandbox.MS_NODEV
                    mounted = sandbox.libc_call("mount", b"tmpfs", path, b"tmpfs", flags, opts) == 0
                    ok &= mounted and bind_back(path.decode(), keep)
            info["private_tmp"] = ok
        info["exposed"] = expose_python_tree()
    return info


def python_tree() -> list[str]:
    """Directories an unprivileged sandbox must be able to read to import and to run python."""
    import sysconfig

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
    from rstarjax.env import sandbox

    ok = True
    for child, fd in handles.items():
        try:
            target = os.path.join(mount_point, child)
            os.mkdir(target, 0o755)
            ok &= sandbox.libc_call("mount", f"/proc/self/fd/{fd}".encode(), target.encode(), None,
                                    sandbox.MS_BIND | sandbox.MS_REC, None) == 0
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
    from rstarjax.env import sandbox

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
        try:
            if sandbox.libc_call("mount", b"tmpfs", closed.encode(), b"tmpfs", sandbox.MS_NOSUID | sandbox.MS_NODEV,
                                 b"size=1m,mode=0755") != 0:
                continue
            for child, fd in handles.items():
                target = os.path.join(closed, child)
                os.mkdir(target, 0o755)
                if sandbox.libc_call("mount", f"/proc/self/fd/{fd}".encode(), target.encode(), None,
                                     sandbox.MS_BIND | sandbox.MS_REC, None) == 0:
                    exposed.append(target)
        finally:
            for fd in handles.values():
                os.close(fd)
    return exposed


def probe_unprivileged_imports(uid: int) -> bool:
    """Can `uid` read the standard library? (If not, dropping to it would break every import.)"""
    import sysconfig

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


def become_realtime() -> bool:
    """SCHED_FIFO at the lowest real-time priority, children reset to normal scheduling at fork.

    Why: a worker's loop is the dispatch path, and it forks (3-4 ms of CPU for the heavy zygote).
    Under the fair scheduler, even at nice -20, it lost the CPU about three times per call to
    the children it had just forked and to its neighbours, and waited ~13 ms per call runnable
    but not running (/proc/<pid>/schedstat, 2-core machine): the batches it had not read yet
    waited with it. As SCHED_FIFO it waits ~0 (p99 dispatch overhead at 1,000 queued: 41 ->
    16 ms for sympy calls on a loaded machine). It is safe because the loop never spins (it
    blocks in epoll whenever it has nothing to start) and its CPU is a few ms per call;
    sandboxes never inherit it (SCHED_RESET_ON_FORK) and cannot ask for it (unprivileged, no
    RLIMIT_RTPRIO); the kernel's RT throttling bounds it in any case."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
    except (OSError, AttributeError):  # unprivileged, or a container without an RT budget
        return False
    return True


def probe_realtime() -> bool:
    """Can a worker become real-time here? (Tried in a throwaway child: the zygote stays as is.)"""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if become_realtime() else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25


def collapse_heap() -> int:
    """Move the anonymous writable memory (the preloaded heap) onto transparent huge pages, in
    place (MADV_COLLAPSE, Linux >= 6.1); return how many bytes now sit on huge pages.

    Why: a sandbox is a fork of this heap, and on this kind of machine the fork and the exit
    were most of a call's CPU (copying and then unmapping one page-table entry per 4 KiB page,
    with memcg accounting each). A huge page is one entry. Pages a process writes after the fork
    are still copied 4 KiB at a time (the kernel splits the huge mapping in that process only),
    so memory use does not grow. Where the kernel refuses (older kernels, THP "never"), nothing
    changes."""
    from rstarjax.env import sandbox

    done = 0
    try:
        with open("/proc/self/maps") as maps:
            regions = [line.split() for line in maps]
    except OSError:
        return 0
    for fields in regions:
        perms, path = fields[1], (fields[5] if len(fields) > 5 else "")
        if perms != "rw-p" or path not in ("", "[heap]"):  # anonymous, private, writable
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        lo = (lo + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        hi &= ~(HUGE_PAGE - 1)
        if hi <= lo:
            continue
        start, length = ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo)
        sandbox.libc_call("madvise", start, length, MADV_HUGEPAGE)  # khugepaged's later work goes here too
        if sandbox.libc_call("madvise", start, length, MADV_COLLAPSE) == 0:
            done += hi - lo
    return done


def probe_pidns() -> bool:
    from rstarjax.env import sandbox

    pid = os.fork()
    if pid == 0:
        ok = sandbox.libc_call("unshare", sandbox.CLONE_NEWPID) == 0
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


# --------------------------------------------------------------------------------------------
# the worker: an event loop over <= slots sandboxes


class Running:
    """One sandbox process. Warm (forked ahead of need, waiting for a call: `call` is None) or
    running its call."""

    __slots__ = (
        "call", "pid", "pidfd", "slot", "workdir", "channel", "stdout", "stderr", "result", "fds", "deadline",
        "t_recv", "t_start", "timed_out", "replied", "done",
    )


class Worker:
    """An event loop over <= `slots` sandboxes.

    Forking (about 3 ms of the heavy zygote's page tables, several times that on a busy machine)
    blocks the loop, so each pass forks at most once and then reads its socket and its
    sandboxes' exits again: a batch waits for one fork at most, not for a slot-full of them.
    * A call that waits for a slot gets a cold start: the fork carries the call along.
    * A slot that frees while no call waits gets, once the loop is quiet, a warm sandbox: a child
      forked ahead of need that did its setup and waits on a socket for its call. At low
      concurrency the next call then starts with two fds sent over that socket (microseconds)
      instead of a fork. (Under saturation warm sandboxes would only add a hand-over, and keep
      more children sharing the worker's pages, i.e. more copy-on-write faults for the worker.)
    """

    def __init__(self, sock: socket.socket, index: int, config: dict, isolation: dict):
        from rstarjax.env import sandbox

        self.sandbox = sandbox
        self.sock = sock
        self.index = index
        self.config = config
        self.isolation = isolation
        self.limits = sandbox.SandboxLimits(**config["limits"])
        self.slots = int(config["slots"])
        self.cold_slots = list(range(self.slots))  # no process: to be warmed
        self.warm: collections.deque[Running] = collections.deque()
        self.pending: collections.deque = collections.deque()
        self.running: dict[int, Running] = {}  # every sandbox process, warm or busy, by pidfd
        self.warm_failures = 0  # warm sandboxes that died before their call, in a row
        self.warm_not_before = 0.0  # back-off after such a death
        self.last_busy = 0.0  # when select last returned something
        self.sel = selectors.DefaultSelector()
        self.reader = FrameReader()
        self.workdir_root = os.path.join(config["workdir_root"], f"w{index}")
        self.counter = 0
        self.use_pidns = isolation["pidns"]
        self.own_pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY) if self.use_pidns else -1
        self.uid_drop = isolation["uid_drop"]

    def slot_uid(self, slot: int) -> int | None:
        if not self.uid_drop:
            return None
        return int(self.config["uid_base"]) + self.index * self.slots + slot

    def serve(self) -> None:
        shutil.rmtree(self.workdir_root, ignore_errors=True)  # leftovers of a killed predecessor
        os.makedirs(self.workdir_root, mode=0o711)
        self.sock.setblocking(True)  # replies wait for room; reads never block (MSG_DONTWAIT)
        self.sel.register(self.sock, selectors.EVENT_READ, ("parent", None))
        while True:
            events = self.sel.select(self._select_timeout())
            if events:
                self.last_busy = time.monotonic()
            for key, _ in events:
                what, run = key.data
                if what == "parent":
                    if not self._read_parent():
                        return
                elif run.done:
                    # Finished earlier in this same batch (epoll may list a sandbox's exit before
                    # the EOF of its pipes): its fds are closed and unregistered already.
                    continue
                elif what == "exit":
                    self._finish(run)
                else:
                    self._drain(key.fileobj, run, what)
            self._enforce_deadlines()
            self._start_pending()
            self._fill_one_slot()  # one fork, then back to select: a batch never waits for more

    def _select_timeout(self) -> float | None:
        if self.pending and (self.warm or self.cold_slots):  # a call can start: no sleeping
            return 0.0
        now = time.monotonic()
        wake = [r.deadline for r in self.running.values() if r.call is not None and not r.timed_out]
        if self.cold_slots:
            wake.append(self._warm_due())
        return min(max(0.0, min(wake) - now), 1.0) if wake else None  # bounded, whatever the inputs

    def _warm_due(self) -> float:
        """When a cold slot with no call for it should get a warm sandbox: once the loop has been
        quiet for WARM_WHEN_QUIET_S, and never before a failure's back-off."""
        return max(self.last_busy + WARM_WHEN_QUIET_S, self.warm_not_before)

    # -- parent messages -------------------------------------------------------------------
    def _read_parent(self) -> bool:
        try:
            data = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        now = time.monotonic()
        for msg in self.reader.feed(data):
            if msg.get("op") == "batch":
                for call in msg["calls"]:
                    call["t_recv"] = now
                    self.pending.append(call)
            elif msg.get("op") == "exit":
                return False
        return True

    def _reply(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.sock.sendall(HEADER.pack(len(data)) + data)

    # -- sandbox lifecycle -----------------------------------------------------------------
    def _fill_one_slot(self) -> None:
        """At most one fork per pass of the loop: for a call that waits (a cold start: the call
        rides along in the fork, as cheap as it gets when calls queue up anyway), or, once the
        loop is quiet, a warm sandbox that the next call will find ready."""
        if not self.cold_slots:
            return
        call = self.pending.popleft() if self.pending else None
        if call is None and time.monotonic() < self._warm_due():
            return
        slot = self.cold_slots.pop()
        opened: list[int] = []
        try:
            self._spawn(slot, opened, call)
        except OSError as exc:  # e.g. no memory/pids/space left: answer, keep serving
            for fd in opened:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.cold_slots.append(slot)
            if call is not None:
                self._reply_start_failure(call, exc)
            else:
                self._warm_failed()

    def _warm_failed(self) -> None:
        """A warm sandbox could not be made, or died before its call: back off (warming is an
        optimisation; calls that wait get cold starts, which answer their own failures)."""
        self.warm_failures += 1
        self.warm_not_before = time.monotonic() + min(0.005 * 2 ** self.warm_failures, 1.0)

    def _spawn(self, slot: int, opened: list, call: dict | None) -> None:
        """Fork the sandbox of `slot`: cold with `call`, or warm (call None) waiting on a socket."""
        sandbox = self.sandbox
        uid = self.slot_uid(slot)
        self.counter += 1
        workdir = os.path.join(self.workdir_root, f"c{self.counter}")
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)
        out_r, out_w = os.pipe()
        opened += [out_r, out_w]
        err_r, err_w = os.pipe()
        opened += [err_r, err_w]
        res_r, res_w = os.pipe()
        opened += [res_r, res_w]
        fds = {"stdout": out_w, "stderr": err_w, "result": res_w}
        ours = None
        if call is None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # `ours` closes itself if we fail
            fds["channel"] = theirs.detach()
        else:
            fds["stdin"] = self._memfd("stdin", (call.get("stdin") or "").encode("utf-8", errors="replace"))
        opened.append(fds.get("channel", fds.get("stdin")))
        t_start = time.monotonic()
        if self.use_pidns:
            sandbox.libc_call("unshare", sandbox.CLONE_NEWPID)  # the next child is PID 1 of a new ns
        try:
            pid = os.fork()
        finally:
            if self.use_pidns and os.getpid() != 1:
                sandbox.libc_call("setns", self.own_pidns_fd, sandbox.CLONE_NEWPID)  # back, for the next unshare
        if pid == 0:
            try:
                sandbox.child_main(self.limits, workdir, uid, fds, call)
            finally:
                os._exit(71)
        for name in ("stdout", "stderr", "result", "channel", "stdin"):
            if name in fds:
                os.close(fds[name])
                opened.remove(fds[name])
        run = Running()
        run.call, run.pid, run.slot, run.workdir, run.channel = call, pid, slot, workdir, ours
        try:
            run.pidfd = os.pidfd_open(pid)
        except OSError:
            os.kill(pid, signal.SIGKILL)  # a child we cannot watch must not live on
            os.waitpid(pid, 0)
            raise
        cap = self.limits.max_output_bytes
        run.stdout, run.stderr, run.result = CappedBuffer(cap), CappedBuffer(cap), bytearray()
        run.fds = {}
        run.timed_out = run.replied = run.done = False
        if call is not None:
            self._started(run, call, t_start)  # the fork counts as the sandbox's time, as always
        for name, fd in (("stdout", out_r), ("stderr", err_r), ("result", res_r)):
            os.set_blocking(fd, False)
            run.fds[name] = fd
            self.sel.register(fd, selectors.EVENT_READ, (name, run))
        opened.clear()  # owned by `run` from here on
        self.sel.register(run.pidfd, selectors.EVENT_READ, ("exit", run))
        self.running[run.pidfd] = run
        if call is None:
            ours.setblocking(False)  # one byte into an empty socket never blocks; be sure anyway
            self.warm.append(run)

    def _start_pending(self) -> None:
        """Hand waiting calls to warm sandboxes: two memfds over a socket, no fork."""
        while self.pending and self.warm:
            call, run = self.pending.popleft(), self.warm.popleft()
            fds = []
            try:
                fds.append(self._memfd("call", json.dumps({k: v for k, v in call.items() if k != "stdin"}).encode()))
                fds.append(self._memfd("stdin", (call.get("stdin") or "").encode("utf-8", errors="replace")))
                socket.send_fds(run.channel, [b"c"], fds)
            except OSError:
                # No memory for a memfd, or the warm sandbox is gone (its exit event cleans up):
                # the call goes back to the head of the line, and this sandbox is not used again.
                self.pending.appendleft(call)
                self._kill(run)
                self._close_channel(run)
                continue
            finally:
                for fd in fds:
                    os.close(fd)
            self._close_channel(run)  # the child has its call queued; we have nothing more to say
            self.warm_failures = 0
            self._started(run, call, time.monotonic())

    @staticmethod
    def _started(run: Running, call: dict, t_start: float) -> None:
        run.call = call
        run.t_start = t_start
        run.t_recv = call.get("t_recv", t_start)
        run.deadline = t_start + float(call["timeout"])

    @staticmethod
    def _memfd(name: str, data: bytes) -> int:
        """`data` in a rewound memfd: any size, and no pipe to fill (a child reads it at leisure)."""
        fd = os.memfd_create(name, 0)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.lseek(fd, 0, os.SEEK_SET)
        except OSError:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _close_channel(run: Running) -> None:
        if run.channel is not None:
            run.channel.close()
            run.channel = None

    def _reply_start_failure(self, call: dict, exc: BaseException | str) -> None:
        now = time.monotonic()
        reply = {"id": call["id"], "t_recv": call.get("t_recv", now), "t_start": now, "t_end": now, "t_sent": now}
        if call["op"] == "verify":
            reply.update(op="verify", correct=False, timed_out=False, error=f"could not start the verifier: {exc}")
        else:
            reply.update(kind="error", text=f"SandboxError: could not start the sandbox: {exc}", infra_error=True)
        self._reply(reply)

    def _drain(self, fd: int, run: Running, what: str) -> None:
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.sel.unregister(fd)
                os.close(fd)
                run.fds.pop(what, None)
                return
            if what == "result":
                if len(run.result) < MAX_RESULT_BYTES:
                    run.result += data[: MAX_RESULT_BYTES - len(run.result)]
            else:
                getattr(run, what).add(data)
            if len(data) < (1 << 16):
                return

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for run in self.running.values():
            if run.call is not None and not run.timed_out and now >= run.deadline:
                run.timed_out = True
                self._kill(run)
                # Answer now: the verdict is known, and tearing down a big process tree (a fork
                # bomb of 64 copies of a 100 MB interpreter) can take a second on a busy machine.
                # The slot stays taken until the process is really gone.
                for what, fd in list(run.fds.items()):
                    if what != "result":
                        self._drain(fd, run, what)
                self._send_result(run, 0, now)

    def _kill(self, run: Running) -> None:
        try:
            signal.pidfd_send_signal(run.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not self.use_pidns:
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _sweep_uid(self, uid: int | None) -> None:
        """Without a PID namespace: kill whatever the call left behind (double forks, setsid)."""
        if uid is None:
            return
        pid = os.fork()
        if pid == 0:
            try:
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)  # as `uid`: reaches only that uid's processes
            finally:
                os._exit(0)
        os.waitpid(pid, 0)

    @staticmethod
    def _sweep_shm(uid: int | None) -> None:
        """Remove what the slot's uid left in /dev/shm (usually nothing: one cheap scandir)."""
        if uid is None:
            return
        try:
            with os.scandir("/dev/shm") as entries:
                for entry in entries:
                    try:
                        if entry.stat(follow_symlinks=False).st_uid == uid:
                            if entry.is_dir(follow_symlinks=False):
                                shutil.rmtree(entry.path, ignore_errors=True)
                            else:
                                os.unlink(entry.path)
                    except OSError:
                        pass
        except OSError:
            pass

    def _kill_orphans(self) -> None:
        """Weakest fallback (no PID namespace, no uid drop): we are a child subreaper, so what a
        call double-forked away is re-parented to us. Kill every child that is not a sandbox
        (warm or running). (A daemon of a call still running in another slot dies early:
        acceptable.)"""
        me = os.getpid()
        live = {r.pid for r in self.running.values()}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in live:
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

    def _finish(self, run: Running) -> None:
        run.done = True
        _, status = os.waitpid(run.pid, 0)
        t_end = time.monotonic()
        # The sandbox (PID 1 of its namespace) is gone and the kernel killed everything it left;
        # whatever it wrote is already in the pipes.
        for what, fd in list(run.fds.items()):
            self._drain(fd, run, what)
            if what in run.fds:
                self.sel.unregister(fd)
                os.close(fd)
        self.sel.unregister(run.pidfd)
        os.close(run.pidfd)
        del self.running[run.pidfd]
        self._close_channel(run)
        if run.call is None:  # died warm (killed from outside, or its setup failed)
            if run in self.warm:
                self.warm.remove(run)
            self._warm_failed()
        elif not run.replied:
            self._send_result(run, status, t_end)  # answer first; cleaning up is our business
        if not self.use_pidns:
            if self.uid_drop:
                self._sweep_uid(self.slot_uid(run.slot))
            else:
                self._kill_orphans()
        self._remove_workdir(run.workdir)
        self._sweep_shm(self.slot_uid(run.slot))
        self.cold_slots.append(run.slot)  # the slot (and its uid) is re-warmed only once clean

    @staticmethod
    def _remove_workdir(path: str) -> None:
        try:
            os.rmdir(path)  # the usual case: the call left nothing behind
        except OSError:
            shutil.rmtree(path, ignore_errors=True)

    def _send_result(self, run: Running, status: int, t_end: float) -> None:
        reply = self._classify(run, status)
        reply.update(id=run.call["id"], t_recv=run.t_recv, t_start=run.t_start, t_end=t_end, t_sent=time.monotonic())
        run.replied = True
        self._reply(reply)

    def _classify(self, run: Running, status: int) -> dict:
        """Turn raw process outcome + streams into one of the four result kinds."""
        call = run.call
        stdout = run.stdout.text()
        stderr = self.sandbox.scrub_paths(run.stderr.text(), run.workdir)
        limit = call["timeout"]
        duration = time.monotonic() - run.t_start
        if run.timed_out:
            if call["op"] == "verify":
                return {"op": "verify", "correct": False, "timed_out": True, "error": f"verifier exceeded {limit:g} s"}
            msg = f"TimeoutError: execution exceeded the {limit:g} s time limit"
            text = f"{stdout.rstrip()}\n{msg}" if stdout.strip() else msg
            return {"kind": "timeout", "text": text, "duration_s": duration}
        payload = None
        if run.result:
            try:
                payload = json.loads(bytes(run.result).split(b"\n", 1)[0])
                if not isinstance(payload, dict):
                    payload = None
            except ValueError:
                payload = None
        code = os.waitstatus_to_exitcode(status)
        if call["op"] == "verify":
            if payload is not None and payload.get("status") == "verify":
                return {"op": "verify", "correct": bool(payload.get("correct")), "timed_out": False,
                        "error": str(payload.get("error", ""))}
            return {"op": "verify", "correct": False, "timed_out": False, "error": f"verifier process ended: {code}"}
        if payload is None or payload.get("status") not in ("ok", "display", "error"):
            # The process ended without reporting: os._exit(), a signal, or a crash.
            if code == 0:
                return self._success(stdout, "", duration)
            if code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"signal {-code}"
                if -code == signal.SIGXCPU:
                    return {"kind": "timeout", "text": "TimeoutError: CPU time limit exceeded", "duration_s": duration}
                reason = f"Process killed by {name}"
                if -code == signal.SIGSEGV:
                    reason += " (segmentation fault)"
            else:
                reason = f"Process exited with status {code}"
            text = "\n".join(s for s in (stdout.rstrip(), stderr.rstrip(), reason) if s)
            return {"kind": "error", "text": text, "duration_s": duration}
        if payload["status"] == "error":
            text = "\n".join(s for s in (stdout.rstrip(), str(payload.get("text", ""))) if s)
            return {"kind": "error", "text": text, "duration_s": duration}
        display = str(payload.get("text", "")) if payload["status"] == "display" else ""
        return self._success(stdout, display, duration)

    @staticmethod
    def _success(stdout: str, display: str, duration: float) -> dict:
        if stdout:
            return {"kind": "stdout", "text": stdout, "duration_s": duration}
        return {"kind": "display", "text": display, "duration_s": duration}


# --------------------------------------------------------------------------------------------
# the zygote


def _no_repair(*args, **kwargs) -> None:
    return None


def skip_threading_fork_repair() -> bool:
    """In a worker: make `threading`'s after-fork handler a no-op for the sandboxes it forks.

    Why: CPython runs that handler in every forked child; it rebuilds the registry of threads
    and its locks and costs a sandbox about 70 copy-on-write page faults (~0.3 ms of the ~6.5 ms
    of CPU a trivial call costs on 2 cores). A worker runs one thread and holds none of those
    locks when it forks, so what a sandbox inherits is already what the handler would rebuild.
    Checked, not assumed: the worker must have one thread, and a forked probe must find itself
    the main thread and be able to start and join a thread; otherwise the handler is restored.
    Only on CPython 3.11, whose handler this reasoning was checked against."""
    import threading

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


def worker_main(fd: int, index: int, config: dict, isolation: dict) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    skip_threading_fork_repair()
    if isolation.get("worker_realtime"):
        become_realtime()
    if not isolation["pidns"]:
        # Orphans of a sandbox (double fork) get re-parented to this worker rather than to
        # init. (Not inherited through fork, so each worker sets it itself.)
        from rstarjax.env import sandbox

        sandbox.libc_call("prctl", sandbox.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    sock = socket.socket(fileno=fd)
    try:
        Worker(sock, index, config, isolation).serve()
    except BaseException:
        import traceback

        traceback.print_exc()  # the trainer's stderr: a worker crash must leave its cause behind
        raise
    finally:
        os._exit(0)  # children die with us (PR_SET_PDEATHSIG)


def preload(tier: str) -> None:
    """Import what model code usually imports, so a forked sandbox pays nothing for it."""
    import importlib

    from rstarjax.env import routing, sandbox  # noqa: F401

    for name in sorted(routing.LEAN_MODULES):
        importlib.import_module(name)
    if tier == routing.HEAVY:
        import numpy  # noqa: F401
        import scipy  # noqa: F401  (submodules are lazy; scipy.special alone would double fork cost)
        import sympy  # noqa: F401

        from rstarjax.env import verify

        verify.warm_up()
        warm_up_libraries()


def warm_up_libraries() -> None:
    """Exercise what math tool calls typically do, once, in the zygote: sympy and numpy import
    much lazily (printers, solvers, polys) and fill caches on first use; done here, every forked
    sandbox inherits it instead of paying ~0.2-1 s for it again."""
    import io
    import contextlib

    import numpy as np
    import sympy

    x, y = sympy.symbols("x y")
    with contextlib.redirect_stdout(io.StringIO()):
        print(sympy.expand((x + 1) ** 5), sympy.factor(x**2 - 1), sympy.simplify(sympy.sin(x) ** 2 + sympy.cos(x) ** 2))
        print(sympy.solve(x**2 - 2, x), sympy.solve([x + y - 2, x - y], [x, y]), sympy.integrate(x**2, x))
        print(sympy.factorint(2**32 + 1), sympy.isprime(97), sympy.primerange(2, 30), sympy.binomial(10, 3))
        print(sympy.Rational(1, 3) + 1, sympy.pi.evalf(30), sympy.sqrt(8), sympy.latex(x**2), sympy.nsimplify(0.5))
        print(sympy.Matrix([[1, 2], [3, 4]]).det(), sympy.diff(sympy.exp(x) * x, x), sympy.limit(sympy.sin(x) / x, x, 0))
        print(sympy.series(sympy.exp(x), x, 0, 3), sympy.gcd(12, 18), sympy.divisors(28), sympy.totient(10))
        print(np.array([1.5, 2.0]), np.arange(6).reshape(2, 3) @ np.ones(3), np.linalg.det(np.eye(2)))


def zygote_main(argv: list[str]) -> None:
    config = json.loads(argv[1])
    control = socket.socket(fileno=int(config["control_fd"]))
    _bootstrap_package()
    env_dir = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != env_dir]  # no top-level "sandbox"
    from rstarjax.env import sandbox

    isolation = setup_zygote_isolation(config)
    os.makedirs(config["workdir_root"], mode=0o711, exist_ok=True)
    preload(config.get("preload", "heavy"))
    if "jax" in sys.modules:  # pragma: no cover - guarded by a test
        raise RuntimeError("the zygote must not import jax")
    isolation["pidns"] = bool(config.get("isolate", True)) and probe_pidns()
    isolation["worker_realtime"] = bool(config.get("worker_realtime", True)) and probe_realtime()
    isolation["uid_drop"] = bool(config.get("isolate", True)) and isolation["root"]
    if isolation["uid_drop"] and not probe_unprivileged_imports(int(config["uid_base"])):
        # Better a working sandbox contained by its PID namespace than one that cannot import.
        isolation["uid_drop"] = False
        isolation["uid_drop_refused"] = "the sandbox uid cannot read the Python installation"
    sandbox.prepare_zygote()
    gc.collect()
    gc.freeze()  # keep the preloaded heap out of GC passes: fewer copy-on-write faults per fork
    isolation["huge_page_bytes"] = collapse_heap() if config.get("huge_pages", True) else 0
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped automatically
    # The control socket is SOCK_SEQPACKET: one message per send, fds ride along (SCM_RIGHTS).
    control.send(json.dumps({"op": "ready", "pid": os.getpid(), "isolation": isolation}).encode())
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        except OSError:
            break
        if not msg:
            break
        request = json.loads(msg)
        if request.get("op") != "spawn" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            control.close()
            worker_main(fds[0], int(request["index"]), config, isolation)
        os.close(fds[0])
        control.send(json.dumps({"op": "spawned", "index": request["index"], "pid": pid}).encode())
    os._exit(0)


if __name__ == "__main__":
    zygote_main(sys.argv)

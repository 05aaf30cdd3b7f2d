"""A worker: the event loop between the trainer and <= `slots` sandboxes.

A worker receives batches of calls from the trainer, hands each to a sandbox, reads the
sandbox's output with a cap, classifies the outcome into one of the four result kinds and
replies. It never forks a sandbox itself: at start, before it has read anything, it forks one
forker per slot (see forker.py), and asks the slot's forker for each new sandbox. So the
process image sandboxes are copies of never held call data, and the expensive part of a fork
(page tables) happens off this loop.

* A call that waits for a slot gets a cold start: its sandbox is cloned with the call already
  queued on its channel.
* A slot that frees while no call waits gets, once the loop is quiet, a warm sandbox: cloned
  ahead of need, set up, waiting on its channel. At low concurrency the next call then starts
  with two fds sent over that channel (microseconds) instead of a clone. (Under saturation
  calls always wait, so sandboxes are cold-started.)

Only the standard library and rstarjax.env are imported (the zygote loads this module).
"""
from __future__ import annotations

import collections
import json
import os
import resource
import selectors
import signal
import socket
import sys
import time
import traceback

from rstarjax.env import cgroups, cleanup, forker, isolation, sandbox, wire
from rstarjax.env.sandbox import Confinement, SandboxLimits

# Re-warming a slot waits for this much quiet unless a call needs the sandbox now: at low
# concurrency the next call (sent as soon as the previous answer arrives) then finds a warm
# sandbox and is read at once, instead of waiting behind the clone that re-warms the slot.
WARM_WHEN_QUIET_S = 0.005
# A call's CPU time (all its processes) is read once it has run this long, then this often:
# one process alone can never exceed its budget (call_cpus >= 1 x its timeout), many can.
CPU_CHECK_AFTER_S = 0.25
CPU_CHECK_EVERY_S = 0.1
MAX_RESULT_BYTES = 4 << 20  # the child's JSON line on fd 3
RESULT_STATUSES = ("ok", "display", "error")

# Who SIGKILLed a sandbox's PID 1, where the worker did not (its own kills are timeouts).
KILLED_BY_MEMORY_BUDGET = "the call's memory budget"  # the program's
KILLED_BY_CPU_LIMIT = "its RLIMIT_CPU"  # the program's
KILLED_FROM_OUTSIDE = "outside the call"  # ours: the host's OOM killer, a limit above the call's, an operator
KILLED_BY_UNKNOWN = "unknown"  # no PID namespace: the program may have killed itself


def sigkill_cause(own_memory_budget_ran_out: bool, cpu_used_s: float, cpu_soft_limit_s: float,
                  pid_namespace: bool) -> str:
    """Why a sandbox died of a SIGKILL that the worker did not send (`cpu_soft_limit_s`: the CPU
    time from which such a kill is its RLIMIT_CPU's, `cpu_kill_threshold`).

    In a PID namespace nothing of the call can send it: the kernel drops every signal that a
    namespace's init gets from inside it, SIGKILL included. What remains is the kernel (the OOM
    killer, RLIMIT_CPU) and processes outside the call. The OOM killer acting on the call's own
    budget and the CPU limit are the program's doing; anything else (an OOM of a cgroup above
    the call's, which picks the sandbox first, the host's, an operator's kill) is not."""
    if own_memory_budget_ran_out:
        return KILLED_BY_MEMORY_BUDGET
    if cpu_used_s >= cpu_soft_limit_s:  # killed at the hard limit, or SIGXCPU ignored
        return KILLED_BY_CPU_LIMIT
    return KILLED_FROM_OUTSIDE if pid_namespace else KILLED_BY_UNKNOWN


def cpu_hard_limit_of(pid: int) -> float | None:
    """The hard RLIMIT_CPU of our child `pid`, alive or dead but not yet reaped (its limits live
    until it is), in seconds; None where it cannot be read or is unlimited."""
    try:
        _, hard = resource.prlimit(pid, resource.RLIMIT_CPU)
    except (OSError, ValueError):
        return None
    return None if hard == resource.RLIM_INFINITY else float(hard)


def cpu_kill_threshold(configured: tuple[int, int], hard_it_had: float | None) -> float:
    """The CPU time (wait4's) from which a sandbox's SIGKILL counts as the kernel's at its hard
    RLIMIT_CPU. The kernel measures that limit in scheduler ticks, and the runtime wait4 reports
    at the kill falls short of it (by up to 0.25 s on a 2-core VM, at limits of 1-5 s): so a kill
    is judged against the soft limit, the margin (`sandbox.cpu_limits`) below the hard one. A
    sandbox whose hard limit was lowered (model code runs in it and, without
    seccomp.LOCKED_LIMITS, may do so) is judged by that limit less the same margin: the kill at
    it is the program's, not one from outside. A raised soft limit changes nothing (the kill
    still comes at the hard one)."""
    soft, hard = configured
    if hard_it_had is None or hard_it_had >= hard:
        return float(soft)
    return max(0.0, hard_it_had - (hard - soft))


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


class Running:
    """One sandbox process: being cloned (`pid` None until its forker answers), warm (waiting
    for a call: `call` None) or running its call."""

    __slots__ = (
        "call", "pid", "pidfd", "slot", "workdir", "channel", "stdout", "stderr", "result", "fds", "deadline",
        "t_recv", "t_start", "timed_out", "replied", "done", "cpu_start", "cpu_checked", "over_cpu_budget",
        "cpu_used_s", "cpu_hard_limit_s",
    )


class Worker:
    """An event loop over <= `slots` sandboxes (see the module docstring)."""

    def __init__(self, sock: socket.socket, index: int, config: dict, host: dict):
        self.sock = sock
        self.index = index
        self.config = config
        self.limits = SandboxLimits(**config["limits"])
        self.slots = int(config["slots"])
        self.use_pidns = bool(host["pidns"])
        self.uid_drop = bool(host["uid_drop"])
        self.drop_caps = bool(host.get("userns"))  # the zygote's user namespace gave us capabilities
        self.call_mounts = bool(host.get("call_mounts"))
        self.tmp_binds = tuple(host["call_tmp_binds"]) if host.get("own_tmp") else None
        self.clone_flags = forker.clone_flags(host)
        self.tid_offset = host.get("tid_offset")
        self.seccomp = bool(host.get("seccomp"))
        self.realtime = bool(host.get("worker_realtime"))
        self.cgroup = config.get("cgroup")  # {"kind", "roots", "memory_root", "cpu_root"}, or None
        # Each slot's memory counters when its last call ended (a worker replacing a dead one
        # finds the slots' cgroups with counts of its predecessor's calls).
        self.memory_seen = [self._new_memory_window(s) for s in range(self.slots)]
        self.cpu_dirs = [None] * self.slots  # where each slot's CPU time is, if accounted
        if self.cgroup is not None and self.cgroup.get("cpu_root"):
            self.cpu_dirs = [os.path.join(self.cgroup["cpu_root"], cgroups.slot_name(index, s)) for s in range(self.slots)]
        self.cold_slots = list(range(self.slots))  # no process: to be warmed
        self.warm: collections.deque[Running] = collections.deque()
        self.pending: collections.deque = collections.deque()
        self.by_slot: list[Running | None] = [None] * self.slots  # each slot's sandbox, if any
        self.warm_failures = 0  # warm sandboxes that died before their call, in a row
        self.warm_not_before = 0.0  # back-off after such a death
        self.last_busy = 0.0  # when select last returned something
        self.sel = selectors.DefaultSelector()
        self.reader = wire.FrameReader()
        self.workdir_root = config["workdir_root"] if self.call_mounts else os.path.join(config["workdir_root"], f"w{index}")
        self.counter = 0
        self.forkers: list[socket.socket] = []
        self.forker_pids: set[int] = set()

    def slot_uid(self, slot: int) -> int | None:
        if not self.uid_drop:
            return None
        return int(self.config["uid_base"]) + self.index * self.slots + slot

    def confinement(self, slot: int, workdir: str) -> Confinement:
        return Confinement(workdir=workdir, uid=self.slot_uid(slot), call_mounts=self.call_mounts,
                           own_proc=self.call_mounts and self.use_pidns, drop_caps=self.drop_caps,
                           tmp_binds=self.tmp_binds, seccomp=self.seccomp)

    def start_forkers(self) -> None:
        """One forker per slot, forked now, while this process has read nothing."""
        me = os.getpid()
        for slot in range(self.slots):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                keep = theirs.fileno()
                os.closerange(3, keep)  # the trainer's socket, earlier forkers' sockets ...
                os.closerange(keep + 1, 1 << 16)
                dirs = [] if self.cgroup is None else [
                    os.path.join(root, cgroups.slot_name(self.index, slot)) for root in self.cgroup["roots"]]
                forker.serve(theirs, me, self.confinement(slot, self.workdir_root), self.limits, self.clone_flags,
                             self.tid_offset, dirs, self.realtime, self.seccomp)
            theirs.close()
            self.forkers.append(ours)
            self.forker_pids.add(pid)
            self.sel.register(ours, selectors.EVENT_READ, ("forker", slot))

    def serve(self) -> None:
        if not self.call_mounts:
            cleanup.remove_tree(self.workdir_root)  # leftovers of a killed predecessor
            os.makedirs(self.workdir_root, mode=0o711)
        self.start_forkers()
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
                elif what == "forker":
                    if not self._forker_replied(run):
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
            self._fill_one_slot()

    def _select_timeout(self) -> float | None:
        if self.pending and (self.warm or self.cold_slots):  # a call can start: no sleeping
            return 0.0
        now = time.monotonic()
        busy = [r for r in self._busy() if not r.timed_out]
        wake = [r.deadline for r in busy]
        wake += [r.cpu_checked + CPU_CHECK_EVERY_S for r in busy if r.cpu_start is not None]
        if self.cold_slots:
            wake.append(self._warm_due())
        return min(max(0.0, min(wake) - now), 1.0) if wake else None  # bounded, whatever the inputs

    def _busy(self) -> list[Running]:
        return [r for r in self.by_slot if r is not None and r.call is not None]

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
        self.sock.sendall(wire.encode_frame(payload))

    # -- sandbox lifecycle -----------------------------------------------------------------
    def _fill_one_slot(self) -> None:
        """At most one clone request per pass: for a call that waits (a cold start), or, once
        the loop is quiet, a warm sandbox that the next call will find ready."""
        if not self.cold_slots:
            return
        call = self.pending.popleft() if self.pending else None
        if call is None and time.monotonic() < self._warm_due():
            return
        slot = self.cold_slots.pop()
        try:
            self._spawn(slot, call)
        except OSError as exc:  # e.g. no memory or file descriptors left: answer, keep serving
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

    def _new_workdir(self) -> str:
        """Without call mounts: a fresh directory per call on the host, removed afterwards."""
        self.counter += 1
        return os.path.join(self.workdir_root, f"c{self.counter}")

    def _spawn(self, slot: int, call: dict | None) -> None:
        """Ask the slot's forker for a sandbox: cold with `call` queued on its channel, or warm."""
        run = Running()
        run.call, run.pid, run.pidfd, run.slot, run.channel = None, None, None, slot, None
        run.workdir = self.workdir_root
        if not self.call_mounts:
            run.workdir = self._new_workdir()
            os.mkdir(run.workdir, 0o700)
            uid = self.slot_uid(slot)
            if uid is not None:
                os.chown(run.workdir, uid, uid)
        opened: list[int] = []
        theirs = None
        try:
            for _ in range(3):
                opened.extend(os.pipe())
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            run.channel = ours
            if call is not None:
                wire.send_call(ours, call)
            child_ends = [opened[1], opened[3], opened[5], theirs.fileno()]
            socket.send_fds(self.forkers[slot], [run.workdir.encode()], child_ends)
        except OSError:
            for fd in opened:
                os.close(fd)
            if run.channel is not None:
                run.channel.close()
            if not self.call_mounts:
                cleanup.remove_tree(run.workdir)
            raise
        finally:
            if theirs is not None:
                theirs.close()
        for fd in (opened[1], opened[3], opened[5]):
            os.close(fd)  # the forker has its own copies now
        cap = self.limits.max_output_bytes
        run.stdout, run.stderr, run.result = CappedBuffer(cap), CappedBuffer(cap), bytearray()
        run.fds = {}
        run.timed_out = run.replied = run.done = run.over_cpu_budget = False
        run.cpu_start = None
        run.cpu_used_s = 0.0
        run.cpu_hard_limit_s = None
        for name, fd in (("stdout", opened[0]), ("stderr", opened[2]), ("result", opened[4])):
            os.set_blocking(fd, False)
            run.fds[name] = fd
            self.sel.register(fd, selectors.EVENT_READ, (name, run))
        self.by_slot[slot] = run
        if call is None:
            ours.setblocking(False)  # one message into an empty socket never blocks; be sure anyway
            self.warm.append(run)
        else:
            self._started(run, call, time.monotonic())  # the clone counts as the sandbox's time
        if not (self.use_pidns or self.uid_drop):
            # The weakest fallback kills every child it does not know after each call: wait for
            # the pid now, so that a sandbox just cloned is never taken for an orphan.
            self._forker_replied(slot, block=True)

    def _forker_replied(self, slot: int, block: bool = False) -> bool:
        """The forker of `slot` answered a clone request with a pid (or -errno). False when the
        forker is gone: then this worker ends (the trainer replaces it with a clean one)."""
        try:
            data = self.forkers[slot].recv(forker.REPLY.size, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if len(data) != forker.REPLY.size:
            return False
        (pid,) = forker.REPLY.unpack(data)
        run = self.by_slot[slot]
        if run is None or run.pid is not None:  # answered already (a blocking wait took it)
            return True
        if pid < 0:
            self._spawn_failed(run, OSError(-pid, os.strerror(-pid)))
            return True
        run.pid = pid
        try:
            run.pidfd = os.pidfd_open(pid)
        except OSError:
            os.kill(pid, signal.SIGKILL)  # a child we cannot watch must not live on
            os.waitpid(pid, 0)
            run.pid = None
            self._spawn_failed(run, OSError("could not watch the sandbox process"))
            return True
        self.sel.register(run.pidfd, selectors.EVENT_READ, ("exit", run))
        if run.timed_out:
            self._kill(run)
        return True

    def _spawn_failed(self, run: Running, exc: OSError) -> None:
        run.done = True
        for fd in run.fds.values():
            self.sel.unregister(fd)
            os.close(fd)
        run.fds = {}
        self._close_channel(run)
        self.by_slot[run.slot] = None
        if not self.call_mounts:
            cleanup.remove_tree(run.workdir)
        self.cold_slots.append(run.slot)
        if run.call is None:
            if run in self.warm:
                self.warm.remove(run)
            self._warm_failed()
        elif not run.replied:
            run.replied = True
            self._reply_start_failure(run.call, exc)

    def _start_pending(self) -> None:
        """Hand waiting calls to warm sandboxes: two memfds over a socket, no clone."""
        while self.pending and self.warm:
            call, run = self.pending.popleft(), self.warm.popleft()
            try:
                wire.send_call(run.channel, call)
            except OSError:
                # No memory for a memfd, or the warm sandbox is gone (its exit event cleans up):
                # the call goes back to the head of the line, and this sandbox is not used again.
                self.pending.appendleft(call)
                self._kill(run)
                self._close_channel(run)
                continue
            self._close_channel(run)  # the child has its call queued; we have nothing more to say
            self.warm_failures = 0
            self._started(run, call, time.monotonic())

    def _started(self, run: Running, call: dict, t_start: float) -> None:
        run.call = call
        run.t_start = t_start
        run.t_recv = call.get("t_recv", t_start)
        run.deadline = t_start + float(call["timeout"])
        cpu_dir = self.cpu_dirs[run.slot]
        run.cpu_start = None if cpu_dir is None else cgroups.cpu_seconds(self.cgroup["kind"], cpu_dir)
        run.cpu_checked = t_start + CPU_CHECK_AFTER_S - CPU_CHECK_EVERY_S

    def _over_cpu_budget(self, run: Running, now: float) -> bool:
        """Have the call's processes together used more CPU time than its budget? (Read at most
        every CPU_CHECK_EVERY_S, from CPU_CHECK_AFTER_S on.)"""
        if run.cpu_start is None or now - run.cpu_checked < CPU_CHECK_EVERY_S:
            return False
        run.cpu_checked = now
        used = cgroups.cpu_seconds(self.cgroup["kind"], self.cpu_dirs[run.slot]) - run.cpu_start
        return used > self.limits.call_cpus * float(run.call["timeout"])

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
        for run in self._busy():
            if run.timed_out:
                continue
            run.over_cpu_budget = now < run.deadline and self._over_cpu_budget(run, now)
            if now >= run.deadline or run.over_cpu_budget:
                run.timed_out = True
                self._kill(run)
                # Answer now: the verdict is known, and tearing down a big process tree (a fork
                # bomb of 64 copies of a 100 MB interpreter) can take a second on a busy machine.
                # The slot stays taken until the process is really gone.
                for what, fd in list(run.fds.items()):
                    self._drain(fd, run, what)
                self._send_result(run, 0, now)

    def _kill(self, run: Running) -> None:
        if run.pidfd is None:  # not cloned yet: killed as soon as its pid arrives (timed_out)
            return
        try:
            signal.pidfd_send_signal(run.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not self.use_pidns:
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _finish(self, run: Running) -> None:
        run.done = True
        run.cpu_hard_limit_s = cpu_hard_limit_of(run.pid)  # before the reap, which frees its limits
        _, status, usage = os.wait4(run.pid, 0)
        run.cpu_used_s = usage.ru_utime + usage.ru_stime  # its own and its reaped children's
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
        self._close_channel(run)
        self.by_slot[run.slot] = None
        if run.call is None:  # died warm (killed from outside, or its setup failed)
            if run in self.warm:
                self.warm.remove(run)
            self._warm_failed()
        elif not run.replied:
            self._send_result(run, status, t_end)  # answer first; cleaning up is our business
        if not self.use_pidns:
            if self.uid_drop:
                cleanup.sweep_uid(self.slot_uid(run.slot))
            else:
                cleanup.kill_orphans(keep=self.forker_pids | {r.pid for r in self.by_slot if r is not None})
        if not self.call_mounts:
            cleanup.remove_tree(run.workdir)
            cleanup.sweep_shm(self.slot_uid(run.slot))
        # The next call in this slot is judged by its own memory events only (read after the
        # answer: a child OOM-killed in a call whose PID 1 lived on must not count later).
        self.memory_seen[run.slot] = self._new_memory_window(run.slot)
        self.cold_slots.append(run.slot)  # the slot (and its uid) is re-warmed only once clean

    def _send_result(self, run: Running, status: int, t_end: float) -> None:
        try:
            reply = self._classify(run, status)
        except Exception as exc:  # noqa: BLE001 - whatever a sandbox wrote, the worker lives on
            reply = {"kind": "error", "text": f"SandboxError: the result could not be read ({type(exc).__name__})",
                     "infra_error": True, "duration_s": 0.0}
        reply.update(id=run.call["id"], t_recv=run.t_recv, t_start=run.t_start, t_end=t_end, t_sent=time.monotonic())
        run.replied = True
        self._reply(reply)

    @staticmethod
    def _result_line(run: Running) -> dict | None:
        """The sandbox's own report from fd 3, or None when it is missing or malformed (model code
        can write anything there: a deeply nested line must not take the worker down)."""
        if len(run.result) <= len(sandbox.READY):
            return None
        try:
            payload = json.loads(bytes(run.result[len(sandbox.READY) :]).split(b"\n", 1)[0])
        except (ValueError, RecursionError):
            return None
        if not isinstance(payload, dict) or not isinstance(payload.get("text", ""), str):
            return None
        return payload

    def _memory_dir(self, slot: int) -> str:
        return os.path.join(self.cgroup["memory_root"], cgroups.slot_name(self.index, slot))

    def _memory_events(self, slot: int) -> cgroups.MemoryEvents | None:
        if self.cgroup is None:
            return None
        return cgroups.memory_events(self.cgroup["kind"], self._memory_dir(slot))

    def _new_memory_window(self, slot: int) -> cgroups.MemoryEvents | None:
        """The slot's memory counters now, from which its next call is judged."""
        if self.cgroup is None:
            return None
        return cgroups.start_memory_window(self.cgroup["kind"], self._memory_dir(slot))

    def _ran_out_of_its_memory_budget(self, slot: int) -> bool:
        """Did the kernel kill a process of the slot's call because the call's own memory budget
        ran out (not a limit above it)? Never without a cgroup: then each process has only its
        RLIMIT_AS, which fails allocations (a MemoryError) instead of killing."""
        before = self.memory_seen[slot]
        return before is not None and self._memory_events(slot).own_limit_killed_since(before)

    def _sigkill_cause(self, run: Running) -> str:
        configured = sandbox.cpu_limits(self.limits, float(run.call["timeout"]))
        return sigkill_cause(self._ran_out_of_its_memory_budget(run.slot), run.cpu_used_s,
                             cpu_kill_threshold(configured, run.cpu_hard_limit_s), self.use_pidns)

    @staticmethod
    def _cpu_limit_timeout(stdout: str, duration: float) -> dict:
        msg = "TimeoutError: CPU time limit exceeded"
        text = f"{stdout.rstrip()}\n{msg}" if stdout.strip() else msg
        return {"kind": "timeout", "text": text, "duration_s": duration}

    def _classify(self, run: Running, status: int) -> dict:
        """Turn raw process outcome + streams into one of the four result kinds."""
        call = run.call
        stdout = run.stdout.text()
        limit = call["timeout"]
        duration = time.monotonic() - run.t_start
        if not run.result.startswith(sandbox.READY):  # it never got to the model's code
            why = sandbox.scrub_paths(run.stderr.text(), run.workdir).strip().splitlines()
            why = why[-1] if why else ("timed out" if run.timed_out else f"status {os.waitstatus_to_exitcode(status)}")
            if call["op"] == "verify":
                return {"op": "verify", "correct": False, "timed_out": False, "error": f"the verifier did not start: {why}"}
            return {"kind": "error", "text": f"SandboxError: the sandbox did not start: {why}", "infra_error": True,
                    "duration_s": duration}
        if run.timed_out:  # the worker killed it (wall clock, CPU budget), and only then
            if call["op"] == "verify":
                return {"op": "verify", "correct": False, "timed_out": True, "error": f"verifier exceeded {limit:g} s"}
            msg = f"TimeoutError: execution exceeded the {limit:g} s time limit"
            if run.over_cpu_budget:
                budget = self.limits.call_cpus * limit
                msg = f"TimeoutError: the call's processes together used more than {budget:g} s of CPU time"
            text = f"{stdout.rstrip()}\n{msg}" if stdout.strip() else msg
            return {"kind": "timeout", "text": text, "duration_s": duration}
        payload = self._result_line(run)
        code = os.waitstatus_to_exitcode(status)
        if call["op"] == "verify":
            if payload is not None and payload.get("status") == "verify":
                return {"op": "verify", "correct": payload.get("correct") is True, "timed_out": False,
                        "error": str(payload.get("error", ""))[:500]}
            return {"op": "verify", "correct": False, "timed_out": False, "error": f"verifier process ended: {code}"}
        if payload is None or payload.get("status") not in RESULT_STATUSES:
            # The process ended without reporting: os._exit(), a signal, or a crash.
            if code == 0:
                return self._success(stdout, "", duration)
            if code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"signal {-code}"
                cause = self._sigkill_cause(run) if -code == signal.SIGKILL else None
                if cause == KILLED_FROM_OUTSIDE:  # ours to retry, never the model's to see
                    return {"kind": "error", "text": f"SandboxError: the sandbox was killed from {cause} (SIGKILL)",
                            "infra_error": True, "duration_s": duration}
                if -code == signal.SIGXCPU or cause == KILLED_BY_CPU_LIMIT:
                    return self._cpu_limit_timeout(stdout, duration)
                reason = f"Process killed by {name}"
                if -code == signal.SIGSEGV:
                    reason += " (segmentation fault)"
                if cause == KILLED_BY_MEMORY_BUDGET:
                    budget = self.limits.call_memory_bytes >> 20
                    reason = f"MemoryError: the call's processes together exceeded its memory budget ({budget} MiB)"
            else:
                reason = f"Process exited with status {code}"
            stderr = sandbox.scrub_paths(run.stderr.text(), run.workdir)
            text = "\n".join(s for s in (stdout.rstrip(), stderr.rstrip(), reason) if s)
            return {"kind": "error", "text": text, "duration_s": duration}
        if payload["status"] == "error":
            text = "\n".join(s for s in (stdout.rstrip(), payload.get("text", "")) if s)
            return {"kind": "error", "text": text, "duration_s": duration}
        display = payload.get("text", "") if payload["status"] == "display" else ""
        return self._success(stdout, display, duration)

    @staticmethod
    def _success(stdout: str, display: str, duration: float) -> dict:
        if stdout:
            return {"kind": "stdout", "text": stdout, "duration_s": duration}
        return {"kind": "display", "text": display, "duration_s": duration}


def worker_main(fd: int, index: int, config: dict, host: dict) -> None:
    """A worker's life (in a child of the zygote). Never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    forker.skip_threading_fork_repair()  # before the forkers exist: their clones inherit it
    # Not readable by processes of the same uid (matters without a uid drop): it holds every call.
    isolation.prctl(isolation.PR_SET_DUMPABLE, 0)
    isolation.set_process_name("rj-worker")
    if host.get("worker_realtime"):
        forker.become_realtime()
    if not host["pidns"]:
        # Orphans of a sandbox (double fork) get re-parented to this worker rather than to init.
        isolation.prctl(isolation.PR_SET_CHILD_SUBREAPER, 1)
    sock = socket.socket(fileno=fd)
    try:
        Worker(sock, index, config, host).serve()
    except BaseException:
        traceback.print_exc(file=sys.stderr)  # the trainer's stderr: a crash must leave its cause
        raise
    finally:
        os._exit(0)  # forkers and sandboxes die with us (PR_SET_PDEATHSIG)

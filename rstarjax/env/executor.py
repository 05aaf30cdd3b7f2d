"""CodeExecutor: the trainer-side half of the code environment (rStar2-Agent §3.1).

    submit() --> bounded central queue --> send thread i --batch (<= 64)--> worker process i
                                                 ^                               | one result per
    Future resolved <---- receive thread i <-----+-------------------------------+ finished call

* One send thread per worker pulls up to `batch_size` calls from the central queue whenever its
  worker has free capacity: what is queued at that moment (batches form by themselves under
  load; `flush_s` > 0 would wait for fuller ones). Unlike the paper's send workers it does not
  wait for the whole batch before sending more, so one slow call does not hold 63 finished ones
  back.
* One receive thread per worker resolves futures as results arrive (all that one recv brings).
  EOF on the worker socket means the worker died: all its in-flight calls are answered (infra
  error) and it is replaced.
* A watchdog answers calls that waited in the queue longer than `queue_timeout` and kills a
  worker that has made no progress for longer than its longest in-flight timeout + `grace_s`.
Every call is resolved exactly once (see `_resolve`); every wait has a bound.

Resources of the host the executor holds while it runs, all given back by `close()`: a leased
range of sandbox uids (uids.py), a cgroup per sandbox slot (cgroups.py), a scratch directory.
`close()` also kills any process still running under the executor's uids or in its cgroups,
whatever the model's code did.

Multi-host: each host builds its own CodeExecutor for the rollouts it owns; there is no
cross-host service.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from . import cgroups, uids
from .cleanup import SANDBOX_DIR_PREFIX, kill_uid_range, remove_stale_sandbox_dirs
from .job_queue import Job, JobQueue
from .official_reward import REWARD_MODES
from .results import ERROR, ExecResult, VerifyResult
from .routing import HEAVY, LEAN, choose_tier
from .sandbox import SAFE_ENV, SandboxLimits
from .wire import BATCH_BYTES, MAX_CALL_BYTES, FrameReader, json_bytes, send_frame

_ZYGOTE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
_executor_seq = itertools.count()
log = logging.getLogger(__name__)


class ExecutorClosedError(RuntimeError):
    pass


def batch_items(calls) -> list[tuple[str, str]]:
    """(code, stdin) for every item of a batch: a code string, or a (code, stdin) pair whose
    stdin may be None. Anything else is a TypeError that names the item."""
    items = []
    for i, call in enumerate(calls):
        if isinstance(call, str):
            items.append((call, ""))
            continue
        if isinstance(call, (tuple, list)) and len(call) == 2 and isinstance(call[0], str) \
                and (call[1] is None or isinstance(call[1], str)):
            items.append((call[0], call[1] or ""))
            continue
        shown = repr(call)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise TypeError(f"calls[{i}] must be a code string or a (code, stdin) pair of strings, got "
                        f"{type(call).__name__} {shown}")
    return items


@dataclasses.dataclass
class ExecutorConfig:
    num_workers: int = 2  # "heavy" worker processes: forked from the numpy/sympy/scipy zygote
    lean_workers: int = -1  # workers forked from a bare zygote for code importing only light
    #                         stdlib modules (4x cheaper fork); -1 -> num_workers, 0 -> disabled
    slots_per_worker: int = 4  # sandboxes a worker runs at once
    inflight_per_worker: int = 0  # calls handed to a worker at once; 0 -> 2 * slots_per_worker
    batch_size: int = 64  # paper §3.1: send workers group up to 64 calls
    flush_s: float = 0.0  # wait this long for a fuller batch; 0: send what is queued now (see docs)
    max_queue: int = 100_000  # central queue bound, per tier and stage (backpressure beyond it)
    dispatch: str = "staged"  # job_queue.DISPATCHES: tool calls before verifications, or "fifo"
    submit_timeout: float = 60.0  # how long submit() blocks on a full queue before answering "overloaded"
    queue_timeout: float = 900.0  # a call not dispatched within this is answered with an error
    default_timeout: float = 10.0  # per-call wall-clock limit
    max_timeout: float = 600.0
    verify_timeout: float = 10.0
    grace_s: float = 5.0  # a worker silent for (longest in-flight timeout + grace) is killed
    startup_timeout: float = 120.0
    limits: SandboxLimits = dataclasses.field(default_factory=SandboxLimits)
    isolate: bool = True  # namespaces, uid drop, seccomp, cgroups where the host allows (docs/code_env.md)
    uid_base: int | None = None  # sandbox uids: uid_base + worker * slots + slot; None: a range of
    #                              the pool's size leased for this executor alone (uids.py)
    tmp_bytes: int = 512 << 20  # the sandboxes' private /tmp; used only where calls cannot have
    #                             their own tmpfs (see SandboxLimits.disk_bytes)
    python: str = sys.executable
    worker_realtime: bool = True  # workers and forkers run SCHED_FIFO (lowest RT priority) where
    #                               the kernel allows it: they are the dispatch path (see
    #                               forker.become_realtime); `isolation["worker_realtime"]` says if it did
    huge_pages: bool = True  # the zygotes move their preloaded heap onto transparent huge pages
    #                          (MADV_COLLAPSE): forks and exits copy/unmap far fewer page-table
    #                          entries (see zygote.py collapse_heap); `isolation["huge_page_bytes"]`


class _Zygote:
    """The preloaded interpreter that forks workers (see zygote.py)."""

    def __init__(self, config: ExecutorConfig, workdir_root: str, tier: str, uid_base: int, cgroup: dict | None):
        self.lock = threading.Lock()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        wire_config = {
            "control_fd": child.fileno(),
            "limits": dataclasses.asdict(config.limits),
            "slots": config.slots_per_worker,
            "isolate": config.isolate,
            "uid_base": uid_base,
            "workdir_root": workdir_root,
            "tmp_bytes": config.tmp_bytes,
            "cgroup": cgroup,
            "preload": tier,
            "worker_realtime": config.worker_realtime,
            "huge_pages": config.huge_pages,
            "import_paths": [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p],
        }
        env = dict(SAFE_ENV, HOME="/", PYTHONDONTWRITEBYTECODE="1")
        self.proc = subprocess.Popen(
            [config.python, "-s", _ZYGOTE_PATH, json.dumps(wire_config)],
            pass_fds=[child.fileno()],
            env=env,  # scrubbed: the trainer's secrets never reach the zygote or sandboxes
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,  # a Ctrl-C to the trainer's group is the trainer's business
        )
        child.close()
        self.sock = parent
        self.sock.settimeout(config.startup_timeout)
        try:
            msg = self.sock.recv(1 << 16)
        except OSError as exc:
            self.kill()
            raise RuntimeError(f"code-environment zygote did not start: {exc}") from exc
        if not msg:
            code = self.proc.wait(5)
            raise RuntimeError(f"code-environment zygote exited during startup (status {code}); "
                               "its traceback is on this process's stderr")
        ready = json.loads(msg)
        self.isolation = ready["isolation"]
        self.sock.settimeout(30.0)

    def spawn(self, index: int) -> tuple[socket.socket, int, int]:
        """A new worker connected to a fresh socketpair: (socket, pid, pidfd)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self.lock:
                socket.send_fds(self.sock, [json.dumps({"op": "spawn", "index": index}).encode()], [theirs.fileno()])
                msg = self.sock.recv(1 << 16)
            if not msg:
                raise OSError("zygote closed its control socket")
            pid = int(json.loads(msg)["pid"])
            pidfd = os.pidfd_open(pid)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return ours, pid, pidfd

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout: float = 5.0) -> None:
        try:
            self.sock.close()  # EOF -> the zygote exits
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass


@dataclasses.dataclass(eq=False)
class _WorkerHandle:
    index: int
    sock: socket.socket
    pid: int
    pidfd: int
    inflight: dict = dataclasses.field(default_factory=dict)
    alive: bool = True
    last_progress: float = dataclasses.field(default_factory=time.monotonic)
    fd_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    closed: bool = False

    def kill(self) -> None:
        # Under fd_lock: a pidfd number closed by release() may already belong to a new worker.
        with self.fd_lock:
            if self.closed:
                return
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except OSError:
                pass

    def release(self) -> None:
        with self.fd_lock:
            if self.closed:
                return
            self.closed = True
            self.sock.close()
            os.close(self.pidfd)


class CodeExecutor:
    """Isolated, pooled Python execution for tool calls and reward verification.

    Use as a context manager (or call start()/close()). Thread-safe.
    """

    def __init__(self, num_workers: int | None = None, config: ExecutorConfig | None = None, **overrides):
        config = dataclasses.replace(config or ExecutorConfig(), **overrides)
        if num_workers is not None:
            config = dataclasses.replace(config, num_workers=num_workers)
        if config.num_workers < 1 or config.slots_per_worker < 1:
            raise ValueError("num_workers and slots_per_worker must be >= 1")
        self.config = config
        self.capacity = config.inflight_per_worker or 2 * config.slots_per_worker
        lean = config.num_workers if config.lean_workers < 0 else config.lean_workers
        self.num_sandbox_uids = (config.num_workers + lean) * config.slots_per_worker
        if config.uid_base is not None and not 0 < config.uid_base < 2**32 - 1 - self.num_sandbox_uids:
            raise ValueError(f"uid_base {config.uid_base} leaves no room for {self.num_sandbox_uids} sandbox uids")
        # Leased at start() when left automatic: unique on this host while this executor runs.
        self.uid_base: int | None = config.uid_base
        self._uid_lease: uids.UidLease | None = None
        self._cgroups: cgroups.CgroupTree | None = None
        # Flat worker numbering: heavy workers first, then lean ones (the index picks sandbox uids).
        self._worker_tier = [HEAVY] * config.num_workers + [LEAN] * lean
        self._queues = {HEAVY: JobQueue(config.max_queue, config.dispatch),
                        LEAN: JobQueue(config.max_queue, config.dispatch)}
        # One lock for the workers' state. `_cv` announces changes anyone may wait for (deaths,
        # replacements, drained workers); `_capacity[i]` wakes only send thread i when its worker
        # frees capacity: with one shared condition every result woke every send thread.
        self._state_lock = threading.RLock()
        self._cv = threading.Condition(self._state_lock)
        self._capacity = [threading.Condition(self._state_lock) for _ in self._worker_tier]
        self._resolve_lock = threading.Lock()
        self._ids = itertools.count()
        self._workers: list[_WorkerHandle | None] = [None] * len(self._worker_tier)
        self._threads: list[threading.Thread] = []
        self._zygotes: dict[str, _Zygote] = {}
        self._zygote_locks = {HEAVY: threading.Lock(), LEAN: threading.Lock()}
        self._workdir_root = ""
        self._started = False
        self._closing = False
        self.stats = collections.Counter()  # read-only for users; see _count
        self._stats_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "CodeExecutor":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def isolation(self) -> dict:
        """What the host allowed (the heavy zygote's probes, see docs/code_env.md): root, userns
        (an unprivileged user namespace instead of root), netns, mountns, fresh_root (the
        default-deny file system; else fresh_root_refused says why), exposed (the host paths it
        shows), private_tmp, host_readonly, pidns, call_mounts, own_tmp (each call a writable
        /tmp of its own; call_tmp_binds what it shows of the fresh root's), ipcns, uid_drop, seccomp,
        worker_realtime, huge_page_bytes, and call_budget ("cgroup-v2", "cgroup-v1" or "rlimits").
        ``isolation.confinement_gap`` reads it."""
        if HEAVY not in self._zygotes:
            return {}
        info = dict(self._zygotes[HEAVY].isolation)
        info["call_budget"] = self._cgroups.kind if self._cgroups is not None else cgroups.NONE
        return info

    def start(self) -> "CodeExecutor":
        if self._started:
            return self
        # what executors killed before their close() left behind (their zygotes are gone)
        stale = remove_stale_sandbox_dirs()
        if stale:
            log.info("removed %d stale sandbox directories: %s", len(stale), ", ".join(stale))
        # Sandboxes see this path only inside the zygote's private /tmp when that mount works.
        self._workdir_root = tempfile.mkdtemp(prefix=SANDBOX_DIR_PREFIX)
        try:
            if self.uid_base is None:
                self._uid_lease = uids.lease(self.num_sandbox_uids)
                self.uid_base = self._uid_lease.base
            self._cgroups = self._make_cgroups()
            cgroup = self._cgroups.wire() if self._cgroups is not None else None
            for tier in sorted(set(self._worker_tier)):
                self._zygotes[tier] = _Zygote(self.config, self._workdir_root, tier, self.uid_base, cgroup)
            for i in range(len(self._workers)):
                self._workers[i] = self._spawn_worker(i)
        except BaseException:
            # Leave nothing behind: a half-started pool would hold processes nobody closes.
            for h in self._workers:
                if h is not None:
                    h.kill()
                    h.release()
            for zygote in self._zygotes.values():
                zygote.kill()
            self._release_host_resources()
            raise
        for i in range(len(self._workers)):
            for target, name in ((self._send_loop, "send"), (self._receive_loop, "recv")):
                t = threading.Thread(target=target, args=(i,), name=f"code-env-{name}-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        t = threading.Thread(target=self._watchdog_loop, name="code-env-watchdog", daemon=True)
        t.start()
        self._threads.append(t)
        self._started = True
        return self

    def close(self, drain_timeout: float | None = None) -> None:
        """Stop accepting calls, wait (bounded) for in-flight ones, answer the rest, stop processes."""
        if not self._started or self._closing:
            return
        for queue in self._queues.values():
            for job in queue.close():
                self._resolve(job, self._infra_result(job, "the code executor was closed"))
        deadline = time.monotonic() + (drain_timeout if drain_timeout is not None else self.config.grace_s)
        with self._cv:
            while any(w is not None and w.inflight for w in self._workers) and time.monotonic() < deadline:
                self._cv.wait(0.05)
            self._closing = True
            handles = [w for w in self._workers if w is not None]
            self._notify_everyone()
        for h in handles:
            self._worker_died(h, "the code executor was closed")
        for t in self._threads:
            t.join(timeout=5.0)
        for zygote in self._zygotes.values():
            zygote.close()
        self._release_host_resources()

    def _make_cgroups(self) -> cgroups.CgroupTree | None:
        """A cgroup per sandbox slot with the call's budget, where the host offers cgroups."""
        if not (self.config.isolate and os.geteuid() == 0):
            return None
        limits = self.config.limits
        budget = cgroups.CallBudget(limits.call_memory_bytes, limits.max_processes + 1)  # + the slot's forker
        slots = [cgroups.slot_name(i, s) for i in range(len(self._worker_tier))
                 for s in range(self.config.slots_per_worker)]
        return cgroups.CgroupTree.create(cgroups.tree_name(next(_executor_seq)), slots, budget)

    def _release_host_resources(self) -> None:
        """Kill whatever still runs under our sandbox uids or in our cgroups (the model's code may
        have tried anything), then give back the cgroups, the uid range and the scratch dir."""
        if self._cgroups is not None:
            self._cgroups.remove()
            self._cgroups = None
        if self.uid_base is not None and os.geteuid() == 0:
            kill_uid_range(self.uid_base, self.num_sandbox_uids)
        if self._uid_lease is not None:
            self._uid_lease.release()
            self._uid_lease = None
        shutil.rmtree(self._workdir_root, ignore_errors=True)

    # -- public API ------------------------------------------------------------------------
    def submit(self, code: str, stdin: str = "", timeout: float | None = None) -> concurrent.futures.Future:
        """Queue one execution. Returns a Future[ExecResult]; blocks only while the queue is full
        (at most `submit_timeout`, then the future carries an "overloaded" infra error)."""
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        if stdin is None:
            stdin = ""
        if not isinstance(stdin, str):
            raise TypeError(f"stdin must be str, got {type(stdin).__name__}")
        return self._submit("exec", {"code": code, "stdin": stdin}, self._check_timeout(timeout))

    def submit_verify(self, response_text: str, gold, timeout: float | None = None,
                      mode: str = "answer") -> concurrent.futures.Future:
        """Reward of one response, computed in a sandbox under a wall-clock kill.
        Returns a Future[VerifyResult] (`bool(result)` is the reward; a timeout gives False).
        ``mode``: official_reward.REWARD_MODES ("answer": the paper's eq. 3; "boxed": the same, or
        the response's last box where it wrote no <answer> block; "official": the
        official code's compute_score on the whole text)."""
        if not isinstance(response_text, str):
            raise TypeError(f"response_text must be str, got {type(response_text).__name__}")
        if mode not in REWARD_MODES:
            raise ValueError(f"reward mode must be one of {REWARD_MODES}, got {mode!r}")
        timeout = self._check_timeout(timeout if timeout is not None else self.config.verify_timeout)
        return self._submit("verify", {"response": response_text, "gold": str(gold), "mode": mode}, timeout)

    def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        fut = self.submit(code, stdin, timeout)
        return self._wait(fut, self._check_timeout(timeout))

    def run_batch(self, calls, timeout: float | None = None) -> list[ExecResult]:
        """`calls`: iterable of code strings or (code, stdin) pairs. Results in the same order.
        A malformed item raises TypeError naming it, before anything is submitted."""
        limit = self._check_timeout(timeout)
        futures = [self.submit(code, stdin, timeout) for code, stdin in batch_items(calls)]
        return [self._wait(f, limit) for f in futures]

    def verify(self, response_text: str, gold, timeout: float | None = None, mode: str = "answer") -> VerifyResult:
        fut = self.submit_verify(response_text, gold, timeout, mode)
        return self._wait(fut, self._check_timeout(timeout or self.config.verify_timeout))

    async def arun(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        """Async form of run(): never blocks the event loop (backpressure is awaited)."""
        timeout = self._check_timeout(timeout)
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        job = self._make_job("exec", {"code": code, "stdin": stdin or ""}, timeout)
        self._count("submitted")
        queue = self._queues[job.tier]
        deadline = time.monotonic() + self.config.submit_timeout
        while not queue.put(job, timeout=0.0):
            if queue.closed or time.monotonic() >= deadline:
                self._reject(job)
                break
            await asyncio.sleep(0.005)
        return await asyncio.wait_for(asyncio.wrap_future(job.future), self._result_bound(timeout))

    async def arun_batch(self, calls, timeout: float | None = None) -> list[ExecResult]:
        """Async form of run_batch(): the same accepted items, results in the same order."""
        tasks = [self.arun(code, stdin, timeout=timeout) for code, stdin in batch_items(calls)]
        return list(await asyncio.gather(*tasks))

    # -- internals: submission -------------------------------------------------------------
    def _check_timeout(self, timeout: float | None) -> float:
        timeout = self.config.default_timeout if timeout is None else float(timeout)
        if not (timeout > 0 and math.isfinite(timeout)) or timeout > self.config.max_timeout:
            raise ValueError(f"timeout must be in (0, {self.config.max_timeout}] seconds, got {timeout}")
        return timeout

    def _make_job(self, op: str, payload: dict, timeout: float) -> Job:
        if not self._started or self._closing:
            raise ExecutorClosedError("CodeExecutor is not running (use it as a context manager)")
        fut = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()  # cancel() cannot drop a call: it is answered once
        has_lean = LEAN in self._worker_tier
        tier = choose_tier(payload["code"]) if (op == "exec" and has_lean) else HEAVY
        job = Job(next(self._ids), op, payload, timeout, fut, time.monotonic(), tier=tier)
        job.wire_bytes = json_bytes(job.wire())
        return job

    def _submit(self, op: str, payload: dict, timeout: float) -> concurrent.futures.Future:
        job = self._make_job(op, payload, timeout)
        self._count("submitted")
        if job.wire_bytes > MAX_CALL_BYTES:  # the model's doing: answered now, never sent
            self._count("oversized")
            self._resolve(job, self._oversized_result(job))
        elif not self._queues[job.tier].put(job, timeout=self.config.submit_timeout):
            self._reject(job)
        return job.future

    @staticmethod
    def _oversized_result(job: Job):
        why = (f"the call is {job.wire_bytes / 2**20:.0f} MiB as sent, over the code environment's "
               f"limit of {MAX_CALL_BYTES >> 20} MiB for one call")
        if job.op == "verify":
            return VerifyResult(False, timed_out=False, error=f"the response to verify: {why}")
        return ExecResult(ERROR, f"ToolCallError: {why} (its code and stdin together)")

    def _reject(self, job: Job) -> None:
        self._count("rejected")
        why = "the code executor was closed" if self._queues[job.tier].closed else (
            f"code environment overloaded: queue full ({self.config.max_queue}) for {self.config.submit_timeout:g} s")
        self._resolve(job, self._infra_result(job, why))

    def _result_bound(self, timeout: float) -> float:
        # Queue expiry + run + worker-hang detection + respawn: past this something is broken.
        return self.config.queue_timeout + self.config.submit_timeout + timeout + 2 * self.config.grace_s + 30.0

    def _wait(self, fut: concurrent.futures.Future, timeout: float):
        try:
            return fut.result(timeout=self._result_bound(timeout))
        except concurrent.futures.TimeoutError:  # pragma: no cover - the watchdog answers first
            return ExecResult(ERROR, "code environment did not answer in time", infra_error=True)

    def _count(self, key: str) -> None:
        # Counter += is a read-modify-write: from several threads it would lose increments.
        with self._stats_lock:
            self.stats[key] += 1

    # -- internals: resolution -------------------------------------------------------------
    def _resolve(self, job: Job, result) -> None:
        """Answer a call exactly once (later attempts are ignored and counted)."""
        with self._resolve_lock:
            if job.resolved:
                self._count("duplicate_answers_ignored")
                return
            job.resolved = True
        if isinstance(result, ExecResult):
            self._count(f"result_{result.kind}")
            if result.infra_error:
                self._count("infra_errors")
        elif isinstance(result, VerifyResult) and result.timed_out:
            self._count("verify_timeouts")
        job.future.set_result(result)

    @staticmethod
    def _infra_result(job: Job, why: str):
        if job.op == "verify":
            return VerifyResult(False, timed_out=False, error=why)
        return ExecResult(ERROR, f"SandboxError: {why}", infra_error=True)

    def _result_from_wire(self, job: Job, msg: dict, received: float):
        if job.op == "verify":
            return VerifyResult(bool(msg.get("correct")), bool(msg.get("timed_out")), str(msg.get("error", "")))
        now = time.monotonic()
        # One clock (CLOCK_MONOTONIC is system-wide): trainer and worker stamps are comparable.
        timings = {
            "submit": job.t_submit, "dequeue": job.t_dequeue, "sent": job.t_sent or job.t_dequeue,
            "worker_recv": msg.get("t_recv", 0.0), "start": msg.get("t_start", 0.0), "end": msg.get("t_end", 0.0),
            "worker_sent": msg.get("t_sent", 0.0), "received": received, "resolved": now,
        }
        return ExecResult(msg["kind"], str(msg.get("text", "")), float(msg.get("duration_s", 0.0)),
                          infra_error=bool(msg.get("infra_error", False)), timings=timings)

    # -- internals: workers ----------------------------------------------------------------
    def _spawn_worker(self, index: int) -> _WorkerHandle:
        tier = self._worker_tier[index]
        with self._zygote_locks[tier]:
            try:
                sock, pid, pidfd = self._zygotes[tier].spawn(index)
            except (OSError, ValueError, KeyError):
                # The zygote itself is gone or wedged: start a new one (imports again, ~1-2 s).
                self._count("zygote_restarts")
                self._zygotes[tier].kill()
                cgroup = self._cgroups.wire() if self._cgroups is not None else None
                self._zygotes[tier] = _Zygote(self.config, self._workdir_root, tier, self.uid_base, cgroup)
                sock, pid, pidfd = self._zygotes[tier].spawn(index)
        return _WorkerHandle(index, sock, pid, pidfd)

    def _worker_died(self, h: _WorkerHandle, why: str) -> None:
        with self._cv:
            if not h.alive:
                return
            h.alive = False
            jobs = list(h.inflight.values())
            h.inflight.clear()
            self._notify_everyone()
        h.kill()
        try:
            h.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not self._closing:
            self._count("worker_deaths")
        for job in jobs:
            self._resolve(job, self._infra_result(job, f"sandbox worker died ({why}); the call was not completed"))

    def _send_loop(self, i: int) -> None:
        cfg = self.config
        queue = self._queues[self._worker_tier[i]]
        while True:
            with self._cv:
                while True:
                    if self._closing:
                        return
                    h = self._workers[i]
                    if h is not None and h.alive and len(h.inflight) < self.capacity:
                        break
                    self._capacity[i].wait(0.1)
                free = self.capacity - len(h.inflight)
            batch = queue.get_batch(min(cfg.batch_size, free), cfg.flush_s, timeout=0.1,
                                    max_bytes=BATCH_BYTES)
            if not batch:
                if queue.closed:
                    return
                continue
            now = time.monotonic()
            with self._cv:
                if not h.alive or self._closing:
                    queue.put_front(batch)  # never dispatched: someone else takes them
                    if self._closing:
                        for job in queue.close():
                            self._resolve(job, self._infra_result(job, "the code executor was closed"))
                    continue
                if not h.inflight:
                    h.last_progress = now
                for job in batch:
                    job.t_dequeue = now
                    h.inflight[job.id] = job
            try:
                send_frame(h.sock, {"op": "batch", "calls": [job.wire() for job in batch]})
                sent = time.monotonic()
                for job in batch:
                    job.t_sent = sent
                self._count("batches")
            except OSError as exc:
                self._worker_died(h, f"send failed: {exc}")

    def _receive_loop(self, i: int) -> None:
        while not self._closing:
            h = self._workers[i]
            why = self._receive_results(i, h)
            self._worker_died(h, why)
            h.release()
            if self._closing:
                return
            self._replace_worker(i)

    def _receive_results(self, i: int, h: _WorkerHandle) -> str:
        """Answer calls as worker `h`'s results arrive; return why its stream ended. Reads
        whatever is there in one recv (often several results under load): one wake-up, one
        lock round and one GIL hand-off for all of them."""
        reader = FrameReader()
        while True:
            try:
                data = h.sock.recv(1 << 20)
                msgs = reader.feed(data) if data else None
            except (OSError, ValueError) as exc:
                return f"{type(exc).__name__}: {exc}"
            if msgs is None:
                return "worker process exited"
            received = time.monotonic()
            with self._cv:
                jobs = [h.inflight.pop(msg.get("id"), None) for msg in msgs]
                h.last_progress = received
                self._capacity[i].notify()
                if not h.inflight:
                    self._cv.notify_all()  # close() waits for drained workers
            for job, msg in zip(jobs, msgs):
                if job is None:
                    continue
                try:
                    result = self._result_from_wire(job, msg, received)
                except (KeyError, TypeError, ValueError) as exc:
                    result = self._infra_result(job, f"malformed answer from the worker: {exc!r}")
                self._resolve(job, result)

    def _replace_worker(self, i: int) -> None:
        delay = 0.05
        while not self._closing:
            try:
                handle = self._spawn_worker(i)
            except Exception as exc:  # noqa: BLE001 - keep trying; queued calls expire meanwhile
                print(f"rstarjax.env: respawning worker {i} failed: {exc}", file=sys.stderr)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            with self._cv:
                self._workers[i] = handle
                self._notify_everyone()
            return

    def _notify_everyone(self) -> None:
        """Wake every waiter on the workers' state (caller holds the lock)."""
        self._cv.notify_all()
        for capacity in self._capacity:
            capacity.notify_all()

    def _watchdog_loop(self) -> None:
        while not self._closing:
            time.sleep(0.1)
            now = time.monotonic()
            for queue in self._queues.values():
                for job in queue.expire(now - self.config.queue_timeout):
                    self._count("queue_timeouts")
                    self._resolve(job, self._infra_result(job, f"not dispatched within {self.config.queue_timeout:g} s"))
            with self._cv:
                hung = []
                for h in self._workers:
                    if h is None or not h.alive or not h.inflight:
                        continue
                    # A worker runs <= slots calls at once, each killed at its timeout, so it must
                    # answer something at least every (longest timeout + grace) seconds.
                    longest = max(job.timeout for job in h.inflight.values())
                    if now - h.last_progress > longest + self.config.grace_s:
                        hung.append(h)
            for h in hung:
                self._count("hung_workers_killed")
                h.kill()  # the receive thread sees EOF, answers its calls and replaces it

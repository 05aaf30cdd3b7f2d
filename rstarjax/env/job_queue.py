"""The trainer-side queue of the code pool (docs/code_env.md): a call as a ``Job`` from
``CodeExecutor.submit`` until its future is resolved, and the bounded central ``JobQueue``
that the executor's send threads take batches from (one per zygote tier), tool calls
before reward verifications."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time

from .routing import HEAVY


@dataclasses.dataclass(eq=False)
class Job:
    """One call from ``submit`` until its future is resolved (exactly once: ``resolved``)."""

    id: int
    op: str  # "exec" | "verify"
    payload: dict
    timeout: float
    future: concurrent.futures.Future
    t_submit: float
    t_dequeue: float = 0.0
    t_sent: float = 0.0  # the batch holding this call was written to the worker's socket
    resolved: bool = False
    tier: str = HEAVY
    wire_bytes: int = 0  # ``wire()`` as JSON: batches are cut to fit a frame (get_batch)

    def wire(self) -> dict:
        return {"id": self.id, "op": self.op, "timeout": self.timeout, **self.payload}


# ``JobQueue`` dispatch orders (``ExecutorConfig.dispatch``)
DISPATCHES = ("staged", "fifo")
# "staged": the pipeline stages' lanes, in the order a send thread serves them
STAGE_LANES = ("exec", "verify")


class JobQueue:
    """Bounded queue with batch get, expiry and close; every wait has a timeout.

    ``dispatch="staged"`` (the default; SkyRL-Agent's pipeline dispatcher, "SkyRL-Agent:
    Efficient RL Training for Multi-turn LLM Agent", arXiv 2511.16108, §3.2) keeps one bounded
    lane per pipeline stage, tool execution before reward verification: a rollout waiting on
    its tool call holds its KV pages and a decode slot, while a verification is read only
    when the batch ends, so a burst of finished rollouts never queues ahead of (or, by filling
    the bound, blocks the submission of) the tool calls of those still running. Within a lane,
    first in first out. ``"fifo"``: one lane for both, as before (the benchmark's baseline)."""

    def __init__(self, maxsize: int, dispatch: str = "staged"):
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        self.maxsize = maxsize
        self.dispatch = dispatch
        names = STAGE_LANES if dispatch == "staged" else ("all",)
        self.lanes: dict[str, collections.deque[Job]] = {n: collections.deque() for n in names}
        self.cv = threading.Condition()
        self.closed = False

    def lane_of(self, job: Job) -> collections.deque[Job]:
        return self.lanes[job.op if self.dispatch == "staged" else "all"]

    def __len__(self) -> int:
        return sum(len(lane) for lane in self.lanes.values())

    def put(self, job: Job, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        lane = self.lane_of(job)
        with self.cv:
            while len(lane) >= self.maxsize and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cv.wait(left)
            if self.closed:
                return False
            lane.append(job)
            self.cv.notify_all()
            return True

    def _take(self, n: int, max_bytes: int | None) -> list[Job]:
        batch, size = [], 0
        for lane in self.lanes.values():  # in stage order
            while lane and len(batch) < n:
                if batch and max_bytes is not None and size + lane[0].wire_bytes > max_bytes:
                    return batch  # the rest waits for the next batch (one call alone always goes)
                size += lane[0].wire_bytes
                batch.append(lane.popleft())
        return batch

    def get_batch(self, max_n: int, flush_s: float, timeout: float,
                  max_bytes: int | None = None) -> list[Job]:
        """Up to ``max_n`` queued calls, waiting up to ``timeout`` for a first and ``flush_s``
        for more; at most ``max_bytes`` of their ``wire_bytes`` together, unless one alone is
        more."""
        deadline = time.monotonic() + timeout
        with self.cv:
            while not len(self) and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self.cv.wait(left)
            flush_at = time.monotonic() + flush_s
            while len(self) < max_n and not self.closed:
                left = flush_at - time.monotonic()
                if left <= 0:
                    break
                self.cv.wait(left)
            batch = self._take(max_n, max_bytes)
            self.cv.notify_all()
            return batch

    def put_front(self, jobs: list[Job]) -> None:
        with self.cv:
            for job in reversed(jobs):
                self.lane_of(job).appendleft(job)
            self.cv.notify_all()

    def expire(self, older_than: float) -> list[Job]:
        gone = []
        with self.cv:
            for name, lane in self.lanes.items():
                if not lane or lane[0].t_submit >= older_than:
                    continue
                keep = collections.deque()
                for job in lane:
                    (gone if job.t_submit < older_than else keep).append(job)
                self.lanes[name] = keep
            if gone:
                self.cv.notify_all()
            return gone

    def close(self) -> list[Job]:
        with self.cv:
            self.closed = True
            rest = [job for lane in self.lanes.values() for job in lane]
            for lane in self.lanes.values():
                lane.clear()
            self.cv.notify_all()
            return rest

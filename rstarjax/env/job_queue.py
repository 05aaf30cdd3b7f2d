"""The trainer-side queue of the code pool (docs/code_env.md): a call as a ``Job`` from
``CodeExecutor.submit`` until its future is resolved, and the bounded central ``JobQueue``
that the executor's send threads take batches from (one per zygote tier)."""
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

    def wire(self) -> dict:
        return {"id": self.id, "op": self.op, "timeout": self.timeout, **self.payload}


class JobQueue:
    """Bounded FIFO with batch get, expiry and close; every wait has a timeout."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.items: collections.deque[Job] = collections.deque()
        self.cv = threading.Condition()
        self.closed = False

    def __len__(self) -> int:
        return len(self.items)

    def put(self, job: Job, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cv:
            while len(self.items) >= self.maxsize and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cv.wait(left)
            if self.closed:
                return False
            self.items.append(job)
            self.cv.notify_all()
            return True

    def get_batch(self, max_n: int, flush_s: float, timeout: float) -> list[Job]:
        deadline = time.monotonic() + timeout
        with self.cv:
            while not self.items and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self.cv.wait(left)
            flush_at = time.monotonic() + flush_s
            while len(self.items) < max_n and not self.closed:
                left = flush_at - time.monotonic()
                if left <= 0:
                    break
                self.cv.wait(left)
            batch = [self.items.popleft() for _ in range(min(max_n, len(self.items)))]
            self.cv.notify_all()
            return batch

    def put_front(self, jobs: list[Job]) -> None:
        with self.cv:
            self.items.extendleft(reversed(jobs))
            self.cv.notify_all()

    def expire(self, older_than: float) -> list[Job]:
        with self.cv:
            if not self.items or self.items[0].t_submit >= older_than:
                return []
            keep, gone = collections.deque(), []
            for job in self.items:
                (gone if job.t_submit < older_than else keep).append(job)
            self.items = keep
            self.cv.notify_all()
            return gone

    def close(self) -> list[Job]:
        with self.cv:
            self.closed = True
            rest = list(self.items)
            self.items.clear()
            self.cv.notify_all()
            return rest

"""How the kernel benchmarks time a call: each call waited for (the median of ``iters``), or
``iters`` calls issued back to back and waited for once (their mean), which keeps a call's host
dispatch out of the time when the device takes longer than the dispatch."""
from __future__ import annotations

import statistics
import time

import jax


def median_call_seconds(fn, *args, iters: int, warm_up: bool = True) -> float:
    """The median of ``iters`` waited calls, after one that compiles and warms when asked."""
    if warm_up:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def pipelined_call_seconds(fn, *args, iters: int) -> float:
    """Seconds a call of ``iters`` issued back to back and waited for once (fn compiled)."""
    t = time.perf_counter()
    outs = [fn(*args) for _ in range(iters)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t) / iters

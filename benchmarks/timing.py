"""How the kernel benchmarks time a call: the median wall time of ``iters`` calls, each waited
for (``jax.block_until_ready``), after one call that compiles and warms it when asked."""
from __future__ import annotations

import statistics
import time

import jax


def median_call_seconds(fn, *args, iters: int, warm_up: bool = True) -> float:
    if warm_up:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)

"""How the kernel benchmarks time a call: each call waited for (the median of ``iters``), or
``iters`` calls issued back to back and waited for once (their mean), which keeps a call's host
dispatch out of the time when the device takes longer than the dispatch; and how they compile
their arms before any is timed, several at once (``compile_in_threads``)."""
from __future__ import annotations

import concurrent.futures
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


def compile_in_threads(lowered: dict, threads: int) -> dict:
    """``jax.stages.Lowered`` programs compiled ``threads`` at a time (XLA releases the GIL while
    it compiles; lowering holds it, so lower first, one by one): jax caches each executable,
    so the program's first call then only runs. Best effort: one that fails here is left out
    and compiles (and fails, as its row) at that call. Returns seconds from each compile's
    start to its end, by the same keys."""
    def compile_one(key):
        t = time.perf_counter()
        try:
            lowered[key].compile()
        except Exception:  # noqa: BLE001
            return key, None
        return key, round(time.perf_counter() - t, 2)

    with concurrent.futures.ThreadPoolExecutor(max(1, int(threads))) as pool:
        done = dict(pool.map(compile_one, list(lowered)))
    return {key: s for key, s in done.items() if s is not None}

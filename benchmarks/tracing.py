"""One ``jax.profiler`` trace of one call, kept as a single Chrome-trace file.

The benchmarks capture a trace of exactly one already-compiled call (a decode call, a train
step) so the file stays small enough to come back from a lent device (a few MiB) and holds
nothing but that call. ``benchmarks/profile_summary.py`` reads it offline.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Callable

import jax


def trace_one_call(fn: Callable[[], object], dest: str) -> dict:
    """Run ``fn()`` once under ``jax.profiler.trace`` (waiting for its outputs inside the trace)
    and copy the Perfetto / Chrome-JSON trace to ``dest`` (``*.json.gz``).

    Returns ``{"trace": dest, "trace_bytes": n}``, or ``{"trace_error": why}`` when this jax or
    backend cannot trace: a benchmark's figures never depend on the profiler working.
    """
    work = tempfile.mkdtemp(prefix="trace_")
    try:
        with jax.profiler.trace(work, create_perfetto_trace=True):
            jax.block_until_ready(fn())
        found = sorted(glob.glob(os.path.join(work, "**", "*.trace.json.gz"), recursive=True) +
                       glob.glob(os.path.join(work, "**", "perfetto_trace.json.gz"), recursive=True))
        if not found:
            return {"trace_error": f"no trace file under {work}"}
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        shutil.copyfile(found[-1], dest)
        return {"trace": dest, "trace_bytes": os.path.getsize(dest)}
    except Exception as exc:  # noqa: BLE001  (a profiler failure is reported, not fatal)
        return {"trace_error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        shutil.rmtree(work, ignore_errors=True)

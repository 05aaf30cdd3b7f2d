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

XPLANE_MAX_BYTES = 8 << 20  # a lent device returns files of at most 16 MiB


def trace_one_call(fn: Callable[[], object], dest: str) -> dict:
    """Run ``fn()`` once under ``jax.profiler.trace`` (waiting for its outputs inside the trace)
    and copy the Perfetto / Chrome-JSON trace to ``dest`` (``*.json.gz``).

    The run's ``*.xplane.pb`` (the compiled HLO) goes next to it as ``*.xplane.pb`` when it is
    at most ``XPLANE_MAX_BYTES``. Returns ``{"trace": dest, "trace_bytes": n, ...}``, or ``{"trace_error": why}`` when this jax or
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
        out = {"trace": dest, "trace_bytes": os.path.getsize(dest)}
        # the compiled HLO (bytes and FLOPs per op for profile_summary.py) lives in the xplane
        xplanes = glob.glob(os.path.join(os.path.dirname(found[-1]), "*.xplane.pb"))
        if xplanes and os.path.getsize(xplanes[0]) <= XPLANE_MAX_BYTES:
            xplane = dest[: -len(".json.gz")] + ".xplane.pb"
            shutil.copyfile(xplanes[0], xplane)
            out["xplane_bytes"] = os.path.getsize(xplane)
        return out
    except Exception as exc:  # noqa: BLE001  (a profiler failure is reported, not fatal)
        return {"trace_error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        shutil.rmtree(work, ignore_errors=True)

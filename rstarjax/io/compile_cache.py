"""XLA compilation: the persistent cache across runs, and the seconds spent compiling.

A stage of the recipe compiles dozens of programs (the train step, the log-prob forward, the
engine's prefill and decode per bucket); on one H200 the first two RL steps of a Qwen3-1.7B run
spent most of their "prefill" seconds compiling (docs/launch.md "One GPU"). The persistent cache
lets the next stage, a resumed run or a rerun load them instead; ``compile_seconds`` lets each
step report what compiling cost it (``time/compile``), so it is not mistaken for slow serving.
In a multi-process run jax writes the cache from process 0 only: a rollout process of the
disaggregated placement compiles its engine programs again at every start (docs/launch.md,
"What every multi-process run needs").
"""
from __future__ import annotations

import os
import threading

import jax
from absl import logging

# jax reports each backend compilation's duration under this event (jax._src.dispatch)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_seconds = 0.0
_listening = False


def _on_duration(event: str, duration_secs: float, **_) -> None:
    global _seconds
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _seconds += float(duration_secs)


def compile_seconds() -> float:
    """Seconds this process has spent in XLA backend compilation since the first call (the
    listener starts then; take differences around the work to measure)."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True
        return _seconds


def enable_persistent_cache(path: str) -> str:
    """Use ``path`` (``~`` expanded) as jax's persistent compilation cache; "" leaves it off. A
    cache the user already chose (``JAX_COMPILATION_CACHE_DIR`` or jax's config) wins. A
    directory that cannot be made is a warning, not a failure: the run compiles as usual.
    Returns the directory in use ("" when none)."""
    chosen = jax.config.jax_compilation_cache_dir
    if chosen:
        return chosen
    if not path:
        return ""
    path = os.path.expanduser(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        logging.warning("compilation cache %s not usable (%s): compiling without it", path, exc)
        return ""
    jax.config.update("jax_compilation_cache_dir", path)
    return path

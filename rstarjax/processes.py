"""Which processes train (imports only jax, so every layer may use it).

Every process of a run trains, except under disaggregated placement across processes
(``serving.placement='disaggregated'`` in a multi-process run, docs/training.md "Placement"):
process 0 then trains alone and the others only roll out (``recipes.rollout_process``). The
trainer's collectives, its data share, its batch rows and its checkpoint barriers must then
span process 0 alone: a program or a barrier over every process would wait forever on one
that never joins it. ``training_count`` is what the training path asks instead of
``jax.process_count()``.
"""
from __future__ import annotations

import contextlib
import json

import jax
import numpy as np
from jax.experimental import multihost_utils

_alone = False  # set by ``training_alone`` around a disaggregated trainer process


def training_count() -> int:
    """How many processes train (they are processes 0 .. count - 1)."""
    return 1 if _alone else jax.process_count()


@contextlib.contextmanager
def training_alone():
    """Within: this process trains alone (the other processes only roll out)."""
    global _alone
    before, _alone = _alone, True
    try:
        yield
    finally:
        _alone = before


def gather_json(obj) -> list:
    """``obj`` (anything ``json`` writes) from every process, in process order: a collective, so
    every process calls it at the same point. For per-process state a checkpoint keeps (written
    by process 0 alone)."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([data.size], np.int64)).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = multihost_utils.process_allgather(padded).reshape(len(sizes), -1)
    return [json.loads(bytes(row[:int(n)])) for row, n in zip(rows, sizes)]

"""Which processes train (imports only jax, so every layer may use it).

Every process of a run trains, except under disaggregated placement across processes
(``serving.placement='disaggregated'`` in a 2-process run, docs/training.md "Placement"):
process 0 then trains alone and process 1 only rolls out (``recipes.rollout_process``). The
trainer's collectives, its data share, its batch rows and its checkpoint barriers must then
span process 0 alone: a program or a barrier over every process would wait forever on one
that never joins it. ``training_count`` is what the training path asks instead of
``jax.process_count()``.
"""
from __future__ import annotations

import contextlib

import jax

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

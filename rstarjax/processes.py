"""Which processes train (imports only jax and ``models.sharding``, so every layer may use it).

Every process of a run trains, except under disaggregated placement across processes
(``serving.placement='disaggregated'`` in a multi-process run, docs/training.md "Placement"):
processes 0 .. ``serving.trainer_processes`` - 1 then train and the others only roll out
(``recipes.rollout_process``), each driven by one trainer (``rollout_processes_of``). The
trainer's collectives, its data shares, its batch rows and its checkpoint barriers must then
span the training processes alone: a program or a barrier over every process would wait
forever on one that never joins it. ``training_count`` is what the training path asks instead
of ``jax.process_count()``, and ``allgather`` is its gather.
"""
from __future__ import annotations

import contextlib
import functools
import json

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstarjax.models.sharding import PROCESS_AXIS, device_mesh

_count: int | None = None  # set by ``training_processes`` around a disaggregated trainer process


def training_count() -> int:
    """How many processes train (they are processes 0 .. count - 1)."""
    return jax.process_count() if _count is None else _count


@contextlib.contextmanager
def training_processes(count: int):
    """Within: processes 0 .. ``count`` - 1 train (the others only roll out)."""
    global _count
    if not 1 <= count <= jax.process_count():
        raise ValueError(f"{count} training processes: there are {jax.process_count()} processes")
    before, _count = _count, int(count)
    try:
        yield
    finally:
        _count = before


def rollout_processes_of(trainer: int, trainers: int, total: int) -> tuple[int, ...]:
    """The rollout processes (``trainers`` .. ``total`` - 1) that training process ``trainer``
    drives: every ``trainers``-th, so each trainer has as many as the others when ``trainers``
    divides their number (``recipes.config.device_rules`` requires it)."""
    return tuple(range(trainers + trainer, total, trainers))


def trainer_of(rollout: int, trainers: int) -> int:
    """The training process that drives rollout process ``rollout`` (``rollout_processes_of``)."""
    return (rollout - trainers) % trainers


def allgather(x) -> np.ndarray:
    """``x`` (a small host array, the same shape everywhere) from every training process,
    stacked in process order: a collective of the training processes alone (a rollout process
    never joins it; ``multihost_utils.process_allgather`` would wait for it forever)."""
    x = np.asarray(x)
    count = training_count()
    if count == 1:  # nothing to gather: no program runs
        return x[None]
    if count == jax.process_count():
        return np.asarray(multihost_utils.process_allgather(x)).reshape(count, *x.shape)
    firsts = [jax.local_devices(process_index=p)[0] for p in range(count)]
    mesh = device_mesh(firsts, (PROCESS_AXIS,))
    rows = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec(PROCESS_AXIS)), x[None])
    return np.asarray(_replicated(mesh)(rows).addressable_data(0))


@functools.lru_cache(maxsize=4)
def _replicated(mesh: Mesh):
    return jax.jit(lambda rows: rows, out_shardings=NamedSharding(mesh, PartitionSpec()))


def any_process(flag: bool) -> bool:
    """True if ``flag`` is True on any training process (a collective of them: every one asks at
    the same point). An RL step's refill decision and a stage's end are global, so every
    process runs the same rounds and consumes the same prompts (the data iterators stay in
    lockstep)."""
    return bool(np.any(allgather(np.asarray(flag, np.int32))))


def global_rows(local_rows: int) -> int:
    """The rows of a batch whose every training process brings ``local_rows`` (the global
    batch is their concatenation in process order)."""
    return local_rows * training_count()


def barrier(name: str) -> None:
    """Wait until every training process reaches the barrier ``name``."""
    if training_count() == jax.process_count():
        multihost_utils.sync_global_devices(name)
    else:  # a gather of nothing is a barrier of the training processes alone
        allgather(np.zeros((), np.int32))


def gather_json(obj) -> list:
    """``obj`` (anything ``json`` writes) from every training process, in process order: a
    collective, so every one calls it at the same point. For per-process state a checkpoint
    keeps (its meta written by process 0 alone)."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = allgather(np.asarray([data.size], np.int64)).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = allgather(padded).reshape(len(sizes), -1)
    return [json.loads(bytes(row[:int(n)])) for row, n in zip(rows, sizes)]

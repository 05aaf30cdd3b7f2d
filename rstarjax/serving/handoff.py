"""Multi-process weight hand-off: the trainer's globally sharded state -> a full copy on each
process's own devices (docs/serving.md, "Multi-host rollout").

In a multi-process run (``jax.process_count() > 1``) the training state is one global array per
parameter, split over every process's devices. Rollout must not touch it: each process's
scheduler issues its own program sequence (its prompts, prefill buckets, decode step counts), so
any program on a global array would wait for collectives the other processes never join. Each
process therefore serves its own full copy on its local devices, and the only cross-process
traffic of rollout is this hand-off, once per update, run by every process at the same point:

1. one jitted reshard of the state to a global mesh ``(process, tensor)`` whose row ``p`` is
   process ``p``'s local devices: replicated over ``process`` (the all-gather across processes
   happens here, on device), split over ``tensor`` like a slice over all local devices
   (``models.sharding.state_shardings``: heads, MLP columns, vocabulary);
2. each process wraps the shards it holds into arrays on its local mesh
   (``jax.make_array_from_single_device_arrays``): no copy, no host round trip.

The engines then make their serving copies from these local arrays (``Engine.update_params``),
each a program over its own slice's devices.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from rstarjax.models.sharding import state_shardings

PROCESS_AXIS = "process"


def local_mesh(axis: str = "tensor") -> Mesh:
    """This process's devices on one axis, in the order every process sees them
    (``jax.devices()`` filtered by process): position ``i`` is the same on every host."""
    return Mesh(np.array(_devices_by_process()[jax.process_index()]), (axis,),
                axis_types=(AxisType.Auto,))


def process_mesh(local: Mesh) -> Mesh:
    """The global mesh ``(process, *local.axis_names)``: row ``p`` holds process ``p``'s devices
    at the positions ``local``'s devices hold among this process's devices. Every process must
    pass a local mesh of the same positions (the same slice layout on every host), so all build
    the same global mesh."""
    by_process = _devices_by_process()
    mine = by_process[jax.process_index()]
    try:
        positions = [mine.index(d) for d in local.devices.flat]
    except ValueError:
        raise ValueError(f"the local mesh {local.devices.tolist()} holds devices of another "
                         f"process (this is process {jax.process_index()})") from None
    counts = {len(v) for v in by_process.values()}
    if len(counts) != 1:
        raise ValueError(f"hosts with different device counts {sorted(counts)} cannot hand off "
                         "the same layout")
    rows = [[by_process[p][i] for i in positions] for p in sorted(by_process)]
    devices = np.array(rows, dtype=object).reshape(len(rows), *local.devices.shape)
    return Mesh(devices, (PROCESS_AXIS, *local.axis_names),
                axis_types=(AxisType.Auto,) * (1 + len(local.axis_names)))


def is_process_local(tree) -> bool:
    """True when every array of ``tree`` lives on this process's devices only."""
    me = jax.process_index()
    return all(d.process_index == me for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)
               for d in x.sharding.device_set)


def require_process_local(tree, what: str = "the served state") -> None:
    """Refuse global arrays (with a clear error instead of a hang in rollout)."""
    if not is_process_local(tree):
        raise ValueError(f"{what} spans other processes' devices: in a multi-process run hand "
                         "each process its own copy first (serving.handoff.ProcessHandoff); a "
                         "program on global arrays inside rollout would wait on the other hosts")


class ProcessHandoff:
    """The hand-off for one model structure onto ``local`` (default: all of this process's
    devices on a ``tensor`` axis). Built once; ``__call__`` runs one compiled reshard per update.
    Every process must call it at the same point (it is a collective)."""

    def __init__(self, state, local: Mesh | None = None):
        self.local = local if local is not None else local_mesh()
        self.mesh = process_mesh(self.local)
        self._local_shardings = state_shardings(state, self.local)
        specs = jax.tree.map(lambda s: s.spec, self._local_shardings)
        self._global_shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs)
        self._gather = jax.jit(lambda x: x, out_shardings=self._global_shardings)

    def __call__(self, state):
        """``state`` (global arrays, the trainer's layout) -> the same values as arrays on this
        process's local mesh. A state on other devices than the trainer's (all of them) must lie
        on this process's devices only: it is placed locally, with no collective."""
        if _device_set(state) == set(self.mesh.devices.flat):
            gathered = self._gather(state)
            return jax.tree.map(_local_view, gathered, self._local_shardings)
        require_process_local(state, "a state on part of the devices")
        return jax.device_put(state, self._local_shardings)


def _local_view(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """The addressable shards of a process-replicated global array, as one array on the local
    mesh (same buffers)."""
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [s.data for s in x.addressable_shards])


def _device_set(tree) -> set:
    return {d for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for d in x.sharding.device_set}


def _devices_by_process() -> dict[int, list[jax.Device]]:
    by_process: dict[int, list[jax.Device]] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    return by_process

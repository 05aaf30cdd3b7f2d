"""The weight hand-off, all of it (docs/serving.md "Weight hand-off", "Multi-host rollout"): the
trainer's state -> each engine's serving copy, once per update, in device memory.

On one process (``serving_copies``, ``update_engines``): the ``nnx.split`` state (e.g. the
trainer's float32 FSDP params) becomes every slice's serving copy (``models.qwen3``
``serving_weights``: matmul weights in the serving dtype, one buffer per layer) in ONE jitted
program per tensor size. An engine tells the hand-off what it serves through its public
``Engine.layout`` (a ``ServingLayout``) and takes the copy with ``Engine.serve``.

Across processes (``ProcessHandoff``, ``jax.process_count() > 1``): the training state is one
global array per parameter, split over every process's devices. Rollout must not touch it: each
process's scheduler issues its own program sequence (its prompts, prefill buckets, decode step
counts), so any program on a global array would wait for collectives the other processes never
join. Each process therefore serves its own full copy on its local devices, and the only
cross-process traffic of rollout is this hand-off, once per update, run by every process at the
same point:

1. one jitted reshard of the state to a global mesh ``(process, tensor)`` whose row ``p`` is
   process ``p``'s local devices: replicated over ``process`` (the all-gather across processes
   happens here, on device), split over ``tensor`` like a slice over all local devices
   (``models.sharding.state_shardings``: heads, MLP columns, vocabulary);
2. each process wraps the shards it holds into arrays on its local mesh
   (``jax.make_array_from_single_device_arrays``): no copy, no host round trip.

The engines then make their serving copies from these local arrays (``update_engines``), each
a program over its own slice's devices.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstarjax.models.qwen3 import ServingWeights, serving_weights
from rstarjax.models.sharding import PROCESS_AXIS, device_mesh, state_shardings

# A slice's target layout in the hand-off: the NamedShardings of its serving copy (a
# ``ServingWeights`` of them), one device, or None (wherever the cast program puts it).
Target = ServingWeights | jax.Device | None


@dataclasses.dataclass(frozen=True)
class ServingLayout:
    """What the hand-off needs to know of an engine (``Engine.layout``): the served model's
    structure, the serving dtype, whether the head is untied (CPU), where the copy goes, and
    the shapes of the copy it serves (any model whose copy has them may be handed to it: a
    LoRA policy over the served base, whose adapters the hand-off merges)."""

    graphdef: object  # nnx.GraphDef of the served model
    structure: object  # jax tree structure of its ``nnx.split`` state
    dtype: jnp.dtype
    untie_head: bool
    target: Target
    copy_shapes: object  # ``ServingWeights`` of jax.ShapeDtypeStruct

    @property
    def program_key(self) -> tuple:
        """Engines with the same key share one ``serving_copies`` call."""
        return (self.graphdef, self.dtype, self.untie_head)


class Served(Protocol):
    """An engine as the hand-off sees it (``serving.engine.Engine``)."""

    layout: ServingLayout

    def serve(self, weights: ServingWeights) -> None: ...


def serving_fn(graphdef, state, dtype, untie_head):
    """The serving copy of an ``nnx.split`` state (traced inside the hand-off programs)."""
    return serving_weights(nnx.merge(graphdef, state), dtype, untie_head)


to_serving = jax.jit(serving_fn, static_argnums=(0, 2, 3))


def serving_shapes(graphdef, state, dtype, untie_head):
    """Shapes and dtypes of the serving copy (no computation)."""
    return jax.eval_shape(functools.partial(serving_fn, graphdef, dtype=dtype,
                                            untie_head=untie_head), state)


def named(mesh: Mesh, specs):
    """A tree of PartitionSpecs as NamedShardings on ``mesh``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def serving_copies(graphdef, state, targets: Sequence[Target], *, dtype,
                   untie_head: bool = False) -> list[ServingWeights]:
    """The weight hand-off (docs/serving.md "Weight hand-off"): the serving copy
    (``models.qwen3.serving_weights``: matmul weights in ``dtype``, one buffer per layer) of the
    ``nnx.split`` model ``state`` (e.g. the trainer's float32 FSDP params) placed in each of
    ``targets``, made once per update in device memory, never through the host.

    Colocated slices (each target's devices, in its mesh order, are ``tensor_parallel``
    consecutive devices of the state's, sorted by id, as ``slices.slice_meshes`` makes them):
    ONE jitted program per tensor size gathers and casts the params straight into a staging
    layout over the state's own devices, the slices' layout on every row of ``tensor``
    devices; each slice then keeps the buffers already on its devices (no copy). Transient
    memory per device: one serving shard (what a device of a slice keeps anyway). The program
    is the same on every process of a multi-host run (it depends on the state's devices and
    the tensor size only). Other targets (devices outside the state's, a state on the host):
    ``jax.device_put`` to the target, then the cast there.

    The copies own their buffers: the trainer may donate its params afterwards."""
    dtype = jnp.dtype(dtype)
    out: list[ServingWeights | None] = [None] * len(targets)
    rows = _staging_rows(state, targets)
    for tensor in sorted({len(r) for r in rows if r}):
        group = [i for i, r in enumerate(rows) if r and len(r) == tensor]
        devices = _sorted_devices(state)
        # one row per slice position: a full serving copy on every row of ``tensor`` devices
        mesh = device_mesh(np.array(devices).reshape(-1, tensor), ("data", "tensor"))
        target = targets[group[0]]
        specs = (jax.tree.map(lambda _: PartitionSpec(), serving_shapes(graphdef, state, dtype,
                                                                        untie_head))
                 if isinstance(target, jax.Device) else
                 specs_of(target))
        staged = _staging_program(graphdef, dtype, untie_head, named(mesh, specs))(state)
        for i in group:
            out[i] = _take_row(staged, targets[i], rows[i])
    remote: dict[int, ServingWeights] = {}  # staged for other device groups, by slice size
    for i, target in enumerate(targets):
        if out[i] is not None:
            continue
        if target is None:
            out[i] = to_serving(graphdef, state, dtype, untie_head)
        elif isinstance(target, jax.Device):
            out[i] = to_serving(graphdef, jax.device_put(state, target), dtype, untie_head)
        else:
            mesh = mesh_of(target)
            devices, size = _sorted_devices(state), mesh.size
            if devices and len(devices) % size == 0:
                # another device group (disaggregated rollouts): the staging program casts the
                # state into the slice's layout on every row of ``size`` of the state's own
                # devices, then each shard of the first row is copied device to device to the
                # slice (equal per-device slices: jax copies buffers, where a reshard across
                # device groups would go through the host): the serving dtype's bytes only
                if size not in remote:
                    specs = specs_of(target)
                    remote[size] = stage_in_layout(graphdef, state, specs, size, dtype=dtype, untie_head=untie_head)
                out[i] = jax.device_put(remote[size], target)
                continue
            placed = jax.device_put(state, state_shardings(state, mesh))
            out[i] = jax.jit(serving_fn, static_argnums=(0, 2, 3), out_shardings=target)(
                graphdef, placed, dtype, untie_head)
    return out


def stage_in_layout(graphdef, state, specs, size: int, *, dtype, untie_head: bool = False) -> ServingWeights:
    """The serving copy of ``state`` in the layout of a slice of ``size`` devices on a ``tensor``
    axis (``specs``: its PartitionSpecs), on the first ``size`` of the state's own devices that
    this process holds: the staging program casts the state into that layout on every row of
    ``size`` of its devices (one program, no host copy; a collective of every process the state
    spans), and this process's first row's buffers are kept (no copy). What another device
    group's slice then takes device to device: in this process (``serving_copies``) or in a
    rollout process (``copy_to_receiver``), from each training process its own."""
    devices = _sorted_devices(state)
    if not devices or len(devices) % size:
        raise ValueError(f"a slice of {size} devices does not tile the state's {len(devices)} devices")
    rows = np.array(devices).reshape(-1, size)
    mine = [row for row in rows if all(d.process_index == jax.process_index() for d in row)]
    if not mine:
        raise ValueError(f"no {size} consecutive devices of the state lie on process {jax.process_index()}: "
                         "each training process needs a whole rollout slice's worth of devices")
    rows_mesh = device_mesh(rows, ("data", "tensor"))
    staged = _staging_program(graphdef, jnp.dtype(dtype), untie_head, named(rows_mesh, specs))(state)
    first = named(device_mesh(np.array(mine[0]), ("tensor",)), specs)
    return _take_row(staged, first, None)


def pair_mesh(sender: Mesh, receiver: Mesh) -> Mesh:
    """The mesh ``(process, *axes)`` whose row 0 is ``sender``'s devices and row 1 ``receiver``'s
    (two meshes of one shape and axis names, in two processes): ``copy_to_receiver`` runs on it."""
    if sender.devices.shape != receiver.devices.shape or sender.axis_names != receiver.axis_names:
        raise ValueError(f"the sender's mesh {dict(sender.shape)} and the receiver's {dict(receiver.shape)} "
                         "differ: a shard-to-shard copy needs one layout on both sides")
    return device_mesh(np.stack([sender.devices, receiver.devices]), (PROCESS_AXIS, *sender.axis_names))


def copy_to_receiver(tree, pair: Mesh):
    """The weights of ``pair``'s row 0 (the sender process) copied to its row 1 (the receiver
    process), device to device in ONE compiled program: a collective both processes call at
    the same point. Each passes its own ``tree`` of arrays laid over its row of ``pair`` (the
    sender its new serving copy, ``stage_in_layout``; the receiver the copy it serves, which
    gives the shapes) and gets the sender's values as arrays on its own devices, in the
    layout it passed. Each device sends or receives exactly its own shard: the serving
    dtype's bytes cross once, never through the host."""
    def lift(x):  # this process's shards as its row of a [2, *shape] array over the pair
        sharding = NamedSharding(pair, PartitionSpec(PROCESS_AXIS, *x.sharding.spec))
        shards = {s.device: s.data for s in x.addressable_shards}
        shape = (2, *x.shape)
        return jax.make_array_from_single_device_arrays(
            shape, sharding, [shards[d].reshape(1, *shards[d].shape)
                              for d in sharding.addressable_devices_indices_map(shape)])

    def lower(g, x):  # the row back as an array in the layout passed
        shards = {s.device: s.data for s in g.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            x.shape, x.sharding, [shards[d].reshape(shards[d].shape[1:])
                                  for d in x.sharding.addressable_devices_indices_map(x.shape)])

    lifted = jax.tree.map(lift, tree)
    leaves, treedef = jax.tree.flatten(jax.tree.map(lambda g: g.sharding, lifted), is_leaf=_is_sharding)
    return jax.tree.map(lower, _first_row_program(tuple(leaves), treedef)(lifted), tree)


@functools.lru_cache(maxsize=16)
def _first_row_program(shardings, treedef):
    """Every row of each ``[2, ...]`` leaf set to row 0 (XLA lowers it to a collective permute)."""
    return jax.jit(lambda t: jax.tree.map(lambda g: jnp.broadcast_to(g[:1], g.shape), t),
                   out_shardings=jax.tree.unflatten(treedef, shardings))


def update_engines(engines: Sequence[Served], state, graphdef=None) -> None:
    """Hand ``state`` (an ``nnx.split`` state: of the served model, or of ``graphdef``'s model
    when given, e.g. the LoRA policy over the served base) to ``engines`` (e.g. every slice of
    a host): ``stage_copies``, then ``serve_copies``, the one path new weights take into
    engines (``ColocatedEngines`` stages now and serves between rounds the same way). A
    released engine (``Engine.release_memory``) gets its KV pool back."""
    serve_copies(stage_copies(engines, state, graphdef))


def serve_copies(staged: Sequence[tuple[Served, ServingWeights]]) -> None:
    """Each engine serves the copy ``stage_copies`` made for it (between scheduler runs: a run
    reads the engines' weights at every iteration)."""
    for engine, weights in staged:
        engine.serve(weights)


def split_weights(model_or_state) -> tuple[object, object]:
    """(graphdef, state) of new weights: a module (e.g. a LoRA policy over the served base) is
    split, a state of the served model's structure comes with no graphdef (None)."""
    if isinstance(model_or_state, nnx.Module):
        return nnx.split(model_or_state)
    return None, model_or_state


def stage_copies(engines: Sequence[Served], state, graphdef=None) -> list[tuple[Served, ServingWeights]]:
    """Each engine's serving copy of ``state`` (as ``update_engines`` takes it), made now and
    served later (``Engine.serve``: asynchronous rollouts install it between rounds): one
    ``serving_copies`` for those that share a model and a dtype, so colocated slices cost one
    program per update, not one per slice; with adapters, the merge is part of that program
    (``models.qwen3.serving_weights``). The copies own their buffers."""
    groups: dict[tuple, list[Served]] = {}
    copy_shapes: dict[tuple, object] = {}  # traced once per program key, not once per engine
    for e in engines:
        if graphdef is None and jax.tree.structure(state) != e.layout.structure:
            raise ValueError("update_params: the new state's tree structure differs from the "
                             "served model's")
        key = e.layout.program_key if graphdef is None else (graphdef, e.layout.dtype, e.layout.untie_head)
        if graphdef is not None and key not in copy_shapes:
            copy_shapes[key] = serving_shapes(graphdef, state, *key[1:])
        if graphdef is not None and not _same_shapes(copy_shapes[key], e.layout.copy_shapes):
            raise ValueError("update_params: the new model's serving copy (its architecture, shapes or "
                             "dtypes) differs from the one this engine serves")
        groups.setdefault(key, []).append(e)
    staged = []
    for (graphdef, dtype, untie), group in groups.items():
        copies = serving_copies(graphdef, state, [e.layout.target for e in group],
                                dtype=dtype, untie_head=untie)
        staged += zip(group, copies)
    return staged


def _same_shapes(a, b) -> bool:
    """Whether two trees of arrays (or their ShapeDtypeStructs) have one structure, shapes and dtypes."""
    spec = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]  # noqa: E731
    return jax.tree.structure(a) == jax.tree.structure(b) and spec(a) == spec(b)


def _is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)


def specs_of(target: ServingWeights):
    """A slice's layout (``ServingLayout.target``, a tree of NamedShardings) as PartitionSpecs."""
    return jax.tree.map(lambda sh: sh.spec, target, is_leaf=_is_sharding)


def mesh_of(target: ServingWeights) -> Mesh:
    """The mesh a slice's layout lies on."""
    return jax.tree.leaves(target, is_leaf=_is_sharding)[0].mesh


def _sorted_devices(state) -> list[jax.Device]:
    """The devices ``state``'s arrays lie on, by id ([] for a state on the host)."""
    devices = set()
    for x in jax.tree.leaves(state):
        devices |= x.sharding.device_set if isinstance(x, jax.Array) else set()
    return sorted(devices, key=lambda d: d.id)


def _staging_rows(state, targets) -> list[tuple[jax.Device, ...] | None]:
    """Per target, its devices when the staging program can place it (see ``serving_copies``),
    else None."""
    leaves = jax.tree.leaves(state)
    if not leaves or not all(isinstance(x, jax.Array) and x.committed for x in leaves):
        return [None] * len(targets)
    devices = _sorted_devices(state)
    rows = []
    for target in targets:
        if isinstance(target, jax.Device):
            row = (target,)
        elif target is None:
            row = None
        else:
            mesh = mesh_of(target)
            row = tuple(mesh.devices.flat)
        if row is not None and len(devices) % len(row) == 0:
            t = len(row)
            if row not in {tuple(devices[i:i + t]) for i in range(0, len(devices), t)}:
                row = None
        else:
            row = None
        rows.append(row)
    return rows


@functools.lru_cache(maxsize=64)
def _staging_jit(graphdef, dtype, untie_head, leaves, treedef):
    return jax.jit(functools.partial(serving_fn, graphdef, dtype=dtype, untie_head=untie_head),
                   out_shardings=jax.tree.unflatten(treedef, leaves))


def _staging_program(graphdef, dtype, untie_head, shardings):
    leaves, treedef = jax.tree.flatten(shardings, is_leaf=_is_sharding)
    return _staging_jit(graphdef, dtype, untie_head, tuple(leaves), treedef)


def _take_row(staged: ServingWeights, target: Target, row) -> ServingWeights:
    """The slice's own arrays out of the staging copy: its devices' buffers, no copy."""
    def take(x, sharding):
        shards = {s.device: s.data for s in x.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            x.shape, sharding, [shards[d] for d in sharding.addressable_devices_indices_map(
                x.shape)])
    if isinstance(target, jax.Device):
        single = jax.sharding.SingleDeviceSharding(target)
        return jax.tree.map(lambda x: take(x, single), staged)
    return jax.tree.map(take, staged, target)


# ---- across processes ----------------------------------------------------------------

def local_mesh(axis: str = "tensor") -> Mesh:
    """This process's devices on one axis, in the order every process sees them
    (``jax.devices()`` filtered by process): position ``i`` is the same on every host."""
    return device_mesh(_devices_by_process()[jax.process_index()], (axis,))


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
    return device_mesh(devices, (PROCESS_AXIS, *local.axis_names))


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

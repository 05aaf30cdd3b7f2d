"""Meshes (one builder, one axis vocabulary), logical-axis rules, and helpers to build/shard
models for jit.

Every mesh of the project is made by ``device_mesh`` with axes from ``AXES`` (no other module
calls ``Mesh(...)``): the trainer's ``(data, fsdp, tensor)`` (``make_mesh``), a serving slice's
``(tensor,)`` (``serving.slices``), the weight hand-off's staging ``(data, tensor)`` (one full
serving copy per row), its cross-process ``(process, tensor)`` meshes (``serving.handoff``), the
training processes' ``(process,)`` gather (``rstarjax.processes``) and a mesh another process
described (``describe_mesh`` / ``mesh_from_description``: a rollout process's slice, ``rl.remote``).

Every parameter carries ``logical_axes`` metadata (e.g. ``("layers", "embed", "mlp")``); the
rules below map logical names to mesh axes. A dimension whose size is not divisible by its mesh
axes is replicated instead (tiny test models on big meshes), never silently padded.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")  # the trainer's mesh
PROCESS_AXIS = "process"  # one row per process (the multi-process weight hand-off)
AXES = (PROCESS_AXIS, *MESH_AXES)  # every mesh axis name the project uses

# logical name -> mesh axis (str), tuple of mesh axes, or None (replicated).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    # activations
    ("batch", ("data", "fsdp")),
    # The embedding lookup's rows: over data only, so its output can keep the hidden dim on fsdp
    # like the table (Qwen3._embed) and reach "batch" by an all-to-all inside each fsdp group.
    ("lookup_batch", "data"),
    ("seq", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),  # attention heads inside the fused attention kernels
    ("act_vocab", "tensor"),
)


def device_mesh(devices, axes: Sequence[str]) -> Mesh:
    """The mesh laying out ``devices`` (an array of devices, or a flat list for one axis) in
    exactly their given order, one array dimension per name of ``axes`` (names from ``AXES``,
    every axis ``AxisType.Auto``: XLA's partitioner places the collectives)."""
    axes = tuple(axes)
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"mesh axes {unknown} are not in the project's vocabulary {AXES}")
    grid = devices if isinstance(devices, np.ndarray) else np.array(devices, dtype=object)
    if grid.ndim != len(axes):
        raise ValueError(f"a mesh over a {grid.ndim}-d array of devices needs {grid.ndim} axis "
                         f"names, got {axes}")
    return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))


def describe_mesh(mesh: Mesh) -> dict:
    """``mesh`` as plain data another process can rebuild it from (``mesh_from_description``):
    its devices' global ids in mesh order, its shape and its axis names."""
    return {"devices": [d.id for d in mesh.devices.flat], "shape": mesh.devices.shape, "axes": mesh.axis_names}


def mesh_from_description(described: dict) -> Mesh:
    """The mesh ``describe_mesh`` described (in any process of the run: device ids are global)."""
    by_id = {d.id: d for d in jax.devices()}
    grid = np.array([by_id[i] for i in described["devices"]], dtype=object).reshape(described["shape"])
    return device_mesh(grid, described["axes"])


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    """The trainer's mesh, axes (data, fsdp, tensor); one size may be -1 (= the remaining
    devices). Devices are ordered by ``jax.make_mesh`` (the physical topology, e.g. TPU ICI)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices not divisible by {known} ({sizes})")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} "
                         f"devices, have {len(devices)}")
    ordered = jax.make_mesh(tuple(sizes), MESH_AXES, devices=devices).devices
    return device_mesh(ordered, MESH_AXES)


def _mesh_axis_sizes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes if hasattr(mesh, "axis_sizes")
                    else mesh.devices.shape))


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int] | None, mesh,
                    rules=DEFAULT_RULES) -> P:
    """PartitionSpec for an array with these logical axes on this mesh. Mesh axes absent from
    the mesh, already used by an earlier dim, or not dividing the dim are dropped."""
    rule_map = dict(rules)
    sizes = _mesh_axis_sizes(mesh)
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical_axes):
        target = rule_map.get(name) if name is not None else None
        if name is not None and name not in rule_map:
            raise ValueError(f"logical axis {name!r} has no sharding rule")
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a in sizes and a not in used and sizes[a] > 1)
        if shape is not None and axes:
            # Keep the longest prefix of mesh axes that divides the dimension.
            while axes and shape[dim] % int(np.prod([sizes[a] for a in axes])):
                axes = axes[:-1]
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules=DEFAULT_RULES) -> jax.Array:
    """Activation sharding hint; a no-op unless a mesh is set with ``jax.set_mesh``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh, rules))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.State:
    """NamedSharding per variable, from its ``logical_axes`` metadata (replicated if none)."""
    def one(var):
        axes = var.get_metadata().get("logical_axes")
        shape = var.get_value().shape
        spec = P() if axes is None else logical_to_spec(axes, shape, mesh, rules)
        return var.replace(NamedSharding(mesh, spec))
    return jax.tree.map(one, state, is_leaf=_is_var)


def shard_model(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
    """Move an existing model's parameters onto their shardings (in place; returns model)."""
    state = nnx.state(model)
    placed = jax.device_put(state, state_shardings(state, mesh, rules))
    nnx.update(model, placed)
    return model


def batch_sharding(mesh: Mesh, ndim: int = 2, rules=DEFAULT_RULES) -> NamedSharding:
    """Sharding for per-token inputs ``[B, T, ...]``: batch over (data, fsdp)."""
    batch = logical_to_spec(("batch",), None, mesh, rules)[0]
    return NamedSharding(mesh, P(batch, *([None] * (ndim - 1))))

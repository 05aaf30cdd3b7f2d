"""Serving slices of one host: which devices each ``Engine`` spans (docs/serving.md, "Serving
slices").

A slice is a mesh with one ``tensor`` axis over ``tensor_parallel`` consecutive local devices
(neighbours on one host share the fastest links: NVLink, ICI); the engine on it splits the
weights Megatron-style and the KV pages by kv head. A host runs ``num_slices`` of them side by
side and the rollout scheduler spreads rollouts over them by free KV pages.
"""
from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import Mesh

from rstarjax.models.sharding import device_mesh


def slice_meshes(devices: Sequence[jax.Device], *, tensor_parallel: int,
                 num_slices: int = 0) -> list[Mesh]:
    """``num_slices`` meshes (0: as many as ``devices`` hold) of ``tensor_parallel`` consecutive
    devices each, axis ``tensor``. Raises ``ValueError`` naming the config key when they do
    not fit."""
    devices = list(devices)
    if tensor_parallel < 1 or tensor_parallel > len(devices):
        raise ValueError(f"serving.tensor_parallel={tensor_parallel} must be in [1, "
                         f"{len(devices)}] (the local devices)")
    fit = len(devices) // tensor_parallel
    num_slices = num_slices or fit
    if num_slices > fit:
        raise ValueError(f"serving.slices_per_host={num_slices} slices of serving.tensor_parallel="
                         f"{tensor_parallel} devices need {num_slices * tensor_parallel} devices, "
                         f"this host has {len(devices)}")
    return [device_mesh(devices[i * tensor_parallel:(i + 1) * tensor_parallel], ("tensor",))
            for i in range(num_slices)]

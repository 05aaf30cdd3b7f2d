"""Where an engine's arrays live, and giving their memory back (docs/serving.md "Serving
slices", "Memory plan").

An engine is placed on one device, on a serving slice (a mesh whose ``tensor`` axis spans its
devices, ``serving.slices``), or on neither (the weights stay where the given model's arrays
are). On a slice the serving copy is split Megatron-style (``models.qwen3.serving_weight_specs``)
and the KV pool by kv head where the kv-head count allows (``models.kv_cache.pool_spec``); the
device programs are the same everywhere, XLA's SPMD partitioner adds the collectives.
"""
from __future__ import annotations

import contextlib

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstarjax.models.config import ModelConfig
from rstarjax.models.kv_cache import PagedKVCache, pool_spec
from rstarjax.models.qwen3 import serving_weight_specs
from rstarjax.serving.handoff import Target, named, serving_shapes
from rstarjax.serving.sizing import free_device_bytes


class Placement:
    """The devices of one engine: ``device``, ``mesh`` (a serving slice) or neither."""

    def __init__(self, device: jax.Device | None = None, mesh: Mesh | None = None):
        if device is not None and mesh is not None:
            raise ValueError("give an engine a device or a mesh, not both")
        if mesh is not None and "tensor" not in mesh.shape:
            raise ValueError(f"a serving mesh needs a 'tensor' axis, got axes {mesh.axis_names}")
        if mesh is not None and mesh.size != mesh.shape["tensor"]:
            raise ValueError(f"a serving mesh spans its devices with its 'tensor' axis only, got "
                             f"{dict(mesh.shape)}")
        self.device = device
        self.mesh = mesh
        self.tensor_parallel = 1 if mesh is None else int(mesh.shape["tensor"])
        self.weights_target: Target = device  # where the hand-off puts the serving copy
        self.kv_sharding: NamedSharding | None = None  # the pool's layout on a slice
        # Neither device nor slice: the mesh the given model's arrays live on, replicated
        # (``follow``); None where they are on one device without a mesh.
        self.home: NamedSharding | None = None

    @property
    def first_device(self) -> jax.Device:
        if self.mesh is not None:
            return self.mesh.devices.flat[0]
        return self.device or jax.local_devices()[0]

    def lay_out(self, model_config: ModelConfig, graphdef, state, dtype, untie_head: bool) -> None:
        """On a slice: the shardings of the serving copy (the hand-off's target) and of the
        pool. Elsewhere nothing to decide."""
        if self.mesh is None:
            return
        shapes = serving_shapes(graphdef, state, dtype, untie_head)
        specs = serving_weight_specs(model_config, shapes, self.tensor_parallel)
        self.weights_target = named(self.mesh, specs)
        self.kv_sharding = NamedSharding(self.mesh, pool_spec(model_config,
                                                              self.tensor_parallel))

    def follow(self, weights) -> None:
        """An engine on neither a device nor a slice runs its programs where its serving copy
        lives: on the trainer's mesh when the model came from there (colocated). Its programs
        return the pool and the decode state replicated on that mesh, so those are made there
        too: made on one device outside the mesh, they had another type, and the first
        programs compiled a second time for the arrays they returned (the prefill again on
        the next RL step: 15 s for Qwen3-1.7B on an H200)."""
        if self.mesh is not None or self.device is not None:
            return
        sharding = jax.tree.leaves(weights)[0].sharding
        if isinstance(sharding, NamedSharding):
            self.home = NamedSharding(sharding.mesh, PartitionSpec())

    def new_pool(self, model_config: ModelConfig, num_pages: int, page_size: int, dtype):
        """A zero KV pool (k, v) on the engine's devices."""
        layout = self.kv_sharding if self.mesh is not None else self.home
        if layout is not None:  # made in place (on a slice split by kv head, never whole on one device)
            pool = tuple([layout] * model_config.num_hidden_layers)
            return jax.jit(lambda: PagedKVCache.init_pool(model_config, num_pages, page_size,
                                                          dtype),
                           out_shardings=(pool, pool))()
        with (jax.default_device(self.device) if self.device is not None
              else contextlib.nullcontext()):
            return PagedKVCache.init_pool(model_config, num_pages, page_size, dtype)

    def put(self, tree):
        """``tree`` (e.g. a fresh decode state) on the engine's devices, replicated on a slice
        or on the mesh the engine follows."""
        if self.mesh is not None:
            return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))
        if self.home is not None:
            return jax.device_put(tree, self.home)
        return tree if self.device is None else jax.device_put(tree, self.device)

    def free_kv_bytes(self) -> int | None:
        """Pool bytes the engine's devices can still take: one device's free memory, times the
        tensor size where the pool is split by kv head (each device holds 1/tensor of a page)."""
        if self.mesh is None:
            return free_device_bytes(self.device)
        free = [free_device_bytes(d) for d in self.mesh.devices.flat]
        if any(f is None for f in free):
            return None
        split = self.kv_sharding.spec != PartitionSpec()
        return min(free) * (self.tensor_parallel if split else 1)


def delete_arrays(tree) -> None:
    """Free the device memory of every array of ``tree`` now (not when Python collects it)."""
    for x in jax.tree.leaves(tree):
        x.delete()

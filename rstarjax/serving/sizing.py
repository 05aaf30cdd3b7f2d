"""How many KV pages (and decode slots) an engine gets, from memory or from an explicit count.

``plan_kv`` is the one place that decides; ``Engine`` calls it with the device's free memory
(after the serving weights are placed), and tests call it with the memory of a device we do
not have (e.g. 80 GB for the stage configs at Qwen3-1.7B / 8B shapes), so the arithmetic that
decides whether a configuration starts is the same code either way.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstarjax.models.config import ModelConfig
from rstarjax.models.kv_cache import kv_bytes_per_token, pages_for
from rstarjax.models.qwen3 import Qwen3, serving_weights

MAX_AUTO_SLOTS = 256  # decode batch width when sized from memory (GPU/TPU decode is
#                       weight-bandwidth bound up to a few hundred rows)
DEFAULT_CPU_SLOTS = 64  # no memory statistics (CPU): a dense-equivalent pool of this many rows
GB = 1e9


@dataclasses.dataclass(frozen=True)
class KVPlan:
    page_size: int
    num_pages: int
    num_slots: int
    pages_per_rollout: int  # pages of one maximum-length rollout
    page_bytes: int  # K and V of one page over all layers
    free_bytes: int | None  # device memory free when sizing (None: unknown, CPU)
    source: str  # "kv_pages" | "memory" | "dense-equivalent"

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def max_length_rollouts(self) -> int:
        """Maximum-length rollouts the pool holds at once (the dense-cache equivalent)."""
        return self.num_pages // self.pages_per_rollout

    def describe(self) -> str:
        return (f"{self.num_pages} pages x {self.page_size} tokens = {self.kv_tokens} KV tokens "
                f"({self.kv_bytes / GB:.2f} GB, {self.source}), {self.num_slots} slots, "
                f"{self.max_length_rollouts} maximum-length rollouts")


def free_device_bytes(device: jax.Device | None = None) -> int | None:
    """Bytes the allocator can still hand out on ``device``; None where unknown (CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def serving_weight_bytes(cfg: ModelConfig, dtype) -> int:
    """Bytes of the serving copy of the weights (matmul weights in ``dtype``, norms as
    stored), from the abstract model (``nnx.eval_shape``: nothing is allocated)."""
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shapes = jax.eval_shape(lambda s: serving_weights(nnx.merge(graphdef, s), dtype), state)
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(shapes)))


def plan_kv(cfg: ModelConfig, *, max_len: int, page_size: int = 16, kv_pages: int = 0,
            kv_memory_fraction: float = 0.9, num_slots: int = 0, dtype=jnp.bfloat16,
            free_bytes: int | None = None) -> KVPlan:
    """Pages and slots for an engine whose rollouts reach ``max_len`` tokens.

    - ``kv_pages > 0``: exactly that many pages.
    - else, with ``free_bytes`` known (GPU/TPU: free device memory after the serving
      weights): ``kv_memory_fraction`` of it, in pages (the rest is left for activations).
    - else (CPU): a dense-equivalent pool, ``num_slots`` (default 64) maximum-length rows.

    Slots (the decode batch width): ``num_slots`` if given, else ``min(256, pages)`` when
    sized from memory. Raises ``ValueError`` with the numbers and the flag that fixes it when
    the pool cannot hold one maximum-length rollout."""
    if page_size < 1 or max_len < 2:
        raise ValueError(f"need page_size >= 1 and max_len >= 2, got {page_size}, {max_len}")
    if not 0.0 < kv_memory_fraction <= 1.0:
        raise ValueError(f"serving.kv_memory_fraction must be in (0, 1], got "
                         f"{kv_memory_fraction}")
    page_bytes = kv_bytes_per_token(cfg, dtype) * page_size
    per_rollout = pages_for(max_len, page_size)
    if kv_pages > 0:
        num_pages, source = int(kv_pages), "kv_pages"
    elif free_bytes is not None:
        num_pages, source = int(kv_memory_fraction * max(0, free_bytes) // page_bytes), "memory"
    else:
        num_pages = (num_slots or DEFAULT_CPU_SLOTS) * per_rollout
        source = "dense-equivalent"
    if num_pages < per_rollout:
        have = (f"{free_bytes / GB:.2f} GB free on the device after the weights, "
                if free_bytes is not None else "")
        raise ValueError(
            f"the KV pool cannot hold one maximum-length rollout: {max_len} tokens need "
            f"{per_rollout} pages of {page_size} tokens ({per_rollout * page_bytes / GB:.2f} "
            f"GB), the pool has {num_pages} pages ({num_pages * page_bytes / GB:.2f} GB; "
            f"{have}source: {source}). Set --config.serving.kv_pages={per_rollout} or more, "
            f"raise --config.serving.kv_memory_fraction (now {kv_memory_fraction}), or lower "
            f"--config.rl.max_prompt_len / --config.rl.max_response_len.")
    if num_slots <= 0:
        num_slots = min(MAX_AUTO_SLOTS, num_pages) if source != "dense-equivalent" \
            else DEFAULT_CPU_SLOTS
    return KVPlan(page_size=int(page_size), num_pages=num_pages, num_slots=int(num_slots),
                  pages_per_rollout=per_rollout, page_bytes=int(page_bytes),
                  free_bytes=free_bytes, source=source)

"""KV storage for cached decoding: a paged pool (docs/design.md, docs/serving.md).

``PagedKVCache``: one pool of fixed-size pages shared by every row of a serving engine, and a
page table per row. Row b's token at position p lives in page ``page_table[b, p // page_size]``
at offset ``p % page_size``; a row holds only the pages its tokens fill, so a short rollout
does not reserve a long one's memory. Per layer, k and v are ``[kv_heads, num_pages,
page_size, head_dim]``: the layout jax's shipped Pallas paged-attention kernels (GPU and TPU)
read, so a layer's pool goes to them without a copy. Layers are separate arrays (a tuple):
each is updated in place and handed to a kernel as its own buffer (slicing one stacked array
per layer would copy the layer's whole pool on every step).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rstarjax.models.config import ModelConfig

NO_PAGE = -1  # page-table entry of a position with no page (reads masked, writes dropped)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """The page pool plus the rows that one forward reads and writes.

    ``k``, ``v``: tuples (one per layer) of ``[kv_heads, num_pages, page_size, head_dim]``;
    ``page_table``: int32[B, P], page ids of row b's positions ``[i * page_size, (i+1) *
    page_size)``, ``NO_PAGE`` where none is allocated; ``lengths``: int32[B] tokens stored.
    A forward may read a prefix of the table's columns (``P`` smaller than a row's maximum):
    the caller guarantees every position it touches lies in those columns."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_table: jax.Array
    lengths: jax.Array

    @staticmethod
    def init_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16
                  ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"need num_pages > 0 and page_size > 0, got {num_pages}, {page_size}")
        shape = pool_layer_shape(cfg, num_pages, page_size)
        k = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))
        return k, v

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    def replace(self, **changes) -> "PagedKVCache":
        return dataclasses.replace(self, **changes)


def pool_layer_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (cfg.num_key_value_heads, num_pages, page_size, cfg.head_dim)


def pool_spec(cfg: ModelConfig, tensor: int, axis: str = "tensor") -> jax.sharding.PartitionSpec:
    """PartitionSpec of one layer's pool ``[kv_heads, num_pages, page_size, head_dim]`` on a
    mesh whose ``axis`` has ``tensor`` devices: split by kv head where ``tensor`` divides the
    kv-head count (each device holds its heads' pages, next to its k/v projection columns),
    else replicated (every device holds every page: correct, ``tensor`` times the memory)."""
    P = jax.sharding.PartitionSpec
    return P(axis) if tensor > 1 and cfg.num_key_value_heads % tensor == 0 else P()


def kv_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    """Bytes of K and V that one token occupies over all layers."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * \
        np.dtype(dtype).itemsize


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` positions."""
    return -(-int(num_tokens) // int(page_size))

"""KVCache: per-layer key/value storage for cached decoding (contract in docs/design.md)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rstarjax.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """``k``, ``v``: ``[num_layers, B, S, num_kv_heads, head_dim]``; ``lengths``: int32[B],
    the number of tokens stored per row (row b's valid entries are ``[0, lengths[b])``)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> "KVCache":
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"KVCache.init needs batch > 0 and max_len > 0, got {batch}, {max_len}")
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def replace(self, **changes) -> "KVCache":
        return dataclasses.replace(self, **changes)

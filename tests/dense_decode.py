"""Test support: a dense-cache cached forward of ``Qwen3``, outside the serving engine.

No run decodes this way (rollouts use the paged slot engine, ``models.qwen3.paged_forward``);
it is kept here as a plain reference for cached decoding: every row owns ``max_len`` cache
positions, the layers run one after another in Python, and attention is the masked
``attend`` over the whole cache. ``tests/test_model.py`` checks it against the uncached
forward, ``tests/test_hf_parity.py`` against transformers.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3, attend, decoder_layer, rms_norm, rope_angles


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


def dense_decode(model: Qwen3, tokens: jax.Array, cache: KVCache, num_new: jax.Array
                 ) -> tuple[jax.Array, KVCache]:
    """Per-row cached forward: token i of row b sits at position ``lengths[b] + i``, is written
    there (out-of-range writes dropped, never clamped) and attends to cache entries
    ``<= lengths[b] + i``. Returns f32[B, T, V] logits and the cache with lengths + num_new."""
    cfg = model.config
    if tokens.ndim != 2 or tokens.shape[0] != cache.batch:
        raise ValueError(f"tokens {tokens.shape} must be [B={cache.batch}, T]")
    b, t = tokens.shape
    positions = cache.lengths[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)
    sin, cos = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
    mask = (jnp.arange(cache.max_len)[None, None, :] <= positions[:, :, None])[:, None]  # [B,1,T,S]
    rows = jnp.arange(b)[:, None]
    keys, values = cache.k, cache.v
    x = jnp.take(model.embed[...], tokens, axis=0).astype(cfg.dtype)
    stacked = model.layers.stacked()
    for i in range(cfg.num_hidden_layers):
        def attention(q, k, v, i=i):
            nonlocal keys, values
            # mode="drop" discards writes past max_len instead of clamping onto earlier entries
            keys = keys.at[i, rows, positions].set(k.astype(keys.dtype), mode="drop")
            values = values.at[i, rows, positions].set(v.astype(values.dtype), mode="drop")
            return attend(q, keys[i].astype(q.dtype), values[i].astype(q.dtype), mask,
                          cfg.attention_impl), None

        x, _ = decoder_layer(cfg, {name: a[i] for name, a in stacked.items()}, x, sin, cos,
                             attention)
    h = rms_norm(x, model.final_norm[...], cfg.rms_norm_eps).astype(cfg.dtype)
    weight, vocab_major = model.output_projection()
    logits = jnp.einsum("btd,vd->btv" if vocab_major else "btd,dv->btv", h,
                        weight.astype(cfg.dtype), preferred_element_type=jnp.float32)
    new_cache = KVCache(k=keys, v=values,
                        lengths=cache.lengths + num_new.astype(cache.lengths.dtype))
    return logits.astype(jnp.float32), new_cache

"""Flax NNX Qwen3 dense decoder (and the Qwen2.5 variant via config flags).

Layer parameters are stored *stacked* (leading ``layers`` axis) in one layout whether the
forward runs as ``lax.scan`` (fast compile for 40+ layers) or as an unrolled Python loop, so
checkpoints, sharding rules and HF conversion never depend on ``scan_layers``.

Entry points (docs/design.md):
  ``model(tokens, positions=None, segment_ids=None) -> f32[B, T, V]`` packed training forward;
  ``model.hidden(tokens, positions, segment_ids) -> [B, T, D]`` the same forward up to the final
  norm, and ``model.token_logprobs(...)`` the per-token log-probs and entropies from it with the
  vocabulary projected chunk by chunk (models/logprobs.py: no [B, T, V] for long rows);
  ``paged_forward(cfg, serving_weights(...), tokens, paged_cache, num_new)`` the serving engine's
  forward over a paged KV pool (last-token logits only; layers unrolled over per-layer arrays).
The packed forward's attention is ``models.attention.packed_attention`` (fused / blockwise,
memory linear in T; ``ModelConfig.packed_attention``), the paged forward's with
``models.paged_attention``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from rstarjax.models.attention import choose_implementation, packed_attention, segment_causal_mask
from rstarjax.models import decode_gemm
from rstarjax.models.config import ModelConfig
from rstarjax.models.kv_cache import PagedKVCache
from rstarjax.models.logprobs import token_logprobs_from_hidden
from rstarjax.models.lora import adapter_names, init_adapters, lora_delta, merged_weight
from rstarjax.models.paged_attention import (paged_attention_reference, paged_decode_append,
                                             paged_decode_attention, ragged_decode_attention,
                                             write_kv_pages)
from rstarjax.models.sharding import constrain, logical_to_spec

# Names of the stacked per-layer parameters, in the order HF lists them.
LAYER_PARAM_NAMES = ("input_norm", "q_proj", "q_bias", "k_proj", "k_bias", "v_proj", "v_bias",
                     "q_norm", "k_norm", "o_proj", "post_attention_norm", "gate_proj", "up_proj",
                     "down_proj")


# ---------------------------------------------------------------------------------------------
# Pure building blocks
# ---------------------------------------------------------------------------------------------
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in f32 (as HF Qwen3RMSNorm), result in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) f32[..., head_dim // 2] for integer positions (HF default rope)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x[B, T, heads, head_dim]; sin/cos are [B, T, head_dim // 2]."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
           implementation: str | None) -> jax.Array:
    """GQA attention: q[B,T,N,H], k/v[B,S,K,H], mask bool[B,1,T,S] (True = attend)."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=q.shape[-1] ** -0.5,
                                        implementation=implementation)


# The primitives whose outputs are a fused attention kernel's forward results (its output and
# softmax statistics, what its backward reads): cuDNN's (jax's binding) and the Pallas kernels'.
# A cuDNN call is not a dot, so ``dots`` recomputes it in the backward pass: on an H200 that is
# 16 ms of a 308 ms Qwen3-1.7B step at 8K tokens (docs/training.md, "On a GPU").
ATTENTION_KERNELS = frozenset({"dot_product_attention_fwd_wrapper", "pallas_call"})


def saves_attention(prim, *_, **__) -> bool:
    """Remat policy: keep what the attention kernels return, recompute everything else."""
    return prim.name in ATTENTION_KERNELS


def saves_dots_and_attention(prim, *args, **params) -> bool:
    """Remat policy: ``checkpoint_dots`` and what the attention kernels return."""
    return saves_attention(prim) or jax.checkpoint_policies.checkpoint_dots(prim, *args, **params)


REMAT = {"full": None,
         "dots": jax.checkpoint_policies.checkpoint_dots,
         "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
         "attention": saves_attention,
         "dots_attention": saves_dots_and_attention}


def _remat(fn: Callable, policy: str) -> Callable:
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=REMAT[policy], prevent_cse=False)


def decoder_layer(cfg: ModelConfig, p: dict, x: jax.Array, sin: jax.Array, cos: jax.Array,
                  attention: Callable[[jax.Array, jax.Array, jax.Array], tuple],
                  attention_prepares_qk: bool = False):
    """One pre-norm block. ``attention(q, k, v) -> (out[B,T,N,H], aux)`` abstracts training
    (self-attention with a mask) vs decoding (write into the cache, attend over it).
    ``attention_prepares_qk``: q and k reach ``attention`` as the projections leave them, and it
    applies the q/k RMSNorm and the rotary embedding itself (a decode kernel that does all of
    it in one pass, ``paged_attention.paged_decode_append``)."""
    dt = cfg.dtype
    b, t, _ = x.shape
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def matmul(h, name):
        y = h @ p[name].astype(dt)
        name_a, name_b = adapter_names(name)
        if name_a in p:  # LoRA: + (alpha / r) (h A) B, the adapters unmerged (models/lora.py)
            y = y + lora_delta(h, p[name_a], p[name_b], cfg.lora_scale, dt)
        return y

    def proj(h, name, heads):
        y = matmul(h, name)
        bias = p.get(name.replace("proj", "bias"))
        if bias is not None:
            y = y + bias.astype(dt)
        return y.reshape(b, t, heads, hd)

    h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
    q, k, v = proj(h, "q_proj", nq), proj(h, "k_proj", nkv), proj(h, "v_proj", nkv)
    if cfg.qk_norm and not attention_prepares_qk:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    if not attention_prepares_qk:
        q, k = apply_rope(q, sin, cos), apply_rope(k, sin, cos)
    out, aux = attention(q, k, v)
    x = x + matmul(out.reshape(b, t, nq * hd), "o_proj")
    x = constrain(x, ("batch", "seq", "act_embed"))

    h = rms_norm(x, p["post_attention_norm"], cfg.rms_norm_eps)
    gate = constrain(matmul(h, "gate_proj"), ("batch", "seq", "act_mlp"))
    up = constrain(matmul(h, "up_proj"), ("batch", "seq", "act_mlp"))
    x = x + matmul(jax.nn.silu(gate) * up, "down_proj")
    return constrain(x, ("batch", "seq", "act_embed")), aux


def decode_layer_fused(cfg: ModelConfig, p: dict, x: jax.Array,
                       attention: Callable[[jax.Array, jax.Array, jax.Array], tuple], *,
                       sums: jax.Array | None = None, interpret: bool = False):
    """``decoder_layer`` for a decode step of a served model (one token a row, merged weights,
    ``attention`` applying the q/k norm and the rotary embedding: ``pallas_gpu_packed_layer``, and
    ``pallas_mgpu_packed_layer`` with the Mosaic GPU kernel as that attention),
    with its projections as ``decode_gemm``'s kernels, each taking in the work beside it: the
    input norm and the q/k/v projections in one kernel, the output projection with the residual
    add, the post-attention norm with the gate/up projections and SwiGLU, the down projection
    with the residual add. Four GEMM kernels and the attention a layer; the same arithmetic and
    roundings as ``decoder_layer`` (tests/test_decode_gemm.py) but for summation order.

    Each residual-add kernel also writes its rows' partial sums of squares, which the next
    norm takes instead of re-reading the rows: ``sums`` are x's (the previous layer's; None: the
    input norm sums x itself). -> (x, attention's aux, the sums of the returned x)."""
    if any(adapter_names(name)[0] in p for name in ("q_proj", "o_proj", "gate_proj")):
        raise ValueError("decode_layer_fused serves merged weights (serving_weights): got LoRA adapters")
    dt = cfg.dtype
    b, t, d = x.shape
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    kw = dict(blocking=decode_gemm.GEMM_BLOCKING, interpret=interpret)
    rows = x.reshape(b * t, d)
    q, k, v = decode_gemm.norm_matmul(rows, p["input_norm"], tuple(p[n].astype(dt) for n in (
        "q_proj", "k_proj", "v_proj")), eps=cfg.rms_norm_eps, sums=sums, **kw)

    def heads(y, name, count):
        bias = p.get(name)  # Qwen2.5's q/k/v biases: an add after the kernel
        return (y if bias is None else y + bias.astype(dt)).reshape(b, t, count, hd)

    out, aux = attention(heads(q, "q_bias", nq), heads(k, "k_bias", nkv), heads(v, "v_bias", nkv))
    rows, sums = decode_gemm.matmul_residual(out.reshape(b * t, nq * hd), p["o_proj"].astype(dt), rows,
                                             with_sums=True, **kw)
    (act,) = decode_gemm.norm_matmul(rows, p["post_attention_norm"], (
        p["gate_proj"].astype(dt), p["up_proj"].astype(dt)), eps=cfg.rms_norm_eps, swiglu=True,
        sums=sums, **kw)
    rows, sums = decode_gemm.matmul_residual(act, p["down_proj"].astype(dt), rows, with_sums=True, **kw)
    return rows.reshape(b, t, d), aux, sums


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------
def _hidden_sharded(table: jax.Array) -> bool:
    """Whether the embedding table [V, D] has its hidden dim split (over fsdp) on the current mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and logical_to_spec(("vocab", "embed"), table.shape, mesh)[1] is not None


def embed_lookup(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """Rows of ``table`` [V, D] at ``tokens`` [B, T] -> [B, T, D] in ``dtype``, sharded on batch.

    With the table's D split over fsdp, a lookup has D split over fsdp too: asked straight for
    rows over (data, fsdp), XLA cannot get there on a data x fsdp mesh without gathering the
    whole micro-batch activation onto every device (and its gradient, in the scatter-add).
    So each fsdp group first looks up its data shard's rows with D kept on fsdp (local, no
    weight gather), then one all-to-all inside the group trades D for rows; the backward is the
    reverse all-to-all and a local scatter-add into the table's shard."""
    if _hidden_sharded(table):
        tokens = constrain(tokens, ("lookup_batch", "seq"))
        x = constrain(jnp.take(table, tokens, axis=0), ("lookup_batch", "seq", "embed"))
    else:
        x = jnp.take(table, tokens, axis=0)
    return constrain(x.astype(dtype), ("batch", "seq", "act_embed"))


def _param(rngs: nnx.Rngs | None, shape, dtype, axes, init: str, std: float = 0.02) -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:  # normal with HF's initializer_range (ModelConfig.initializer_range, 0.02 for Qwen)
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


class DecoderLayers(nnx.Module):
    """All decoder layers' parameters, stacked on a leading ``layers`` axis (stored [in, out]).
    With ``cfg.lora_rank`` > 0 also the stacked adapters of ``cfg.lora_targets``
    (``nnx.LoRAParam`` ``<proj>_lora_a`` / ``<proj>_lora_b``, models/lora.py), the rest frozen
    in ``cfg.base_param_dtype``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        L, d, f = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
        q_dim, kv_dim, pd = cfg.num_attention_heads * cfg.head_dim, \
            cfg.num_key_value_heads * cfg.head_dim, cfg.base_param_dtype
        P = lambda shape, axes, init="normal": _param(rngs, (L, *shape), pd, ("layers", *axes), init,
                                                      cfg.initializer_range)
        self.input_norm = P((d,), ("norm",), "ones")
        self.q_proj = P((d, q_dim), ("embed", "q_heads"))
        self.k_proj = P((d, kv_dim), ("embed", "kv_heads"))
        self.v_proj = P((d, kv_dim), ("embed", "kv_heads"))
        self.q_bias = P((q_dim,), ("q_heads",), "zeros") if cfg.attention_bias else None
        self.k_bias = P((kv_dim,), ("kv_heads",), "zeros") if cfg.attention_bias else None
        self.v_bias = P((kv_dim,), ("kv_heads",), "zeros") if cfg.attention_bias else None
        self.q_norm = P((cfg.head_dim,), ("norm",), "ones") if cfg.qk_norm else None
        self.k_norm = P((cfg.head_dim,), ("norm",), "ones") if cfg.qk_norm else None
        self.o_proj = P((q_dim, d), ("q_heads", "embed"))
        self.post_attention_norm = P((d,), ("norm",), "ones")
        self.gate_proj = P((d, f), ("embed", "mlp"))
        self.up_proj = P((d, f), ("embed", "mlp"))
        self.down_proj = P((f, d), ("mlp", "embed"))
        self.lora_names: tuple[str, ...] = ()
        if cfg.lora_rank > 0:
            adapters = init_adapters(cfg, rngs.params())
            for name, var in adapters.items():
                setattr(self, name, var)
            self.lora_names = tuple(adapters)

    def stacked(self) -> dict[str, jax.Array]:
        """Raw stacked arrays by name (absent optional params left out; adapters included)."""
        out = {}
        for name in LAYER_PARAM_NAMES + self.lora_names:
            var = getattr(self, name)
            if var is not None:
                out[name] = var[...]
        return out


class Qwen3(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.base_param_dtype,
                            ("vocab", "embed"), "normal", cfg.initializer_range)
        self.layers = DecoderLayers(cfg, rngs=rngs)
        self.final_norm = _param(rngs, (cfg.hidden_size,), cfg.base_param_dtype, ("norm",), "ones")
        self.lm_head = None if cfg.tie_word_embeddings else _param(
            rngs, (cfg.hidden_size, cfg.vocab_size), cfg.base_param_dtype, ("embed", "vocab"), "normal",
            cfg.initializer_range)

    # ---- shared pieces ---------------------------------------------------------------------
    def _embed(self, tokens: jax.Array) -> jax.Array:
        return embed_lookup(self.embed[...], tokens, self.config.dtype)

    def _logits(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps).astype(cfg.dtype)
        if self.lm_head is None:
            logits = jnp.einsum("btd,vd->btv", h, self.embed[...].astype(cfg.dtype),
                                preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("btd,dv->btv", h, self.lm_head[...].astype(cfg.dtype),
                                preferred_element_type=jnp.float32)
        return constrain(logits.astype(jnp.float32), ("batch", "seq", "act_vocab"))

    def _run_layers(self, x, sin, cos, layer_fn, carry_extra):
        """Apply ``layer_fn(p, x, extra, i) -> (x, extra)`` over all layers, scanned or unrolled
        (same function, same numbers)."""
        cfg = self.config
        params = self.layers.stacked()
        body = _remat(layer_fn, cfg.remat_policy)
        if cfg.scan_layers:
            def step(carry, xs):
                h, extra = carry
                p, i = xs
                return body(p, h, extra, i), None
            (x, carry_extra), _ = jax.lax.scan(
                step, (x, carry_extra), (params, jnp.arange(cfg.num_hidden_layers)))
        else:
            for i in range(cfg.num_hidden_layers):
                p = jax.tree.map(lambda a, i=i: a[i], params)
                x, carry_extra = body(p, x, carry_extra, jnp.asarray(i))
        return x, carry_extra

    # ---- training / scoring forward -------------------------------------------------------
    def _packed_forward(self, tokens: jax.Array, positions: jax.Array | None,
                        segment_ids: jax.Array | None) -> jax.Array:
        """The decoder stack over packed rows: int32[B,T] -> residual stream [B,T,D] (before
        the final norm). Causal attention within a segment (``packed_attention``)."""
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be int32[B, T], got shape {tokens.shape}")
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        if positions.shape != (b, t) or segment_ids.shape != (b, t):
            raise ValueError(f"positions {positions.shape} and segment_ids {segment_ids.shape} "
                             f"must match tokens {tokens.shape}")
        sin, cos = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
        impl = choose_implementation(cfg.packed_attention, t, dtype=cfg.dtype)
        if impl == "dense":  # short rows: one [B,1,T,T] mask shared by every layer
            mask = segment_causal_mask(segment_ids)
            attention = lambda q, k, v: (attend(q, k, v, mask, cfg.attention_impl), None)
        else:
            attention = lambda q, k, v: (packed_attention(
                q, k, v, segment_ids, impl, block=cfg.attention_block_size), None)

        def layer_fn(p, x, extra, i):
            x, _ = decoder_layer(cfg, p, x, sin, cos, attention)
            return x, extra

        x, _ = self._run_layers(self._embed(tokens), sin, cos, layer_fn, ())
        return x

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """int32[B,T] -> f32[B,T,V]. Packed sequences: causal attention within a segment."""
        return self._logits(self._packed_forward(tokens, positions, segment_ids))

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
        """int32[B,T] -> final-normed hidden states [B,T,D] in the compute dtype: the logits are
        ``hidden @ output_projection`` (``output_projection``)."""
        cfg = self.config
        x = self._packed_forward(tokens, positions, segment_ids)
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps).astype(cfg.dtype)

    def output_projection(self) -> tuple[jax.Array, bool]:
        """(weight, vocab_major): the LM head [D, V], or the tied embedding [V, D] (True)."""
        if self.lm_head is None:
            return self.embed[...], True
        return self.lm_head[...], False

    def token_logprobs(self, tokens: jax.Array, positions: jax.Array | None = None,
                       segment_ids: jax.Array | None = None, *, with_entropy: bool = True,
                       temperature: float = 1.0) -> tuple[jax.Array, jax.Array | None]:
        """f32[B,T] log pi(tokens[:, t] | tokens[:, <t]) and the entropy of that distribution
        (column 0 is 0; ``models.logprobs``), the vocabulary projected ``vocab_chunk_len``
        positions at a time. Equal to the log-softmax of ``model(...) / temperature`` gathered
        at the tokens."""
        weight, vocab_major = self.output_projection()
        return token_logprobs_from_hidden(
            self.hidden(tokens, positions, segment_ids), weight, tokens, vocab_major=vocab_major,
            chunk_len=self.config.vocab_chunk_len, with_entropy=with_entropy,
            temperature=temperature)


# ---------------------------------------------------------------------------------------------
# Serving: a cast, per-layer copy of the weights and the paged-cache forward
# ---------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ServingWeights:
    """The weights a serving engine reads: matmul weights cast once to the serving dtype (no
    cast inside every step), norms kept as stored (``rms_norm`` computes in f32 anyway), and
    one dict per layer instead of stacked arrays (a decode step then reads each layer's
    weights as their own buffers, never a slice copy of the stack)."""

    embed: jax.Array
    final_norm: jax.Array
    lm_head: jax.Array | None
    layers: tuple[dict[str, jax.Array], ...]


_UNCAST = ("input_norm", "post_attention_norm", "q_norm", "k_norm")


def serving_config(cfg: ModelConfig, dtype=None) -> ModelConfig:
    """``cfg`` as the serving forward uses it: compute in ``dtype`` (default: ``cfg.dtype``),
    layers unrolled, no remat; the fields that can be lists (token ids) dropped so the config
    hashes (it is a static argument of the engine's jitted programs)."""
    return cfg.replace(dtype=jnp.dtype(dtype or cfg.dtype), scan_layers=False, remat_policy="none",
                       bos_token_id=None, eos_token_id=None, lora_rank=0)  # served merged: no adapters


def serving_weights(model: "Qwen3", dtype, untie_head: bool = False) -> ServingWeights:
    """Copy of ``model``'s weights for serving (call under jit: one program per update).

    ``untie_head``: give a tied model its own ``[hidden, vocab]`` output matrix (a transposed
    copy of the embedding). XLA:CPU multiplies by a transposed matrix several times slower
    (it repacks it every call: most of a small model's decode step); GPUs and TPUs do not
    need the extra copy.

    A LoRA model is served merged: each adapted weight is ``W + (alpha / r) A B``
    (``lora.merged_weight``, computed in float32, stored once in ``dtype``), so under jit the
    merge and the cast are one program, with no merged copy of the model in between."""
    dtype = jnp.dtype(dtype)
    stacked = model.layers.stacked()
    cfg = model.config
    for target in cfg.lora_targets if cfg.lora_rank else ():
        a, b = (stacked.pop(name) for name in adapter_names(target))
        stacked[target] = merged_weight(stacked[target].astype(dtype), a, b, cfg.lora_scale)
    # norms as a plain model stores them (``param_dtype``: a LoRA base's bf16 norms, exactly)
    norm = lambda x: x.astype(cfg.param_dtype)  # noqa: E731
    layers = tuple({name: (norm(a[i]) if name in _UNCAST else a[i].astype(dtype))
                    for name, a in stacked.items()}
                   for i in range(cfg.num_hidden_layers))
    embed = model.embed[...].astype(dtype)
    head = None if model.lm_head is None else model.lm_head[...].astype(dtype)
    if head is None and untie_head:
        head = embed.T
    return ServingWeights(embed=embed, final_norm=norm(model.final_norm[...]), lm_head=head,
                          layers=layers)


# Megatron-style tensor parallelism of the serving copy (docs/serving.md, "Serving slices"):
# column-parallel weights split their output features (whole heads / MLP columns) over the
# tensor axis, row-parallel ones their input features, so a layer's attention and MLP each end
# in one all-reduce that XLA's SPMD partitioner inserts.
_COLUMN_PARALLEL = {"q_proj": "q", "q_bias": "q", "k_proj": "kv", "k_bias": "kv",
                    "v_proj": "kv", "v_bias": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW_PARALLEL = {"o_proj": "q", "down_proj": "mlp"}


def tensor_parallel_splits(cfg: ModelConfig, tensor: int) -> dict[str, bool]:
    """Which groups split over ``tensor`` devices: ``q`` (attention heads), ``kv`` (kv heads:
    k/v projections and the KV pages), ``mlp`` (intermediate columns), ``vocab`` (the output
    head's columns). A group whose count ``tensor`` does not divide stays replicated (correct,
    only less memory-saving): e.g. 8 kv heads on TP-16."""
    return {"q": cfg.num_attention_heads % tensor == 0,
            "kv": cfg.num_key_value_heads % tensor == 0,
            "mlp": cfg.intermediate_size % tensor == 0,
            "vocab": cfg.vocab_size % tensor == 0}


def serving_weight_specs(cfg: ModelConfig, w: ServingWeights, tensor: int,
                         axis: str = "tensor") -> ServingWeights:
    """PartitionSpec of every array of a serving copy ``w`` (arrays or shapes) on a mesh whose
    ``axis`` has ``tensor`` devices: q/k/v and gate/up column-parallel, o and down row-parallel,
    the output head split by vocabulary columns, norms and the embedding replicated."""
    P = jax.sharding.PartitionSpec
    split = tensor_parallel_splits(cfg, tensor) if tensor > 1 else {}

    def layer_spec(name, x):
        if name in _COLUMN_PARALLEL and split.get(_COLUMN_PARALLEL[name]):
            return P(*([None] * (x.ndim - 1)), axis)
        if name in _ROW_PARALLEL and split.get(_ROW_PARALLEL[name]):
            return P(axis, None)
        return P()

    head = None if w.lm_head is None else (P(None, axis) if split.get("vocab") else P())
    return ServingWeights(embed=P(), final_norm=P(), lm_head=head,
                          layers=tuple({n: layer_spec(n, x) for n, x in layer.items()}
                                       for layer in w.layers))


def paged_forward(cfg: ModelConfig, w: ServingWeights, tokens: jax.Array, cache: PagedKVCache,
                  num_new: jax.Array, *, decode_attention: str = "reference",
                  live_pages: tuple[jax.Array, ...] | None = None,
                  interpret: bool = False, kv_sharding=None) -> tuple[jax.Array, PagedKVCache]:
    """Cached forward over a paged pool (docs/design.md): token i of row b sits at position
    ``lengths[b] + i`` (i < ``num_new[b]``; the rest is padding whose writes are dropped), is
    written into the row's page and attends to the row's positions ``<=`` its own. Returns the
    f32 logits of each row's last new token ``[B, V]`` (garbage for rows with ``num_new`` 0)
    and the cache with the new pool and ``lengths + num_new``.

    ``cfg`` is ``serving_config(...)`` (its dtype is the compute dtype). One query per row
    (T = 1, a decode step) uses ``paged_decode_attention(implementation=decode_attention)``,
    or for ``"ragged"`` ``ragged_decode_attention`` over ``live_pages`` (page ids, rows,
    first positions, count); more (prefill, extend) use the pure-JAX reference.
    ``kv_sharding``: the pool's sharding on a tensor-parallel slice (the Pallas kernels then
    run per device on its kv heads)."""
    b, t = tokens.shape
    if cache.page_table.shape[0] != b or num_new.shape != (b,):
        raise ValueError(f"tokens {tokens.shape}, page_table {cache.page_table.shape} and "
                         f"num_new {num_new.shape} must agree on the batch")
    positions = cache.lengths[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)
    valid = jnp.arange(t)[None, :] < num_new[:, None]
    sin, cos = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
    keys, values = list(cache.k), list(cache.v)
    x = jnp.take(w.embed, tokens, axis=0).astype(cfg.dtype)
    # our decode kernels that write the step's K/V themselves (and with "_rope" also apply the
    # q/k norm and the rotary embedding): one kernel between the QKV and output projections
    # ("_layer": also the layer's projections as decode_gemm kernels, norms, SwiGLU and residual
    # adds fused into them: decode_layer_fused; "pallas_mgpu_": the Mosaic GPU kernel)
    in_kernel = t == 1 and decode_attention in ("pallas_gpu_packed_append", "pallas_gpu_packed_rope",
                                                "pallas_gpu_packed_layer", "pallas_mgpu_packed_rope",
                                                "pallas_mgpu_packed_layer")
    prepares_qk = in_kernel and decode_attention != "pallas_gpu_packed_append"
    fused_layer = in_kernel and decode_attention.endswith("_layer")
    sums = None  # the fused layer's sums of squares of x, handed from layer to layer
    for i, p in enumerate(w.layers):
        def attention(q, k, v, i=i, p=p):
            if in_kernel:
                extra = {}
                if prepares_qk:
                    extra = dict(rope=(sin[:, 0], cos[:, 0]), eps=cfg.rms_norm_eps,
                                 qk_norm=(p["q_norm"], p["k_norm"]) if cfg.qk_norm else None)
                out, keys[i], values[i] = paged_decode_append(
                    q[:, 0], k[:, 0], v[:, 0], keys[i], values[i], cache.page_table,
                    positions[:, 0], valid[:, 0], interpret=interpret, kv_sharding=kv_sharding,
                    mosaic=decode_attention.startswith("pallas_mgpu"), **extra)
                return out[:, None], None
            keys[i], values[i] = write_kv_pages(keys[i], values[i], k, v, cache.page_table,
                                                positions, valid)
            if t == 1 and decode_attention == "ragged":
                out = ragged_decode_attention(q[:, 0], keys[i], values[i], *live_pages,
                                              positions[:, 0] + 1)[:, None]
            elif t == 1:
                out = paged_decode_attention(q[:, 0], keys[i], values[i], cache.page_table,
                                             positions[:, 0] + 1, interpret=interpret,
                                             implementation=decode_attention,
                                             kv_sharding=kv_sharding)[:, None]
            else:
                out = paged_attention_reference(q, keys[i], values[i], cache.page_table,
                                                positions)
            return out, None

        if fused_layer:
            x, _, sums = decode_layer_fused(cfg, p, x, attention, sums=sums, interpret=interpret)
        else:
            x, _ = decoder_layer(cfg, p, x, sin, cos, attention, attention_prepares_qk=prepares_qk)
    last = jnp.take_along_axis(x, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)
    h = rms_norm(last, w.final_norm, cfg.rms_norm_eps).astype(cfg.dtype)
    if w.lm_head is None:
        logits = jnp.einsum("btd,vd->btv", h, w.embed, preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("btd,dv->btv", h, w.lm_head, preferred_element_type=jnp.float32)
    new = cache.replace(k=tuple(keys), v=tuple(values),
                        lengths=cache.lengths + num_new.astype(cache.lengths.dtype))
    return logits[:, 0].astype(jnp.float32), new

"""Causal self-attention over packed rows, one entry point with one implementation per backend.

A packed row holds several sequences side by side; ``segment_ids`` int32[B, T] tells them apart
(0 = padding). Token t attends to token s iff ``s <= t`` and ``segment_ids[s] ==
segment_ids[t]`` (``segment_causal_mask``); padding attends to earlier padding, so no query row is
empty and no NaN appears (callers ignore padding outputs).

``packed_attention(q, k, v, segment_ids, implementation)`` picks:

* ``dense``: ``jax.nn.dot_product_attention`` with the ``bool[B, 1, T, T]`` mask. XLA materialises
  the ``[B, N, T, T]`` scores: memory grows as T^2. The reference (and what short rows use on
  CPU).
* ``blockwise``: pure JAX, flash-attention style (Dao et al. 2022, "FlashAttention", arXiv
  2205.14135; backward as FlashAttention-2, arXiv 2307.08691): queries and keys in blocks, an
  online softmax over the key blocks, a custom VJP that recomputes each block's scores from the
  saved log-sum-exp. Never holds more than one ``[B, N, block, block]`` tile: memory linear in T.
  Blocks above the diagonal and blocks whose segment ranges cannot meet are skipped.
* ``splash``: TPU, the Pallas splash-attention kernel that ships with jax
  (``jax.experimental.pallas.ops.tpu.splash_attention``) with a causal mask and segment ids.
* ``pallas_gpu``: NVIDIA (Triton), the Pallas flash-attention kernel that ships with jax
  (``jax.experimental.pallas.ops.gpu.attention.mha``) with ``causal=True`` and segment ids.
* ``cudnn``: NVIDIA, cuDNN fused attention in its packed-sequence layout (per-segment offsets
  and lengths derived from ``segment_ids``; each segment must be one contiguous run, which packed
  rows are). jax 0.10's public ``jax.nn.dot_product_attention(implementation="cudnn")`` only
  takes per-row lengths (padding), not several segments per row, so this goes through the
  function underneath it. A row with more contiguous runs than ``max_segments`` (static shapes)
  is computed by the Pallas kernel instead, under ``lax.cond``: never a wrong answer.
* ``auto``: ``splash`` on TPU, ``cudnn`` on Hopper and later NVIDIA GPUs in bf16/f16 (a
  Qwen3-1.7B train step at 8K tokens on an H100 runs 1.35x faster than with ``pallas_gpu``;
  docs/training.md), ``pallas_gpu`` on earlier ones (cuDNN's packed layout needs Hopper),
  ``blockwise`` for a float32 model on CUDA (cuDNN takes no float32), and elsewhere (CPU,
  ROCm) ``dense`` up to ``DENSE_MAX_LEN`` tokens and ``blockwise`` above (docs/model.md has the
  measurements). A named kernel on an accelerator it does not lower for is refused.

All take ``q[B, T, N, H]`` and ``k, v[B, T, K, H]`` with ``N % K == 0`` (grouped-query attention:
query head n uses key/value head ``n // (N // K)``) and return ``[B, T, N, H]`` in q's dtype.
The Pallas kernels run per device under ``shard_map`` when a mesh is set (``jax.set_mesh``): rows
over the mesh's batch axes, heads over ``tensor`` (logical axes ``batch`` and ``act_heads``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rstarjax.models.config import PACKED_ATTENTION as IMPLEMENTATIONS
from rstarjax.models.sharding import logical_to_spec

# CPU/ROCm ``auto``: rows up to this length use the dense path (as fast there, and exactly the
# numbers of the plain masked attention), longer ones the blockwise path (faster from ~384 tokens
# on CPU, and memory linear in T; docs/model.md).
DENSE_MAX_LEN = 256
# Tiles when none is given: blockwise from the CPU sweep in docs/model.md (64 up to 1K tokens,
# 256 above); splash 512 (the kernel's TPU sweet spot); the Triton kernel 128 (its default).
SPLASH_BLOCK = 512
PALLAS_GPU_BLOCK = 128


def blockwise_block(seq_len: int) -> int:
    """The blockwise tile for rows of ``seq_len`` tokens (fastest on CPU in docs/model.md)."""
    return 64 if seq_len <= 1024 else 256


_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# The dense reference
# ---------------------------------------------------------------------------------------------
def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """bool[B,1,T,T]: token t sees s <= t of the same segment (padding id 0 sees padding, so no
    row is empty and no NaN appears; its outputs are ignored by callers)."""
    t = segment_ids.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal[None] & same)[:, None]


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                    implementation: str | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention`` with the dense segment-causal mask (T^2 memory)."""
    return jax.nn.dot_product_attention(q, k, v, mask=segment_causal_mask(segment_ids),
                                        scale=q.shape[-1] ** -0.5, implementation=implementation)


# ---------------------------------------------------------------------------------------------
# Blockwise (flash) attention in pure JAX
# ---------------------------------------------------------------------------------------------
def _to_blocks(x: jax.Array, n: int, block: int) -> jax.Array:
    """[B, n * block, ...] -> [n, B, block, ...]."""
    return jnp.moveaxis(x.reshape(x.shape[0], n, block, *x.shape[2:]), 1, 0)


def _from_blocks(x: jax.Array) -> jax.Array:
    """[n, B, block, ...] -> [B, n * block, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _blocks_may_meet(q_lo, q_hi, k_lo, k_hi) -> jax.Array:
    """Whether a query block and a key block can share a segment in any row (from each block's
    per-row min/max segment id; conservative: True can still mean no pair meets)."""
    return jnp.any((jnp.maximum(q_lo, k_lo) <= jnp.minimum(q_hi, k_hi)))


def _tile_mask(seg_q, seg_k, i, j, block):
    """bool[B, 1, 1, bq, bk]: same segment and causal, for query block i and key block j."""
    pos_q = i * block + jnp.arange(block)
    pos_k = j * block + jnp.arange(block)
    causal = pos_q[:, None] >= pos_k[None, :]
    same = seg_q[:, :, None] == seg_k[:, None, :]
    return (same & causal[None])[:, None, None]


def _tile_scores(qb, kb, scale):
    """[B, bq, K, G, H] x [B, bk, K, H] -> f32[B, K, G, bq, bk]."""
    return jnp.einsum("bqkgh,bskh->bkgqs", qb, kb, preferred_element_type=jnp.float32) * scale


def _blockwise_forward(q, k, v, seg, block):
    """Online-softmax forward. q[B,Tp,K,G,H], k/v[B,Tp,K,H], seg[B,Tp] with Tp % block == 0.
    Returns out f32[B,Tp,K,G,H] and lse f32[B,K,G,Tp] (-inf where a query sees nothing)."""
    b, tp, nk, g, h = q.shape
    n = tp // block
    scale = h ** -0.5
    qs, ks, vs, segs = (_to_blocks(x, n, block) for x in (q, k, v, seg))
    seg_lo, seg_hi = segs.min(axis=2), segs.max(axis=2)  # [n, B]

    def one_query_block(i):
        qb, sq = qs[i], segs[i]

        def body(j, carry):
            def update(carry):
                acc, m, l = carry
                s = _tile_scores(qb, ks[j], scale)
                s = jnp.where(_tile_mask(sq, segs[j], i, j, block), s, _NEG_INF)
                m_new = jnp.maximum(m, s.max(axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(vs.dtype), vs[j],
                                preferred_element_type=jnp.float32)
                return acc * alpha[..., None] + pv, m_new, l * alpha + p.sum(axis=-1)

            meet = _blocks_may_meet(seg_lo[i], seg_hi[i], seg_lo[j], seg_hi[j])
            return jax.lax.cond(meet, update, lambda c: c, carry)

        init = (jnp.zeros((b, nk, g, block, h), jnp.float32),
                jnp.full((b, nk, g, block), _NEG_INF, jnp.float32),
                jnp.zeros((b, nk, g, block), jnp.float32))
        acc, m, l = jax.lax.fori_loop(0, i + 1, body, init)  # causal: key blocks 0..i only
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), _NEG_INF)
        return jnp.einsum("bkgqh->bqkgh", out), lse

    out, lse = jax.lax.map(one_query_block, jnp.arange(n))
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, nk, g, tp)  # [n,B,K,G,bq] -> [B,K,G,Tp]
    return _from_blocks(out), lse


def _blockwise_backward(q, k, v, seg, out, lse, dout, block):
    """FlashAttention-2 backward: per key block j, loop over query blocks i >= j, recompute the
    tile's probabilities from ``lse`` and accumulate dk_j, dv_j and dq (in place)."""
    b, tp, nk, g, h = q.shape
    n = tp // block
    scale = h ** -0.5
    qs, ks, vs, segs, dos = (_to_blocks(x, n, block) for x in (q, k, v, seg, dout))
    seg_lo, seg_hi = segs.min(axis=2), segs.max(axis=2)
    # delta_t = sum_h dout * out (the softmax-Jacobian correction), per query and head
    delta = jnp.einsum("bqkgh,bqkgh->bkgq", dout.astype(jnp.float32), out.astype(jnp.float32))
    lses = jnp.moveaxis(lse.reshape(b, nk, g, n, block), 3, 0)  # [n, B, K, G, bq]
    deltas = jnp.moveaxis(delta.reshape(b, nk, g, n, block), 3, 0)
    lse_safe = jnp.where(jnp.isfinite(lses), lses, 0.0)

    def one_key_block(dq, j):
        kb, vb, sk = ks[j], vs[j], segs[j]

        def body(i, carry):
            def update(carry):
                dk, dv, dq = carry
                qb, dob = qs[i], dos[i]
                s = _tile_scores(qb, kb, scale)
                mask = _tile_mask(segs[i], sk, i, j, block)
                p = jnp.where(mask, jnp.exp(s - lse_safe[i][..., None]), 0.0)
                dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p.astype(dob.dtype), dob,
                                     preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqkgh,bskh->bkgqs", dob, vb, preferred_element_type=jnp.float32)
                ds = p * (dp - deltas[i][..., None]) * scale
                dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds.astype(qb.dtype), qb,
                                     preferred_element_type=jnp.float32)
                dq_i = jnp.einsum("bkgqs,bskh->bqkgh", ds.astype(kb.dtype), kb,
                                  preferred_element_type=jnp.float32)
                dq = jax.lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i, i, 0)
                return dk, dv, dq

            meet = _blocks_may_meet(seg_lo[i], seg_hi[i], seg_lo[j], seg_hi[j])
            return jax.lax.cond(meet, update, lambda c: c, carry)

        zeros = jnp.zeros((b, block, nk, h), jnp.float32)
        dk, dv, dq = jax.lax.fori_loop(j, n, body, (zeros, zeros, dq))  # causal: i >= j
        return dq, (dk, dv)

    dq0 = jnp.zeros((n, b, block, nk, g, h), jnp.float32)
    dq, (dk, dv) = jax.lax.scan(one_key_block, dq0, jnp.arange(n))
    return _from_blocks(dq), _from_blocks(dk), _from_blocks(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise_core(q, k, v, seg, block):
    out, _ = _blockwise_forward(q, k, v, seg, block)
    return out.astype(q.dtype)


def _blockwise_core_fwd(q, k, v, seg, block):
    out, lse = _blockwise_forward(q, k, v, seg, block)
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, out, lse)


def _blockwise_core_bwd(block, res, dout):
    q, k, v, seg, out, lse = res
    dq, dk, dv = _blockwise_backward(q, k, v, seg, out, lse, dout, block)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_blockwise_core.defvjp(_blockwise_core_fwd, _blockwise_core_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                        block: int | None = None) -> jax.Array:
    """Segment-causal attention in ``block x block`` tiles, values and gradients equal to
    ``dense_attention`` (up to float rounding) with memory linear in T.

    Rows are padded to a multiple of ``block`` with segment id -1 (a fresh segment after every
    real token: real queries never see it)."""
    b, t, nq, h = q.shape
    nk = k.shape[2]
    block = blockwise_block(t) if block is None else block
    if block <= 0:
        raise ValueError(f"block must be > 0, got {block}")
    block = min(block, t)
    tp = -(-t // block) * block
    pad = tp - t
    seg = segment_ids.astype(jnp.int32)
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
    out = _blockwise_core(q.reshape(b, tp, nk, nq // nk, h), k, v, seg, block)
    return out.reshape(b, tp, nq, h)[:, :t]


# ---------------------------------------------------------------------------------------------
# Pallas kernels (TPU splash, GPU Triton) and cuDNN
# ---------------------------------------------------------------------------------------------
def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_rows(q, k, v, segment_ids, multiple: int):
    """Pad T to a multiple of ``multiple``; the pad is segment -1 (never seen by real tokens)."""
    t = q.shape[1]
    pad = _round_up(t, multiple) - t
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)
    return q, k, v, segment_ids.astype(jnp.int32)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                     block: int | None = None, interpret: bool = False) -> jax.Array:
    """TPU splash attention (jax's Pallas kernel): causal mask + segment ids, GQA as one MQA
    kernel per key/value head (the kernel's native grouped form)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, nq, h = q.shape
    nk = k.shape[2]
    g = nq // nk
    blk = min(block or SPLASH_BLOCK, _round_up(t, 128))
    q, k, v, seg = _pad_rows(q, k, v, segment_ids, blk)
    tp = q.shape[1]
    sizes = sa.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk,
                          block_kv_dkv=blk, block_kv_dkv_compute=blk, block_q_dq=blk,
                          block_kv_dq=blk)
    mask = sa.MultiHeadMask([sa.CausalMask((tp, tp))] * g)
    kernel = sa.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)
    # per row and kv head: q [G, Tp, H], k/v [Tp, H]; the kernel applies no scale itself
    qg = jnp.einsum("btkgh->bkgth", q.reshape(b, tp, nk, g, h)) * jnp.asarray(h ** -0.5, q.dtype)
    kg, vg = jnp.einsum("btkh->bkth", k), jnp.einsum("btkh->bkth", v)

    def per_row(qr, kr, vr, sr):
        ids = sa.SegmentIds(q=sr, kv=sr)
        return jax.vmap(lambda a, b_, c: kernel(a, b_, c, segment_ids=ids))(qr, kr, vr)

    out = jax.vmap(per_row)(qg, kg, vg, seg)  # [B, K, G, Tp, H]
    return jnp.einsum("bkgth->btkgh", out).reshape(b, tp, nq, h)[:, :t].astype(q.dtype)


def pallas_gpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                         block: int | None = None, interpret: bool = False) -> jax.Array:
    """NVIDIA (Triton) flash attention, jax's Pallas kernel: ``causal=True`` + segment ids. The
    kernel wants as many key/value heads as query heads, so k/v are repeated per group (their
    gradients sum back through the repeat)."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    t, nq, h = q.shape[1], q.shape[2], q.shape[3]
    g = nq // k.shape[2]
    blk = min(block or PALLAS_GPU_BLOCK, max(16, 1 << (t - 1).bit_length()))  # powers of two
    q, k, v, seg = _pad_rows(q, k, v, segment_ids, blk)
    if g > 1:
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    bwd = min(32, blk)
    sizes = gpu_attention.BlockSizes(block_q=blk, block_k=blk, block_q_dkv=bwd, block_kv_dkv=bwd,
                                     block_q_dq=bwd, block_kv_dq=bwd)
    out = gpu_attention.mha(q, k, v, seg, sm_scale=h ** -0.5, causal=True, block_sizes=sizes,
                            interpret=interpret)
    return out[:, :t]


def segment_run_count(segment_ids: jax.Array) -> jax.Array:
    """int32[B]: contiguous runs of equal ids per row (segments, padding counted)."""
    changes = segment_ids[:, 1:] != segment_ids[:, :-1]
    return 1 + jnp.sum(changes, axis=1, dtype=jnp.int32)


def segment_offsets(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed layout from segment ids: (lengths int32[B, M], offsets int32[B, M + 1]),
    one entry per contiguous run of equal ids (padding included, so padding attends to padding
    as in the dense path), -1 past the row's last run. Rows with more than ``max_segments`` runs
    are not representable (``cudnn_attention`` then uses its fallback)."""
    b, t = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    run = jnp.cumsum(starts, axis=1) - 1  # run index of every token
    lengths = jax.vmap(lambda r: jnp.bincount(r, length=max_segments))(run)
    num_runs = run[:, -1] + 1
    idx = jnp.arange(max_segments)
    offsets = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                               jnp.cumsum(lengths, axis=1).astype(jnp.int32)], axis=1)
    lengths = jnp.where(idx[None] < num_runs[:, None], lengths, -1).astype(jnp.int32)
    offsets = jnp.where(jnp.arange(max_segments + 1)[None] < num_runs[:, None], offsets, -1)
    return lengths, offsets.astype(jnp.int32)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                    max_segments: int = 64, fallback=None) -> jax.Array:
    """cuDNN fused attention with packed segments (causal within each contiguous run).

    Each segment id must occupy one contiguous run (packed rows do); at most ``max_segments``
    runs per row, padding counted (a fixed number, because shapes are static). A batch with a
    row beyond that goes to ``fallback(q, k, v, segment_ids)`` (under ``lax.cond``, so only the
    branch taken runs); without one such a batch comes out NaN: loud, never silently wrong."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_sdpa

    def fused(q, k, v, segment_ids):
        lengths, offsets = segment_offsets(segment_ids, max_segments)
        out = cudnn_sdpa(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                         kv_offsets=offsets, scale=q.shape[-1] ** -0.5,
                         mask_type=MaskType.PADDING_CAUSAL)
        return out.astype(q.dtype)

    too_many = jnp.any(segment_run_count(segment_ids) > max_segments)
    if fallback is None:
        return jnp.where(too_many, jnp.nan, fused(q, k, v, segment_ids)).astype(q.dtype)
    return jax.lax.cond(too_many, lambda *a: fallback(*a).astype(q.dtype), fused,
                        q, k, v, segment_ids)


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------
def device_platform(device=None) -> str:
    """'tpu', 'cuda', 'rocm' or 'cpu' for ``device`` (default: the default backend's first): jax
    names both GPU kinds 'gpu' in places, and the client's platform version tells ROCm apart."""
    device = device or jax.devices()[0]
    platform = device.platform
    if platform == "gpu":
        version = getattr(device.client, "platform_version", "").lower()
        return "rocm" if "rocm" in version else "cuda"
    return platform


def _platform() -> str:
    """'tpu', 'cuda', 'rocm' or 'cpu' for the default backend."""
    return device_platform()


# cuDNN's fused attention in the packed (several segments a row) layout: jax's
# ``fused_attention_stablehlo`` accepts it only on Hopper and later, in half precision
CUDNN_PACKED_MIN_CAPABILITY = 9.0
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
# the accelerators each kernel lowers for (CPU runs the Pallas ones in their interpreter, tests)
KERNEL_PLATFORMS = {"splash": ("tpu", "cpu"), "pallas_gpu": ("cuda", "rocm", "cpu"), "cudnn": ("cuda",)}


def _cuda_capability() -> float | None:
    """The first device's CUDA compute capability (9.0 on an H100), None where it has none."""
    try:
        return float(jax.devices()[0].compute_capability)
    except (AttributeError, TypeError, ValueError):
        return None


def cuda_default(dtype, capability: float | None) -> str:
    """``auto`` on an NVIDIA GPU: cuDNN where its packed layout runs (Hopper or later, bf16/f16:
    1.35x the Pallas kernel's step on an H100, docs/training.md), else the Pallas flash kernel
    (an A100, an L40S: cuDNN's packed layout is refused there), and for float32 the blockwise
    path (cuDNN takes no float32; a float32 model is a precision check, where XLA's own dots
    are the plain reference)."""
    if dtype is not None and jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        return "blockwise"
    if capability is not None and capability < CUDNN_PACKED_MIN_CAPABILITY:
        return "pallas_gpu"
    return "cudnn"


def choose_implementation(implementation: str, seq_len: int, platform: str | None = None,
                          dtype=None, capability: float | None = None) -> str:
    """Resolve ``auto`` for this backend, row length and compute ``dtype`` (docstring of this
    module; ``capability``: the CUDA compute capability, default the first device's), and refuse
    a named kernel on an accelerator it cannot lower for, in one line."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r} not in {IMPLEMENTATIONS}")
    platform = platform or _platform()
    if implementation != "auto":
        where = KERNEL_PLATFORMS.get(implementation)
        if where is not None and platform not in where:
            raise ValueError(f"packed_attention={implementation!r} runs on {'/'.join(where)}, not {platform}: "
                             "use 'auto', 'blockwise' or 'dense'")
        return implementation
    if platform == "tpu":
        return "splash"
    if platform == "cuda":
        return cuda_default(dtype, _cuda_capability() if capability is None else capability)
    return "dense" if seq_len <= DENSE_MAX_LEN else "blockwise"


def _per_device(fn, q, k, v, segment_ids):
    """Run a kernel that only knows one device's arrays under ``shard_map`` when a mesh is set:
    rows split like the ``batch`` logical axis, heads like ``act_heads`` when the key/value
    heads divide over it (then the query heads do too), else whole on every device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(q, k, v, segment_ids)
    P = jax.sharding.PartitionSpec
    rows = logical_to_spec(("batch",), q.shape[:1], mesh)[0]
    heads = logical_to_spec(("act_heads",), (k.shape[2],), mesh)[0]  # divides N too (N % K == 0)
    qkv = P(rows, None, heads, None)
    return jax.shard_map(fn, in_specs=(qkv, qkv, qkv, P(rows, None)), out_specs=qkv,
                         check_vma=False)(q, k, v, segment_ids)


def block_problem(implementation: str, block: int) -> str | None:
    """Why the kernel ``implementation`` cannot take tiles of ``block`` tokens (None: it can):
    splash's key/value blocks are multiples of 128 lanes, Pallas' Triton blocks powers of two."""
    if implementation == "splash" and block % 128:
        return "the splash kernel's blocks are multiples of 128"
    if implementation == "pallas_gpu" and (block < 16 or block & (block - 1)):
        return "the Pallas GPU kernel's blocks are powers of two from 16"
    return None


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                     implementation: str = "auto", *, block: int | None = None,
                     dense_implementation: str | None = None, interpret: bool | None = None,
                     max_segments: int = 64) -> jax.Array:
    """Segment-causal self-attention of packed rows: q[B,T,N,H], k/v[B,T,K,H], segment_ids
    int[B,T] -> [B,T,N,H]. ``implementation``: one of ``IMPLEMENTATIONS`` (module docstring);
    ``block``: the tile (default per implementation, above); ``dense_implementation`` goes to
    ``jax.nn.dot_product_attention`` on the dense path;
    ``interpret`` runs the Pallas kernels in interpret mode (default: on CPU, where they cannot
    be compiled: slow, for tests)."""
    if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {q.shape} must be [B,T,N,H] and k/v {k.shape} [B,T,K,H], N % K == 0")
    if segment_ids.shape != q.shape[:2]:
        raise ValueError(f"segment_ids {segment_ids.shape} must be [B, T] = {q.shape[:2]}")
    impl = choose_implementation(implementation, q.shape[1], dtype=q.dtype)
    if block is not None and (problem := block_problem(impl, block)):
        raise ValueError(f"attention_block_size={block}: {problem}")
    if impl == "dense":
        return dense_attention(q, k, v, segment_ids, dense_implementation)
    if impl == "blockwise":
        return blockwise_attention(q, k, v, segment_ids, block)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if impl == "splash":
        fn = functools.partial(splash_attention, block=block, interpret=interpret)
    elif impl == "pallas_gpu":
        fn = functools.partial(pallas_gpu_attention, block=block, interpret=interpret)
    else:
        fn = functools.partial(cudnn_attention, max_segments=max_segments,
                               fallback=functools.partial(pallas_gpu_attention, block=block,
                                                          interpret=interpret))
    return _per_device(fn, q, k, v, segment_ids)

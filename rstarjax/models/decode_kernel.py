"""Our paged decode-attention kernel (Pallas, lowered to Triton on NVIDIA/AMD GPUs).

One query token per row over the row's pages in the pool (``kv_cache.PagedKVCache`` layout:
K and V ``[kv heads, pages, page size, head dim]``). What it does differently from jax's
``pallas.ops.gpu.paged_attention`` (the ``pallas_gpu`` path), each from the H200 profile of
Qwen3-1.7B decode (docs/serving.md, "Our decode kernel"):

- **GQA packing without padding.** A program holds all G query heads of one kv head (G = 2 for
  Qwen3-1.7B, 4 for 8B) as a ``[G, head dim]`` block and reads that kv head's pages once (a G
  that is not a power of two, 5 for Qwen3-14B, is padded to the next one: Triton's blocks are).
  jax's kernel feeds the tensor cores, whose smallest block is 16 rows, so it pads G to 16 and
  writes 16-row split partials (8x the partial traffic at G = 2). Here the logits
  ``q . k`` and ``p . v`` are broadcast multiply-reduce on the CUDA cores: decode reads each K/V
  element once for G multiply-adds, far below the cores' rate, so the tensor cores buy nothing.
- **Split-K over the live pages, not the table.** jax's kernel cuts the page-table *width*
  into ``k_splits`` equal parts, so a 560-token row in a 4,608-token table sits entirely in
  the first split and the others idle. Here split s of a row reads the s-th share of that
  row's *live* pages (a multiple of ``pages_per_block``), so every split has work.
- **Splits only where the grid needs them.** ``k_splits`` follows the batch: rows x kv heads
  programs already fill the GPU at 256 rows (one split: the kernel normalises and writes the
  output itself, no combine at all); fewer rows get more splits (a small combine in XLA).
- **Page loads in flight.** ``pages_per_block`` pages are gathered per loop iteration and
  Triton software-pipelines the loop over ``num_stages`` stages.

``decode_attention_packed`` is exact against ``paged_attention.paged_attention_reference``
(tests/test_paged_attention.py runs it in Pallas' interpreter on CPU).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

LOW = float(jnp.finfo(jnp.float32).min)  # running-max start: exp(LOW - any real max) == 0


@dataclasses.dataclass(frozen=True)
class PackedBlocking:
    """How the packed kernel cuts its work (static: part of the compiled program).

    ``pages_per_block``: pages gathered per loop iteration (upper bound; reduced to a divisor
    of the table width). ``max_k_splits``: most flash-decoding splits of a row;
    ``target_programs``: the splits are the fewest that make rows x kv heads x splits reach
    it (an H100 has 132 SMs, an H200 too: ~8 programs each). ``num_warps``/``num_stages``:
    Triton's launch and software-pipelining depth. ``tensor_cores``: the two products as
    tensor-core dots instead, the G query heads padded to the 16-row tile inside the program
    (the hedge against CUDA-core math not keeping up; the live-page splits stay)."""
    pages_per_block: int = 4
    max_k_splits: int = 8
    target_programs: int = 1024
    num_warps: int = 4
    num_stages: int = 3
    tensor_cores: int = 0

    def for_shape(self, rows: int, kv_heads: int, width: int, page_size: int = 16,
                  itemsize: int = 2) -> tuple[int, int]:
        """(pages per block, k splits) for a batch of ``rows`` and a table ``width`` wide; at
        most ``MAX_BLOCK_TOKENS`` tokens an iteration (half as many of a float32 pool: the same
        bytes in flight), so larger pages take fewer per block."""
        tokens = MAX_BLOCK_TOKENS * 2 // max(2, itemsize)
        most = max(1, min(self.pages_per_block, tokens // page_size))
        per_block = max(d for d in range(1, most + 1) if width % d == 0)
        wanted = -(-self.target_programs // max(1, rows * kv_heads))
        splits = max(1, min(self.max_k_splits, wanted, width // per_block))
        return per_block, splits


# Tokens a program gathers per loop iteration, at most: K and V of 128 tokens x 128 dims in bf16
# are 64 KB, 192 KB over 3 pipeline stages, under an H100/H200 SM's 228 KB of shared memory
# (a float32 pool's tokens are twice the bytes: half as many, ``PackedBlocking.for_shape``).
MAX_BLOCK_TOKENS = 128

# Read when a decode program is traced (benchmarks/serving.py --packed-blocking sets it).
PACKED_BLOCKING = PackedBlocking()


TILE_ROWS = 16  # the tensor cores' smallest tile: G query heads are padded to it for dots


def query_rows(group: int, tensor_cores: bool) -> int:
    """Rows of a program's q block for ``group`` query heads a kv head: the next power of two
    (Pallas' Triton lowering takes only power-of-two blocks, so Qwen3-14B's G = 5 goes in 8
    rows), at least the 16-row tile for tensor-core dots. The padding rows are zero queries
    (finite through the norm, rope and softmax) whose outputs are sliced off."""
    rows = 1 << (group - 1).bit_length()
    return max(rows, TILE_ROWS) if tensor_cores else rows


def _kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, *refs, page_size: int,
            per_block: int, k_splits: int, scale: float, tensor_cores: bool, append: bool,
            rope: bool, norm: bool, eps: float):
    """Program (row b, kv head h, split s): online softmax over the split's share of the row's
    live pages, ``per_block`` pages an iteration. Refs: lengths [1], table [W], q [G, H],
    k/v [pages, S, H]; with ``append`` also slot [1], k_new/v_new [1, H]; with ``rope`` sin/cos
    [1, H/2]; with ``norm`` the q/k RMSNorm weights [1, H] (inputs); then o [G, H] (one split:
    normalised, q's dtype) or o [G, H], m [G], l [G] in float32 (several: combined by
    ``_combine``), and with ``append`` the two pools again (aliased to k/v).

    ``append``: the row's last token (position ``length - 1``) is not read from the pool but
    taken from k_new/v_new, which split 0 starts its softmax with and writes into the pool at
    ``slot`` (page * S + offset; -1: no write). The other splits stop one token earlier, so no
    program reads the position being written.

    ``rope`` (with ``append``): q and k_new arrive as the QKV projection leaves them; the kernel
    applies the q/k RMSNorm (``norm``) and the rotary embedding itself, rounding where the
    model's ``rms_norm`` and ``apply_rope`` round (to q's dtype after each). Rotate-half works on
    the two halves of the head dimension, so q stays two halves and the keys are read as two:
    ``q . k = q1 . k1 + q2 . k2`` (Triton has no concatenate to rebuild the rotated q)."""
    refs = list(refs)
    if append:
        slot_ref, k_new_ref, v_new_ref = refs[:3]
        refs = refs[3:]
    if rope:
        sin_ref, cos_ref = refs[:2]
        refs = refs[2:]
    if norm:
        q_norm_ref, k_norm_ref = refs[:2]
        refs = refs[2:]
    out_refs = refs[:-2] if append else refs
    split = pl.program_id(2)
    length = lengths_ref[0]
    cached = length - 1 if append else length  # tokens read from the pool
    live_blocks = pl.cdiv(pl.cdiv(cached, page_size), per_block)
    share = pl.cdiv(live_blocks, k_splits)  # blocks per split
    first = split * share
    last = jnp.minimum(first + share, live_blocks)
    g, h = q_ref.shape
    half = h // 2
    tokens = per_block * page_size
    pool_dtype = refs[-1].dtype if append else k_ref.dtype
    # a float32 pool's tensor-core dots in full float32: without a precision Pallas' Triton
    # lowering makes them TF32 (~1e-3 off), and a float32 pool is here to be exact
    exact_dots = jax.lax.Precision.HIGHEST if pool_dtype == jnp.float32 else None

    def prepared(x_ref, norm_ref):
        """(x1, x2) float32 halves of x after the RMSNorm and the rotary embedding."""
        dtype = x_ref.dtype
        x1 = x_ref[:, pl.ds(0, half)].astype(jnp.float32)
        x2 = x_ref[:, pl.ds(half, half)].astype(jnp.float32)
        if norm:
            inv = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / h + eps)
            w1 = norm_ref[:, pl.ds(0, half)].astype(jnp.float32)
            w2 = norm_ref[:, pl.ds(half, half)].astype(jnp.float32)
            x1 = (w1 * (x1 * inv[:, None])).astype(dtype).astype(jnp.float32)
            x2 = (w2 * (x2 * inv[:, None])).astype(dtype).astype(jnp.float32)
        sin, cos = sin_ref[...], cos_ref[...]
        return ((x1 * cos - x2 * sin).astype(dtype).astype(jnp.float32),
                (x2 * cos + x1 * sin).astype(dtype).astype(jnp.float32))

    def scores(qs, ks, dots=tensor_cores):
        """[G, T] float32 logits of the query parts qs against the key parts ks [T, ...]."""
        total = 0.0
        for qp, kp in zip(qs, ks):
            if dots:  # q rounded to the pool's dtype, float32 accumulation
                total = total + jnp.dot(qp.astype(kp.dtype), kp.T, precision=exact_dots,
                                        preferred_element_type=jnp.float32)
            else:
                total = total + jnp.sum(qp[:, None, :] * kp.astype(jnp.float32)[None, :, :], axis=2)
        return total

    if rope:
        qs = tuple(x * scale for x in prepared(q_ref, q_norm_ref if norm else None))
    else:
        qs = (q_ref[...].astype(jnp.float32) * scale,)  # [G, H]

    def body(i, carry):
        o, m, l = carry  # [G, H], [G], [G] (float32)
        start = i * per_block
        ids = table_ref[pl.ds(start, per_block)]
        if rope:
            ks = (k_ref[ids, :, pl.ds(0, half)].reshape(tokens, half),
                  k_ref[ids, :, pl.ds(half, half)].reshape(tokens, half))
        else:
            ks = (k_ref[ids].reshape(tokens, h),)
        v = v_ref[ids].reshape(tokens, h)
        logits = scores(qs, ks)
        pos = start * page_size + jnp.arange(tokens)
        logits = jnp.where((pos < cached)[None, :], logits, LOW)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        if tensor_cores:  # p rounded to the pool's dtype, as the reference does
            pv = jnp.dot(p.astype(v.dtype), v, precision=exact_dots,
                         preferred_element_type=jnp.float32)
        else:
            pv = jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)
        o = o * alpha[:, None] + pv
        return o, m_new, l

    o0, m0, l0 = (jnp.zeros((g, h), jnp.float32), jnp.full((g,), LOW, jnp.float32),
                  jnp.zeros((g,), jnp.float32))
    if append:  # split 0 starts from the new token: its logit is the running max, p = 1
        if rope:  # k_new's parts as the pool will hold them
            k_parts = tuple(x.astype(pool_dtype) for x in prepared(k_new_ref, k_norm_ref if norm else None))
        else:
            k_parts = (k_new_ref[...].astype(pool_dtype),)
        v_new = v_new_ref[...].astype(pool_dtype)
        mine = split == 0
        # one key: products, not a dot (a tensor-core dot needs 16 columns), q rounded as in one
        q_new = tuple(x.astype(pool_dtype).astype(jnp.float32) for x in qs) if tensor_cores else qs
        m0 = jnp.where(mine, scores(q_new, k_parts, dots=False)[:, 0], m0)
        l0 = jnp.where(mine, jnp.ones_like(l0), l0)
        o0 = jnp.where(mine, jnp.broadcast_to(v_new.astype(jnp.float32), (g, h)), o0)
    o, m, l = jax.lax.fori_loop(first, last, body, (o0, m0, l0))
    if k_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l
    if append:
        k_out_ref, v_out_ref = refs[-2:]
        slot = slot_ref[0]

        @pl.when((split == 0) & (slot >= 0))
        def _write():
            page, at = slot // page_size, pl.ds(slot % page_size, 1)
            if rope:
                k_out_ref[page, at, pl.ds(0, half)] = k_parts[0]
                k_out_ref[page, at, pl.ds(half, half)] = k_parts[1]
            else:
                k_out_ref[page, at, :] = k_parts[0]
            v_out_ref[page, at, :] = v_new


def _combine(o, m, l, dtype):
    """Flash-decoding's last step: splits' partials [S, B, K, G, (H)] -> [B, K, G, H]."""
    top = jnp.max(m, axis=0)
    w = jnp.exp(m - top[None])  # an empty split: exp(LOW - top) == 0
    total = jnp.sum(l * w, axis=0)
    return (jnp.sum(o * w[..., None], axis=0) / total[..., None]).astype(dtype)


@functools.partial(jax.jit, static_argnames=("blocking", "scale", "interpret"))
def decode_attention_packed(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            page_table: jax.Array, lengths: jax.Array, *,
                            blocking: PackedBlocking = PackedBlocking(),
                            scale: float | None = None, interpret: bool = False) -> jax.Array:
    """q [B, N, H] (unscaled; ``scale``, default ``H ** -0.5``, applied in float32 inside) over each row's first ``lengths[b]``
    tokens (>= 1) of its pages ``page_table[b]`` (entries past the live ones are never read
    for K/V a row does not own: the positions mask them; they must be valid page ids) ->
    [B, N, H]. GQA: query head n reads kv head ``n // (N // K)``."""
    return _packed_call(q, k_pages, v_pages, page_table, lengths, None, blocking=blocking,
                        scale=scale, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("blocking", "scale", "interpret", "eps"))
def decode_attention_append(q: jax.Array, k_new: jax.Array, v_new: jax.Array, slots: jax.Array,
                            k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                            lengths: jax.Array, *, blocking: PackedBlocking = PackedBlocking(),
                            scale: float | None = None, interpret: bool = False,
                            rope: tuple[jax.Array, jax.Array] | None = None,
                            qk_norm: tuple[jax.Array, jax.Array] | None = None, eps: float = 1e-6
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decode step's K/V write and attention in one kernel: each row's new token k_new /
    v_new [B, K, H] is written into the pools at ``slots[b]`` (page id * page size + offset;
    -1: not written) and attended to as the row's last token (position ``lengths[b] - 1``),
    its earlier ``lengths[b] - 1`` tokens read from the pages. -> (out [B, N, H], k_pages,
    v_pages), the pools updated in place (``input_output_aliases``: inside a program that
    carries them, as the engine's decode loop does, no copy). The same result as
    ``paged_attention.write_kv_pages`` followed by ``decode_attention_packed``, without the two
    scatter kernels a layer; a row whose write is dropped (-1) still attends to its k_new /
    v_new (the engine ignores those rows' outputs).

    ``rope`` (sin, cos [B, H/2], ``qwen3.rope_angles`` of the rows' positions): q and k_new are
    the QKV projection's output; the kernel applies ``qk_norm`` (the q and k RMSNorm weights [H],
    epsilon ``eps``; None: no norm) and the rotary embedding to both, as ``qwen3.decoder_layer``
    does before attention, so those kernels go too."""
    if qk_norm is not None and rope is None:
        raise ValueError("qk_norm is applied with the rotary embedding: give rope too")
    return _packed_call(q, k_pages, v_pages, page_table, lengths, (slots, k_new, v_new),
                        blocking=blocking, scale=scale, interpret=interpret, rope=rope,
                        qk_norm=qk_norm, eps=eps)


def _packed_call(q, k_pages, v_pages, page_table, lengths, new_kv, *, blocking, scale, interpret,
                 rope=None, qk_norm=None, eps=1e-6):
    from jax.experimental.pallas import triton as plgpu

    b, n, h = q.shape
    kh, _, page_size, _ = k_pages.shape
    g = n // kh
    width = page_table.shape[1]
    per_block, k_splits = blocking.for_shape(b, kh, width, page_size, k_pages.dtype.itemsize)
    append = new_kv is not None
    kernel = functools.partial(_kernel, page_size=page_size, per_block=per_block,
                               k_splits=k_splits, scale=h ** -0.5 if scale is None else scale,
                               tensor_cores=bool(blocking.tensor_cores), append=append,
                               rope=rope is not None, norm=qk_norm is not None, eps=eps)
    rows = query_rows(g, bool(blocking.tensor_cores))
    q4 = jnp.pad(q.reshape(b, kh, g, h), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    pool = pl.BlockSpec((None, *k_pages.shape[1:]), lambda r, j, s: (j, 0, 0, 0))
    in_specs = [pl.BlockSpec((None, 1), lambda r, j, s: (r, 0)),  # lengths [B, 1]
                pl.BlockSpec((None, width), lambda r, j, s: (r, 0)),  # the row's table
                pl.BlockSpec((None, None, rows, h), lambda r, j, s: (r, j, 0, 0)),  # q [B, K, G, H]
                pool, pool]
    args = [lengths.astype(jnp.int32).reshape(b, 1), page_table.astype(jnp.int32), q4,
            k_pages, v_pages]
    if k_splits == 1:
        out_specs = [pl.BlockSpec((None, None, rows, h), lambda r, j, s: (r, j, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, kh, rows, h), q.dtype)]
    else:
        part = (k_splits, b, kh, rows)
        out_specs = [pl.BlockSpec((None, None, None, rows, h), lambda r, j, s: (s, r, j, 0, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda r, j, s: (s, r, j, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda r, j, s: (s, r, j, 0))]
        out_shape = [jax.ShapeDtypeStruct((*part, h), jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32)]
    aliases = {}
    if append:
        slots, k_new, v_new = new_kv
        token = pl.BlockSpec((None, None, 1, h), lambda r, j, s: (r, j, 0, 0))  # [B, K, 1, H]
        in_specs += [pl.BlockSpec((None, 1), lambda r, j, s: (r, 0)), token, token]
        args += [slots.astype(jnp.int32).reshape(b, 1), k_new.reshape(b, kh, 1, h),
                 v_new.reshape(b, kh, 1, h)]  # cast to the pool's dtype inside
        if rope is not None:
            angle = pl.BlockSpec((None, 1, h // 2), lambda r, j, s: (r, 0, 0))  # [B, 1, H/2]
            in_specs += [angle, angle]
            args += [x.astype(jnp.float32).reshape(b, 1, h // 2) for x in rope]
        if qk_norm is not None:
            weight = pl.BlockSpec((1, h), lambda r, j, s: (0, 0))  # [1, H]
            in_specs += [weight, weight]
            args += [x.reshape(1, h) for x in qk_norm]
        out_specs += [pool, pool]
        out_shape += [jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                      jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)]
        aliases = {3: len(out_shape) - 2, 4: len(out_shape) - 1}  # the pools, in place
    outs = pl.pallas_call(
        kernel, grid=(b, kh, k_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=blocking.num_warps,
                                             num_stages=blocking.num_stages),
        name=f"decode_attention_{'append' if append else 'packed'}_g{rows}_p{per_block}_s{k_splits}",
    )(*args)
    if append:
        *outs, k_pages, v_pages = outs
    out = outs[0] if k_splits == 1 else _combine(*outs, q.dtype)
    out = out[:, :, :g].reshape(b, n, h)
    return (out, k_pages, v_pages) if append else out

"""Attention over a paged KV pool (layout in ``kv_cache.PagedKVCache``).

- ``write_kv_pages``: scatter new keys/values into their rows' pages; writes of padding tokens
  (and any position without a page) are dropped, never redirected onto another row's page.
- ``paged_attention_reference``: pure JAX, any backend, any number of query tokens per row:
  gathers the rows' pages named by the page table and runs masked softmax attention (float32
  logits and softmax, like ``jax.nn.dot_product_attention``). Query i of row b at position
  ``positions[b, i]`` sees the row's tokens at positions ``<= positions[b, i]``. It is the
  reference every kernel below is tested against, and the path for prefill/extend everywhere.
- ``ragged_decode_attention``: one query token per row over a list of exactly the decoding
  rows' live pages, pure JAX (segment max/sum per row): the portable decode path.
- ``paged_decode_attention``: one query token per row, dispatched to jax's shipped Pallas
  kernels where they apply: ``pallas.ops.gpu.paged_attention`` (Triton, NVIDIA) and
  ``pallas.ops.tpu.paged_attention`` (Mosaic, TPU). Both read only a row's live pages (they
  stop at its length) straight from the pool layout, so a decode step costs the live tokens,
  not the rows' maximum. ``DECODE_IMPLEMENTATIONS`` lists the choices;
  ``default_decode_implementation`` picks one per platform (docs/serving.md explains what is
  not used and why: the GPU ``decode_attention`` reads contiguous per-row K/V, not pages; the
  TPU ``ragged_paged_attention`` needs K and V interleaved in one array and its interpret mode
  cannot run on CPU in this jax, so it could not be tested against the reference here).
  ``pallas_gpu_packed`` is our own kernel (``decode_kernel.py``): all query heads of a kv head
  in one block without padding, split-K over the live pages; chosen by name until a GPU
  measures it against ``pallas_gpu`` (docs/serving.md, "Our decode kernel").
- ``paged_decode_append``: the same kernel writing the step's K/V itself
  (``pallas_gpu_packed_append``: no scatter kernels between the projections and attention),
  and also applying the q/k RMSNorm and the rotary embedding (``pallas_gpu_packed_rope``: the
  QKV projection's output goes straight into the kernel); ``pallas_gpu_packed_layer`` is that
  kernel with the layer's projections as ``decode_gemm`` kernels (``qwen3.decode_layer_fused``).
  ``pallas_mgpu_packed`` is the packed kernel's work as a Mosaic GPU kernel for Hopper
  (``decode_kernel_mgpu.py``): the pages copied by the TMA several blocks ahead, both products
  on the tensor cores; bfloat16/float16 pools, NVIDIA H100/H200 only. ``pallas_mgpu_packed_rope``
  is that kernel with ``pallas_gpu_packed_rope``'s work in it (``paged_decode_append(mosaic=True)``:
  the step's K/V written, the q/k RMSNorm and the rotary embedding applied in the kernel), and
  ``pallas_mgpu_packed_layer`` is ``pallas_gpu_packed_layer`` with that kernel as its attention.
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from rstarjax.models.attention import device_platform
from rstarjax.models.kv_cache import NO_PAGE

DECODE_IMPLEMENTATIONS = ("reference", "ragged", "pallas_gpu", "pallas_gpu_packed",
                          "pallas_gpu_packed_append", "pallas_gpu_packed_rope",
                          "pallas_gpu_packed_layer", "pallas_mgpu_packed", "pallas_mgpu_packed_rope",
                          "pallas_mgpu_packed_layer", "pallas_tpu")
QUERY_BLOCK = 256  # queries per block in the reference: bounds the [T, context] logits buffer
RAGGED_CHUNK = 64  # pages per iteration of the ragged decode attention
RAGGED_LIST_STEP = 16  # a list of at most RAGGED_CHUNK pages is padded to a multiple of this


def write_kv_pages(k_pages: jax.Array, v_pages: jax.Array, k_new: jax.Array, v_new: jax.Array,
                   page_table: jax.Array, positions: jax.Array, valid: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
    """Write ``k_new``/``v_new`` [B, T, K, H] at ``positions`` [B, T] of their rows.

    ``valid`` [B, T] marks real tokens; the others (padding, idle rows) and positions whose
    page-table entry is ``NO_PAGE`` or past the table are dropped (scatter ``mode="drop"`` to
    an out-of-range page id)."""
    page, offset = write_targets(page_table, positions, valid, *k_pages.shape[1:3])
    # Index [:, page, offset] puts the broadcast [B, T] dims after the kv-head dim.
    k_pages = k_pages.at[:, page, offset].set(
        jnp.moveaxis(k_new, 2, 0).astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[:, page, offset].set(
        jnp.moveaxis(v_new, 2, 0).astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages


def write_targets(page_table: jax.Array, positions: jax.Array, valid: jax.Array, num_pages: int,
                  page_size: int) -> tuple[jax.Array, jax.Array]:
    """(page id, offset in the page) where each token at ``positions`` is written; page id
    ``num_pages`` (out of range) for a write that is dropped: ``valid`` false, past the table,
    or a ``NO_PAGE`` entry."""
    width = page_table.shape[1]
    col = positions // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(col, 0, width - 1), axis=1)
    keep = valid & (col < width) & (page != NO_PAGE)
    return jnp.where(keep, page, num_pages), positions % page_size


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """[K, N, S, H] pool, [B, P] table -> [K, B, P * S, H]: each row's positions in order
    (kv heads stay leading: attention then contracts without transposing the gathered K/V)."""
    kh, _, s, h = pages.shape
    b, p = page_table.shape
    return pages[:, jnp.maximum(page_table, 0)].reshape(kh, b, p * s, h)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              page_table: jax.Array, positions: jax.Array) -> jax.Array:
    """q [B, T, N, H] at ``positions`` [B, T] -> [B, T, N, H] (GQA, scale ``H ** -0.5``)."""
    b, t, n, h = q.shape
    kh = k_pages.shape[0]
    g = n // kh
    keys = gather_pages(k_pages, page_table)  # [K, B, C, H]
    values = gather_pages(v_pages, page_table)
    context = keys.shape[2]
    scale = h ** -0.5

    def block(qb, pos):  # qb [B, t', N, H], pos [B, t']
        tb = qb.shape[1]
        # [K, B, t' * G, H]: the query rows of one kv head, next to its keys.
        qk = jnp.moveaxis(qb.reshape(b, tb, kh, g, h), 2, 0).reshape(kh, b, tb * g, h)
        logits = jnp.einsum("kbqh,kbch->kbqc", qk, keys.astype(qb.dtype),
                            preferred_element_type=jnp.float32) * scale
        seen = jnp.arange(context)[None, None, :] <= pos[:, :, None]  # [B, t', C]
        seen = jnp.repeat(seen, g, axis=1)[None]  # [1, B, t' * G, C]
        logits = jnp.where(seen, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(values.dtype)
        out = jnp.einsum("kbqc,kbch->kbqh", probs, values, preferred_element_type=jnp.float32)
        out = jnp.moveaxis(out.reshape(kh, b, tb, g, h), 0, 2)  # [B, t', K, G, H]
        return out.reshape(b, tb, n, h).astype(q.dtype)

    if t <= QUERY_BLOCK or t % QUERY_BLOCK:
        return block(q, positions)
    nb = t // QUERY_BLOCK
    qs = jnp.moveaxis(q.reshape(b, nb, QUERY_BLOCK, n, h), 1, 0)
    ps = jnp.moveaxis(positions.reshape(b, nb, QUERY_BLOCK), 1, 0)
    out = jax.lax.map(lambda a: block(*a), (qs, ps))  # one block's logits live at a time
    return jnp.moveaxis(out, 0, 1).reshape(b, t, n, h)


def ragged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            page_ids: jax.Array, page_rows: jax.Array, page_starts: jax.Array,
                            num_listed: jax.Array, lengths: jax.Array, *,
                            chunk: int = RAGGED_CHUNK) -> jax.Array:
    """One query per row over exactly the listed pages, pure JAX: q [B, N, H] -> [B, N, H].

    ``page_ids``/``page_rows``/``page_starts`` [M]: the pages to read, the row each belongs to
    and the position of its first token; only the first ``num_listed`` entries count. Row b
    sees its first ``lengths[b]`` tokens. A list of at most ``chunk`` entries is read in one
    pass (the engine pads it to a multiple of ``RAGGED_LIST_STEP``, so a short list reads
    about its live pages, not a whole chunk); a longer one (M a multiple of ``chunk``, fixed
    per batch bucket) ``chunk`` pages at a time in a loop of ``ceil(num_listed / chunk)``
    iterations with an online softmax per row (running max, sum and output). Either way the
    work follows the live pages of the decoding rows, not every row times the longest one.
    The portable decode path (CPU)."""
    b, n, h = q.shape
    kh, _, s, _ = k_pages.shape
    g = n // kh
    chunk = min(chunk, page_ids.shape[0])
    if page_ids.shape[0] % chunk:
        raise ValueError(f"{page_ids.shape[0]} listed-page entries: not a multiple of {chunk}")
    # Materialise q: fused into the per-page gather, its producers (norm, rope) would be
    # recomputed once per page instead of once per row.
    q4 = jax.lax.optimization_barrier(q).reshape(b, kh, g, h)
    low = jnp.finfo(jnp.float32).min

    def body(c, carry):
        m, l, o = carry  # running max [B, K, G], sum [B, K, G], output [B, K, G, H] (f32)
        ids, rows, starts = (jax.lax.dynamic_slice_in_dim(a, c * chunk, chunk)
                             for a in (page_ids, page_rows, page_starts))
        listed = c * chunk + jnp.arange(chunk) < num_listed
        rows = jnp.where(listed, rows, b)  # unlisted entries: out of range, dropped below
        r = jnp.clip(rows, 0, b - 1)
        keys, values = k_pages[:, jnp.maximum(ids, 0)], v_pages[:, jnp.maximum(ids, 0)]
        logits = jnp.einsum("ckgh,kcsh->ckgs", q4[r], keys.astype(q.dtype),
                            preferred_element_type=jnp.float32) * h ** -0.5
        pos = starts[:, None] + jnp.arange(s)[None, :]
        seen = (rows < b)[:, None] & (pos < lengths[r][:, None])  # [C, S]
        logits = jnp.where(seen[:, None, None], logits, low)
        m_new = jnp.maximum(m, jax.ops.segment_max(logits.max(-1), rows, num_segments=b))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[r][..., None]) * seen[:, None, None]
        l = l * alpha + jax.ops.segment_sum(p.sum(-1), rows, num_segments=b)
        pv = jnp.einsum("ckgs,kcsh->ckgh", p.astype(values.dtype), values,
                        preferred_element_type=jnp.float32)
        o = o * alpha[..., None] + jax.ops.segment_sum(pv, rows, num_segments=b)
        return m_new, l, o

    init = (jnp.full((b, kh, g), low, jnp.float32), jnp.zeros((b, kh, g), jnp.float32),
            jnp.zeros((b, kh, g, h), jnp.float32))
    if page_ids.shape[0] == chunk:  # one chunk: no loop (its overhead is a small model's step)
        _, l, o = body(0, init)
    else:
        _, l, o = jax.lax.fori_loop(0, (num_listed + chunk - 1) // chunk, body, init)
    out = o / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]
    return out.reshape(b, n, h).astype(q.dtype)


# jax's Triton kernel and ours (decode_kernel.py): Pallas' Triton lowering takes their blocks
TRITON_IMPLEMENTATIONS = ("pallas_gpu", "pallas_gpu_packed", "pallas_gpu_packed_append",
                          "pallas_gpu_packed_rope", "pallas_gpu_packed_layer")


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kernel_problems(implementation: str, *, head_dim: int, page_size: int) -> list[str]:
    """Why ``implementation`` cannot lower for a pool of ``head_dim`` and ``page_size`` (empty: it
    can, or it is no Triton/TPU kernel; the Mosaic GPU kernel has its own,
    ``decode_kernel_mgpu.problems``), each reason naming the dimension first. Pallas' Triton
    lowering takes only blocks of a power-of-two size (a block of pages [pages, page_size,
    head_dim], the [G, head_dim] queries), so a 48-token page or Qwen2's head_dim 80 fails there
    at the first decode; the TPU kernel's blocks end in 128 lanes of head_dim."""
    out = []
    if implementation in TRITON_IMPLEMENTATIONS:
        out += [f"{name} {value} (Pallas' Triton lowering takes power-of-two blocks only)"
                for name, value in (("head_dim", head_dim), ("page_size", page_size))
                if not _power_of_two(value)]
    if implementation == "pallas_tpu" and head_dim % 128:
        out.append(f"head_dim {head_dim} (the TPU kernel's blocks are multiples of 128 lanes)")
    return out


def default_decode_implementation(platform: str | None = None, *, head_dim: int = 128,
                                  page_size: int = 16, kv_dtype=jnp.bfloat16) -> str:
    """The decode attention for a platform ("cuda", "rocm", "tpu", "cpu"; default: the first
    device's) and a pool of ``kv_dtype``: the shipped Pallas kernel where its constraints hold
    (``kernel_problems``; 16-token multiples for its tensor-core tiles), else the portable
    ``ragged`` path. A float32 pool is kept off both shipped kernels, whose products are not
    float32, so a float32 engine's log-probs would be off by ~1e-3 from the trainer's
    (tests/test_engine_differential.py): the TPU kernel rounds K and V to bfloat16 inside (jax's
    ``paged_attention_kernel``, ``_maybe_dequantize``), and on CUDA jax's kernel's dots carry no
    precision, which Pallas' Triton lowering makes TF32. There a float32 pool takes the ``ragged``
    path, whose einsums are XLA's dots at the precision of every other matmul of the engine and
    the trainer (``jax_default_matmul_precision``): not our ``pallas_gpu_packed``, exact in its
    interpreter but not yet run on a GPU (docs/serving.md)."""
    platform = platform or device_platform()
    shape = dict(head_dim=head_dim, page_size=page_size)
    half_width = jnp.dtype(kv_dtype).itemsize <= 2
    tiles = head_dim % 16 == 0 and page_size % 16 == 0
    if platform in ("cuda", "gpu"):
        if half_width and tiles and not kernel_problems("pallas_gpu", **shape):
            return "pallas_gpu"
    if platform == "tpu" and tiles and half_width and not kernel_problems("pallas_tpu", **shape):
        return "pallas_tpu"
    return "ragged"  # CPU; ROCm (the Triton kernel is untested there); odd shapes


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class PallasGpuBlocking:
    """How the Triton paged-attention kernel cuts its work. A row's page-table columns are
    split into ``k_splits`` partitions (combined afterwards, flash-decoding style), each read
    ``pages_per_block`` pages per iteration; the values are upper bounds, reduced to divisors
    of the table width. jax's defaults are (8, 16, 8 warps, 2 stages); ours read fewer pages
    per iteration with fewer warps. On an H200 inside the engine (Qwen3-1.7B, docs/serving.md)
    they decoded faster in both runs there were, on two machines: 1.07x and 1.08x at 64 rows,
    1.19x and 1.18x at 256 rows (each the median of 16 calls of 16 steps)."""
    pages_per_block: int = 4
    max_k_splits: int = 8
    num_warps: int = 4
    num_stages: int = 2

    def for_width(self, width: int) -> tuple[int, int]:
        """(pages per compute block, k splits) for a page table ``width`` columns wide."""
        per_block = _largest_divisor(width, self.pages_per_block)
        return per_block, _largest_divisor(width // per_block, self.max_k_splits)


# Read when a decode program is traced: benchmarks/serving.py --pallas-blocking sets it to
# compare blockings inside the engine.
PALLAS_GPU_BLOCKING = PallasGpuBlocking()


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           page_table: jax.Array, lengths: jax.Array, *,
                           implementation: str = "reference", interpret: bool = False,
                           kv_sharding: jax.sharding.NamedSharding | None = None
                           ) -> jax.Array:
    """One query per row: q [B, N, H] attends to the row's first ``lengths[b]`` tokens
    (including the one just written). -> [B, N, H].

    ``interpret=True`` runs the kernel in its interpreter (CPU tests): Pallas' for the Triton
    kernels, Mosaic GPU's for ``pallas_mgpu_packed``, the TPU interpreter (``pltpu.force_tpu_interpret_mode``, which also works around
    the call) for the TPU one. ``kv_sharding``: the pool's sharding on a tensor-parallel slice; where it splits the
    kv heads, a Pallas kernel runs once per device on that device's heads (``shard_map``:
    XLA cannot partition a kernel call itself)."""
    if kv_sharding is not None and implementation.startswith("pallas") \
            and split_kv_axis(kv_sharding) is not None:
        return _per_kv_head_shard(q, k_pages, v_pages, page_table, lengths, kv_sharding,
                                  implementation=implementation, interpret=interpret)
    if implementation == "reference":
        pos = (lengths - 1)[:, None]
        return paged_attention_reference(q[:, None], k_pages, v_pages, page_table, pos)[:, 0]
    # The kernels take unscaled logits; rows with no token (idle slots) get length 1 so no
    # row divides by an empty softmax (their outputs are ignored by the caller).
    scaled = (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(q.dtype)
    lengths = jnp.maximum(lengths, 1).astype(jnp.int32)
    table = jnp.maximum(page_table, 0).astype(jnp.int32)
    width = table.shape[1]
    per_block = _largest_divisor(width, 8)
    if implementation == "pallas_gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel

        blocking = PALLAS_GPU_BLOCKING
        per_block, k_splits = blocking.for_width(width)
        return gpu_kernel.paged_attention(
            scaled, k_pages, v_pages, table, lengths, block_h=16,
            pages_per_compute_block=per_block, k_splits=k_splits, num_warps=blocking.num_warps,
            num_stages=blocking.num_stages, interpret=interpret)
    if implementation == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_kernel

        # The interpreter is chosen when the kernel is traced, in this thread: the engine's
        # programs may be traced in a scheduler thread, outside any context of the caller's.
        with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
            return tpu_kernel(scaled, k_pages, v_pages, lengths, table,
                              pages_per_compute_block=per_block)
    if implementation == "pallas_gpu_packed":
        from rstarjax.models import decode_kernel

        # Unscaled q (the kernel scales in float32); lengths >= 1 and table entries valid ids.
        return decode_kernel.decode_attention_packed(q, k_pages, v_pages, table, lengths,
                                                     blocking=decode_kernel.PACKED_BLOCKING,
                                                     interpret=interpret)
    if implementation == "pallas_mgpu_packed":
        from rstarjax.models import decode_kernel_mgpu

        return decode_kernel_mgpu.decode_attention_mosaic(
            q, k_pages, v_pages, table, lengths, blocking=decode_kernel_mgpu.MOSAIC_BLOCKING,
            interpret=interpret)
    raise ValueError(f"decode attention {implementation!r} not in {DECODE_IMPLEMENTATIONS}")


def paged_decode_append(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pages: jax.Array,
                        v_pages: jax.Array, page_table: jax.Array, positions: jax.Array,
                        valid: jax.Array, *, interpret: bool = False,
                        kv_sharding: jax.sharding.NamedSharding | None = None,
                        rope: tuple[jax.Array, jax.Array] | None = None,
                        qk_norm: tuple[jax.Array, jax.Array] | None = None, eps: float = 1e-6,
                        mosaic: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode step's write and attention in one kernel (``decode_kernel.decode_attention_append``):
    q [B, N, H], k_new/v_new [B, K, H] at ``positions`` [B] -> (out [B, N, H], k_pages,
    v_pages). What ``write_kv_pages`` then ``paged_decode_attention`` over ``positions + 1``
    tokens give, the same writes dropped (``valid`` false, no page); a row whose write is
    dropped attends to its new K/V all the same (the caller ignores it). ``rope`` (sin, cos
    [B, H/2]) and ``qk_norm`` (weights [H]): q and k_new are the projections' output, normed
    and rotated in the kernel. ``mosaic``: the Mosaic GPU kernel
    (``decode_kernel_mgpu.decode_attention_mosaic_append``, Hopper) instead of the Triton one."""
    from rstarjax.models import decode_kernel, decode_kernel_mgpu

    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    page, offset = write_targets(page_table, positions[:, None], valid[:, None], num_pages,
                                 page_size)
    slots = jnp.where(page[:, 0] < num_pages, page[:, 0] * page_size + offset[:, 0], -1)
    lengths = (positions + 1).astype(jnp.int32)
    table = jnp.maximum(page_table, 0).astype(jnp.int32)

    def local(q, k_new, v_new, k_pages, v_pages, slots, table, lengths, rope, qk_norm):
        if mosaic:
            return decode_kernel_mgpu.decode_attention_mosaic_append(
                q, k_new, v_new, slots, k_pages, v_pages, table, lengths, rope=rope,
                qk_norm=qk_norm, eps=eps, blocking=decode_kernel_mgpu.MOSAIC_APPEND_BLOCKING,
                interpret=interpret)
        return decode_kernel.decode_attention_append(
            q, k_new, v_new, slots, k_pages, v_pages, table, lengths, rope=rope,
            qk_norm=qk_norm, eps=eps, blocking=decode_kernel.PACKED_BLOCKING, interpret=interpret)

    args = (q, k_new, v_new, k_pages, v_pages, slots, table, lengths, rope, qk_norm)
    axis = split_kv_axis(kv_sharding) if kv_sharding is not None else None
    if axis is None:
        return local(*args)
    P = jax.sharding.PartitionSpec  # each device its kv heads and their query heads
    heads = P(None, axis)
    return jax.shard_map(local, mesh=kv_sharding.mesh,
                         in_specs=(heads, heads, heads, P(axis), P(axis), P(), P(), P(), P(), P()),
                         out_specs=(heads, P(axis), P(axis)), check_vma=False)(*args)


def split_kv_axis(kv_sharding: jax.sharding.NamedSharding) -> str | None:
    """The mesh axis a pool sharding splits the kv heads over (None: replicated pool)."""
    spec = tuple(kv_sharding.spec)
    return spec[0] if spec and spec[0] is not None else None


def _per_kv_head_shard(q, k_pages, v_pages, page_table, lengths, kv_sharding, **kernel):
    """A Pallas decode kernel on each device's kv heads and their query heads, no collective.

    Query heads are split the same way as kv heads (contiguous blocks, as the q/k/v
    projections' columns are), so a device's queries of kv head j sit next to its pages of j.
    """
    axis = split_kv_axis(kv_sharding)
    P = jax.sharding.PartitionSpec

    def local(q, k, v, table, lens):
        return paged_decode_attention(q, k, v, table, lens, **kernel)

    return jax.shard_map(local, mesh=kv_sharding.mesh,
                         in_specs=(P(None, axis), P(axis), P(axis), P(), P()),
                         out_specs=P(None, axis), check_vma=False)(
        q, k_pages, v_pages, page_table, lengths)

"""Paged decode attention as a Mosaic GPU kernel (Pallas, NVIDIA Hopper: H100, H200).

The same work as ``decode_kernel.decode_attention_packed`` (one query token per row, all query
heads of a kv head in one program, a row's live pages only), written for the one question the
Triton kernel leaves open (docs/serving.md, "Our decode kernel"): whether Triton keeps page
loads in flight when their addresses come from the page table. Here nothing is left to a
compiler's pipelining pass:

- **Pages copied by the TMA, ``stages`` blocks in flight.** Each loop iteration reads a block
  of ``block_tokens`` tokens (whole pages) of K and of V; every page is one bulk copy
  (``copy_gmem_to_smem``) from the pool straight into a swizzled shared-memory slot, its page
  id read from the table. The copies of block i + ``stages`` are issued as soon as block i's
  slot is consumed, so ``stages`` blocks (``stages`` x 32 KB at 64 tokens of 128 dims) are
  always on their way while the tensor cores work on the current one.
- **Both products on the tensor cores (WGMMA).** The G query heads of a kv head are the first
  rows of a 64-row tile (WGMMA's height; the other rows are zero). Decode does G multiply-adds
  per K/V element read, so the padded rows cost tensor-core time the HBM leaves idle anyway:
  64 x 128 x 2 x 2 FLOPs per token of a kv head, ~0.5 ms per layer at 256 rows x 4K on an
  H100's ~700 TFLOP/s, against ~1.9 ms of reads at its 2.3 TB/s target.
- **One program per (row, kv head), no splits, no combine.** A program holds ~80-112 KB of
  shared memory (two a streaming multiprocessor); 32 rows x 8 kv heads already put two on each
  of 132.

q is padded to 8 rows (G <= 8; a [rows, kv heads, 8, dim] array, 4 MB at 256 rows) so that it
and the output move as whole 8-row tiles. Exact against ``paged_attention_reference``
(tests/test_decode_kernel_mgpu.py) in Mosaic GPU's interpreter, which runs the page copies,
barriers and slots as written and the two products as plain dots (it has no WGMMA with a
transposed operand or a register operand); tests/test_decode_lowering.py lowers it for CUDA
inside the engine's decode program (Mosaic GPU's own lowering and layout inference run on CPU).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

TILE_ROWS = 64  # WGMMA's height: the query heads of a kv head are the first rows of the tile
Q_ROWS = 8  # the query heads of a kv head, padded to one 8-row tile (G <= 8)


@dataclasses.dataclass(frozen=True)
class MosaicBlocking:
    """``block_tokens``: tokens of K and of V an iteration reads (at most: whole pages, a
    divisor of the table width, a multiple of WGMMA's contraction step over the swizzled slots);
    ``stages``: iterations whose copies are in flight at once."""
    block_tokens: int = 64
    stages: int = 3

    def for_width(self, width: int, page_size: int, quantum: int) -> int | None:
        """Pages a block for a table ``width`` wide: the most whose tokens stay within
        ``block_tokens`` (or the fewest above it where none do) among the counts that divide
        the width and make a multiple of ``quantum`` tokens (64 at 128-byte rows). None: no
        such count."""
        fits = [d for d in range(1, width + 1)
                if width % d == 0 and (d * page_size) % quantum == 0]
        if not fits:
            return None
        within = [d for d in fits if d * page_size <= self.block_tokens]
        return max(within) if within else min(fits)

    def pages_per_block(self, width: int, page_size: int, head_dim: int, dtype) -> int | None:
        """``for_width`` with WGMMA's step for rows of ``head_dim`` in ``dtype``."""
        return self.for_width(width, page_size, swizzle_bytes(head_dim, dtype) // jnp.dtype(dtype).itemsize)

    def shared_bytes(self, width: int, page_size: int, head_dim: int, dtype=jnp.bfloat16) -> int:
        """Shared memory a program holds for a table ``width`` wide: the q/output tile and the
        K and V slots."""
        per_block = self.pages_per_block(width, page_size, head_dim, dtype) or 0
        return (TILE_ROWS + 2 * self.stages * per_block * page_size) * head_dim * jnp.dtype(dtype).itemsize


# Read when a decode program is traced (benchmarks/decode_kernel_sweep.py --mosaic-blockings).
MOSAIC_BLOCKING = MosaicBlocking()


def swizzle_bytes(head_dim: int, dtype) -> int:
    """The shared-memory swizzle of a K/V row (128 bytes, or the row where it is shorter)."""
    return min(128, head_dim * jnp.dtype(dtype).itemsize)


def problems(q_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype,
             width: int | None = None, blocking: MosaicBlocking | None = None) -> list[str]:
    """Why the kernel cannot run these shapes (empty: it can)."""
    out = []
    group = q_heads // max(1, kv_heads)
    if group > Q_ROWS:
        out.append(f"{group} query heads per kv head (at most {Q_ROWS})")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        out.append(f"a {jnp.dtype(dtype).name} pool (bfloat16 or float16: WGMMA's inputs)")
    row_bytes = head_dim * jnp.dtype(dtype).itemsize
    if row_bytes % 128 and row_bytes not in (32, 64):
        out.append(f"head_dim {head_dim} (a row of 32, 64 or a multiple of 128 bytes: the swizzle)")
    if page_size % 8:
        out.append(f"page_size {page_size} (a multiple of 8: one page is whole 8-row tiles)")
    elif width is not None and not out:
        if (blocking or MOSAIC_BLOCKING).pages_per_block(width, page_size, head_dim, dtype) is None:
            quantum = swizzle_bytes(head_dim, dtype) // jnp.dtype(dtype).itemsize
            out.append(f"a page table {width} pages wide (no divisor of it makes a multiple of "
                       f"{quantum} tokens of {page_size}-token pages)")
    return out


def device_problem(device=None) -> str | None:
    """Why the first device cannot run the kernel (None: it can, or it is not a GPU: lowering
    for CUDA elsewhere, as jax.export does). WGMMA is Hopper's (compute capability 9.x): neither
    an A100 nor a Blackwell GPU nor an AMD one has it."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return None
    if "rocm" in str(getattr(getattr(device, "client", None), "platform_version", "")).lower():
        return "an AMD GPU (a Hopper GPU: H100, H200)"
    capability = str(getattr(device, "compute_capability", ""))
    if capability and not capability.startswith("9."):
        return f"a GPU of compute capability {capability} (Hopper's 9.x: H100, H200)"
    return None


def _kernel(lengths, table, q, k_pool, v_pool, o, qo_smem, k_smem, v_smem, k_ready, v_ready,
            q_ready, *, page_size: int, per_block: int, stages: int, scale: float,
            interpret: bool):
    """Program (row r, kv head h): online softmax over the row's live pages, ``per_block``
    pages a block, the copies of ``stages`` blocks in flight. GMEM refs: lengths [B], table
    [B, W], q [B, K, 8, D], pools [K, pages, S, D], o [B, K, 8, D]; shared: the q/output tile
    [64, D], K and V slots [stages, per_block * S, D]; a barrier a slot for K and for V."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    r, h = lax.axis_index("rows"), lax.axis_index("heads")
    dtype = qo_smem.dtype
    tokens = per_block * page_size
    length = lengths[r]
    blocks = lax.div(length + tokens - 1, jnp.int32(tokens))
    tile, dim = TILE_ROWS, qo_smem.shape[1]
    # The interpreter has no layout casts; on the device they pin the WGMMA register layout.
    cast = (lambda x, _: x) if interpret else plgpu.layout_cast
    wgmma_layout = plgpu.Layout.WGMMA

    def fetch(block, slot):
        for j in range(per_block):
            page = table[r, block * per_block + j]
            rows = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_pool.at[h, page], k_smem.at[slot, rows], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_pool.at[h, page], v_smem.at[slot, rows], v_ready.at[slot])

    for s in range(stages):
        pl.when(s < blocks)(functools.partial(fetch, jnp.int32(s), s))
    qo_smem[...] = cast(jnp.zeros((tile, dim), dtype), wgmma_layout)
    plgpu.commit_smem()  # the zero rows are written before the copy fills the first 8
    plgpu.copy_gmem_to_smem(q.at[r, h], qo_smem.at[pl.ds(0, Q_ROWS)], q_ready)
    plgpu.barrier_wait(q_ready)

    def scores(slot):
        """[64, tokens] float32 logits of the q tile against the slot's keys."""
        if interpret:
            return jnp.dot(qo_smem[...], k_smem[slot].T, preferred_element_type=jnp.float32)

        def product(acc):
            plgpu.wgmma(acc, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
            return acc[...]
        return pl.run_scoped(product, plgpu.ACC((tile, tokens), jnp.float32))

    def weighted_values(p, slot):
        """[64, D] float32: p [64, tokens] (in the pool's dtype) times the slot's values."""
        if interpret:
            return jnp.dot(p, v_smem[slot], preferred_element_type=jnp.float32)

        def product(acc):
            plgpu.wgmma(acc, p, v_smem.at[slot])
            return acc[...]
        return pl.run_scoped(product, plgpu.ACC((tile, dim), jnp.float32))

    def body(i, carry):
        acc, m, l = carry  # [64, D], [64], [64] float32
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(k_ready.at[slot])
        logits = scores(slot) * scale
        column = (lax.broadcasted_iota(jnp.int32, logits.shape, 1) if interpret else
                  plgpu.broadcasted_iota(jnp.int32, logits.shape, 1, layout=wgmma_layout))
        logits = jnp.where(i * tokens + column < length, logits, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=1))  # finite: block 0 holds a live token
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        plgpu.barrier_wait(v_ready.at[slot])
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + weighted_values(p.astype(dtype), slot)
        # both products have been read back: the slot is free for block i + stages
        pl.when(i + stages < blocks)(lambda: fetch(i + stages, slot))
        return acc, m_new, l

    carry = (cast(jnp.zeros((tile, dim), jnp.float32), wgmma_layout),
             cast(jnp.full((tile,), -jnp.inf, jnp.float32), wgmma_layout.reduce(1)),
             cast(jnp.zeros((tile,), jnp.float32), wgmma_layout.reduce(1)))
    acc, _, l = lax.fori_loop(0, blocks, body, carry)
    qo_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem.at[pl.ds(0, Q_ROWS)], o.at[r, h])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("blocking", "scale", "interpret"))
def decode_attention_mosaic(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            page_table: jax.Array, lengths: jax.Array, *,
                            blocking: MosaicBlocking = MosaicBlocking(),
                            scale: float | None = None, interpret: bool = False) -> jax.Array:
    """q [B, N, H] (unscaled; ``scale``, default ``H ** -0.5``, applied to the float32 logits)
    over each row's first ``lengths[b]`` tokens (>= 1) of its pages ``page_table[b]`` (entries
    past the live ones must be valid page ids; the positions mask them) -> [B, N, H]. GQA:
    query head n reads kv head ``n // (N // K)``. The contract of ``decode_attention_packed``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, n, dim = q.shape
    kh, _, page_size, _ = k_pages.shape
    group = n // kh
    width = page_table.shape[1]
    refused = problems(n, kh, dim, page_size, k_pages.dtype, width, blocking)
    if not interpret and (on_device := device_problem()):
        refused.append(on_device)
    if refused:
        raise ValueError("decode_attention='pallas_mgpu_packed' cannot run " + "; ".join(refused))
    itemsize = jnp.dtype(k_pages.dtype).itemsize
    swizzle = swizzle_bytes(dim, k_pages.dtype)
    per_block = blocking.pages_per_block(width, page_size, dim, k_pages.dtype)
    tokens = per_block * page_size
    layout = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
    q8 = jnp.pad(q.astype(k_pages.dtype).reshape(b, kh, group, dim),
                 ((0, 0), (0, 0), (0, Q_ROWS - group), (0, 0)))
    kernel = functools.partial(_kernel, page_size=page_size, per_block=per_block,
                               stages=blocking.stages, scale=dim ** -0.5 if scale is None else scale,
                               interpret=interpret)
    extra = {}
    if interpret:
        # jax 0.10 exports no public name for Mosaic GPU's interpreter
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        extra["interpret"] = InterpretGPUParams()
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((b, kh, Q_ROWS, dim), k_pages.dtype),
        grid=(b, kh), grid_names=("rows", "heads"),
        scratch_types=dict(
            qo_smem=plgpu.SMEM((TILE_ROWS, dim), k_pages.dtype, transforms=layout),
            k_smem=plgpu.SMEM((blocking.stages, tokens, dim), k_pages.dtype, transforms=layout),
            v_smem=plgpu.SMEM((blocking.stages, tokens, dim), k_pages.dtype, transforms=layout),
            k_ready=plgpu.Barrier(num_arrivals=per_block, num_barriers=blocking.stages),
            v_ready=plgpu.Barrier(num_arrivals=per_block, num_barriers=blocking.stages),
            q_ready=plgpu.Barrier()),
        kernel_name=f"decode_attention_mgpu_p{per_block}_s{blocking.stages}", **extra)
    out = call(lengths.astype(jnp.int32), page_table.astype(jnp.int32), q8, k_pages, v_pages)
    return out[:, :, :group].reshape(b, n, dim).astype(q.dtype)

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

``decode_attention_mosaic_append`` (``pallas_mgpu_packed_rope``) is the same kernel doing the
Triton ``_rope`` kernel's work too: the step's new token is the stream's first block (its K and
V copied into slot 0, normed and rotated there with q, written into the pool from untiled rows),
the row's cached tokens stream in behind it; the pools are aliased in and out of the call.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

TILE_ROWS = 64  # WGMMA's height: the query heads of a kv head are the first rows of the tile
Q_ROWS = 8  # the query heads of a kv head, padded to one 8-row tile (G <= 8)
# Shared memory a program may hold on Hopper (H100, H200: 227 KiB opted in per block), the limit
# Mosaic GPU's lowering enforces (its default where no GPU is attached)
SHARED_MEMORY_BYTES = 227 * 1024
# How Mosaic GPU lays out a program's shared memory: each buffer starts on a 1 KiB boundary,
# Pallas reserves 2 KiB of scratch for cross-warp reductions (``CompilerParams``' default
# ``reduction_scratch_bytes``), and each barrier takes 8 bytes
SHARED_ALIGNMENT = 1024
REDUCTION_SCRATCH_BYTES = 2048
BARRIER_BYTES = 8


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

    def shared_bytes(self, width: int, page_size: int, head_dim: int, dtype=jnp.bfloat16, *,
                     append: bool = False, rope: bool = False) -> int:
        """Shared memory a program holds for a table ``width`` wide, as Mosaic GPU counts it
        (``SHARED_ALIGNMENT``): the q/output tile and the K and V slots; with ``append`` the
        untiled rows the new token's K and V are copied into the pool from (64 rows of K with
        ``rope``, else 8; 8 of V); with ``rope`` the float32 angles and the q/k norm weights
        (counted whether or not the model norms q and k); the reduction scratch and barriers."""
        per_block = self.pages_per_block(width, page_size, head_dim, dtype) or 0
        row = head_dim * jnp.dtype(dtype).itemsize
        slot = per_block * page_size * row
        buffers = [TILE_ROWS * row] + [slot] * (2 * self.stages)
        if append:
            buffers += [(TILE_ROWS if rope else Q_ROWS) * row, Q_ROWS * row]
        if rope:
            buffers += [head_dim // 2 * 4] * 2 + [row] * 2
        aligned = sum(-(-size // SHARED_ALIGNMENT) * SHARED_ALIGNMENT for size in buffers)
        barriers = 2 * self.stages + 1
        return aligned + REDUCTION_SCRATCH_BYTES + barriers * BARRIER_BYTES


# Read when a decode program is traced (benchmarks/decode_kernel_sweep.py --mosaic-blocking).
MOSAIC_BLOCKING = MosaicBlocking()
# The writing kernel's (pallas_mgpu_packed_rope; --mosaic-append-blocking): its untiled K/V rows
# (18 KB) would take 3 stages of 64 tokens to 130 KB, one program an SM; 2 stages keep two
# (98 KB each, 4 blocks in flight an SM, twice what Little's law asks at the HBM's speed)
MOSAIC_APPEND_BLOCKING = MosaicBlocking(64, 2)


def swizzle_bytes(head_dim: int, dtype) -> int:
    """The shared-memory swizzle of a K/V row (128 bytes, or the row where it is shorter)."""
    return min(128, head_dim * jnp.dtype(dtype).itemsize)


def problems(q_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype,
             width: int | None = None, blocking: MosaicBlocking | None = None, *,
             append: bool = False, rope: bool = False) -> list[str]:
    """Why the kernel cannot run these shapes (empty: it can). ``append``: the new token's K/V
    pass through a 64-row tile of the first slot (rows of whole 128-byte swizzle spans, so
    blocks are multiples of 64 tokens); ``rope``: each half of a row whole spans too."""
    out = []
    group = q_heads // max(1, kv_heads)
    if group > Q_ROWS:
        out.append(f"{group} query heads per kv head (at most {Q_ROWS})")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        out.append(f"a {jnp.dtype(dtype).name} pool (bfloat16 or float16: WGMMA's inputs)")
    row_bytes = head_dim * jnp.dtype(dtype).itemsize
    if row_bytes % 128 and row_bytes not in (32, 64):
        out.append(f"head_dim {head_dim} (a row of 32, 64 or a multiple of 128 bytes: the swizzle)")
    elif rope and row_bytes % 256:
        out.append(f"head_dim {head_dim} with the rotary embedding in the kernel (each half of a "
                   f"row a multiple of 128 bytes)")
    elif append and row_bytes % 128:
        out.append(f"head_dim {head_dim} with the K/V write in the kernel (a row a multiple of "
                   f"128 bytes)")
    if page_size % 8:
        out.append(f"page_size {page_size} (a multiple of 8: one page is whole 8-row tiles)")
    elif width is not None and not out:
        blocking = blocking or MOSAIC_BLOCKING
        per_block = blocking.pages_per_block(width, page_size, head_dim, dtype)
        if per_block is None:
            quantum = swizzle_bytes(head_dim, dtype) // jnp.dtype(dtype).itemsize
            out.append(f"a page table {width} pages wide (no divisor of it makes a multiple of "
                       f"{quantum} tokens of {page_size}-token pages)")
        elif (need := blocking.shared_bytes(width, page_size, head_dim, dtype, append=append,
                                            rope=rope)) > SHARED_MEMORY_BYTES:
            out.append(f"page_size {page_size} ({per_block}-page blocks of "
                       f"{per_block * page_size} tokens, {blocking.stages} in flight: {need // 1024} "
                       f"KiB of shared memory, over Hopper's {SHARED_MEMORY_BYTES // 1024} KiB)")
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


def _kernel(*refs, grid: str, page_size: int, per_block: int, stages: int, swizzle: int,
            scale: float, interpret: bool, append: bool, rope: bool, norm: bool, eps: float):
    """Program (row r, kv head h): online softmax over the row's live pages, ``per_block`` pages
    a block, the copies of ``stages`` blocks in flight. GMEM refs, in order: lengths [B], table
    [B, W], q [B, K, 8, D], pools [K, pages, S, D]; with ``append`` slots [B], k_new / v_new [B,
    K, 8, D] (the new token in row 0, zeros below); with ``rope`` sin / cos [B, D/2] float32; with
    ``norm`` the q / k RMSNorm weights [D]; then o [B, K, 8, D] and with ``append`` the pools
    again (aliased: the new token's K and V are written there).

    ``grid``: where the program's (row, kv head) comes from: ``"mesh"`` the axes of
    ``plgpu.kernel``'s grid, ``"call"`` ``pallas_call``'s program ids, ``"input"`` a first GMEM
    ref [2] (the interpreter of jax 0.10 runs only the first program of a ``pallas_call``
    grid, so interpret mode calls each program on its own)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if grid == "input":
        coords, *refs = refs
        where = (coords[0], coords[1])
    elif grid == "call":
        where = (pl.program_id(0), pl.program_id(1))
    else:
        where = (lax.axis_index("rows"), lax.axis_index("heads"))
    names = ["lengths", "table", "q", "k_pool", "v_pool"]
    names += ["slots", "k_new", "v_new"] * append + ["sin", "cos"] * rope + ["q_norm", "k_norm"] * norm
    names += ["o"] + ["k_out", "v_out"] * append
    gmem = dict(zip(names, refs, strict=True))
    dtype, dim = gmem["k_pool"].dtype, gmem["q"].shape[-1]
    tokens = per_block * page_size
    itemsize = jnp.dtype(dtype).itemsize
    tiled = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
    # one barrier for what the first block needs: q, and the new token's K/V (into slot 0 and
    # the untiled rows the pool write copies from), angles and weights
    firsts = 1 + 2 * append + (2 - rope) * append + 2 * rope + 2 * norm
    scratch = dict(
        qo_smem=plgpu.SMEM((TILE_ROWS, dim), dtype, transforms=tiled),
        k_smem=plgpu.SMEM((stages, tokens, dim), dtype, transforms=tiled),
        v_smem=plgpu.SMEM((stages, tokens, dim), dtype, transforms=tiled),
        k_ready=plgpu.Barrier(num_arrivals=per_block, num_barriers=stages),
        v_ready=plgpu.Barrier(num_arrivals=per_block, num_barriers=stages),
        first_ready=plgpu.Barrier(num_arrivals=firsts))
    if append:  # a TMA copy of one row reads untiled rows (a tiled slot copies whole 8-row tiles)
        scratch.update(k_row=plgpu.SMEM((TILE_ROWS if rope else Q_ROWS, dim), dtype),
                       v_row=plgpu.SMEM((Q_ROWS, dim), dtype))
    if rope:
        scratch.update(sin_smem=plgpu.SMEM((dim // 2,), jnp.float32),
                       cos_smem=plgpu.SMEM((dim // 2,), jnp.float32))
    if norm:
        scratch.update(q_norm_smem=plgpu.SMEM((dim,), gmem["q_norm"].dtype),
                       k_norm_smem=plgpu.SMEM((dim,), gmem["k_norm"].dtype))
    program = functools.partial(_program, gmem, where, page_size=page_size, per_block=per_block,
                                stages=stages, scale=scale, interpret=interpret, append=append,
                                rope=rope, norm=norm, eps=eps)
    pl.run_scoped(program, **scratch)


def _program(gmem, where, *, qo_smem, k_smem, v_smem, k_ready, v_ready, first_ready,
             k_row=None, v_row=None, sin_smem=None, cos_smem=None, q_norm_smem=None,
             k_norm_smem=None, page_size: int, per_block: int, stages: int, scale: float,
             interpret: bool, append: bool, rope: bool, norm: bool, eps: float):
    """The program's work (``_kernel``'s docstring). The stream of blocks it reads: with
    ``append``, first the new token (slot 0, filled from k_new / v_new, its K normed and rotated
    there when ``rope``), then the row's cached tokens from the pool; pool block i sits in slot
    (i + 1) % stages, else i % stages."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    r, h = where
    table, k_pool, v_pool = gmem["table"], gmem["k_pool"], gmem["v_pool"]
    dtype = qo_smem.dtype
    tile, dim = TILE_ROWS, qo_smem.shape[1]
    tokens = per_block * page_size
    length = gmem["lengths"][r]
    cached = length - 1 if append else length  # tokens read from the pool
    blocks = lax.div(cached + tokens - 1, jnp.int32(tokens))
    first_slot = 1 if append else 0  # pool block 0's slot
    # The interpreter has no layout casts; on the device they pin the WGMMA register layout.
    cast = (lambda x, _: x) if interpret else plgpu.layout_cast
    load = (lambda ref, _: ref[...]) if interpret else (lambda ref, lay: plgpu.load(ref, (), layout=lay))
    wgmma_layout = plgpu.Layout.WGMMA

    def fetch(block, slot):
        for j in range(per_block):
            page = table[r, block * per_block + j]
            rows = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_pool.at[h, page], k_smem.at[slot, rows], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_pool.at[h, page], v_smem.at[slot, rows], v_ready.at[slot])

    for s in range(first_slot, stages):
        pl.when(s - first_slot < blocks)(functools.partial(fetch, jnp.int32(s - first_slot), s))
    # zero rows around the copied 8 (q's padding; the new token's neighbours in slot 0), so
    # that no junk of shared memory meets the products
    qo_smem[...] = cast(jnp.zeros((tile, dim), dtype), wgmma_layout)
    if append:
        k_smem[0] = cast(jnp.zeros((tokens, dim), dtype), wgmma_layout)
        v_smem[0] = cast(jnp.zeros((tokens, dim), dtype), wgmma_layout)
    plgpu.commit_smem()  # the zeros are written before the copies fill the first 8 rows
    eight = pl.ds(0, Q_ROWS)
    plgpu.copy_gmem_to_smem(gmem["q"].at[r, h], qo_smem.at[eight], first_ready)
    if append:
        plgpu.copy_gmem_to_smem(gmem["k_new"].at[r, h], k_smem.at[0, eight], first_ready)
        plgpu.copy_gmem_to_smem(gmem["v_new"].at[r, h], v_smem.at[0, eight], first_ready)
        plgpu.copy_gmem_to_smem(gmem["v_new"].at[r, h], v_row, first_ready)
        if not rope:  # the key as it comes; with rope the program writes k_row itself
            plgpu.copy_gmem_to_smem(gmem["k_new"].at[r, h], k_row, first_ready)
    if rope:
        plgpu.copy_gmem_to_smem(gmem["sin"].at[r], sin_smem, first_ready)
        plgpu.copy_gmem_to_smem(gmem["cos"].at[r], cos_smem, first_ready)
    if norm:
        plgpu.copy_gmem_to_smem(gmem["q_norm"], q_norm_smem, first_ready)
        plgpu.copy_gmem_to_smem(gmem["k_norm"], k_norm_smem, first_ready)
    plgpu.barrier_wait(first_ready)

    def prepare(ref, norm_smem, *copies):
        """The RMSNorm (``norm``) and the rotary embedding of a tile's 64 rows, in place (and
        into each of ``copies``): each half of the head dimension a [64, D/2] array, rounded to
        the tile's dtype where ``qwen3.rms_norm`` and ``qwen3.apply_rope`` round."""
        half = dim // 2
        rows, low, high = pl.ds(0, tile), pl.ds(0, half), pl.ds(half, half)
        x1 = load(ref.at[rows, low], wgmma_layout).astype(jnp.float32)
        x2 = load(ref.at[rows, high], wgmma_layout).astype(jnp.float32)
        column = wgmma_layout.reduce(0)
        across = lambda v: lax.broadcast_in_dim(v.astype(jnp.float32), x1.shape, [1])  # noqa: E731
        if norm:
            inv = lax.rsqrt(((x1 * x1).sum(axis=1) + (x2 * x2).sum(axis=1)) / dim + eps)
            inv = lax.broadcast_in_dim(inv, x1.shape, [0])
            x1 = (across(load(norm_smem.at[low], column)) * (x1 * inv)).astype(dtype).astype(jnp.float32)
            x2 = (across(load(norm_smem.at[high], column)) * (x2 * inv)).astype(dtype).astype(jnp.float32)
        sin, cos = across(load(sin_smem, column)), across(load(cos_smem, column))
        y1, y2 = (x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)
        for out in (ref, *copies):
            out[rows, low] = y1
            out[rows, high] = y2

    if rope:
        prepare(qo_smem, q_norm_smem)
        prepare(k_smem.at[0], k_norm_smem, k_row)
        plgpu.commit_smem()  # before the tensor cores and the copy below read them
    if append:
        slot_id = gmem["slots"][r]

        @pl.when(slot_id >= 0)
        def _write():  # the new token's K and V (row 0 of the untiled rows) into the pool
            size = jnp.int32(page_size)
            page, at = lax.div(slot_id, size), pl.ds(lax.rem(slot_id, size), 1)
            plgpu.copy_smem_to_gmem(k_row.at[pl.ds(0, 1)], gmem["k_out"].at[h, page, at])
            plgpu.copy_smem_to_gmem(v_row.at[pl.ds(0, 1)], gmem["v_out"].at[h, page, at])

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

    def step(carry, slot, live, wait_k, wait_v):
        """One block of the online softmax: ``live(column)`` marks the slot's live tokens."""
        acc, m, l = carry  # [64, D], [64], [64] float32
        wait_k()
        logits = scores(slot) * scale
        column = (lax.broadcasted_iota(jnp.int32, logits.shape, 1) if interpret else
                  plgpu.broadcasted_iota(jnp.int32, logits.shape, 1, layout=wgmma_layout))
        logits = jnp.where(live(column), logits, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=1))  # finite: every block holds a live token
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        wait_v()
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + weighted_values(p.astype(dtype), slot)
        return acc, m_new, l

    carry = (cast(jnp.zeros((tile, dim), jnp.float32), wgmma_layout),
             cast(jnp.full((tile,), -jnp.inf, jnp.float32), wgmma_layout.reduce(1)),
             cast(jnp.zeros((tile,), jnp.float32), wgmma_layout.reduce(1)))
    if append:  # the new token: column 0 of slot 0, already in shared memory
        carry = step(carry, 0, lambda column: column == 0, lambda: None, lambda: None)
        pl.when(stages - 1 < blocks)(lambda: fetch(jnp.int32(stages - 1), 0))

    def body(i, carry):
        slot = lax.rem(i + first_slot, jnp.int32(stages))
        carry = step(carry, slot, lambda column: i * tokens + column < cached,
                     lambda: plgpu.barrier_wait(k_ready.at[slot]),
                     lambda: plgpu.barrier_wait(v_ready.at[slot]))
        # both products have been read back: the slot is free for block i + stages
        pl.when(i + stages < blocks)(lambda: fetch(i + stages, slot))
        return carry

    acc, _, l = lax.fori_loop(0, blocks, body, carry)
    qo_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem.at[pl.ds(0, Q_ROWS)], gmem["o"].at[r, h])
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
    return _mosaic_call(q, k_pages, v_pages, page_table, lengths, None, blocking=blocking,
                        scale=scale, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("blocking", "scale", "interpret", "eps"))
def decode_attention_mosaic_append(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                                   slots: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                   page_table: jax.Array, lengths: jax.Array, *,
                                   blocking: MosaicBlocking = MosaicBlocking(),
                                   scale: float | None = None, interpret: bool = False,
                                   rope: tuple[jax.Array, jax.Array] | None = None,
                                   qk_norm: tuple[jax.Array, jax.Array] | None = None,
                                   eps: float = 1e-6) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decode step's K/V write and attention in one Mosaic GPU kernel: the contract of
    ``decode_kernel.decode_attention_append`` (k_new / v_new [B, K, H] written at ``slots[b]``,
    page id * page size + offset, -1: not written, and attended to as position ``lengths[b] -
    1``; -> (out, k_pages, v_pages), the pools updated in place). The new token's K and V go
    through shared memory: the program norms and rotates it there (``rope``, ``qk_norm``),
    attends to it as the first block and copies its row into the pool, while the row's cached
    tokens stream in behind it."""
    if qk_norm is not None and rope is None:
        raise ValueError("qk_norm is applied with the rotary embedding: give rope too")
    return _mosaic_call(q, k_pages, v_pages, page_table, lengths, (slots, k_new, v_new),
                        blocking=blocking, scale=scale, interpret=interpret, rope=rope,
                        qk_norm=qk_norm, eps=eps)


def _mosaic_call(q, k_pages, v_pages, page_table, lengths, new_kv, *, blocking, scale, interpret,
                 rope=None, qk_norm=None, eps=1e-6):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, n, dim = q.shape
    kh, _, page_size, _ = k_pages.shape
    group = n // kh
    width = page_table.shape[1]
    append = new_kv is not None
    # the rotary kernel is the attention of two switches (the engine names the one chosen)
    switch = "'pallas_mgpu_packed_rope' or 'pallas_mgpu_packed_layer'" if rope is not None else (
        "'pallas_mgpu_packed_append'" if append else "'pallas_mgpu_packed'")
    refused = problems(n, kh, dim, page_size, k_pages.dtype, width, blocking, append=append,
                       rope=rope is not None)
    if not interpret and (on_device := device_problem()):
        refused.append(on_device)
    if refused:
        raise ValueError(f"decode_attention={switch} cannot run " + "; ".join(refused))
    dtype = k_pages.dtype
    per_block = blocking.pages_per_block(width, page_size, dim, dtype)

    def eight_rows(x, rows):  # [B, K * rows, H] -> [B, K, 8, H] in the pool's dtype, zeros below
        return jnp.pad(x.astype(dtype).reshape(b, kh, rows, dim),
                       ((0, 0), (0, 0), (0, Q_ROWS - rows), (0, 0)))

    args = [lengths.astype(jnp.int32), page_table.astype(jnp.int32), eight_rows(q, group),
            k_pages, v_pages]
    out_type = [jax.ShapeDtypeStruct((b, kh, Q_ROWS, dim), dtype)]
    if append:
        slots, k_new, v_new = new_kv
        args += [slots.astype(jnp.int32), eight_rows(k_new, 1), eight_rows(v_new, 1)]
        out_type += [jax.ShapeDtypeStruct(k_pages.shape, dtype), jax.ShapeDtypeStruct(v_pages.shape, dtype)]
    if rope is not None:
        args += [x.astype(jnp.float32).reshape(b, dim // 2) for x in rope]
    if qk_norm is not None:
        args += [w.reshape(dim) for w in qk_norm]
    static = dict(page_size=page_size, per_block=per_block, stages=blocking.stages,
                  swizzle=swizzle_bytes(dim, dtype), scale=dim ** -0.5 if scale is None else scale,
                  interpret=interpret, append=append, rope=rope is not None,
                  norm=qk_norm is not None, eps=eps)
    name = (f"decode_attention_mgpu{'_append' * append}{'_rope' * (rope is not None)}"
            f"_p{per_block}_s{blocking.stages}")
    extra = {}
    if interpret:
        # jax 0.10 exports no public name for Mosaic GPU's interpreter
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        extra["interpret"] = InterpretGPUParams()
    if not append:
        outs = [plgpu.kernel(functools.partial(_kernel, grid="mesh", **static), out_type=out_type[0],
                             grid=(b, kh), grid_names=("rows", "heads"), kernel_name=name,
                             **extra)(*args)]
    else:
        gmem = pl.BlockSpec(memory_space=plgpu.GMEM)

        def call(grid, first, args):
            return pl.pallas_call(
                functools.partial(_kernel, grid="input" if first else "call", **static),
                out_shape=out_type, grid=grid, in_specs=[gmem] * (len(args)),
                out_specs=[gmem] * len(out_type),
                input_output_aliases={3 + first: 1, 4 + first: 2},  # the pools, in place
                compiler_params=plgpu.CompilerParams(), name=name, **extra)(*args)

        if not interpret:
            outs = call((b, kh), 0, args)
        else:  # one program a call, in grid order, the pools carried from call to call
            out = jnp.zeros(out_type[0].shape, dtype)
            for r in range(b):
                for h in range(kh):
                    o, args[3], args[4] = call((), 1, [jnp.asarray([r, h], jnp.int32), *args])
                    out = out.at[r, h].set(o[r, h])
            outs = [out, args[3], args[4]]
    out = outs[0][:, :, :group].reshape(b, n, dim).astype(q.dtype)
    return (out, outs[1], outs[2]) if append else out

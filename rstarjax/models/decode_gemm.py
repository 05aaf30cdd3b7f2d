"""The decode step's projections as Pallas GEMMs (lowered to Triton on NVIDIA/AMD GPUs) that
take in the work around them: the RMSNorm before a projection, SwiGLU between the MLP's
projections, the residual add after one.

Why (docs/serving.md, "Our decode kernel"): at 64 rows a decode step of Qwen3-1.7B is ~1.7 ms
at the HBM roofline, and after our attention kernel the rest of the step is ~10 kernels a
layer, each a few microseconds whatever its size: the input and post-attention norms, SwiGLU,
two residual adds, beside the GEMMs themselves. With these a layer is four GEMM kernels and the
attention kernel (``qwen3.decoder_layer(fused=...)``, ``decode_attention="pallas_gpu_packed_layer"``):

- ``norm_matmul(x, w_norm, (w_q, w_k, w_v))``: each program needs its rows' sums of squares,
  then multiplies the normed rows, rounded to x's dtype as ``qwen3.rms_norm`` rounds them, by
  its block of one of the weights. Several weights go in one launch: each program's column
  block says which it reads. The sums come from the kernel that wrote x (``sums=``, below);
  without them (the first layer) each program sums its rows itself, a second pass over them.
- ``norm_matmul(x, w_norm, (w_gate, w_up), swiglu=True)``: each program reads the same column
  block of both weights and writes ``silu(gate) * up``, rounded per op as jax's ``silu`` and the
  product round in the model.
- ``matmul_residual(a, w, residual, with_sums=True)``: ``residual + a @ w`` (the output and
  down projections), each program also writing the squares of its block of the output summed
  per row, so the next norm reads [column blocks, rows] floats instead of every program
  re-reading all its rows of x from L2 (at 64 rows x 32 columns, 2x the weight bytes again).

A decode step's GEMM is a weight read (64 rows: 2 x 64 FLOPs per 2-byte weight), so a program's
loop streams ``[block_k, block_cols]`` weight tiles through ``num_stages`` pipeline stages, and
the column blocks narrow until rows x columns programs fill the GPU (``GemmBlocking``).

Exact against the model's own ``rms_norm`` / ``jax.nn.silu`` / ``@`` in Pallas' interpreter
(tests/test_decode_gemm.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

TILE = 16  # the tensor cores' smallest tile: rows are padded to a multiple of it


@dataclasses.dataclass(frozen=True)
class GemmBlocking:
    """How the decode GEMMs cut their work (static: part of the compiled program).

    ``block_rows``/``block_cols``/``block_k``: the largest tiles (each reduced to a power of two
    that divides its dimension); ``target_programs``: column blocks halve (down to
    ``min_cols``) until row blocks x column blocks reach it (an H100/H200 has 132 SMs: ~2 per SM
    keeps a weight tile in flight on each while the other computes). ``num_warps``/
    ``num_stages``: Triton's launch and software-pipelining depth."""
    block_rows: int = 64
    block_cols: int = 128
    block_k: int = 128
    target_programs: int = 256
    min_cols: int = 32
    num_warps: int = 4
    num_stages: int = 4

    def for_shape(self, rows: int, depth: int, widths: tuple[int, ...]) -> tuple[int, int, int]:
        """(row block, column block, k block) for ``rows`` (a multiple of ``TILE``) times a
        ``[depth, width]`` weight of each width."""
        block_rows = _power_of_two_dividing(rows, self.block_rows)
        block_k = _power_of_two_dividing(depth, self.block_k)
        block_cols = min(_power_of_two_dividing(n, self.block_cols) for n in widths)
        if min(block_rows, block_cols, block_k) < TILE:
            raise ValueError(f"decode GEMM of {rows} rows x [{depth}, {widths}]: every dimension "
                             f"must be a multiple of {TILE}")
        programs = lambda c: (rows // block_rows) * sum(n // c for n in widths)  # noqa: E731
        while programs(block_cols) < self.target_programs and block_cols // 2 >= max(TILE, self.min_cols):
            block_cols //= 2
        return block_rows, block_cols, block_k

    def stages_for(self, block_rows: int, block_cols: int, block_k: int, weights: int,
                   itemsize: int, shared_bytes: int | None = None) -> int:
        """``num_stages``, fewer where its pipelined tiles (an x tile and ``weights`` weight tiles
        an iteration) would not fit ``shared_bytes`` (default: ``pipeline_shared_bytes()`` of the
        device): a blocking Triton cannot fit in an SM's shared memory fails only when the
        device compiles it, so it is cut here."""
        budget = pipeline_shared_bytes() if shared_bytes is None else shared_bytes
        per_stage = (block_rows * block_k + weights * block_k * block_cols) * itemsize
        return max(1, min(self.num_stages, budget // per_stage))

    def spec(self) -> str:
        """The blocking as ``decode_kernel_sweep.py --gemm-blocking`` reads it (``from_spec``)."""
        return ",".join(str(getattr(self, f.name)) for f in dataclasses.fields(self))

    @classmethod
    def from_spec(cls, spec: str) -> "GemmBlocking":
        """BLOCK_ROWS,BLOCK_COLS,BLOCK_K,TARGET_PROGRAMS,MIN_COLS,NUM_WARPS,NUM_STAGES."""
        values = [int(v) for v in spec.split(",")]
        if len(values) != len(dataclasses.fields(cls)):
            raise ValueError(f"GEMM blocking {spec!r}: want {len(dataclasses.fields(cls))} integers "
                             f"({','.join(f.name.upper() for f in dataclasses.fields(cls))})")
        return cls(*values)


# Shared memory (KB) a block may have, by a substring of jax's device_kind (first match wins);
# 35 KB of it is left to Triton's own scratch (the accumulator's layout conversion before the
# store: 32 KB at 64 x 128) and the rest to the pipelined tiles.
SHARED_MEMORY_KB = (("H100", 227), ("H200", 227), ("H800", 227), ("H20", 227), ("A100", 163),
                    ("A800", 163), ("MI300", 64), ("MI250", 64), ("MI210", 64))
SHARED_MEMORY_KB_OTHERWISE = 99  # Ada and consumer Ampere, the smallest of the CUDA cards
TRITON_SCRATCH_KB = 35


def pipeline_shared_bytes(device_kind: str | None = None) -> int:
    """Bytes the pipelined tiles may take on ``device_kind`` (default: the first device's; a CPU,
    interpreting the kernels or exporting them for cuda, gets an H100's)."""
    if device_kind is None:
        device = jax.devices()[0]
        device_kind = "H100" if device.platform == "cpu" else device.device_kind
    kb = next((kb for key, kb in SHARED_MEMORY_KB if key.lower() in device_kind.lower()),
              SHARED_MEMORY_KB_OTHERWISE)
    return (kb - TRITON_SCRATCH_KB) * 1024


def _power_of_two_dividing(n: int, most: int) -> int:
    """The largest power of two <= ``most`` that divides ``n`` (1 if n is odd)."""
    p = 1
    while p * 2 <= most and n % (p * 2) == 0:
        p *= 2
    return p


# Read when a decode program is traced (benchmarks can set it, as decode_kernel.PACKED_BLOCKING).
GEMM_BLOCKING = GemmBlocking()


def _accumulate(x_ref, w_refs, rows, cols, depth, block_k, inv=None, w_norm_ref=None):
    """float32 ``[block rows, block cols]`` products of x's ``rows`` with each weight's ``cols``,
    the rows first RMS-normed with ``inv`` (1 / rms per row) and ``w_norm`` when given."""
    dtype = x_ref.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def body(i, accs):
        at = pl.ds(i * block_k, block_k)
        a = x_ref[rows, at]
        if inv is not None:  # qwen3.rms_norm: float32, rounded to x's dtype
            scale = w_norm_ref[:, at].astype(jnp.float32)
            a = (scale * (a.astype(jnp.float32) * inv[:, None])).astype(dtype)
        return tuple(acc + jnp.dot(a, w[at, cols].astype(dtype), precision=precision,
                                   preferred_element_type=jnp.float32)
                     for acc, w in zip(accs, w_refs))

    zero = jnp.zeros((rows.size, cols.size), jnp.float32)
    return jax.lax.fori_loop(0, depth // block_k, body, tuple(zero for _ in w_refs))


def _inverse_rms(x_ref, rows, depth, block_k, eps):
    """1 / sqrt(mean(x^2) + eps) of x's ``rows`` in float32, summed ``block_k`` columns a time."""
    def body(i, total):
        a = x_ref[rows, pl.ds(i * block_k, block_k)].astype(jnp.float32)
        return total + jnp.sum(a * a, axis=1)

    total = jax.lax.fori_loop(0, depth // block_k, body, jnp.zeros((rows.size,), jnp.float32))
    return jax.lax.rsqrt(total / depth + eps)


def _swiglu(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
    """``jax.nn.silu(g) * u`` of the float32 accumulators, rounded where the model's ops round:
    the projections' outputs to ``dtype``, then each op of ``silu(g) = g / (1 + exp(-g))`` as jax
    writes it (negate, exp, add, divide, multiply), then the product with ``up``."""
    def rounded(v):
        return v.astype(dtype).astype(jnp.float32)

    g, u = rounded(gate), rounded(up)
    sigmoid = rounded(1.0 / rounded(1.0 + rounded(jnp.exp(-g))))
    return (rounded(g * sigmoid) * u).astype(dtype)


def _inverse_rms_from_sums(sums_ref, rows, depth, eps):
    """1 / sqrt(mean(x^2) + eps) of ``rows`` from the producer's partial sums of squares
    ([column blocks, M], ``matmul_residual(..., with_sums=True)``), summed one block a time."""
    def body(c, total):
        return total + sums_ref[c, rows]

    total = jax.lax.fori_loop(0, sums_ref.shape[0], body, jnp.zeros((rows.size,), jnp.float32))
    return jax.lax.rsqrt(total / depth + eps)


def _norm_matmul_kernel(x_ref, w_norm_ref, *refs, count: int, starts: tuple[int, ...],
                        block_rows: int, block_cols: int, block_k: int, eps: float, swiglu: bool,
                        has_sums: bool):
    """Program (row block r, column block j). Refs: x [M, K], the norm's weight [1, K], with
    ``has_sums`` the partial sums of squares of x [C, M], then the ``count`` weights [K, N_i] and
    the outputs [M, N_i] (one, [M, N], with ``swiglu``). Without ``swiglu`` column block j
    belongs to the weight whose range ``starts`` gives it."""
    if has_sums:
        sums_ref, *refs = refs
    w_refs, o_refs = refs[:count], refs[count:]
    r, j = pl.program_id(0), pl.program_id(1)
    depth = x_ref.shape[1]
    rows = pl.ds(r * block_rows, block_rows)
    # the sums, when the kernel that wrote x gave them, spare every program a pass over its rows
    inv = (_inverse_rms_from_sums(sums_ref, rows, depth, eps) if has_sums
           else _inverse_rms(x_ref, rows, depth, block_k, eps))
    if swiglu:
        cols = pl.ds(j * block_cols, block_cols)
        gate, up = _accumulate(x_ref, w_refs, rows, cols, depth, block_k, inv, w_norm_ref)
        (o_ref,) = o_refs
        o_ref[rows, cols] = _swiglu(gate, up, o_ref.dtype)
        return
    for w_ref, o_ref, start, end in zip(w_refs, o_refs, starts, starts[1:]):
        @pl.when((j >= start) & (j < end))
        def _one(w_ref=w_ref, o_ref=o_ref, start=start):
            cols = pl.ds((j - start) * block_cols, block_cols)
            (acc,) = _accumulate(x_ref, (w_ref,), rows, cols, depth, block_k, inv, w_norm_ref)
            o_ref[rows, cols] = acc.astype(o_ref.dtype)


def _matmul_residual_kernel(a_ref, w_ref, res_ref, o_ref, *sums_ref, block_rows: int,
                            block_cols: int, block_k: int):
    """Program (row block r, column block j): o = residual + (a @ w), the product rounded to the
    output dtype before the add, as the model's ``x + matmul(...)`` rounds; with a sums output
    [C, M], row j of it gets the squares of its block of o summed per row (the next norm's)."""
    r, j = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(r * block_rows, block_rows), pl.ds(j * block_cols, block_cols)
    (acc,) = _accumulate(a_ref, (w_ref,), rows, cols, a_ref.shape[1], block_k)
    dtype = o_ref.dtype
    y = acc.astype(dtype).astype(jnp.float32)
    out = (res_ref[rows, cols].astype(jnp.float32) + y).astype(dtype)
    o_ref[rows, cols] = out
    if sums_ref:
        written = out.astype(jnp.float32)  # the values the next norm reads, as it upcasts them
        sums_ref[0][j, rows] = jnp.sum(written * written, axis=1)


def _pad_rows(x: jax.Array) -> tuple[jax.Array, int]:
    m = x.shape[0]
    padded = -(-m // TILE) * TILE
    return (x if padded == m else jnp.pad(x, ((0, padded - m), (0, 0)))), m


def _compiler_params(blocking: GemmBlocking, tiles: tuple[int, int, int], weights: int, itemsize: int):
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=blocking.num_warps,
                                num_stages=blocking.stages_for(*tiles, weights, itemsize))


def _whole(shape):
    """A block that is the whole array (the kernel indexes its own tiles)."""
    return pl.BlockSpec(shape, lambda r, j: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=("eps", "swiglu", "blocking", "interpret"))
def norm_matmul(x: jax.Array, w_norm: jax.Array, weights: tuple[jax.Array, ...], *, eps: float,
                swiglu: bool = False, sums: jax.Array | None = None,
                blocking: GemmBlocking = GemmBlocking(),
                interpret: bool = False) -> tuple[jax.Array, ...]:
    """``rms_norm(x, w_norm, eps) @ w`` for each ``w`` of ``weights`` ([K, N_i]) in one kernel,
    x [M, K] -> one [M, N_i] per weight in x's dtype; ``swiglu`` (weights = (gate, up)):
    ``(silu(h @ gate) * (h @ up),)``, the MLP's activation, in one pass over both weights.
    ``sums``: x's partial sums of squares as the ``matmul_residual`` that wrote x gave them
    ([C, M padded to the tile], ``with_sums=True``); without, each program sums its rows first."""
    if swiglu and len(weights) != 2:
        raise ValueError(f"swiglu takes (gate, up), got {len(weights)} weights")
    xp, m = _pad_rows(x)
    rows, depth = xp.shape
    if sums is not None and (sums.ndim != 2 or sums.shape[1] != rows):
        raise ValueError(f"sums {sums.shape}: want [column blocks, {rows}] (matmul_residual's)")
    widths = tuple(w.shape[1] for w in weights)
    if any(w.shape[0] != depth for w in weights):
        raise ValueError(f"weights {[w.shape for w in weights]} must all have {depth} rows")
    block_rows, block_cols, block_k = blocking.for_shape(rows, depth, widths[:1] if swiglu else widths)
    if swiglu:
        if widths[0] != widths[1]:
            raise ValueError(f"gate and up widths differ: {widths}")
        outs = (jax.ShapeDtypeStruct((rows, widths[0]), x.dtype),)
        column_blocks = widths[0] // block_cols
        starts = (0, column_blocks)
    else:
        outs = tuple(jax.ShapeDtypeStruct((rows, n), x.dtype) for n in widths)
        ends = [0]
        for n in widths:
            ends.append(ends[-1] + n // block_cols)
        starts, column_blocks = tuple(ends), ends[-1]
    kernel = functools.partial(_norm_matmul_kernel, count=len(weights), starts=starts,
                               block_rows=block_rows, block_cols=block_cols, block_k=block_k,
                               eps=eps, swiglu=swiglu, has_sums=sums is not None)
    given = () if sums is None else (sums.astype(jnp.float32),)
    ys = pl.pallas_call(
        kernel, grid=(rows // block_rows, column_blocks),
        in_specs=[_whole(xp.shape), _whole((1, depth))] + [_whole(a.shape) for a in given]
        + [_whole(w.shape) for w in weights],
        out_specs=[_whole(o.shape) for o in outs], out_shape=list(outs), interpret=interpret,
        compiler_params=_compiler_params(blocking, (block_rows, block_cols, block_k),
                                         2 if swiglu else 1, x.dtype.itemsize),
        name=f"decode_gemm_norm_{'swiglu' if swiglu else 'matmul'}_m{block_rows}_n{block_cols}_k{block_k}",
    )(xp, w_norm.reshape(1, depth), *given, *weights)
    return tuple(y[:m] for y in ys)


@functools.partial(jax.jit, static_argnames=("with_sums", "blocking", "interpret"))
def matmul_residual(a: jax.Array, w: jax.Array, residual: jax.Array, *, with_sums: bool = False,
                    blocking: GemmBlocking = GemmBlocking(), interpret: bool = False):
    """``residual + a @ w`` in one kernel: a [M, K], w [K, N], residual [M, N] -> [M, N] in the
    residual's dtype (the product rounded to it first, as the model rounds). ``with_sums``:
    (out, sums), sums [column blocks, M padded to the tile] float32 the squares of out's rows
    summed per column block, which the next ``norm_matmul(..., sums=)`` takes instead of
    re-reading the rows (every program of it would read all its rows once more, from L2)."""
    ap, m = _pad_rows(a.astype(residual.dtype))
    rp, _ = _pad_rows(residual)
    rows, depth = ap.shape
    if w.shape[0] != depth or residual.shape != (m, w.shape[1]):
        raise ValueError(f"a {a.shape} @ w {w.shape} + residual {residual.shape}: shapes disagree")
    block_rows, block_cols, block_k = blocking.for_shape(rows, depth, (w.shape[1],))
    kernel = functools.partial(_matmul_residual_kernel, block_rows=block_rows,
                               block_cols=block_cols, block_k=block_k)
    column_blocks = w.shape[1] // block_cols
    out_shape = [jax.ShapeDtypeStruct(rp.shape, residual.dtype)]
    if with_sums:
        out_shape.append(jax.ShapeDtypeStruct((column_blocks, rows), jnp.float32))
    outs = pl.pallas_call(
        kernel, grid=(rows // block_rows, column_blocks),
        in_specs=[_whole(ap.shape), _whole(w.shape), _whole(rp.shape)],
        out_specs=[_whole(o.shape) for o in out_shape], out_shape=out_shape,
        interpret=interpret, compiler_params=_compiler_params(
            blocking, (block_rows, block_cols, block_k), 1, residual.dtype.itemsize),
        name=f"decode_gemm_residual{'_sums' if with_sums else ''}_m{block_rows}_n{block_cols}_k{block_k}",
    )(ap, w, rp)
    return (outs[0][:m], outs[1]) if with_sums else outs[0][:m]

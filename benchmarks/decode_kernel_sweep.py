"""Time the paged decode-attention kernels over their blocking knobs; one JSON line per config.

    python benchmarks/decode_kernel_sweep.py                      # GPU: Qwen3-1.7B/8B kv layout
    python benchmarks/decode_kernel_sweep.py --tiny --interpret   # CPU smoke run (interpreter)
    python benchmarks/decode_kernel_sweep.py --arms triton,packed --batches 256 --contexts 4096
    python benchmarks/decode_kernel_sweep.py --engine --batches 256,64,32   # inside the engine

``--arms packed`` adds our kernel (``models/decode_kernel.py``) with each ``--packed-blockings``
spec, in the order given (gpu_check.py gives them in predicted order, under ``--budget-s``);
``--arms mosaic`` our Mosaic GPU kernel (``models/decode_kernel_mgpu.py``, Hopper) with each
``--mosaic-blockings`` spec.
``--canary``: each Mosaic GPU kernel called once (the first ``--mosaic-blockings`` spec, and the
kernel that writes the K/V and applies the rotary embedding, ``pallas_mgpu_packed_rope``, with
``--mosaic-append-blocking``) at the given shapes against the float32 reference, a row each with
``ok``: gpu_check.py's kernels2 part runs it first, in a process of its own with a short
timeout, so that a Mosaic GPU kernel that fails or hangs on a device costs seconds, not the
parts that would run it.
``--engine``: the engine's whole decode step instead (Qwen3-1.7B, random bf16 weights, every
row a ``--prompt-len`` prompt), one engine per batch whose decode program is compiled once per
``--engine-arms`` entry (attention path x sampler); the arms alternate call by call for
``--rounds`` rounds (16 steps a call) and each prints the median call, its range, tokens/s and
the HBM-roofline fraction (weights + live KV bytes per step / step time / peak bandwidth, as
``benchmarks/serving.py``); ``--trace-dir`` keeps a ``jax.profiler`` trace of one more call of
``--trace-arms`` (with its ``*.xplane.pb``, the compiled HLO ``profile_summary.py`` names the
fusions from); ``--compile-threads N`` compiles every arm's program ahead, N at a time (a 1.7B
decode program is ~17 s of compile on a GPU host, so 8 arms x 3 batches is most of the part).

The decode profile on an H200 (docs/serving.md) puts ~60 % of a Qwen3-1.7B decode step in this
kernel at about a quarter of the HBM bandwidth. The engine picks its knobs from the page-table
width alone (``models/paged_attention.py``); this measures what each choice costs at the decode
shapes that matter: a batch of rows (``--batches``) whose contexts are ``--contexts`` tokens
(each row's length drawn within +-10 %), pages scattered over the pool as a long run leaves
them. Per config: the median time of the whole call (the kernel and its split-combining
epilogue), live KV GB/s, and the largest output difference from a float32 gather-and-softmax
reference.

``--arms`` adds cuDNN's paged attention (jax's private ``jax._src.cudnn`` binding, GPU only) on the
same pages in its own layout ([pages, kv heads, page size, head dim]): ``cudnn`` with one query
position per row and all query heads, ``cudnn_packed`` with the query heads that share a kv head
as that head's query positions (one K/V read per kv head, the flash-decoding packing). Its binding
needs the pool to hold exactly rows x page-table columns pages, so every arm's pool does.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--batches", default="64,256")
ap.add_argument("--contexts", default="560,4096")
ap.add_argument("--q-heads", type=int, default=16, help="16: Qwen3-1.7B; 32: Qwen3-8B")
ap.add_argument("--kv-heads", type=int, default=8)
ap.add_argument("--head-dim", type=int, default=128)
ap.add_argument("--page-sizes", default="16", help="tokens per page, comma-separated (serving.page_size)")
ap.add_argument("--max-tokens", type=int, default=4608,
                help="a row's most tokens (stage 1: 4,608); the page table is this / page size wide")
ap.add_argument("--check-rows", type=int, default=16, help="rows compared with the float32 reference")
ap.add_argument("--per-block", default="4,8,16")
ap.add_argument("--k-splits", default="1,2,4,8,16")
ap.add_argument("--warps", default="4,8")
ap.add_argument("--stages", default="2")
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--arms", default="triton", help="comma-separated: triton (the knob sweep), "
                "cudnn, cudnn_packed, packed (ours, each --packed-blockings spec), mosaic (ours on "
                "Mosaic GPU, each --mosaic-blockings spec)")
ap.add_argument("--mosaic-blockings", default="64,3;64,2;128,2;64,4",
                help="';'-separated BLOCK_TOKENS,STAGES (models/decode_kernel_mgpu.py "
                     "MosaicBlocking), run in this order")
ap.add_argument("--packed-blockings", default="4,8,1024,4,3;4,8,1024,4,3,1;2,8,1024,4,4;8,8,1024,8,3;4,8,1048576,4,3",
                help="';'-separated PAGES_PER_BLOCK,MAX_K_SPLITS,TARGET_PROGRAMS,NUM_WARPS,NUM_STAGES[,TENSOR_CORES] "
                     "(models/decode_kernel.py PackedBlocking), run in this order")
ap.add_argument("--engine", action="store_true", help="the engine's decode step (see module doc)")
ap.add_argument("--engine-arms", default="pallas_gpu:exact,pallas_gpu_packed:exact,pallas_gpu_packed:fused,"
                "pallas_gpu_packed_append:fused,pallas_gpu_packed_rope:fused,"
                "pallas_gpu_packed_layer:fused",
                help="ATTENTION:SAMPLER[:GEMMS], comma-separated (GEMMS: cublas, the decode "
                "program's GEMMs on cuBLAS instead of XLA's Triton ones)")
ap.add_argument("--preset", default="qwen3-1.7b", help="--engine: the model shape")
ap.add_argument("--packed-blocking", default="", help="--engine: the blocking of the engine's "
                "pallas_gpu_packed arms (one --packed-blockings spec; default: the engine's)")
ap.add_argument("--mosaic-blocking", default="", help="--engine: the blocking of the engine's "
                "pallas_mgpu_packed arms (one --mosaic-blockings spec; default: the engine's)")
ap.add_argument("--mosaic-append-blocking", default="", help="--engine: the same for its "
                "pallas_mgpu_packed_rope and _layer arms (default: the engine's)")
ap.add_argument("--gemm-blocking", default="", help="--engine: the blocking of the "
                "pallas_gpu_packed_layer and pallas_mgpu_packed_layer arms' GEMMs (BLOCK_ROWS,BLOCK_COLS,BLOCK_K,TARGET_PROGRAMS,"
                "MIN_COLS,NUM_WARPS,NUM_STAGES: models/decode_gemm.py GemmBlocking; default: the engine's)")
ap.add_argument("--prompt-len", type=int, default=512, help="--engine: tokens per row at the start")
ap.add_argument("--rounds", type=int, default=3, help="--engine: alternating calls per arm")
ap.add_argument("--compile-threads", type=int, default=1,
                help="--engine: compile the arms' decode programs ahead in this many threads "
                     "(lowered one by one, compiled side by side); 1: each compiles at its first call")
ap.add_argument("--trace-dir", default="", help="--engine: a jax.profiler trace of one call (after "
                "the timed rounds) of each --trace-arms arm at each --trace-batches batch")
ap.add_argument("--trace-arms", default="", help="--engine: ATTENTION:SAMPLER arms to trace "
                "(default: the last --engine-arms arm)")
ap.add_argument("--trace-batches", default="256,64", help="--engine: the batches traced")
ap.add_argument("--peak-gbps", type=float, default=0.0, help="HBM peak (default: by device kind)")
ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting configs after this")
ap.add_argument("--canary", action="store_true", help="each Mosaic GPU kernel once against the "
                "reference (module doc)")
ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
ap.add_argument("--interpret", action="store_true")
args = ap.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas.ops.gpu import paged_attention as kernel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rstarjax.models.paged_attention import PALLAS_GPU_BLOCKING  # noqa: E402
from hardware import hbm_peak_gbps  # noqa: E402  (benchmarks/, this script's folder)
from timing import compile_in_threads, median_call_seconds  # noqa: E402

if args.tiny:
    args.batches, args.contexts, args.max_tokens = "4", "40", 128
    args.kv_heads, args.q_heads, args.head_dim = 2, 4, 16
    args.per_block, args.k_splits, args.warps = "2,4", "1,2", "4"
    args.packed_blockings = "2,2,1024,4,3;4,8,1,4,3"
    args.mosaic_blockings = "16,2"
    args.preset, args.rounds = "tiny", 2
    args.prompt_len = 24 if args.prompt_len == 512 else args.prompt_len  # the default: tiny's



def peak_gbps() -> float:
    kind = jax.devices()[0].device_kind
    return args.peak_gbps or hbm_peak_gbps(kind) or 0.0


def inputs(batch: int, context: int, page_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    pages_per_row = args.max_tokens // page_size
    num_pages = batch * pages_per_row  # cuDNN's binding checks pool pages == rows x columns
    shape = (args.kv_heads, num_pages, page_size, args.head_dim)
    # drawn on the device: 256 rows x 4,608 tokens is 2 x 2.4 GB, a minute of host RNG and copy
    kk, kv = jax.random.split(jax.random.PRNGKey(seed))
    k = jax.random.normal(kk, shape, jnp.bfloat16)
    v = jax.random.normal(kv, shape, jnp.bfloat16)
    table = rng.permutation(num_pages).reshape(batch, pages_per_row)
    lengths = rng.integers(int(0.9 * context), int(1.1 * context) + 1, batch)
    lengths = np.minimum(lengths, pages_per_row * page_size)
    q = jnp.asarray(rng.standard_normal((batch, args.q_heads, args.head_dim), np.float32),
                    jnp.bfloat16)
    return q, k, v, jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)


def reference(q, k, v, table, lengths):
    """Float32 decode attention over the rows' pages, unscaled logits as the kernel takes them."""
    group = q.shape[1] // k.shape[0]
    keys = jnp.moveaxis(k[:, table], 0, 3).reshape(q.shape[0], -1, k.shape[0], k.shape[-1])
    values = jnp.moveaxis(v[:, table], 0, 3).reshape(keys.shape)
    keys = jnp.repeat(keys.astype(jnp.float32), group, axis=2)  # [rows, positions, q heads, dim]
    values = jnp.repeat(values.astype(jnp.float32), group, axis=2)
    logits = jnp.einsum("bhd,bshd->bhs", q.astype(jnp.float32), keys)
    live = jnp.arange(keys.shape[1])[None, None, :] < lengths[:, None, None]
    weights = jax.nn.softmax(jnp.where(live, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhs,bshd->bhd", weights, values)


def cudnn_arm(packed: bool):
    """cuDNN's paged attention as a function of the Triton kernel's inputs plus K/V already in
    cuDNN's page layout ([pages, kv heads, page size, head dim], made once outside the timing)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, paged_attention

    def call(q, k_pages, v_pages, table, lengths):
        rows, q_heads, dim = q.shape
        kv_heads = k_pages.shape[1]
        positions = q_heads // kv_heads if packed else 1
        heads = kv_heads if packed else q_heads
        query = q.reshape(rows, heads, positions, dim)  # BNTH; q head h reads kv head h // group
        page_table = table[:, None, :, None]
        out = paged_attention(query, k_pages, v_pages,
                              jnp.full((rows,), positions, jnp.int32), lengths,
                              page_table, page_table, scale=1.0,
                              mask_type=MaskType.PADDING, qkv_layout="BNTH")
        return out.reshape(rows, q_heads, dim)
    return jax.jit(call)


def packed_blockings():
    from rstarjax.models.decode_kernel import PackedBlocking

    return [PackedBlocking(*map(int, spec.split(","))) for spec in args.packed_blockings.split(";") if spec]


def packed_arm(blocking):
    from rstarjax.models.decode_kernel import decode_attention_packed

    # the sweep's q is taken as pre-scaled, as jax's kernel takes it (the reference's logits are q.k)
    return jax.jit(lambda q, k, v, t, n: decode_attention_packed(
        q, k, v, t, n, blocking=blocking, scale=1.0, interpret=args.interpret))


def mosaic_blockings():
    from rstarjax.models.decode_kernel_mgpu import MosaicBlocking

    return [MosaicBlocking(*map(int, spec.split(","))) for spec in args.mosaic_blockings.split(";") if spec]


def mosaic_append_blocking():
    """The writing Mosaic GPU kernel's blocking: ``--mosaic-append-blocking``, else the engine's."""
    from rstarjax.models import decode_kernel_mgpu as mgpu

    spec = args.mosaic_append_blocking
    return mgpu.MosaicBlocking(*map(int, spec.split(","))) if spec else mgpu.MOSAIC_APPEND_BLOCKING


def mosaic_arm(blocking):
    from rstarjax.models.decode_kernel_mgpu import decode_attention_mosaic

    return jax.jit(lambda q, k, v, t, n: decode_attention_mosaic(
        q, k, v, t, n, blocking=blocking, scale=1.0, interpret=args.interpret))


def engine_default(width: int) -> tuple[int, int]:
    """What the engine picks today: (pages per compute block, k splits)."""
    return PALLAS_GPU_BLOCKING.for_width(width)


def timed(fn, *a) -> float:
    return median_call_seconds(fn, *a, iters=args.iters)


def triton_configs(width: int) -> list[tuple[int, int, int, int]]:
    """(pages per block, k splits, warps, stages): the engine's choice first, then the sweep's."""
    configs = [(*engine_default(width), PALLAS_GPU_BLOCKING.num_warps, PALLAS_GPU_BLOCKING.num_stages)]
    for per, ks, w, st in itertools.product(*(map(int, s.split(",")) for s in
                                              (args.per_block, args.k_splits, args.warps, args.stages))):
        if width % (per * ks) == 0 and (per, ks, w, st) not in configs:
            configs.append((per, ks, w, st))
    return configs if "triton" in args.arms.split(",") else configs[:1]  # the engine's: the baseline


def main():
    t_start = time.perf_counter()
    kv_bytes_token = 2 * args.kv_heads * args.head_dim * 2  # K and V, bf16, one layer
    arms = args.arms.split(",")
    best = {}
    for page_size, batch, context in itertools.product(*(map(int, x.split(",")) for x in
                                                         (args.page_sizes, args.batches, args.contexts))):
        configs = triton_configs(args.max_tokens // page_size)
        q, k, v, table, lengths = inputs(batch, context, page_size)
        live = float(jnp.sum(lengths)) * kv_bytes_token
        rows = min(batch, args.check_rows)  # the reference materialises its rows' K/V in float32
        expected = jax.jit(reference)(q[:rows], k, v, table[:rows], lengths[:rows])
        trials = [(dict(arm="triton", per_block=per, k_splits=ks, warps=w, stages=st,
                        default=(per, ks, w, st) == configs[0]),
                   lambda per=per, ks=ks, w=w, st=st: jax.jit(
                       lambda q, k, v, t, n: kernel.paged_attention(
                           q, k, v, t, n, block_h=16, pages_per_compute_block=per, k_splits=ks,
                           num_warps=w, num_stages=st, interpret=args.interpret)), (k, v))
                  for per, ks, w, st in configs]
        ours = {"packed": [], "mosaic": []}
        if "packed" in arms:
            for blocking in packed_blockings():
                per, splits = blocking.for_shape(batch, args.kv_heads, args.max_tokens // page_size,
                                                 page_size)
                ours["packed"].append((dict(arm="packed", per_block=per, k_splits=splits,
                                            warps=blocking.num_warps, stages=blocking.num_stages,
                                            target_programs=blocking.target_programs,
                                            tensor_cores=blocking.tensor_cores),
                                       lambda b=blocking: packed_arm(b), (k, v)))
        if "mosaic" in arms:
            for blocking in mosaic_blockings():
                width = args.max_tokens // page_size
                ours["mosaic"].append((dict(arm="mosaic", per_block=blocking.pages_per_block(
                                                width, page_size, args.head_dim, jnp.bfloat16),
                                            stages=blocking.stages,
                                            shared_kb=blocking.shared_bytes(width, page_size, args.head_dim) // 1024),
                                       lambda b=blocking: mosaic_arm(b), (k, v)))
        # our two kernels' blockings taken in turn, each list in its predicted order, so that a
        # budget that runs out has measured the likeliest of both
        for pair in itertools.zip_longest(ours["packed"], ours["mosaic"]):
            trials += [t for t in pair if t is not None]
        for arm in ("cudnn", "cudnn_packed"):
            if arm in arms:
                pages = (jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1))
                trials.append((dict(arm=arm), lambda arm=arm: cudnn_arm(arm == "cudnn_packed"), pages))
        for fields, make, (kk, vv) in trials:
            if time.perf_counter() - t_start > args.budget_s:
                break
            row = {"batch": batch, "context": context, "page_size": page_size, "q_heads": args.q_heads,
                   **fields}
            try:
                fn = make()
                out = fn(q, kk, vv, table, lengths)
                row["max_diff_vs_reference"] = float(jnp.max(jnp.abs(out[:rows].astype(jnp.float32) -
                                                                     expected)))
                s = timed(fn, q, kk, vv, table, lengths)
                row.update(us=round(1e6 * s, 1), gbps=round(live / s / 1e9, 1))
                if peak_gbps():
                    row["hbm_fraction"] = round(live / s / 1e9 / peak_gbps(), 3)
            except Exception as exc:  # noqa: BLE001  (a config the kernel refuses is a result)
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(row), flush=True)
            key = (page_size, batch, context)
            if "us" in row and (key not in best or row["us"] < best[key]["us"]):
                best[key] = row
    for row in best.values():
        print(json.dumps({"best": True, **row}), flush=True)


def canary_arms():
    """(name, function of the sweep's inputs -> output, pools expected back or None) per Mosaic
    GPU kernel. The writing kernel gets the rows' last tokens from the pool as its new K/V and
    the identity rotation (sin 0, cos 1), so its output is the plain attention's and its write
    leaves the pool as it was: both are checked."""
    from rstarjax.models import decode_kernel_mgpu as mgpu
    from rstarjax.models.paged_attention import write_targets

    plain = mosaic_arm(mosaic_blockings()[0])
    blocking = mosaic_append_blocking()

    @jax.jit
    def rope(q, k, v, table, lengths):
        num_pages, page_size = k.shape[1], k.shape[2]
        last = (lengths - 1)[:, None]
        page, offset = (x[:, 0] for x in write_targets(table, last, jnp.ones_like(last, bool),
                                                        num_pages, page_size))
        slots = page * page_size + offset
        k_new, v_new = (jnp.swapaxes(x[:, page, offset], 0, 1) for x in (k, v))
        half = q.shape[-1] // 2
        angles = (jnp.zeros((q.shape[0], half)), jnp.ones((q.shape[0], half)))
        return mgpu.decode_attention_mosaic_append(
            q, k_new, v_new, slots, k, v, table, lengths, rope=angles, scale=1.0,
            blocking=blocking, interpret=args.interpret)
    return [("mosaic", plain, False), ("mosaic_rope", rope, True)]


def canary_main():
    """``--canary``: one call of each Mosaic GPU kernel, a row each (module doc)."""
    for page_size, batch, context in itertools.product(*(map(int, x.split(",")) for x in
                                                         (args.page_sizes, args.batches, args.contexts))):
        q, k, v, table, lengths = inputs(batch, context, page_size)
        expected = jax.jit(reference)(q, k, v, table, lengths)
        for name, fn, writes in canary_arms():
            row = {"canary": True, "arm": name, "batch": batch, "context": context,
                   "page_size": page_size, "head_dim": args.head_dim, "ok": False}
            t = time.perf_counter()
            try:
                out = fn(q, k, v, table, lengths)
                if writes:
                    out, k_back, v_back = out
                    row["pools_unchanged"] = bool(jnp.array_equal(k_back, k) & jnp.array_equal(v_back, v))
                diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected)))
                row.update(max_diff_vs_reference=diff, seconds=round(time.perf_counter() - t, 2))
                row["ok"] = diff < 0.05 and row.get("pools_unchanged", True)  # bf16 p: ~0.02
            except Exception as exc:  # noqa: BLE001  (a kernel that fails is the result)
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(row), flush=True)
    return 0


def parse_arm(spec: str) -> tuple[str, str, str]:
    """ATTENTION:SAMPLER[:GEMMS] -> (attention, sampler, gemms); GEMMS (``serving.decode_gemms``,
    default xla) sets XLA options of the decode program alone, so arms alternate in one process."""
    from rstarjax.serving.programs import DECODE_GEMMS

    attention, sampler, *rest = spec.split(":")
    gemms = rest[0] if rest else "xla"
    if gemms not in DECODE_GEMMS:
        raise SystemExit(f"arm {spec!r}: GEMMS must be one of {sorted(DECODE_GEMMS)}")
    return attention, sampler, gemms


def set_arm(engine, arm) -> None:
    """The arm's static settings of the decode program (a new compile the first time)."""
    from rstarjax.serving.programs import DECODE_GEMMS

    engine.decode_attention, engine.sampler = arm[:2]
    engine.decode_xla_options = DECODE_GEMMS[arm[2]]


def compile_ahead(engine, state, arms, threads: int) -> tuple[dict, float]:
    """Each arm's decode program for the engine's active slots compiled before any runs,
    ``threads`` at a time (``timing.compile_in_threads``), so the arms' compiles overlap instead
    of queueing at their first calls; an arm that fails to lower here compiles (and fails, as a
    row) at its call. Returns (seconds per arm compiled, wall seconds of them all)."""
    from rstarjax.serving.programs import DECODE_GEMMS

    started = time.perf_counter()
    lowered = {}
    for arm in arms:
        try:
            lowered[arm] = engine.lower_decode(engine.params, state, attention=arm[0], sampler=arm[1],
                                               xla_options=DECODE_GEMMS[arm[2]])
        except Exception:  # noqa: BLE001  (its first call reports it)
            pass
    seconds = compile_in_threads(lowered, threads)
    return {a: round(t, 1) for a, t in seconds.items()}, time.perf_counter() - started


def engine_main():
    """The engine's decode step per batch x arm (module doc): one JSON line per batch x arm."""
    import gc

    from flax import nnx

    from rstarjax.models.config import ModelConfig
    from rstarjax.models.kv_cache import kv_bytes_per_token
    from rstarjax.models.qwen3 import Qwen3
    from rstarjax.serving import Engine, SamplingParams
    from rstarjax.serving.sizing import decode_weight_bytes_read
    from rstarjax.serving.start_plan import StartRequest

    from rstarjax.models import decode_gemm, decode_kernel

    if args.gemm_blocking:  # read when the decode programs are traced, as PACKED_BLOCKING
        decode_gemm.GEMM_BLOCKING = decode_gemm.GemmBlocking.from_spec(args.gemm_blocking)
    if args.packed_blocking:  # read when the decode programs are traced
        decode_kernel.PACKED_BLOCKING = decode_kernel.PackedBlocking(
            *map(int, args.packed_blocking.split(",")))
    if args.mosaic_blocking:
        from rstarjax.models import decode_kernel_mgpu

        decode_kernel_mgpu.MOSAIC_BLOCKING = decode_kernel_mgpu.MosaicBlocking(
            *map(int, args.mosaic_blocking.split(",")))
    if args.mosaic_append_blocking:
        from rstarjax.models import decode_kernel_mgpu

        decode_kernel_mgpu.MOSAIC_APPEND_BLOCKING = mosaic_append_blocking()
    t_start = time.perf_counter()
    arms = [parse_arm(a) for a in args.engine_arms.split(",") if a]
    peak = peak_gbps()
    for batch in map(int, args.batches.split(",")):
        if time.perf_counter() - t_start > args.budget_s:
            break
        cfg = ModelConfig.preset(args.preset, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        model = Qwen3(cfg, rngs=nnx.Rngs(0))
        calls = len(arms) * (args.rounds + 1) + 1 + len(args.trace_arms.split(","))
        try:  # a pool that cannot hold batch x prompt_len (4K contexts) is a row, not the end
            max_len = args.prompt_len + 16 * calls + 8
            engine = Engine(model, num_slots=batch, max_len=max_len,
                            kv_memory_fraction=0.8, decode_attention=arms[0][0],
                            interpret=args.interpret, sampler=arms[0][1])
            need = batch * -(-max_len // engine.page_size)  # every row to its last call's length
            if engine.num_pages < need:
                raise RuntimeError(f"the pool holds {engine.num_pages} pages, {batch} rows of "
                                   f"{max_len} tokens need {need}")
            rng = np.random.default_rng(0)
            state = engine.init_decode_state()
            state, _ = engine.start(engine.params, state, [
                StartRequest(r, rng.integers(0, cfg.vocab_size, args.prompt_len).tolist(),
                             SamplingParams(temperature=1.0, seed=r, max_new_tokens=10**6))
                for r in range(batch)])
        except Exception as exc:  # noqa: BLE001
            print(json.dumps({"engine": True, "preset": args.preset, "batch": batch,
                              "prompt_len": args.prompt_len,
                              "error": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)
            del model
            gc.collect()
            continue
        del model
        gc.collect()
        times = {arm: [] for arm in arms}
        context = {arm: [] for arm in arms}
        compile_s = {}
        failed = {}  # an arm whose program does not compile here is a row; the others go on
        ahead, ahead_wall = compile_ahead(engine, state, arms, args.compile_threads) \
            if args.compile_threads > 1 else ({}, None)
        for rnd in range(args.rounds + 1):  # round 0 compiles each arm's program (or runs it, compiled ahead)
            for arm in arms:
                if rnd and time.perf_counter() - t_start > args.budget_s:
                    break
                if arm in failed:
                    continue
                length = float(np.mean([engine.slot_length(r) for r in range(batch)]))
                t = time.perf_counter()
                try:  # an arm the engine refuses (set_arm) or the device does not compile is a row
                    set_arm(engine, arm)
                    state, block = engine.decode(engine.params, state)
                except Exception as exc:  # noqa: BLE001  (compiled before it runs: state intact)
                    if rnd:
                        raise
                    failed[arm] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                seconds = time.perf_counter() - t
                if rnd == 0:
                    compile_s[arm] = seconds
                else:
                    times[arm].append(seconds / block.steps)
                    context[arm].append(length)
        traces = {}
        if args.trace_dir and batch in map(int, args.trace_batches.split(",")):
            from tracing import trace_one_call

            for arm in ([parse_arm(a) for a in args.trace_arms.split(",") if a] or arms[-1:]):
                if arm not in times or time.perf_counter() - t_start > args.budget_s:
                    continue
                set_arm(engine, arm)

                def one_call():
                    nonlocal state
                    state, _ = engine.decode(engine.params, state)
                    return state
                name = "_".join(["decode", f"b{batch}", *(x for x in arm if x != "xla")]) + ".json.gz"
                traces[arm] = trace_one_call(one_call, os.path.join(args.trace_dir, name))
        weights = decode_weight_bytes_read(cfg, batch)
        for arm, error in failed.items():
            print(json.dumps({"engine": True, "preset": args.preset, "batch": batch,
                              "prompt_len": args.prompt_len, "attention": arm[0], "sampler": arm[1],
                              "gemms": arm[2], "error": error}), flush=True)
        for arm in arms:
            if not times[arm]:
                continue
            step = statistics.median(times[arm])
            moved = weights + float(np.mean(context[arm])) * batch * kv_bytes_per_token(cfg, jnp.bfloat16)
            row = {"engine": True, "preset": args.preset, "batch": batch,
                   "prompt_len": args.prompt_len, "attention": arm[0],
                   "sampler": arm[1], "gemms": arm[2], "calls": len(times[arm]), "step_ms": round(1e3 * step, 3),
                   "step_ms_range": [round(1e3 * min(times[arm]), 3), round(1e3 * max(times[arm]), 3)],
                   "decode_tok_s": round(batch / step, 1), "context": round(float(np.mean(context[arm]))),
                   "compile_s": round(compile_s[arm], 1), "bytes_per_step_gb": round(moved / 1e9, 4)}
            if ahead_wall is not None:  # compiled ahead: compile_s is then its first call's run
                row.update(compiled_ahead_s=ahead.get(arm), compile_ahead_wall_s=round(ahead_wall, 1),
                           compile_threads=args.compile_threads)
            if peak:
                row["roofline_fraction"] = round(moved / (peak * 1e9) / step, 4)
            if arm[0].endswith("_layer"):  # the paths that run our GEMMs
                row["gemm_blocking"] = decode_gemm.GEMM_BLOCKING.spec()
            if arm[0].startswith("pallas_mgpu"):  # the Mosaic GPU kernel's (BLOCK_TOKENS, STAGES)
                from rstarjax.models import decode_kernel_mgpu

                mosaic = (decode_kernel_mgpu.MOSAIC_BLOCKING if arm[0] == "pallas_mgpu_packed"
                          else decode_kernel_mgpu.MOSAIC_APPEND_BLOCKING)  # the writing kernel's
                row["mosaic_blocking"] = f"{mosaic.block_tokens},{mosaic.stages}"
            row.update(traces.get(arm, {}))
            print(json.dumps(row), flush=True)
        del engine, state
        gc.collect()


if __name__ == "__main__":
    sys.exit(engine_main() if args.engine else canary_main() if args.canary else main())

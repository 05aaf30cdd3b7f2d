"""Time the decode step's GEMMs alone: ours (``models/decode_gemm.py``, each blocking) against
XLA's ops of the same work; one JSON line per (batch, kind, arm).

    python benchmarks/decode_gemm_sweep.py                      # GPU: Qwen3-1.7B, 64 and 256 rows
    python benchmarks/decode_gemm_sweep.py --tiny --interpret   # CPU smoke run (interpreter)

Why: ``decode_attention="pallas_gpu_packed_layer"`` replaces a layer's ~10 XLA kernels beside
the attention by four of ours, and wins only if our GEMMs read the weights about as fast as
XLA's (docs/serving.md). Inside the engine that is one number among the attention's and the
sampler's; here it is measured by itself, in a few seconds a blocking, so a GPU loan learns
which blocking (if any) matches XLA before the engine arms run (gpu_check's ``gemms`` part
hands the best one to its ``decode`` part).

Kinds, at the ``--preset``'s layer shapes: ``layer`` (the four below chained as a decode layer
chains them, the attention left out: the q projection stands in for its output), ``qkv`` (the
input RMSNorm and the q/k/v projections), ``o`` (the output projection and the residual add),
``gate_up`` (the post-attention RMSNorm, the gate/up projections and SwiGLU), ``down`` (the
down projection and the residual add). Each kind runs over ``--layers`` layers of distinct
random weights in one program (unrolled, as the engine's layers are), so no weight is read from
L2 twice and a launch's host cost is spread over the layers.

Arms: ``xla`` (the model's ops, ``qwen3.rms_norm``, ``@``, ``jax.nn.silu``, as ``decoder_layer``
writes them), ``xla:cublas`` (the same with cuBLAS GEMMs, ``programs.DECODE_GEMMS``: the
strongest baseline at 64 rows), then ours with each ``--gemm-blockings`` spec in the order
given. The arms alternate for ``--rounds`` rounds; each row gives the median round (a round:
the median of ``--iters`` calls), its range, microseconds a layer, the bytes a layer reads and
writes over that time, its share of the HBM peak, the time against the faster XLA arm, and the
largest difference from the ``xla`` arm's output. Last, one ``{"best_gemm_blocking": ...}``
line: the blocking whose ``layer`` time against the faster XLA arm is lowest summed over the
batches (gpu_check reads it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

T_START = time.perf_counter()  # --budget-s counts from here: jax's import and start are in it
ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="qwen3-1.7b", help="the model shape (models/config.py PRESETS)")
ap.add_argument("--batches", default="64,256", help="rows a decode step, comma-separated")
ap.add_argument("--kinds", default="layer,qkv,o,gate_up,down")
ap.add_argument("--layers", type=int, default=0, help="layers of distinct weights (default: the preset's)")
ap.add_argument("--gemm-blockings", default="64,128,128,256,32,4,4",
                help="';'-separated BLOCK_ROWS,BLOCK_COLS,BLOCK_K,TARGET_PROGRAMS,MIN_COLS,NUM_WARPS,"
                     "NUM_STAGES specs (models/decode_gemm.py GemmBlocking), in the order to run")
ap.add_argument("--no-xla", action="store_true", help="ours only (no baseline: not for figures)")
ap.add_argument("--iters", type=int, default=10, help="calls a round (the median is the round's)")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--compile-threads", type=int, default=1,
                help="compile each (kind, batch)'s arms ahead, this many at a time; 1: each at its first call")
ap.add_argument("--peak-gbps", type=float, default=0.0, help="HBM peak (default: by device kind)")
ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting batches/kinds after this")
ap.add_argument("--tiny", action="store_true", help="the tiny preset, 2 layers, 2 rounds (CPU smoke run)")
ap.add_argument("--interpret", action="store_true", help="our kernels in Pallas' interpreter (CPU)")
args = ap.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rstarjax.models import decode_gemm  # noqa: E402
from rstarjax.models.config import ModelConfig  # noqa: E402
from rstarjax.models.qwen3 import rms_norm  # noqa: E402
from rstarjax.serving.programs import DECODE_GEMMS  # noqa: E402
from hardware import hbm_peak_gbps  # noqa: E402  (benchmarks/, this script's folder)
from timing import compile_in_threads, pipelined_call_seconds  # noqa: E402

if args.tiny:
    args.preset, args.batches, args.layers, args.rounds, args.iters = "tiny", "4,32", 2, 2, 2
    if args.gemm_blockings == ap.get_default("gemm_blockings"):
        args.gemm_blockings = "16,32,32,256,16,4,4;32,64,64,1,64,4,3"

KINDS = ("layer", "qkv", "o", "gate_up", "down")
EPS = 1e-6


def peak_gbps() -> float:
    kind = jax.devices()[0].device_kind
    return args.peak_gbps or hbm_peak_gbps(kind) or 0.0


def layer_weights(cfg: ModelConfig, layers: int, seed: int = 0) -> list[dict]:
    """``layers`` layers of random bf16 weights at the config's shapes, drawn on the device."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = dict(q_proj=(d, q), k_proj=(d, kv), v_proj=(d, kv), o_proj=(q, d),
                  gate_proj=(d, f), up_proj=(d, f), down_proj=(f, d))
    out = []
    for i in range(layers):
        keys = jax.random.split(jax.random.PRNGKey(seed * 1000 + i), len(shapes) + 2)
        p = {name: (jax.random.normal(k, s, jnp.float32) * s[0] ** -0.5).astype(cfg.dtype)
             for k, (name, s) in zip(keys, shapes.items())}
        p["input_norm"] = 1.0 + 0.1 * jax.random.normal(keys[-2], (d,), jnp.float32)
        p["post_attention_norm"] = 1.0 + 0.1 * jax.random.normal(keys[-1], (d,), jnp.float32)
        out.append(p)
    return out


def xla_ops():
    """The four steps as ``qwen3.decoder_layer`` writes them (XLA fuses and picks the GEMMs);
    the sums of squares our kernels hand on are None here."""
    return dict(
        qkv=lambda x, p, sums: tuple(rms_norm(x, p["input_norm"], EPS) @ p[n]
                                     for n in ("q_proj", "k_proj", "v_proj")),
        o=lambda a, res, p: (res + a @ p["o_proj"], None),
        gate_up=lambda x, p, sums: (lambda h: jax.nn.silu(h @ p["gate_proj"]) * (h @ p["up_proj"]))(
            rms_norm(x, p["post_attention_norm"], EPS)),
        down=lambda a, res, p: (res + a @ p["down_proj"], None))


def our_ops(blocking):
    """``qwen3.decode_layer_fused``'s kernels: each residual add hands its rows' sums of squares
    to the next norm, as in the engine."""
    kw = dict(blocking=blocking, interpret=args.interpret)
    return dict(
        qkv=lambda x, p, sums: decode_gemm.norm_matmul(
            x, p["input_norm"], (p["q_proj"], p["k_proj"], p["v_proj"]), eps=EPS, sums=sums, **kw),
        o=lambda a, res, p: decode_gemm.matmul_residual(a, p["o_proj"], res, with_sums=True, **kw),
        gate_up=lambda x, p, sums: decode_gemm.norm_matmul(
            x, p["post_attention_norm"], (p["gate_proj"], p["up_proj"]), eps=EPS, swiglu=True,
            sums=sums, **kw)[0],
        down=lambda a, res, p: decode_gemm.matmul_residual(a, p["down_proj"], res, with_sums=True, **kw))


def row_sums(x: jax.Array) -> jax.Array:
    """x's sums of squares as a residual kernel hands them on ([1, rows padded to the tile])."""
    padded = -(-x.shape[0] // decode_gemm.TILE) * decode_gemm.TILE
    sums = jnp.sum(jnp.square(x.astype(jnp.float32)), axis=1)
    return jnp.pad(sums, (0, padded - x.shape[0]))[None]


def program(kind: str, ops: dict, ours: bool):
    """f(x, attn, act, weights) running ``kind`` over every layer's weights; returns every
    output (so none is dead code) and, for the chained kinds, the last residual. The norms
    alone (qkv, gate_up) get x's sums as the kernel before them would give them (ours)."""
    def run(x, attn, act, weights):
        outs, sums = [], row_sums(x) if ours and kind in ("qkv", "gate_up") else None
        for p in weights:
            if kind == "layer":  # the decode layer's chain: q stands in for the attention's output
                q, k, v = ops["qkv"](x, p, sums)
                outs.append((k, v))  # returned, so XLA cannot drop their projections
                x, sums = ops["o"](q, x, p)
                x, sums = ops["down"](ops["gate_up"](x, p, sums), x, p)
            elif kind in ("qkv", "gate_up"):
                outs.append(ops[kind](x, p, sums))
            else:  # o, down: the residual carried from layer to layer
                x, extra = ops[kind](attn if kind == "o" else act, x, p)
                outs.append(extra)
        return x, [o for o in outs if o is not None]
    return run


def bytes_a_layer(cfg: ModelConfig, kind: str, rows: int) -> int:
    """HBM bytes one layer of ``kind`` must read and write at least (bf16 weights and rows)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    item = jnp.dtype(cfg.dtype).itemsize
    weights = dict(qkv=d * (q + 2 * kv), o=q * d, gate_up=2 * d * f, down=f * d)
    rows_moved = dict(qkv=d + q + 2 * kv, o=q + 2 * d, gate_up=d + f, down=f + 2 * d)
    if kind == "layer":
        return sum(bytes_a_layer(cfg, k, rows) for k in ("qkv", "o", "gate_up", "down"))
    return item * (weights[kind] + rows * rows_moved[kind])


def timed(fn, *a) -> float:
    """One round: ``--iters`` calls issued back to back, waited for once, per call (compiled and
    warmed before the rounds start). A call passes every layer's weights, ~10 arrays a layer,
    whose dispatch would otherwise sit in each arm's time alike and pull the ratios toward 1."""
    return pipelined_call_seconds(fn, *a, iters=args.iters)


def max_diff(kind: str, got, want) -> float:
    """Over what both arms return: the last residual, and each layer's products for the norms
    alone (o and down also return our sums of squares, which XLA's arm has not)."""
    pick = lambda out: [out[0], *(out[1] if kind in ("qkv", "gate_up") else [])]  # noqa: E731
    leaves = zip(jax.tree.leaves(pick(got)), jax.tree.leaves(pick(want)))
    return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))) for g, w in leaves)


def arms() -> list[tuple[dict, dict, dict]]:
    """(row fields, ops, compiler options) per arm, baselines first."""
    out = [] if args.no_xla else [(dict(arm="xla"), xla_ops(), {}),
                                  (dict(arm="xla:cublas"), xla_ops(), DECODE_GEMMS["cublas"])]
    for spec in (s for s in args.gemm_blockings.split(";") if s):
        blocking = decode_gemm.GemmBlocking.from_spec(spec)
        out.append((dict(arm="ours", blocking=blocking.spec()), our_ops(blocking), {}))
    return out


def over_budget() -> bool:
    return time.perf_counter() - T_START > args.budget_s


def main():
    cfg = ModelConfig.preset(args.preset)
    layers = args.layers or cfg.num_hidden_layers
    weights = layer_weights(cfg, layers)
    d, f, q = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := sorted(set(kinds) - set(KINDS)):
        raise SystemExit(f"--kinds {unknown}: not offered; choose from {KINDS}")
    peak = peak_gbps()
    ratios: dict[str, list[float]] = {}
    # each kind at every batch before the next kind: the layer rows (what the best blocking is
    # chosen from) come first whatever the budget leaves
    for kind in kinds:
        for batch in map(int, args.batches.split(",")):
            keys = jax.random.split(jax.random.PRNGKey(batch), 3)
            x = jax.random.normal(keys[0], (batch, d), jnp.float32).astype(cfg.dtype)
            attn = jax.random.normal(keys[1], (batch, q), jnp.float32).astype(cfg.dtype)
            act = jax.random.normal(keys[2], (batch, f), jnp.float32).astype(cfg.dtype)
            if over_budget():
                print(json.dumps({"batch": batch, "kind": kind, "skipped": "--budget-s spent"}), flush=True)
                continue
            trials, pending = [], []
            for fields, ops, options in arms():  # compile every arm first, then alternate
                row = {"batch": batch, "kind": kind, "layers": layers, "preset": args.preset, **fields}
                if over_budget():  # the arms compiled so far are still timed and compared
                    print(json.dumps({**row, "skipped": "--budget-s spent"}), flush=True)
                    continue
                try:
                    fn = jax.jit(program(kind, ops, fields["arm"] == "ours"),
                                 compiler_options=options or None)
                    lowered = fn.lower(x, attn, act, weights) if args.compile_threads > 1 else None
                    pending.append((row, fn, lowered))
                except Exception as exc:  # noqa: BLE001  (a blocking that does not lower is a result)
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    print(json.dumps(row), flush=True)
            ahead = compile_in_threads({i: low for i, (_, _, low) in enumerate(pending) if low is not None},
                                       args.compile_threads)
            for i, (row, fn, _) in enumerate(pending):
                try:
                    t0 = time.perf_counter()
                    out = jax.block_until_ready(fn(x, attn, act, weights))
                    row["compile_s"] = round(time.perf_counter() - t0, 2)  # compiled ahead: its first run
                    if i in ahead:
                        row["compiled_ahead_s"] = ahead[i]
                    trials.append((row, fn, out, []))
                except Exception as exc:  # noqa: BLE001  (a blocking the device refuses is a result)
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    print(json.dumps(row), flush=True)
            for _ in range(args.rounds):
                for _, fn, _, times in trials:
                    times.append(timed(fn, x, attn, act, weights))
            reference = next((out for row, _, out, _ in trials if row["arm"] == "xla"), None)
            xla_best = min((statistics.median(t) for row, _, _, t in trials if row["arm"].startswith("xla")),
                           default=None)
            moved = bytes_a_layer(cfg, kind, batch)
            for row, _, out, times in trials:
                per_layer = statistics.median(times) / layers
                row.update(us_per_layer=round(1e6 * per_layer, 2),
                           us_range=[round(1e6 * min(times) / layers, 2), round(1e6 * max(times) / layers, 2)],
                           mb_per_layer=round(moved / 1e6, 2), gbps=round(moved / per_layer / 1e9, 1))
                if peak:
                    row["hbm_fraction"] = round(moved / per_layer / 1e9 / peak, 3)
                if xla_best:
                    row["vs_best_xla"] = round(statistics.median(times) / xla_best, 3)
                if reference is not None and row["arm"] != "xla":
                    row["max_diff_vs_xla"] = max_diff(kind, out, reference)
                print(json.dumps(row), flush=True)
                if kind == "layer" and row["arm"] == "ours" and "vs_best_xla" in row:
                    ratios.setdefault(row["blocking"], []).append(row["vs_best_xla"])
            if kind == "layer" and ratios:  # after each batch, so a kill later keeps the best so far
                print(json.dumps(best_blocking(ratios)), flush=True)


def best_blocking(ratios: dict[str, list[float]]) -> dict:
    """The blocking whose layer time over the faster XLA arm's sums lowest over the batches
    (among those measured at every batch, when any is)."""
    batches = len(args.batches.split(","))
    complete = {b: r for b, r in ratios.items() if len(r) == batches} or ratios
    best = min(complete, key=lambda b: sum(complete[b]))
    return {"best_gemm_blocking": best, "layer_vs_best_xla": complete[best], "batches": args.batches}


if __name__ == "__main__":
    main()

"""Time jax's Pallas GPU paged-attention kernel over its blocking knobs; one JSON line per config.

    python benchmarks/decode_kernel_sweep.py                      # GPU: Qwen3-1.7B/8B kv layout
    python benchmarks/decode_kernel_sweep.py --tiny --interpret   # CPU smoke run (interpreter)

The decode profile on an H200 (docs/serving.md) puts ~60 % of a Qwen3-1.7B decode step in this
kernel at about a quarter of the HBM bandwidth. The engine picks its knobs from the page-table
width alone (``models/paged_attention.py``); this measures what each choice costs at the decode
shapes that matter: a batch of rows (``--batches``) whose contexts are ``--contexts`` tokens
(each row's length drawn within +-10 %), pages scattered over the pool as a long run leaves
them. Per config: the median time of the whole call (the kernel and its split-combining
epilogue), live KV GB/s, and the largest output difference from the default config's.
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
ap.add_argument("--page-size", type=int, default=16)
ap.add_argument("--width", type=int, default=288, help="page-table columns (stage 1: 4608 / 16)")
ap.add_argument("--per-block", default="4,8,16")
ap.add_argument("--k-splits", default="1,2,4,8,16")
ap.add_argument("--warps", default="4,8")
ap.add_argument("--stages", default="2")
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting configs after this")
ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
ap.add_argument("--interpret", action="store_true")
args = ap.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas.ops.gpu import paged_attention as kernel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rstarjax.models.paged_attention import PALLAS_GPU_BLOCKING  # noqa: E402

if args.tiny:
    args.batches, args.contexts, args.width = "4", "40", 8
    args.kv_heads, args.q_heads, args.head_dim = 2, 4, 16
    args.per_block, args.k_splits, args.warps = "2,4", "1,2", "4"


def inputs(batch: int, context: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    pages_per_row = args.width
    num_pages = batch * pages_per_row + 1
    shape = (args.kv_heads, num_pages, args.page_size, args.head_dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    table = rng.permutation(num_pages)[: batch * pages_per_row].reshape(batch, pages_per_row)
    lengths = rng.integers(int(0.9 * context), int(1.1 * context) + 1, batch)
    lengths = np.minimum(lengths, pages_per_row * args.page_size)
    q = jnp.asarray(rng.standard_normal((batch, args.q_heads, args.head_dim), np.float32),
                    jnp.bfloat16)
    return q, k, v, jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)


def engine_default(width: int) -> tuple[int, int]:
    """What the engine picks today: (pages per compute block, k splits)."""
    return PALLAS_GPU_BLOCKING.for_width(width)


def timed(fn, *a) -> float:
    jax.block_until_ready(fn(*a))
    times = []
    for _ in range(args.iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*a))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    t_start = time.perf_counter()
    kv_bytes_token = 2 * args.kv_heads * args.head_dim * 2  # K and V, bf16, one layer
    default = engine_default(args.width)
    configs = [(*default, PALLAS_GPU_BLOCKING.num_warps, PALLAS_GPU_BLOCKING.num_stages)]
    for per, ks, w, st in itertools.product(*(map(int, s.split(",")) for s in
                                              (args.per_block, args.k_splits, args.warps, args.stages))):
        if args.width % (per * ks) == 0 and (per, ks, w, st) not in configs:
            configs.append((per, ks, w, st))
    best = {}
    for batch, context in itertools.product(map(int, args.batches.split(",")),
                                            map(int, args.contexts.split(","))):
        q, k, v, table, lengths = inputs(batch, context)
        live = float(jnp.sum(lengths)) * kv_bytes_token
        ref = None
        for per, ks, w, st in configs:
            if time.perf_counter() - t_start > args.budget_s:
                break
            fn = jax.jit(lambda q, k, v, t, n, per=per, ks=ks, w=w, st=st: kernel.paged_attention(
                q, k, v, t, n, block_h=16, pages_per_compute_block=per, k_splits=ks,
                num_warps=w, num_stages=st, interpret=args.interpret))
            row = {"batch": batch, "context": context, "q_heads": args.q_heads,
                   "per_block": per, "k_splits": ks, "warps": w, "stages": st,
                   "default": (per, ks, w, st) == configs[0]}
            try:
                out = fn(q, k, v, table, lengths)
                ref = out if ref is None else ref
                row["max_diff_vs_default"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) -
                                                                   ref.astype(jnp.float32))))
                s = timed(fn, q, k, v, table, lengths)
                row.update(us=round(1e6 * s, 1), gbps=round(live / s / 1e9, 1))
            except Exception as exc:  # noqa: BLE001  (a config the kernel refuses is a result)
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            print(json.dumps(row), flush=True)
            key = (batch, context)
            if "us" in row and (key not in best or row["us"] < best[key]["us"]):
                best[key] = row
    for (batch, context), row in best.items():
        print(json.dumps({"best": True, **row}), flush=True)


if __name__ == "__main__":
    sys.exit(main())

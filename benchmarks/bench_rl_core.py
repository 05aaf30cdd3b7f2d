"""RL core throughput: RoC selection, TrainBatch building (padded vs packed), log-prob gather.

Prints ONE JSON line. Each figure sits next to a baseline measured in the same process:
  roc:    paper variant (weighted successive sampling) vs the official deterministic top-k;
  batch:  packed (first-fit decreasing) vs one-sequence-per-row padding (rows, fill, build time);
  logp:   fused logsumexp-gather token_logprobs vs log_softmax + take_along_axis (jit, fwd+bwd);
  hidden_logp: chunked (checkpointed) log-probs+entropy from hidden states vs full [B, L, V]
          logits: compiled temp memory and time of fwd+bwd.
Usage: python benchmarks/bench_rl_core.py [--groups 512] [--vocab 32768]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np

from rstarjax.models.logprobs import token_logprobs_from_hidden
from rstarjax.rl.batch import build_train_batch
from rstarjax.rl.loss import token_logprobs, token_logprobs_and_entropy
from rstarjax.rl.roc import RocStats, roc_select
from rstarjax.rl.trajectory import Segment, SegmentKind, ToolErrorCounts, Trajectory


def timeit(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def synthetic_groups(rng, groups, size):
    out = []
    for _ in range(groups):
        calls = rng.integers(0, 6, size)
        out.append([
            RocStats(reward=float(rng.random() < 0.5), tool_calls=int(c), tool_errors=int(rng.integers(0, c + 1)),
                     answer_tags=int(rng.integers(0, 3)), turns=int(max(1, c)))
            for c in calls
        ])
    return out


def synthetic_trajs(rng, n, max_len):
    trajs = []
    for _ in range(n):
        p = int(rng.integers(100, 300))
        r = int(min(max_len - p, rng.lognormal(6.8, 0.8)))
        trajs.append(Trajectory(prompt_ids=rng.integers(0, 1000, p),
                                segments=[Segment(SegmentKind.MODEL, rng.integers(0, 1000, r), np.full(r, -1.0))],
                                tool_errors=ToolErrorCounts(), reward=1.0))
    return trajs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--group_size", type=int, default=16)
    ap.add_argument("--trajs", type=int, default=256)
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--logp_batch", type=int, default=4)
    ap.add_argument("--logp_len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunk_len", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    res = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend()}

    groups = synthetic_groups(rng, args.groups, 2 * args.group_size)
    gen = np.random.default_rng(1)
    t_paper = timeit(lambda: [roc_select(g, args.group_size, gen) for g in groups])
    t_topk = timeit(lambda: [roc_select(g, args.group_size, None, variant="topk") for g in groups])
    res["roc_paper_ms_per_step"] = round(1e3 * t_paper, 2)
    res["roc_topk_ms_per_step_baseline"] = round(1e3 * t_topk, 2)

    trajs = synthetic_trajs(rng, args.trajs, args.seq_len)
    adv = [1.0] * len(trajs)
    t_pad = timeit(lambda: build_train_batch(trajs, adv, args.seq_len, 0))
    t_pack = timeit(lambda: build_train_batch(trajs, adv, args.seq_len, 0, pack=True))
    _, lay_pad = build_train_batch(trajs, adv, args.seq_len, 0)
    _, lay_pack = build_train_batch(trajs, adv, args.seq_len, 0, pack=True)
    res.update(batch_padded_rows_baseline=lay_pad.num_rows, batch_padded_fill_baseline=round(lay_pad.fill, 3),
               batch_padded_build_ms_baseline=round(1e3 * t_pad, 1), batch_packed_rows=lay_pack.num_rows,
               batch_packed_fill=round(lay_pack.fill, 3), batch_packed_build_ms=round(1e3 * t_pack, 1))

    b, l, v = args.logp_batch, args.logp_len, args.vocab
    logits = jax.random.normal(jax.random.key(0), (b, l, v), jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (b, l), 0, v)

    def naive(lg, tok):
        lsm = jax.nn.log_softmax(lg[:, :-1].astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(lsm, tok[:, 1:, None], axis=-1)[..., 0]
        return jnp.concatenate([jnp.zeros((tok.shape[0], 1)), picked], axis=1)

    def fwd_bwd(fn):
        return jax.jit(jax.grad(lambda lg: fn(lg, tokens).sum()))

    for name, fn in (("fused", token_logprobs), ("naive_baseline", naive)):
        f = fwd_bwd(fn)
        jax.block_until_ready(f(logits))
        res[f"logp_{name}_ms"] = round(1e3 * timeit(lambda: jax.block_until_ready(f(logits)), repeat=5), 2)
    same = jnp.max(jnp.abs(jax.jit(token_logprobs)(logits, tokens) - jax.jit(naive)(logits, tokens)))
    res["logp_max_abs_diff"] = float(same)

    # Peak temporary memory of grad(log-probs + entropy) from hidden states: chunked vs full logits.
    d = args.hidden
    hidden = jax.random.normal(jax.random.key(2), (1, args.chunk_len, d), jnp.float32)
    w = jax.random.normal(jax.random.key(3), (d, v), jnp.float32) * 0.05
    tok = jax.random.randint(jax.random.key(4), (1, args.chunk_len), 0, v)

    def full_path(h, w):
        lp, ent = token_logprobs_and_entropy(h @ w, tok)
        return lp.sum() + ent.sum()

    def chunk_path(h, w):
        lp, ent = token_logprobs_from_hidden(h, w, tok, vocab_major=False, chunk_len=args.chunk)
        return lp.sum() + ent.sum()

    for name, fn in (("chunked", chunk_path), ("full_logits_baseline", full_path)):
        f = jax.jit(jax.grad(fn, argnums=(0, 1)))
        mem = f.lower(hidden, w).compile().memory_analysis()
        res[f"hidden_logp_{name}_temp_mib"] = round(mem.temp_size_in_bytes / 2**20, 1) if mem else None
        jax.block_until_ready(f(hidden, w))
        res[f"hidden_logp_{name}_ms"] = round(1e3 * timeit(lambda: jax.block_until_ready(f(hidden, w)), repeat=2), 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

"""Serving slices benchmark: decode tokens/s of one workload served by different slice layouts
of the same devices (``S x TP``: S slices of TP devices each, e.g. 1 x TP-8, 2 x TP-4,
8 x TP-1), through the rollout scheduler; prints ONE JSON line.

Every layout gets the same total decode slots (split evenly over its slices), the same float32
weights and the same greedy requests, split in equal contiguous shares over its slices; the completions are checked identical across layouts
(tensor parallelism must not change a token). Compiles are excluded (a warm-up run first);
``--repeat N`` alternates the layouts N times and reports the median and [min, max].

On CPU the devices are simulated (``--xla_force_host_platform_device_count``) and share the
host's cores: the figures show the overhead of the partitioned programs and their collectives,
not the speed-up of real accelerators.

    python benchmarks/serving_slices.py [--devices 8] [--layouts 1x8,2x4,8x1] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices (CPU only)")
ap.add_argument("--layouts", default="1x8,2x4,8x1", help="SLICESxTP, comma separated")
ap.add_argument("--prompts", type=int, default=32)
ap.add_argument("--new-tokens", type=int, default=64)
ap.add_argument("--slots", type=int, default=32, help="decode slots in total, over all slices")
ap.add_argument("--repeat", type=int, default=1)
args = ap.parse_args()
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rstarjax.models.config import ModelConfig  # noqa: E402
from rstarjax.models.qwen3 import Qwen3  # noqa: E402
from rstarjax.serving import Engine, RolloutScheduler, SamplingParams, slice_meshes  # noqa: E402
from rstarjax.serving.generate import _OneTurn  # noqa: E402


def model() -> Qwen3:
    cfg = ModelConfig.preset("demo", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                             num_attention_heads=8, num_key_value_heads=8, head_dim=64,
                             dtype=jnp.float32)
    return Qwen3(cfg, rngs=nnx.Rngs(0))


def engines(m: Qwen3, slices: int, tp: int, max_len: int) -> list[Engine]:
    meshes = slice_meshes(jax.devices(), tensor_parallel=tp, num_slices=slices)
    return [Engine(m, mesh=mesh, max_len=max_len, num_slots=args.slots // slices,
                   cache_dtype=jnp.float32) for mesh in meshes]


def run(es: list[Engine], prompts) -> tuple[float, list]:
    episodes = [_OneTurn(p, SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens))
                for p in prompts]
    t0 = time.perf_counter()
    # Static split (equal contiguous shares): every run gives each slice the same requests, so
    # the warm-up compiled every shape a timed run meets (the dynamic queue splits differently
    # each run, and a slice meeting a new batch bucket would compile inside the timing).
    RolloutScheduler(es, max_rollout_len=es[0].max_len, admit_reserve_tokens=0,
                     policy="static", sync_turns=False).run(episodes)
    return time.perf_counter() - t0, [ep.out.token_ids for ep in episodes]


def main():
    m = model()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 4000, int(n)).tolist()
               for n in rng.integers(16, 128, args.prompts)]
    max_len = max(map(len, prompts)) + args.new_tokens
    layouts = [tuple(map(int, s.split("x"))) for s in args.layouts.split(",")]
    built = {lay: engines(m, *lay, max_len) for lay in layouts}
    outputs, seconds = {}, {lay: [] for lay in layouts}
    for lay in layouts:  # warm-up: compiles
        _, outputs[lay] = run(built[lay], prompts)
    first = outputs[layouts[0]]
    same = {f"{s}x{t}": outputs[(s, t)] == first for s, t in layouts}
    for _ in range(args.repeat):
        for lay in layouts:
            seconds[lay].append(run(built[lay], prompts)[0])
    tokens = sum(len(o) for o in first)
    figures = {f"{s}xTP{t}_tokens_per_s": round(tokens / statistics.median(seconds[(s, t)]), 1)
               for s, t in layouts}
    spread = {f"{s}xTP{t}_tokens_per_s": [round(tokens / max(seconds[(s, t)]), 1),
                                          round(tokens / min(seconds[(s, t)]), 1)]
              for s, t in layouts}
    print(json.dumps({"benchmark": "serving_slices", "device": jax.devices()[0].device_kind,
                      "devices": jax.device_count(), "prompts": args.prompts,
                      "new_tokens": args.new_tokens, "slots": args.slots, "repeat": args.repeat,
                      **figures, "spread": spread, "tokens_identical": same}))


if __name__ == "__main__":
    main()

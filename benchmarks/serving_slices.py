"""Serving slices benchmark: decode tokens/s of one workload served by different slice layouts
of the same devices (``S x TP``: S slices of TP devices each, e.g. 1 x TP-8, 2 x TP-4,
8 x TP-1), through the rollout scheduler; prints ONE JSON line.

Every layout gets the same total decode slots (split evenly over its slices), the same float32
weights and the same greedy requests, split in equal contiguous shares over its slices; the completions are checked identical across layouts
(tensor parallelism must not change a token). Compiles are excluded (a warm-up run first);
``--repeat N`` alternates the layouts N times and reports the median and [min, max].

The weight hand-off, per layout, side by side with its cost baseline, the update step: the
float32 params of a ``Trainer`` (FSDP over every device) become every slice's serving copy in
``--handoff-dtype`` (default bfloat16, the shipped serving dtype) and layout
(``handoff.serving_copies``: one program, no host round trip), ``handoff_seconds``; the
previous path (``jax.device_put`` onto each slice, which reshards FSDP shards through the host,
then a cast program per slice), ``handoff_previous_seconds``; and one ``Trainer.update`` of
``--train-rows`` x ``--train-seq`` tokens on the same model and devices,
``update_step_seconds``. Each is the median of ``--repeat`` (at least 3) alternating runs.

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
ap.add_argument("--repeat", type=int, default=3)
ap.add_argument("--handoff-dtype", default="bfloat16")
ap.add_argument("--train-rows", type=int, default=8, help="rows of the timed update step")
ap.add_argument("--train-seq", type=int, default=256, help="tokens per row of the update step")
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
from rstarjax.models.sharding import make_mesh, state_shardings  # noqa: E402
from rstarjax.rl import optim as optim_lib  # noqa: E402
from rstarjax.rl import trainer as trainer_lib  # noqa: E402
from rstarjax.rl.loss import LossConfig  # noqa: E402
from rstarjax.serving import Engine, RolloutScheduler, SamplingParams, slice_meshes  # noqa: E402
from rstarjax.serving import handoff as handoff_lib  # noqa: E402
from rstarjax.serving.completions import _OneTurn  # noqa: E402


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


def handoff_targets(es: list[Engine]) -> list:
    """Each slice's serving shardings (the engines serve float32, so that every layout decodes
    the same tokens; the shardings of a bfloat16 copy are the same)."""
    return [e.layout.target for e in es]


def handoff(graphdef, state, es: list[Engine], dtype) -> float:
    t0 = time.perf_counter()
    copies = handoff_lib.serving_copies(graphdef, state, handoff_targets(es), dtype=dtype,
                                        untie_head=es[0].layout.untie_head)
    jax.block_until_ready(copies)
    return time.perf_counter() - t0


def previous_handoff(graphdef, state, es: list[Engine], dtype) -> float:
    """The path before ``serving_copies``: the state onto each slice (its logical axes on the
    slice's mesh: jax reshards FSDP shards it cannot map device to device through the host),
    then one cast program per slice."""
    t0 = time.perf_counter()
    copies = []
    for e, target in zip(es, handoff_targets(es)):
        placed = jax.device_put(state, state_shardings(state, e.mesh))
        copies.append(_previous_cast(e.graphdef, dtype, e.layout.untie_head, target)(placed))
    jax.block_until_ready(copies)
    return time.perf_counter() - t0


_previous = {}


def _previous_cast(graphdef, dtype, untie, target):
    key = (id(target), dtype)
    if key not in _previous:
        _previous[key] = jax.jit(lambda st: handoff_lib.serving_fn(graphdef, st, dtype, untie),
                                 out_shardings=target)
    return _previous[key]


def trainer_step(m: Qwen3):
    """A Trainer over every device (FSDP, as the RL recipe's default mesh) and a callable
    running one timed update of ``--train-rows`` x ``--train-seq`` tokens."""
    tr = trainer_lib.Trainer(m, optim_lib.OptimConfig(learning_rate=1e-6), LossConfig(),
                             trainer_lib.TrainerConfig(recompute_old_logprobs=False),
                             mesh=make_mesh(1, -1, 1))
    rng = np.random.default_rng(1)
    b, n = args.train_rows, args.train_seq
    mask = np.zeros((b, n), np.float32)
    mask[:, n // 4:] = 1.0
    old = (-5.0 + 0.3 * rng.standard_normal((b, n))).astype(np.float32) * mask
    batch = tr.put_batch(dict(
        tokens=rng.integers(0, m.config.vocab_size, (b, n)).astype(np.int32),
        positions=np.broadcast_to(np.arange(n, dtype=np.int32), (b, n)).copy(),
        segment_ids=np.ones((b, n), np.int32), loss_mask=mask, old_logprobs=old,
        rollout_logprobs=old,
        advantages=(np.where(rng.random(b) < 0.5, 1.0, -1.0)[:, None] * mask).astype(np.float32)))

    def step() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(tr.update(batch, tr.policy_loss))
        return time.perf_counter() - t0
    return tr, step


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
    # The hand-off vs the update step it follows, alternating (the trainer's params: float32,
    # FSDP over every device, as the colocated RL recipe holds them).
    dtype = jnp.dtype(args.handoff_dtype)
    tr, update = trainer_step(m)
    graphdef = built[layouts[0]][0].graphdef
    ours = {lay: [] for lay in layouts}
    previous = {lay: [] for lay in layouts}
    update_seconds = []
    update()  # compiles
    state = nnx.split(tr.model())[1]
    for lay in layouts:  # compiles
        handoff(graphdef, state, built[lay], dtype)
        previous_handoff(graphdef, state, built[lay], dtype)
    for _ in range(args.repeat):
        update_seconds.append(update())
        state = nnx.split(tr.model())[1]  # the update donated the previous params
        for lay in layouts:
            ours[lay].append(handoff(graphdef, state, built[lay], dtype))
            previous[lay].append(previous_handoff(graphdef, state, built[lay], dtype))

    def med(xs):
        return round(statistics.median(xs), 5)

    def spread_of(xs):
        return [round(min(xs), 5), round(max(xs), 5)]
    name = {lay: f"{lay[0]}xTP{lay[1]}" for lay in layouts}
    handoffs = {
        "handoff_dtype": str(dtype),
        "handoff_seconds": {name[lay]: med(ours[lay]) for lay in layouts},
        "handoff_previous_seconds": {name[lay]: med(previous[lay]) for lay in layouts},
        "update_step_seconds": med(update_seconds),
        "update_step_tokens": args.train_rows * args.train_seq,
        "handoff_spread": {name[lay]: spread_of(ours[lay]) for lay in layouts},
        "handoff_previous_spread": {name[lay]: spread_of(previous[lay]) for lay in layouts},
        "update_step_spread": spread_of(update_seconds),
    }
    tokens = sum(len(o) for o in first)
    figures = {f"{s}xTP{t}_tokens_per_s": round(tokens / statistics.median(seconds[(s, t)]), 1)
               for s, t in layouts}
    spread = {f"{s}xTP{t}_tokens_per_s": [round(tokens / max(seconds[(s, t)]), 1),
                                          round(tokens / min(seconds[(s, t)]), 1)]
              for s, t in layouts}
    print(json.dumps({"benchmark": "serving_slices", "device": jax.devices()[0].device_kind,
                      "devices": jax.device_count(), "prompts": args.prompts,
                      "new_tokens": args.new_tokens, "slots": args.slots, "repeat": args.repeat,
                      **figures, "spread": spread, "tokens_identical": same, **handoffs}))


if __name__ == "__main__":
    main()

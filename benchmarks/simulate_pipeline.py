"""SIMULATION, not a measurement: the step time of the RL loop at the paper's scale, projected for
synchronous, asynchronous (bounded staleness k = 1), partial-rollout and combined schedules.

    python benchmarks/simulate_pipeline.py [--gpus 64] [--prompts 512] [--samples 32]
        [--max-response 12288] [--mean-response 6000] [--tp 2] [--budget 4096] [--seeds 3] [--quick]

Prints one JSON line: the projected seconds per step and trained tokens per second of each
schedule (median over ``--seeds`` workload draws, with the range), and the speedups over the
synchronous loop. Nothing runs on a device; the numbers are only as good as the cost model:

- **Workload** (rStar2-Agent, arXiv 2508.20722, §4 and §5: Qwen3-14B, 64 GPUs, 512 prompts x 32
  rollouts, responses up to 12K tokens whose mean grows from ~6K to ~8K, at most 10 tool turns,
  0.3 s per tool call on average from dispatch to result, §3.1): each rollout draws its model
  tokens from a log-normal capped at the response budget, its turns from a geometric
  distribution capped at ``max_turns``, its tool waits from an exponential with the paper's mean.
- **Decode step** of one serving slice (TP ``t``): weight bytes / (t x weight bandwidth) + the
  K/V bytes of every active row's context / (t x K/V bandwidth). The two effective bandwidths
  (2.8 and 1.4 TB/s) are the values that reproduce the Qwen3-8B decode steps measured on one
  H200 (docs/serving.md: 10.25 ms at 64 rows and 23.39 ms at 256 rows of ~650 tokens; the
  profile of that call also reads K/V at 1.4 TB/s). Prefill and tool-output extends are
  compute-bound at ``prefill_mfu``.
- **Update**: the model FLOPs of training on the trained tokens plus one forward for the old
  log-probs, at the train MFU measured on one H200 (37.9 % at 4 x 8K tokens, docs/training.md),
  over the GPUs that train. The hand-off of new weights costs ``handoff_s``.
- **Scheduling** (§3.2): rollouts go to slices from one shared queue, each slice admitting at most
  K = KV capacity / (prompt + response budget) rows, the paper's rule.

Schedules:
- ``sync``: the paper's loop; every GPU decodes, then every GPU trains.
- ``sync_disaggregated``: ``R`` GPUs decode while the others wait, then those train.
- ``async``: disaggregated, rollouts for step n + 1 generated while step n trains (k = 1):
  a step takes max(rollout, update + hand-off); R is the best split in eighths of the GPUs.
- ``partial``: colocated; each rollout decodes at most ``--budget`` model tokens per step
  (Kimi k1.5, arXiv 2501.12599, §2.6.2: partial rollouts), is paused with its KV kept and
  continues in the next step; a group is trained once all its samples finished. Each step
  admits ``--prompts`` new groups, so in the steady state as many groups finish as start.
- ``async_partial``: both.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402

from rstarjax.models.config import ModelConfig  # noqa: E402
from rstarjax.models.kv_cache import kv_bytes_per_token  # noqa: E402

GB = 1e9


# ---- the cost model ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU. Defaults: an H200 as measured in docs/serving.md and docs/training.md."""
    hbm_bytes: float = 141 * GB
    memory_fraction: float = 0.95
    weight_bandwidth: float = 2.8e12  # effective bytes/s of the decode step's weight reads
    kv_bandwidth: float = 1.4e12  # effective bytes/s of the paged-attention kernel's K/V reads
    peak_flops: float = 989e12  # dense bf16
    train_mfu: float = 0.379
    prefill_mfu: float = 0.35


@dataclasses.dataclass(frozen=True)
class ModelShape:
    params: float
    weight_bytes: float  # bf16 serving copy
    kv_bytes_per_token: float  # all layers, bf16
    train_flops_per_token: float  # at the row length the update sees
    state_bytes: float  # float32 master weights + AdamW moments + gradients (16 bytes per parameter)

    @classmethod
    def of(cls, preset: str, row_tokens: int) -> "ModelShape":
        cfg = ModelConfig.preset(preset)
        n = cfg.num_params
        return cls(params=n, weight_bytes=2.0 * n, kv_bytes_per_token=kv_bytes_per_token(cfg, jnp.bfloat16),
                   train_flops_per_token=cfg.train_flops_per_token(row_tokens), state_bytes=16.0 * n)


def decode_step_seconds(model: ModelShape, hw: Hardware, tp: int, context_tokens: float) -> float:
    """One decode step of a TP-``tp`` slice whose active rows hold ``context_tokens`` in all:
    it reads the weights once and every row's K/V once (the memory-bound decode)."""
    return (model.weight_bytes / (tp * hw.weight_bandwidth)
            + context_tokens * model.kv_bytes_per_token / (tp * hw.kv_bandwidth))


def prefill_seconds(model: ModelShape, hw: Hardware, tp: int, tokens: float) -> float:
    """Prefill or extend of ``tokens`` on a TP-``tp`` slice: 2 N FLOPs per token, compute-bound."""
    return 2.0 * model.params * tokens / (tp * hw.peak_flops * hw.prefill_mfu)


def update_seconds(model: ModelShape, hw: Hardware, gpus: int, tokens: float) -> float:
    """The RL update on ``gpus`` GPUs: training FLOPs plus the old-log-prob forward (a third)."""
    return tokens * model.train_flops_per_token * (4.0 / 3.0) / (gpus * hw.peak_flops * hw.train_mfu)


def slice_rows(model: ModelShape, hw: Hardware, tp: int, row_tokens: int, train_gpus: int) -> int:
    """The paper's K: rows a slice admits at full length. Colocated slices also hold their share
    of the training state (``train_gpus`` > 0: sharded over that many GPUs)."""
    state = model.state_bytes / train_gpus * tp if train_gpus else 0.0
    free = hw.memory_fraction * hw.hbm_bytes * tp - model.weight_bytes - state
    return max(0, int(free // (row_tokens * model.kv_bytes_per_token)))


# ---- the workload --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: int = 512
    samples: int = 32  # 2G with Resample-on-Correct
    prompt_tokens: int = 300
    max_response: int = 12288
    mean_response: float = 6000.0  # model tokens
    sigma: float = 0.7  # of the log-normal
    mean_turns: float = 3.0
    max_turns: int = 10
    tool_tokens: int = 150  # tool output tokens per call
    tool_wait_s: float = 0.3  # paper §3.1: mean latency of a call


@dataclasses.dataclass
class Rollout:
    """One rollout's plan (its turns) and how far it got."""
    group: int
    decode: list[int]  # model tokens of each turn
    tool_wait: list[float]  # after each turn but the last
    tool_tokens: int
    prompt_tokens: int
    turn: int = 0
    done_in_turn: int = 0
    slice_id: int = -1  # the slice holding its KV once started
    finished: bool = False

    @property
    def context(self) -> int:
        return (self.prompt_tokens + sum(self.decode[:self.turn]) + self.done_in_turn
                + self.turn * self.tool_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.decode) + (len(self.decode) - 1) * self.tool_tokens


def sample_rollouts(w: Workload, rng: np.random.Generator, first_group: int = 0) -> list[Rollout]:
    """``w.prompts`` x ``w.samples`` rollouts: log-normal lengths capped so model and tool tokens fit
    the response budget, geometric turn counts, exponential tool waits."""
    mu = math.log(w.mean_response) - w.sigma ** 2 / 2
    out = []
    for g in range(w.prompts):
        for _ in range(w.samples):
            turns = int(min(w.max_turns, rng.geometric(1.0 / w.mean_turns)))
            budget = w.max_response - (turns - 1) * w.tool_tokens
            length = int(np.clip(rng.lognormal(mu, w.sigma), turns, budget))
            # at least one token per turn, the rest split at random: exactly ``length`` in all
            decode = (1 + rng.multinomial(length - turns, rng.dirichlet(np.ones(turns)))).tolist()
            waits = rng.exponential(w.tool_wait_s, turns - 1).tolist()
            out.append(Rollout(first_group + g, decode, waits, w.tool_tokens, w.prompt_tokens))
    return out


# ---- one slice's decode loop, event by event ------------------------------------------------------
def run_rollouts(queue: list[Rollout], slices: int, rows: int, model: ModelShape, hw: Hardware,
                 tp: int, budget: int = 0) -> float:
    """Decode ``queue`` on ``slices`` slices of ``rows`` rows each, from one shared queue (§3.2)
    (a rollout that already holds a slice's KV goes back to that slice, first); returns the
    makespan. ``budget`` > 0: a rollout decodes at most that many model tokens in this call and is
    paused (``finished`` stays False) when it reaches it. Between events every decoding row of a
    slice advances one token per step; a step's time follows its rows' total context."""
    if rows < 1:
        raise ValueError("a slice holds no row at full length: more memory, TP or a shorter budget")
    waiting = [r for r in queue if not r.finished]
    pinned = [[r for r in waiting if r.slice_id == s] for s in range(slices)]
    fresh = [r for r in waiting if r.slice_id < 0]
    fresh.reverse()  # pop() takes them in order
    clocks = [(0.0, s) for s in range(slices)]
    heapq.heapify(clocks)
    # per slice and row: its rollout, the model tokens left in its turn, when it decodes again
    # (after a tool call), the tokens it decoded in this call, and its context
    occupant = [[None] * rows for _ in range(slices)]
    busy = np.zeros((slices, rows), bool)
    left = np.zeros((slices, rows), np.int64)
    wake = np.zeros((slices, rows))
    spent = np.zeros((slices, rows), np.int64)
    context = np.zeros((slices, rows))
    makespan = 0.0
    while clocks:
        now, s = heapq.heappop(clocks)
        for j in np.nonzero(~busy[s])[0]:  # admit (pinned first: their KV is on this slice)
            if not (pinned[s] or fresh):
                break
            r = pinned[s].pop() if pinned[s] else fresh.pop()
            if r.slice_id < 0:
                r.slice_id = s
                now += prefill_seconds(model, hw, tp, r.prompt_tokens)
            occupant[s][j] = r
            busy[s, j], left[s, j], wake[s, j] = True, r.decode[r.turn] - r.done_in_turn, now
            spent[s, j], context[s, j] = 0, r.context
        if not busy[s].any():
            makespan = max(makespan, now)
            continue
        decoding = busy[s] & (wake[s] <= now)
        if not decoding.any():  # every row waits on its tool
            heapq.heappush(clocks, (wake[s][busy[s]].min(), s))
            continue
        n = int(decoding.sum())
        steps = int(left[s][decoding].min())
        if budget:
            steps = min(steps, int(budget - spent[s][decoding].max()))
        total = float(context[s][decoding].sum())
        # the step time is linear in the context, so the chunk's mean step is its middle one's
        per_step = decode_step_seconds(model, hw, tp, total + n * (steps - 1) / 2)
        sleeping = busy[s] & ~decoding
        if sleeping.any():  # stop at the first tool result, so that its row joins the batch
            first = float(wake[s][sleeping].min())
            if steps * per_step > first - now:
                steps = max(1, int((first - now) / per_step))
                per_step = decode_step_seconds(model, hw, tp, total + n * (steps - 1) / 2)
        now += steps * per_step
        left[s][decoding] -= steps
        spent[s][decoding] += steps
        context[s][decoding] += steps
        for j in np.nonzero(decoding & (left[s] == 0))[0]:  # turns that ended
            r = occupant[s][j]
            if r.turn == len(r.decode) - 1:
                r.finished, r.done_in_turn = True, r.decode[r.turn]
                busy[s, j], occupant[s][j] = False, None
                continue
            now += prefill_seconds(model, hw, tp, r.tool_tokens)
            wake[s, j] = now + r.tool_wait[r.turn]
            r.turn, r.done_in_turn = r.turn + 1, 0
            left[s, j] = r.decode[r.turn]
            context[s, j] += r.tool_tokens
        if budget:  # paused: its KV stays on this slice for the next call
            for j in np.nonzero(busy[s] & (spent[s] >= budget))[0]:
                r = occupant[s][j]
                r.done_in_turn = r.decode[r.turn] - int(left[s, j])
                busy[s, j], occupant[s][j] = False, None
        heapq.heappush(clocks, (now, s))
    return makespan


# ---- the schedules -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setup:
    gpus: int = 64
    tp: int = 2
    preset: str = "qwen3-14b"
    budget: int = 4096  # partial rollouts: model tokens per rollout per step
    handoff_s: float = 2.0
    trained_fraction: float = 0.5  # Resample-on-Correct keeps G of 2G
    steps: int = 6  # partial schedules: steps simulated (the first two are warm-up)


def _trained_tokens(rollouts: list[Rollout], frac: float) -> float:
    return frac * sum(r.total_tokens for r in rollouts)


def _groups(setup: Setup, rollout_gpus: int | None) -> tuple[int, int, bool]:
    """(GPUs that decode, GPUs that train, colocated): ``rollout_gpus`` None is colocated."""
    if rollout_gpus is None:
        return setup.gpus, setup.gpus, True
    return rollout_gpus, setup.gpus - rollout_gpus, False


def sync_step(w: Workload, setup: Setup, hw: Hardware, seed: int, rollout_gpus: int | None = None) -> dict:
    """One step of the synchronous loop, and the same rollouts under k = 1 overlap: rollout
    makespan, update seconds, step seconds and trained tokens per second of both."""
    model = ModelShape.of(setup.preset, w.prompt_tokens + w.max_response)
    rollouts = sample_rollouts(w, np.random.default_rng(seed))
    r_gpus, t_gpus, colocated = _groups(setup, rollout_gpus)
    rows = slice_rows(model, hw, setup.tp, w.prompt_tokens + w.max_response, t_gpus if colocated else 0)
    rollout_s = run_rollouts(rollouts, r_gpus // setup.tp, rows, model, hw, setup.tp)
    tokens = _trained_tokens(rollouts, setup.trained_fraction)
    update_s = update_seconds(model, hw, t_gpus, tokens) + setup.handoff_s
    sync_s, overlap_s = rollout_s + update_s, max(rollout_s, update_s)
    return {"rollout_s": rollout_s, "update_s": update_s, "step_s": sync_s, "tokens_per_s": tokens / sync_s,
            "overlap_step_s": overlap_s, "overlap_tokens_per_s": tokens / overlap_s, "rows_per_slice": rows}


def partial_steps(w: Workload, setup: Setup, hw: Hardware, seed: int, rollout_gpus: int | None = None,
                  overlap: bool = False) -> dict:
    """``setup.steps`` steps with partial rollouts: each admits ``w.prompts`` new groups, decodes
    every rollout for at most ``setup.budget`` model tokens, and trains the groups whose samples
    all finished. Trained tokens per second over the steps after the first two."""
    model = ModelShape.of(setup.preset, w.prompt_tokens + w.max_response)
    rng = np.random.default_rng(seed)
    r_gpus, t_gpus, colocated = _groups(setup, rollout_gpus)
    rows = slice_rows(model, hw, setup.tp, w.prompt_tokens + w.max_response, t_gpus if colocated else 0)
    carried: list[Rollout] = []
    per_step = []  # (trained tokens, rollout s, update s, step s)
    for step in range(setup.steps):
        queue = carried + sample_rollouts(w, rng, first_group=step * w.prompts)
        rollout_s = run_rollouts(queue, r_gpus // setup.tp, rows, model, hw, setup.tp, budget=setup.budget)
        open_groups = {r.group for r in queue if not r.finished}
        done = [r for r in queue if r.group not in open_groups]
        carried = [r for r in queue if r.group in open_groups]
        tokens = _trained_tokens(done, setup.trained_fraction)
        update_s = update_seconds(model, hw, t_gpus, tokens) + setup.handoff_s
        per_step.append((tokens, rollout_s, update_s, max(rollout_s, update_s) if overlap else rollout_s + update_s))
    tokens, rollout_s, update_s, step_s = (np.array(c) for c in zip(*per_step[2:] or per_step))
    return {"rollout_s": float(rollout_s.mean()), "update_s": float(update_s.mean()),
            "step_s": float(step_s.mean()), "tokens_per_s": float(tokens.sum() / step_s.sum()),
            "rows_per_slice": rows, "groups_in_flight": len({r.group for r in carried})}


def _splits(setup: Setup, hw: Hardware, model: ModelShape) -> list[int]:
    """GPUs that decode in a disaggregated split, in eighths of the machine (whole slices), such
    that the others hold the training state with half their memory left for activations."""
    step = max(setup.tp, setup.gpus // 8 // setup.tp * setup.tp)
    return [r for r in range(step, setup.gpus, step)
            if model.state_bytes / (setup.gpus - r) <= hw.memory_fraction * hw.hbm_bytes * 0.5]


def project(w: Workload, setup: Setup, hw: Hardware, seed: int) -> dict:
    """Every schedule on one workload draw; the disaggregated ones at their best split."""
    model = ModelShape.of(setup.preset, w.prompt_tokens + w.max_response)
    splits = _splits(setup, hw, model)
    if not splits:
        raise ValueError(f"no split of {setup.gpus} GPUs holds the training state on the trainers")
    by_split = {r: sync_step(w, setup, hw, seed, rollout_gpus=r) for r in splits}
    sync_r = max(splits, key=lambda r: by_split[r]["tokens_per_s"])
    async_r = max(splits, key=lambda r: by_split[r]["overlap_tokens_per_s"])
    a = by_split[async_r]
    near = [r for r in splits if abs(splits.index(r) - splits.index(async_r)) <= 1]
    both = {r: partial_steps(w, setup, hw, seed, rollout_gpus=r, overlap=True) for r in near}
    both_r = max(near, key=lambda r: both[r]["tokens_per_s"])
    return {
        "sync": sync_step(w, setup, hw, seed),
        "sync_disaggregated": {**by_split[sync_r], "rollout_gpus": sync_r},
        "async": {**a, "step_s": a["overlap_step_s"], "tokens_per_s": a["overlap_tokens_per_s"],
                  "rollout_gpus": async_r},
        "partial": partial_steps(w, setup, hw, seed),
        "async_partial": {**both[both_r], "rollout_gpus": both_r},
    }


def summarize(runs: list[dict]) -> dict:
    """Median and range over seeds of each schedule's figures, and speedups over ``sync``."""
    out: dict = {"simulation": True}
    for name in runs[0]:
        vals = {k: [r[name][k] for r in runs] for k in ("step_s", "rollout_s", "update_s", "tokens_per_s")}
        out[name] = {k: round(float(np.median(v)), 2) for k, v in vals.items()}
        out[name]["step_s_range"] = [round(min(vals["step_s"]), 2), round(max(vals["step_s"]), 2)]
        if "rollout_gpus" in runs[0][name]:
            out[name]["rollout_gpus"] = int(np.median([r[name]["rollout_gpus"] for r in runs]))
        speed = [r[name]["tokens_per_s"] / r["sync"]["tokens_per_s"] for r in runs]
        out[name]["speedup_vs_sync"] = round(float(np.median(speed)), 3)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--preset", default="qwen3-14b")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--max-response", type=int, default=12288)
    p.add_argument("--mean-response", type=float, default=6000.0)
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a small instance (CPU seconds, for tests)")
    a = p.parse_args(argv)
    if a.quick:
        a.gpus, a.prompts, a.samples, a.max_response, a.mean_response, a.budget = 8, 8, 8, 4096, 1500.0, 1024
        a.preset, a.steps, a.seeds = "qwen3-1.7b", 4, 1
    w = Workload(prompts=a.prompts, samples=a.samples, max_response=a.max_response,
                 mean_response=a.mean_response)
    setup = Setup(gpus=a.gpus, tp=a.tp, preset=a.preset, budget=a.budget, steps=a.steps)
    hw = Hardware()
    runs = [project(w, setup, hw, seed) for seed in range(a.seeds)]
    out = {"bench": "simulate_pipeline", **summarize(runs),
           "setup": dataclasses.asdict(setup), "workload": dataclasses.asdict(w),
           "hardware": dataclasses.asdict(hw), "seeds": a.seeds}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

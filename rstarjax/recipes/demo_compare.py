"""GRPO-RoC against plain GRPO on the demo (rStar2-Agent Fig. 4 and Fig. 9): ``mode=demo_compare``.

    python -m rstarjax.main --config=configs/demo.py:compare --workdir=/tmp/compare

One SFT (``recipes.demo``'s, on a task mix whose traces sometimes open with a buggy program, read the
sandbox's traceback and fix it: ``demo.recover_fraction``; or the params of an earlier run's SFT,
``demo.sft_checkpoint``), then two RL runs from the same SFT weights with the same seed, data and
steps:

* ``roc``: GRPO-RoC, 2G rollouts per prompt, Resample-on-Correct keeps G (§2.2.3);
* ``grpo``: "GRPO with tool", the paper's baseline: G rollouts per prompt, all of them trained.

``WORKDIR/comparison.json`` holds per arm the per-step curves (``CURVES``), the means over the
last ``LAST_STEPS`` steps, greedy held-out accuracy after RL, the arm's wall time, and the run's
provenance; ``WORKDIR/plots/compare_*.png`` overlays the curves of the two arms.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import textwrap
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstarjax import report
from rstarjax.io import files
from rstarjax.io.metrics_log import read_metrics
from rstarjax.recipes import build, demo
from rstarjax.recipes.config import RunConfig
from rstarjax.recipes.rl import run_rl

ARMS: tuple[tuple[str, bool], ...] = (("roc", True), ("grpo", False))  # (name, rl.roc)
LAST_STEPS = 3  # the "_last" figures: mean over the last 3 RL steps

# comparison.json curve name -> (metrics.jsonl key, what it is). "trained": the trajectories the
# update trained on (after the batch filter and, for roc, RoC); "sampled": every rollout drawn.
CURVES: dict[str, tuple[str, str]] = {
    "tool_error_ratio_positive": (
        "rollout/tool_error_ratio_positive",
        "failed tool calls / tool calls, pooled over the positively rewarded trajectories trained on (Fig. 4)"),
    "tool_error_ratio_positive_sampled": (
        "rollout_all/tool_error_ratio_positive",
        "the same over every positively rewarded rollout sampled (what the policy does, before any selection)"),
    "positives_with_tool_error_sampled": (
        "rollout_all/positives_with_tool_error",
        "share of the positive rollouts sampled that hold at least one failed tool call"),
    "reward_mean": ("rollout_all/reward_mean", "mean reward of every rollout sampled"),
    "response_length": ("rollout_all/response_length_mean",
                        "mean response length in tokens (model + tool output) of every rollout sampled"),
    "response_length_trained": ("rollout/response_length_mean", "the same over the trajectories trained on"),
    "turns": ("rollout_all/turns_mean", "mean assistant turns of every rollout sampled"),
    "tool_calls": ("rollout_all/tool_calls_mean", "mean tool calls of every rollout sampled"),
}


def arm_config(run: RunConfig, roc: bool) -> RunConfig:
    """The demo config of one arm: only ``rl.roc`` differs (plain GRPO samples G, RoC 2G)."""
    return dataclasses.replace(run, rl=dataclasses.replace(run.rl, roc=bool(roc)))


def read_curves(metrics_path: str) -> dict[str, list[float]]:
    """Per-step values of ``CURVES`` from one arm's metrics.jsonl (plus the steps)."""
    records = read_metrics(metrics_path)
    out: dict[str, list[float]] = {}
    steps, _ = report.curve(records, CURVES["reward_mean"][0])
    out["step"] = [float(s) for s in steps]
    for name, (key, _) in CURVES.items():
        xs, ys = report.curve(records, key)
        by_step = dict(zip(xs, ys))
        out[name] = [by_step.get(s, float("nan")) for s in steps]
    return out


def last_mean(values: Sequence[float], n: int = LAST_STEPS) -> float:
    """Mean of the last ``n`` finite values (NaN if there are none)."""
    tail = [v for v in values[-n:] if math.isfinite(v)]
    return float(np.mean(tail)) if tail else float("nan")


def arm_summary(curves: Mapping[str, list[float]], heldout_accuracy: float, breakdown: Mapping[str, Any],
                wall_seconds: float, steps: int) -> dict[str, Any]:
    """One arm's entry of comparison.json."""
    def first(name: str) -> float:
        return curves[name][0] if steps else float("nan")

    return {
        "tool_error_ratio_positive_last": last_mean(curves["tool_error_ratio_positive"]),
        "tool_error_ratio_positive_sampled_last": last_mean(curves["tool_error_ratio_positive_sampled"]),
        "tool_error_ratio_positive_first": first("tool_error_ratio_positive"),
        "tool_error_ratio_positive_sampled_first": first("tool_error_ratio_positive_sampled"),
        "positives_with_tool_error_sampled_first": first("positives_with_tool_error_sampled"),
        "positives_with_tool_error_sampled_last": last_mean(curves["positives_with_tool_error_sampled"]),
        "heldout_accuracy": heldout_accuracy,
        "response_length_last": last_mean(curves["response_length"]),
        "response_length_trained_last": last_mean(curves["response_length_trained"]),
        "turns_last": last_mean(curves["turns"]),
        "reward_mean_last": last_mean(curves["reward_mean"]),
        "wall_seconds": wall_seconds,
        "steps": steps,
        "heldout": dict(breakdown),
        "curves": dict(curves),
    }


def targets(roc: Mapping[str, Any], grpo: Mapping[str, Any]) -> dict[str, Any]:
    """The three claims of Fig. 4 / Fig. 9 at demo scale, each with the figures it compares."""
    r, g = roc["tool_error_ratio_positive_last"], grpo["tool_error_ratio_positive_last"]
    return {
        "tool_error_ratio_positive_at_most_half_of_grpo": bool(r <= 0.5 * g) if g > 0 else None,
        "heldout_accuracy_not_lower_by_more_than_2_points":
            bool(roc["heldout_accuracy"] >= grpo["heldout_accuracy"] - 0.02),
        "response_length_shorter": bool(roc["response_length_last"] < grpo["response_length_last"]),
    }


def plot_comparison(arms: Mapping[str, Mapping[str, Any]], out_dir: str) -> list[str]:
    """``compare_<curve>.png`` per curve, the arms overlaid."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, (_, what) in CURVES.items():
        path = os.path.join(out_dir, f"compare_{name}.png")
        report.plot_lines(path, textwrap.fill(f"{name}: {what}", 90),
                          [(arm, a["curves"]["step"], a["curves"][name]) for arm, a in arms.items()],
                          xlabel="RL step", title_size=9)
        paths.append(path)
    return paths


def _host_copy(model: nnx.Module):
    graphdef, state = nnx.split(model)
    return graphdef, jax.device_get(state)


def _fresh_model(graphdef, host_state) -> nnx.Module:
    """A new model holding its own copy of the SFT weights: an arm's updates (which donate their
    buffers) never touch the weights the next arm starts from."""
    return nnx.merge(graphdef, jax.tree.map(lambda x: jnp.array(x, copy=True), host_state))


def run_compare(run: RunConfig, workdir: str) -> dict[str, Any]:
    """``mode=demo_compare``: SFT once, then GRPO-RoC and plain GRPO from the same weights with the
    same seed and data; writes ``comparison.json`` and ``plots/compare_*.png``."""
    setup = demo.prepare(run, workdir, "comparison.json")
    policy, sft_summary = demo.train_sft_policy(run, setup, workdir)
    graphdef, sft_state = _host_copy(policy)
    eval_rows = setup.data["eval_rows"]

    arms: dict[str, dict[str, Any]] = {}
    executor = build.executor(run.rl.num_tool_workers, run.env.allow_unconfined)
    try:
        rollouts = demo.demo_rollouts(run, policy, setup, executor)
        sft_acc, _, sft_breakdown = demo.evaluate(rollouts, eval_rows, "after SFT")
        for name, roc in ARMS:
            t0 = time.time()
            arm_dir = os.path.join(workdir, f"rl_{name}")
            trainer = run_rl(demo.rl_run_for_demo(arm_config(run, roc), setup.rl_path), arm_dir,
                             rollout_fn=rollouts, model=_fresh_model(graphdef, sft_state),
                             on_update=lambda tr: rollouts.update_params(tr.served_model()))
            rollouts.update_params(trainer.served_model())
            acc, _, breakdown = demo.evaluate(rollouts, eval_rows, f"after {name}", trainer.step)
            curves = read_curves(os.path.join(arm_dir, "logs", "metrics.jsonl"))
            arms[name] = arm_summary(curves, acc, breakdown, time.time() - t0, trainer.step)
            _say_arm(name, arms[name])
    finally:
        executor.close()

    comparison = {
        "roc": arms["roc"],
        "grpo": arms["grpo"],
        "targets": targets(arms["roc"], arms["grpo"]),
        "sft": {"heldout_accuracy": sft_acc, "heldout": sft_breakdown, "steps": sft_summary["steps"],
                "seconds": sft_summary["seconds"]},
        "num_eval_problems": len(eval_rows),
        "rl_steps": int(run.total_steps),
        "last_steps": LAST_STEPS,
        "recover_fraction": dict(run.demo.recover_fraction),
        "curves": {name: what for name, (_, what) in CURVES.items()},
        "wall_seconds": time.time() - setup.t_start,
        "provenance": setup.provenance,
    }
    try:
        comparison["plots"] = plot_comparison(arms, os.path.join(workdir, "plots"))
    except Exception as e:  # plots are a convenience; never lose the run's figures over them
        demo.log.warning("comparison plots failed: %s", e)
    files.write_json_atomic(os.path.join(workdir, "comparison.json"), _json_safe(comparison))
    demo._say(f"comparison: targets {json.dumps(comparison['targets'])}, wall {comparison['wall_seconds']:.0f}s")
    return comparison


COMPARED = ("tool_error_ratio_positive_last", "tool_error_ratio_positive_sampled_last", "heldout_accuracy",
            "response_length_last", "turns_last")


def seed_table(comparisons: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``COMPARED`` per arm over several runs' ``comparison.json`` (mean and range, arms side by
    side), the SFT's held-out accuracy, and per target the number of runs that met it."""
    if not comparisons:
        raise ValueError("seed_table needs at least one comparison.json")
    return {
        "seeds": [int(c["provenance"]["seeds"]["seed"]) for c in comparisons],
        "sft_heldout_accuracy": demo.spread([c["sft"]["heldout_accuracy"] for c in comparisons]),
        "arms": {arm: {key: demo.spread([c[arm][key] for c in comparisons]) for key in COMPARED}
                 for arm, _ in ARMS},
        "targets_met": {t: sum(c["targets"][t] is True for c in comparisons) for t in comparisons[0]["targets"]},
        "runs": len(comparisons),
    }


def _json_safe(value):
    """NaN / inf (a curve with no positive trajectory at some step) become null: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _say_arm(name: str, a: Mapping[str, Any]) -> None:
    demo._say(f"{name}: tool-error ratio in trained positives {a['tool_error_ratio_positive_first']:.3f} -> "
              f"{a['tool_error_ratio_positive_last']:.3f} (sampled {a['tool_error_ratio_positive_sampled_first']:.3f}"
              f" -> {a['tool_error_ratio_positive_sampled_last']:.3f}), response {a['response_length_last']:.0f} "
              f"tokens / {a['turns_last']:.2f} turns, held-out {100 * a['heldout_accuracy']:.1f}% "
              f"({a['wall_seconds']:.0f}s)")

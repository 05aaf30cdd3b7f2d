"""Per-step training metrics: pure functions of trajectories, plus the JSONL/TensorBoard writer.

The figures follow what rStar2-Agent plots: reward / accuracy, response length and the clipping
(truncation) ratio (Fig. 8), and the tool-error ratio within positively rewarded trajectories
before and after RoC (Fig. 4).
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence

import numpy as np

from rstarjax.rl.trajectory import Finish, Trajectory


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def positive_tool_error_ratio(trajectories: Sequence[Trajectory]) -> float:
    """Fraction of tool calls that failed, over all positively rewarded trajectories (Fig. 4).

    Pooled over calls (sum of errors / sum of calls), as the paper's "proportion of tool calls
    that contain errors within correctly answered trajectories". 0 when no positive trajectory
    made a tool call.
    """
    pos = [t for t in trajectories if t.reward > 0]
    calls = sum(t.tool_calls for t in pos)
    errors = sum(t.tool_errors.total for t in pos)
    return errors / calls if calls else 0.0


def format_violation_ratio(trajectories: Sequence[Trajectory]) -> float:
    """Fraction of trajectories that break the answer format: no <answer> tag, or more than one
    (the two cases rStar2-Agent eq. 5 penalises)."""
    if not trajectories:
        return 0.0
    return _mean([float(t.answer_tags != 1) for t in trajectories])


def rollout_metrics(trajectories: Sequence[Trajectory], prefix: str = "rollout/") -> dict[str, float]:
    """Summary of one batch of trajectories (the ones that will be trained on, or all 2G)."""
    if not trajectories:
        return {}
    lengths = [len(t.response_ids) for t in trajectories]
    rewards = [float(t.reward) for t in trajectories]
    calls = [t.tool_calls for t in trajectories]
    errors = [t.tool_errors.total for t in trajectories]
    total_calls = sum(calls)
    out = {
        "reward_mean": _mean(rewards),
        "accuracy": _mean([float(r > 0) for r in rewards]),
        "response_length_mean": _mean(lengths),
        "response_length_max": float(max(lengths)),
        "model_tokens_mean": _mean([t.num_model_tokens for t in trajectories]),
        "truncation_ratio": _mean([float(t.finish == Finish.MAX_LENGTH) for t in trajectories]),
        "turns_mean": _mean([t.turns for t in trajectories]),
        "tool_calls_mean": _mean(calls),
        "tool_error_ratio": (sum(errors) / total_calls) if total_calls else 0.0,
        "tool_error_ratio_positive": positive_tool_error_ratio(trajectories),
        "format_violation_ratio": format_violation_ratio(trajectories),
        "error_finish_ratio": _mean([float(t.finish == Finish.ERROR) for t in trajectories]),
    }
    return {prefix + k: v for k, v in out.items()}


def group_solve_rates(trajectories: Sequence[Trajectory]) -> dict[int, float]:
    """Per group_id, the fraction of its trajectories with positive reward."""
    groups: dict[int, list[float]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(float(t.reward > 0))
    return {g: _mean(v) for g, v in groups.items()}


def group_metrics(trajectories: Sequence[Trajectory], prefix: str = "rollout/") -> dict[str, float]:
    """Share of prompts solved by all / none of their rollouts (the §4.3 "too easy" signal)."""
    rates = list(group_solve_rates(trajectories).values())
    if not rates:
        return {}
    return {
        prefix + "groups_all_correct": _mean([float(r == 1.0) for r in rates]),
        prefix + "groups_all_wrong": _mean([float(r == 0.0) for r in rates]),
    }


def roc_metrics(before: Sequence[Trajectory], after: Sequence[Trajectory]) -> dict[str, float]:
    """Fig. 4 before and after Resample-on-Correct: tool-error ratio in positive trajectories."""
    return {
        "roc/tool_error_ratio_positive_before": positive_tool_error_ratio(before),
        "roc/tool_error_ratio_positive_after": positive_tool_error_ratio(after),
        "roc/format_violation_ratio_before": format_violation_ratio(before),
        "roc/format_violation_ratio_after": format_violation_ratio(after),
        "roc/kept_fraction": (len(after) / len(before)) if before else 0.0,
    }


def throughput_metrics(num_tokens: int, timings: Mapping[str, float]) -> dict[str, float]:
    """Times in seconds per phase and tokens/s over the whole step."""
    total = sum(timings.values())
    out = {f"time/{k}": float(v) for k, v in timings.items()}
    out["time/step"] = float(total)
    out["perf/tokens_per_second"] = num_tokens / total if total > 0 else 0.0
    return out


def _jsonable(v):
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep the information as a string
    return v


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Only process 0 writes (pass ``enabled=False`` on the others). TensorBoard is optional: if
    tensorboardX is missing the JSONL file is still written.
    """

    def __init__(self, logdir: str, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self._tb = None
        self._jsonl = None
        if not enabled:
            return
        os.makedirs(logdir, exist_ok=True)
        self._jsonl = open(os.path.join(logdir, "metrics.jsonl"), "a", buffering=1)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:  # pragma: no cover - tensorboardX is a base dependency
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(os.path.join(logdir, "tb"))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "wall_time": time.time()}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float, np.floating, np.integer)):
                    self._tb.add_scalar(k, float(v), int(step))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

"""Per-step rollout metrics: pure functions of trajectories (``io.metrics_log`` writes them).

The figures follow what rStar2-Agent plots: reward / accuracy, response length and the clipping
(truncation) ratio (Fig. 8), and the tool-error ratio within positively rewarded trajectories
before and after RoC (Fig. 4).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from rstarjax.rl.trajectory import FinishReason, Trajectory, group_indices


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


def positives_with_tool_error_fraction(trajectories: Sequence[Trajectory]) -> float:
    """Share of the positively rewarded trajectories with at least one failed tool call: the
    lucky error-ridden successes that an outcome-only reward reinforces (rStar2-Agent §2.2.3).
    0 when there is no positive trajectory."""
    pos = [t for t in trajectories if t.reward > 0]
    return _mean([float(t.tool_errors.total > 0) for t in pos])


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
        "truncation_ratio": _mean([float(t.finish == FinishReason.MAX_LENGTH) for t in trajectories]),
        "turns_mean": _mean([t.turns for t in trajectories]),
        "tool_calls_mean": _mean(calls),
        "tool_call_rate": _mean([float(c > 0) for c in calls]),  # share of responses that used the tool
        "tool_error_ratio": (sum(errors) / total_calls) if total_calls else 0.0,
        "tool_error_ratio_positive": positive_tool_error_ratio(trajectories),
        "positives_with_tool_error": positives_with_tool_error_fraction(trajectories),
        "format_violation_ratio": format_violation_ratio(trajectories),
        "error_finish_ratio": _mean([float(t.finish == FinishReason.ERROR) for t in trajectories]),
    }
    return {prefix + k: v for k, v in out.items()}


def group_solve_rates(trajectories: Sequence[Trajectory]) -> dict[int, float]:
    """Per group_id, the fraction of its trajectories with positive reward."""
    groups = group_indices([t.group_id for t in trajectories])
    return {g: _mean([float(trajectories[i].reward > 0) for i in idx]) for g, idx in groups.items()}


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

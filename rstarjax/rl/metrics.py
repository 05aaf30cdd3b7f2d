"""Per-step rollout metrics: pure functions of trajectories (``io.metrics_log`` writes them).

The figures follow what rStar2-Agent plots: reward / accuracy, response length and the clipping
(truncation) ratio (Fig. 8), and the tool-error ratio within positively rewarded trajectories
before and after RoC (Fig. 4).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
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


# ---- the sampler / trainer log-prob gap alarm ---------------------------------------------------

# A trained token counts in ``train/logprob_gap_tokens_over`` when the log-prob the sampler recorded
# and the one the trainer recomputes differ by more than this (nats), per serving dtype. float32:
# the two forwards differ only in kernels and summation order (CPU: max gap ~1e-6 per step on the
# demo), so 1e-2 is far above noise yet far below what a wrong context costs (issue 31: 1.7 to 14.5
# nats). bfloat16 / float16 serving rounds every matmul: the gap is wide by nature (docs/metrics.md,
# "Sampler / trainer log-prob gap", has the measured distribution) and the threshold sits above it.
LOGPROB_GAP_THRESHOLDS = {"float32": 1e-2, "bfloat16": 1.0, "float16": 0.25}


def _known_dtype_name(dtype, table: Mapping[str, float], what: str) -> str:
    try:  # the dtype names jax knows (bfloat16 among them)
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in table:
        raise ValueError(f"no {what} for serving dtype {dtype!r}; known: {sorted(table)}")
    return name


def logprob_gap_threshold(serving_dtype) -> float:
    """The gap above which a trained token counts as off, for rollouts served in ``serving_dtype``
    (a name or a dtype)."""
    return LOGPROB_GAP_THRESHOLDS[_known_dtype_name(serving_dtype, LOGPROB_GAP_THRESHOLDS,
                                                    "log-prob gap threshold")]


def gap_threshold_of(serving_dtype, forward_dtypes=()) -> float:
    """The gap threshold of rollouts served in ``serving_dtype`` and recomputed by a trainer whose
    forward computes in ``forward_dtypes`` (``Trainer.forward_dtypes``): the coarser side's. A
    bf16 trainer next to a float32 engine rounds its own matmuls (0.019-0.025 nats measured on a
    tiny model where float32 on both sides stayed under 6.2e-6): judged at float32's 0.01 it
    raised the "different context" alarm on rounding."""
    return max(logprob_gap_threshold(d) for d in (serving_dtype, *forward_dtypes))


# The batch's mean k3 KL(sampler || trainer) (``train/logprob_gap_kl``) above which ``rl_step``
# warns, per dtype, the coarser side's for a run (``logprob_gap_kl_level``). The per-token count
# above misses a sampler and trainer that disagree on the whole distribution in bf16: a
# temperature mismatch (sampler 0.6, trainer 1.0) puts 2-12 % of tokens over 1 nat, 1.0 against
# 1.05 none. The mean separates the two. Measured noise: float32 on CPU |d| <= 3.2e-6 (k3 ~ d^2/2
# < 1e-11); bf16 on both sides, the H200 stage-1 job (a random bf16 Qwen3-1.7B at temperature 1:
# 11.5 nats of entropy a token, the noisiest kind of row) 5.3e-4 at every step of its three runs
# (benchmarks/profiles/h200-2026-11-2*/main_metrics.jsonl); LM-like synthetic rows with bf16-
# rounded sampler logits 3.2e-4. Mismatch, on those synthetic rows: sampler / trainer temperature
# 0.7 / 1.0, 1.0 / 0.7, 1.0 / 1.3, 0.6 / 1.0 give 0.11-0.20; 1.0 / 1.05 gives 4.8e-3.
# - bfloat16 1e-2: 19x over the measured noise, 10x under the smallest of those mismatches (a 5 %
#   temperature difference stays under it: bf16's noise leaves no wide margin that low);
# - float16 1e-3: rounding 8x finer than bf16's (10 mantissa bits to 7), k3 ~64x lower (~1e-5);
# - float32 1e-4: float noise on CPU, but a GPU's float32 matmuls may run in TF32 (float16's
#   mantissa): kept 10x over float16's scaled noise, 48x under the 5 % mismatch.
LOGPROB_GAP_KL_LEVELS = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-3}


def logprob_gap_kl_level(serving_dtype, forward_dtypes=()) -> float:
    """The ``train/logprob_gap_kl`` level above which a run served in ``serving_dtype`` and
    recomputed in ``forward_dtypes`` warns: the coarser side's (as ``gap_threshold_of``)."""
    return max(LOGPROB_GAP_KL_LEVELS[_known_dtype_name(d, LOGPROB_GAP_KL_LEVELS, "log-prob gap KL level")]
               for d in (serving_dtype, *forward_dtypes))


def logprob_gap_kl_warning(step: int, gap_kl: float, level: float) -> str | None:
    """The warning of a step whose batch-mean sampler / trainer k3 KL (``train/logprob_gap_kl``)
    passes ``level`` (``logprob_gap_kl_level``; NaN passes too), else None. Rounding noise sits
    far under the level in every dtype; a mean this high says the trainer recomputes another
    distribution than the one the sampler drew from."""
    if gap_kl <= level:
        return None
    return (f"step {step}: the sampler/trainer log-prob gap's mean k3 KL is {gap_kl:.3g} nats a token "
            f"(train/logprob_gap_kl), above this run's {level:g}, which rounding noise stays far "
            f"under: the trainer is not recomputing the distribution the rollouts were sampled from. "
            f"Check that the trainer divides its logits by the sampler's temperature (rl.temperature), "
            f"that both hold the same weights (hand-off, LoRA merge, policy version) and that the engine "
            f"fed the trajectory's context (docs/metrics.md, 'Sampler / trainer log-prob gap').")


def is_float32(serving_dtype) -> bool:
    return jnp.dtype(serving_dtype) == jnp.float32


def trajectories_at(placements: Sequence, positions: np.ndarray) -> list[int]:
    """Indices of the trajectories whose columns hold any of ``positions`` ((row, column) pairs of
    a TrainBatch; ``placements``: ``batch.BatchLayout.placements``, one per trajectory)."""
    hit = []
    for i, p in enumerate(placements):
        rows = positions[positions[:, 0] == p.row]
        if ((rows[:, 1] >= p.start) & (rows[:, 1] < p.start + p.length)).any():
            hit.append(i)
    return hit


def logprob_gap_alarm(step: int, tokens_over: int, threshold: float, prompts: Sequence[str],
                      max_prompt_chars: int = 200) -> str:
    """The warning of a float32 run whose sampler and trainer disagree on trained tokens: the
    engine fed the sampler a different context than the trajectory holds (issue 31), or the two
    forwards are not the same model."""
    shown = "\n".join(f"  - {p[:max_prompt_chars]!r}" for p in prompts) or "  (none of this process's)"
    return (f"step {step}: {tokens_over} trained tokens have a sampler/trainer log-prob gap above "
            f"{threshold:g} nats (train/logprob_gap_tokens_over), where float32 serving should agree to "
            f"float noise: the sampler probably saw a different context than the trained trajectory "
            f"(docs/metrics.md, 'Sampler / trainer log-prob gap'). Prompts of the affected "
            f"trajectories:\n{shown}")

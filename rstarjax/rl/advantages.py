"""Group-relative advantages and reward shaping (rStar2-Agent eq. 2 / eq. 7; Dr. GRPO; DAPO; Kimi k1.5).

All functions are pure NumPy over one prompt's group (or a flat batch with group ids): they run on
the host between rollout and batching, never inside jit.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def group_advantages(rewards, std_normalize: bool = True, eps: float = 1e-6, ddof: int = 1) -> np.ndarray:
    """Outcome advantage per rollout of ONE group, rStar2-Agent eq. 7 (= GRPO eq. 2).

    A_i = (r_i - mean(r)) / (std(r) + eps). ``std_normalize=False`` is Dr. GRPO (Liu et al. 2025):
    A_i = r_i - mean(r). ``ddof=1`` (sample std) matches verl's GRPO estimator (torch.std), on
    which the official rStar2-Agent code runs; ``ddof=0`` is the population std.
    A group of one has no relative signal: its advantage is 0.
    All-equal groups give exactly 0 (numerator 0), whatever eps.
    """
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {r.shape}")
    if r.size == 0:
        raise ValueError("empty group")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"non-finite reward in {r}")
    if r.size == 1:
        return np.zeros(1, np.float32)
    centered = r - r.mean()
    if not std_normalize:
        return centered.astype(np.float32)
    return (centered / (r.std(ddof=ddof) + eps)).astype(np.float32)


def grouped_advantages(rewards, group_ids, std_normalize: bool = True, eps: float = 1e-6, ddof: int = 1) -> np.ndarray:
    """eq. 7 applied per group over a flat batch; ``group_ids[i]`` names rollout i's prompt."""
    r = np.asarray(rewards, np.float64)
    g = np.asarray(group_ids)
    if r.shape != g.shape or r.ndim != 1:
        raise ValueError(f"rewards {r.shape} and group_ids {g.shape} must be equal 1-D shapes")
    out = np.zeros(r.shape, np.float32)
    for gid in np.unique(g):
        idx = np.flatnonzero(g == gid)
        out[idx] = group_advantages(r[idx], std_normalize=std_normalize, eps=eps, ddof=ddof)
    return out


def is_informative_group(rewards, atol: float = 0.0) -> bool:
    """DAPO dynamic sampling predicate (Yu et al. 2025, eq. 11 constraint 0 < |correct| < G).

    A group whose rewards are all equal has zero advantage everywhere and contributes no
    gradient. With dynamic sampling on, the trainer drops such groups after rollout and keeps
    drawing new prompts (up to a bounded number of extra rollout rounds) until the batch holds
    the configured number of informative groups. Stated as "rewards not all equal" so that
    shaped (non-binary) rewards are handled too.
    """
    r = np.asarray(rewards, np.float64)
    if r.size == 0:
        raise ValueError("empty group")
    return bool(np.ptp(r) > atol)


def is_equal_reward_group(rewards) -> bool:
    """Batch filtering of rStar2-Agent §4.3 ("problems in a batch are rejected due to achieving a
    perfect pass rate"): True when every rollout of a prompt earned the same reward, so the group
    has zero advantage (eq. 7) and no gradient; its tokens would only enlarge eq. 6's token
    denominator. The official code (``down_sample/reject_sampling.py``, ``reject_equal_reward``,
    on in its run script) drops such groups before RoC, all-correct and all-wrong alike, without
    refilling; its test ``torch.allclose(r[0], r)`` is reproduced by ``np.allclose(r[0], r)``
    (same tolerances, rtol 1e-5 and atol 1e-8).
    """
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {r.shape}")
    return bool(np.allclose(r[0], r))


def kimi_length_reward(lengths, correct, coef: float = 1.0) -> np.ndarray:
    """Kimi k1.5 length penalty (Kimi Team 2025, §2.3.3 of the published report; §3.2.9 of the
    draft describes it without the formula): per group,

        lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)
        len_reward_i = lambda_i            if the rollout is correct
                       min(0, lambda_i)    otherwise

    i.e. correct rollouts get a bonus for being short and a penalty for being long; wrong ones
    only the penalty. Returns ``coef * len_reward`` to be *added* to the answer reward (after
    RoC, before advantages). All lengths equal -> 0 (the report's max = min case).
    """
    n = np.asarray(lengths, np.float64)
    c = np.asarray(correct, bool)
    if n.shape != c.shape or n.ndim != 1 or n.size == 0:
        raise ValueError(f"lengths {n.shape} and correct {c.shape} must be equal non-empty 1-D shapes")
    lo, hi = n.min(), n.max()
    if hi == lo:
        return np.zeros(n.shape, np.float32)
    lam = 0.5 - (n - lo) / (hi - lo)
    return (coef * np.where(c, lam, np.minimum(0.0, lam))).astype(np.float32)


def overlong_filter_weights(truncated: Sequence[bool]) -> np.ndarray:
    """DAPO overlong filtering (Yu et al. 2025): per-rollout loss weight 0 for truncated rollouts.

    Off by default: rStar2-Agent §4.3.1 found it harmful (it keeps repetitive overlong outputs
    unpunished). When on, make_train_batch multiplies each rollout's loss mask by this weight, so
    the global token denominator also excludes those tokens.
    """
    return np.where(np.asarray(truncated, bool), 0.0, 1.0).astype(np.float32)


def trajectory_advantages(
    trajectories: Sequence, std_normalize: bool = True, length_penalty_coef: float = 0.0, eps: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    """(shaped rewards, advantages) for RoC-kept trajectories, grouped by ``Trajectory.group_id``.

    The reward is the 0/1 answer reward (eq. 3) plus, if ``length_penalty_coef`` > 0, the Kimi k1.5
    length reward over each group, with length = the number of model-sampled tokens (tool output
    is not the policy's verbosity) and correct = reward > 0. Advantages follow eq. 7 per group.
    """
    rewards = np.array([float(t.reward) for t in trajectories], np.float64)
    groups = np.array([int(t.group_id) for t in trajectories])
    shaped = rewards.copy()
    if length_penalty_coef > 0:
        lengths = np.array([t.num_model_tokens for t in trajectories], np.float64)
        for gid in np.unique(groups):
            idx = np.flatnonzero(groups == gid)
            shaped[idx] += kimi_length_reward(lengths[idx], rewards[idx] > 0, coef=length_penalty_coef)
    adv = grouped_advantages(shaped, groups, std_normalize=std_normalize, eps=eps)
    return shaped.astype(np.float32), adv

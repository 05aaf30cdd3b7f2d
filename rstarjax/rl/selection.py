"""What of a rollout round is trained on: the batch filter of rStar2-Agent §4.3 and RoC (eq. 4-5)
applied per prompt group, and DAPO's dynamic-sampling filter (docs/algorithm.md).

Per group of one prompt's rollouts: rollouts ended by an infrastructure error are excluded (a
group left with fewer than G is dropped and counted), groups whose rollouts all earned the same
reward are rejected (``reject_equal_reward``), then RoC keeps G of 2G (without RoC: the G
rollouts). Pure host code over Trajectories.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rstarjax.rl import advantages as adv_lib
from rstarjax.rl import roc as roc_lib
from rstarjax.rl.trajectory import Trajectory, group_indices


@dataclasses.dataclass
class Selection:
    """What ``select_groups`` kept of one rollout round, and why the other groups went."""

    kept: list  # trajectories to train on, G per kept group, in group order
    groups: int = 0  # groups rolled out
    all_correct: int = 0  # rejected before RoC: every rollout correct (§4.3 "perfect pass rate")
    all_wrong: int = 0  # rejected before RoC: every rollout wrong
    equal_after_roc: int = 0  # rejected after RoC: the G it kept have equal rewards (paper variant)
    short: int = 0  # fewer than G rollouts left once infrastructure errors are excluded
    infra_trajectories: int = 0  # rollouts ended by an infrastructure error (never trained on)

    @property
    def rejected(self) -> int:
        return self.all_correct + self.all_wrong + self.equal_after_roc

    @property
    def trained(self) -> int:
        return self.groups - self.rejected - self.short


def select_groups(trajectories: Sequence[Trajectory], num_groups: int, cfg, seed: int) -> Selection:
    """Per prompt group: exclude rollouts ended by an infrastructure error, reject equal-reward
    groups (``cfg.reject_equal_reward``), then RoC keeps G (or, without RoC, the G rollouts).
    ``cfg``: the ``rl`` section (``step.RLConfig``).

    A group left with fewer than G rollouts after the exclusion is dropped (counted ``short``).
    With the paper's RoC a mixed group of 2G with a single failure keeps no negative (floor(1/2)
    = 0): its G rewards are equal and, with ``reject_equal_reward``, it is rejected after RoC.
    """
    out = Selection(kept=[], groups=num_groups)
    for g, idx in group_indices([t.group_id for t in trajectories], num_groups).items():
        trajs = [trajectories[i] for i in idx]
        if len(trajs) != cfg.rollouts_per_prompt:
            raise ValueError(f"group {g} has {len(trajs)} rollouts, expected {cfg.rollouts_per_prompt} "
                             f"({'oversample' if cfg.roc else 'group_size'})")
        valid = [t for t in trajs if not t.infra_error]
        out.infra_trajectories += len(trajs) - len(valid)
        if len(valid) < cfg.group_size:
            out.short += 1
            continue
        rewards = [float(t.reward) for t in valid]
        if cfg.reject_equal_reward and adv_lib.is_equal_reward_group(rewards):
            if rewards[0] > 0:
                out.all_correct += 1
            else:
                out.all_wrong += 1
            continue
        if cfg.roc:
            keep = roc_lib.roc_select(valid, cfg.group_size, np.random.default_rng([seed, g]), variant=cfg.roc_variant,
                                      min_negatives=cfg.roc_min_negatives, min_positives=cfg.roc_min_positives,
                                      penalty=cfg.roc_penalty, zero_penalty_eps=cfg.roc_zero_penalty_eps)
        else:
            keep = range(cfg.group_size)
        kept = [valid[i] for i in keep]
        if cfg.reject_equal_reward and adv_lib.is_equal_reward_group([t.reward for t in kept]):
            out.equal_after_roc += 1
            continue
        out.kept.extend(kept)
    return out


def selection_metrics(selections: Sequence[Selection]) -> dict[str, float]:
    """``filter/``: what the batch filter did over a step's rollout rounds (fractions of groups)."""
    groups = max(sum(s.groups for s in selections), 1)
    total = lambda name: float(sum(getattr(s, name) for s in selections))  # noqa: E731
    return {
        "filter/groups": total("groups"),
        "filter/groups_trained": total("trained"),
        "filter/rejected_frac": total("rejected") / groups,
        "filter/rejected_all_correct_frac": total("all_correct") / groups,
        "filter/rejected_all_wrong_frac": total("all_wrong") / groups,
        "filter/rejected_after_roc": total("equal_after_roc"),
        "filter/infra_short_groups": total("short"),
        "filter/infra_trajectories": total("infra_trajectories"),
    }


def informative_groups(kept: Sequence[Trajectory], estimator: str, length_penalty_coef: float
                       ) -> tuple[list[list[Trajectory]], int]:
    """DAPO dynamic sampling filter ("DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale", Yu et al. 2025, arXiv 2503.14476, eq. 11; ``advantages.is_informative_group``) over
    RoC-kept trajectories: (groups whose eq.-7 rewards are not all equal, number dropped).

    Applied AFTER RoC, on the rewards the advantages see (answer reward + optional Kimi length
    reward): RoC can turn a mixed 2G group into an all-correct G (one wrong rollout, n_neg = 0),
    which has zero advantage everywhere just like an all-equal 2G group.
    """
    keep, dropped = [], 0
    for idx in group_indices([t.group_id for t in kept]).values():
        trajs = [kept[i] for i in idx]
        shaped, _ = adv_lib.trajectory_advantages(trajs, estimator, length_penalty_coef)
        if adv_lib.is_informative_group(shaped):
            keep.append(trajs)
        else:
            dropped += 1
    return keep, dropped

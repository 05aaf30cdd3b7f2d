"""Resample-on-Correct (RoC): keep G of 2G rollouts per prompt (rStar2-Agent §2.2.3, eq. 4-5).

Negatives (reward <= 0) are down-sampled uniformly, keeping their diversity; positives are
down-sampled with probability inversely proportional to a penalty p_total = p_err + p_format,
so clean successful traces (no tool errors, exactly one <answer>) dominate the positive signal.

Decisions the paper leaves open (see docs/algorithm.md):

* **Counts.** With N rollouts and G kept: ``n_neg = floor(|neg| * G / N)`` (= floor(|neg|/2)
  for the paper's N = 2G) and ``n_pos = G - n_neg``. For N = 2G there are always enough
  positives (|pos| - n_pos = G - ceil(|neg|/2) >= 0). For N < 2G (rollouts lost upstream) any
  shortfall of positives is filled with further uniformly drawn negatives; N < G is an error.
  All-negative groups keep G uniform negatives; all-positive groups keep G weighted positives.
* **p_total = 0.** Weights are ``1 / (p_total + zero_penalty_eps)`` (default eps 0.01): a
  perfect trace is ~50x likelier to be picked first than a tool-free one (p_total = 0.5) but
  the draw stays a draw, so penalty-0 traces never get an infinite weight.
* **Sampling without replacement** is successive sampling: each draw picks among the
  remaining positives with probability w_i / sum(remaining w); chosen ones are removed
  (vectorised with Efraimidis-Spirakis keys, which have exactly that distribution).
* **Positive** means reward > 0 on the *answer-only* reward (eq. 3), before any shaping.
* ``variant="topk"`` is the official code's selection (rStar2-Agent repository,
  ``down_sample/roc.py``, ``resample_of_correct``) exactly, given the penalties; see
  ``official_topk_counts``: counts ``round(|neg| G/N)`` / ``round(|pos| G/N)`` (Python round,
  half to even), per-class floors (the run script's ``min_zero_reward_trace_num=2`` and
  ``min_non_zero_reward_trace_num=2``), the positives sorted by p_total ascending (stable: ties
  by index) and cut, the negatives taken in rollout order. By default tool errors come from the
  structured counts (``Trajectory.tool_errors``), never from searching tool output for "error".
* ``penalty="official_text"`` (``official_text_penalty``): the penalties the official code
  computes from the decoded response text instead (turns = the response's assistant spans,
  errors = tool responses containing "error", unclosed <answer> tags counted); with
  ``variant="topk"`` the kept set is then the official one on the same trajectories.

Edge cases at N = 2G = 32, G = 16 (docs/algorithm.md): 31 negatives / 1 positive keeps 15 + the
positive in both variants; 1 negative / 31 positives keeps no negative in the paper variant
(floor(1/2) = 0: the G kept rewards are all equal, zero advantage) and the negative + 15
positives in the official one.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rstarjax.protocol import (ANSWER_CLOSE, ANSWER_OPEN, IM_END, IM_START, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN,
                               closed_spans)
from rstarjax.rl.trajectory import Trajectory

P_ERR_NO_TOOL_CALL = 0.5  # eq. 4: default error ratio for trajectories that never call a tool
P_FORMAT_NO_ANSWER = 1.0  # eq. 5: maximum format penalty without an <answer> tag
DEFAULT_ZERO_PENALTY_EPS = 0.01
# The official run script's per-class floors of the top-k selection (min_zero_reward_trace_num,
# min_non_zero_reward_trace_num).
OFFICIAL_MIN_NEGATIVES = 2
OFFICIAL_MIN_POSITIVES = 2


@dataclasses.dataclass(frozen=True)
class RocStats:
    """The per-trajectory numbers RoC needs (a Trajectory can be reduced to these)."""

    reward: float
    tool_calls: int
    tool_errors: int  # parse + execution + timeout
    answer_tags: int
    turns: int

    @classmethod
    def from_trajectory(cls, traj: Trajectory) -> "RocStats":
        return cls(
            reward=float(traj.reward),
            tool_calls=int(traj.tool_calls),
            tool_errors=int(traj.tool_errors.total),
            answer_tags=int(traj.answer_tags),
            turns=int(traj.turns),
        )

    def __post_init__(self):
        if self.tool_calls < 0 or self.tool_errors < 0 or self.answer_tags < 0 or self.turns < 0:
            raise ValueError(f"negative count in {self}")
        if self.tool_errors > self.tool_calls:
            raise ValueError(f"tool_errors {self.tool_errors} > tool_calls {self.tool_calls}")


def _stats(x: Trajectory | RocStats) -> RocStats:
    return x if isinstance(x, RocStats) else RocStats.from_trajectory(x)


def p_err(traj: Trajectory | RocStats) -> float:
    """Tool error ratio, rStar2-Agent eq. 4.

    0.5 when the trajectory made no tool call (encourages tool use), else
    (erroneous tool calls) / (all tool calls), errors = parse + execution + timeout.
    """
    s = _stats(traj)
    if s.tool_calls == 0:
        return P_ERR_NO_TOOL_CALL
    return s.tool_errors / s.tool_calls


def p_format(traj: Trajectory | RocStats) -> float:
    """Answer-format penalty, rStar2-Agent eq. 5.

    1 when there is no <answer> tag, else min(1, (num <answer> tags - 1) / num turns).
    A trajectory with answer tags but 0 recorded turns is malformed: it gets the maximum 1.
    """
    s = _stats(traj)
    if s.answer_tags == 0:
        return P_FORMAT_NO_ANSWER
    if s.turns == 0:
        return P_FORMAT_NO_ANSWER
    return min(1.0, (s.answer_tags - 1) / s.turns)


def p_total(traj: Trajectory | RocStats) -> float:
    """Total RoC penalty p_err + p_format (rStar2-Agent §2.2.3, after eq. 5)."""
    return p_err(traj) + p_format(traj)


# ---- the official code's penalties, read from the decoded response text ---------------------------
# microsoft/rStar, rstar2_agent/down_sample/roc.py (calc_error_ratio_penalty_weights,
# calc_format_penalty_weights): the response is decoded with its special tokens, so it holds the
# model turns, the tool turns and the <|im_start|>/<|im_end|> markers, but not the prompt (whose
# "<|im_start|>assistant" opens the first model turn). Its re.findall calls ("<tool_response>.*?
# </tool_response>", "<answer>.*?</answer>", "<\|im_start\|>assistant.*?<\|im_end\|>") are
# protocol.closed_spans here: the same spans, in linear time on a degenerate response.
OFFICIAL_NO_TOOL_RESPONSE_PENALTY = 0.5


def official_error_ratio_penalty(response_text: str) -> float:
    """The official error-ratio penalty: of the <tool_response> blocks in the response, the
    fraction whose text contains "error" in any case (a program that prints "error" counts, a
    malformed call whose message lacks the word does not); 0.5 when there is none."""
    responses = closed_spans(response_text, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)
    if not responses:
        return OFFICIAL_NO_TOOL_RESPONSE_PENALTY
    return sum("error" in r.lower() for r in responses) / len(responses)


def official_format_penalty(response_text: str) -> float:
    """The official answer-format penalty: 1 unless both tags occur and every "<answer>" and
    "</answer>" belongs to a closed pair; else min(1, (pairs - 1) / turns), turns being the
    assistant spans "<|im_start|>assistant ... <|im_end|>" of the response (the first model turn
    opens in the prompt and so is not one: a response without a tool turn has 0 turns and gets 1)."""
    if "<answer>" not in response_text or "</answer>" not in response_text:
        return P_FORMAT_NO_ANSWER
    closed = len(closed_spans(response_text, ANSWER_OPEN, ANSWER_CLOSE))
    if response_text.count("<answer>") != closed or response_text.count("</answer>") != closed:
        return P_FORMAT_NO_ANSWER
    turns = len(closed_spans(response_text, IM_START + "assistant", IM_END))
    if turns == 0:
        return P_FORMAT_NO_ANSWER
    return min((closed - 1) / turns, 1.0)


def official_text_penalty(response_text: str) -> float:
    """p_total as the official code computes it (roc_error_ratio and roc_answer_format both on,
    as in its run scripts): the two penalties above, summed."""
    if not isinstance(response_text, str):
        raise TypeError(f"response_text must be a str, got {type(response_text).__name__}")
    return official_error_ratio_penalty(response_text) + official_format_penalty(response_text)


ROC_PENALTIES = ("paper", "official_text")  # rl.roc_penalty


def selection_weights(penalties: np.ndarray, zero_penalty_eps: float = DEFAULT_ZERO_PENALTY_EPS) -> np.ndarray:
    """Sampling weights inversely proportional to the penalty (rStar2-Agent §2.2.3)."""
    if zero_penalty_eps <= 0:
        raise ValueError("zero_penalty_eps must be > 0 (a penalty of 0 would get an infinite weight)")
    return 1.0 / (np.asarray(penalties, np.float64) + zero_penalty_eps)


def weighted_sample_without_replacement(weights: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k indices drawn by successive sampling: each draw picks among the items not drawn yet with
    probability proportional to their weights. Returned in draw order.

    Implemented with Efraimidis-Spirakis keys (log u_i / w_i, the k largest), which has exactly the
    successive-sampling distribution (Efraimidis & Spirakis 2006) in one vectorised pass.
    """
    w = np.asarray(weights, np.float64)
    if k > len(w) or k < 0:
        raise ValueError(f"cannot draw {k} of {len(w)}")
    if np.any(~np.isfinite(w)) or np.any(w <= 0):
        raise ValueError("weights must be finite and > 0")
    u = 1.0 - rng.random(len(w))  # in (0, 1]: log is finite
    keys = np.log(u) / w
    return np.argsort(-keys, kind="stable")[:k].astype(np.int64)


def _as_rng(rng) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)):
        return np.random.default_rng(int(rng))
    raise TypeError(f"rng must be a numpy Generator or an int seed, got {type(rng)}")


def roc_counts(num_neg: int, num_pos: int, group_size: int) -> tuple[int, int]:
    """(negatives kept, positives kept) by the paper's rule, rStar2-Agent §2.2.3: of 2G rollouts,
    floor(|O_neg| / 2) negatives and the other G - floor(|O_neg| / 2) = ceil(|O_pos| / 2)
    positives. Generalised to N rollouts as floor(|neg| G / N); see the module docstring for N < 2G.
    E.g. G = 16 of 32: 31 negatives / 1 positive -> (15, 1); 1 negative / 31 positives -> (0, 16)."""
    n = num_neg + num_pos
    if n < group_size:
        raise ValueError(f"RoC needs at least group_size={group_size} rollouts, got {n}")
    n_neg = min(num_neg, (num_neg * group_size) // n)  # floor(|neg|/2) when n == 2G
    n_pos = group_size - n_neg
    if n_pos > num_pos:  # only when n < 2G: top up with more negatives
        n_neg += n_pos - num_pos
        n_pos = num_pos
    return n_neg, n_pos


def official_topk_counts(num_neg: int, num_pos: int, group_size: int,
                         min_negatives: int = OFFICIAL_MIN_NEGATIVES,
                         min_positives: int = OFFICIAL_MIN_POSITIVES) -> tuple[int, int]:
    """(negatives kept, positives kept) by the official rStar2-Agent code's rule
    (``down_sample/roc.py``), for a group of N = num_neg + num_pos > G rollouts:

        n_neg = round(|neg| G / N), n_pos = round(|pos| G / N)      (Python round: half to even)
        if n_neg <= min(min_negatives, |neg|): n_neg = min(min_negatives, |neg|); n_pos = G - n_neg
        if n_pos <= min(min_positives, |pos|): n_pos = min(min_positives, |pos|); n_neg = G - n_pos

    E.g. G = 16 of 32: 31 negatives / 1 positive -> (15, 1); 1 negative / 31 positives -> (1, 15).
    The official code also keeps a whole group when both rounded counts fall under their floors;
    that needs G < min_negatives + min_positives, which it forbids (as ``validate`` does), so
    here it is an error, as are the counts its own assertion would reject.
    """
    n = num_neg + num_pos
    if min_negatives + min_positives > group_size:
        raise ValueError(f"topk RoC floors {min_negatives} + {min_positives} exceed group_size={group_size}")
    if n <= group_size:
        raise ValueError(f"official_topk_counts needs more than group_size={group_size} rollouts, got {n}")
    n_neg = round(num_neg * group_size / n)
    n_pos = round(num_pos * group_size / n)
    if n_neg < min_negatives and n_pos < min_positives:
        raise ValueError(f"topk RoC: both counts ({n_neg}, {n_pos}) under their floors")
    if n_neg <= min(min_negatives, num_neg):
        n_neg = min(min_negatives, num_neg)
        n_pos = group_size - n_neg
    if n_pos <= min(min_positives, num_pos):
        n_pos = min(min_positives, num_pos)
        n_neg = group_size - n_pos
    if n_neg + n_pos != group_size or n_neg > num_neg or n_pos > num_pos:
        raise ValueError(f"topk RoC: the official rule gives {n_neg} of {num_neg} negatives and {n_pos} of "
                         f"{num_pos} positives for G={group_size}, which its own assertion rejects")
    return n_neg, n_pos


def roc_select(
    trajs_or_stats: Sequence[Trajectory | RocStats],
    group_size: int,
    rng: np.random.Generator | int,
    variant: str = "paper",
    zero_penalty_eps: float = DEFAULT_ZERO_PENALTY_EPS,
    min_negatives: int = OFFICIAL_MIN_NEGATIVES,
    min_positives: int = OFFICIAL_MIN_POSITIVES,
    penalty: str = "paper",
) -> list[int]:
    """Indices (sorted ascending) of the ``group_size`` rollouts RoC keeps from one prompt's group.

    rStar2-Agent §2.2.3: negatives uniformly, positives without replacement with probability
    inversely proportional to p_total (eq. 4 + eq. 5). ``variant="topk"``: the official code's
    deterministic selection (``official_topk_counts``; ``rng`` then unused, ``min_negatives`` /
    ``min_positives`` are its per-class floors). ``penalty="official_text"``: p_total is
    ``official_text_penalty`` of each Trajectory's ``response_text`` (RocStats carry no text).
    """
    gids = {int(t.group_id) for t in trajs_or_stats if isinstance(t, Trajectory)}
    if len(gids) > 1:
        raise ValueError(f"roc_select got trajectories of several prompts (group_ids {sorted(gids)}); "
                         "select per group (selection.select_groups)")
    stats = [_stats(t) for t in trajs_or_stats]
    if group_size <= 0:
        raise ValueError("group_size must be > 0")
    if len(stats) < group_size:
        raise ValueError(f"RoC needs at least group_size={group_size} rollouts, got {len(stats)}")
    rewards = np.array([s.reward for s in stats], np.float64)
    if not np.all(np.isfinite(rewards)):
        raise ValueError("non-finite reward")
    pos = np.flatnonzero(rewards > 0)
    neg = np.flatnonzero(rewards <= 0)
    if penalty == "paper":
        penalties = np.array([p_total(s) for s in stats], np.float64)
    elif penalty == "official_text":
        if not all(isinstance(t, Trajectory) for t in trajs_or_stats):
            raise ValueError("penalty='official_text' reads each Trajectory's response_text; RocStats have none")
        penalties = np.array([official_text_penalty(t.response_text) for t in trajs_or_stats], np.float64)
    else:
        raise ValueError(f"unknown RoC penalty {penalty!r} (expected one of {ROC_PENALTIES})")

    if variant == "paper":
        gen = _as_rng(rng)
        n_neg, n_pos = roc_counts(len(neg), len(pos), group_size)
        kept_neg = gen.choice(neg, size=n_neg, replace=False) if n_neg else np.zeros(0, np.int64)
        picks = weighted_sample_without_replacement(selection_weights(penalties[pos], zero_penalty_eps), n_pos, gen)
        kept_pos = pos[picks]
    elif variant == "topk":
        if len(stats) == group_size:  # the official code keeps a group of exactly G whole
            return list(range(group_size))
        n_neg, n_pos = official_topk_counts(len(neg), len(pos), group_size, min_negatives, min_positives)
        order_pos = pos[np.argsort(penalties[pos], kind="stable")]  # Python's stable sort by penalty
        kept_neg, kept_pos = neg[:n_neg], order_pos[:n_pos]  # negatives: first in rollout order
    else:
        raise ValueError(f"unknown RoC variant {variant!r} (expected 'paper' or 'topk')")
    kept = sorted(int(i) for i in np.concatenate([kept_neg, kept_pos]))
    assert len(kept) == group_size and len(set(kept)) == group_size
    return kept

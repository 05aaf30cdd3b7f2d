"""Resample-on-Correct against hand-computed eq. 4-5 values and exact sampling probabilities."""
import itertools
import math

import numpy as np
import pytest

from rstarjax.rl.roc import RocStats, p_err, p_format, p_total, roc_select
from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, ToolErrorCounts, Trajectory


def traj(reward=1.0, calls=0, parse=0, execution=0, timeout=0, answers=1, turns=1, text=""):
    return Trajectory(
        prompt_ids=np.array([1, 2]),
        segments=[Segment(SegmentKind.MODEL, [3, 4], [-0.5, -0.5])],
        turns=turns,
        tool_calls=calls,
        tool_errors=ToolErrorCounts(parse=parse, execution=execution, timeout=timeout),
        answer_tags=answers,
        finish=FinishReason.ANSWERED,
        reward=reward,
        response_text=text,
    )


# ---- eq. 4 / eq. 5 by hand -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, expected",
    [
        (dict(calls=0), 0.5),  # no tool call: default 0.5
        (dict(calls=3, execution=1), 1 / 3),
        (dict(calls=4, parse=1, timeout=1), 0.5),  # all three failure kinds count
        (dict(calls=2, parse=1, execution=1), 1.0),
        (dict(calls=5), 0.0),
    ],
)
def test_p_err_eq4(kw, expected):
    assert p_err(traj(**kw)) == pytest.approx(expected)


def test_p_err_uses_structured_counts_not_text():
    # A clean run whose tool output merely *prints* the word "error" is not an error (the official
    # code greps for "error"; we count failed calls reported by the environment).
    t = traj(calls=2, text="<tool_response>no error found; Error bars: 3</tool_response>")
    assert p_err(t) == 0.0


@pytest.mark.parametrize(
    "answers, turns, expected",
    [
        (0, 3, 1.0),  # no <answer>: maximum penalty
        (1, 3, 0.0),
        (2, 4, 0.25),
        (3, 4, 0.5),
        (5, 2, 1.0),  # min(1, 4/2)
        (2, 1, 1.0),
    ],
)
def test_p_format_eq5(answers, turns, expected):
    assert p_format(traj(answers=answers, turns=turns)) == pytest.approx(expected)


def test_p_total_and_stats_equivalence():
    t = traj(calls=4, execution=1, answers=3, turns=8)
    assert p_total(t) == pytest.approx(0.25 + 0.25)
    s = RocStats(reward=1.0, tool_calls=4, tool_errors=1, answer_tags=3, turns=8)
    assert p_total(s) == p_total(t)


def test_bad_stats_rejected():
    with pytest.raises(ValueError):
        RocStats(reward=1.0, tool_calls=1, tool_errors=2, answer_tags=1, turns=1)
    with pytest.raises(ValueError):
        roc_select([traj()] * 3, group_size=4, rng=0)
    with pytest.raises(ValueError):
        roc_select([traj()] * 4, group_size=2, rng=0, variant="nope")
    other = traj()
    other.group_id = 9
    with pytest.raises(ValueError, match="several prompts"):
        roc_select([traj(), traj(), other], group_size=2, rng=0)


# ---- counts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_neg", range(0, 9))
def test_counts_floor_half_negatives(num_neg):
    g = 4
    group = [traj(reward=0.0) for _ in range(num_neg)] + [traj(reward=1.0) for _ in range(2 * g - num_neg)]
    for seed in range(5):
        kept = roc_select(group, g, np.random.default_rng(seed))
        assert len(kept) == g and len(set(kept)) == g and all(0 <= i < 2 * g for i in kept)
        assert sum(group[i].reward == 0 for i in kept) == num_neg // 2  # floor(|neg| / 2)


def test_short_group_tops_up_with_negatives():
    # 5 rollouts for G = 4 (3 lost upstream): 1 pos, 4 neg -> floor(4*4/5)=3 neg + 1 pos = 4.
    group = [traj(reward=1.0)] + [traj(reward=0.0) for _ in range(4)]
    kept = roc_select(group, 4, 0)
    assert 0 in kept and len(kept) == 4
    # 0 positives and 4 rollouts: all negatives kept.
    assert roc_select([traj(reward=0.0)] * 4, 4, 0) == [0, 1, 2, 3]


def test_seeded_and_deterministic():
    group = [traj(reward=float(i % 2), calls=i % 3, execution=int(i % 3 == 2)) for i in range(16)]
    a = roc_select(group, 8, np.random.default_rng(7))
    b = roc_select(group, 8, np.random.default_rng(7))
    assert a == b
    assert len({tuple(roc_select(group, 8, s)) for s in range(20)}) > 1


# ---- sampling probabilities ------------------------------------------------------------------


def exact_inclusion(weights, k):
    """Inclusion probability of each item under successive weighted sampling, by enumerating
    every ordered k-draw: P(i1..ik) = prod_j w_ij / (W - w_i1 - ... - w_i(j-1))."""
    n = len(weights)
    incl = np.zeros(n)
    total = float(sum(weights))
    for seq in itertools.permutations(range(n), k):
        p, left = 1.0, total
        for i in seq:
            p *= weights[i] / left
            left -= weights[i]
        for i in seq:
            incl[i] += p
    return incl


def test_positive_inclusion_matches_successive_sampling():
    # 2G = 8, G = 4, 1 negative -> floor(1/2) = 0 negatives, 4 of the 7 positives.
    specs = [  # (calls, errors, answers, turns) -> p_total by hand
        (2, 0, 1, 2),  # 0 + 0          = 0.0
        (4, 1, 1, 2),  # 0.25 + 0       = 0.25
        (0, 0, 1, 1),  # 0.5 + 0        = 0.5
        (2, 1, 2, 2),  # 0.5 + 0.5      = 1.0
        (1, 1, 0, 1),  # 1.0 + 1.0      = 2.0
        (3, 0, 3, 4),  # 0 + 0.5        = 0.5
        (5, 1, 1, 3),  # 0.2 + 0        = 0.2
    ]
    p_hand = [0.0, 0.25, 0.5, 1.0, 2.0, 0.5, 0.2]
    group = [traj(reward=1.0, calls=c, execution=e, answers=a, turns=t) for c, e, a, t in specs]
    group.append(traj(reward=0.0))
    assert [p_total(t) for t in group[:7]] == pytest.approx(p_hand)
    w = [1.0 / (p + 0.01) for p in p_hand]  # documented weight: 1 / (p_total + 0.01)
    expected = exact_inclusion(w, 4)
    assert expected.sum() == pytest.approx(4.0)

    trials = 6000
    rng = np.random.default_rng(123)
    counts = np.zeros(8)
    for _ in range(trials):
        for i in roc_select(group, 4, rng):
            counts[i] += 1
    assert counts[7] == 0  # the lone negative: floor(1/2) = 0 kept
    freq = counts[:7] / trials
    se = np.sqrt(expected * (1 - expected) / trials)
    z = (freq - expected) / np.maximum(se, 1e-9)
    assert np.all(np.abs(z) < 4.5), (freq, expected, z)
    # Lower penalty => more often kept (the point of RoC).
    assert freq[0] > freq[1] > freq[2] > freq[3] > freq[4]


def test_first_pick_probability():
    # G=2 from 4 (all positive): the first pick ~ w_i / W; check the marginal of "kept" instead
    # against the exact 2-draw inclusion, which depends on the first pick distribution.
    group = [traj(reward=1.0, calls=0, answers=1), traj(reward=1.0, calls=1, answers=1),
             traj(reward=1.0, calls=2, execution=1, answers=1), traj(reward=1.0, calls=1, execution=1, answers=0)]
    w = np.array([1 / 0.51, 1 / 0.01, 1 / 0.51, 1 / 2.01])
    expected = exact_inclusion(list(w), 2)
    trials = 4000
    counts = np.zeros(4)
    for s in range(trials):
        for i in roc_select(group, 2, s):
            counts[i] += 1
    freq = counts / trials
    se = np.sqrt(expected * (1 - expected) / trials)
    assert np.all(np.abs(freq - expected) < 4.5 * np.maximum(se, 1e-3)), (freq, expected)


def test_negatives_uniform():
    # 2G = 8: 6 negatives with very different penalties, 2 positives -> keep 3 of 6 negatives,
    # each with probability 1/2 regardless of its penalty.
    group = [traj(reward=0.0, calls=i, execution=min(i, 1), answers=i % 3) for i in range(6)]
    group += [traj(reward=1.0), traj(reward=1.0)]
    trials = 3000
    counts = np.zeros(8)
    rng = np.random.default_rng(5)
    for _ in range(trials):
        for i in roc_select(group, 4, rng):
            counts[i] += 1
    assert counts[6] + counts[7] == trials  # n_neg = floor(6/2) = 3, so exactly 1 positive per draw
    freq = counts[:6] / trials
    se = math.sqrt(0.25 / trials)
    assert np.all(np.abs(freq - 0.5) < 4.5 * se), freq


def test_all_negative_and_all_positive_groups():
    neg = [traj(reward=0.0) for _ in range(8)]
    assert len(roc_select(neg, 4, 0)) == 4
    pos = [traj(reward=1.0, calls=2, execution=int(i >= 4)) for i in range(8)]  # 4 clean, 4 with 50% errors
    clean = 0
    for s in range(300):
        clean += sum(i < 4 for i in roc_select(pos, 4, s))
    assert clean / (300 * 4) > 0.9  # weights 100 vs ~1.96


# ---- the official deterministic variant -------------------------------------------------------


def official_selection(rewards, penalties, down_sample_to_n, min_zero=2, min_non_zero=2):
    """A line-by-line transcription of the selection in the official rStar2-Agent code
    (``down_sample/roc.py``, ``resample_of_correct``, one uid), on plain lists: the reference
    ``variant="topk"`` must reproduce."""
    indices = list(range(len(rewards)))
    if len(indices) < down_sample_to_n:
        return None
    if len(indices) == down_sample_to_n:
        return indices
    zero = [(i, p) for i, r, p in zip(indices, rewards, penalties) if r <= 0]
    non_zero = [(i, p) for i, r, p in zip(indices, rewards, penalties) if r > 0]
    non_zero.sort(key=lambda x: x[1])
    zero_num = round(len(zero) * down_sample_to_n / len(indices))
    non_zero_num = round(len(non_zero) * down_sample_to_n / len(indices))
    if zero_num < min_zero and non_zero_num < min_non_zero:
        return indices
    if zero_num <= min(min_zero, len(zero)):
        zero_num = min(min_zero, len(zero))
        non_zero_num = down_sample_to_n - zero_num
    if non_zero_num <= min(min_non_zero, len(non_zero)):
        non_zero_num = min(min_non_zero, len(non_zero))
        zero_num = down_sample_to_n - non_zero_num
    choices = [i for i, _ in non_zero[:non_zero_num]] + [i for i, _ in zero[:zero_num]]
    assert len(choices) == down_sample_to_n
    return sorted(choices)


def test_topk_variant_by_hand():
    # 8 rollouts, G=4: negatives at 0,1,2 -> round(1.5) = 2, taken in rollout order (the official
    # code sorts only the positives); positives 3..7 -> round(2.5) = 2, lowest p_total first.
    group = [
        traj(reward=0.0, calls=0),  # p 0.5
        traj(reward=0.0, calls=1, execution=1),  # p 1.0
        traj(reward=0.0, calls=2),  # p 0.0
        traj(reward=1.0, calls=2, execution=1),  # 0.5
        traj(reward=1.0, calls=0),  # 0.5
        traj(reward=1.0, calls=3),  # 0.0
        traj(reward=1.0, calls=4, execution=1),  # 0.25
        traj(reward=1.0, calls=1, answers=2, turns=1),  # 1.0
    ]
    assert roc_select(group, 4, rng=None, variant="topk") == [0, 1, 5, 6]
    # Ties broken by original index (stable), like Python's sort in the official code.
    assert roc_select([traj(reward=1.0)] * 8, 4, rng=None, variant="topk") == [0, 1, 2, 3]


@pytest.mark.parametrize("num_neg, want_neg, want_pos", [
    (31, 15, 1),  # round(15.5) = 16 negatives would drop the only success: the positive floor keeps it
    (1, 1, 15),  # round(0.5) = 0 negatives: the negative floor keeps the only failure
    (2, 2, 14), (3, 2, 14), (5, 2, 14), (6, 3, 13), (16, 8, 8), (30, 14, 2), (29, 14, 2),
    (32, 16, 0), (0, 0, 16),
])
def test_topk_worked_examples_2g_32(num_neg, want_neg, want_pos):
    """G = 16 of 2G = 32 with the run script's floors (2, 2), by hand and against the
    transcription of the official code."""
    from rstarjax.rl.roc import official_topk_counts

    assert official_topk_counts(num_neg, 32 - num_neg, 16) == (want_neg, want_pos)
    group = [traj(reward=0.0, calls=1, execution=i % 2) for i in range(num_neg)]
    group += [traj(reward=1.0, calls=1 + i % 3, execution=int(i % 3 == 0), answers=1 + i % 2, turns=4)
              for i in range(32 - num_neg)]
    order = np.random.default_rng(num_neg).permutation(32)  # interleave classes and penalties
    group = [group[i] for i in order]
    kept = roc_select(group, 16, rng=None, variant="topk")
    assert sum(group[i].reward <= 0 for i in kept) == want_neg
    assert kept == official_selection([t.reward for t in group], [p_total(t) for t in group], 16)


def test_topk_matches_official_transcription_on_random_groups():
    rng = np.random.default_rng(0)
    for trial in range(300):
        g = int(rng.choice([4, 6, 8, 16]))
        n = int(rng.integers(g + 1, 2 * g + 1))  # 2G, or fewer when rollouts were excluded
        group = [traj(reward=float(rng.random() < rng.random()), calls=int(c), execution=int(rng.integers(0, c + 1)),
                      answers=int(rng.integers(0, 3)), turns=int(rng.integers(1, 5)))
                 for c in rng.integers(0, 4, size=n)]
        want = official_selection([t.reward for t in group], [p_total(t) for t in group], g)
        try:
            got = roc_select(group, g, rng=None, variant="topk")
        except ValueError:  # only where the official code fails its own assertion
            with pytest.raises(AssertionError):
                official_selection([t.reward for t in group], [p_total(t) for t in group], g)
            continue
        assert got == want, (trial, g, n)


def test_paper_variant_edge_cases_2g_32():
    """The paper's floor(|neg| / 2): 31 negatives / 1 positive keeps 15 + the positive; 1 negative
    / 31 positives keeps no negative (the G kept rewards are all equal)."""
    from rstarjax.rl.roc import roc_counts

    assert roc_counts(31, 1, 16) == (15, 1)
    assert roc_counts(1, 31, 16) == (0, 16)
    group = [traj(reward=0.0)] + [traj(reward=1.0) for _ in range(31)]
    assert all(group[i].reward > 0 for i in roc_select(group, 16, 0))
    group = [traj(reward=0.0) for _ in range(31)] + [traj(reward=1.0)]
    assert 31 in roc_select(group, 16, 0)


def test_successive_sampling_order_probabilities():
    # P(first = i) = w_i / W and P(first = i, second = j) = w_i/W * w_j/(W - w_i).
    from rstarjax.rl.roc import weighted_sample_without_replacement

    w = np.array([5.0, 1.0, 2.0, 0.5])
    rng = np.random.default_rng(11)
    trials = 20000
    pairs = np.zeros((4, 4))
    for _ in range(trials):
        a, b = weighted_sample_without_replacement(w, 2, rng)
        pairs[a, b] += 1
    W = w.sum()
    exact = np.array([[0 if i == j else w[i] / W * w[j] / (W - w[i]) for j in range(4)] for i in range(4)])
    se = np.sqrt(exact * (1 - exact) / trials)
    assert np.all(np.abs(pairs / trials - exact) < 4.5 * np.maximum(se, 1e-4)), (pairs / trials, exact)
    with pytest.raises(ValueError):
        weighted_sample_without_replacement(np.array([1.0, 0.0]), 1, rng)


def test_roc_applied_per_group_of_a_flat_batch():
    """RoC over the rollouts of several prompts (selection.select_groups, the RL step's): G per
    group by ``group_id``, whatever the list order, deterministic in the seed."""
    from rstarjax.rl.selection import select_groups
    from rstarjax.rl.config import RLConfig

    trajs = []
    for gid in (1, 0):
        for i in range(8):
            t = traj(reward=float(i < 3))
            t.group_id = gid
            trajs.append(t)
    cfg = RLConfig(group_size=4, oversample=8)
    kept = select_groups(trajs, 2, cfg, seed=0).kept
    assert len(kept) == 8
    for gid in (0, 1):
        sub = [t for t in kept if t.group_id == gid]
        assert len(sub) == 4 and sum(t.reward == 0 for t in sub) == 2  # floor(5/2)
    assert [id(t) for t in select_groups(trajs, 2, cfg, seed=0).kept] == [id(t) for t in kept]


def test_zero_penalty_eps_is_the_rl_key_select_groups_draws_with():
    """``rl.roc_zero_penalty_eps`` reaches the draw: with eps = 1 the weights are 1 / (p + 1),
    whose inclusion probabilities differ clearly from the default 1 / (p + 0.01)'s."""
    from rstarjax.rl.config import RLConfig
    from rstarjax.rl.selection import select_groups

    specs = [(2, 0, 1, 2), (0, 0, 1, 1), (1, 1, 0, 1), (2, 1, 2, 2)]  # p_total 0, 0.5, 2, 1
    group = [traj(reward=1.0, calls=c, execution=e, answers=a, turns=t) for c, e, a, t in specs * 2]
    group[-1] = traj(reward=0.0)  # one negative: floor(1/2) = 0 kept, 4 of the 7 positives
    p = [p_total(t) for t in group[:7]]
    trials = 3000
    for eps in (1.0, 0.01):
        # (the G kept are all positive: equal rewards, which the batch filter would reject)
        cfg = RLConfig(group_size=4, oversample=8, prompts_per_step=1, roc_zero_penalty_eps=eps,
                       reject_equal_reward=False)
        expected = exact_inclusion([1.0 / (x + eps) for x in p], 4)
        counts = np.zeros(8)
        for s in range(trials):
            for t in select_groups(group, 1, cfg, s).kept:
                counts[next(i for i, g in enumerate(group) if g is t)] += 1
        freq = counts[:7] / trials
        se = np.sqrt(expected * (1 - expected) / trials)
        assert np.all(np.abs(freq - expected) < 4.5 * np.maximum(se, 1e-3)), (eps, freq, expected)
    # the two settings' predictions are far apart for the p_total = 2 trace
    assert exact_inclusion([1 / (x + 1.0) for x in p], 4)[2] - exact_inclusion([1 / (x + 0.01) for x in p], 4)[2] > 0.15
    with pytest.raises(ValueError, match="roc_zero_penalty_eps"):
        RLConfig(group_size=4, oversample=8, roc_zero_penalty_eps=0.0)

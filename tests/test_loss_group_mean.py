"""loss.token_mean="group": rStar2-Agent eq. 6 (arXiv 2508.20722) read literally,

    J = E_{(q, a), {o_i}} [ 1 / (sum_{i=1}^G |o^_i|) sum_i sum_t min(r A, clip(r) A) ],

a token mean per group (its kept rollouts' trained tokens), the groups of a mini-batch averaged
equally. Every reference here is written from that formula (mean over groups of the group's token
sum / its token count), never from the code's weights: on ``policy_loss``, through
``Trainer.train`` (packed rows, a group with every token masked, a group across two mini-batches,
2 micro-batches per mini-batch, rows reordered or not) and through ``rl_step`` with the tiny model."""
import os
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_trainer import leaves, tiny_model  # noqa: E402

from rstarjax import processes  # noqa: E402
from rstarjax.models import sharding as sharding_lib  # noqa: E402
from rstarjax.rl import optim as optim_lib  # noqa: E402
from rstarjax.rl import trainer as trainer_lib  # noqa: E402
from rstarjax.rl.loss import (LOSS_SCALE_KEY, LossConfig, group_token_mean_scale, policy_loss,  # noqa: E402
                              policy_micro_loss, trained_groups)
from rstarjax.validation import ConfigError  # noqa: E402

EPS_LOW, EPS_HIGH = 0.2, 0.28
GROUP = LossConfig(token_mean="group")


def eq6_surrogate(xp, logp, old, adv):
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token (the objective, not negated)."""
    ratio = xp.exp(logp - old)
    return xp.minimum(ratio * adv, xp.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)


def eq6_group_loss(xp, logp, old, adv, mask, groups):
    """-(1 / #groups) sum_g [sum_{t in g} min(r A, clip(r) A) / |g|] over the groups with a trained
    token (``groups``: each token's group id, 0 = none), written out group by group."""
    obj = eq6_surrogate(xp, logp, old, adv)
    terms = []
    for g in sorted(set(np.asarray(groups)[np.asarray(mask) > 0].tolist())):
        on = mask * (np.asarray(groups) == g)
        terms.append(xp.sum(obj * on) / xp.sum(on))
    return -sum(terms) / len(terms)


def eq6_batch_loss(xp, logp, old, adv, mask):
    """DAPO's reading (token_mean="batch"): one token mean over every trained token."""
    return -xp.sum(eq6_surrogate(xp, logp, old, adv) * mask) / xp.sum(mask)


def random_arrays(rng, groups, lengths, length=16):
    """One sequence per row: row i in group ``groups[i]`` with ``lengths[i]`` trained tokens."""
    n = len(groups)
    col = np.arange(length)[None, :]
    mask = ((col >= 2) & (col < 2 + np.asarray(lengths)[:, None])).astype(np.float32)
    gid = np.where(col < 2 + np.asarray(lengths)[:, None], np.asarray(groups)[:, None], 0).astype(np.int32)
    old = rng.normal(-1.0, 0.5, (n, length)).astype(np.float32)
    logp = (old + rng.normal(0, 0.4, (n, length))).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, (n, 1)), length, axis=1).astype(np.float32)
    return logp, old, adv, mask, gid


def test_weights_by_hand_and_over_blocks():
    mask = np.array([[0, 1, 1, 0, 1, 1],   # group 1: 2 tokens, group 2: 2 (tool token masked)
                     [0, 1, 1, 1, 0, 0],   # group 3: 3 tokens
                     [0, 0, 0, 0, 0, 0]], np.float32)  # group 4: every token masked, no group of the mean
    gid = np.array([[1, 1, 1, 2, 2, 2], [3, 3, 3, 3, 0, 0], [4, 4, 4, 0, 0, 0]])
    w = group_token_mean_scale(mask, gid)
    np.testing.assert_allclose(w[0], [0, 1 / 6, 1 / 6, 0, 1 / 6, 1 / 6])
    np.testing.assert_allclose(w[1], [0, 1 / 9, 1 / 9, 1 / 9, 0, 0])
    assert not w[2].any() and w.sum() == pytest.approx(1.0)
    assert trained_groups(mask, gid).tolist() == [3]
    # two blocks (mini-batches): each its own mean over its own groups, its weights summing to 1
    w = group_token_mean_scale(mask, gid, row_block=[0, 1, 1])
    np.testing.assert_allclose(w[0], [0, 1 / 4, 1 / 4, 0, 1 / 4, 1 / 4])
    np.testing.assert_allclose(w[1], [0, 1 / 3, 1 / 3, 1 / 3, 0, 0])
    # a group in two blocks counts in each with its tokens there
    w = group_token_mean_scale(mask, np.where(gid == 3, 1, gid), row_block=[0, 1, 1])
    np.testing.assert_allclose(w[1], [0, 1 / 3, 1 / 3, 1 / 3, 0, 0])
    # other processes' groups: divided by the global count
    w = group_token_mean_scale(mask, gid, block_groups=[5])
    np.testing.assert_allclose(w[1], [0, 1 / 15, 1 / 15, 1 / 15, 0, 0])
    with pytest.raises(ValueError, match="no group"):
        group_token_mean_scale(mask, np.where(gid == 3, 0, gid))
    with pytest.raises(ValueError, match="fewer groups"):
        group_token_mean_scale(mask, gid, block_groups=[2])


def test_policy_loss_is_the_mean_over_groups_of_their_token_means():
    rng = np.random.default_rng(0)
    groups, lengths = [1, 1, 2, 2, 3, 3, 4], [3, 11, 2, 4, 9, 12, 6]
    logp, old, adv, mask, gid = random_arrays(rng, groups, lengths)
    mask[6] = 0  # group 4 overlong-filtered: every token masked
    scale = group_token_mean_scale(mask, gid)
    loss, metrics = policy_loss(jnp.asarray(logp), old, adv, mask, 0.0, GROUP, loss_scale=scale)
    want = eq6_group_loss(np, logp.astype(np.float64), old, adv, mask, gid)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    batch = float(policy_loss(jnp.asarray(logp), old, adv, mask, mask.sum(), LossConfig())[0])
    assert batch == pytest.approx(eq6_batch_loss(np, logp.astype(np.float64), old, adv, mask), rel=1e-5)
    assert abs(batch - want) > 1e-2  # unequal groups: the two readings differ
    # metrics are per-group token means averaged over the groups too
    r = np.exp(logp - old)
    low = ((adv < 0) & (r < 1 - EPS_LOW)).astype(np.float64)
    frac = np.mean([np.sum(low * mask * (gid == g)) / np.sum(mask * (gid == g)) for g in (1, 2, 3)])
    assert float(metrics["clip_frac_low"]) == pytest.approx(frac, rel=1e-5, abs=1e-7)
    assert float(metrics["ratio_mean"]) == pytest.approx(
        np.mean([np.sum(r * mask * (gid == g)) / np.sum(mask * (gid == g)) for g in (1, 2, 3)]), rel=1e-5)
    assert float(metrics["token_frac"]) == pytest.approx(1.0, rel=1e-6)
    # summed over any split into micro-batches, as the trainer sums them
    parts = [policy_loss(jnp.asarray(logp[s:e]), old[s:e], adv[s:e], mask[s:e], 0.0, GROUP,
                         loss_scale=scale[s:e]) for s, e in ((0, 3), (3, 7))]
    assert sum(float(p[0]) for p in parts) == pytest.approx(want, rel=1e-5)
    assert sum(float(p[1]["token_frac"]) for p in parts) == pytest.approx(1.0, rel=1e-6)
    # the gradient is eq. 6's per-group form's
    g_ours = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, 0.0, GROUP, loss_scale=scale)[0])(jnp.asarray(logp))
    g_want = jax.grad(lambda lp: eq6_group_loss(jnp, lp, old, adv, mask, gid))(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g_ours), np.asarray(g_want), rtol=1e-5, atol=1e-8)


def test_every_group_with_the_same_tokens_gives_the_batch_token_mean():
    rng = np.random.default_rng(1)
    logp, old, adv, mask, gid = random_arrays(rng, [1, 1, 2, 2, 3, 3], [4, 8, 10, 2, 6, 6])  # 12 each
    group = float(policy_loss(jnp.asarray(logp), old, adv, mask, 0.0, GROUP,
                              loss_scale=group_token_mean_scale(mask, gid))[0])
    batch = float(policy_loss(jnp.asarray(logp), old, adv, mask, mask.sum(), LossConfig())[0])
    assert group == pytest.approx(batch, rel=1e-5)
    assert group == pytest.approx(eq6_group_loss(np, logp.astype(np.float64), old, adv, mask, gid), rel=1e-5)


def test_refused_combinations_and_the_micro_loss_keys():
    for kw, what in ((dict(advantage_estimator="dr_grpo"), "dr_grpo"), (dict(policy_loss="gspo"), "gspo"),
                     (dict(micro_batch_tokens=8), "micro_batch_tokens"),
                     (dict(micro_batch_rows="configured"), "micro_batch_rows")):
        with pytest.raises(ConfigError, match=what) as err:
            LossConfig(token_mean="group", **kw)
        assert "'group'" in str(err.value)  # the message names the option
    assert LOSS_SCALE_KEY in policy_micro_loss(GROUP).keys and policy_micro_loss(GROUP).normaliser == "tokens"
    assert LOSS_SCALE_KEY not in policy_micro_loss(LossConfig()).keys
    assert GROUP.per_token_weights and not LossConfig().per_token_weights
    with pytest.raises(ValueError, match="token_mean='group' needs loss_scale"):
        policy_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), 0.0, GROUP)


# ---- through Trainer.train ---------------------------------------------------------------------
ROWS, LEN, PROMPT = 8, 24, 4
# (row, length, group, trained): packed rows 0, 3 and 5; group 3's tokens all masked; group 4 in
# both mini-batches (rows 0-3 and 4-7); row 6 padding; groups of unequal token counts
SEQUENCES = [(0, 10, 1, True), (0, 12, 2, True), (1, 20, 1, True), (2, 14, 3, False), (3, 9, 2, True),
             (3, 8, 4, True), (4, 22, 4, True), (5, 7, 5, True), (5, 12, 4, True), (7, 16, 5, True)]


def packed_batch(seed=0):
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((ROWS, LEN), np.int32) for k in ("tokens", "positions", "segment_ids")}
    out.update({k: np.zeros((ROWS, LEN), np.float32) for k in ("loss_mask", "old_logprobs", "advantages")})
    gid = np.zeros((ROWS, LEN), np.int32)
    col = {}
    for row, n, g, trained in SEQUENCES:
        s = col.get(row, 0)
        span = slice(s, s + n)
        col[row] = s + n
        assert col[row] <= LEN
        out["tokens"][row, span] = rng.integers(1, 512, n)
        out["positions"][row, span] = np.arange(n)
        out["segment_ids"][row, span] = out["segment_ids"][row].max() + 1
        gid[row, span] = g
        if trained:
            m = np.r_[np.zeros(PROMPT), np.ones(n - PROMPT)]
            m[PROMPT + 2] = 0  # a tool token
            out["loss_mask"][row, span] = m
            out["advantages"][row, span] = m * rng.choice([1.0, -0.7]) * rng.uniform(0.5, 1.5)
            # old log-probs away from the policy's so both clip branches are exercised
            out["old_logprobs"][row, span] = m * (-6.2 + rng.normal(0, 0.4, n))
    out["rollout_logprobs"] = out["old_logprobs"].copy()
    return out, gid


def direct_logprobs(model, batch):
    logits = model(jnp.asarray(batch["tokens"]), positions=jnp.asarray(batch["positions"]),
                   segment_ids=jnp.asarray(batch["segment_ids"]))
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, jnp.asarray(batch["tokens"])[:, 1:, None], axis=-1)[..., 0]


def block_loss(model, batch, gid, rows):
    """eq. 6 per group over the mini-batch ``rows`` (a direct forward of its rows)."""
    sub = {k: v[rows] for k, v in batch.items()}
    cut = {k: jnp.asarray(v)[:, 1:] for k, v in sub.items()}
    return eq6_group_loss(jnp, direct_logprobs(model, sub), cut["old_logprobs"], cut["advantages"],
                          cut["loss_mask"], gid[rows][:, 1:])


@pytest.mark.parametrize("skip_padding, devices", [(True, 2), (False, 1)])
def test_trainer_updates_are_eq6_per_group_over_each_mini_batch(skip_padding, devices):
    """2 mini-batches of 4 rows, each of 2 micro-batches of 2 rows (with skip_padding the rows are
    reordered: the masked and padding rows last), plain SGD: the loss and the two parameter
    updates equal eq. 6's per-group means, each mini-batch over its own groups and tokens."""
    batch, gid = packed_batch()
    graphdef, p0, rest = nnx.split(tiny_model(), nnx.Param, ...)

    def loss_at(p, rows):
        return block_loss(nnx.merge(graphdef, p, rest), batch, gid, rows)

    first, second = np.arange(4), np.arange(4, 8)
    loss0, g0 = jax.value_and_grad(loss_at)(p0, first)
    p1 = jax.tree.map(lambda p, g: p - g, p0, g0)
    loss1, g1 = jax.value_and_grad(loss_at)(p1, second)
    p2 = jax.tree.map(lambda p, g: p - g, p1, g1)
    assert max(float(np.abs(g).max()) for g in leaves(g0) + leaves(g1)) > 1e-4  # real gradients

    tr = trainer_lib.Trainer(tiny_model(), None, GROUP,
                             trainer_lib.TrainerConfig(micro_batch_size=2, mini_batches=2, recompute_old_logprobs=False,
                                                       skip_padding=skip_padding),
                             mesh=sharding_lib.make_mesh(1, devices, 1, devices=jax.devices()[:devices]),
                             optimizer=optax.sgd(1.0))
    if skip_padding:
        assert not (tr.row_order(batch, 2) == np.arange(ROWS)).all()  # the rows do move
    m = tr.train({k: v.copy() for k, v in batch.items()}, group_ids=gid)
    assert m["train/updates"] == 2
    assert m["train/loss"] == pytest.approx((float(loss0) + float(loss1)) / 2, rel=1e-4, abs=1e-6)
    assert m["train/token_frac"] == pytest.approx(1.0, abs=1e-5)
    for got, want, g in zip(leaves(tr.state.params), leaves(p2), leaves(g0)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * max(1.0, np.abs(g).max()))


def test_trainer_batch_and_group_means_differ_on_unequal_groups():
    batch, gid = packed_batch()
    losses = {}
    for cfg in (LossConfig(), GROUP):
        tr = trainer_lib.Trainer(tiny_model(), None, cfg, trainer_lib.TrainerConfig(recompute_old_logprobs=False),
                                 mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]),
                                 optimizer=optax.sgd(1.0))
        losses[cfg.token_mean] = tr.train({k: v.copy() for k, v in batch.items()}, group_ids=gid)["train/loss"]
    model = tiny_model()
    want = float(block_loss(model, batch, gid, np.arange(ROWS)))
    assert losses["group"] == pytest.approx(want, rel=1e-4)
    cut = {k: jnp.asarray(v)[:, 1:] for k, v in batch.items()}
    dapo = float(eq6_batch_loss(jnp, direct_logprobs(model, batch), cut["old_logprobs"], cut["advantages"],
                                cut["loss_mask"]))
    assert losses["batch"] == pytest.approx(dapo, rel=1e-4)
    assert abs(losses["batch"] - losses["group"]) > 1e-2 * abs(losses["group"])


def test_trainer_refuses_what_it_cannot_weigh():
    batch, gid = packed_batch()
    tr = trainer_lib.Trainer(tiny_model(), None, GROUP, trainer_lib.TrainerConfig(recompute_old_logprobs=False),
                             mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]), optimizer=optax.sgd(1.0))
    with pytest.raises(ValueError, match="token_mean='group' needs group_ids"):
        tr.train(batch)
    with pytest.raises(ValueError, match="no group"):
        tr.train(batch, group_ids=np.where(gid == 2, 0, gid))
    with pytest.raises(ValueError, match="host arrays"):
        tr.train(tr.put_batch(batch), group_ids=gid)
    assert tr.step == 0


@pytest.mark.parametrize("mini_batches, others, want_count", [(1, [[3]], [5]), (4, [[1, 2, 0, 0]], [1, 2, 1, 1])])
def test_multi_process_weights_count_every_processes_groups(monkeypatch, mini_batches, others, want_count):
    """Process 1 of 2 (its 4 rows are global rows 4-7): a group's tokens are on its own process,
    the groups of each global mini-batch are summed over the processes (one all-gather)."""
    mask = np.zeros((4, 6), np.float32)
    mask[:, 1:] = 1
    mask[3, 3:] = 0
    gid = np.array([[1] * 6, [1] * 6, [2] * 6, [2] * 6])  # group 1: 10 tokens, group 2: 7
    gathered = []

    def allgather(x):
        gathered.append(np.asarray(x).tolist())
        return np.concatenate([np.asarray(others), np.asarray(x)[None]])

    monkeypatch.setattr(processes, "training_count", lambda: 2)
    monkeypatch.setattr(processes, "allgather", allgather)
    monkeypatch.setattr(jax, "process_index", lambda *a: 1)
    fake = SimpleNamespace(cfg=trainer_lib.TrainerConfig(mini_batches=mini_batches), loss_cfg=GROUP)
    w = trainer_lib.Trainer.group_loss_scale(fake, {"loss_mask": mask}, gid)
    # local counts per global mini-batch: rows 4-7 are mini-batch 0 of 1, or 2 and 3 of 4
    assert gathered == [[2] if mini_batches == 1 else [0, 0, 1, 1]]
    total = np.asarray(others).sum(axis=0) + np.asarray(gathered[0])
    assert total.tolist() == want_count
    if mini_batches == 1:
        np.testing.assert_allclose(w[0, 1:], 1 / (5 * 10))
        np.testing.assert_allclose(w[3, 1:3], 1 / (5 * 7))
    else:  # global mini-batches 2 (rows 4-5: group 1) and 3 (rows 6-7: group 2), one group each
        np.testing.assert_allclose(w[0, 1:], 1 / 10)
        np.testing.assert_allclose(w[3, 1:3], 1 / 7)


# ---- through rl_step with the tiny model --------------------------------------------------------
def test_rl_step_passes_each_tokens_group_and_trains_eq6_per_group():
    """The real rl_step (scripted rollouts, RoC, GRPO advantages, batch): the group ids it passes
    are the trajectories' prompts, and the first update's loss (old log-probs recomputed: r = 1)
    is eq. 6's mean over groups of -sum A / |group tokens|, not the batch token mean."""
    from rstarjax.rl.config import RLConfig
    from rstarjax.rl.step import rl_step
    from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, Trajectory

    rewards = {0: [1, 1, 1, 1], 1: [1, 0, 1, 0], 2: [0, 1, 0, 1], 3: [1, 0, 0, 1]}

    def rollouts(records, n, seed, version):
        out = []
        for g, rec in enumerate(records):
            p = int(rec["problem"].split()[-1])
            rng = np.random.default_rng([p, seed])
            for j in range(n):
                k = 2 + (3 * p + 5 * j) % 7
                out.append(Trajectory(
                    prompt_ids=np.array([5, 6, 100 + p], np.int32),
                    segments=[Segment(SegmentKind.MODEL, rng.integers(1, 400, k), -rng.random(k) - 0.1)],
                    turns=1, answer_tags=1, finish=FinishReason.ANSWERED, reward=float(rewards[p][j]),
                    group_id=g, policy_version=version))
        return out

    tr = trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(learning_rate=1e-3), GROUP,
                             trainer_lib.TrainerConfig(micro_batch_size=2),
                             mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    seen = {}
    train = tr.train

    def spy(batch, **kw):
        seen.update(batch=batch, **kw)
        return train(batch, **kw)

    tr.train = spy
    cfg = RLConfig(prompts_per_step=4, group_size=2, oversample=4, max_prompt_len=4, max_response_len=8)
    m = rl_step(tr, rollouts, [{"problem": f"problem {p}", "answer": str(p)} for p in range(4)], cfg,
                LossConfig(), seed=3)
    assert m["filter/groups_trained"] == 3 and tr.step == 1
    b, gid = seen["batch"], seen["group_ids"]
    mask, adv = np.asarray(b.loss_mask), np.asarray(b.advantages)
    prompt = np.where(b.segment_ids > 0, b.tokens, 0)[:, 2]  # one sequence per row: its problem
    for row in range(gid.shape[0]):
        on = b.segment_ids[row] > 0
        assert len(set(gid[row][on].tolist())) == int(on.any()) and not gid[row][~on].any()
    by_prompt = {int(p): {int(g) for g in gid[prompt == p, 0]} for p in set(prompt[mask.any(axis=1)].tolist())}
    assert sorted(by_prompt) == [101, 102, 103] and all(len(v) == 1 for v in by_prompt.values())
    assert len({v.pop() for v in by_prompt.values()}) == 3  # one id per problem, distinct
    # ratio 1 at the first update: eq. 6's objective is A itself, token by token
    per_group = [np.sum(adv * mask * (prompt == p)[:, None]) / np.sum(mask * (prompt == p)[:, None])
                 for p in (101, 102, 103)]
    want, dapo = -np.mean(per_group), -np.sum(adv * mask) / np.sum(mask)
    assert abs(want - dapo) > 1e-2  # the groups' token counts differ: the readings differ
    assert m["train/loss"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert m["train/token_frac"] == pytest.approx(1.0, abs=1e-5)

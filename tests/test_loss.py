"""Policy loss vs an independent NumPy transcription of rStar2-Agent eq. 6-7; micro-batch exactness."""
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rstarjax.rl.advantages import (
    dr_grpo_advantages,
    grouped_advantages,
    grpo_advantages,
    is_informative_group,
    kimi_length_reward,
)
from rstarjax.models.logprobs import token_logprobs_and_entropy
from rstarjax.rl.batch import build_train_batch
from rstarjax.rl.loss import LossConfig, dr_grpo_denominator, policy_loss
from rstarjax.rl.trajectory import Segment, SegmentKind, Trajectory


def make_train_batch(*args, **kwargs):
    return build_train_batch(*args, **kwargs)[0]


def num_loss_tokens(batch):
    """eq. 6's sum_i |o_i| of a whole batch."""
    return float(np.asarray(batch.loss_mask, np.float64).sum())


def token_logprobs(logits, targets):
    return token_logprobs_and_entropy(logits, targets)[0]

# ---- eq. 7 ------------------------------------------------------------------------------------


def test_group_advantages_eq7():
    r = [1.0, 0.0, 0.0, 1.0, 1.0]
    mean = sum(r) / len(r)
    sd = statistics.stdev(r)  # sample std, as verl's torch.std
    np.testing.assert_allclose(grpo_advantages(r), [(x - mean) / (sd + 1e-6) for x in r], rtol=1e-6)
    sd0 = statistics.pstdev(r)
    np.testing.assert_allclose(grpo_advantages(r, ddof=0), [(x - mean) / (sd0 + 1e-6) for x in r], rtol=1e-6)
    np.testing.assert_allclose(dr_grpo_advantages(r), [x - mean for x in r], rtol=1e-6)  # Dr. GRPO
    assert np.all(grpo_advantages([1.0] * 4) == 0) and np.all(grpo_advantages([0.0] * 4) == 0)
    assert grpo_advantages([1.0]).tolist() == [0.0] and dr_grpo_advantages([1.0]).tolist() == [0.0]
    with pytest.raises(ValueError):
        grpo_advantages([1.0, float("nan")])
    with pytest.raises(ValueError):
        dr_grpo_advantages([1.0, float("nan")])


def test_grouped_advantages_per_group():
    r = [1, 0, 1, 1, 0, 0]
    g = [7, 7, 3, 3, 3, 7]
    out = grouped_advantages(r, g)
    np.testing.assert_allclose(out[[0, 1, 5]], grpo_advantages([1, 0, 0]))
    np.testing.assert_allclose(out[[2, 3, 4]], grpo_advantages([1, 1, 0]))


def test_dynamic_sampling_predicate():
    assert not is_informative_group([1, 1, 1]) and not is_informative_group([0, 0])
    assert is_informative_group([0, 1, 0])


def test_kimi_length_reward_by_hand():
    # min 100, max 300: lambda = 0.5 - (len - 100) / 200 -> [0.5, 0, -0.5, 0.25]
    out = kimi_length_reward([100, 200, 300, 150], [True, True, False, False], coef=1.0)
    np.testing.assert_allclose(out, [0.5, 0.0, -0.5, 0.0])
    assert np.all(kimi_length_reward([5, 5], [True, False]) == 0)


# ---- token_logprobs vs torch ----------------------------------------------------------------


def test_token_logprobs_against_torch():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 6, 11)).astype(np.float32) * 3
    tokens = rng.integers(0, 11, size=(2, 6))
    lp, ent = token_logprobs_and_entropy(jnp.asarray(logits), jnp.asarray(tokens))
    tl = torch.log_softmax(torch.tensor(logits[:, :-1]), -1)
    ref = torch.gather(tl, -1, torch.tensor(tokens[:, 1:])[..., None])[..., 0].numpy()
    ref_ent = torch.distributions.Categorical(logits=torch.tensor(logits[:, :-1])).entropy().numpy()
    np.testing.assert_allclose(np.asarray(lp)[:, 1:], ref, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent)[:, 1:], ref_ent, atol=1e-5)
    assert np.all(np.asarray(lp)[:, 0] == 0)
    # bf16 logits are upcast before the softmax
    lpb = token_logprobs(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(tokens))
    assert lpb.dtype == jnp.float32


# ---- eq. 6 vs NumPy --------------------------------------------------------------------------


def make_group(rng, n=5, vocab=13):
    trajs = []
    for i in range(n):
        p = rng.integers(2, 5)
        segs = []
        for k in range(rng.integers(1, 4)):
            m = rng.integers(1, 5)
            segs.append(Segment(SegmentKind.MODEL, rng.integers(0, vocab, m), -rng.uniform(0.05, 3.0, m)))
            segs.append(Segment(SegmentKind.TOOL, rng.integers(0, vocab, rng.integers(1, 3))))
        trajs.append(Trajectory(prompt_ids=rng.integers(0, vocab, p), segments=segs, reward=float(rng.integers(0, 2))))
    trajs[0].reward, trajs[1].reward = 1.0, 0.0  # at least one of each
    return trajs


def numpy_eq6(trajs, new_lp_per_traj, eps_low=0.2, eps_high=0.28, dual_c=None, kl_coef=0.0, ref_per_traj=None):
    """Direct transcription of eq. 6-7: sum over kept rollouts i and their MODEL tokens t of
    -min(r A_i, clip(r, 1-el, 1+eh) A_i), divided by sum_i |o_i| (model tokens only)."""
    rewards = [t.reward for t in trajs]
    mu = sum(rewards) / len(rewards)
    sd = statistics.stdev(rewards)
    total, count = 0.0, 0
    for i, t in enumerate(trajs):
        a = (t.reward - mu) / (sd + 1e-6)
        j = 0  # index over this rollout's response tokens
        for seg in t.segments:
            for k in range(len(seg.ids)):
                if seg.kind == SegmentKind.MODEL:
                    r = math.exp(new_lp_per_traj[i][j] - seg.logprobs[k])
                    term = -min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
                    if dual_c is not None and a < 0:
                        term = min(term, -dual_c * a)
                    if kl_coef:
                        d = ref_per_traj[i][j] - new_lp_per_traj[i][j]
                        term += kl_coef * (math.exp(d) - d - 1)
                    total += term
                    count += 1
                j += 1
    return total / count


def batch_and_newlp(trajs, rng, pack=False, spread=0.5):
    adv = grpo_advantages([t.reward for t in trajs])
    b = make_train_batch(trajs, adv, seq_len=32, pad_id=0, pack=pack)
    new = b.old_logprobs + rng.normal(size=b.old_logprobs.shape).astype(np.float32) * spread
    # per-trajectory new log-probs of the response tokens, read back through the layout
    per_traj = []
    row = 0
    for i, t in enumerate(trajs):  # unpacked: row i, response after the prompt
        p = len(t.prompt_ids)
        per_traj.append(new[i, p : p + len(t.response_ids)].tolist())
    return b, new, per_traj


@pytest.mark.parametrize("dual_c", [None, 3.0])
def test_policy_loss_matches_numpy_eq6(dual_c):
    rng = np.random.default_rng(1)
    trajs = make_group(rng)
    b, new, per_traj = batch_and_newlp(trajs, rng, spread=0.6)
    cfg = LossConfig(dual_clip_c=dual_c)
    denom = num_loss_tokens(b)
    loss, m = jax.jit(policy_loss, static_argnames="cfg")(
        jnp.asarray(new), b.old_logprobs, b.advantages, b.loss_mask, denom, cfg=cfg
    )
    ref = numpy_eq6(trajs, per_traj, dual_c=dual_c)
    assert float(loss) == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert float(m["token_frac"]) == pytest.approx(1.0)
    assert 0 < float(m["clip_frac_low"]) + float(m["clip_frac_high"]) < 1  # spread 0.6 clips some tokens


def test_kl_option_matches_numpy():
    rng = np.random.default_rng(2)
    trajs = make_group(rng)
    b, new, per_traj = batch_and_newlp(trajs, rng)
    ref_lp = b.old_logprobs + rng.normal(size=new.shape).astype(np.float32) * 0.3
    ref_per_traj = [ref_lp[i, len(t.prompt_ids) :].tolist() for i, t in enumerate(trajs)]
    cfg = LossConfig(kl_coef=0.1)
    loss, m = policy_loss(jnp.asarray(new), b.old_logprobs, b.advantages, b.loss_mask, num_loss_tokens(b), cfg,
                          ref_logprobs=jnp.asarray(ref_lp))
    assert float(loss) == pytest.approx(numpy_eq6(trajs, per_traj, kl_coef=0.1, ref_per_traj=ref_per_traj), rel=1e-5)
    with pytest.raises(ValueError):
        policy_loss(jnp.asarray(new), b.old_logprobs, b.advantages, b.loss_mask, 1.0, cfg)


def test_gradient_matches_numpy():
    # d loss / d logp_t = -A r_t / denom where the unclipped branch is active, else 0.
    rng = np.random.default_rng(3)
    trajs = make_group(rng)
    b, new, _ = batch_and_newlp(trajs, rng, spread=0.4)
    denom = num_loss_tokens(b)
    g = jax.grad(lambda lp: policy_loss(lp, b.old_logprobs, b.advantages, b.loss_mask, denom, LossConfig())[0])(
        jnp.asarray(new)
    )
    r = np.exp(new - b.old_logprobs)
    a = b.advantages
    active = np.where(a > 0, r <= 1.28, r >= 0.8)  # min() picks the unclipped term
    expect = np.where((b.loss_mask > 0) & active, -a * r / denom, 0.0)
    np.testing.assert_allclose(np.asarray(g), expect, atol=1e-6)


def test_entropy_and_tis_options():
    rng = np.random.default_rng(4)
    trajs = make_group(rng)
    b, new, _ = batch_and_newlp(trajs, rng, spread=0.1)
    mask, denom = b.loss_mask, num_loss_tokens(b)
    ent = rng.uniform(0, 2, new.shape).astype(np.float32)
    base, _ = policy_loss(jnp.asarray(new), b.old_logprobs, b.advantages, mask, denom, LossConfig())
    with_ent, m = policy_loss(jnp.asarray(new), b.old_logprobs, b.advantages, mask, denom, LossConfig(entropy_coef=0.01),
                              entropy=jnp.asarray(ent))
    assert float(with_ent) == pytest.approx(float(base) - 0.01 * (ent * mask).sum() / denom, rel=1e-5)
    # TIS: trainer old log-probs differ from the sampler's; weight = min(exp(old - rollout), cap).
    rollout = b.old_logprobs + rng.normal(size=new.shape).astype(np.float32) * 0.5
    cap = 1.5
    w = np.minimum(np.exp(b.old_logprobs - rollout), cap)
    r = np.exp(new - b.old_logprobs)
    a = b.advantages
    pg = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.28))
    expect = (mask * pg * w).sum() / denom
    loss, m = policy_loss(jnp.asarray(new), b.old_logprobs, b.advantages, mask, denom, LossConfig(tis_cap=cap),
                          rollout_logprobs=jnp.asarray(rollout))
    assert float(loss) == pytest.approx(expect, rel=1e-5)
    assert float(m["tis_capped_frac"]) == pytest.approx((mask * (np.exp(b.old_logprobs - rollout) > cap)).sum() / denom, rel=1e-5)


def test_decoupled_ppo_equals_a_hand_written_reference():
    """Decoupled PPO (AReaL): ratio against the proximal policy, each token weighted by
    pi_prox / pi_behav, tokens above the cap dropped but still counted in the normaliser. Four
    hand-built tokens, the expected loss written out by hand; with behaviour == proximal it is
    eq. 6, loss and gradient bit for bit."""
    import math

    prox = np.log(np.array([[0.5, 0.2, 0.4, 0.3, 0.9]], np.float32))
    behav = np.log(np.array([[0.5, 0.1, 0.5, 0.05, 0.9]], np.float32))  # w = 1, 2, 0.8, 6 (dropped at 5)
    new = np.log(np.array([[0.6, 0.3, 0.2, 0.3, 0.9]], np.float32))  # r = 1.2, 1.5 (clip 1.28), 0.5, 1
    adv = np.array([[1.0, 1.0, -1.0, 2.0, 0.0]], np.float32)
    mask = np.array([[1.0, 1.0, 1.0, 1.0, 0.0]], np.float32)  # the last token is a prompt token
    cfg = LossConfig(decoupled_cap=5.0)
    loss, m = policy_loss(jnp.asarray(new), jnp.asarray(prox), jnp.asarray(adv), jnp.asarray(mask), 4.0, cfg,
                          rollout_logprobs=jnp.asarray(behav))
    # token 1: -min(1.2 * 1, 1.2 * 1) * 1 = -1.2; token 2: -min(1.5, 1.28) * 2 = -2.56;
    # token 3 (A < 0): -min(0.5 * -1, 0.8 * -1) * 0.8 = 0.64; token 4: weight 6 > 5, dropped
    assert float(loss) == pytest.approx((-1.2 - 2.56 + 0.64 + 0.0) / 4, rel=1e-5)
    assert float(m["behaviour_dropped_frac"]) == pytest.approx(1 / 4)
    assert float(m["behaviour_weight_mean"]) == pytest.approx((1 + 2 + 0.8 + 0) / 4, rel=1e-5)
    uncapped, _ = policy_loss(jnp.asarray(new), jnp.asarray(prox), jnp.asarray(adv), jnp.asarray(mask), 4.0,
                              LossConfig(decoupled_cap=math.inf), rollout_logprobs=jnp.asarray(behav))
    assert float(uncapped) == pytest.approx((-1.2 - 2.56 + 0.64 - 6 * 2 * 1.0) / 4, rel=1e-5)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(jnp.asarray(new), jnp.asarray(prox), jnp.asarray(adv), jnp.asarray(mask), 4.0, cfg)

    def grad_and_loss(c, behaviour):
        return jax.value_and_grad(lambda lp: policy_loss(lp, jnp.asarray(prox), jnp.asarray(adv), jnp.asarray(mask),
                                                         4.0, c, rollout_logprobs=behaviour)[0])(jnp.asarray(new))
    on_policy = grad_and_loss(cfg, jnp.asarray(prox))
    eq6 = grad_and_loss(LossConfig(), None)
    assert float(on_policy[0]) == float(eq6[0]) and np.array_equal(on_policy[1], eq6[1])
    # the weight is data, not differentiated: d loss / d logp_1 = -A r w / denom on an unclipped token
    g = np.asarray(grad_and_loss(cfg, jnp.asarray(behav))[1])
    assert g[0, 0] == pytest.approx(-1.0 * 1.2 * 1.0 / 4, rel=1e-5) and g[0, 1] == 0.0 and g[0, 3] == 0.0
    for bad in (dict(decoupled_cap=1.0), dict(decoupled_cap=5.0, tis_cap=2.0)):
        with pytest.raises(ValueError):
            LossConfig(**bad)


def numpy_gspo(b, new, seq_ids, el=3e-4, eh=4e-4):
    """GSPO (arXiv 2507.18071, GSPO-token; verl's compute_policy_loss_gspo, seq-mean-token-mean):
    s_i = exp(mean_t (logp - old)) per sequence; per-token term -min(s A, clip(s) A), averaged
    over each sequence's tokens, then over the sequences."""
    means = []
    mask = b.loss_mask
    for key in np.unique(seq_ids[mask > 0]):
        sel = (seq_ids == key) & (mask > 0)
        s = math.exp(float(np.mean(new[sel] - b.old_logprobs[sel])))
        means.append(np.mean([-min(s * a, min(max(s, 1 - el), 1 + eh) * a) for a in b.advantages[sel]]))
    return float(np.mean(means))


def test_gspo_packed_equals_unpacked_and_numpy():
    rng = np.random.default_rng(5)
    trajs = make_group(rng, n=6)
    adv = grpo_advantages([t.reward for t in trajs])
    flat = make_train_batch(trajs, adv, seq_len=32, pad_id=0)
    packed = make_train_batch(trajs, adv, seq_len=32, pad_id=0, pack=True)
    assert packed.shape[0] < flat.shape[0]
    # the same per-token deviation (1e-4 scale: around the GSPO clip range) for each token
    dev = {}
    new_flat = flat.old_logprobs.copy()
    for i, t in enumerate(trajs):
        d = rng.normal(size=len(t.response_ids)).astype(np.float32) * 3e-4
        dev[i] = d
        new_flat[i, len(t.prompt_ids) : len(t.prompt_ids) + len(d)] += d
    cfg = LossConfig(policy_loss="gspo")
    from rstarjax.rl.loss import trained_sequences

    sequences = float(trained_sequences(jnp.asarray(flat.loss_mask), None))
    assert sequences == len(trajs)
    lf, _ = policy_loss(jnp.asarray(new_flat), flat.old_logprobs, flat.advantages, flat.loss_mask, sequences, cfg)
    seq_ids = np.arange(flat.shape[0])[:, None] * 100 + flat.segment_ids
    # float32 sums of terms near 1 whose mean is near 0 (GRPO advantages sum to 0 in a group)
    assert float(lf) == pytest.approx(numpy_gspo(flat, new_flat, seq_ids), abs=1e-6)
    # packed: find each trajectory's segment by matching its token run
    from rstarjax.rl.batch import build_train_batch

    packed, layout = build_train_batch(trajs, adv, seq_len=32, pad_id=0, pack=True)
    new_packed = packed.old_logprobs.copy()
    for i, (t, pl) in enumerate(zip(trajs, layout.placements)):
        s = pl.start + len(t.prompt_ids)
        new_packed[pl.row, s : s + len(dev[i])] += dev[i]
    assert float(trained_sequences(jnp.asarray(packed.loss_mask), jnp.asarray(packed.segment_ids))) == sequences
    lp_, _ = policy_loss(jnp.asarray(new_packed), packed.old_logprobs, packed.advantages, packed.loss_mask,
                         sequences, cfg, segment_ids=jnp.asarray(packed.segment_ids))
    assert float(lp_) == pytest.approx(float(lf), abs=1e-6)
    # without segment_ids, packed rows would be treated as one sequence: a different value
    lp_wrong, _ = policy_loss(jnp.asarray(new_packed), packed.old_logprobs, packed.advantages, packed.loss_mask,
                              sequences, cfg)
    assert abs(float(lp_wrong) - float(lf)) > 1e-5


# ---- micro-batching: sum of micro losses/grads == full batch ------------------------------------


def test_microbatch_sum_equals_full_batch_loss_and_grads():
    rng = np.random.default_rng(6)
    trajs = make_group(rng, n=8, vocab=13)
    b = make_train_batch(trajs, grpo_advantages([t.reward for t in trajs]), seq_len=32, pad_id=0)
    params = {
        "emb": jnp.asarray(rng.normal(size=(13, 6)).astype(np.float32)),
        "out": jnp.asarray(rng.normal(size=(6, 13)).astype(np.float32)),
    }
    cfg = LossConfig()
    denom = num_loss_tokens(b)  # global, from the WHOLE batch

    def loss_fn(p, mb):
        logits = jnp.tanh(p["emb"][mb.tokens]) @ p["out"]
        lp = token_logprobs(logits, mb.tokens)
        return policy_loss(lp, mb.old_logprobs, mb.advantages, mb.loss_mask, denom, cfg)

    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (full, fm), gfull = step(params, b)
    total, gsum, msum = 0.0, jax.tree.map(jnp.zeros_like, params), None
    for s in range(0, 8, 3):  # uneven micro-batches: 3, 3, 2 rows
        (l, m), g = step(params, jax.tree.map(lambda a: a[s:s + 3], b))
        total += l
        gsum = jax.tree.map(jnp.add, gsum, g)
        msum = m if msum is None else jax.tree.map(jnp.add, msum, m)
    assert float(total) == pytest.approx(float(full), rel=1e-5, abs=1e-7)
    for k in params:
        np.testing.assert_allclose(np.asarray(gsum[k]), np.asarray(gfull[k]), rtol=1e-4, atol=1e-6)
    for k in fm:
        assert float(msum[k]) == pytest.approx(float(fm[k]), rel=1e-5, abs=1e-7)
    assert float(msum["token_frac"]) == pytest.approx(1.0)


def test_masked_garbage_does_not_poison():
    rng = np.random.default_rng(7)
    trajs = make_group(rng)
    b, new, _ = batch_and_newlp(trajs, rng)
    new = np.where(b.loss_mask > 0, new, -1e30).astype(np.float32)
    new[b.loss_mask == 0] = -np.inf
    loss, g = jax.value_and_grad(
        lambda lp: policy_loss(lp, b.old_logprobs, b.advantages, b.loss_mask, num_loss_tokens(b), LossConfig())[0]
    )(jnp.asarray(new))
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))
    assert float(policy_loss(jnp.asarray(new), b.old_logprobs, b.advantages, 0 * b.loss_mask, 0.0, LossConfig())[0]) == 0.0


def test_loss_config_validation():
    for bad in (dict(eps_low=0.0), dict(eps_low=1.0), dict(kl_coef=-1.0), dict(dual_clip_c=0.5), dict(tis_cap=0.0)):
        with pytest.raises(ValueError):
            LossConfig(**bad)
    for bad in (dict(policy_loss="ppo"), dict(advantage_estimator="rloo")):  # named choices are checked
        with pytest.raises(ValueError):
            LossConfig(**bad)
    with pytest.raises(ValueError):
        dr_grpo_denominator(0, 10)
    assert dr_grpo_denominator(num_sequences=4, max_response_len=10) == 40


def test_trajectory_advantages_groups_and_length_penalty():
    from rstarjax.rl.advantages import trajectory_advantages

    def t(gid, reward, n_model, n_tool=0):
        segs = [Segment(SegmentKind.MODEL, np.zeros(n_model), np.zeros(n_model))]
        if n_tool:
            segs.append(Segment(SegmentKind.TOOL, np.zeros(n_tool)))
        return Trajectory(prompt_ids=np.ones(2), segments=segs, reward=reward, group_id=gid)

    trajs = [t(0, 1.0, 10, n_tool=50), t(0, 1.0, 30), t(0, 0.0, 20), t(1, 1.0, 5), t(1, 0.0, 5)]
    shaped, adv = trajectory_advantages(trajs, length_penalty_coef=0.1)
    # group 0: model lengths 10, 30, 20 (tool tokens ignored) -> lambda 0.5, -0.5, 0.0
    np.testing.assert_allclose(shaped, [1.05, 0.95, 0.0, 1.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(adv[:3], grpo_advantages([1.05, 0.95, 0.0]), rtol=1e-6)
    np.testing.assert_allclose(adv[3:], grpo_advantages([1.0, 0.0]), rtol=1e-6)
    _, plain = trajectory_advantages(trajs, estimator="dr_grpo")
    np.testing.assert_allclose(plain[:3], [1 / 3, 1 / 3, -2 / 3], rtol=1e-6)


def test_micro_batch_token_mean_is_the_official_actors():
    """loss.token_mean="micro_batch" (issue #27): each micro-batch contributes its own token mean
    times its rows / the batch's rows, as verl's dp_actor.update_policy does with use_dynamic_bsz
    (loss_scale_factor = micro rows / mini-batch rows, loss_agg_mode="token-mean"); with dual clip c=3."""
    rng = np.random.default_rng(11)
    trajs = make_group(rng, n=8)
    b, new, _ = batch_and_newlp(trajs, rng, spread=0.6)
    cfg = LossConfig(dual_clip_c=3.0, token_mean="micro_batch")
    rows = int(np.sum(np.asarray(b.loss_mask).any(axis=1)))
    total, official = 0.0, 0.0
    for s, e in ((0, 3), (3, 6), (6, 8)):
        mb = jax.tree.map(lambda a: a[s:e], b)
        loss, _ = policy_loss(jnp.asarray(new[s:e]), mb.old_logprobs, mb.advantages, mb.loss_mask, rows, cfg)
        total += float(loss)
        # the official formula by hand: token mean of the dual-clipped PPO loss over this micro-batch
        mask = np.asarray(mb.loss_mask) > 0
        r = np.exp(new[s:e] - np.asarray(mb.old_logprobs))
        a = np.asarray(mb.advantages)
        pg = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.28))
        pg = np.where(a < 0, np.minimum(pg, -a * 3.0), pg)
        official += pg[mask].mean() * mask.any(axis=1).sum() / rows
    assert total == pytest.approx(official, rel=1e-5)
    whole = float(policy_loss(jnp.asarray(new), b.old_logprobs, b.advantages, b.loss_mask,
                              num_loss_tokens(b), LossConfig(dual_clip_c=3.0))[0])
    assert whole != pytest.approx(total, rel=1e-3)  # eq. 6's one batch-wide mean differs
    with pytest.raises(ValueError, match="token_mean"):
        LossConfig(token_mean="sequence")
    with pytest.raises(ValueError, match="dr_grpo"):
        LossConfig(token_mean="micro_batch", advantage_estimator="dr_grpo")

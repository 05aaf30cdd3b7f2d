"""verl's loss scaling in the rstar2_official profile (issue #50): loss.micro_batch_rows="configured"
and loss.micro_batch_tokens (token-budget micro-batches) against a numpy re-statement of the
official verl (J-shang/verl d0dc976578c1758d777498df1354f008aca2803d, the submodule of microsoft/rStar
ecbfb94):

- verl/workers/actor/dp_actor.py ``DataParallelPPOActor.update_policy`` with use_dynamic_bsz: per GPU,
  each micro-batch's ``policy_loss * loss_scale_factor``, ``loss_scale_factor = micro rows /
  ppo_mini_batch_size`` (the normalised per-GPU value: train batch x rollout.n / GPUs,
  verl/workers/fsdp_workers.py), backward summed over the micro-batches; FSDP averages the GPUs'
  gradients;
- verl/trainer/ppo/core_algos.py ``compute_policy_loss_vanilla`` (clip_ratio_low/high, dual clip
  clip_ratio_c, ratio from the clamped log-ratio) and ``agg_loss`` "token-mean" =
  verl/utils/torch_functional.py ``masked_mean`` (sum / (mask sum + 1e-8));
- verl/utils/seqlen_balancing.py ``rearrange_micro_batches``: min(rows, ceil(tokens / budget))
  micro-batches per GPU, the largest count over the GPUs.

The micro-batches given to verl's formula are the ones ``verl_loss_scale`` formed (verl balances
with Karmarkar-Karp; the contract checked is the loss on the same micro-batches)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstarjax.rl.loss import LossConfig, policy_loss, token_budget_micro_batches, verl_loss_scale

EPS_LOW, EPS_HIGH, CLIP_C = 0.2, 0.28, 3.0


def verl_policy_loss(xp, old, logp, adv, mask):
    """core_algos.compute_policy_loss_vanilla + agg_loss('token-mean'), restated."""
    log_ratio = xp.clip(logp - old, -20.0, 20.0)
    ratio = xp.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * xp.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    clip1 = xp.maximum(pg1, pg2)
    pg3 = -adv * CLIP_C
    clip2 = xp.minimum(pg3, clip1)
    pg = xp.where(adv < 0, clip2, clip1)
    return xp.sum(pg * mask) / (xp.sum(mask) + 1e-8)


def verl_update_loss(xp, gpu_micro_batches, rows_per_gpu, arrays):
    """dp_actor.update_policy's loss over all GPUs: mean over GPUs of sum over micro-batches of
    policy_loss * rows / ppo_mini_batch_size (gradients, being linear in it, follow)."""
    old, logp, adv, mask = arrays
    total = 0.0
    for micro_batches in gpu_micro_batches:
        for rows in micro_batches:
            idx = np.asarray(rows)
            total = total + verl_policy_loss(xp, old[idx], logp[idx], adv[idx], mask[idx]) * len(rows) / rows_per_gpu
    return total / len(gpu_micro_batches)


def make_batch(rng, n=24, length=40):
    lengths = rng.integers(4, length + 1, size=n)
    seg = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
    mask = (seg * (rng.random((n, length)) < 0.7)).astype(np.float32)
    old = rng.normal(-1.0, 0.5, (n, length)).astype(np.float32)
    logp = (old + rng.normal(0, 0.4, (n, length))).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, (n, 1)), length, axis=1).astype(np.float32)
    return lengths, seg, mask, old, logp, adv


def gpu_blocks(n, gpus, lengths, budget):
    """The micro-batches verl_loss_scale forms, as row lists per GPU (one sequence per row here)."""
    blocks = np.array_split(np.arange(n), gpus)
    count = max(min(len(b), -(-int(lengths[b].sum()) // budget)) for b in blocks)
    return [[[int(b[i]) for i in part] for part in token_budget_micro_batches(lengths[b], budget, count)]
            for b in blocks]


@pytest.mark.parametrize("gpus, budget", [(1, 100), (4, 60), (3, 10_000)])
def test_loss_and_gradient_equal_verls_on_the_same_micro_batches(gpus, budget):
    rng = np.random.default_rng(gpus * 7 + budget)
    lengths, seg, mask, old, logp, adv = make_batch(rng)
    n = len(lengths)
    configured = 2 * n  # RoC kept half of the rollouts the update was configured for
    scale = verl_loss_scale(mask, seg, configured, budget, gpus)
    cfg = LossConfig(dual_clip_c=CLIP_C, token_mean="micro_batch", micro_batch_rows="configured",
                     micro_batch_tokens=budget, micro_batch_gpus=gpus)
    micro = gpu_blocks(n, gpus, lengths, budget)
    assert sum(len(p) for b in micro for p in b) == n and all(p for b in micro for p in b)

    @jax.jit
    def ours(lp):  # our micro-batches (any split: 3 fixed ones here) summed, as the trainer does
        parts = [policy_loss(lp[s:e], old[s:e], adv[s:e], mask[s:e], 0.0, cfg, loss_scale=scale[s:e])[0]
                 for s, e in ((0, 7), (7, 15), (15, n))]
        return sum(parts)

    # verl's formula in float64; ours in float32 (as verl's actor): within float32 summation error
    want = verl_update_loss(np, micro, configured / gpus, tuple(a.astype(np.float64) for a in (old, logp, adv, mask)))
    assert float(ours(jnp.asarray(logp))) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    g_ours = jax.grad(ours)(jnp.asarray(logp))
    g_verl = jax.jit(jax.grad(lambda lp: verl_update_loss(jnp, micro, configured / gpus,
                                                  (jnp.asarray(old), lp, jnp.asarray(adv), jnp.asarray(mask)))))(
        jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g_ours), np.asarray(g_verl), rtol=1e-5, atol=1e-9)


def test_the_configured_rows_scale_the_loss_by_rows_kept_over_configured():
    """The issue's factor: dividing by the rows kept instead of verl's configured rows multiplies
    loss and gradient by configured / kept."""
    rng = np.random.default_rng(3)
    lengths, seg, mask, old, logp, adv = make_batch(rng)
    n = len(lengths)
    losses = []
    for rows in (n, 4 * n):
        cfg = LossConfig(token_mean="micro_batch", micro_batch_tokens=100, micro_batch_gpus=2)
        losses.append(float(policy_loss(jnp.asarray(logp), old, adv, mask, 0.0, cfg,
                                        loss_scale=verl_loss_scale(mask, seg, rows, 100, 2))[0]))
    assert losses[0] == pytest.approx(4 * losses[1], rel=1e-6)


def test_token_budget_micro_batches_count_and_cover():
    lengths = [30, 5, 17, 40, 8, 22]
    parts = token_budget_micro_batches(lengths, 50)
    assert len(parts) == -(-sum(lengths) // 50) == 3
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert len(token_budget_micro_batches(lengths, 1)) == 6  # at most one per sequence
    assert len(token_budget_micro_batches(lengths, 10_000)) == 1
    assert token_budget_micro_batches(lengths, 50, count=4) and len(token_budget_micro_batches(lengths, 50, 4)) == 4


def test_packed_rows_count_each_sequence():
    """A packed row's sequences are verl rows of their own (segment_ids)."""
    seg = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 0, 0, 0]])
    mask = np.array([[0, 1, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0]], np.float32)
    scale = verl_loss_scale(mask, seg, 3, 10_000, 1)  # one micro-batch of 3 sequences, 5 tokens
    np.testing.assert_allclose(scale[mask > 0], 3 / (3 * 5))


def test_options_need_the_micro_batch_token_mean():
    with pytest.raises(ValueError, match="token_mean"):
        LossConfig(micro_batch_rows="configured")
    with pytest.raises(ValueError, match="micro_batch_rows"):
        LossConfig(token_mean="micro_batch", micro_batch_rows="all")
    with pytest.raises(ValueError, match="loss_scale"):
        policy_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), 0.0,
                    LossConfig(token_mean="micro_batch", micro_batch_tokens=8))


@pytest.mark.slow
def test_trainer_update_equals_verls_loss_on_a_model():
    """Trainer.train with the profile's options (token budget, 2 GPUs, configured rows): its loss
    and SGD step equal verl's formula on a direct forward of the same model, whatever our own
    micro-batches (micro_batch_size=4 here)."""
    import os
    import sys

    import optax
    from flax import nnx

    sys.path.insert(0, os.path.dirname(__file__))
    from test_trainer import leaves, random_batch, tiny_model
    from test_trainer_options import direct_logprobs

    from rstarjax.models import sharding as sharding_lib
    from rstarjax.rl import trainer as trainer_lib

    batch = random_batch(5)
    n = batch["tokens"].shape[0]
    seg = batch["segment_ids"]
    budget, gpus, configured = int(seg.sum()) // 3, 2, 4 * n
    lengths = seg.sum(axis=1)
    micro = gpu_blocks(n, gpus, lengths, budget)
    assert sum(len(b) for b in micro) > gpus  # several micro-batches per GPU

    graphdef, params, rest = nnx.split(tiny_model(), nnx.Param, ...)

    def verl(p):
        logp = direct_logprobs(nnx.merge(graphdef, p, rest), batch)
        arrays = tuple(jnp.asarray(batch[k])[:, 1:] for k in ("old_logprobs", "advantages", "loss_mask"))
        return verl_update_loss(jnp, micro, configured / gpus, (arrays[0], logp, arrays[1], arrays[2]))

    want_loss, grads = jax.jit(jax.value_and_grad(verl))(params)
    want_params = jax.tree.map(lambda p, g: p - g, params, grads)
    mesh = sharding_lib.make_mesh(1, 2, 1, devices=jax.devices()[:2])
    cfg = LossConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip_c=CLIP_C, token_mean="micro_batch",
                     micro_batch_rows="configured", micro_batch_tokens=budget, micro_batch_gpus=gpus)
    tr = trainer_lib.Trainer(tiny_model(), None, cfg, trainer_lib.TrainerConfig(micro_batch_size=4,
                             recompute_old_logprobs=False), mesh=mesh, optimizer=optax.sgd(1.0))
    m = tr.train(batch, denom=configured)
    assert m["train/loss"] == pytest.approx(float(want_loss), rel=1e-4, abs=1e-7)
    for got, want, g in zip(leaves(tr.state.params), leaves(want_params), leaves(grads)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * max(1.0, np.abs(g).max()))


def test_the_kl_penalty_is_verls_low_var_kl_with_its_cap():
    """kl_coef's per-token KL: verl's ``kl_penalty(..., "low_var_kl")`` (core_algos.py) restated in
    torch: the log-ratio clamped to +-20, k3 = exp(d) - d - 1 clamped to [-10, 10], and its
    gradient (none past the cap), on tokens from near the reference to far past it."""
    torch = pytest.importorskip("torch")
    from rstarjax.rl.loss import kl_k3

    logp = np.linspace(-30.0, -0.01, 41)
    ref = np.full_like(logp, -1.0)

    def verl_low_var_kl(lp, rf):
        d = torch.clamp(rf - lp, min=-20, max=20)
        return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)

    tl = torch.tensor(logp, requires_grad=True)
    want = verl_low_var_kl(tl, torch.tensor(ref))
    want.sum().backward()
    np.testing.assert_allclose(np.asarray(kl_k3(jnp.asarray(logp), jnp.asarray(ref))), want.detach().numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.grad(lambda x: jnp.sum(kl_k3(x, jnp.asarray(ref))))(jnp.asarray(logp))),
                               tl.grad.numpy(), rtol=1e-5, atol=1e-5)
    assert (want.detach().numpy() == 10).any() and (want.detach().numpy() < 10).any()

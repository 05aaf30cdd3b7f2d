"""Trainer: micro-batched and sharded updates against an independent full-batch reference."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from rstarjax.models import sharding as sharding_lib
from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.rl import optim as optim_lib
from rstarjax.rl import trainer as trainer_lib
from rstarjax.rl.loss import LossConfig

B, L, PROMPT = 8, 24, 6


def tiny_model(seed=0):
    # f32 compute so the comparisons are tight; one layer keeps the compiles short
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32, num_hidden_layers=1)
    return Qwen3(cfg, rngs=nnx.Rngs(seed))


def random_batch(seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(B, L)).astype(np.int32)
    lengths = rng.integers(PROMPT + 4, L + 1, size=B)
    col = np.arange(L)[None, :]
    valid = col < lengths[:, None]
    loss_mask = (valid & (col >= PROMPT)).astype(np.float32)
    loss_mask[:, PROMPT + 2] = 0.0  # a tool token in the middle of every response
    adv = np.where(rng.random(B) < 0.5, 1.0, -0.7)[:, None] * loss_mask
    # old log-probs away from the current policy so both clip branches are exercised
    old = (-6.2 + rng.normal(0, 0.4, size=(B, L))) * loss_mask
    return dict(
        tokens=tokens,
        positions=np.where(valid, col, 0).astype(np.int32),
        segment_ids=valid.astype(np.int32),
        loss_mask=loss_mask,
        old_logprobs=old.astype(np.float32),
        advantages=adv.astype(np.float32),
        rollout_logprobs=old.astype(np.float32),
    )


def reference_loss(model, batch, eps_low=0.2, eps_high=0.28):
    """rStar2-Agent eq. 6 transcribed directly over the whole batch (no micro-batching):
    -1/sum|o_i| sum_i sum_t min(r A, clip(r, 1-el, 1+eh) A), r = exp(logp - old)."""
    logits = model(jnp.asarray(batch["tokens"]), positions=jnp.asarray(batch["positions"]),
                   segment_ids=jnp.asarray(batch["segment_ids"]))
    logp_all = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    tgt = jnp.asarray(batch["tokens"])[:, 1:]
    logp = jnp.take_along_axis(logp_all, tgt[..., None], axis=-1)[..., 0]
    mask = jnp.asarray(batch["loss_mask"])[:, 1:]
    adv = jnp.asarray(batch["advantages"])[:, 1:]
    old = jnp.asarray(batch["old_logprobs"])[:, 1:]
    ratio = jnp.exp(logp - old)
    obj = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
    return -jnp.sum(obj * mask) / jnp.sum(mask)


def reference_sgd_params(batch, lr):
    model = tiny_model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grads = jax.grad(lambda p: reference_loss(nnx.merge(graphdef, p, rest), batch))(params)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), grads


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_micro_batched_sharded_step_equals_full_batch_reference():
    """4 micro-batches on an 8-device (fsdp=4, tensor=2) mesh == eq. 6's full-batch gradient."""
    batch = random_batch()
    lr = 1.0  # plain SGD makes the parameter change equal the gradient
    ref_params, ref_grads = reference_sgd_params(batch, lr)
    assert max(float(np.abs(g).max()) for g in leaves(ref_grads)) > 1e-4  # a real gradient

    mesh = sharding_lib.make_mesh(1, 4, 2)
    tr = trainer_lib.Trainer(tiny_model(), None, LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=4, recompute_old_logprobs=False),
                             mesh=mesh, optimizer=optax.sgd(lr))
    metrics = tr.train(batch)
    assert tr.step == 1
    for got, want, g in zip(leaves(tr.state.params), leaves(ref_params), leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * max(1.0, np.abs(g).max()))
    # metrics summed over micro-batches are whole-batch quantities
    assert metrics["train/token_frac"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["train/tokens"] == pytest.approx(batch["loss_mask"].sum())
    ref_loss = float(reference_loss(tiny_model(), batch))
    assert metrics["train/loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    assert metrics["train/clip_frac_low"] + metrics["train/clip_frac_high"] > 0


@pytest.mark.slow
def test_sharded_adamw_steps_equal_single_device():
    """Two AdamW updates with old-log-prob recompute: 8 devices (data=2, fsdp=2, tensor=2) give the
    parameters of a 1-device run."""
    batches = [random_batch(1), random_batch(2)]
    optim_cfg = optim_lib.OptimConfig(learning_rate=1e-3, warmup_steps=2)
    cfg = trainer_lib.TrainerConfig(micro_batch_size=4, recompute_old_logprobs=True)
    single = trainer_lib.Trainer(tiny_model(), optim_cfg, LossConfig(), cfg,
                                 mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    multi = trainer_lib.Trainer(tiny_model(), optim_cfg, LossConfig(), cfg,
                                mesh=sharding_lib.make_mesh(2, 2, 2))
    for b in batches:
        m1 = single.train(b)
        m8 = multi.train(b)
        assert m1["train/grad_norm"] == pytest.approx(m8["train/grad_norm"], rel=1e-4)
        assert m1["train/logprob_gap_abs"] == pytest.approx(m8["train/logprob_gap_abs"], rel=1e-4)
    assert single.step == multi.step == 2
    assert m8["train/lr"] == pytest.approx(1e-3)
    for a, b in zip(leaves(single.state.params), leaves(multi.state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)  # lr 1e-3: 2% of one update
    # sharded for real: some parameter is split over devices
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(multi.state.params))


def test_recompute_old_logprobs_matches_forward_and_gap_is_reported():
    batch = random_batch(3)
    tr = trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(), LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=2),
                             mesh=sharding_lib.make_mesh(1, 2, 1, devices=jax.devices()[:2]))
    g = tr.put_batch(batch)
    lp = np.asarray(tr.compute_logprobs(g))
    logits = tiny_model()(jnp.asarray(batch["tokens"]), positions=jnp.asarray(batch["positions"]),
                          segment_ids=jnp.asarray(batch["segment_ids"]))
    ref = torch.log_softmax(torch.tensor(np.asarray(logits[:, :-1])), -1).gather(
        -1, torch.tensor(batch["tokens"][:, 1:], dtype=torch.long)[..., None])[..., 0].numpy()
    np.testing.assert_allclose(lp[:, 1:], ref, rtol=1e-5, atol=1e-5)
    want = trainer_lib.logprob_gap(batch["rollout_logprobs"], lp, batch["loss_mask"])
    m = tr.train(batch)
    assert m["train/logprob_gap_abs"] == pytest.approx(want["logprob_gap_abs"], rel=1e-5)
    assert m["train/logprob_gap_kl"] == pytest.approx(want["logprob_gap_kl"], rel=1e-4)
    # recomputed old log-probs == current policy: the first update's ratio is exactly 1
    assert m["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["train/clip_frac_low"] == m["train/clip_frac_high"] == 0.0


def test_optimizer_matches_torch_adamw_with_clip_and_warmup():
    """optax chain == torch clip_grad_norm_ + AdamW + LambdaLR warmup, over 4 steps."""
    cfg = optim_lib.OptimConfig(learning_rate=1e-2, warmup_steps=3, weight_decay=0.01, grad_clip_norm=1.0)
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(5, 3)).astype(np.float32)
    grads = [rng.normal(scale=s, size=(5, 3)).astype(np.float32) for s in (3.0, 0.1, 2.0, 0.5)]

    opt = optim_lib.make_optimizer(cfg)
    w, state = jnp.asarray(w0), opt.init(jnp.asarray(w0))
    for g in grads:
        upd, state = opt.update(jnp.asarray(g), state, w)
        w = optax.apply_updates(w, upd)

    tw = torch.nn.Parameter(torch.tensor(w0))
    topt = torch.optim.AdamW([tw], lr=cfg.learning_rate, betas=(cfg.b1, cfg.b2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(topt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    for g in grads:
        tw.grad = torch.tensor(g)
        torch.nn.utils.clip_grad_norm_([tw], cfg.grad_clip_norm)
        topt.step()
        sched.step()
    np.testing.assert_allclose(np.asarray(w), tw.detach().numpy(), rtol=1e-5, atol=1e-7)


def test_bad_shapes_fail_clearly():
    tr = trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(), LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=3),
                             mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    with pytest.raises(ValueError, match="micro_batch_size"):
        tr.train(random_batch())
    bad = random_batch()
    bad["advantages"] = bad["advantages"][:, :-1]
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        tr.put_batch(bad)
    with pytest.raises(ValueError, match="mini_batches"):
        trainer_lib.TrainerConfig(mini_batches=0)

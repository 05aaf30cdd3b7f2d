"""The RL and SFT steps on the long-row forward (blockwise attention, vocabulary in chunks) give
the numbers of an independent full-logits, dense-attention reference: eq. 6 over the whole batch
(micro-batched and sharded here), the SFT token-mean NLL, and the old-log-prob recompute."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rstarjax.models import sharding as sharding_lib
from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.rl import sft as sft_lib
from rstarjax.rl import trainer as trainer_lib
from rstarjax.rl.loss import LossConfig, token_logprobs

B, L = 8, 40
# several vocabulary chunks and attention tiles per row, so every new code path runs
LONG_ROWS = dict(packed_attention="blockwise", attention_block_size=8, vocab_chunk_len=7)


def model(seed=0, **overrides):
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32, num_hidden_layers=1, **overrides)
    return Qwen3(cfg, rngs=nnx.Rngs(seed))


def packed_batch(seed=0, vocab=512):
    """Two sequences per row (positions restart, segment ids 1 and 2), padding at the end."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(B, L)).astype(np.int32)
    first = rng.integers(8, 20, size=B)
    second = rng.integers(8, L - 20, size=B)
    col = np.arange(L)[None, :]
    seg = np.where(col < first[:, None], 1, np.where(col < (first + second)[:, None], 2, 0))
    positions = np.where(seg == 1, col, np.where(seg == 2, col - first[:, None], 0))
    prompt = np.where(seg == 1, col < 4, col - first[:, None] < 4)
    loss_mask = ((seg > 0) & ~prompt).astype(np.float32)
    adv = np.where(rng.random(B) < 0.5, 1.0, -0.7)[:, None] * loss_mask
    old = (-6.2 + rng.normal(0, 0.4, size=(B, L))) * loss_mask
    return dict(tokens=tokens, positions=positions.astype(np.int32), segment_ids=seg.astype(np.int32),
                loss_mask=loss_mask, old_logprobs=old.astype(np.float32),
                advantages=adv.astype(np.float32), rollout_logprobs=old.astype(np.float32))


def reference_logprobs(m, batch):
    """Dense attention, full [B, L, V] logits, log-softmax: the forward before long-row support."""
    logits = m(jnp.asarray(batch["tokens"]), positions=jnp.asarray(batch["positions"]),
               segment_ids=jnp.asarray(batch["segment_ids"]))
    return token_logprobs(logits, jnp.asarray(batch["tokens"]))


def reference_eq6(m, batch, eps_low=0.2, eps_high=0.28):
    logp = reference_logprobs(m, batch)
    mask, adv = jnp.asarray(batch["loss_mask"]), jnp.asarray(batch["advantages"])
    ratio = jnp.exp(logp - jnp.asarray(batch["old_logprobs"]))
    obj = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
    return -jnp.sum(obj * mask) / jnp.sum(mask)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_rl_step_on_long_row_forward_equals_full_batch_dense_reference():
    """4 micro-batches on an 8-device (fsdp=4, tensor=2) mesh, plain SGD: the parameter change
    is eq. 6's full-batch gradient through dense attention and full logits."""
    batch = packed_batch()
    lr = 1.0
    dense = model(packed_attention="dense")
    graphdef, params, rest = nnx.split(dense, nnx.Param, ...)
    tr = trainer_lib.Trainer(model(**LONG_ROWS), None, LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=4, recompute_old_logprobs=True),
                             mesh=sharding_lib.make_mesh(1, 4, 2), optimizer=optax.sgd(lr))
    recomputed = tr.compute_logprobs(tr.put_batch(batch))
    np.testing.assert_allclose(np.asarray(recomputed) * batch["loss_mask"],
                               np.asarray(reference_logprobs(dense, batch)) * batch["loss_mask"],
                               atol=2e-5)
    batch["old_logprobs"] = np.asarray(reference_logprobs(dense, batch))  # what train() recomputes
    grads = jax.grad(lambda p: reference_eq6(nnx.merge(graphdef, p, rest), batch))(params)
    want = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    metrics = tr.train(batch)
    assert max(float(np.abs(g).max()) for g in leaves(grads)) > 1e-4
    for got, ref, g in zip(leaves(tr.state.params), leaves(want), leaves(grads)):
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5 * max(1.0, np.abs(g).max()))
    assert metrics["train/token_frac"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["train/loss"] == pytest.approx(float(reference_eq6(dense, batch)), rel=1e-4, abs=1e-6)


def test_sft_step_on_long_row_forward_equals_dense_full_logits_nll():
    batch = packed_batch(1)
    arrays = {k: jnp.asarray(batch[k]) for k in sft_lib.SFT_KEYS}
    dense = model(packed_attention="dense")
    graphdef, params, rest = nnx.split(dense, nnx.Param, ...)

    def nll(p):
        logp = reference_logprobs(nnx.merge(graphdef, p, rest), batch)
        return -jnp.sum(logp * arrays["loss_mask"]) / jnp.sum(arrays["loss_mask"])

    want_loss, want_grads = jax.value_and_grad(nll)(params)
    long_graphdef, long_params, long_rest = nnx.split(model(**LONG_ROWS), nnx.Param, ...)
    step = sft_lib.make_sft_step(long_graphdef, long_rest, optax.sgd(1.0), num_micro=2)
    state = trainer_lib.TrainState(long_params, optax.sgd(1.0).init(long_params), jnp.int32(0))
    new_state, metrics = jax.jit(step)(state, arrays)
    assert float(metrics["loss"]) == pytest.approx(float(want_loss), rel=1e-5)
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.global_norm(want_grads)), rel=1e-4)
    for got, p, g in zip(leaves(new_state.params), leaves(params), leaves(want_grads)):
        np.testing.assert_allclose(got, p - g, rtol=1e-4, atol=1e-5)

"""Chunked-vocabulary token log-probs and entropies (models/logprobs.py) against the full-logits
reference (rl.loss.token_logprobs_and_entropy, itself checked against torch in test_loss.py):
values and gradients (entropy term included), tied and untied output projections, one and several
chunks; memory that does not grow with the row beyond one chunk; the model's token_logprobs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.models import ModelConfig, Qwen3
from rstarjax.models.logprobs import token_logprobs_from_hidden
from rstarjax.rl.loss import token_logprobs_and_entropy


def _objective(lp, ent, weights):
    return jnp.sum(lp * weights) + 0.3 * jnp.sum(ent * weights)


@pytest.mark.parametrize("vocab_major", [False, True])
@pytest.mark.parametrize("chunk_len", [4, 10, 64])  # several chunks with padding, exact, one
def test_chunked_equals_full_logits_values_and_grads(vocab_major, chunk_len):
    rng = np.random.default_rng(8)
    b, l, d, v = 2, 11, 5, 17
    hidden = jnp.asarray(rng.normal(size=(b, l, d)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(v, d) if vocab_major else (d, v)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, v, (b, l)))
    weights = jnp.asarray(rng.normal(size=(b, l)).astype(np.float32))

    def full(hidden, w):
        lp, ent = token_logprobs_and_entropy(hidden @ (w.T if vocab_major else w), tokens)
        return _objective(lp, ent, weights), (lp, ent)

    def chunked(hidden, w):
        lp, ent = token_logprobs_from_hidden(hidden, w, tokens, vocab_major=vocab_major,
                                             chunk_len=chunk_len)
        return _objective(lp, ent, weights), (lp, ent)

    (vf, (lpf, entf)), gf = jax.value_and_grad(full, argnums=(0, 1), has_aux=True)(hidden, w)
    (vc, (lpc, entc)), gc = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True))(
        hidden, w)
    np.testing.assert_allclose(lpc, lpf, atol=1e-5)
    np.testing.assert_allclose(entc, entf, atol=1e-5)
    assert float(jnp.abs(entf).max()) > 0.1 and not np.any(np.asarray(lpc[:, 0]))
    for a, c in zip(gf, gc):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-4, atol=1e-5)
    lp_only, none = token_logprobs_from_hidden(hidden, w, tokens, vocab_major=vocab_major,
                                               chunk_len=chunk_len, with_entropy=False)
    assert none is None
    np.testing.assert_allclose(lp_only, lpf, atol=1e-5)


def test_chunked_memory_does_not_grow_with_the_row_past_one_chunk():
    """XLA's memory analysis of the gradient: full logits grow with L, the chunked path holds
    one chunk's logits whatever L."""
    d, v = 32, 8192

    def temp(fn, l):
        h = jax.ShapeDtypeStruct((1, l, d), jnp.float32)
        w = jax.ShapeDtypeStruct((d, v), jnp.float32)
        tok = jax.ShapeDtypeStruct((1, l), jnp.int32)

        def loss(h, w, tok):
            lp, ent = fn(h, w, tok)
            return jnp.sum(lp) + jnp.sum(ent)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return grad.lower(h, w, tok).compile().memory_analysis().temp_size_in_bytes

    full = lambda h, w, tok: token_logprobs_and_entropy(h @ w, tok)
    chunked = lambda h, w, tok: token_logprobs_from_hidden(h, w, tok, vocab_major=False,
                                                           chunk_len=256)
    full_8k = temp(full, 8192)
    assert full_8k > 8192 * v * 4  # the reference holds [L, V] float32 logits (and more)
    small, large = temp(chunked, 2048), temp(chunked, 8192)
    assert large < 1.2 * small  # only the small [L, D]-sized terms grow
    assert large < full_8k / 10


@pytest.mark.parametrize("tied", [True, False])
def test_model_token_logprobs_equal_log_softmax_of_logits(tied):
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32, tie_word_embeddings=tied, vocab_chunk_len=7,
                             num_hidden_layers=1)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (2, 30)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 18 + [2] * 8 + [0] * 4], 2, 0), jnp.int32)
    weights = jnp.asarray(rng.randn(2, 30), jnp.float32)

    def ours(state):
        lp, ent = nnx.merge(graphdef, state).token_logprobs(tokens, segment_ids=seg)
        return _objective(lp, ent, weights), (lp, ent)

    def reference(state):
        logits = nnx.merge(graphdef, state)(tokens, segment_ids=seg)
        lp, ent = token_logprobs_and_entropy(logits, tokens)
        return _objective(lp, ent, weights), (lp, ent)

    (_, (lp, ent)), g = jax.jit(jax.value_and_grad(ours, has_aux=True))(state)
    (_, (lpr, entr)), gr = jax.jit(jax.value_and_grad(reference, has_aux=True))(state)
    np.testing.assert_allclose(lp, lpr, atol=1e-5)
    np.testing.assert_allclose(ent, entr, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gr)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    assert float(jnp.abs(g["embed"][...]).max()) > 0  # tied: output gradient reaches the embedding
    h = nnx.merge(graphdef, state).hidden(tokens, segment_ids=seg)
    w, vocab_major = model.output_projection()
    assert vocab_major == tied and h.shape == (2, 30, cfg.hidden_size)


def test_bf16_model_token_logprobs_close_to_its_logits():
    cfg = ModelConfig.preset("tiny", dtype=jnp.bfloat16, vocab_chunk_len=8)
    model = Qwen3(cfg, rngs=nnx.Rngs(1))
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 512, (2, 20)), jnp.int32)
    lp, ent = jax.jit(lambda t: model.token_logprobs(t))(tokens)
    lpr, entr = token_logprobs_and_entropy(jax.jit(model)(tokens), tokens)
    assert lp.dtype == jnp.float32
    np.testing.assert_allclose(lp, lpr, atol=1e-3)
    np.testing.assert_allclose(ent, entr, atol=1e-3)

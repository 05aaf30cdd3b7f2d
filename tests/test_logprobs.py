"""Chunked-vocabulary token log-probs and entropies (models/logprobs.py) against the full-logits
reference (models.logprobs.token_logprobs_and_entropy, itself checked against torch in test_loss.py):
values and gradients (entropy term included), tied and untied output projections, one and several
chunks; memory that does not grow with the row beyond one chunk; the model's token_logprobs;
the projection's backward in the compute dtype (bf16 operands, float32 accumulation)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.models import ModelConfig, Qwen3, logprobs
from rstarjax.models.logprobs import token_logprobs_and_entropy, token_logprobs_from_hidden
from rstarjax.models.sharding import make_mesh


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


@pytest.mark.parametrize("chunk_len", [4, 64])
def test_tempered_logprobs_and_entropy_equal_torch_at_the_temperature(chunk_len):
    """temperature=T: log_softmax(logits / T) at the targets and the entropy of softmax(logits / T),
    against torch's (float64); T=1 is bit-identical to the untempered call."""
    import torch

    rng = np.random.default_rng(9)
    b, l, d, v = 2, 9, 5, 13
    hidden = jnp.asarray(rng.normal(size=(b, l, d)).astype(np.float32) * 2)
    w = jnp.asarray(rng.normal(size=(d, v)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, v, (b, l)))
    lp, ent = token_logprobs_from_hidden(hidden, w, tokens, vocab_major=False, chunk_len=chunk_len,
                                         temperature=0.6)
    logits = torch.tensor(np.asarray(hidden, np.float64)) @ torch.tensor(np.asarray(w, np.float64))
    logp = torch.log_softmax(logits[:, :-1] / 0.6, -1)
    want_lp = logp.gather(-1, torch.tensor(np.asarray(tokens[:, 1:]), dtype=torch.long)[..., None])[..., 0]
    want_ent = -(logp.exp() * logp).sum(-1)
    np.testing.assert_allclose(np.asarray(lp)[:, 1:], want_lp.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent)[:, 1:], want_ent.numpy(), atol=1e-4)  # f32, logits ~20
    plain = token_logprobs_from_hidden(hidden, w, tokens, vocab_major=False, chunk_len=chunk_len)
    at_one = token_logprobs_from_hidden(hidden, w, tokens, vocab_major=False, chunk_len=chunk_len,
                                        temperature=1.0)
    assert all(np.array_equal(x, y) for x, y in zip(plain, at_one))
    assert np.abs(np.asarray(plain[0]) - np.asarray(lp)).max() > 1e-2
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_from_hidden(hidden, w, tokens, vocab_major=False, temperature=0.0)


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


# ---- the projection's backward in the compute dtype -----------------------------------------

def _weighted_grads(hidden, w, tokens, weights, vocab_major, chunk_len):
    """jit'd (d_hidden, d_w) of the log-prob + entropy objective through the chunked path."""
    def loss(hidden, w):
        lp, ent = token_logprobs_from_hidden(hidden, w, tokens, vocab_major=vocab_major,
                                             chunk_len=chunk_len)
        return _objective(lp, ent, weights)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(hidden, w)


def _bf16_rounded_inputs(seed, vocab_major, b=2, l=96, d=64, v=1024):
    """float32 hidden states that bf16 represents exactly (so a bf16 run and its float32
    reference start from the same numbers), a float32 weight of either layout, tokens, weights."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(b, l, d)), jnp.bfloat16).astype(jnp.float32)
    w = jnp.asarray(rng.normal(size=(v, d) if vocab_major else (d, v)) / np.sqrt(d), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, (b, l)))
    weights = jnp.asarray(rng.normal(size=(b, l)), jnp.float32)
    return hidden, w, tokens, weights


def _relative_error(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


_DOT_OPERANDS = re.compile(r"stablehlo\.dot_general .*: \(tensor<([^>]*)>, tensor<([^>]*)>\)")


def _dot_operand_dtypes(stablehlo_text):
    """(lhs, rhs) element types ('bf16', 'f32', ...) of every dot_general in a lowered module."""
    return [(lhs.split("x")[-1], rhs.split("x")[-1])
            for lhs, rhs in _DOT_OPERANDS.findall(stablehlo_text)]


@pytest.mark.parametrize("vocab_major", [False, True])
@pytest.mark.parametrize("chunk_len", [4, 64])  # several chunks (lax.map + checkpoint), one
def test_bf16_projection_backward_dots_take_bf16_operands(vocab_major, chunk_len):
    """Every matmul of the gradient, the two backward ones included, multiplies bf16 by bf16:
    with JAX's own transpose the float32 logits' cotangent made them float32 x float32
    (TF32 GEMMs on the GPU, ~36 ms of a 340 ms Qwen3-1.7B step)."""
    b, l, d, v = 2, 11, 8, 32
    hidden = jax.ShapeDtypeStruct((b, l, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((v, d) if vocab_major else (d, v), jnp.float32)  # f32 master weight
    tokens = jax.ShapeDtypeStruct((b, l), jnp.int32)

    def loss(hidden, w, tokens):
        lp, ent = token_logprobs_from_hidden(hidden, w, tokens, vocab_major=vocab_major,
                                             chunk_len=chunk_len)
        return jnp.sum(lp) + jnp.sum(ent)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, w, tokens).as_text()
    dots = _dot_operand_dtypes(text)
    assert len(dots) >= 3, text  # the forward and both backward matmuls were found
    assert all(pair == ("bf16", "bf16") for pair in dots), dots


@pytest.mark.parametrize("vocab_major", [False, True])
@pytest.mark.parametrize("chunk_len", [32, 128])  # several chunks, one
def test_bf16_projection_grads_close_to_float32_reference(vocab_major, chunk_len):
    """bf16 hidden states, float32 master weight: the gradients are those of the all-float32
    computation to bf16 accuracy (measured ~3e-3 for d_hidden, ~2e-3 for d_w; JAX's own
    float32 transpose gave ~2.4e-3 and ~1.7e-3), and d_w reaches the master weight in float32."""
    hidden, w, tokens, weights = _bf16_rounded_inputs(3, vocab_major)
    want = _weighted_grads(hidden, w, tokens, weights, vocab_major, chunk_len)
    got = _weighted_grads(hidden.astype(jnp.bfloat16), w, tokens, weights, vocab_major, chunk_len)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    for g, r in zip(got, want):
        assert _relative_error(g, r) < 1e-2


@pytest.mark.parametrize("vocab_major", [False, True])
def test_float32_projection_grads_identical_to_plain_einsum(vocab_major):
    """Float32 hidden states take no shortcut: the chunked gradients are bit for bit those of
    the same chunked computation with the plain einsum projection (its JAX transpose)."""
    hidden, w, tokens, weights = _bf16_rounded_inputs(4, vocab_major, l=40, v=96)
    hidden = hidden + 1e-3  # no longer bf16-representable: a full float32 input
    got = _weighted_grads(hidden, w, tokens, weights, vocab_major, 16)

    def plain_project(h, unembed, vocab_major):
        eq = "bcd,vd->bcv" if vocab_major else "bcd,dv->bcv"
        return jnp.einsum(eq, h, unembed, preferred_element_type=jnp.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logprobs, "_project", plain_project)
        want = _weighted_grads(hidden, w, tokens, weights, vocab_major, 16)
    for g, r in zip(got, want):
        assert g.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


@pytest.mark.parametrize("vocab_major", [False, True])
def test_custom_backward_equations_match_autodiff(vocab_major):
    """The hand-written transposes (both layouts) are JAX's, checked with float32 operands where
    no rounding hides a wrong equation; gradients come back in the primal dtypes."""
    hidden, w, _, _ = _bf16_rounded_inputs(5, vocab_major, l=12, v=40)
    cot = jnp.asarray(np.random.default_rng(6).normal(size=(2, 12, 40)), jnp.float32)
    eq = "bcd,vd->bcv" if vocab_major else "bcd,dv->bcv"
    plain = lambda h, w: jnp.einsum(eq, h, w, preferred_element_type=jnp.float32)
    custom = lambda h, w: logprobs._project_with_compute_dtype_backward(h, w, vocab_major)
    want_out, want_vjp = jax.vjp(plain, hidden, w)
    got_out, got_vjp = jax.vjp(custom, hidden, w)
    np.testing.assert_array_equal(got_out, want_out)
    for g, r in zip(got_vjp(cot), want_vjp(cot)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)  # summation order only
    _, vjp_bf16 = jax.vjp(custom, hidden.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert [g.dtype for g in vjp_bf16(cot)] == [jnp.bfloat16, jnp.bfloat16]


@pytest.mark.parametrize("vocab_major", [False, True])
def test_bf16_projection_grads_under_a_mesh_equal_unsharded(vocab_major):
    """With the activation sharding constraints active (vocabulary over 'tensor', batch over
    data x fsdp) the custom backward gives the unsharded gradients."""
    hidden, w, tokens, weights = _bf16_rounded_inputs(7, vocab_major, b=4, l=40, v=256)
    hidden = hidden.astype(jnp.bfloat16)
    want = _weighted_grads(hidden, w, tokens, weights, vocab_major, 16)
    with jax.set_mesh(make_mesh(data=2, fsdp=2, tensor=2)):
        got = _weighted_grads(hidden, w, tokens, weights, vocab_major, 16)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=2e-3)

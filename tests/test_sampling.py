"""Sampling against outside references: HF transformers' logits warpers (PyTorch) and NumPy."""
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import jax
import jax.numpy as jnp

from rstarjax.serving.sampling import SamplingParams, filter_logits, sample_tokens


def _hf_filter(row: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    scores = torch.tensor(row[None], dtype=torch.float32)
    ids = torch.zeros((1, 1), dtype=torch.long)
    if temperature > 0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores[0].numpy()


SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 5, 1.0),
    (1.3, 0, 0.9),
    (0.5, 20, 0.6),
    (1.0, 1, 1.0),
    (2.0, 0, 0.3),
]


def test_filter_matches_hf_warpers_per_row():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(len(SETTINGS), 97)).astype(np.float32) * 3
    t = jnp.array([s[0] for s in SETTINGS], jnp.float32)
    k = jnp.array([s[1] for s in SETTINGS], jnp.int32)
    p = jnp.array([s[2] for s in SETTINGS], jnp.float32)
    ours = np.asarray(filter_logits(jnp.asarray(logits), t, k, p))
    for b, (tb, kb, pb) in enumerate(SETTINGS):
        ref = _hf_filter(logits[b], tb, kb, pb)
        np.testing.assert_array_equal(np.isfinite(ours[b]), np.isfinite(ref), err_msg=f"row {b}")
        kept = np.isfinite(ref)
        np.testing.assert_allclose(ours[b][kept], ref[kept], rtol=1e-6)


def _np_log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_greedy_rows_take_argmax_and_report_policy_logprob():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 50)).astype(np.float32)
    zeros = jnp.zeros(4, jnp.int32)
    tokens, logprobs = sample_tokens(
        jnp.asarray(logits), zeros, zeros, jnp.zeros(4), zeros, jnp.ones(4)
    )
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
    ref = _np_log_softmax(logits)[np.arange(4), logits.argmax(-1)]
    np.testing.assert_allclose(np.asarray(logprobs), ref, atol=1e-5)


def _draw_many(logits_row, n, t, k, p, seed=3):
    """n draws of one request: counters 0..n-1 (what the engine does token after token)."""
    logits = jnp.broadcast_to(jnp.asarray(logits_row), (n, logits_row.shape[0]))
    ones = jnp.ones(n)
    tokens, logprobs = jax.jit(sample_tokens)(
        logits,
        jnp.full(n, seed, jnp.int32),
        jnp.arange(n, dtype=jnp.int32),
        ones * t,
        jnp.full(n, k, jnp.int32),
        ones * p,
    )
    return np.asarray(tokens), np.asarray(logprobs)


def test_sample_frequencies_follow_filtered_distribution():
    rng = np.random.default_rng(2)
    row = rng.normal(size=(12,)).astype(np.float32) * 1.5
    t, k, p = 0.8, 6, 0.85
    ref_logits = _hf_filter(row, t, k, p)
    ref = np.exp(_np_log_softmax(np.where(np.isfinite(ref_logits), ref_logits, -1e30)))
    n = 20000
    tokens, logprobs = _draw_many(row, n, t, k, p)
    assert np.all(np.isfinite(ref_logits)[tokens]), "drew a token the filters removed"
    freq = np.bincount(tokens, minlength=12) / n
    # 5 standard errors per cell.
    tol = 5 * np.sqrt(ref * (1 - ref) / n) + 1e-9
    assert np.all(np.abs(freq - ref) <= tol), (freq, ref)
    # the log-prob of the distribution the token came from: the logits at the temperature,
    # before top-k / top-p (what the trainer recomputes; verl leaves the filters out too)
    np.testing.assert_allclose(logprobs, _np_log_softmax(row / t)[tokens], atol=1e-5)


def test_logprobs_are_of_the_tempered_distribution_and_exact_at_temperature_one():
    """Per row: log_softmax(logits / T) at T > 0, the raw logits' for greedy rows (T = 0);
    at T = 1 bit-identical to the untempered log-softmax (the paper's setting changes nothing)."""
    rng = np.random.default_rng(6)
    logits = (rng.normal(size=(4, 40)) * 3).astype(np.float32)
    temperature = np.array([0.7, 1.0, 0.0, 1.6], np.float32)
    forced = jnp.array([3, 9, -1, 21], jnp.int32)
    tokens, logprobs = sample_tokens(
        jnp.asarray(logits), jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32),
        jnp.asarray(temperature), jnp.zeros(4, jnp.int32), jnp.ones(4), forced=forced)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    scale = np.where(temperature > 0, temperature, 1.0)[:, None].astype(np.float64)
    want = _np_log_softmax(logits.astype(np.float64) / scale)[np.arange(4), tokens]
    np.testing.assert_allclose(logprobs, want, atol=1e-5)
    assert tokens[2] == logits[2].argmax()
    untempered = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))[np.arange(4), tokens]
    assert logprobs[1] == untempered[1] and logprobs[2] == untempered[2]
    assert abs(logprobs[0] - untempered[0]) > 1e-3  # the test can tell the two apart


def test_draws_depend_only_on_seed_and_counter_not_on_batch_position():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 64)).astype(np.float32)
    ones = jnp.ones(3)
    args = dict(temperature=ones, top_k=jnp.zeros(3, jnp.int32), top_p=ones)
    seeds = jnp.array([11, 12, 13], jnp.int32)
    counters = jnp.array([5, 0, 7], jnp.int32)
    a, _ = sample_tokens(jnp.asarray(logits), seeds, counters, **args)
    perm = np.array([2, 0, 1])
    b, _ = sample_tokens(jnp.asarray(logits[perm]), seeds[perm], counters[perm], **args)
    np.testing.assert_array_equal(np.asarray(a)[perm], np.asarray(b))
    # Different counters of the same seed give different streams (not one repeated token).
    toks, _ = _draw_many(np.zeros(64, np.float32), 200, 1.0, 0, 1.0, seed=11)
    assert len(set(toks.tolist())) > 50


def test_forced_tokens_override_draw_but_keep_policy_logprob():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(2, 30)).astype(np.float32)
    ones = jnp.ones(2)
    forced = jnp.array([7, -1], jnp.int32)
    tokens, logprobs = sample_tokens(
        jnp.asarray(logits), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32),
        jnp.zeros(2), jnp.zeros(2, jnp.int32), ones, forced=forced,
    )
    assert int(tokens[0]) == 7 and int(tokens[1]) == int(logits[1].argmax())
    np.testing.assert_allclose(
        np.asarray(logprobs), _np_log_softmax(logits)[[0, 1], [7, logits[1].argmax()]], atol=1e-5
    )


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
               dict(max_new_tokens=0), dict(temperature=float("nan"))]
)
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_vocab_limit_never_samples_padding_ids_but_keeps_policy_logprob():
    # Padding rows past the tokenizer get the largest logits: without the limit they would win
    # greedy and dominate sampling; with it they are never drawn, and the reported log-prob is
    # still the full-vocabulary log-softmax the trainer recomputes.
    vocab, limit, rows = 16, 12, 256
    logits = jnp.tile(jnp.arange(vocab, dtype=jnp.float32)[None] * 0.3, (rows, 1))
    temperature = jnp.where(jnp.arange(rows) % 2 == 0, 1.0, 0.0)
    tokens, logprobs = sample_tokens(
        logits, jnp.arange(rows, dtype=jnp.int32), jnp.zeros(rows, jnp.int32), temperature,
        jnp.zeros(rows, jnp.int32), jnp.ones(rows, jnp.float32), vocab_limit=limit)
    tokens = np.asarray(tokens)
    assert tokens.max() < limit
    assert np.all(tokens[1::2] == limit - 1)  # greedy picks the best allowed id
    full = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(np.asarray(logprobs), full[np.arange(rows), tokens], atol=1e-6)
    unlimited, _ = sample_tokens(
        logits, jnp.arange(rows, dtype=jnp.int32), jnp.zeros(rows, jnp.int32), temperature,
        jnp.zeros(rows, jnp.int32), jnp.ones(rows, jnp.float32))
    assert np.asarray(unlimited).max() >= limit  # the test would catch a missing limit

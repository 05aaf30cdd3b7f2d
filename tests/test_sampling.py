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


def _filter_as_hf(logits: np.ndarray, settings) -> np.ndarray:
    """``filter_logits`` of each row at its (temperature, top_k, top_p), checked against HF's
    warpers row by row: the same tokens kept, at the same tempered values."""
    t = jnp.array([s[0] for s in settings], jnp.float32)
    k = jnp.array([s[1] for s in settings], jnp.int32)
    p = jnp.array([s[2] for s in settings], jnp.float32)
    ours = np.asarray(filter_logits(jnp.asarray(logits), t, k, p))
    for b, (tb, kb, pb) in enumerate(settings):
        ref = _hf_filter(logits[b], tb, kb, pb)
        np.testing.assert_array_equal(np.isfinite(ours[b]), np.isfinite(ref), err_msg=f"row {b}")
        kept = np.isfinite(ref)
        np.testing.assert_allclose(ours[b][kept], ref[kept], rtol=1e-6)
    return ours


def test_filter_matches_hf_warpers_per_row():
    rng = np.random.default_rng(0)
    _filter_as_hf(rng.normal(size=(len(SETTINGS), 97)).astype(np.float32) * 3, SETTINGS)


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


# ---- the fused sampler (serving sampler "fused"): one chunked pass, logits of any dtype ------

from rstarjax.models.logprobs import logprobs_and_entropy_of_logits  # noqa: E402
from rstarjax.serving.sampling import clamp_logprob, sample_tokens_fused  # noqa: E402


def _fused(logits, temperature, *, seeds=None, counters=None, top_k=None, top_p=None, chunk=16,
           **kw):
    b = logits.shape[0]
    fused = jax.jit(sample_tokens_fused, static_argnames=("chunk", "vocab_limit"))  # one compile
    return fused(
        jnp.asarray(logits), jnp.arange(b, dtype=jnp.int32) if seeds is None else seeds,
        jnp.zeros(b, jnp.int32) if counters is None else counters, jnp.asarray(temperature),
        jnp.zeros(b, jnp.int32) if top_k is None else top_k,
        jnp.ones(b, jnp.float32) if top_p is None else top_p, chunk=chunk, **kw)


def test_fused_sampler_logprobs_equal_the_trainers_float32_ones():
    """The log-prob the fused sampler returns, from float32 logits, is the trainer's
    (``logprobs_and_entropy_of_logits`` on float32 logits / T) to float noise, over several
    vocabulary chunks (one partial); from bf16 logits it is the float32 log-softmax of those
    bf16 values (nothing rounded further), and the trainer's within the bf16 alarm."""
    from rstarjax.rl.metrics import logprob_gap_threshold

    rng = np.random.default_rng(11)
    logits = (rng.normal(size=(6, 40)) * 4).astype(np.float32)
    temperature = np.array([1.0, 0.7, 0.0, 1.6, 1.0, 0.0], np.float32)
    scale = np.where(temperature > 0, temperature, 1.0)[:, None]
    tokens, lp = _fused(logits, temperature)
    trainer, _ = logprobs_and_entropy_of_logits(jnp.asarray(logits / scale), tokens)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(trainer), atol=2e-6)
    assert np.all(np.asarray(tokens)[temperature == 0] == logits[temperature == 0].argmax(-1))

    bf16 = jnp.asarray(logits, jnp.bfloat16)
    tokens, lp = _fused(bf16, temperature)
    rounded = np.asarray(bf16.astype(jnp.float32))
    want = _np_log_softmax(rounded / scale)[np.arange(6), np.asarray(tokens)]
    np.testing.assert_allclose(np.asarray(lp), want, atol=2e-6)
    trainer, _ = logprobs_and_entropy_of_logits(jnp.asarray(logits / scale), tokens)
    gap = np.abs(np.asarray(lp) - np.asarray(trainer)).max()
    assert 0 < gap < 0.1 * logprob_gap_threshold(jnp.bfloat16)


def test_fused_sampler_draws_from_the_tempered_policy():
    """4,000 draws (one key each) of one row over 3 chunks: frequencies within a 5-sigma band
    of softmax(logits / T); the exact sampler's draws for the same keys differ (so the switch)."""
    rows, temperature = 4000, 1.3
    logits = np.tile(np.linspace(-2.0, 2.0, 12, dtype=np.float32)[None], (rows, 1))
    counters = jnp.arange(rows, dtype=jnp.int32)
    tokens, _ = _fused(logits, np.full(rows, temperature, np.float32),
                       seeds=jnp.full(rows, 3, jnp.int32), counters=counters, chunk=5)
    probs = np.exp(_np_log_softmax(logits[0] / temperature))
    freq = np.bincount(np.asarray(tokens), minlength=12) / rows
    assert np.all(np.abs(freq - probs) < 5 * np.sqrt(probs * (1 - probs) / rows) + 1e-3), (freq, probs)
    exact, _ = sample_tokens(jnp.asarray(logits), jnp.full(rows, 3, jnp.int32), counters,
                             jnp.full(rows, temperature), jnp.zeros(rows, jnp.int32), jnp.ones(rows))
    assert np.mean(np.asarray(exact) != np.asarray(tokens)) > 0.3


def test_fused_sampler_is_reproducible_per_request_not_per_batch_position():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 64)).astype(np.float32)
    seeds, counters = jnp.array([11, 12, 13], jnp.int32), jnp.array([5, 0, 7], jnp.int32)
    a, _ = _fused(logits, np.ones(3, np.float32), seeds=seeds, counters=counters)
    perm = np.array([2, 0, 1])
    b, _ = _fused(logits[perm], np.ones(3, np.float32), seeds=seeds[perm], counters=counters[perm])
    np.testing.assert_array_equal(np.asarray(a)[perm], np.asarray(b))


def test_fused_sampler_greedy_limits_forced_and_filters():
    """Greedy takes the first maximum across chunks; ids >= vocab_limit are never chosen but
    the log-prob stays the full vocabulary's; forced tokens keep the policy's log-prob; a
    top-k / top-p row draws exactly what ``sample_tokens`` draws, an unfiltered row beside it
    its own fused draw."""
    vocab, limit = 16, 12
    logits = np.tile(np.arange(vocab, dtype=np.float32)[None] * 0.3, (4, 1))
    logits[2, 3] = logits[2, 9] = 10.0  # a tie across chunks: the first one wins
    temperature = np.array([1.0, 0.0, 0.0, 1.0], np.float32)
    forced = jnp.array([-1, -1, -1, 5], jnp.int32)
    tokens, lp = _fused(logits, temperature, vocab_limit=limit, forced=forced, chunk=5)
    tokens = np.asarray(tokens)
    assert tokens[0] < limit and tokens[1] == limit - 1 and tokens[2] == 3 and tokens[3] == 5
    full = _np_log_softmax(logits)
    np.testing.assert_allclose(np.asarray(lp), full[np.arange(4), tokens], atol=1e-6)

    rng = np.random.default_rng(9)
    logits = (rng.normal(size=(len(SETTINGS), 97)) * 3).astype(np.float32)
    t = jnp.array([s[0] for s in SETTINGS], jnp.float32)
    k = jnp.array([s[1] for s in SETTINGS], jnp.int32)
    p = jnp.array([s[2] for s in SETTINGS], jnp.float32)
    seeds, counters = jnp.arange(len(SETTINGS), dtype=jnp.int32), jnp.zeros(len(SETTINGS), jnp.int32)
    got, lp = _fused(logits, t, seeds=seeds, counters=counters, top_k=k, top_p=p, chunk=32)
    want, want_lp = sample_tokens(jnp.asarray(logits), seeds, counters, t, k, p)
    unfiltered = np.asarray((k == 0) & (p >= 1.0))
    alone, _ = _fused(logits, t, seeds=seeds, counters=counters, chunk=32)  # no row filters
    want = np.where(unfiltered, np.asarray(alone), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_allclose(np.asarray(lp), _np_log_softmax(logits / np.asarray(t)[:, None])[
        np.arange(len(SETTINGS)), want], atol=2e-6)
    assert unfiltered.any() and not unfiltered.all()  # both kinds of row are checked


def test_fused_sampler_row_draws_do_not_depend_on_the_other_rows_settings():
    """A request's tokens are its own (seed, counter, logits, settings): an unfiltered row draws
    the same token whether or not another row of its batch uses top-k / top-p (the whole batch
    used to take the exact path then, with other noise: a different token for nearly every seed)."""
    rng = np.random.default_rng(0)
    row = rng.normal(size=(1, 200)).astype(np.float32)
    seeds = jnp.arange(40, dtype=jnp.int32)
    ones = np.ones(40, np.float32)
    alone, _ = _fused(np.repeat(row, 40, 0), ones, seeds=seeds, chunk=64)
    # each request beside a top-k 5 row (seed 99), in one batch of 80
    batch = np.repeat(row, 80, 0)
    mixed, _ = _fused(batch, np.ones(80, np.float32), seeds=jnp.concatenate([seeds, jnp.full(40, 99, jnp.int32)]),
                      top_k=jnp.array([0] * 40 + [5] * 40, jnp.int32), chunk=64)
    np.testing.assert_array_equal(np.asarray(mixed)[:40], np.asarray(alone))


def test_an_unfiltered_row_keeps_its_tail_when_another_row_filters():
    """The exact sampler runs ``filter_logits`` on every row once one row filters: a row at
    top_p 1 keeps every token, even where the float32 cumulative mass reaches 1.0 before its
    tail (a confident row: the others' mass is below float32's resolution of 1)."""
    logits = np.zeros((2, 8), np.float32)
    logits[:, 0] = 30.0  # p(others) ~ 1e-13 each
    out = filter_logits(jnp.asarray(logits), jnp.ones(2), jnp.array([0, 2], jnp.int32), jnp.ones(2))
    np.testing.assert_array_equal(np.asarray(out)[0], logits[0])  # nothing cut
    assert np.isfinite(np.asarray(out)[1]).sum() == 8  # top-k 2 over a 7-way tie keeps the tie (HF)


def test_fused_sampler_logprob_after_an_all_masked_chunk():
    """A vocabulary chunk whose logits are all -inf (masked ids) leaves the running log-sum-exp
    at its start: the log-prob is the log-softmax's, not exp(-inf - -inf) = NaN."""
    row = (np.random.default_rng(0).standard_normal(50) * 2).astype(np.float32)
    row[:16] = -np.inf  # exactly the first chunk of 16
    logits = np.repeat(row[None], 4, 0)
    want = _np_log_softmax(row)
    for temperature in (1.0, 0.0):
        tokens, lp = _fused(logits, np.full(4, temperature, np.float32), chunk=16)
        assert np.all(np.asarray(tokens) >= 16)
        np.testing.assert_allclose(np.asarray(lp), want[np.asarray(tokens)], rtol=1e-6)


@pytest.mark.parametrize("sampler", [sample_tokens, sample_tokens_fused], ids=["exact", "fused"])
def test_nan_logits_give_a_nan_logprob_at_any_batch_size(sampler):
    """NaN logits must reach the train batch's finite check as a NaN log-prob: capping the
    log-prob at 0 with ``jnp.minimum`` turned it into 0.0 in the compiled fused sampler on CPU
    from 4096 rows on."""
    rows = 4096
    row = (np.random.default_rng(0).standard_normal(50) * 2).astype(np.float32)
    row[5] = np.nan
    run = jax.jit(lambda x: sampler(x, jnp.arange(rows, dtype=jnp.int32), jnp.zeros(rows, jnp.int32),
                                    jnp.ones(rows), jnp.zeros(rows, jnp.int32), jnp.ones(rows)))
    _, lp = run(jnp.broadcast_to(jnp.asarray(row), (rows, 50)))
    assert np.isnan(np.asarray(lp)).all()


def test_clamp_logprob_caps_at_zero_and_keeps_nan():
    x = jnp.array([-1.5, 0.0, 3e-7, np.nan, -np.inf], jnp.float32)
    np.testing.assert_array_equal(np.asarray(clamp_logprob(x)), [-1.5, 0.0, 0.0, np.nan, -np.inf])


def test_top_k_keeps_every_token_tied_with_the_kth_as_hf():
    """bf16 logits tie often: HF's TopKLogitsWarper removes only scores below the k-th largest,
    so every token tied with it stays drawable (vLLM likewise). Rows: a tie straddling k, a tie
    wholly inside the top k, all tokens equal, and top-k then top-p over a tie."""
    rows = np.array([
        [3.0, 1.0, 2.0, 2.0, 2.0, 0.5, -1.0, 2.0],   # k=2: 3.0 and the four 2.0s
        [3.0, 2.5, 2.5, 1.0, 0.0, 0.0, -2.0, -3.0],  # k=3: exactly 3 (the tie is inside)
        [1.0] * 8,                                   # k=1: all tied, all kept
        [4.0, 3.0, 3.0, 3.0, 0.0, -1.0, -1.0, -5.0],  # k=2 then top-p 0.95
    ], np.float32)
    ours = _filter_as_hf(rows, [(1.0, 2, 1.0), (0.8, 3, 1.0), (1.0, 1, 1.0), (1.0, 2, 0.95)])
    assert np.isfinite(ours[0]).sum() == 5 and np.isfinite(ours[2]).sum() == 8

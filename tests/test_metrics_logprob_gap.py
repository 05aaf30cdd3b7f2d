"""The batch-level sampler / trainer log-prob gap warning (``rl.metrics.logprob_gap_kl_level``,
``logprob_gap_kl_warning``): a temperature mismatch between sampler and trainer warns in every
dtype, bf16 included, where the per-token count's 1 nat cannot see it; rounding noise does not."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from rstarjax.rl.logprob_gap import gap_on_device  # noqa: E402
from rstarjax.rl.metrics import (LOGPROB_GAP_THRESHOLDS, logprob_gap_kl_level,  # noqa: E402
                                 logprob_gap_kl_warning)
from rstarjax.serving.sampling import sample_tokens  # noqa: E402


def lm_like_logits(rows: int = 256, vocab: int = 4096) -> jax.Array:
    """Rows shaped like a language model's: a boosted token over Gumbel noise, from unsure to
    sure rows, at Qwen-like magnitudes (top logits ~ 20-40, where bf16 rounds by 0.125-0.25)."""
    rng = np.random.default_rng(1)
    z = rng.gumbel(size=(rows, vocab)).astype(np.float32) * 1.5
    z[np.arange(rows), rng.integers(0, vocab, rows)] += rng.uniform(0, 25, rows)
    return jnp.asarray(z + 12.0)


def _logprob_at(logits, tokens, temperature):
    return jnp.take_along_axis(jax.nn.log_softmax(logits / temperature, -1), tokens[:, None], -1)[:, 0]


def bf16_sampler_gap(logits, sampler_temperature: float, trainer_temperature: float) -> dict[str, float]:
    """The gap metrics of a bf16 engine sampling at one temperature (its logits rounded to bf16)
    and a float32 trainer recomputing at another."""
    rows = logits.shape[0]
    served = logits.astype(jnp.bfloat16).astype(jnp.float32)
    tokens, _ = sample_tokens(served, jnp.arange(rows, dtype=jnp.int32), jnp.zeros(rows, jnp.int32),
                              jnp.full(rows, sampler_temperature), jnp.zeros(rows, jnp.int32), jnp.ones(rows))
    sampled = _logprob_at(served, tokens, sampler_temperature)
    recomputed = _logprob_at(logits, tokens, trainer_temperature)
    metrics, _ = gap_on_device(sampled[None], recomputed[None], jnp.ones((1, rows)),
                               LOGPROB_GAP_THRESHOLDS["bfloat16"])
    return metrics


def test_a_temperature_mismatch_in_bf16_warns_and_bf16_rounding_does_not():
    logits = lm_like_logits()
    level = logprob_gap_kl_level("bfloat16", ("float32",))
    noise = bf16_sampler_gap(logits, 1.0, 1.0)
    assert noise["train/logprob_gap_abs"] > 5e-3  # real rounding noise, not an exact copy
    assert logprob_gap_kl_warning(3, noise["train/logprob_gap_kl"], level) is None
    for sampler_t, trainer_t in ((0.6, 1.0), (1.0, 0.7)):
        off = bf16_sampler_gap(logits, sampler_t, trainer_t)
        # the per-token count at bf16's 1 nat sees a few tokens at most: no alarm by itself
        assert off["train/logprob_gap_tokens_over"] < 0.15 * off["train/logprob_gap_tokens"]
        warning = logprob_gap_kl_warning(3, off["train/logprob_gap_kl"], level)
        assert warning is not None and warning.startswith("step 3: ") and "train/logprob_gap_kl" in warning
        assert "rl.temperature" in warning


def test_kl_levels_are_the_coarser_sides_and_keep_rounding_under_them():
    assert logprob_gap_kl_level("float32") < logprob_gap_kl_level("float16") < logprob_gap_kl_level("bfloat16")
    assert logprob_gap_kl_level("float32", ("bfloat16",)) == logprob_gap_kl_level("bfloat16")
    assert logprob_gap_kl_level(jnp.bfloat16, ("float32",)) == logprob_gap_kl_level("bfloat16")
    with pytest.raises(ValueError, match="float64"):
        logprob_gap_kl_level("float64")
    # the H200 stage-1 job's bf16 noise (5.3e-4 at every step) stays quiet; NaN is no noise
    assert logprob_gap_kl_warning(1, 5.3e-4, logprob_gap_kl_level("bfloat16")) is None
    assert logprob_gap_kl_warning(1, float("nan"), logprob_gap_kl_level("bfloat16")) is not None
    assert logprob_gap_kl_warning(1, 0.0, logprob_gap_kl_level("float32")) is None


def _kl_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "train/logprob_gap_kl" in r.getMessage()]


def test_rl_step_warns_on_the_batch_gap_in_bf16(caplog):
    """Through ``rl_step``: a bf16 run whose sampler recorded every log-prob 0.5 nats off (no
    token over bf16's 1 nat, so no count) warns on ``train/logprob_gap_kl``; an exact sampler
    does not."""
    from test_batch_filter import REWARDS, exact_sampler, make_trainer, records, response_len, rl_cfg

    from rstarjax.rl.loss import LossConfig
    from rstarjax.rl.step import rl_step

    cfg = rl_cfg(roc=False)
    tr = make_trainer()
    off = exact_sampler(tr, REWARDS.get, lambda p, j: {k: -0.5 for k in range(response_len(p, j))})
    with caplog.at_level("WARNING", logger="rstarjax.rl.step"):
        m = rl_step(tr, off, records(2, 3), cfg, LossConfig(), seed=6, serving_dtype="bfloat16")
    assert m["train/logprob_gap_tokens_over"] == 0.0 and m["train/logprob_gap_kl"] > 0.1
    [warning] = _kl_warnings(caplog)
    assert warning.startswith(f"step {tr.step}: ")

    caplog.clear()
    with caplog.at_level("WARNING", logger="rstarjax.rl.step"):
        m = rl_step(tr, exact_sampler(tr, REWARDS.get), records(2, 3), cfg, LossConfig(), seed=6,
                    serving_dtype="bfloat16")
    assert m["train/logprob_gap_kl"] < 1e-6 and not _kl_warnings(caplog)

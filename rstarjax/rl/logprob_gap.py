"""The sampler/trainer log-prob gap: how far the log-probs the rollout engine sampled with are from
the ones the trainer recomputes for the same tokens. It should be float noise (the same weights, the
same tokens); anything larger is a bug in the hand-off, the template or the kernels, so the trainer
measures it on every step where the arrays live and reports the worst positions."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


MAX_GAP_OUTLIERS = 64  # positions of over-threshold tokens read back per train call


@functools.partial(jax.jit, static_argnames=("out_sharding",))
def gap_sums(sampled, recomputed, mask, threshold, out_sharding=None):
    d = (recomputed - sampled) * mask
    over = jnp.abs(d) > threshold  # untrained tokens have d = 0: never over a threshold >= 0
    # The first few (row, column) of the over-threshold tokens, in row-major order; -1 pads.
    positions = jnp.argwhere(over, size=MAX_GAP_OUTLIERS, fill_value=-1)
    out = (jnp.sum(jnp.abs(d)), jnp.max(jnp.abs(d)), jnp.sum((jnp.exp(d) - 1.0 - d) * mask),
           jnp.sum(mask), jnp.sum(over), positions)
    # Replicated: readable on every process of a multi-process run.
    return out if out_sharding is None else jax.lax.with_sharding_constraint(out, out_sharding)


def gap_on_device(sampled, recomputed, mask, threshold: float = np.inf, replicated=None
                  ) -> tuple[dict[str, float], np.ndarray]:
    """Mismatch between the sampler's and the trainer's log-probs on trained tokens, computed
    where the (possibly multi-process) arrays live: mean |d|, max |d|, the mean k3 estimate of
    KL(sampler || trainer), exp(d) - 1 - d with d = trainer - sampler (>= 0, unbiased), and the
    count of tokens with |d| > ``threshold``; plus the global (row, column) of the first
    ``MAX_GAP_OUTLIERS`` of those ([n, 2])."""
    s_abs, s_max, s_kl, n, over, positions = jax.device_get(
        gap_sums(sampled, recomputed, mask, jnp.float32(threshold), out_sharding=replicated))
    measured, n = float(n), max(float(n), 1.0)
    # how many tokens were measured: with partial or asynchronous rollouts only fresh ones are,
    # and a step with none reports gaps of 0 that say nothing
    metrics = {"train/logprob_gap_abs": float(s_abs) / n, "train/logprob_gap_max": float(s_max),
               "train/logprob_gap_kl": float(s_kl) / n, "train/logprob_gap_tokens": measured,
               "train/logprob_gap_tokens_over": float(over)}
    return metrics, np.asarray(positions)[np.asarray(positions)[:, 0] >= 0]

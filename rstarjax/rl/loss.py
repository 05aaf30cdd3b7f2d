"""GRPO-RoC policy loss (rStar2-Agent eq. 6) and its options, as jit-friendly jnp functions.

Alignment (docs/design.md TrainBatch): arrays are [B, L]; position t holds target token t and the
log-prob of predicting it from position t-1. ``token_logprobs`` does the shift, so every [B, L]
array here lines up with ``TrainBatch.tokens`` / ``loss_mask`` / ``old_logprobs``.

Exact micro-batching: ``policy_loss`` returns SUM over the micro-batch's tokens / ``denom`` where
``denom`` is computed once for the WHOLE batch (``loss_denominator``). Summing the losses (and
metrics, and gradients) of the micro-batches therefore equals the full-batch value. This is the
token-level normalisation of eq. 6 (1 / sum_i |o_i|), not GRPO eq. 1's per-sequence mean.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps masked/garbage positions from producing inf * 0 = nan


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss options. Defaults are the paper's GRPO-RoC (eq. 6): Clip-Higher, no KL, no entropy."""

    eps_low: float = 0.2  # rStar2-Agent eq. 6, Clip-Higher (Yu et al. 2025)
    eps_high: float = 0.28
    # KL(pi || pi_ref) with the k3 estimator (Schulman 2020), added to the loss; the paper drops it (§2.2.1).
    kl_coef: float = 0.0
    # Entropy bonus (subtracted from the loss); the paper drops it (§2.2.1).
    entropy_coef: float = 0.0
    # Dual clip (Ye et al. 2020): for A < 0 the per-token loss is capped at -c * A. Typical c = 3.
    dual_clip_c: float | None = None
    # Dr. GRPO (Liu et al. 2025): advantages without std and a constant denominator
    # (num sequences * max response length) instead of the token count; see loss_denominator.
    dr_grpo: bool = False
    # GSPO (Zheng et al. 2025), GSPO-token form: the ratio is the sequence-level geometric mean
    # exp(mean_t log(pi/pi_old)), clipped with its own (much smaller) epsilons.
    gspo: bool = False
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    # Truncated importance sampling (Yao et al. 2025): weight each token by
    # min(pi_old_trainer / pi_rollout, tis_cap) to correct sampler/trainer log-prob mismatch.
    tis_cap: float | None = None
    # DAPO overlong filtering: zero the loss mask of truncated rollouts (paper §4.3.1: harmful).
    overlong_filter: bool = False
    # Kimi k1.5 length penalty coefficient (reward shaping, advantages.kimi_length_reward); 0 = off.
    length_penalty_coef: float = 0.0
    # DAPO dynamic sampling (rollout-level; advantages.is_informative_group): refill zero-variance groups.
    dynamic_sampling: bool = False

    def __post_init__(self):
        for name in ("eps_low", "eps_high", "gspo_eps_low", "gspo_eps_high"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LossConfig.{name} must be > 0")
        if self.eps_low >= 1 or self.gspo_eps_low >= 1:
            raise ValueError("eps_low must be < 1 (the lower clip bound 1 - eps_low must stay positive)")
        if self.kl_coef < 0 or self.entropy_coef < 0 or self.length_penalty_coef < 0:
            raise ValueError("coefficients must be >= 0")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise ValueError("dual_clip_c must be > 1")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError("tis_cap must be > 0")

    @property
    def std_normalize(self) -> bool:
        """Whether advantages divide by the group std (eq. 7); Dr. GRPO does not."""
        return not self.dr_grpo


def loss_denominator(loss_mask, cfg: LossConfig, num_sequences: int | None = None, max_response_len: int | None = None) -> float:
    """The global denominator of eq. 6: total loss-mask tokens of the WHOLE batch (host-side).

    Dr. GRPO instead uses the constant num_sequences * max_response_len (no length bias).
    """
    if cfg.dr_grpo:
        if not num_sequences or not max_response_len:
            raise ValueError("Dr. GRPO needs num_sequences and max_response_len for its constant denominator")
        return float(num_sequences * max_response_len)
    return float(np.asarray(loss_mask, np.float64).sum())


def token_logprobs_and_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 log pi(targets[:, t] | <t) and the entropy of that distribution, both [B, L].

    ``logits`` f[B, L, V] is the model output over ``targets`` = TrainBatch.tokens int[B, L];
    logits[:, t-1] predicts targets[:, t]. Column 0 has no prediction and is 0 (its loss mask is 0:
    it is always a prompt token). In packed rows the first token of each segment is also a prompt
    token with mask 0, so the cross-segment prediction is never trained on.
    """
    if logits.ndim != 3 or targets.ndim != 2 or logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} must be [B, L, V] and [B, L]")
    lg = logits[:, :-1].astype(jnp.float32)
    lse = jax.nn.logsumexp(lg, axis=-1)
    picked = jnp.take_along_axis(lg, targets[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    logp = picked - lse
    probs = jnp.exp(lg - lse[..., None])
    entropy = lse - jnp.sum(probs * lg, axis=-1)
    pad = jnp.zeros((targets.shape[0], 1), jnp.float32)
    return jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, entropy], axis=1)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """fp32 log pi(targets[:, t] | <t) aligned with ``targets`` [B, L] (column 0 is 0)."""
    if logits.ndim != 3 or targets.ndim != 2 or logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} must be [B, L, V] and [B, L]")
    lg = logits[:, :-1].astype(jnp.float32)
    lse = jax.nn.logsumexp(lg, axis=-1)
    picked = jnp.take_along_axis(lg, targets[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    pad = jnp.zeros((targets.shape[0], 1), jnp.float32)
    return jnp.concatenate([pad, picked - lse], axis=1)


def sequence_mean(values: jax.Array, mask: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Masked mean of ``values`` over each sequence, broadcast back to [B, L].

    A sequence is a row (``segment_ids`` None) or a (row, segment id) pair in packed rows.
    """
    b, l = values.shape
    seg = jnp.ones((b, l), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    key = (jnp.arange(b, dtype=jnp.int32)[:, None] * (l + 1) + seg).reshape(-1)
    n = b * (l + 1)
    sums = jax.ops.segment_sum((values * mask).reshape(-1), key, num_segments=n)
    counts = jax.ops.segment_sum(mask.reshape(-1), key, num_segments=n)
    means = sums / jnp.maximum(counts, 1.0)
    return means[key].reshape(b, l)


def clipped_surrogate(ratio: jax.Array, advantages: jax.Array, eps_low: float, eps_high: float, dual_clip_c: float | None):
    """Per-token loss of eq. 6: -min(r A, clip(r, 1-eps_low, 1+eps_high) A), optionally dual-clipped."""
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg = jnp.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        pg = jnp.where(advantages < 0, jnp.minimum(pg, -advantages * dual_clip_c), pg)
    return pg


def kl_k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k3 estimator of KL(pi || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = jnp.clip(ref_logprobs - logprobs, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.exp(d) - d - 1.0


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    denom,
    cfg: LossConfig,
    ref_logprobs: jax.Array | None = None,
    rollout_logprobs: jax.Array | None = None,
    entropy: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO-RoC objective, rStar2-Agent eq. 6 (negated, to minimise), over [B, L] aligned arrays.

    loss = sum_t mask_t * (pg_t + kl_coef * KL_t - entropy_coef * H_t) / denom, with
    pg_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t), r_t = pi / pi_old.
    ``denom`` is the global token count of the whole batch (see module docstring); a denom of 0
    (no trainable token anywhere) is treated as 1, giving loss 0.
    ``rollout_logprobs`` is only used with ``cfg.tis_cap``; ``ref_logprobs`` with ``cfg.kl_coef``;
    ``entropy`` with ``cfg.entropy_coef`` (and reported when given); ``segment_ids`` with GSPO on
    packed rows. Metrics are sums / denom as well, so they add across micro-batches too.
    """
    f32 = jnp.float32
    logp = logprobs.astype(f32)
    old = old_logprobs.astype(f32)
    adv = advantages.astype(f32)
    mask = loss_mask.astype(f32)
    on = mask > 0
    inv_denom = 1.0 / jnp.maximum(jnp.asarray(denom, f32), 1.0)

    log_ratio = jnp.where(on, jnp.clip(logp - old, -_MAX_LOG_RATIO, _MAX_LOG_RATIO), 0.0)
    if cfg.gspo:
        # GSPO-token: value = sequence-level ratio, gradient = that ratio times d log pi_t.
        seq_log_ratio = sequence_mean(log_ratio, mask, segment_ids)
        log_ratio = jax.lax.stop_gradient(seq_log_ratio) + logp - jax.lax.stop_gradient(logp)
        log_ratio = jnp.where(on, log_ratio, 0.0)
        eps_low, eps_high = cfg.gspo_eps_low, cfg.gspo_eps_high
    else:
        eps_low, eps_high = cfg.eps_low, cfg.eps_high
    ratio = jnp.exp(log_ratio)

    pg = clipped_surrogate(ratio, adv, eps_low, eps_high, cfg.dual_clip_c)
    metrics = {}
    if cfg.tis_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("tis_cap needs rollout_logprobs")
        is_log = jnp.where(on, jnp.clip(old - rollout_logprobs.astype(f32), -_MAX_LOG_RATIO, _MAX_LOG_RATIO), 0.0)
        is_weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(is_log), cfg.tis_cap))
        pg = pg * is_weight
        metrics["tis_weight_mean"] = jnp.sum(mask * is_weight) * inv_denom
        metrics["tis_capped_frac"] = jnp.sum(mask * (jnp.exp(is_log) > cfg.tis_cap)) * inv_denom

    per_token = pg
    metrics["pg_loss"] = jnp.sum(mask * pg) * inv_denom
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_k3(logp, ref_logprobs.astype(f32))
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl_ref"] = jnp.sum(mask * kl) * inv_denom
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")
    if entropy is not None:
        ent = entropy.astype(f32)
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * ent
        metrics["entropy"] = jnp.sum(mask * ent) * inv_denom

    loss = jnp.sum(mask * per_token) * inv_denom

    ratio_sg = jax.lax.stop_gradient(ratio)
    adv_sg = adv
    metrics["clip_frac_low"] = jnp.sum(mask * ((adv_sg < 0) & (ratio_sg < 1.0 - eps_low))) * inv_denom
    metrics["clip_frac_high"] = jnp.sum(mask * ((adv_sg > 0) & (ratio_sg > 1.0 + eps_high))) * inv_denom
    if cfg.dual_clip_c is not None:
        metrics["dual_clip_frac"] = jnp.sum(mask * ((adv_sg < 0) & (ratio_sg > cfg.dual_clip_c))) * inv_denom
    metrics["ratio_mean"] = jnp.sum(mask * ratio_sg) * inv_denom
    # k3 estimate of KL(pi_old || pi) on the sampled tokens (how far this update moved).
    lr_sg = jax.lax.stop_gradient(jnp.where(on, jnp.clip(logp - old, -_MAX_LOG_RATIO, _MAX_LOG_RATIO), 0.0))
    metrics["approx_kl"] = jnp.sum(mask * (jnp.exp(lr_sg) - lr_sg - 1.0)) * inv_denom
    metrics["token_frac"] = jnp.sum(mask) * inv_denom  # 1.0 once summed over all micro-batches
    return loss, metrics

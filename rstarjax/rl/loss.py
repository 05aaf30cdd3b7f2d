"""The losses the trainer differentiates, as jit-friendly jnp functions: GRPO-RoC's policy loss
(rStar2-Agent eq. 6) with its options, and SFT's masked NLL.

Alignment (docs/design.md TrainBatch): arrays are [B, L]; position t holds target token t and the
log-prob of predicting it from position t-1. The model's ``token_logprobs`` (``models/logprobs.py``)
does the shift, so every [B, L] array here lines up with ``TrainBatch.tokens`` / ``loss_mask`` /
``old_logprobs``.

Exact micro-batching: every loss returns SUM over the micro-batch's tokens / ``denom`` where
``denom`` is computed once for the WHOLE batch (the trainer's step: its token count, eq. 6's
1 / sum_i |o_i|, not GRPO eq. 1's per-sequence mean; or Dr. GRPO's constant), or the per-token
weights of ``LOSS_SCALE_KEY`` are computed on the host for the whole batch (eq. 6's per-group
token means, ``group_token_mean_scale``; verl's micro-batches, ``verl_loss_scale``). Summing the
losses (and metrics, and gradients) of the micro-batches therefore equals the full-batch value.

``loss.policy_loss`` names one of ``POLICY_RATIOS`` (how pi / pi_old is measured and clipped);
a new loss term is one more pure function here and one field in ``LossConfig``, whose default
every config's ``loss`` section takes (configs/base.py builds the section from it).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from rstarjax.rl.advantages import ADVANTAGE_ESTIMATORS
from rstarjax.rl.batch import BATCH_KEYS, REF_KEY, SEQUENCE_KEYS
from rstarjax.validation import one_of, require

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps masked/garbage positions from producing inf * 0 = nan


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The ``loss`` section. Defaults are the paper's GRPO-RoC (eq. 6): Clip-Higher, no KL, no entropy."""

    eps_low: float = 0.2  # rStar2-Agent eq. 6, Clip-Higher (DAPO, arXiv 2503.14476)
    eps_high: float = 0.28
    # KL(pi || pi_ref) with the k3 estimator (Schulman 2020), added to the loss; the paper drops it (§2.2.1).
    kl_coef: float = 0.0
    # Entropy bonus (subtracted from the loss); the paper drops it (§2.2.1).
    entropy_coef: float = 0.0
    # Dual clip (Ye et al. 2020): for A < 0 the per-token loss is capped at -c * A. Typical c = 3.
    dual_clip_c: float | None = None
    # How the importance ratio is measured and clipped: POLICY_RATIOS ("ppo_clip": eq. 6 per
    # token; "gspo": the sequence-level ratio with its own, much smaller, clip range).
    policy_loss: str = "ppo_clip"
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    # Truncated importance sampling (Yao et al. 2025): weight each token by
    # min(pi_old_trainer / pi_rollout, tis_cap) to correct sampler/trainer log-prob mismatch.
    tis_cap: float | None = None
    # Decoupled PPO (AReaL, arXiv 2505.24298): the ratio is taken against the proximal policy
    # (the old log-probs recomputed at the update's start) and each token weighted by
    # pi_proximal / pi_behaviour (the sampler's); tokens whose weight exceeds this cap drop out.
    # None = off; float("inf") = uncapped. For rollouts older than the weights being trained.
    decoupled_cap: float | None = None
    # advantages.ADVANTAGE_ESTIMATORS: "grpo" (eq. 7) or "dr_grpo" (no std, and eq. 6's
    # normaliser becomes the constant of ``dr_grpo_denominator``).
    advantage_estimator: str = "grpo"
    # TOKEN_MEANS: "batch" = eq. 6 as DAPO reads it, one token mean over the whole (mini-)batch (a
    # group weighs by its tokens); "group" = eq. 6 read literally, a token mean per group (its kept
    # rollouts' trained tokens in the mini-batch), the groups averaged equally
    # (``group_token_mean_scale``, per-token weights from the group ids rl_step passes);
    # "micro_batch" = the official verl actor's: a token mean per micro-batch, weighted by its
    # share of the rows (``micro_batch_token_mean_scale``)
    token_mean: str = "batch"
    # token_mean="micro_batch" only. MICRO_BATCH_ROWS: what the micro-batches' rows are divided by:
    # "kept", the rows trained (after RoC); "configured", the rows the update was configured for
    # (prompts x rollouts sampled per prompt, before RoC: verl's normalised ppo_mini_batch_size
    # per GPU, whose losses the GPUs average), passed in by the RL step
    micro_batch_rows: str = "kept"
    # > 0: the token means are taken over verl's micro-batches (use_dynamic_bsz): the sequences
    # split into ``micro_batch_gpus`` contiguous blocks (one per GPU) and each block into
    # ``token_budget_micro_batches`` of this many tokens (ppo_max_token_len_per_gpu), as
    # per-token weights (LOSS_SCALE_KEY, ``verl_loss_scale``) whatever our own micro-batches are;
    # 0: each of our micro-batches is one
    micro_batch_tokens: int = 0
    micro_batch_gpus: int = 1

    def __post_init__(self):
        require(
            (0 < self.eps_low < 1 and self.eps_high > 0,
             f"eps_low={self.eps_low} must lie in (0, 1) and eps_high={self.eps_high} be > 0 "
             "(the lower clip bound 1 - eps_low must stay positive)"),
            (0 < self.gspo_eps_low < 1 and self.gspo_eps_high > 0,
             f"gspo_eps_low={self.gspo_eps_low} must lie in (0, 1) and gspo_eps_high={self.gspo_eps_high} be > 0"),
            (self.kl_coef >= 0 and self.entropy_coef >= 0,
             "kl_coef and entropy_coef must be >= 0 (0 = off; the paper uses 0, §2.2.1)"),
            (self.dual_clip_c is None or self.dual_clip_c > 1, f"dual_clip_c={self.dual_clip_c} must be > 1"),
            (self.tis_cap is None or self.tis_cap > 0, f"tis_cap={self.tis_cap} must be > 0"),
            (self.decoupled_cap is None or self.decoupled_cap > 1,
             f"decoupled_cap={self.decoupled_cap} must be > 1 (a weight of 1, on-policy, is always kept)"),
            (self.tis_cap is None or self.decoupled_cap is None,
             "tis_cap and decoupled_cap are two corrections of the same behaviour/trainer mismatch: use one"),
            one_of("policy_loss", self.policy_loss, POLICY_RATIOS),
            one_of("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS),
            one_of("token_mean", self.token_mean, TOKEN_MEANS),
            one_of("micro_batch_rows", self.micro_batch_rows, MICRO_BATCH_ROWS),
            (self.micro_batch_tokens >= 0 and self.micro_batch_gpus >= 1,
             f"micro_batch_tokens={self.micro_batch_tokens} must be >= 0 (0 = off) and "
             f"micro_batch_gpus={self.micro_batch_gpus} >= 1"),
            (self.token_mean != "batch" or (self.micro_batch_rows == "kept" and self.micro_batch_tokens == 0),
             "micro_batch_rows and micro_batch_tokens set how token_mean='micro_batch' normalises: "
             "set loss.token_mean=micro_batch"),
            (self.token_mean != "group" or (self.micro_batch_rows == "kept" and self.micro_batch_tokens == 0),
             "token_mean='group' divides each group's token sum by that group's trained tokens: "
             "micro_batch_rows and micro_batch_tokens (verl's micro-batch token means) do not apply to it; "
             "use them with loss.token_mean=micro_batch"),
            (self.token_mean == "batch" or self.advantage_estimator != "dr_grpo",
             f"token_mean={self.token_mean!r} replaces eq. 6's normaliser, which dr_grpo fixes to a constant: "
             "use one of them"),
            (self.policy_loss != "gspo" or (self.token_mean == "batch" and self.advantage_estimator != "dr_grpo"),
             "policy_loss='gspo' averages each sequence's tokens, then the sequences (GSPO's own "
             "objective; verl's seq-mean-token-mean): token_mean='micro_batch' or 'group' and dr_grpo's "
             "constant normaliser do not apply to it"),
        )

    @property
    def per_token_weights(self) -> bool:
        """Whether the loss weighs each token by ``LOSS_SCALE_KEY`` (computed on the host by
        ``Trainer.train``): verl's token-budget micro-batches, or eq. 6's per-group token means."""
        return self.micro_batch_tokens > 0 or self.token_mean == "group"


TOKEN_MEANS = ("batch", "group", "micro_batch")
MICRO_BATCH_ROWS = ("kept", "configured")
# [B, L] per-token weights (loss.micro_batch_tokens > 0 or token_mean="group"), added by Trainer.train
LOSS_SCALE_KEY = "loss_scale"


def _row_blocks(rows: int, row_block) -> np.ndarray:
    block = np.zeros(rows, np.int64) if row_block is None else np.asarray(row_block, np.int64).reshape(-1)
    if block.shape != (rows,) or (block < 0).any():
        raise ValueError(f"row_block must give each of the {rows} rows a block >= 0, got shape {block.shape}")
    return block


def _group_tokens(loss_mask, group_ids, row_block):
    """Over the trained tokens (mask > 0): (their [B, L] selector, the distinct (block, group)
    pairs [2, K], each token's pair index, each pair's mask sum); raises when a trained token
    has no group."""
    mask = np.asarray(loss_mask, np.float64)
    gid = np.asarray(group_ids)
    if gid.shape != mask.shape or mask.ndim != 2:
        raise ValueError(f"group_ids {gid.shape} must be laid out as the loss mask {mask.shape} ([B, L])")
    block = np.broadcast_to(_row_blocks(mask.shape[0], row_block)[:, None], mask.shape)
    on = mask > 0
    if (gid[on] <= 0).any():
        raise ValueError(f"{int(np.sum(gid[on] <= 0))} trained tokens (loss mask > 0) have no group "
                         "(group id 0): token_mean='group' cannot weigh them")
    if not on.any():
        return on, np.zeros((2, 0), np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    keys, inverse = np.unique(np.stack([block[on], gid[on].astype(np.int64)]), axis=1, return_inverse=True)
    sums = np.zeros(keys.shape[1], np.float64)
    np.add.at(sums, inverse.reshape(-1), mask[on])
    return on, keys, inverse.reshape(-1), sums


def trained_groups(loss_mask, group_ids, row_block=None, blocks: int = 1) -> np.ndarray:
    """int64[blocks]: how many groups (distinct ids > 0 of ``group_ids``) have a trained token
    in each block of rows (``row_block[r]``, default all rows block 0)."""
    _, keys, _, _ = _group_tokens(loss_mask, group_ids, row_block)
    return np.bincount(keys[0], minlength=blocks).astype(np.int64)


def group_token_mean_scale(loss_mask, group_ids, row_block=None, block_groups=None) -> np.ndarray:
    """[B, L] float32 per-token weights (``LOSS_SCALE_KEY``) that make the loss's weighted token
    sum rStar2-Agent's eq. 6 read literally (arXiv 2508.20722):

        J = E_{(q, a), {o_i}_{i=1}^{2G}} [ 1 / (sum_{i=1}^G |o^_i|) sum_{i=1}^G sum_t min(r A, clip(r) A) ],

    each group's token sum divided by that group's trained tokens (its G kept rollouts' model
    tokens), the expectation over questions averaging the groups equally. A token of group g in
    block b (a mini-batch: ``row_block[r]`` of its row, default all rows one block) weighs

        1 / (groups of b with a trained token * trained tokens (loss-mask sum) of g in b),

    so each group's weights sum to 1 / groups and all of b's to 1. ``group_ids`` [B, L] int: the
    group of each token (any id > 0 per group, one id never two groups; 0 = no group: padding,
    prompts); packed rows simply hold several ids. A group counts only its tokens in the block
    (one whose tokens are all masked is no group of the mean). ``block_groups`` [blocks]: the
    groups to divide by per block instead of those counted here (a multi-process batch: every
    process's, ``Trainer.group_loss_scale``). Tokens with mask 0 weigh 0."""
    mask = np.asarray(loss_mask, np.float64)
    on, keys, inverse, sums = _group_tokens(loss_mask, group_ids, row_block)
    if block_groups is None:
        count = np.bincount(keys[0], minlength=int(keys[0].max(initial=-1)) + 1)
    else:
        count = np.asarray(block_groups, np.int64).reshape(-1)
        local = np.bincount(keys[0], minlength=count.size)
        if local.size > count.size or (local > count).any():
            raise ValueError(f"block_groups={count.tolist()} counts fewer groups than the rows hold "
                             f"({local.tolist()})")
    scale = np.zeros(mask.shape, np.float32)
    scale[on] = (1.0 / (count[keys[0]] * sums))[inverse]
    return scale


def micro_batch_token_mean_scale(mask: jax.Array, batch_rows) -> jax.Array:
    """The factor that turns a micro-batch's token SUM into the official actor's share of the
    loss (verl dp_actor.update_policy with use_dynamic_bsz, loss_agg_mode="token-mean"): its token
    mean times its rows / the mini-batch's rows, ``batch_rows`` counting the rows with a trained
    token (padding rows of rejected groups are no rows of the official batch)."""
    f32 = jnp.float32
    mask = mask.astype(f32)
    rows = jnp.sum(jnp.any(mask > 0, axis=tuple(range(1, mask.ndim))).astype(f32))
    return rows / (jnp.maximum(jnp.asarray(batch_rows, f32), 1.0) * jnp.maximum(jnp.sum(mask), 1.0))


def token_budget_micro_batches(lengths, budget: int, count: int | None = None) -> list[list[int]]:
    """verl's use_dynamic_bsz split of one GPU's sequences (verl/utils/seqlen_balancing.py
    ``rearrange_micro_batches``): ``min(sequences, ceil(total tokens / budget))`` micro-batches
    (or ``count``: verl takes the largest count over the GPUs), balanced by tokens. The balancing
    is ours (longest first into the lightest micro-batch; verl uses Karmarkar-Karp), so a
    micro-batch may hold other sequences than verl's would; each holds whole sequences and none is
    empty. Returns the sequences' indices per micro-batch, ascending."""
    lengths = [int(n) for n in lengths]
    if not lengths:
        return []
    if count is None:
        count = min(len(lengths), -(-sum(lengths) // max(int(budget), 1)))
    count = max(1, min(count, len(lengths)))
    parts: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = min(range(count), key=lambda k: (loads[k], len(parts[k]), k))
        parts[k].append(i)
        loads[k] += lengths[i]
    return [sorted(p) for p in parts]


def verl_loss_scale(loss_mask, segment_ids, rows: float, budget: int, gpus: int) -> np.ndarray:
    """[B, L] float32 weights that make eq. 6's token sum verl's loss (dp_actor.update_policy with
    use_dynamic_bsz, loss_agg_mode="token-mean"; its gradient averaged over ``gpus``): a token of
    a sequence in micro-batch m weighs |m| / (rows * trained tokens of m). The sequences (each
    (row, segment) of ``segment_ids`` > 0, in order) are split into ``gpus`` contiguous blocks,
    each into ``token_budget_micro_batches`` of ``budget`` tokens (the count the largest over the
    blocks). ``rows``: the normaliser (verl's configured rows of the whole update, all GPUs)."""
    mask = np.asarray(loss_mask, np.float32)
    seg = np.asarray(segment_ids)
    seqs = [(r, s) for r in range(seg.shape[0]) for s in np.unique(seg[r]) if s > 0]
    lengths = [int(np.sum(seg[r] == s)) for r, s in seqs]
    blocks = np.array_split(np.arange(len(seqs)), max(int(gpus), 1))
    counts = [min(len(b), -(-sum(lengths[i] for i in b) // max(int(budget), 1))) for b in blocks if len(b)]
    count = max(counts, default=0)
    scale = np.zeros(mask.shape, np.float32)
    for block in blocks:
        if not len(block):
            continue
        for part in token_budget_micro_batches([lengths[i] for i in block], budget, count):
            members = [seqs[block[j]] for j in part]
            where = [(r, seg[r] == s) for r, s in members]
            tokens = sum(float(np.sum(mask[r][on])) for r, on in where)
            if tokens > 0:
                for r, on in where:
                    scale[r][on] = len(members) / (float(rows) * tokens)
    return scale


def dr_grpo_denominator(num_sequences: int, max_response_len: int) -> float:
    """Dr. GRPO's constant normaliser of eq. 6 (Liu et al. 2025, arXiv 2503.20783): the sequences
    of one update times the maximum response length, instead of their token count (which
    favours long wrong answers over short ones)."""
    if num_sequences < 1 or max_response_len < 1:
        raise ValueError(f"Dr. GRPO needs num_sequences and max_response_len >= 1, got "
                         f"{num_sequences} and {max_response_len}")
    return float(num_sequences * max_response_len)


def _sequence_keys(shape, segment_ids: jax.Array | None) -> tuple[jax.Array, int]:
    """One id per sequence for every token (flattened), and how many ids there can be. A sequence
    is a row (``segment_ids`` None) or a (row, segment id) pair in packed rows."""
    b, l = shape
    seg = jnp.ones((b, l), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    return (jnp.arange(b, dtype=jnp.int32)[:, None] * (l + 1) + seg).reshape(-1), b * (l + 1)


def sequence_sum(values: jax.Array, mask: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Masked sum of ``values`` over each sequence, broadcast back to [B, L]."""
    key, n = _sequence_keys(values.shape, segment_ids)
    return jax.ops.segment_sum((values * mask).reshape(-1), key, num_segments=n)[key].reshape(values.shape)


def sequence_mean(values: jax.Array, mask: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Masked mean of ``values`` over each sequence, broadcast back to [B, L]."""
    return sequence_sum(values, mask, segment_ids) / jnp.maximum(sequence_sum(jnp.ones_like(mask), mask, segment_ids), 1.0)


def trained_sequences(mask: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """How many sequences of a batch train at least one token (GSPO's normaliser)."""
    key, n = _sequence_keys(mask.shape, segment_ids)
    counts = jax.ops.segment_sum(mask.astype(jnp.float32).reshape(-1), key, num_segments=n)
    return jnp.sum((counts > 0).astype(jnp.float32))


def ppo_clip_ratio(log_ratio: jax.Array, logprobs: jax.Array, mask: jax.Array, segment_ids, cfg: LossConfig):
    """rStar2-Agent eq. 6: the per-token ratio r_t = pi / pi_old (PPO's clipped surrogate,
    Schulman et al. 2017, arXiv 1707.06347), clipped to [1 - eps_low, 1 + eps_high] (Clip-Higher).
    Returns (log r_t, eps_low, eps_high)."""
    return log_ratio, cfg.eps_low, cfg.eps_high


def gspo_ratio(log_ratio: jax.Array, logprobs: jax.Array, mask: jax.Array, segment_ids, cfg: LossConfig):
    """GSPO ("Group Sequence Policy Optimization", Zheng et al. 2025, arXiv 2507.18071), GSPO-token
    form: the value is the sequence-level ratio exp(mean_t log(pi/pi_old)) (one per packed
    sequence, ``sequence_mean``), the gradient that ratio times d log pi_t; clipped with
    gspo_eps_low / gspo_eps_high."""
    on = mask > 0
    seq_log_ratio = sequence_mean(log_ratio, mask, segment_ids)
    log_ratio = jax.lax.stop_gradient(seq_log_ratio) + logprobs - jax.lax.stop_gradient(logprobs)
    return jnp.where(on, log_ratio, 0.0), cfg.gspo_eps_low, cfg.gspo_eps_high


# loss.policy_loss: name -> (log_ratio, logprobs, mask, segment_ids, cfg) -> (log ratio, eps_low, eps_high)
POLICY_RATIOS: dict[str, Callable] = {"ppo_clip": ppo_clip_ratio, "gspo": gspo_ratio}


def clipped_surrogate(ratio: jax.Array, advantages: jax.Array, eps_low: float, eps_high: float,
                      dual_clip_c: float | None):
    """Per-token loss of eq. 6: -min(r A, clip(r, 1-eps_low, 1+eps_high) A), optionally dual-clipped."""
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg = jnp.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        pg = jnp.where(advantages < 0, jnp.minimum(pg, -advantages * dual_clip_c), pg)
    return pg


def behaviour_weight(proximal_logprobs: jax.Array, behaviour_logprobs: jax.Array, mask: jax.Array,
                     tis_cap: float | None, decoupled_cap: float | None) -> tuple[jax.Array, jax.Array]:
    """The per-token off-policy weight w_t of the surrogate (stop-gradient), and the tokens whose
    raw weight passed the cap (truncated, or dropped); w_t = 1 and none past it without a
    correction or where the policies coincide.

    w_t = pi_proximal / pi_behaviour, behaviour = the policy the sampler drew from (its recorded
    log-probs), proximal = the trainer's old log-probs (recomputed at the update's start):
    - ``tis_cap``: truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework
      Secretly Brings You Off-Policy RL Training"; verl's ``tis_imp_ratio_cap``):
      w_t = min(w_t, cap), every token kept;
    - ``decoupled_cap``: decoupled PPO (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
      Reinforcement Learning System for Language Reasoning", arXiv 2505.24298, §5 eq. 5, the
      behaviour importance weight; its ``behav_imp_weight_cap``): w_t uncapped, and a token
      whose w_t exceeds the cap drops out (w_t = 0; it still counts in the normaliser).
    Returns (w [B, L], past_cap [B, L] bool)."""
    f32 = jnp.float32
    on = mask > 0
    if tis_cap is None and decoupled_cap is None:
        return jnp.ones(mask.shape, f32), jnp.zeros(mask.shape, bool)
    log_w = jnp.where(on, jnp.clip(proximal_logprobs.astype(f32) - behaviour_logprobs.astype(f32),
                                   -_MAX_LOG_RATIO, _MAX_LOG_RATIO), 0.0)
    w = jnp.exp(log_w)
    cap = tis_cap if tis_cap is not None else decoupled_cap
    past_cap = on & (w > cap)
    kept = jnp.minimum(w, cap) if tis_cap is not None else jnp.where(past_cap, 0.0, w)
    return jax.lax.stop_gradient(kept), past_cap


KL_CAP = 10.0  # verl's low_var_kl clamps each token's k3 value to [-10, 10]


def kl_k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k3 estimator of KL(pi || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0),
    capped at ``KL_CAP`` as verl's ``low_var_kl`` (verl/trainer/ppo/core_algos.py ``kl_penalty``;
    a capped token gives no gradient)."""
    d = jnp.clip(ref_logprobs - logprobs, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.minimum(jnp.exp(d) - d - 1.0, KL_CAP)


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
    loss_scale: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO-RoC objective, rStar2-Agent eq. 6 (negated, to minimise), over [B, L] aligned arrays.

    loss = sum_t mask_t * (pg_t + kl_coef * KL_t - entropy_coef * H_t) / denom, with
    pg_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t), r_t = pi / pi_old.
    ``denom`` is the normaliser of the whole batch (see module docstring); a denom of 0 (no
    trainable token anywhere) is treated as 1, giving loss 0. r_t is ``POLICY_RATIOS[cfg.policy_loss]``'s.
    ``rollout_logprobs`` (the behaviour policy's) is only used with ``cfg.tis_cap`` or
    ``cfg.decoupled_cap`` (``behaviour_weight``: pg_t times w_t); ``ref_logprobs`` with ``cfg.kl_coef``;
    ``entropy`` with ``cfg.entropy_coef`` (and reported when given); ``segment_ids`` with GSPO on
    packed rows. Metrics are sums / denom as well, so they add across micro-batches too.
    With ``cfg.token_mean="micro_batch"``, ``denom`` is the batch's number of trained rows and each
    sum is scaled by ``micro_batch_token_mean_scale`` instead; with ``cfg.micro_batch_tokens > 0``
    each token by its ``loss_scale`` (``verl_loss_scale``) and ``denom`` is unused, as with
    ``cfg.token_mean="group"`` (``group_token_mean_scale``: eq. 6's token mean per group). With GSPO each
    token is weighted by 1 / its sequence's trained tokens and ``denom`` is the batch's number of
    trained sequences (``trained_sequences``): GSPO's own objective.
    """
    f32 = jnp.float32
    logp = logprobs.astype(f32)
    old = old_logprobs.astype(f32)
    adv = advantages.astype(f32)
    mask = loss_mask.astype(f32)
    on = mask > 0
    if cfg.per_token_weights:
        if loss_scale is None:
            what = ("token_mean='group' needs loss_scale (group_token_mean_scale" if cfg.token_mean == "group"
                    else "micro_batch_tokens > 0 needs loss_scale (verl_loss_scale")
            raise ValueError(f"loss.{what}, added by Trainer.train)")
        token_weight = mask * loss_scale.astype(f32)

        def total(x):  # verl's micro-batch token means or eq. 6's group token means, token by token
            return jnp.sum(token_weight * x)
    elif cfg.policy_loss == "gspo":  # GSPO's objective: a token mean per sequence, over ``denom`` sequences
        token_weight = mask / jnp.maximum(sequence_sum(jnp.ones_like(mask), mask, segment_ids), 1.0)
        inv_denom = 1.0 / jnp.maximum(jnp.asarray(denom, f32), 1.0)

        def total(x):
            return jnp.sum(token_weight * x) * inv_denom
    else:
        if cfg.token_mean == "micro_batch":
            inv_denom = micro_batch_token_mean_scale(mask, denom)
        else:
            inv_denom = 1.0 / jnp.maximum(jnp.asarray(denom, f32), 1.0)

        def total(x):
            return jnp.sum(mask * x) * inv_denom

    log_ratio = jnp.where(on, jnp.clip(logp - old, -_MAX_LOG_RATIO, _MAX_LOG_RATIO), 0.0)
    log_ratio, eps_low, eps_high = POLICY_RATIOS[cfg.policy_loss](log_ratio, logp, mask, segment_ids, cfg)
    ratio = jnp.exp(log_ratio)

    pg = clipped_surrogate(ratio, adv, eps_low, eps_high, cfg.dual_clip_c)
    metrics = {}
    if cfg.tis_cap is not None or cfg.decoupled_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("tis_cap and decoupled_cap need rollout_logprobs (the behaviour policy's)")
        weight, past_cap = behaviour_weight(old, rollout_logprobs, mask, cfg.tis_cap, cfg.decoupled_cap)
        pg = pg * weight
        prefix, past = ("tis_weight_mean", "tis_capped_frac") if cfg.tis_cap is not None else \
            ("behaviour_weight_mean", "behaviour_dropped_frac")
        metrics[prefix] = total(weight)
        metrics[past] = total(past_cap)

    per_token = pg
    metrics["pg_loss"] = total(pg)
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_k3(logp, ref_logprobs.astype(f32))
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl_ref"] = total(kl)
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")
    if entropy is not None:
        ent = entropy.astype(f32)
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * ent
        metrics["entropy"] = total(ent)

    loss = total(per_token)

    ratio_sg = jax.lax.stop_gradient(ratio)
    adv_sg = adv
    metrics["clip_frac_low"] = total((adv_sg < 0) & (ratio_sg < 1.0 - eps_low))
    metrics["clip_frac_high"] = total((adv_sg > 0) & (ratio_sg > 1.0 + eps_high))
    if cfg.dual_clip_c is not None:
        metrics["dual_clip_frac"] = total((adv_sg < 0) & (ratio_sg > cfg.dual_clip_c))
    metrics["ratio_mean"] = total(ratio_sg)
    # k3 estimate of KL(pi_old || pi) on the sampled tokens (how far this update moved).
    lr_sg = jax.lax.stop_gradient(jnp.where(on, jnp.clip(logp - old, -_MAX_LOG_RATIO, _MAX_LOG_RATIO), 0.0))
    metrics["approx_kl"] = total(jnp.exp(lr_sg) - lr_sg - 1.0)
    # 1.0 once summed over all micro-batches
    metrics["token_frac"] = jnp.sum(token_weight) if cfg.per_token_weights else jnp.sum(mask) * inv_denom
    return loss, metrics


# ---- per-micro-batch losses for the trainer's gradient-accumulation step ----------------------
@dataclasses.dataclass(frozen=True)
class MicroLoss:
    """What ``Trainer.update`` differentiates on each micro-batch: ``fn(logprobs, entropy, micro,
    denom) -> (loss, metrics)``, both sums over the micro-batch's tokens divided by the whole
    batch's ``denom`` (so they add up across micro-batches), reading the batch arrays ``keys``.
    ``with_entropy=False``: ``fn`` gets ``entropy=None`` and the forward skips its extra pass
    over the vocabulary."""

    fn: Callable[[jax.Array, jax.Array | None, Mapping[str, jax.Array], jax.Array], tuple[jax.Array, dict]]
    keys: tuple[str, ...]
    with_entropy: bool = True
    # what the trainer's default ``denom`` counts: the batch's trained "tokens" (eq. 6), its
    # trained "rows" (loss.token_mean="micro_batch") or its trained "sequences" (GSPO)
    normaliser: str = "tokens"


def policy_micro_loss(cfg: LossConfig) -> MicroLoss:
    """eq. 6 (``policy_loss``) over a micro-batch of a TrainBatch; with ``cfg.kl_coef > 0`` the
    batch also carries the frozen reference policy's log-probs (``REF_KEY``)."""

    def fn(logprobs, entropy, micro, denom):
        return policy_loss(logprobs, micro["old_logprobs"], micro["advantages"], micro["loss_mask"], denom, cfg,
                           ref_logprobs=micro.get(REF_KEY), rollout_logprobs=micro["rollout_logprobs"],
                           entropy=entropy, segment_ids=micro["segment_ids"], loss_scale=micro.get(LOSS_SCALE_KEY))

    keys = BATCH_KEYS + ((REF_KEY,) if cfg.kl_coef > 0 else ()) + ((LOSS_SCALE_KEY,) if cfg.per_token_weights else ())
    normaliser = "rows" if cfg.token_mean == "micro_batch" else "sequences" if cfg.policy_loss == "gspo" else "tokens"
    return MicroLoss(fn, keys, normaliser=normaliser)


def masked_nll(logprobs, entropy, micro, denom):
    """SFT: -sum of log pi(token | prefix) over the trained (assistant) tokens / denom."""
    return -jnp.sum(logprobs * micro["loss_mask"]) / denom, {}


NLL = MicroLoss(masked_nll, SEQUENCE_KEYS, with_entropy=False)

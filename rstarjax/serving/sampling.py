"""Per-slot token sampling: temperature, top-k, top-p, greedy, a reproducible RNG per request.

Everything here is pure and shape-static so it runs inside the engine's jitted steps with one
compile for any mix of per-slot settings. Each row of a batch carries its own parameters:

- ``temperature[b] <= 0`` means greedy (argmax); otherwise logits are divided by it;
- ``top_k[b] <= 0`` disables top-k; otherwise only the k most likely tokens may be drawn
  (and any tied with the k-th, as in HF transformers and vLLM);
- ``top_p[b] >= 1`` disables nucleus filtering; otherwise the smallest set of most likely
  tokens whose probability reaches ``top_p`` is kept (the token that crosses the threshold
  is included, as in HF transformers' ``TopPLogitsWarper`` and vLLM);
- the random key of a draw is ``fold_in(PRNGKey(seed[b]), counter[b])`` where ``counter`` is
  the number of tokens this request has sampled so far, and a row's draw reads only its own
  logits, settings and key. A request therefore draws the same tokens whatever slot, batch or
  engine it runs in (given its logits and the sampler, ``"exact"`` or ``"fused"``: the two draw
  different tokens for one key): reproducible from its seed alone.

The returned log-prob is the log-prob of the distribution the token was drawn from, before
filtering: ``log_softmax(logits / temperature)[token]`` in float32 (greedy rows: temperature 1,
the raw logits). It is what the trainer's forward recomputes as the "old" log-prob for the
importance ratio (rStar2-Agent eq. 6 uses pi_old of the sampled token), the trainer dividing
its logits by the same rollout temperature (``rl/trainer.py``; verl's actor does the same).
Top-k / top-p only change which token is drawn (verl, TRL and OpenRLHF leave them out of the
trained log-probs too). At the paper's temperature 1.0 the division is by 1.0: exact.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``stop_ids``: generation of a turn ends *after* emitting
    any of these ids; ``max_new_tokens`` bounds the tokens sampled for the request."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 256
    stop_ids: Sequence[int] = ()

    def __post_init__(self):
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -2**31 <= self.seed < 2**31:  # the engine keys its random stream with an int32
            raise ValueError(f"seed must fit a 32-bit signed integer, got {self.seed}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def request_keys(seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """One PRNG key per row: ``fold_in(PRNGKey(seed), counter)`` (see module docstring)."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(
        seeds.astype(jnp.uint32), counters.astype(jnp.uint32)
    )


def filter_logits(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Tempered logits with tokens outside top-k / top-p set to -inf. f32[B,V] -> f32[B,V].

    Works on the descending sort of each row so per-row k and p need no recompilation.
    Top-k keeps every token whose logit equals the k-th largest, as HF transformers'
    ``TopKLogitsWarper`` (it removes only scores below the k-th) and vLLM do: bf16 logits tie
    often, and which of the tied tokens survived would otherwise depend on the sort.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    safe_t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / safe_t
    order = jnp.argsort(-scaled, axis=-1)  # descending, stable
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    kth = jnp.take_along_axis(sorted_logits, k - 1, axis=-1)  # the k-th largest, [B, 1]
    keep = sorted_logits >= kth
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Probability mass strictly before each token: a token is kept while that mass < top_p,
    # so the token that crosses the threshold is kept and the top-1 token always is.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p >= 1 keeps every token outright: the float32 cumsum can reach 1.0 before the tail, and
    # a row's draw must not lose its tail because another row of the batch filters (this function
    # then runs on every row)
    keep = keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    # Scatter back to vocabulary order.
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(sorted_logits, inverse, axis=-1)


def sample_tokens(
    logits: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    forced: jax.Array | None = None,
    vocab_limit: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row and return ``(tokens int32[B], logprobs f32[B])``.

    ``forced[b] >= 0`` replaces the draw by that token (teacher forcing: scripted policies and
    the benchmark's fixed workloads); its log-prob is still the row's tempered policy's.
    ``vocab_limit`` (static): ids >= it are never drawn. Model embeddings are padded past the
    tokenizer (Qwen3: 151936 rows, 151669 tokens) and those ids decode to nothing; the returned
    log-prob stays the full-vocabulary one, which the trainer recomputes.
    """
    policy_logits = logits.astype(jnp.float32)
    logits = policy_logits
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    sampled_rows = temperature > 0
    # The full-vocabulary sort of top-k/top-p is by far the costliest part of a small-model
    # decode step on CPU: skip it (lax.cond runs one branch) when no sampled row filters,
    # and skip the draw entirely when every row is greedy.
    needs_filter = jnp.any(sampled_rows & ((top_k > 0) | (top_p < 1.0)))

    def draw():
        tempered = logits / jnp.where(sampled_rows, temperature, 1.0)[:, None]
        filtered = jax.lax.cond(needs_filter,
                                lambda: filter_logits(logits, temperature, top_k, top_p),
                                lambda: tempered)
        keys = request_keys(seeds, counters)
        return jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, filtered)

    drawn = jax.lax.cond(jnp.any(sampled_rows), draw,
                         lambda: jnp.zeros(logits.shape[:1], jnp.int32))
    greedy = jnp.argmax(logits, axis=-1)
    tokens = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
    if forced is not None:
        tokens = jnp.where(forced >= 0, forced, tokens).astype(jnp.int32)
    behaviour_logits = policy_logits / jnp.where(sampled_rows, temperature, 1.0)[:, None]
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(behaviour_logits, axis=-1), tokens[:, None],
                                   axis=-1)[:, 0]
    return tokens, clamp_logprob(logprobs)


def clamp_logprob(logprobs: jax.Array) -> jax.Array:
    """Log-probs capped at 0, NaN kept NaN. <= 0 by definition; at temperatures near 0 the
    compiled division can round a sure token's log-prob a few ulps above it, which the train batch
    would refuse. Not ``jnp.minimum``: compiled into the fused sampler, XLA CPU's min returned 0.0
    for a NaN log-prob at 4096 rows and more, hiding NaN logits from the train batch's finite
    check; the comparison keeps NaN (NaN > 0 is false)."""
    return jnp.where(logprobs > 0, 0.0, logprobs)


# ---- the fused sampler: one pass over the logits in vocabulary chunks ---------------------------

SAMPLERS = ("exact", "fused")
VOCAB_CHUNK = 16384  # columns per pass of the fused sampler (Qwen3's 151,936: 10 chunks)


def _chunk_starts(vocab: int, chunk: int) -> list[int]:
    return list(range(0, vocab, chunk))


def sample_tokens_fused(
    logits: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    forced: jax.Array | None = None,
    vocab_limit: int | None = None,
    chunk: int = VOCAB_CHUNK,
) -> tuple[jax.Array, jax.Array]:
    """``sample_tokens``' contract (same arguments, same log-prob: ``log_softmax(logits / T)``
    of the chosen token, greedy rows at T = 1, before top-k/top-p) from logits of any dtype
    (the engine's bf16), never making a float32 copy of all rows' logits.

    The vocabulary is read in ``chunk``-column slices; each slice is converted to float32 inside
    one fused pass that updates, per row, a running log-sum-exp (the log-prob's normaliser), a
    running argmax (greedy rows) and a running Gumbel-max (sampled rows: argmax of
    ``logits / T + Gumbel noise``, the same distribution ``jax.random.categorical`` draws from).
    The chosen token's logit is then gathered, one value per row. The noise of chunk c is drawn
    from ``fold_in(request key, c)``, so a request's draws are reproducible from its seed and
    counter as before but are NOT the tokens ``sample_tokens`` draws for the same key (hence a
    switch: ``serving`` sampler ``"fused"``; ``"exact"`` is the default). Rows filtered by top-k
    or top-p need the sorted vocabulary: such a row takes ``sample_tokens``' token (computed,
    under a ``lax.cond``, only when the batch holds one; the RL recipes sample at top-k 0,
    top-p 1), every other row keeps its fused draw, so a request's tokens never depend on the
    settings of the other rows of its batch."""
    b, vocab = logits.shape
    sampled_rows = temperature > 0
    scale = jnp.where(sampled_rows, temperature, 1.0).astype(jnp.float32)[:, None]
    limit = vocab if vocab_limit is None else min(int(vocab_limit), vocab)
    keys = request_keys(seeds, counters)
    low = jnp.full((b,), -jnp.inf, jnp.float32)
    m, s = low, jnp.zeros((b,), jnp.float32)  # running max and sum of exp(x - m), all ids
    best, best_at = low, jnp.zeros((b,), jnp.int32)  # running max of the drawn score
    for c, start in enumerate(_chunk_starts(vocab, chunk)):
        x = logits[:, start:start + chunk].astype(jnp.float32) / scale  # [B, C] in registers
        width = x.shape[1]
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        # a row with no finite logit yet (a chunk all -inf, e.g. masked ids) would take
        # exp(-inf - -inf) = NaN: shift it by 0 instead, its sum stays 0
        shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - shift[:, None]), axis=1)
        m = m_new
        noise = jax.vmap(lambda key: jax.random.gumbel(jax.random.fold_in(key, c), (width,)))(keys)
        col = start + jnp.arange(width)
        score = jnp.where(sampled_rows[:, None], x + noise, x)  # greedy: the plain argmax
        score = jnp.where(col[None, :] < limit, score, -jnp.inf)
        at = jnp.argmax(score, axis=1)  # the first maximum, as jnp.argmax over the whole row
        top = jnp.max(score, axis=1)
        better = top > best
        best, best_at = jnp.where(better, top, best), jnp.where(better, start + at, best_at)
    fused_tokens = best_at.astype(jnp.int32)
    filtered_rows = sampled_rows & ((top_k > 0) | (top_p < 1.0))
    exact_tokens = jax.lax.cond(  # the sort only when some row filters
        jnp.any(filtered_rows),
        lambda: sample_tokens(logits, seeds, counters, temperature, top_k, top_p, None,
                              vocab_limit)[0],
        lambda: fused_tokens)
    # per row: a filtered row's token is the exact sampler's, any other row's its own fused draw
    tokens = jnp.where(filtered_rows, exact_tokens, fused_tokens)
    if forced is not None:
        tokens = jnp.where(forced >= 0, forced, tokens).astype(jnp.int32)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=1)[:, 0].astype(jnp.float32)
    # (x - max) first: at temperatures near 0 both terms are huge and their difference small
    logprobs = (chosen / scale[:, 0] - m) - jnp.log(s)
    return tokens, clamp_logprob(logprobs)


def sampler(name: str):
    """The sampling function of a ``serving`` sampler name (``SAMPLERS``)."""
    if name == "exact":
        return sample_tokens
    if name == "fused":
        return sample_tokens_fused
    raise ValueError(f"sampler {name!r} not in {SAMPLERS}")

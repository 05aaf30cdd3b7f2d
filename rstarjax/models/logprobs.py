"""Token log-probabilities and entropies from final hidden states, vocabulary chunk by chunk.

Alignment (docs/design.md TrainBatch): position t-1 predicts ``targets[:, t]``, so the results are
[B, L] arrays whose column t belongs to target t; column 0 has no prediction and is 0 (its loss
mask is always 0: it is a prompt token).

The full logits ``[B, L, V]`` never exist: ``chunk_len`` positions (every row of the batch at once)
are projected onto the vocabulary at a time, inside ``jax.checkpoint`` so the backward pass
recomputes each chunk's logits instead of keeping them. Peak memory O(B * chunk_len * V) instead
of O(B * L * V): for Qwen3 (V = 151,936) at L = 14K one row's float32 logits are 8.5 GB, a
1,024-position chunk 0.6 GB. The price is one more vocabulary matmul in the backward pass, paid
only when there is more than one chunk (rows no longer than ``chunk_len`` keep their logits, as a
plain full-logits loss would).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rstarjax.models.sharding import constrain


def logprobs_and_entropy_of_logits(logits: jax.Array, targets: jax.Array
                                   ) -> tuple[jax.Array, jax.Array]:
    """f32 log pi(targets | ...) and the entropy of each distribution, from logits [..., V] and
    int targets [...] of the same leading shape (no shift)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    probs = jnp.exp(logits - lse[..., None])
    return picked - lse, lse - jnp.sum(probs * logits, axis=-1)


def token_logprobs_and_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log pi(targets[:, t] | <t), entropy at t), both f32[B, L] (column 0 is 0), from the full
    logits f[B, L, V] of a forward over ``targets`` int[B, L]: logits[:, t-1] predicts
    targets[:, t]. The full-logits form of ``token_logprobs_from_hidden`` (short rows, references).
    In packed rows the first token of each segment is a prompt token with loss mask 0, so the
    cross-segment prediction is never trained on."""
    if logits.ndim != 3 or targets.ndim != 2 or logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} must be [B, L, V] and [B, L]")
    lp, ent = logprobs_and_entropy_of_logits(logits[:, :-1], targets[:, 1:])
    zero = jnp.zeros((targets.shape[0], 1), jnp.float32)
    return jnp.concatenate([zero, lp], axis=1), jnp.concatenate([zero, ent], axis=1)


def _projection_equations(vocab_major: bool) -> tuple[str, str, str]:
    """einsum equations of the projection [B, C, D] x unembed -> [B, C, V] and of its two
    transposes (cotangent -> d_hidden, cotangent -> d_unembed), for either weight layout."""
    w = "vd" if vocab_major else "dv"
    return f"bcd,{w}->bcv", f"bcv,{w}->bcd", f"bcv,bcd->{w}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _project_with_compute_dtype_backward(hidden: jax.Array, unembed: jax.Array,
                                         vocab_major: bool) -> jax.Array:
    """f32 logits of ``hidden`` (a dtype narrower than float32) times ``unembed`` cast to it,
    whose backward also runs in the hidden states' dtype with float32 accumulation.

    Why: the float32 logits make JAX's own transpose multiply a float32 cotangent, so both
    backward matmuls (d_hidden = ct @ W, d_W = ct^T @ hidden) ran in float32 on TF32 tensor cores
    with twice the bytes. An H200 profile of the Qwen3-1.7B train step at 1 x 8,192 tokens
    (jax 0.11.2) spent ~36 ms of its 340 ms in those GEMMs (sm90_xmma_gemm_f32f32_tf32f32_f32,
    8 'nt' of 2.9 ms + 8 'nn' of 1.7 ms, one pair per vocabulary chunk) and ~8 ms in their
    casts. Megatron, MaxText and torch bf16 autocast run them in bf16 with float32 accumulation,
    as this does. The gradients come back in the primal dtypes: d_unembed in the dtype
    ``unembed`` was passed in (the float32 master weight gets the float32-accumulated product,
    not one rounded to bf16 first).
    """
    fwd_eq, _, _ = _projection_equations(vocab_major)
    return jnp.einsum(fwd_eq, hidden, unembed.astype(hidden.dtype),
                      preferred_element_type=jnp.float32)


def _project_fwd(hidden, unembed, vocab_major):
    # The residuals are the primal inputs (already alive): no extra copy of the weight is kept.
    return _project_with_compute_dtype_backward(hidden, unembed, vocab_major), (hidden, unembed)


def _project_bwd(vocab_major, residuals, cotangent):
    hidden, unembed = residuals
    _, d_hidden_eq, d_unembed_eq = _projection_equations(vocab_major)
    ct = cotangent.astype(hidden.dtype)
    d_hidden = jnp.einsum(d_hidden_eq, ct, unembed.astype(hidden.dtype),
                          preferred_element_type=jnp.float32)
    d_unembed = jnp.einsum(d_unembed_eq, ct, hidden, preferred_element_type=jnp.float32)
    return d_hidden.astype(hidden.dtype), d_unembed.astype(unembed.dtype)


_project_with_compute_dtype_backward.defvjp(_project_fwd, _project_bwd)


def _project(hidden: jax.Array, unembed: jax.Array, vocab_major: bool) -> jax.Array:
    """[B, C, D] -> f32[B, C, V] in the hidden states' dtype with float32 accumulation, forward
    and backward. Float32 (or wider) hidden states keep JAX's own transpose: nothing to save
    there, and the gradients stay exactly those of the plain einsum."""
    if jnp.finfo(hidden.dtype).bits < 32:
        logits = _project_with_compute_dtype_backward(hidden, unembed, vocab_major)
    else:
        fwd_eq, _, _ = _projection_equations(vocab_major)
        logits = jnp.einsum(fwd_eq, hidden, unembed.astype(hidden.dtype),
                            preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "seq", "act_vocab"))


def token_logprobs_from_hidden(hidden: jax.Array, unembed: jax.Array, targets: jax.Array, *,
                               vocab_major: bool, chunk_len: int = 1024,
                               with_entropy: bool = True, temperature: float = 1.0
                               ) -> tuple[jax.Array, jax.Array | None]:
    """(log pi(targets[:, t] | <t), entropy at t), both f32[B, L] (column 0 is 0).

    ``hidden`` [B, L, D]: the final-normed hidden states in the compute dtype; ``unembed``: the
    output projection, [D, V], or [V, D] with ``vocab_major=True`` (tied input embedding; cast to
    the hidden states' dtype, as the model's logits are). ``with_entropy=False`` returns
    (log-probs, None) and skips the entropy's extra pass over the chunk. ``temperature``
    (static): of the distribution ``softmax(logits / temperature)``, the one rollouts sampled
    from (``serving/sampling.py``); 1.0 leaves the logits untouched.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"hidden {hidden.shape} must be [B, L, D] matching targets {targets.shape}")
    if chunk_len <= 0:
        raise ValueError(f"chunk_len must be > 0, got {chunk_len}")
    b, l, d = hidden.shape
    n = l - 1
    zero = jnp.zeros((b, 1), jnp.float32)
    if n == 0:
        return zero, (zero if with_entropy else None)

    def one_chunk(h, tg):
        logits = _project(h, unembed, vocab_major)
        if temperature != 1.0:
            logits = logits / temperature
        lp, ent = logprobs_and_entropy_of_logits(logits, tg)
        return (lp, ent) if with_entropy else (lp, None)

    h, tg = hidden[:, :-1], targets[:, 1:].astype(jnp.int32)
    if n <= chunk_len:  # one chunk: nothing to save by recomputing it
        lp, ent = one_chunk(h, tg)
    else:
        num = -(-n // chunk_len)
        pad = num * chunk_len - n
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        tg = jnp.pad(tg, ((0, 0), (0, pad)))
        h = jnp.swapaxes(h.reshape(b, num, chunk_len, d), 0, 1)
        tg = jnp.swapaxes(tg.reshape(b, num, chunk_len), 0, 1)
        lp, ent = jax.lax.map(lambda xs: jax.checkpoint(one_chunk)(*xs), (h, tg))
        unchunk = lambda x: jnp.swapaxes(x, 0, 1).reshape(b, num * chunk_len)[:, :n]
        lp = unchunk(lp)
        ent = unchunk(ent) if with_entropy else None
    lp = jnp.concatenate([zero, lp], axis=1)
    return lp, (jnp.concatenate([zero, ent], axis=1) if with_entropy else None)

"""BASELINE for benchmarks only: the dense-cache slot engine, its scheduler and generate() as
they were at commit 01727d7 (before the paged engine), vendored verbatim in one module so
``benchmarks/serving.py`` can run them side by side with the current engine in the same run.

Changes from the original files, nothing else: the three modules are concatenated; imports
point at this module; the dense KV cache and the cached forward it decodes with
(``KVCache``, ``Qwen3.decode`` at that commit; the package no longer has them) are copied in
as ``KVCache`` and ``dense_decode``; the scheduler reuses the current ``Finish``/``CallTool``/``Extend``
classes (the agent loop returns those); the engine counts occupied slots per decode step
(``occupied_slot_steps``, and ``occupied_while_queued`` over the steps the scheduler takes
while rollouts wait to be admitted) so the benchmark can report its concurrency. Not part
of the package; do not import it from rstarjax.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import functools
import threading
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstarjax.models.qwen3 import Qwen3, attend, decoder_layer, rope_angles
from rstarjax.serving.sampling import SamplingParams, sample_tokens
from rstarjax.serving.scheduler import CallTool, Extend, Finish  # noqa: F401  (the agent loop's)


# ---- the dense cache and its cached forward (rstarjax/models at commit 01727d7) ------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """``k``, ``v``: ``[num_layers, B, S, num_kv_heads, head_dim]``; ``lengths``: int32[B],
    the number of tokens stored per row (row b's valid entries are ``[0, lengths[b])``)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def init(cls, cfg, batch: int, max_len: int, dtype=jnp.bfloat16) -> "KVCache":
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"KVCache.init needs batch > 0 and max_len > 0, got {batch}, {max_len}")
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def replace(self, **changes) -> "KVCache":
        return dataclasses.replace(self, **changes)


def dense_decode(model: Qwen3, tokens: jax.Array, cache: KVCache, num_new: jax.Array
                 ) -> tuple[jax.Array, KVCache]:
    """Per-row cached forward: token i of row b sits at position ``lengths[b] + i``, is written
    there (out-of-range writes dropped, never clamped) and attends to cache entries
    ``<= lengths[b] + i``; returns lengths + num_new. (``Qwen3.decode`` as it was, its layer
    loop and embedding/logits helpers being the model's.)"""
    cfg = model.config
    if tokens.ndim != 2 or tokens.shape[0] != cache.batch:
        raise ValueError(f"tokens {tokens.shape} must be [B={cache.batch}, T]")
    b, t = tokens.shape
    s = cache.max_len
    positions = cache.lengths[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)
    sin, cos = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
    mask = (jnp.arange(s)[None, None, :] <= positions[:, :, None])[:, None]  # [B,1,T,S]
    rows = jnp.arange(b)[:, None]

    def layer_fn(p, x, kv, i):
        ck_all, cv_all = kv

        def attention(q, k, v):
            ck = ck_all.at[i, rows, positions].set(k.astype(ck_all.dtype), mode="drop")
            cv = cv_all.at[i, rows, positions].set(v.astype(cv_all.dtype), mode="drop")
            k_l = jax.lax.dynamic_index_in_dim(ck, i, 0, keepdims=False).astype(q.dtype)
            v_l = jax.lax.dynamic_index_in_dim(cv, i, 0, keepdims=False).astype(q.dtype)
            return attend(q, k_l, v_l, mask, cfg.attention_impl), (ck, cv)

        return decoder_layer(cfg, p, x, sin, cos, attention)

    x, (new_k, new_v) = model._run_layers(model._embed(tokens), sin, cos, layer_fn,
                                          (cache.k, cache.v))
    new_cache = KVCache(k=new_k, v=new_v,
                        lengths=cache.lengths + num_new.astype(cache.lengths.dtype))
    return model._logits(x), new_cache



MAX_STOP_IDS = 8  # per-request stop ids kept on device (padded with -1)


class DoneReason(enum.IntEnum):
    NOT_DONE = 0
    STOP = 1  # emitted one of the request's stop ids (the id is part of the output)
    BUDGET = 2  # sampled its max_new_tokens
    CONTEXT = 3  # the slot's KV cache is full: the sampled token could not be fed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the decode step needs, one row per slot (a pytree; donated each step)."""

    cache: KVCache
    pending: jax.Array  # int32[B]: sampled token not yet fed to the cache
    active: jax.Array  # bool[B]: decoding (not free, not done, not waiting on a tool)
    seeds: jax.Array  # int32[B]
    counters: jax.Array  # int32[B]: tokens sampled so far by the request (RNG stream index)
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # int32[B]
    top_p: jax.Array  # f32[B]
    stop_ids: jax.Array  # int32[B, MAX_STOP_IDS], -1 padded
    budget: jax.Array  # int32[B]: tokens this slot may still sample

    def replace(self, **changes) -> "DecodeState":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class Prefix:
    """Result of ``prefill``: a one-row cache holding the prompt and the first sampled token."""

    cache: KVCache  # batch 1, max_len of the engine
    token: int
    logprob: float
    length: int  # tokens in the cache (prompt length)
    sampling: SamplingParams
    done: DoneReason  # the first token may already end the request


@dataclasses.dataclass
class ResultTokens:
    """Host copy of one ``generate`` step: per slot."""

    tokens: np.ndarray  # int32[B]
    logprobs: np.ndarray  # f32[B]
    valid: np.ndarray  # bool[B]: the slot was decoding this step (token is real)
    done: np.ndarray  # int32[B] DoneReason, nonzero the step a slot stops
    lengths: np.ndarray  # int32[B] tokens in the cache after the step


@dataclasses.dataclass
class SlotToken:
    """The token sampled after ``extend``."""

    token: int
    logprob: float
    done: DoneReason


def default_buckets(max_len: int, min_bucket: int = 16) -> tuple[int, ...]:
    """Powers of two from ``min_bucket`` below ``max_len``, then ``max_len``."""
    out, b = [], min_bucket
    while b < max_len:
        out.append(b)
        b *= 2
    out.append(max_len)
    return tuple(out)


def _stop_row(params: SamplingParams) -> np.ndarray:
    if len(params.stop_ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop ids per request, got {len(params.stop_ids)}")
    row = np.full((MAX_STOP_IDS,), -1, np.int32)
    row[: len(params.stop_ids)] = params.stop_ids
    return row


# ---- jitted programs (module level so every engine with the same shapes shares them) ------

@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("vocab_limit",))
def _row_forward(graphdef, params, row: KVCache, tokens, num_new, seed, counter, temperature,
                 top_k, top_p, forced, vocab_limit=None):
    """Feed ``tokens[0, :num_new]`` into a one-row cache; sample after the last one."""
    model = nnx.merge(graphdef, params)
    logits, row = dense_decode(model, tokens, row, num_new)
    last = jnp.take_along_axis(logits, (num_new - 1)[:, None, None], axis=1)[:, 0]
    tok, lp = sample_tokens(last, seed, counter, temperature, top_k, top_p, forced, vocab_limit)
    return row, tok[0], lp[0]


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_row(state: DecodeState, slot, row: KVCache, pending, active, seed, counter,
             temperature, top_k, top_p, stop_ids, budget) -> DecodeState:
    def put(big, small):
        return jax.lax.dynamic_update_index_in_dim(big, small, slot, 0)

    cache = state.cache
    cache = cache.replace(
        k=jax.lax.dynamic_update_slice_in_dim(cache.k, row.k.astype(cache.k.dtype), slot, 1),
        v=jax.lax.dynamic_update_slice_in_dim(cache.v, row.v.astype(cache.v.dtype), slot, 1),
        lengths=put(cache.lengths, row.lengths[0]),
    )
    return state.replace(
        cache=cache, pending=put(state.pending, pending), active=put(state.active, active),
        seeds=put(state.seeds, seed), counters=put(state.counters, counter),
        temperature=put(state.temperature, temperature), top_k=put(state.top_k, top_k),
        top_p=put(state.top_p, top_p), stop_ids=put(state.stop_ids, stop_ids),
        budget=put(state.budget, budget))


@jax.jit
def _get_row(state: DecodeState, slot) -> KVCache:
    c = state.cache
    return KVCache(k=jax.lax.dynamic_slice_in_dim(c.k, slot, 1, 1),
                   v=jax.lax.dynamic_slice_in_dim(c.v, slot, 1, 1),
                   lengths=jax.lax.dynamic_slice_in_dim(c.lengths, slot, 1, 0))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,),
                   static_argnames=("vocab_limit",))
def _generate_step(graphdef, params, state: DecodeState, forced, vocab_limit=None):
    model = nnx.merge(graphdef, params)
    active = state.active
    num_new = active.astype(jnp.int32)
    logits, cache = dense_decode(model, state.pending[:, None], state.cache, num_new)
    tok, lp = sample_tokens(logits[:, 0], state.seeds, state.counters, state.temperature,
                            state.top_k, state.top_p, forced, vocab_limit)
    budget = state.budget - num_new
    hit_stop = jnp.any(tok[:, None] == state.stop_ids, axis=-1)
    # The new token needs one more cache position to be fed later.
    full = cache.lengths >= cache.max_len
    done = jnp.where(hit_stop, DoneReason.STOP,
                     jnp.where(budget <= 0, DoneReason.BUDGET,
                               jnp.where(full, DoneReason.CONTEXT, DoneReason.NOT_DONE)))
    done = jnp.where(active, done, DoneReason.NOT_DONE).astype(jnp.int32)
    new_state = state.replace(
        cache=cache,
        pending=jnp.where(active, tok, state.pending),
        active=active & (done == DoneReason.NOT_DONE),
        counters=state.counters + num_new,
        budget=budget)
    return new_state, (tok, lp, active, done, cache.lengths)


class Engine:
    """JetStream-style engine over one model replica (see module docstring).

    The engine object keeps a host mirror of each slot's cache length and liveness (one
    decode state per engine), which is what the scheduler reads as free KV capacity.
    """

    def __init__(self, model: nnx.Module, *, num_slots: int, max_len: int,
                 buckets: Sequence[int] | None = None, cache_dtype=None, min_bucket: int = 16,
                 device: jax.Device | None = None, vocab_limit: int | None = None):
        if num_slots < 1 or max_len < 2:
            raise ValueError(f"need num_slots >= 1 and max_len >= 2, got {num_slots}, {max_len}")
        self.config = model.config
        # Ids >= vocab_limit (embedding padding past the tokenizer) are never sampled.
        self.vocab_limit = vocab_limit
        self.graphdef, self.params = nnx.split(model)
        # A serving slice on its own device (group): weights and cache live there. Without
        # `device` the model's arrays are served where they are (colocated, no copy).
        self.device = device
        if device is not None:
            self.params = jax.device_put(self.params, device)
        self.num_slots = int(num_slots)
        self.max_len = int(max_len)
        self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(max_len, min_bucket)
        if self.buckets[-1] > max_len:
            raise ValueError(f"bucket {self.buckets[-1]} exceeds max_len {max_len}")
        self.cache_dtype = cache_dtype or self.config.dtype
        self._slot_len = np.zeros(num_slots, np.int64)  # host mirror of cache lengths
        self._slot_live = np.zeros(num_slots, bool)  # holds a request (decoding or waiting)
        self.busy_seconds = 0.0  # time spent inside engine programs (incl. the host sync)
        self.prefill_tokens = 0  # tokens run through prefill/extend forwards (unpadded)
        self.occupied_slot_steps = 0  # benchmark instrumentation: live slots summed over steps
        self.generate_calls = 0
        self.occupied_while_queued = 0  # ... over the steps taken while rollouts were queued
        self.steps_while_queued = 0

    # ---- JetStream contract ----------------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self.num_slots

    @property
    def max_prefill_length(self) -> int:
        return self.buckets[-1]

    def init_decode_state(self) -> DecodeState:
        b = self.num_slots
        self._slot_len[:] = 0
        self._slot_live[:] = False
        state = DecodeState(
            cache=KVCache.init(self.config, b, self.max_len, self.cache_dtype),
            pending=jnp.zeros(b, jnp.int32), active=jnp.zeros(b, bool),
            seeds=jnp.zeros(b, jnp.int32), counters=jnp.zeros(b, jnp.int32),
            temperature=jnp.zeros(b, jnp.float32), top_k=jnp.zeros(b, jnp.int32),
            top_p=jnp.ones(b, jnp.float32), stop_ids=jnp.full((b, MAX_STOP_IDS), -1, jnp.int32),
            budget=jnp.zeros(b, jnp.int32))
        return state if self.device is None else jax.device_put(state, self.device)

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} tokens exceed the largest prefill bucket {self.buckets[-1]}")

    def prefill(self, params, tokens: Sequence[int], true_length: int | None = None,
                existing_prefix: Prefix | None = None, *, sampling: SamplingParams | None = None,
                forced_token: int = -1) -> Prefix:
        """Run a prompt (or append it to ``existing_prefix``) and sample its first token."""
        sampling = sampling or (existing_prefix.sampling if existing_prefix else SamplingParams())
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        n = int(true_length if true_length is not None else tokens.shape[0])
        if n < 1 or n > tokens.shape[0]:
            raise ValueError(f"true_length {n} must be in [1, {tokens.shape[0]}]")
        tokens = tokens[:n]
        if existing_prefix is not None:
            # Feed the prefix's pending token first, exactly like extend.
            tokens = np.concatenate([[existing_prefix.token], tokens]).astype(np.int32)
            row, start, counter = existing_prefix.cache, existing_prefix.length, 1
        else:
            row, start, counter = self._empty_row(), 0, 0
        if start + len(tokens) > self.max_len:
            raise ValueError(f"prompt of {start + len(tokens)} tokens does not fit max_len "
                             f"{self.max_len}")
        row, tok, lp = self._forward(params, row, tokens, sampling, counter, forced_token)
        length = start + len(tokens)
        done = self._first_token_done(tok, sampling, sampling.max_new_tokens, length)
        return Prefix(cache=row, token=tok, logprob=lp, length=length, sampling=sampling,
                      done=done)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Place a prefix in ``slot``; the slot decodes from its first token on."""
        self._check_slot(slot)
        s = prefix.sampling
        t0 = time.perf_counter()
        state = _set_row(
            decode_state, jnp.int32(slot), prefix.cache, jnp.int32(prefix.token),
            jnp.bool_(prefix.done == DoneReason.NOT_DONE), jnp.int32(s.seed), jnp.int32(1),
            jnp.float32(s.temperature), jnp.int32(s.top_k), jnp.float32(s.top_p),
            jnp.asarray(_stop_row(s)), jnp.int32(s.max_new_tokens - 1))
        self.busy_seconds += time.perf_counter() - t0
        self._slot_len[slot] = prefix.length
        self._slot_live[slot] = True
        return state

    def generate(self, params, decode_state: DecodeState,
                 forced: np.ndarray | None = None) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every active slot. ``forced[b] >= 0`` teacher-forces slot b."""
        if forced is None:
            if getattr(self, "_no_force", None) is None:
                self._no_force = jnp.full(self.num_slots, -1, jnp.int32)
            f = self._no_force
        else:
            f = jnp.asarray(forced, jnp.int32)
        t0 = time.perf_counter()
        state, (tok, lp, valid, done, lengths) = _generate_step(self.graphdef, params,
                                                                decode_state, f,
                                                                vocab_limit=self.vocab_limit)
        res = ResultTokens(*jax.device_get((tok, lp, valid, done, lengths)))
        self.busy_seconds += time.perf_counter() - t0
        self.occupied_slot_steps += int(self._slot_live.sum())  # benchmark instrumentation
        self.generate_calls += 1
        self._slot_len[res.valid] = res.lengths[res.valid]
        return state, res

    def free_resource(self, slot: int) -> None:
        """Release ``slot`` (its cache rows are simply overwritten by the next insert).

        The decode state is not touched (JetStream's signature has no state): free a slot
        only once it stopped decoding (a ``done`` result, or while it waits on a tool);
        ``insert`` into it re-initialises everything on device."""
        self._check_slot(slot)
        self._slot_live[slot] = False
        self._slot_len[slot] = 0

    # ---- multi-turn additions -------------------------------------------------------------
    def extend(self, params, decode_state: DecodeState, slot: int, tokens: Sequence[int], *,
               max_new_tokens: int | None = None, forced_token: int = -1
               ) -> tuple[DecodeState, SlotToken]:
        """Append ``tokens`` (e.g. a tool response turn) to a live slot without re-prefilling.

        Feeds the slot's pending token followed by ``tokens``, samples the next token and
        re-activates the slot. ``max_new_tokens`` (if given) is the slot's new budget of
        sampled tokens, counting the one sampled here. Raises ``ValueError`` when the
        conversation would not fit the slot (``free_tokens_in_slot``)."""
        self._check_slot(slot)
        if not self._slot_live[slot]:
            raise ValueError(f"slot {slot} holds no request")
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        need = len(tokens) + 1
        if self._slot_len[slot] + need > self.max_len:
            raise ValueError(f"slot {slot}: {self._slot_len[slot]} + {need} tokens exceed "
                             f"max_len {self.max_len}")
        t0 = time.perf_counter()
        row = _get_row(decode_state, jnp.int32(slot))
        host = jax.device_get((
            decode_state.pending[slot], decode_state.seeds[slot], decode_state.counters[slot],
            decode_state.temperature[slot], decode_state.top_k[slot], decode_state.top_p[slot],
            decode_state.budget[slot], decode_state.stop_ids[slot]))
        pending, seed, counter, top_k, budget = (int(host[i]) for i in (0, 1, 2, 4, 6))
        temp, top_p, stop_row = float(host[3]), float(host[5]), np.asarray(host[7])
        self.busy_seconds += time.perf_counter() - t0
        sampling = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=seed)
        feed = np.concatenate([[pending], tokens]).astype(np.int32)
        row, tok, lp = self._forward(params, row, feed, sampling, counter, forced_token)
        budget = budget if max_new_tokens is None else int(max_new_tokens)
        length = int(self._slot_len[slot]) + need
        done = self._first_token_done(tok, dataclasses.replace(
            sampling, stop_ids=tuple(int(x) for x in stop_row if x >= 0)), budget, length)
        t0 = time.perf_counter()
        state = _set_row(decode_state, jnp.int32(slot), row, jnp.int32(tok),
                         jnp.bool_(done == DoneReason.NOT_DONE), jnp.int32(seed),
                         jnp.int32(counter + 1), jnp.float32(temp), jnp.int32(top_k),
                         jnp.float32(top_p), jnp.asarray(stop_row), jnp.int32(budget - 1))
        self.busy_seconds += time.perf_counter() - t0
        self._slot_len[slot] = length
        return state, SlotToken(token=tok, logprob=lp, done=done)

    def update_params(self, new_params) -> None:
        """Swap the weights (an ``nnx.split`` state with the same structure). No copy: the
        engine keeps a reference, so a colocated trainer's arrays are served directly."""
        if jax.tree.structure(new_params) != jax.tree.structure(self.params):
            raise ValueError("update_params: the new state's tree structure differs from the "
                             "served model's")
        self.params = new_params if self.device is None else jax.device_put(new_params,
                                                                             self.device)

    # ---- capacity for the scheduler --------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_slots * self.max_len

    def free_kv_tokens(self) -> int:
        """KV positions not holding any live request's tokens."""
        return int(self.kv_capacity_tokens - self._slot_len[self._slot_live].sum())

    def free_slots(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(~self._slot_live)]

    def free_tokens_in_slot(self, slot: int) -> int:
        return int(self.max_len - self._slot_len[slot])

    def slot_length(self, slot: int) -> int:
        return int(self._slot_len[slot])

    # ---- internals -------------------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")

    def _empty_row(self) -> KVCache:
        # Contents beyond `lengths` are never read, so any row with length 0 works; keep one.
        if getattr(self, "_empty", None) is None:
            row = KVCache.init(self.config, 1, self.max_len, self.cache_dtype)
            self._empty = row if self.device is None else jax.device_put(row, self.device)
        return self._empty

    def _forward(self, params, row, feed: np.ndarray, sampling: SamplingParams, counter: int,
                 forced_token: int):
        n = len(feed)
        bucket = self.bucket_for(n)
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :n] = feed
        t0 = time.perf_counter()
        row, tok, lp = _row_forward(
            self.graphdef, params, row, jnp.asarray(padded), jnp.array([n], jnp.int32),
            jnp.array([sampling.seed], jnp.int32), jnp.array([counter], jnp.int32),
            jnp.array([sampling.temperature], jnp.float32),
            jnp.array([sampling.top_k], jnp.int32), jnp.array([sampling.top_p], jnp.float32),
            jnp.array([forced_token], jnp.int32), vocab_limit=self.vocab_limit)
        tok, lp = int(tok), float(lp)
        self.busy_seconds += time.perf_counter() - t0
        self.prefill_tokens += n
        return row, tok, lp

    def _first_token_done(self, tok: int, sampling: SamplingParams, budget: int,
                          length: int) -> DoneReason:
        if tok in sampling.stop_ids:
            return DoneReason.STOP
        if budget - 1 <= 0:  # `budget` counts the token just sampled
            return DoneReason.BUDGET
        if length >= self.max_len:
            return DoneReason.CONTEXT
        return DoneReason.NOT_DONE

POLICIES = ("dynamic", "static")


def capacity_for(engine: Engine, max_rollout_len: int) -> int:
    """Rollouts a slice can still admit without any risk of overflowing its KV cache
    (rStar2-Agent §3.2: "given a maximum rollout length L, we estimate the maximum number of
    rollouts K that each GPU can safely handle"): free tokens minus the growth every live
    rollout may still need, divided by L, and never more than the free slots."""
    if max_rollout_len > engine.max_len:
        raise ValueError(f"max rollout length {max_rollout_len} exceeds the slot size "
                         f"{engine.max_len}")
    live = [s for s in range(engine.num_slots) if s not in set(engine.free_slots())]
    reserved = sum(max(0, max_rollout_len - engine.slot_length(s)) for s in live)
    by_tokens = (engine.free_kv_tokens() - reserved) // max_rollout_len
    return max(0, min(len(engine.free_slots()), by_tokens))


@dataclasses.dataclass
class SliceStats:
    busy_s: float = 0.0  # inside engine programs
    episodes: int = 0
    decode_steps: int = 0
    tool_wait_s: float = 0.0  # summed over tool calls: dispatch -> ids ready
    prefill_tokens: int = 0


@dataclasses.dataclass
class ScheduleStats:
    makespan_s: float
    slices: list[SliceStats]

    @property
    def busy_fraction(self) -> list[float]:
        return [s.busy_s / self.makespan_s if self.makespan_s > 0 else 0.0 for s in self.slices]

    def as_dict(self) -> dict[str, float]:
        return {
            "makespan_s": self.makespan_s,
            "busy_fraction_mean": float(np.mean(self.busy_fraction)),
            "tool_wait_s": float(sum(s.tool_wait_s for s in self.slices)),
            "decode_steps": float(sum(s.decode_steps for s in self.slices)),
            "max_slice_steps": float(max(s.decode_steps for s in self.slices)),
            "prefill_tokens": float(sum(s.prefill_tokens for s in self.slices)),
        }


@dataclasses.dataclass
class _Slot:
    episode: Episode
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    waiting: concurrent.futures.Future | None = None
    wait_since: float = 0.0
    decoding: bool = True


class _Source:
    """Where a slice gets its next episode: the shared queue or its own static share."""

    def __init__(self, items):
        self._q = collections.deque(items)
        self._lock = threading.Lock()

    def pop(self) -> Episode | None:
        with self._lock:
            return self._q.popleft() if self._q else None

    def __len__(self):
        with self._lock:
            return len(self._q)


class RolloutScheduler:
    def __init__(self, engines: Sequence[Engine], *, max_rollout_len: int,
                 policy: str = "dynamic", sync_turns: bool | None = None,
                 tool_timeout_s: float = 60.0, timeout_s: float = 3600.0,
                 poll_s: float = 0.005):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} not in {POLICIES}")
        if not engines:
            raise ValueError("need at least one engine")
        self.engines = list(engines)
        self.max_rollout_len = int(max_rollout_len)
        for e in self.engines:
            capacity_for(e, self.max_rollout_len)  # validates L against the slot size
        self.policy = policy
        self.sync_turns = (policy == "static") if sync_turns is None else bool(sync_turns)
        self.tool_timeout_s = float(tool_timeout_s)
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s)

    def run(self, episodes: Sequence[Episode]) -> ScheduleStats:
        """Run every episode to completion (their own objects collect the results)."""
        n = len(self.engines)
        if self.policy == "dynamic":
            shared = _Source(episodes)
            sources = [shared] * n
        else:
            sources = [_Source(episodes[i::n]) for i in range(n)]
        stats = [SliceStats() for _ in range(n)]
        errors: list[BaseException] = []
        stop = threading.Event()
        deadline = time.monotonic() + self.timeout_s
        t0 = time.perf_counter()
        threads = [threading.Thread(target=self._guarded, daemon=True, name=f"slice-{i}",
                                    args=(e, src, st, stop, deadline, errors))
                   for i, (e, src, st) in enumerate(zip(self.engines, sources, stats))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + 5.0)
        stop.set()
        makespan = time.perf_counter() - t0
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"rollouts did not finish within {self.timeout_s} s")
        return ScheduleStats(makespan, stats)

    # ---- one slice --------------------------------------------------------------------------
    def _guarded(self, *args):
        errors, stop = args[-1], args[3]
        try:
            self._drive(*args[:-1])
        except BaseException as e:  # surfaced by run(); stop the other slices too
            errors.append(e)
            stop.set()

    def _drive(self, engine: Engine, source: _Source, stats: SliceStats,
               stop: threading.Event, deadline: float):
        params = engine.params
        state = engine.init_decode_state()
        slots: dict[int, _Slot] = {}
        busy0, prefill0 = engine.busy_seconds, engine.prefill_tokens
        while not stop.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError("rollout slice passed its deadline")
            params = engine.params  # update_params between runs takes effect here
            state = self._admit(engine, params, state, slots, source, stats)
            if not slots:
                if len(source) == 0:
                    break
                continue
            decoding = [s for s, r in slots.items() if r.decoding]
            if decoding and len(source):  # benchmark instrumentation
                engine.occupied_while_queued += int(engine._slot_live.sum())
                engine.steps_while_queued += 1
            if decoding:
                forced = np.full(engine.num_slots, -1, np.int32)
                for s in decoding:
                    forced[s] = slots[s].episode.forced_token(len(slots[s].ids))
                state, res = engine.generate(params, state, forced)
                stats.decode_steps += 1
                for s in decoding:
                    if res.valid[s]:
                        self._add_token(engine, slots, s, int(res.tokens[s]),
                                        float(res.logprobs[s]), DoneReason(int(res.done[s])))
            state = self._resume_tools(engine, params, state, slots, stats)
            if not any(r.decoding for r in slots.values()) and slots:
                waiting = [r.waiting for r in slots.values() if r.waiting is not None]
                if waiting:  # nothing to decode: block (bounded) until a tool call returns
                    concurrent.futures.wait(waiting, timeout=self.poll_s * 10,
                                            return_when=concurrent.futures.FIRST_COMPLETED)
        stats.busy_s += engine.busy_seconds - busy0
        stats.prefill_tokens += engine.prefill_tokens - prefill0

    def _admit(self, engine, params, state, slots, source, stats):
        if self.sync_turns and slots:
            return state  # static batch inference: the next wave waits for the whole batch
        k = capacity_for(engine, self.max_rollout_len)
        for _ in range(k):
            ep = source.pop()
            if ep is None:
                break
            if len(ep.prompt_ids) >= self.max_rollout_len:
                raise ValueError(f"prompt of {len(ep.prompt_ids)} tokens leaves no room in the "
                                 f"maximum rollout length {self.max_rollout_len}")
            slot = engine.free_slots()[0]
            sp = dataclasses.replace(ep.sampling,
                                     max_new_tokens=min(ep.sampling.max_new_tokens,
                                                        self.max_rollout_len - len(ep.prompt_ids)))
            prefix = engine.prefill(params, ep.prompt_ids, sampling=sp,
                                    forced_token=ep.forced_token(0))
            state = engine.insert(prefix, state, slot)
            slots[slot] = _Slot(ep)
            stats.episodes += 1
            self._add_token(engine, slots, slot, prefix.token, prefix.logprob, prefix.done)
        return state

    def _add_token(self, engine, slots, s, tok, lp, done: DoneReason):
        run = slots[s]
        run.ids.append(tok)
        run.logprobs.append(lp)
        if done == DoneReason.NOT_DONE:
            return
        action = run.episode.on_turn_end(run.ids, run.logprobs, done)
        run.ids, run.logprobs, run.decoding = [], [], False
        if isinstance(action, CallTool):
            run.waiting, run.wait_since = action.ids, time.monotonic()
        else:
            engine.free_resource(s)
            del slots[s]

    def _resume_tools(self, engine, params, state, slots, stats):
        if self.sync_turns:
            # Lock-step turns: nothing resumes while a slot still decodes or a call is out.
            if any(r.decoding for r in slots.values()):
                return state
            if any(r.waiting is not None and not r.waiting.done() for r in slots.values()):
                if all(time.monotonic() - r.wait_since < self.tool_timeout_s
                       for r in slots.values() if r.waiting is not None):
                    return state
        for s in list(slots):
            run = slots[s]
            if run.waiting is None:
                continue
            if not run.waiting.done():
                if time.monotonic() - run.wait_since > self.tool_timeout_s:
                    run.waiting.cancel()
                    run.episode.on_abort(f"tool call did not return within {self.tool_timeout_s} s")
                    engine.free_resource(s)
                    del slots[s]
                continue
            fut, run.waiting = run.waiting, None
            stats.tool_wait_s += time.monotonic() - run.wait_since
            try:
                ids = list(fut.result(timeout=0))
            except BaseException as e:  # the tool layer failed: infrastructure, end cleanly
                run.episode.on_abort(f"tool call failed: {e!r}")
                engine.free_resource(s)
                del slots[s]
                continue
            action = run.episode.on_tool_ready(ids, engine.free_tokens_in_slot(s) - 1)
            if isinstance(action, Finish):
                engine.free_resource(s)
                del slots[s]
                continue
            state, first = engine.extend(params, state, s, action.ids,
                                         max_new_tokens=action.max_new_tokens,
                                         forced_token=run.episode.forced_token(0))
            run.decoding = True
            self._add_token(engine, slots, s, first.token, first.logprob, first.done)
        return state

@dataclasses.dataclass
class Completion:
    token_ids: list[int]  # sampled ids, stop id included when it stopped on one
    logprobs: list[float]  # policy log-prob of each sampled id
    finish: str  # "stop" | "length" | "context"
    prompt_len: int = 0


_FINISH = {DoneReason.STOP: "stop", DoneReason.BUDGET: "length", DoneReason.CONTEXT: "context"}


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: Sequence[int] | None = None,
    num_slots: int = 8,
    *,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    max_len: int | None = None,
    engine: Engine | None = None,
    timeout_s: float = 3600.0,
    vocab_limit: int | None = None,
) -> list[Completion]:
    """Complete every prompt (lists of token ids); returns one ``Completion`` per prompt, in order.

    ``model`` is a ``Qwen3`` (an engine with ``num_slots`` slots is built) or ignored when
    ``engine`` is given. Request i samples with seed ``seed + i``, so results do not depend on
    ``num_slots`` or on which slot a prompt lands in. Slots are refilled the step a request
    finishes. ``timeout_s`` bounds the whole call (``TimeoutError``). ``vocab_limit``: ids at or
    past it (embedding padding beyond the tokenizer) are never sampled."""
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if engine is None:
        longest = max(len(p) for p in prompts) + max_new_tokens
        engine = Engine(model, num_slots=min(num_slots, len(prompts)),
                        max_len=max_len or longest, vocab_limit=vocab_limit)
    stops = tuple(stop_ids or ())
    params = engine.params
    state = engine.init_decode_state()
    queue = collections.deque(range(len(prompts)))
    out: list[Completion | None] = [None] * len(prompts)
    slot_req: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s

    def admit(state):
        while queue and engine.free_slots():
            i = queue.popleft()
            sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed + i,
                                max_new_tokens=max_new_tokens, stop_ids=stops)
            prefix = engine.prefill(params, prompts[i], sampling=sp)
            comp = Completion([prefix.token], [prefix.logprob], "", len(prompts[i]))
            out[i] = comp
            if prefix.done != DoneReason.NOT_DONE:
                comp.finish = _FINISH[prefix.done]
                continue
            slot = engine.free_slots()[0]
            state = engine.insert(prefix, state, slot)
            slot_req[slot] = i
        return state

    state = admit(state)
    while slot_req:
        if time.monotonic() > deadline:
            raise TimeoutError(f"generate did not finish within {timeout_s} s")
        state, res = engine.generate(params, state)
        for slot in list(slot_req):
            if not res.valid[slot]:
                continue
            comp = out[slot_req[slot]]
            comp.token_ids.append(int(res.tokens[slot]))
            comp.logprobs.append(float(res.logprobs[slot]))
            if res.done[slot]:
                comp.finish = _FINISH[DoneReason(int(res.done[slot]))]
                engine.free_resource(slot)
                del slot_req[slot]
        state = admit(state)
    return out  # type: ignore[return-value]

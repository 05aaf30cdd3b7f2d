"""The engine's device programs and the state they carry (module-level ``jax.jit``, shared by
every ``serving.engine.Engine`` with the same shapes; docs/serving.md "Page layout").

- ``decode_program``: up to ``steps`` tokens per slot in one call, a ``lax.while_loop`` over
  the active slots only (compacted into a batch of 4, 16, 64 or 256 rows) that stops early
  when none is active or a given number stopped; the host syncs once per call. Attention reads
  only live pages: the Pallas kernels (GPU, TPU) stop at each row's length, the portable
  ``ragged`` path walks a list of the active rows' live pages (padded to a multiple of 16
  pages up to 64, one pass; longer lists 64 pages per loop iteration), the ``reference`` path
  (tests) reads a power-of-two bucket of page-table columns. Compiles: per batch bucket, one
  per list size for ``ragged`` (16, 32, 48, 64, longer), one per context bucket for
  ``reference``, one for the Pallas kernels.
- ``feed_program``: several rows per call (prefill of distinct prompts, ``extend`` of several
  slots, re-prefill after preemption), each row up to ``prefill_chunk`` new tokens (longer
  feeds go in chunks), logits of each row's last token only. Compiles: row buckets (1, 2, ...,
  16) x token buckets x {fresh rows reading their own pages, continuing rows reading the full
  table}.
- ``sample_program`` and ``insert_program``: first tokens of the fed rows (one row can serve
  many samples: the 2G samples of a prompt share its prefill, their page tables pointing at its
  full pages, its last partial page copied), and the slot rows of the decode state. One shape
  per engine (``num_slots`` rows; ``sample_program`` once per row bucket).

Stops: up to ``MAX_STOP_IDS`` stop ids per request, a token budget, and a full slot
(``max_len``), checked on device every step (``DoneReason``).
"""
from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from rstarjax.models.kv_cache import PagedKVCache
from rstarjax.models.qwen3 import paged_forward
from rstarjax.serving.sampling import SamplingParams, sampler as sampler_named

MAX_STOP_IDS = 8  # per-request stop ids kept on device (padded with -1)

class DoneReason(enum.IntEnum):
    NOT_DONE = 0
    STOP = 1  # emitted one of the request's stop ids (the id is part of the output)
    BUDGET = 2  # sampled its max_new_tokens
    CONTEXT = 3  # the slot is full (max_len): the sampled token could not be fed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-slot decoding state on device, one row per slot (a pytree; donated each call).
    The page pool and the page tables are the engine's (host-managed, see module doc)."""

    lengths: jax.Array  # int32[B]: tokens in the slot's cache
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



# ---- what the host reads back from the programs, and what it feeds them ----------------------

def decode_kv_tokens(block: "DecodeBlock") -> int:
    """KV positions a decode call's steps attended to, over its rows: a row that fed n tokens
    and holds L after the call read L - n + 1, ..., L of them (each step attends to the token
    it feeds)."""
    n = block.valid.sum(axis=0).astype(np.int64)
    return int(np.sum(n * block.lengths - n * (n - 1) // 2))


@dataclasses.dataclass
class DecodeBlock:
    """Host copy of one ``decode`` call: ``steps`` rows of per-slot results."""

    tokens: np.ndarray  # int32[steps, B]
    logprobs: np.ndarray  # f32[steps, B]
    valid: np.ndarray  # bool[steps, B]
    done: np.ndarray  # int32[steps, B]
    lengths: np.ndarray  # int32[B] after the call

    @property
    def steps(self) -> int:
        return self.tokens.shape[0]


@dataclasses.dataclass
class SlotToken:
    """A token sampled after a prefill or ``extend``."""

    token: int
    logprob: float
    done: DoneReason


@dataclasses.dataclass
class FeedSample:
    """A token to sample from a fed row's last logits, for a slot (or a detached prefix)."""

    slot: int  # -1: not bound to a slot (JetStream prefill)
    sampling: SamplingParams
    counter: int
    budget: int
    forced: int
    length: int = 0  # tokens in the cache after the feed
    copy: tuple[int, int] | None = None  # (source, destination) page copied before insert


@dataclasses.dataclass
class FeedRow:
    """Tokens to feed into pages (``Engine._run_rows``), then the samples they serve."""

    pages: list[int]  # pages the row writes into (a slot's list or a detached prefix's)
    start: int  # tokens already in them
    tokens: np.ndarray  # to feed
    samples: list[FeedSample]


def empty_decode_state(num_slots: int) -> DecodeState:
    """Every slot free (host-side zeros; the engine places them)."""
    b = num_slots
    return DecodeState(
        lengths=jnp.zeros(b, jnp.int32), pending=jnp.zeros(b, jnp.int32),
        active=jnp.zeros(b, bool), seeds=jnp.zeros(b, jnp.int32),
        counters=jnp.zeros(b, jnp.int32), temperature=jnp.zeros(b, jnp.float32),
        top_k=jnp.zeros(b, jnp.int32), top_p=jnp.ones(b, jnp.float32),
        stop_ids=jnp.full((b, MAX_STOP_IDS), -1, jnp.int32), budget=jnp.zeros(b, jnp.int32))


def stop_row(params: SamplingParams) -> np.ndarray:
    if len(params.stop_ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop ids per request, got {len(params.stop_ids)}")
    row = np.full((MAX_STOP_IDS,), -1, np.int32)
    row[: len(params.stop_ids)] = params.stop_ids
    return row




def pin(pages: tuple, sharding: NamedSharding | None) -> tuple:
    """Keep a slice's pool in its layout (split by kv head) through a program; ``None``: a
    one-device engine, nothing to pin."""
    if sharding is None:
        return pages
    return tuple(jax.lax.with_sharding_constraint(x, sharding) for x in pages)


@functools.partial(jax.jit, static_argnames=("cfg", "kv_sharding"), donate_argnames=("k", "v"))
def feed_program(cfg, weights, k, v, page_table, lengths, tokens, num_new, kv_sharding=None):
    logits, cache = paged_forward(cfg, weights, tokens, PagedKVCache(k, v, page_table, lengths),
                                  num_new)
    return pin(cache.k, kv_sharding), pin(cache.v, kv_sharding), logits


@functools.partial(jax.jit, static_argnames=("vocab_limit", "sampler"))
def sample_program(logits, rows, seeds, counters, temperature, top_k, top_p, forced,
                   vocab_limit=None, sampler="exact"):
    return sampler_named(sampler)(logits[rows], seeds, counters, temperature, top_k, top_p,
                                  forced, vocab_limit)


@functools.partial(jax.jit, static_argnames=("kv_sharding",), donate_argnames=("k", "v", "state"))
def insert_program(k, v, state: DecodeState, copy_src, copy_dst, slot, values: dict,
                   kv_sharding=None):
    """Copy pages (``copy_dst`` out of range: skipped), then write the slot rows (``slot``
    out of range: skipped)."""
    def copy(pages):
        return pages.at[:, copy_dst].set(pages[:, copy_src], mode="drop")

    k, v = pin(tuple(copy(x) for x in k), kv_sharding), pin(tuple(copy(x) for x in v), kv_sharding)
    state = state.replace(**{name: getattr(state, name).at[slot].set(val, mode="drop")
                             for name, val in values.items()})
    return k, v, state


def advance(state: DecodeState, tok, lp, num_new, lengths, max_len):
    """After a step that fed every active slot's pending token and sampled ``tok``."""
    active = state.active
    budget = state.budget - num_new
    hit_stop = jnp.any(tok[:, None] == state.stop_ids, axis=-1)
    full = lengths >= max_len  # the new token needs one more position to be fed later
    done = jnp.where(hit_stop, DoneReason.STOP,
                     jnp.where(budget <= 0, DoneReason.BUDGET,
                               jnp.where(full, DoneReason.CONTEXT, DoneReason.NOT_DONE)))
    done = jnp.where(active, done, DoneReason.NOT_DONE).astype(jnp.int32)
    new = state.replace(lengths=lengths, pending=jnp.where(active, tok, state.pending),
                        active=active & (done == DoneReason.NOT_DONE),
                        counters=state.counters + num_new, budget=budget)
    return new, (tok, lp, active, done)


DECODE_STATIC = ("cfg", "steps", "attention", "vocab_limit", "max_len", "kv_sharding", "interpret",
                 "sampler")
DECODE_DONATED = ("k", "v", "state")


@functools.partial(jax.jit, static_argnames=DECODE_STATIC, donate_argnames=DECODE_DONATED)
def decode_program(cfg, weights, k, v, state: DecodeState, rows, page_table, live_pages,
                   forced, n_steps, stop_after, *, steps, attention, vocab_limit, max_len,
                   kv_sharding=None, interpret=False, sampler="exact"):
    """Up to ``n_steps`` (<= ``steps``) decode steps of the slots ``rows`` (the active ones,
    padded with out-of-range ids: the batch is compacted, idle slots cost nothing); stops
    early when none is active or ``stop_after`` of them stopped (their tool calls and the
    slots they free are the host's to handle). ``sampler`` (``sampling.SAMPLERS``): "fused"
    samples from the logits in the compute dtype (``cfg.dtype``) in one chunked pass."""
    b = state.pending.shape[0]
    in_range = rows < b
    sub = jax.tree.map(lambda x: x[jnp.minimum(rows, b - 1)], state)
    sub = sub.replace(active=sub.active & in_range)
    started = jnp.sum(sub.active)
    table = page_table[jnp.minimum(rows, b - 1)]
    n = rows.shape[0]
    outs = (jnp.zeros((steps, n), jnp.int32), jnp.zeros((steps, n), jnp.float32),
            jnp.zeros((steps, n), bool), jnp.zeros((steps, n), jnp.int32))

    def cond(carry):
        i, _, _, st, _ = carry
        active = jnp.sum(st.active)
        return (i < n_steps) & (active > 0) & (started - active < stop_after)

    def body(carry):
        i, k, v, st, outs = carry
        num_new = st.active.astype(jnp.int32)
        logits, cache = paged_forward(cfg, weights, st.pending[:, None],
                                      PagedKVCache(k, v, table, st.lengths), num_new,
                                      decode_attention=attention, live_pages=live_pages,
                                      kv_sharding=kv_sharding, interpret=interpret)
        if sampler == "fused":  # the LM-head GEMM can write bf16 (XLA may fold the convert)
            logits = logits.astype(cfg.dtype)
        tok, lp = sampler_named(sampler)(logits, st.seeds, st.counters, st.temperature,
                                         st.top_k, st.top_p, forced[i], vocab_limit)
        st, step = advance(st, tok, lp, num_new, cache.lengths, max_len)
        outs = tuple(o.at[i].set(x) for o, x in zip(outs, step))
        return i + 1, pin(cache.k, kv_sharding), pin(cache.v, kv_sharding), st, outs

    _, k, v, sub, outs = jax.lax.while_loop(cond, body, (jnp.int32(0), k, v, sub, outs))
    state = jax.tree.map(lambda full, part: full.at[rows].set(part, mode="drop"), state, sub)
    return k, v, state, outs


# The decode step's GEMMs (``serving.decode_gemms``): XLA's own choice (its Triton GEMMs on a
# GPU), or cuBLAS for all of them (docs/serving.md, "Our decode kernel").
DECODE_GEMMS = {"xla": {}, "cublas": {"xla_gpu_enable_triton_gemm": False}}


@functools.lru_cache(maxsize=None)
def decode_program_with(xla_options: tuple[tuple[str, object], ...]):
    """``decode_program`` compiled with XLA options of its own (``Engine(decode_xla_options=...)``):
    e.g. ``xla_gpu_enable_triton_gemm=False``, cuBLAS for the decode step's GEMMs, whose small
    row counts are where XLA's Triton GEMMs read the weights slowest (docs/serving.md), without
    changing how the rest of the process (the trainer) compiles. One jit per option set."""
    return jax.jit(decode_program.__wrapped__, static_argnames=DECODE_STATIC, donate_argnames=DECODE_DONATED,
                   compiler_options=dict(xla_options))

"""Paged slot engine: JetStream's Engine contract for our Qwen3, plus ``extend``.

One engine owns ``num_slots`` decode slots over one paged KV pool (docs/serving.md, "Page
layout"): ``num_pages`` pages of ``page_size`` tokens, per layer ``[kv_heads, num_pages,
page_size, head_dim]``, and a page table per slot. A slot holds only the pages its tokens fill;
pages are taken as it grows (prefill, decode, ``extend``) and returned when it is freed. The
host keeps the page accounting (``serving.pages.PagePool``) and each slot's page list; the
device keeps the pool and ``DecodeState`` (one row per slot). Weights are a serving copy
(``models.qwen3.ServingWeights``: matmul weights cast once to the serving dtype, bf16 by
default through ``model.dtype``), made at construction and by every ``update_params``.

Token flow of one slot (the "pending token" invariant): the cache holds the conversation minus
its last sampled token, which is *pending*. ``prefill`` runs the prompt and samples the first
token; each decode step feeds every active slot's pending token and samples the next;
``extend(slot, ids)`` feeds ``[pending] + ids`` (a tool response appended to a live
conversation, no re-prefill) and samples the next pending token.

Device programs (module-level ``jax.jit``, shared by every engine with the same shapes):

- ``decode``: up to ``decode_steps`` tokens per slot in one call, a ``lax.while_loop`` over
  the active slots only (compacted into a batch of 4, 16, 64 or 256 rows) that stops early
  when none is active or a given number stopped; the host syncs once per call. Attention reads
  only live pages: the Pallas kernels (GPU, TPU) stop at each row's length, the portable
  ``ragged`` path walks a list of the active rows' live pages (padded to a multiple of 16
  pages up to 64, one pass; longer lists 64 pages per loop iteration), the ``reference`` path
  (tests) reads a power-of-two bucket of page-table columns. Compiles: per batch bucket, one
  per list size for ``ragged`` (16, 32, 48, 64, longer), one per context bucket for
  ``reference``, one for the Pallas kernels.
- ``feed``: several rows per call (prefill of distinct prompts, ``extend`` of several slots,
  re-prefill after preemption), each row up to ``prefill_chunk`` new tokens (longer feeds go
  in chunks), logits of each row's last token only. Compiles: row buckets (1, 2, ..., 16) x token
  buckets (``buckets``) x {fresh rows reading their own pages, continuing rows reading the
  full table}.
- ``sample`` and ``insert``: first tokens of the fed rows (one row can serve many samples:
  the 2G samples of a prompt share its prefill, their page tables pointing at its full pages,
  its last partial page copied), and the slot rows of the decode state. One shape per engine
  (``num_slots`` rows; ``sample`` once per row bucket).

Stops: up to ``MAX_STOP_IDS`` stop ids per request, a token budget, and a full slot
(``max_len``), checked on device every step (``DoneReason``).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rstarjax.models.kv_cache import NO_PAGE, PagedKVCache, pages_for, pool_spec
from rstarjax.models.paged_attention import (DECODE_IMPLEMENTATIONS, RAGGED_CHUNK,
                                             RAGGED_LIST_STEP, default_decode_implementation,
                                             split_kv_axis)
from rstarjax.models.qwen3 import (ServingWeights, paged_forward, serving_config,
                                   serving_weight_specs, serving_weights)
from rstarjax.models.sharding import state_shardings
from rstarjax.serving.handoff import require_process_local
from rstarjax.serving.pages import OutOfPages, PagePool
from rstarjax.serving.sampling import SamplingParams, sample_tokens
from rstarjax.serving.sizing import free_device_bytes, plan_kv

MAX_STOP_IDS = 8  # per-request stop ids kept on device (padded with -1)
ROW_BUCKETS = (1, 2, 4, 8, 16)  # rows per feed call, padded up to one of these


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


@dataclasses.dataclass
class Prefix:
    """Result of ``prefill``: pages of the pool holding the prompt, and its first token. The
    pages belong to the prefix until ``insert`` hands them to a slot (``release`` returns the
    pages of a prefix that is never inserted)."""

    pages: list[int]
    length: int  # tokens in the pages (prompt length)
    token: int
    logprob: float
    sampling: SamplingParams
    done: DoneReason  # the first token may already end the request
    counter: int = 1  # tokens sampled by the request so far
    inserted: bool = False


@dataclasses.dataclass
class ResultTokens:
    """Host copy of one ``generate`` step: per slot."""

    tokens: np.ndarray  # int32[B]
    logprobs: np.ndarray  # f32[B]
    valid: np.ndarray  # bool[B]: the slot was decoding this step (token is real)
    done: np.ndarray  # int32[B] DoneReason, nonzero the step a slot stops
    lengths: np.ndarray  # int32[B] tokens in the cache after the step


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
class StartRequest:
    """Start a request in ``slot``: its cache must hold ``history``, then a token is sampled
    (or ``forced``). Requests with the same ``history`` that is all prompt
    (``prompt_len == len(history)``) share one prefill. The whole pages of the first
    ``prompt_len`` tokens (a prompt, or a rollout resumed after preemption) reuse pages that
    hold the same tokens: another group's of the same call (which is fed first), or those a
    live slot holds, written under the weights being served."""

    slot: int
    history: Sequence[int]
    sampling: SamplingParams
    prompt_len: int = 0
    counter: int = 0  # tokens the request sampled before this one (RNG stream index)
    budget: int | None = None  # tokens it may sample from here, this one included
    forced: int = -1


@dataclasses.dataclass
class _Sample:
    slot: int  # -1: not bound to a slot (JetStream prefill)
    sampling: SamplingParams
    counter: int
    budget: int
    forced: int
    length: int = 0  # tokens in the cache after the feed
    copy: tuple[int, int] | None = None  # (source, destination) page copied before insert


@dataclasses.dataclass
class _Row:
    pages: list[int]  # pages the row writes into (a slot's list or a detached prefix's)
    start: int  # tokens already in them
    tokens: np.ndarray  # to feed
    samples: list[_Sample]


@dataclasses.dataclass
class _StartGroup:
    """How ``Engine.start`` runs the requests of one prompt (``Engine._plan_start``)."""

    leader: StartRequest  # its row feeds the leader's history; the members sample from it
    members: list[StartRequest]
    registered: tuple[int, ...] = ()  # pages from the prefix registry (written by earlier calls)
    writer: int | None = None  # an earlier group of the call whose new pages this one shares
    num_shared: int = 0  # leading pages shared (from the registry or the writer)
    writes_prefix: bool = False  # registers its prompt's full pages once its feed ran


def _start_cost(plan: Sequence[_StartGroup], page_size: int) -> int:
    """Pages a ``start`` plan takes: each leader's pages less the shared ones, plus a copy of
    the partial last page for every other member."""
    total = 0
    for g in plan:
        n = len(g.leader.history)
        total += pages_for(n, page_size) - g.num_shared
        total += (len(g.members) - 1) * (1 if n % page_size else 0)
    return total


@dataclasses.dataclass
class _Slot:
    """Host mirror of a live slot."""

    pages: list[int]
    length: int
    pending: int
    counter: int
    budget: int
    sampling: SamplingParams
    active: bool


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


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ---- jitted programs (module level so every engine with the same shapes shares them) ------

def _serving_fn(graphdef, state, dtype, untie_head):
    return serving_weights(nnx.merge(graphdef, state), dtype, untie_head)


_to_serving = jax.jit(_serving_fn, static_argnums=(0, 2, 3))

# A slice's target layout in the hand-off: the NamedShardings of its serving copy (a
# ``ServingWeights`` of them), one device, or None (wherever the cast program puts it).
Target = ServingWeights | jax.Device | None


def serving_copies(graphdef, state, targets: Sequence[Target], *, dtype,
                   untie_head: bool = False) -> list[ServingWeights]:
    """The weight hand-off (docs/serving.md "Weight hand-off"): the serving copy
    (``models.qwen3.serving_weights``: matmul weights in ``dtype``, one buffer per layer) of the
    ``nnx.split`` model ``state`` (e.g. the trainer's float32 FSDP params) placed in each of
    ``targets``, made once per update in device memory, never through the host.

    Colocated slices (each target's devices, in its mesh order, are ``tensor_parallel``
    consecutive devices of the state's, sorted by id, as ``slices.slice_meshes`` makes them):
    ONE jitted program per tensor size gathers and casts the params straight into a staging
    layout over the state's own devices, the slices' layout on every row of ``tensor``
    devices; each slice then keeps the buffers already on its devices (no copy). Transient
    memory per device: one serving shard (what a device of a slice keeps anyway). The program
    is the same on every process of a multi-host run (it depends on the state's devices and
    the tensor size only). Other targets (devices outside the state's, a state on the host):
    ``jax.device_put`` to the target, then the cast there.

    The copies own their buffers: the trainer may donate its params afterwards."""
    dtype = jnp.dtype(dtype)
    out: list[ServingWeights | None] = [None] * len(targets)
    rows = _staging_rows(state, targets)
    for tensor in sorted({len(r) for r in rows if r}):
        group = [i for i, r in enumerate(rows) if r and len(r) == tensor]
        devices = _sorted_devices(state)
        mesh = Mesh(np.array(devices).reshape(-1, tensor), ("replica", "tensor"),
                    axis_types=(AxisType.Auto, AxisType.Auto))
        target = targets[group[0]]
        specs = (jax.tree.map(lambda _: PartitionSpec(), _serving_shapes(graphdef, state, dtype,
                                                                         untie_head))
                 if isinstance(target, jax.Device) else
                 jax.tree.map(lambda s: s.spec, target, is_leaf=_is_sharding))
        staged = _staging_program(graphdef, dtype, untie_head, _named(mesh, specs))(state)
        for i in group:
            out[i] = _take_row(staged, targets[i], rows[i])
    for i, target in enumerate(targets):
        if out[i] is not None:
            continue
        if target is None:
            out[i] = _to_serving(graphdef, state, dtype, untie_head)
        elif isinstance(target, jax.Device):
            out[i] = _to_serving(graphdef, jax.device_put(state, target), dtype, untie_head)
        else:
            mesh = jax.tree.leaves(target, is_leaf=_is_sharding)[0].mesh
            placed = jax.device_put(state, state_shardings(state, mesh))
            out[i] = jax.jit(_serving_fn, static_argnums=(0, 2, 3), out_shardings=target)(
                graphdef, placed, dtype, untie_head)
    return out


def _is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)


def _named(mesh: Mesh, specs):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def _serving_shapes(graphdef, state, dtype, untie_head):
    return jax.eval_shape(functools.partial(_serving_fn, graphdef, dtype=dtype,
                                            untie_head=untie_head), state)


def _sorted_devices(state) -> list[jax.Device]:
    devices = set()
    for x in jax.tree.leaves(state):
        devices |= x.sharding.device_set
    return sorted(devices, key=lambda d: d.id)


def _staging_rows(state, targets) -> list[tuple[jax.Device, ...] | None]:
    """Per target, its devices when the staging program can place it (see ``serving_copies``),
    else None."""
    leaves = jax.tree.leaves(state)
    if not leaves or not all(isinstance(x, jax.Array) and x.committed for x in leaves):
        return [None] * len(targets)
    devices = _sorted_devices(state)
    rows = []
    for target in targets:
        if isinstance(target, jax.Device):
            row = (target,)
        elif target is None:
            row = None
        else:
            mesh = jax.tree.leaves(target, is_leaf=_is_sharding)[0].mesh
            row = tuple(mesh.devices.flat)
        if row is not None and len(devices) % len(row) == 0:
            t = len(row)
            if row not in {tuple(devices[i:i + t]) for i in range(0, len(devices), t)}:
                row = None
        else:
            row = None
        rows.append(row)
    return rows


@functools.lru_cache(maxsize=64)
def _staging_jit(graphdef, dtype, untie_head, leaves, treedef):
    return jax.jit(functools.partial(_serving_fn, graphdef, dtype=dtype, untie_head=untie_head),
                   out_shardings=jax.tree.unflatten(treedef, leaves))


def _staging_program(graphdef, dtype, untie_head, shardings):
    leaves, treedef = jax.tree.flatten(shardings, is_leaf=_is_sharding)
    return _staging_jit(graphdef, dtype, untie_head, tuple(leaves), treedef)


def _take_row(staged: ServingWeights, target: Target, row) -> ServingWeights:
    """The slice's own arrays out of the staging copy: its devices' buffers, no copy."""
    def take(x, sharding):
        shards = {s.device: s.data for s in x.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            x.shape, sharding, [shards[d] for d in sharding.addressable_devices_indices_map(
                x.shape)])
    if isinstance(target, jax.Device):
        single = jax.sharding.SingleDeviceSharding(target)
        return jax.tree.map(lambda x: take(x, single), staged)
    return jax.tree.map(take, staged, target)


def update_engines(engines: Sequence["Engine"], state) -> None:
    """Hand ``state`` (an ``nnx.split`` state of the served model) to ``engines`` (e.g. every
    slice of a host): one ``serving_copies`` for those that share a model and a dtype, so
    colocated slices cost one program per update, not one per slice. A released engine
    (``Engine.release_memory``) gets its KV pool back."""
    groups: dict[tuple, list[Engine]] = {}
    for e in engines:
        if jax.tree.structure(state) != e._state_structure:
            raise ValueError("update_params: the new state's tree structure differs from the "
                             "served model's")
        groups.setdefault((e.graphdef, e.dtype, e._untie_head), []).append(e)
    for (graphdef, dtype, untie), group in groups.items():
        copies = serving_copies(graphdef, state, [e._handoff_target for e in group],
                                dtype=dtype, untie_head=untie)
        for e, weights in zip(group, copies):
            e._serve(weights)


def _pin(pages: tuple, sharding: NamedSharding | None) -> tuple:
    """Keep a slice's pool in its layout (split by kv head) through a program; ``None``: a
    one-device engine, nothing to pin."""
    if sharding is None:
        return pages
    return tuple(jax.lax.with_sharding_constraint(x, sharding) for x in pages)


@functools.partial(jax.jit, static_argnames=("cfg", "kv_sharding"), donate_argnames=("k", "v"))
def _feed_program(cfg, weights, k, v, page_table, lengths, tokens, num_new, kv_sharding=None):
    logits, cache = paged_forward(cfg, weights, tokens, PagedKVCache(k, v, page_table, lengths),
                                  num_new)
    return _pin(cache.k, kv_sharding), _pin(cache.v, kv_sharding), logits


@functools.partial(jax.jit, static_argnames=("vocab_limit",))
def _sample_program(logits, rows, seeds, counters, temperature, top_k, top_p, forced,
                    vocab_limit=None):
    return sample_tokens(logits[rows], seeds, counters, temperature, top_k, top_p, forced,
                         vocab_limit)


@functools.partial(jax.jit, static_argnames=("kv_sharding",), donate_argnames=("k", "v", "state"))
def _insert_program(k, v, state: DecodeState, copy_src, copy_dst, slot, values: dict,
                    kv_sharding=None):
    """Copy pages (``copy_dst`` out of range: skipped), then write the slot rows (``slot``
    out of range: skipped)."""
    def copy(pages):
        return pages.at[:, copy_dst].set(pages[:, copy_src], mode="drop")

    k, v = _pin(tuple(copy(x) for x in k), kv_sharding), _pin(tuple(copy(x) for x in v), kv_sharding)
    state = state.replace(**{name: getattr(state, name).at[slot].set(val, mode="drop")
                             for name, val in values.items()})
    return k, v, state


def _advance(state: DecodeState, tok, lp, num_new, lengths, max_len):
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


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "attention", "vocab_limit",
                                             "max_len", "kv_sharding", "interpret"),
                   donate_argnames=("k", "v", "state"))
def _decode_program(cfg, weights, k, v, state: DecodeState, rows, page_table, live_pages,
                    forced, n_steps, stop_after, *, steps, attention, vocab_limit, max_len,
                    kv_sharding=None, interpret=False):
    """Up to ``n_steps`` (<= ``steps``) decode steps of the slots ``rows`` (the active ones,
    padded with out-of-range ids: the batch is compacted, idle slots cost nothing); stops
    early when none is active or ``stop_after`` of them stopped (their tool calls and the
    slots they free are the host's to handle)."""
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
        tok, lp = sample_tokens(logits, st.seeds, st.counters, st.temperature, st.top_k,
                                st.top_p, forced[i], vocab_limit)
        st, step = _advance(st, tok, lp, num_new, cache.lengths, max_len)
        outs = tuple(o.at[i].set(x) for o, x in zip(outs, step))
        return i + 1, _pin(cache.k, kv_sharding), _pin(cache.v, kv_sharding), st, outs

    _, k, v, sub, outs = jax.lax.while_loop(cond, body, (jnp.int32(0), k, v, sub, outs))
    state = jax.tree.map(lambda full, part: full.at[rows].set(part, mode="drop"), state, sub)
    return k, v, state, outs


class Engine:
    """JetStream-style engine over one model replica with a paged KV pool (module docstring).

    Sizing (``serving.sizing.plan_kv``): ``kv_pages`` pages if given, else
    ``kv_memory_fraction`` of the device memory free after the serving weights, else (CPU,
    no memory statistics) a dense-equivalent pool of ``num_slots`` maximum-length rows. A
    pool that cannot hold one ``max_len`` rollout is refused at construction.

    Placement: ``device`` (one device), ``mesh`` (a serving slice: a mesh whose ``tensor``
    axis spans its devices, docs/serving.md "Serving slices"), or neither (the weights stay
    where the given model's arrays are). On a mesh the serving copy is split Megatron-style
    (``models.qwen3.serving_weight_specs``) and the pool by kv head where the kv-head count
    allows (``models.kv_cache.pool_spec``); the programs are the same, XLA's SPMD partitioner
    adds the collectives (the Pallas decode kernels run per device on its kv heads).
    ``interpret``: run the Pallas kernels in their interpreter (tests on CPU).
    """

    def __init__(self, model: nnx.Module, *, max_len: int, num_slots: int = 0,
                 page_size: int = 16, kv_pages: int = 0, kv_memory_fraction: float = 0.9,
                 dtype=None, cache_dtype=None, buckets: Sequence[int] | None = None,
                 min_bucket: int = 16, prefill_chunk: int = 2048, max_prefill_tokens: int = 8192,
                 decode_steps: int = 16, min_context: int = 256, decode_attention: str = "auto",
                 device: jax.Device | None = None, mesh: Mesh | None = None,
                 vocab_limit: int | None = None, interpret: bool = False):
        if device is not None and mesh is not None:
            raise ValueError("give an engine a device or a mesh, not both")
        if mesh is not None and "tensor" not in mesh.shape:
            raise ValueError(f"a serving mesh needs a 'tensor' axis, got axes {mesh.axis_names}")
        if mesh is not None and mesh.size != mesh.shape["tensor"]:
            raise ValueError(f"a serving mesh spans its devices with its 'tensor' axis only, got "
                             f"{dict(mesh.shape)}")
        if max_len < 2:
            raise ValueError(f"need max_len >= 2, got {max_len}")
        if decode_steps < 1:
            raise ValueError(f"need decode_steps >= 1, got {decode_steps}")
        self.model_config = model.config
        self.dtype = jnp.dtype(dtype or model.config.dtype)
        self.cfg = serving_config(model.config, self.dtype)
        self.cache_dtype = jnp.dtype(cache_dtype or self.dtype)
        # Ids >= vocab_limit (embedding padding past the tokenizer) are never sampled.
        self.vocab_limit = vocab_limit
        self.device = device
        self.mesh = mesh
        self.tensor_parallel = 1 if mesh is None else int(mesh.shape["tensor"])
        self.max_len = int(max_len)
        self.graphdef, state = nnx.split(model)
        require_process_local(state, "the model given to Engine")
        self._state_structure = jax.tree.structure(state)
        self._untie_head = self._first_device.platform == "cpu"
        self._kv_sharding = None
        self._handoff_target: Target = device
        if mesh is not None:
            self._place_on_mesh(state)
        [self.params] = serving_copies(self.graphdef, state, [self._handoff_target],
                                       dtype=self.dtype, untie_head=self._untie_head)
        # Bumped by every update: the prefix registry offers only pages of the current weights.
        self.params_version = 0
        self.plan = plan_kv(model.config, max_len=self.max_len, page_size=page_size,
                            kv_pages=kv_pages, kv_memory_fraction=kv_memory_fraction,
                            num_slots=num_slots, dtype=self.cache_dtype,
                            free_bytes=None if kv_pages else self._free_kv_bytes())
        self.num_slots = self.plan.num_slots
        self.page_size = self.plan.page_size
        self.num_pages = self.plan.num_pages
        # On a slice the Pallas kernels run per device on its kv heads (shard_map), so they
        # need a pool split by kv head; a replicated pool decodes with the pure-JAX paths.
        kv_split = self._kv_sharding is not None and split_kv_axis(self._kv_sharding) is not None
        if decode_attention == "auto" and self.tensor_parallel > 1 and not kv_split:
            decode_attention = "ragged"
        elif decode_attention == "auto":
            decode_attention = default_decode_implementation(
                self._first_device.platform, head_dim=self.cfg.head_dim,
                page_size=self.page_size, kv_dtype=self.cache_dtype)
        if self.tensor_parallel > 1 and not kv_split and decode_attention.startswith("pallas"):
            raise ValueError(
                f"decode_attention {decode_attention!r} on a slice of {self.tensor_parallel} "
                f"devices needs the kv pool split by kv head, but "
                f"{self.model_config.num_key_value_heads} kv heads do not divide over "
                f"{self.tensor_parallel} devices: use 'ragged' or 'reference', or a "
                f"serving.tensor_parallel that divides the kv heads")
        if decode_attention not in DECODE_IMPLEMENTATIONS:
            raise ValueError(f"decode_attention {decode_attention!r} not in "
                             f"{DECODE_IMPLEMENTATIONS + ('auto',)}")
        self.decode_attention = decode_attention
        self.interpret = bool(interpret)  # CPU tests: the Pallas kernels in their interpreter
        self.decode_steps = int(decode_steps)
        self.table_width = pages_for(self.max_len, self.page_size)
        if decode_attention != "reference":  # the kernels split the table in blocks of pages
            self.table_width = -(-self.table_width // 8) * 8
        self.min_context_pages = max(1, pages_for(min_context, self.page_size))
        self.prefill_chunk = int(min(prefill_chunk, self.max_len))
        self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(
            self.prefill_chunk, min_bucket)
        if self.buckets[-1] > self.max_len:
            raise ValueError(f"bucket {self.buckets[-1]} exceeds max_len {self.max_len}")
        self.prefill_chunk = min(self.prefill_chunk, self.buckets[-1])
        self.max_prefill_tokens = max(int(max_prefill_tokens), self.buckets[-1])
        self.pages = PagePool(self.num_pages, self.page_size)
        self._k, self._v = self._new_pool()
        self._table = np.full((self.num_slots, self.table_width), NO_PAGE, np.int32)
        self._slots: list[_Slot | None] = [None] * self.num_slots
        # Counters (read by the scheduler and benchmarks).
        self.busy_seconds = 0.0  # inside engine programs, host syncs included
        self.prefill_tokens = 0  # tokens fed by prefill/extend/re-prefill (unpadded)
        self.decode_calls = 0
        self.decode_steps_run = 0
        self.host_syncs = 0
        self.generated_tokens = 0  # tokens sampled by decode steps

    # ---- JetStream contract ----------------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self.num_slots

    @property
    def max_prefill_length(self) -> int:
        return self.max_len

    def init_decode_state(self) -> DecodeState:
        """Fresh decode state; every slot free and every page returned to the pool."""
        if self.memory_released:
            raise RuntimeError("the engine was released (serving.release_during_update): "
                               "update_params before serving again")
        b = self.num_slots
        self.pages.reset()
        self._table[:] = NO_PAGE
        self._slots = [None] * b
        state = DecodeState(
            lengths=jnp.zeros(b, jnp.int32), pending=jnp.zeros(b, jnp.int32),
            active=jnp.zeros(b, bool), seeds=jnp.zeros(b, jnp.int32),
            counters=jnp.zeros(b, jnp.int32), temperature=jnp.zeros(b, jnp.float32),
            top_k=jnp.zeros(b, jnp.int32), top_p=jnp.ones(b, jnp.float32),
            stop_ids=jnp.full((b, MAX_STOP_IDS), -1, jnp.int32), budget=jnp.zeros(b, jnp.int32))
        if self.mesh is not None:
            return jax.device_put(state, NamedSharding(self.mesh, PartitionSpec()))
        return state if self.device is None else jax.device_put(state, self.device)

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} tokens exceed the largest prefill bucket {self.buckets[-1]}")

    def prefill(self, params, tokens: Sequence[int], true_length: int | None = None,
                existing_prefix: Prefix | None = None, *, sampling: SamplingParams | None = None,
                forced_token: int = -1) -> Prefix:
        """Run a prompt (or append it to ``existing_prefix``) into free pages of the pool and
        sample its first token. Raises ``OutOfPages`` when the pool cannot hold it."""
        sampling = sampling or (existing_prefix.sampling if existing_prefix else SamplingParams())
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        n = int(true_length if true_length is not None else tokens.shape[0])
        if n < 1 or n > tokens.shape[0]:
            raise ValueError(f"true_length {n} must be in [1, {tokens.shape[0]}]")
        tokens = tokens[:n]
        if existing_prefix is not None:
            if existing_prefix.inserted:
                raise ValueError("the prefix was inserted into a slot already")
            tokens = np.concatenate([[existing_prefix.token], tokens]).astype(np.int32)
            pages, start, counter = existing_prefix.pages, existing_prefix.length, \
                existing_prefix.counter
            existing_prefix.pages = []  # handed to the new prefix
        else:
            pages, start, counter = [], 0, 0
        length = start + len(tokens)
        if length > self.max_len:
            raise ValueError(f"prompt of {length} tokens does not fit max_len {self.max_len}")
        pages = pages + self.pages.alloc(pages_for(length, self.page_size) - len(pages))
        sample = _Sample(-1, sampling, counter, sampling.max_new_tokens - counter, forced_token,
                         length)
        [(tok, lp, done)], _ = self._run_rows(params, None, [_Row(pages, start, tokens,
                                                                  [sample])])
        return Prefix(pages=pages, length=length, token=tok, logprob=lp, sampling=sampling,
                      done=done, counter=counter + 1)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Place a prefix in ``slot`` (its pages become the slot's); the slot decodes from its
        first token on."""
        self._check_slot(slot)
        if self._slots[slot] is not None:
            raise ValueError(f"slot {slot} holds a request: free_resource it first")
        if prefix.inserted:
            raise ValueError("a Prefix can be inserted once (prefill again for another slot)")
        s = prefix.sampling
        _stop_row(s)
        prefix.inserted = True
        budget = s.max_new_tokens - prefix.counter
        self._bind(slot, prefix.pages, prefix.length, prefix.token, prefix.counter, budget, s,
                   prefix.done == DoneReason.NOT_DONE)
        return self._insert(decode_state, [slot], [], [])

    def generate(self, params, decode_state: DecodeState,
                 forced: np.ndarray | None = None) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every active slot. ``forced[b] >= 0`` teacher-forces slot b.
        Raises ``OutOfPages`` when an active slot needs a page the pool does not have (the
        scheduler preempts instead)."""
        f = None if forced is None else np.asarray(forced, np.int32)[None]
        state, block = self.decode(params, decode_state, steps=1, forced=f)
        return state, ResultTokens(block.tokens[0], block.logprobs[0], block.valid[0],
                                   block.done[0], block.lengths)

    def free_resource(self, slot: int) -> None:
        """Release ``slot`` and its pages. The slot stops decoding at the next call (a
        preempted, still active slot too)."""
        self._check_slot(slot)
        info = self._slots[slot]
        if info is not None:
            self.pages.release(info.pages)
        self._slots[slot] = None
        self._table[slot] = NO_PAGE

    def release(self, prefix: Prefix) -> None:
        """Return the pages of a prefix that will not be inserted."""
        if not prefix.inserted:
            self.pages.release(prefix.pages)
            prefix.pages, prefix.inserted = [], True

    # ---- multi-turn and batched additions --------------------------------------------------
    def extend(self, params, decode_state: DecodeState, slot: int, tokens: Sequence[int], *,
               max_new_tokens: int | None = None, forced_token: int = -1
               ) -> tuple[DecodeState, SlotToken]:
        """Append ``tokens`` (e.g. a tool response turn) to a live, idle slot without
        re-prefilling: feeds the pending token and ``tokens``, samples the next token and
        re-activates the slot. ``max_new_tokens`` (if given) is the slot's new budget of
        sampled tokens, counting the one sampled here. Raises ``ValueError`` when the
        conversation would not fit the slot, ``OutOfPages`` when the pool is short."""
        state, [out] = self.extend_many(params, decode_state,
                                        [(slot, tokens, max_new_tokens, forced_token)])
        return state, out

    def extend_many(self, params, state: DecodeState, items) -> tuple[DecodeState,
                                                                       list[SlotToken]]:
        """``extend`` of several slots in batched feeds; ``items``: (slot, tokens,
        max_new_tokens or None, forced token) each."""
        rows = []
        for slot, tokens, max_new, forced in items:
            self._check_slot(slot)
            info = self._slots[slot]
            if info is None:
                raise ValueError(f"slot {slot} holds no request")
            if info.active:
                raise ValueError(f"slot {slot} is still decoding")
            feed = np.concatenate([[info.pending], np.asarray(tokens, np.int32).reshape(-1)])
            if info.length + len(feed) > self.max_len:
                raise ValueError(f"slot {slot}: {info.length} + {len(feed)} tokens exceed "
                                 f"max_len {self.max_len}")
            budget = info.budget if max_new is None else int(max_new)
            rows.append((slot, info, feed.astype(np.int32), budget, forced))
        need = sum(self.pages_to_grow(slot, len(feed)) for slot, _, feed, _, _ in rows)
        if need > self.pages.num_free:
            raise OutOfPages(f"extend needs {need} pages, {self.pages.num_free} free")
        feed_rows = []
        for slot, info, feed, budget, forced in rows:
            self._grow(slot, len(feed))
            feed_rows.append(_Row(info.pages, info.length, feed, [
                _Sample(slot, info.sampling, info.counter, budget, int(forced),
                        info.length + len(feed))]))
        results, state = self._run_rows(params, state, feed_rows)
        return state, [SlotToken(*r) for r in results]

    def start(self, params, state: DecodeState, requests: Sequence[StartRequest]
              ) -> tuple[DecodeState, list[SlotToken]]:
        """Start requests in free slots in batched feeds (see ``StartRequest``); one
        ``SlotToken`` per request, in order. Raises ``OutOfPages`` when ``start_cost`` exceeds
        the free pages.

        A group whose prompt's full pages another group of the same call writes (different
        prompts with the same whole-page head) shares those pages and feeds only the rest, in
        feeds that run after the writer's: a page is never read before it is written."""
        version = self._weights_version(params)
        plan = self._plan_start(requests, version)
        need = _start_cost(plan, self.page_size)
        if need > self.pages.num_free:
            raise OutOfPages(f"starting {len(requests)} requests needs {need} pages, "
                             f"{self.pages.num_free} free")
        rows, pages_of = [], []
        for g in plan:
            shared = g.registered if g.writer is None else pages_of[g.writer][: g.num_shared]
            rows.append(self._start_row(g, shared))
            pages_of.append(rows[-1].pages)
        results: dict[int, tuple] = {}
        writers_first = [i for i, g in enumerate(plan) if g.writer is None]
        readers_after = [i for i, g in enumerate(plan) if g.writer is not None]
        for batch in (writers_first, readers_after):
            if not batch:
                continue
            out, state = self._run_rows(params, state, [rows[i] for i in batch])
            members = [r for i in batch for r in plan[i].members]  # the rows' sample order
            results.update(zip(map(id, members), out))
            for i in batch:  # written now: later groups and calls may share them
                if plan[i].writes_prefix and version is not None:
                    leader = plan[i].leader
                    self.pages.register_prefix(leader.history[: leader.prompt_len], pages_of[i],
                                               version=version)
        return state, [SlotToken(*results[id(r)]) for r in requests]

    def _start_row(self, group: "_StartGroup", shared: Sequence[int]) -> _Row:
        """Take the pages of ``group`` (its leader's: ``shared`` then new ones; every other
        member shares the leader's full pages and gets its own copy of the partial last one),
        bind its slots, and return the row that feeds the leader's history past ``shared``."""
        leader = group.leader
        history = np.asarray(leader.history, np.int32)
        n = len(history)
        pages = list(shared) + self.pages.alloc(pages_for(n, self.page_size) - len(shared))
        self.pages.share(shared)
        full = pages[: n // self.page_size]
        samples = []
        for r in group.members:
            budget = r.sampling.max_new_tokens - r.counter if r.budget is None else r.budget
            if r is leader:
                slot_pages, copy = pages, None
            else:  # share the leader's full pages, copy its last partial page
                self.pages.share(full)
                slot_pages = list(full)
                copy = None
                if n % self.page_size:
                    own = self.pages.alloc(1)[0]
                    slot_pages.append(own)
                    copy = (pages[len(full)], own)
            self._bind(r.slot, slot_pages, 0, 0, r.counter, budget, r.sampling, False)
            samples.append(_Sample(r.slot, r.sampling, r.counter, budget, r.forced, n, copy))
        start = len(shared) * self.page_size
        return _Row(pages, start, history[start:], samples)

    def start_cost(self, requests: Sequence[StartRequest]) -> int:
        """Pages ``start(requests)`` takes from the pool (served with ``self.params``)."""
        return _start_cost(self._plan_start(requests, self.params_version), self.page_size)

    def decode(self, params, state: DecodeState, steps: int | None = None,
               forced: np.ndarray | None = None, stop_after: int | None = None
               ) -> tuple[DecodeState, DecodeBlock]:
        """Up to ``steps`` (default ``decode_steps``) decode steps in one device call, one host
        sync; only the active slots are computed. ``forced[i, b] >= 0`` teacher-forces slot
        b's token at step i. ``stop_after``: return once that many slots stopped (default:
        run all steps unless every slot stops). Takes the pages the active slots grow into
        first (``OutOfPages`` if short: see ``pages_to_grow``)."""
        steps = self.decode_steps if steps is None else int(steps)
        if not 1 <= steps <= self.decode_steps:
            raise ValueError(f"steps must be in [1, {self.decode_steps}], got {steps}")
        active = [s for s, info in enumerate(self._slots) if info is not None and info.active]
        need = sum(self.pages_to_grow(s, steps) for s in active)
        if need > self.pages.num_free:
            raise OutOfPages(f"{len(active)} active slots need {need} pages for {steps} steps, "
                             f"{self.pages.num_free} free")
        for s in active:
            self._grow(s, steps)
        rows = np.full(_batch_bucket(len(active), self.num_slots), self.num_slots, np.int32)
        rows[: len(active)] = active
        width, live_pages = self._decode_reads(active, steps, len(rows))
        f = np.full((self.decode_steps, len(rows)), -1, np.int32)
        if forced is not None:
            f[: len(forced), : len(active)] = np.asarray(forced)[:, active]
        stop_after = len(active) + 1 if stop_after is None else max(1, int(stop_after))
        t0 = time.perf_counter()
        self._k, self._v, state, outs = _decode_program(
            self.cfg, params, self._k, self._v, state, jnp.asarray(rows),
            jnp.asarray(self._table[:, :width]), live_pages, jnp.asarray(f), jnp.int32(steps),
            jnp.int32(stop_after), steps=self.decode_steps, attention=self.decode_attention,
            vocab_limit=self.vocab_limit, max_len=self.max_len, kv_sharding=self._kv_sharding,
            interpret=self.interpret)
        compact = jax.device_get(outs)
        self.busy_seconds += time.perf_counter() - t0
        self.host_syncs += 1
        self.decode_calls += 1
        # Back to slot order: [steps, num_slots].
        full = []
        for a, fill in zip(compact, (0, 0.0, False, 0)):
            x = np.full((steps, self.num_slots), fill, a.dtype)
            x[:, active] = a[:steps, : len(active)]
            full.append(x)
        tokens, logprobs, valid, done = full
        self.decode_steps_run += int(valid.any(axis=1).sum())
        self.generated_tokens += int(valid.sum())
        lengths = np.array([0 if info is None else info.length for info in self._slots])
        block = DecodeBlock(tokens, logprobs, valid, done, lengths)
        for s in active:
            info = self._slots[s]
            fed = int(block.valid[:, s].sum())
            if fed:
                last = int(np.flatnonzero(block.valid[:, s])[-1])
                info.pending = int(block.tokens[last, s])
                info.active = bool(block.done[last, s] == DoneReason.NOT_DONE)
            info.length += fed
            info.counter += fed
            info.budget -= fed
        block.lengths[active] = [self._slots[s].length for s in active]
        return state, block

    def update_params(self, new_params) -> None:
        """Serve new weights: an ``nnx.split`` state of the served model's structure, copied
        once into the serving dtype and layout (``serving_copies``; several slices at once:
        ``update_engines``). A released engine gets its KV pool back."""
        update_engines([self], new_params)

    def release_memory(self) -> None:
        """Free the serving copy and the KV pool (``serving.release_during_update``: room for
        the train step on the same devices, docs/serving.md "Memory plan"); the next
        ``update_params`` makes both again. Every slot must be free."""
        if self.live_slots():
            raise ValueError(f"release_memory: slots {self.live_slots()} still hold requests")
        for x in jax.tree.leaves((self.params, self._k, self._v)):
            x.delete()
        self.params = self._k = self._v = None

    @property
    def memory_released(self) -> bool:
        return self._k is None

    # ---- page accounting for the scheduler --------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def free_kv_tokens(self) -> int:
        return self.pages.num_free * self.page_size

    @property
    def free_pages(self) -> int:
        return self.pages.num_free

    def free_slots(self) -> list[int]:
        return [i for i, info in enumerate(self._slots) if info is None]

    def live_slots(self) -> list[int]:
        return [i for i, info in enumerate(self._slots) if info is not None]

    def slot_length(self, slot: int) -> int:
        info = self._slots[slot]
        return 0 if info is None else info.length

    def free_tokens_in_slot(self, slot: int) -> int:
        return self.max_len - self.slot_length(slot)

    def slot_pages(self, slot: int) -> list[int]:
        info = self._slots[slot]
        return [] if info is None else list(info.pages)

    def slot_info(self, slot: int) -> _Slot:
        """A copy of the host mirror of a live slot (length, pending token, RNG counter,
        remaining budget, sampling, pages)."""
        info = self._slots[slot]
        if info is None:
            raise ValueError(f"slot {slot} holds no request")
        return dataclasses.replace(info, pages=list(info.pages))

    def is_decoding(self, slot: int) -> bool:
        info = self._slots[slot]
        return info is not None and info.active

    def pages_to_grow(self, slot: int, num_tokens: int) -> int:
        """Pages ``slot`` must take to hold ``num_tokens`` more tokens (capped at max_len)."""
        info = self._slots[slot]
        target = min(info.length + int(num_tokens), self.max_len)
        return max(0, pages_for(target, self.page_size) - len(info.pages))

    # ---- internals -------------------------------------------------------------------------
    @property
    def _first_device(self) -> jax.Device:
        if self.mesh is not None:
            return self.mesh.devices.flat[0]
        return self.device or jax.local_devices()[0]

    def _place_on_mesh(self, state) -> None:
        """Shardings of a slice: the serving copy (the hand-off's target) and the pool."""
        shapes = _serving_shapes(self.graphdef, state, self.dtype, self._untie_head)
        specs = serving_weight_specs(self.model_config, shapes, self.tensor_parallel)
        self._handoff_target = _named(self.mesh, specs)
        self._kv_sharding = NamedSharding(self.mesh, pool_spec(self.model_config,
                                                               self.tensor_parallel))

    def _new_pool(self):
        if self.mesh is not None:  # made in place, split by kv head (never whole on one device)
            pool = tuple([self._kv_sharding] * self.model_config.num_hidden_layers)
            return jax.jit(lambda: PagedKVCache.init_pool(self.model_config, self.num_pages,
                                                          self.page_size, self.cache_dtype),
                           out_shardings=(pool, pool))()
        with jax.default_device(self.device) if self.device is not None else _nullcontext():
            return PagedKVCache.init_pool(self.model_config, self.num_pages, self.page_size,
                                          self.cache_dtype)

    def _serve(self, weights: ServingWeights) -> None:
        """Take a hand-off's serving copy; make the pool again after ``release_memory``."""
        if self.memory_released:
            self._k, self._v = self._new_pool()
        self.params = weights
        self.params_version += 1

    def _free_kv_bytes(self) -> int | None:
        """Pool bytes the slice's devices can still take: one device's free memory, times the
        tensor size where the pool is split by kv head (each device holds 1/tensor of a page)."""
        if self.mesh is None:
            return free_device_bytes(self.device)
        free = [free_device_bytes(d) for d in self.mesh.devices.flat]
        if any(f is None for f in free):
            return None
        split = self._kv_sharding.spec != PartitionSpec()
        return min(free) * (self.tensor_parallel if split else 1)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")

    def _bind(self, slot, pages, length, pending, counter, budget, sampling, active):
        self._check_slot(slot)
        if self._slots[slot] is not None:
            raise ValueError(f"slot {slot} holds a request")
        self._slots[slot] = _Slot(list(pages), length, pending, counter, budget, sampling, active)
        self._table[slot] = NO_PAGE
        self._table[slot, : len(pages)] = pages

    def _grow(self, slot: int, num_tokens: int) -> None:
        info = self._slots[slot]
        extra = self.pages.alloc(self.pages_to_grow(slot, num_tokens))
        self._table[slot, len(info.pages): len(info.pages) + len(extra)] = extra
        info.pages.extend(extra)

    def _decode_reads(self, active: list[int], steps: int, batch: int):
        """What a decode call reads: page-table columns, and for the ragged attention the
        list of the active slots' live pages (ids, rows in the compacted batch, first
        positions, count), in arrays of a fixed size per batch bucket."""
        size = self.page_size
        if self.decode_attention == "reference":
            longest = max((self._slots[s].length + steps for s in active), default=0)
            width = self._context_pages(longest)
        else:  # the kernels and the ragged list stop at each row's length themselves
            width = self.table_width
        ids, rows, starts = [], [], []
        if self.decode_attention == "ragged":
            for j, s in enumerate(active):  # rows are positions in the compacted batch
                info = self._slots[s]
                n = pages_for(min(info.length + steps, self.max_len), size)
                ids += info.pages[:n]
                rows += [j] * n
                starts += range(0, n * size, size)
            m = _ragged_list_size(len(ids), batch * self.table_width)
        else:
            m = RAGGED_CHUNK  # unused
        arrays = [np.zeros(m, np.int32), np.full(m, batch, np.int32), np.zeros(m, np.int32)]
        for a, vals in zip(arrays, (ids, rows, starts)):
            a[: len(vals)] = vals
        return width, (*(jnp.asarray(a) for a in arrays), jnp.int32(len(ids)))

    def _context_pages(self, tokens: int) -> int:
        """Page-table columns the reference attention reads to cover ``tokens`` positions: a
        power of two of pages (bounded compiles) from ``min_context``."""
        need = max(self.min_context_pages, pages_for(tokens, self.page_size))
        return min(self.table_width, _pow2_at_least(need))

    def _group(self, requests: Sequence[StartRequest]):
        """(leader, members) per distinct fresh prompt; other requests stand alone."""
        groups: dict[tuple, list[StartRequest]] = {}
        out = []
        for r in requests:
            if len(r.history) < 1:
                raise ValueError("a request needs at least one token of history")
            if len(r.history) > self.max_len:
                raise ValueError(f"history of {len(r.history)} tokens exceeds max_len "
                                 f"{self.max_len}")
            if r.prompt_len == len(r.history):
                key = tuple(int(t) for t in r.history)
                if key in groups:
                    groups[key].append(r)
                    continue
                groups[key] = [r]
                out.append(groups[key])
            else:
                out.append([r])
        return [(members[0], members) for members in out]

    def _weights_version(self, params) -> int | None:
        """The registry version of pages written with ``params``: the served copy's version;
        None for any other weights (their pages are neither registered nor looked up)."""
        return self.params_version if params is self.params else None

    def _plan_start(self, requests: Sequence[StartRequest], version: int | None
                    ) -> list["_StartGroup"]:
        """Which pages each group of ``start(requests)`` shares: registered pages written by
        an earlier call under the same weights, else the pages an earlier group of this call
        writes for the same full-page prompt head (that group then runs first), else none."""
        plan, writer_of = [], {}
        for leader, members in self._group(requests):
            group = _StartGroup(leader, members)
            head = self.pages.full_prefix_key(leader.history[: leader.prompt_len])
            # At least the last token is fed again: its logits are what the first token samples.
            shareable = min(len(head), len(leader.history) - 1) // self.page_size
            registered = () if version is None or not head else self.pages.lookup_prefix(
                head, version=version)
            if registered:
                group.registered = registered[:shareable]
                group.num_shared = len(group.registered)
            elif head in writer_of and shareable:
                group.writer, group.num_shared = writer_of[head], shareable
            elif head and head not in writer_of:
                writer_of[head] = len(plan)
                group.writes_prefix = True
            plan.append(group)
        return plan

    def _run_rows(self, params, state, rows: list[_Row]):
        """Feed every row (chunked, batched), sample each row's samples from its last logits,
        then insert them into their slots (``state`` None: sampling only). Returns
        ``[(token, logprob, DoneReason)]`` in the rows' sample order and the new state."""
        results: dict[int, tuple] = {}
        pending = [(i, row, row.start, 0) for i, row in enumerate(rows)]  # (row, start, offset)
        while pending:
            # One wave: the next chunk of every row, batched by size.
            wave = sorted(pending, key=lambda p: len(p[1].tokens) - p[3])
            pending = []
            while wave:
                n_first = min(len(wave[0][1].tokens) - wave[0][3], self.prefill_chunk)
                bucket = self.bucket_for(max(1, n_first))
                call = []
                for item in list(wave):
                    n = min(len(item[1].tokens) - item[3], self.prefill_chunk)
                    if n > bucket or len(call) == ROW_BUCKETS[-1] or \
                            _row_bucket(len(call) + 1) * self.bucket_for(n) > \
                            self.max_prefill_tokens:
                        break
                    call.append(item)
                    wave.remove(item)
                if not call:  # the smallest remaining chunk alone
                    call = [wave.pop(0)]
                logits = self._feed(params, call)
                finished = []
                for j, (i, row, start, off) in enumerate(call):
                    n = min(len(row.tokens) - off, self.prefill_chunk)
                    if off + n < len(row.tokens):
                        pending.append((i, row, start + n, off + n))
                    else:
                        finished.append((j, i, row))
                if finished:
                    state = self._sample_and_insert(params, state, logits, finished, results)
        ordered = [results[(i, k)] for i, row in enumerate(rows) for k in range(len(row.samples))]
        return ordered, state

    def _feed(self, params, call):
        """One batched forward over the rows of ``call``; returns last-token logits [R, V]."""
        sizes = [min(len(row.tokens) - off, self.prefill_chunk) for _, row, _, off in call]
        r, t = _row_bucket(len(call)), self.bucket_for(max(sizes))
        fresh = all(start == 0 for _, _, start, _ in call)  # rows read only their own tokens
        width = self._context_pages(t) if fresh else self.table_width
        table = np.full((r, width), NO_PAGE, np.int32)
        lengths = np.zeros(r, np.int32)
        tokens = np.zeros((r, t), np.int32)
        num_new = np.zeros(r, np.int32)
        for j, ((_, row, start, off), n) in enumerate(zip(call, sizes)):
            table[j, : min(width, len(row.pages))] = row.pages[:width]
            lengths[j] = start
            tokens[j, :n] = row.tokens[off: off + n]
            num_new[j] = n
        t0 = time.perf_counter()
        self._k, self._v, logits = _feed_program(
            self.cfg, params, self._k, self._v, jnp.asarray(table), jnp.asarray(lengths),
            jnp.asarray(tokens), jnp.asarray(num_new), kv_sharding=self._kv_sharding)
        self.busy_seconds += time.perf_counter() - t0
        self.prefill_tokens += int(sum(sizes))
        return logits

    def _sample_and_insert(self, params, state, logits, finished, results):
        samples = [(j, i, k, s) for j, i, row in finished for k, s in enumerate(row.samples)]
        m = max(self.num_slots, len(samples))  # one shape per engine: bounded compiles
        cols = {name: np.zeros(m, dt) for name, dt in (
            ("rows", np.int32), ("seeds", np.int32), ("counters", np.int32),
            ("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32))}
        cols["forced"] = np.full(m, -1, np.int32)
        cols["top_p"][:] = 1.0
        for q, (j, _, _, s) in enumerate(samples):
            sp = s.sampling
            cols["rows"][q], cols["seeds"][q], cols["counters"][q] = j, sp.seed, s.counter
            cols["temperature"][q], cols["top_k"][q], cols["top_p"][q] = (
                sp.temperature, sp.top_k, sp.top_p)
            cols["forced"][q] = s.forced
        t0 = time.perf_counter()
        tok, lp = _sample_program(logits, *(jnp.asarray(cols[c]) for c in (
            "rows", "seeds", "counters", "temperature", "top_k", "top_p", "forced")),
            vocab_limit=self.vocab_limit)
        tok, lp = jax.device_get((tok, lp))
        self.busy_seconds += time.perf_counter() - t0
        self.host_syncs += 1
        slots, copies = [], []
        for q, (j, i, k, s) in enumerate(samples):
            token, done = int(tok[q]), DoneReason.NOT_DONE
            if token in s.sampling.stop_ids:
                done = DoneReason.STOP
            elif s.budget - 1 <= 0:  # `budget` counts the token just sampled
                done = DoneReason.BUDGET
            elif s.length >= self.max_len:
                done = DoneReason.CONTEXT
            results[(i, k)] = (token, float(lp[q]), done)
            if s.slot >= 0:
                info = self._slots[s.slot]
                info.length, info.pending, info.counter = s.length, token, s.counter + 1
                info.budget, info.active = s.budget - 1, done == DoneReason.NOT_DONE
                slots.append(s.slot)
                if s.copy is not None:
                    copies.append(s.copy)
        if slots and state is not None:
            state = self._insert(state, slots, [c[0] for c in copies], [c[1] for c in copies])
        return state

    def _insert(self, state, slots, copy_src, copy_dst) -> DecodeState:
        """Write the host mirror of ``slots`` into the decode state; copy pages first."""
        m = self.num_slots  # fixed shapes (one compile per engine); padding rows are skipped
        slot_idx = np.full(m, self.num_slots, np.int32)  # out of range: skipped
        slot_idx[: len(slots)] = slots
        vals = {"lengths": np.zeros(m, np.int32), "pending": np.zeros(m, np.int32),
                "active": np.zeros(m, bool), "seeds": np.zeros(m, np.int32),
                "counters": np.zeros(m, np.int32), "temperature": np.zeros(m, np.float32),
                "top_k": np.zeros(m, np.int32), "top_p": np.ones(m, np.float32),
                "stop_ids": np.full((m, MAX_STOP_IDS), -1, np.int32),
                "budget": np.zeros(m, np.int32)}
        for q, slot in enumerate(slots):
            info = self._slots[slot]
            sp = info.sampling
            vals["lengths"][q], vals["pending"][q], vals["active"][q] = (
                info.length, info.pending, info.active)
            vals["seeds"][q], vals["counters"][q], vals["budget"][q] = (
                sp.seed, info.counter, info.budget)
            vals["temperature"][q], vals["top_k"][q], vals["top_p"][q] = (
                sp.temperature, sp.top_k, sp.top_p)
            vals["stop_ids"][q] = _stop_row(sp)
        c = self.num_slots
        src = np.zeros(c, np.int32)
        dst = np.full(c, self.num_pages, np.int32)  # out of range: skipped
        src[: len(copy_src)], dst[: len(copy_dst)] = copy_src, copy_dst
        t0 = time.perf_counter()
        self._k, self._v, state = _insert_program(
            self._k, self._v, state, jnp.asarray(src), jnp.asarray(dst), jnp.asarray(slot_idx),
            {name: jnp.asarray(v) for name, v in vals.items()}, kv_sharding=self._kv_sharding)
        self.busy_seconds += time.perf_counter() - t0
        return state


def _batch_bucket(n: int, num_slots: int) -> int:
    """Decode batch for ``n`` active slots: a power of 4 from 4 (few compiles), at most the
    slot count."""
    b = 4
    while b < n:
        b *= 4
    return min(b, num_slots) if n <= num_slots else n


def _ragged_list_size(listed: int, most: int) -> int:
    """Entries of the ragged attention's page list: up to one chunk, the live pages rounded up
    to a multiple of ``RAGGED_LIST_STEP`` (read in one pass: the gather and the attention
    follow the live pages; a few compiles per batch bucket); more, a fixed size per batch
    bucket read a chunk at a time (``most``: every row's whole page table)."""
    if listed <= RAGGED_CHUNK:
        return max(RAGGED_LIST_STEP, -(-listed // RAGGED_LIST_STEP) * RAGGED_LIST_STEP)
    return -(-most // RAGGED_CHUNK) * RAGGED_CHUNK


def _row_bucket(n: int) -> int:
    for b in ROW_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"{n} rows exceed the largest row bucket {ROW_BUCKETS[-1]}")


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

"""Paged slot engine: the native API the rollout scheduler drives (``start / decode /
extend_many``) over our Qwen3 (JetStream's ``prefill / insert / generate / release`` contract is
``serving.jetstream_contract``).

One engine owns ``num_slots`` decode slots over one paged KV pool (docs/serving.md, "Page
layout"): ``num_pages`` pages of ``page_size`` tokens, per layer ``[kv_heads, num_pages,
page_size, head_dim]``, and a page table per slot. A slot holds only the pages its tokens fill;
pages are taken as it grows (``start``, ``decode``, ``extend``) and returned when it is freed.
The host keeps the page accounting and each slot's pages (``serving.pages``: ``PagePool``,
``SlotTable``); the device keeps the pool and ``DecodeState`` (one row per slot; the device
programs are ``serving.programs``). Weights are a serving copy (``models.qwen3.ServingWeights``:
matmul weights cast once to the serving dtype, bf16 by default through ``model.dtype``), made at
construction and by every ``update_params`` (``serving.handoff``); where the arrays live is
``serving.placement``.

Token flow of one slot (the "pending token" invariant): the cache holds the conversation minus
its last sampled token, which is *pending*. ``start`` feeds a request's history and samples
its first token; each decode step feeds every active slot's pending token and samples the
next; ``extend(slot, ids)`` feeds ``[pending] + ids`` (a tool response appended to a live
conversation, no re-prefill) and samples the next pending token.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rstarjax.models.attention import device_platform
from rstarjax.models.kv_cache import NO_PAGE, pages_for
from rstarjax.models.paged_attention import (RAGGED_CHUNK, RAGGED_LIST_STEP,
                                             default_decode_implementation, split_kv_axis)
from rstarjax.models.qwen3 import ServingWeights, serving_config
from rstarjax.serving.decode_choice import DecodeChoice
from rstarjax.serving.handoff import (ServingLayout, require_process_local, serving_copies,
                                      serving_shapes, split_weights, update_engines)
from rstarjax.serving.pages import OutOfPages, PagePool, SlotInfo, SlotTable
from rstarjax.serving.placement import Placement, delete_arrays
from rstarjax.serving.programs import (MAX_STOP_IDS, DecodeBlock, DecodeState, DoneReason, FeedRow,
                                       FeedSample, SlotToken, decode_program, decode_program_with,
                                       empty_decode_state, feed_program, insert_program,
                                       sample_program, stop_row)
from rstarjax.serving.sampling import SAMPLERS, SamplingParams
from rstarjax.serving.sizing import plan_kv
from rstarjax.serving.start_plan import StartGroup, StartRequest, plan_start, start_cost

ROW_BUCKETS = (1, 2, 4, 8, 16)  # rows per feed call, padded up to one of these


def default_buckets(max_len: int, min_bucket: int = 16) -> tuple[int, ...]:
    """Powers of two from ``min_bucket`` below ``max_len``, then ``max_len``."""
    out, b = [], min_bucket
    while b < max_len:
        out.append(b)
        b *= 2
    out.append(max_len)
    return tuple(out)


def check_token_ids(ids, vocab_size: int, what: str) -> None:
    """Refuse ids outside ``[0, vocab_size)``. The embedding lookup would not fail on them
    (``jnp.take`` fills NaN past the table and wraps negative ids): it would write NaN, or
    another token's, K/V into pages that later requests reuse, whose decoding then turns NaN."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.size:
        raise ValueError(f"{what}: token id {int(outside[0])} is outside the vocabulary "
                         f"[0, {vocab_size})")


def forced_ids(forced) -> np.ndarray:
    """The teacher-forced ids of a forced-token array (negative entries sample, as in
    ``sampling.sample_tokens``)."""
    forced = np.asarray(forced, np.int64).reshape(-1)
    return forced[forced >= 0]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class Engine:
    """Paged slot engine over one model replica (module docstring).

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

    Placement is ``serving.placement.Placement``; what the weight hand-off reads is ``layout``
    and what it calls is ``serve`` (``serving.handoff.update_engines``).
    """

    def __init__(self, model: nnx.Module, *, max_len: int, num_slots: int = 0,
                 page_size: int = 16, kv_pages: int = 0, kv_memory_fraction: float = 0.9,
                 dtype=None, cache_dtype=None, buckets: Sequence[int] | None = None,
                 min_bucket: int = 16, prefill_chunk: int = 2048, max_prefill_tokens: int = 8192,
                 decode_steps: int = 16, min_context: int = 256, decode_attention: str = "auto",
                 device: jax.Device | None = None, mesh: Mesh | None = None,
                 vocab_limit: int | None = None, interpret: bool = False,
                 sampler: str = "exact", decode_xla_options: dict | None = None):
        self.placement = Placement(device, mesh)
        # XLA options of the decode program alone (programs.decode_program_with), e.g.
        # {"xla_gpu_enable_triton_gemm": False}: cuBLAS GEMMs in the decode step only
        self.decode_xla_options = dict(decode_xla_options or {})
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler {sampler!r} not in {SAMPLERS}")
        self.sampler = sampler  # sampling.SAMPLERS: "fused" draws other tokens for a key
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
        self.tensor_parallel = self.placement.tensor_parallel
        self.max_len = int(max_len)
        self.graphdef, state = nnx.split(model)
        require_process_local(state, "the model given to Engine")
        first_device = self.placement.first_device
        untie_head = first_device.platform == "cpu"
        self.placement.lay_out(model.config, self.graphdef, state, self.dtype, untie_head)
        # What the weight hand-off needs to know of this engine (serving.handoff).
        self.layout = ServingLayout(self.graphdef, jax.tree.structure(state), self.dtype,
                                    untie_head, self.placement.weights_target,
                                    serving_shapes(self.graphdef, state, self.dtype, untie_head))
        [self.params] = serving_copies(self.graphdef, state, [self.layout.target],
                                       dtype=self.dtype, untie_head=untie_head)
        self.placement.follow(self.params)
        # Bumped by every update: the prefix registry offers only pages of the current weights.
        self.params_version = 0
        self.plan = plan_kv(model.config, max_len=self.max_len, page_size=page_size,
                            kv_pages=kv_pages, kv_memory_fraction=kv_memory_fraction,
                            num_slots=num_slots, dtype=self.cache_dtype,
                            free_bytes=None if kv_pages else self.placement.free_kv_bytes())
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
                device_platform(first_device), head_dim=self.cfg.head_dim,
                page_size=self.page_size, kv_dtype=self.cache_dtype)
        self._kv_split = kv_split
        self.interpret = bool(interpret)  # CPU tests: the Pallas kernels in their interpreter
        choice = self._checked_choice(decode_attention)
        self.decode_steps = int(decode_steps)
        self.table_width = pages_for(self.max_len, self.page_size)
        if choice.names != ("reference",):  # the kernels split the table in blocks of pages
            self.table_width = -(-self.table_width // 8) * 8
        self.decode_attention = choice.spec()
        self.min_context_pages = max(1, pages_for(min_context, self.page_size))
        self.prefill_chunk = int(min(prefill_chunk, self.max_len))
        self.buckets = tuple(sorted(buckets)) if buckets else default_buckets(
            self.prefill_chunk, min_bucket)
        if self.buckets[-1] > self.max_len:
            raise ValueError(f"bucket {self.buckets[-1]} exceeds max_len {self.max_len}")
        self.prefill_chunk = min(self.prefill_chunk, self.buckets[-1])
        self.max_prefill_tokens = max(int(max_prefill_tokens), self.buckets[-1])
        self.pages = PagePool(self.num_pages, self.page_size)
        self.slots = SlotTable(self.pages, self.num_slots, self.table_width, self.max_len)
        self.held: set[int] = set()  # slots of partial rollouts paused with their KV (``hold``)
        self._k, self._v = self._new_pool()
        # Counters (read by the scheduler and benchmarks).
        self.busy_seconds = 0.0  # inside engine programs, host syncs included
        self.prefill_tokens = 0  # tokens fed by prefill/extend/re-prefill (unpadded)
        self.decode_calls = 0
        self.decode_steps_run = 0
        self.host_syncs = 0
        self.generated_tokens = 0  # tokens sampled by decode steps

    # ---- the decode attention ----------------------------------------------------------------
    @property
    def decode_attention(self) -> str:
        """The decode attention, one path or one per batch size (``serving.decode_choice``)."""
        return self.decode_choice.spec()

    @decode_attention.setter
    def decode_attention(self, spec: str) -> None:
        choice = self._checked_choice(spec)
        if choice.names != ("reference",) and self.table_width % 8:
            raise ValueError(f"decode attention {spec!r}: this engine's page table was laid out for "
                             f"'reference' alone; build the engine with it")
        self.decode_choice = choice

    def _checked_choice(self, spec: str) -> DecodeChoice:
        """``spec`` parsed, each of its paths checked against this engine's placement."""
        choice = DecodeChoice.parse(spec)
        for name in choice.names:
            if self.tensor_parallel > 1 and not self._kv_split and name.startswith("pallas"):
                raise ValueError(
                    f"decode_attention {name!r} on a slice of {self.tensor_parallel} "
                    f"devices needs the kv pool split by kv head, but "
                    f"{self.model_config.num_key_value_heads} kv heads do not divide over "
                    f"{self.tensor_parallel} devices: use 'ragged' or 'reference', or a "
                    f"serving.tensor_parallel that divides the kv heads")
            if self.tensor_parallel > 1 and name.endswith("_layer"):
                raise ValueError(
                    f"decode_attention {name!r} runs its projections as single-device "
                    f"kernels; on a slice of {self.tensor_parallel} devices use "
                    f"{name.removesuffix('_layer') + '_rope'!r} (the same attention, XLA's split GEMMs)")
            if problems := self._kernel_shape_problems(name):
                other_pages = any(p.startswith("page_size") for p in problems)
                raise ValueError(
                    f"decode_attention {name!r} cannot run this engine's pool: "
                    f"{'; '.join(problems)}: set serving.decode_attention to 'auto' or 'ragged'"
                    + (" or choose another serving.page_size" if other_pages else ""))
        return choice

    def _kernel_shape_problems(self, name: str) -> list[str]:
        """Why the decode kernel ``name`` cannot run this engine's pool shapes (empty: it can):
        refused here in one line, not at the first decode's lowering on the device. The Triton
        and TPU kernels' limits are their lowerings' (their interpreters take any shape); the
        Mosaic GPU kernel refuses the same shapes interpreted or not."""
        from rstarjax.models import decode_kernel_mgpu
        from rstarjax.models.paged_attention import kernel_problems

        if name.startswith("pallas_mgpu"):
            writes = name != "pallas_mgpu_packed"  # _rope and _layer: the writing, rotating kernel
            blocking = (decode_kernel_mgpu.MOSAIC_APPEND_BLOCKING if writes
                        else decode_kernel_mgpu.MOSAIC_BLOCKING)
            width = -(-pages_for(self.max_len, self.page_size) // 8) * 8  # the kernels' table
            return decode_kernel_mgpu.problems(
                self.model_config.num_attention_heads, self.model_config.num_key_value_heads,
                self.cfg.head_dim, self.page_size, self.cache_dtype, width, blocking,
                append=writes, rope=writes)
        if self.interpret:
            return []
        return kernel_problems(name, head_dim=self.cfg.head_dim, page_size=self.page_size)

    # ---- slots and their decode state ------------------------------------------------------
    def init_decode_state(self, keep: Sequence[int] = ()) -> DecodeState:
        """Fresh decode state; every slot free and every page returned to the pool, except the
        held slots in ``keep`` (partial rollouts paused with their KV, ``hold``), which stay
        idle with their pages, pending token and RNG position."""
        if self.memory_released:
            raise RuntimeError("the engine was released (serving.release_during_update): "
                               "update_params before serving again")
        if not set(keep) <= self.held:
            raise ValueError(f"slots {sorted(set(keep) - self.held)} are not held (hold them before keeping them)")
        self.slots.reset(keep)
        self.held = set(keep)
        state = self.placement.put(empty_decode_state(self.num_slots))
        return self._insert(state, list(keep), [], []) if keep else state

    def blank_decode_state(self) -> DecodeState:
        """A fresh device decode state for a slot table with no slot in use, the page pool left
        as it is: after a failed step whose slots were all freed, the pages of prefills not yet
        inserted (held by their prefixes) stay theirs, which ``init_decode_state`` would return
        to the pool while they are still in use."""
        busy = [s for s in range(self.num_slots) if self.slots[s] is not None]
        if busy:
            raise ValueError(f"slots {busy} are in use: free them first (or init_decode_state)")
        return self.placement.put(empty_decode_state(self.num_slots))

    def hold(self, state: DecodeState, slot: int) -> DecodeState:
        """Stop ``slot`` decoding and keep its pages, pending token and RNG position: a partial
        rollout paused with its KV. ``resume`` continues it, in this decode state or in a later
        one (``init_decode_state(keep=...)``)."""
        info = self.slots[slot]
        if info is None or not info.active:
            raise ValueError(f"slot {slot} is not decoding")
        info.active = False
        self.held.add(slot)
        return self._insert(state, [slot], [], [])

    def resume(self, state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """Held ``slots`` decode on from their pending token, on the KV they hold (written by
        whatever weights were served then)."""
        for slot in slots:
            if slot not in self.held:
                raise ValueError(f"slot {slot} is not held")
            self.held.discard(slot)
            self.slots[slot].active = True
        return self._insert(state, list(slots), [], []) if slots else state

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} tokens exceed the largest prefill bucket {self.buckets[-1]}")

    def free_resource(self, slot: int) -> None:
        """Release ``slot`` and its pages. The slot stops decoding at the next call (a
        preempted, still active slot too)."""
        self.slots.free(slot)
        self.held.discard(slot)

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
        slots = [item[0] for item in items]
        if len(set(slots)) != len(slots):  # two feeds would write the same cache positions
            raise ValueError(f"extend_many got a slot more than once: {slots}")
        for slot, tokens, max_new, forced in items:
            self.slots.check(slot)
            info = self.slots[slot]
            if info is None:
                raise ValueError(f"slot {slot} holds no request")
            if info.active:
                raise ValueError(f"slot {slot} is still decoding")
            self._check_ids(tokens, f"extend of slot {slot}")
            self._check_ids(forced_ids(forced), f"forced token of slot {slot}")
            feed = np.concatenate([[info.pending], np.asarray(tokens, np.int32).reshape(-1)])
            if info.length + len(feed) > self.max_len:
                raise ValueError(f"slot {slot}: {info.length} + {len(feed)} tokens exceed "
                                 f"max_len {self.max_len}")
            budget = info.budget if max_new is None else int(max_new)
            if budget < 1:  # the token sampled here would be past the budget
                raise ValueError(f"extend of slot {slot} needs a budget of at least one token, "
                                 f"got {budget}")
            rows.append((slot, info, feed.astype(np.int32), budget, forced))
        need = sum(self.pages_to_grow(slot, len(feed)) for slot, _, feed, _, _ in rows)
        if need > self.pages.num_free:
            raise OutOfPages(f"extend needs {need} pages, {self.pages.num_free} free")
        feed_rows = []
        for slot, info, feed, budget, forced in rows:
            self.slots.grow(slot, len(feed))
            feed_rows.append(FeedRow(info.pages, info.length, feed, [
                FeedSample(slot, info.sampling, info.counter, budget, int(forced),
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
        self._check_start(requests)
        version = self._weights_version(params)
        plan = plan_start(requests, self.pages, self.max_len, version)
        need = start_cost(plan, self.page_size)
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

    def _start_row(self, group: StartGroup, shared: Sequence[int]) -> FeedRow:
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
            budget = r.start_budget
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
            self.slots.bind(r.slot, slot_pages, 0, 0, r.counter, budget, r.sampling, False)
            samples.append(FeedSample(r.slot, r.sampling, r.counter, budget, r.forced, n, copy))
        start = len(shared) * self.page_size
        return FeedRow(pages, start, history[start:], samples)

    def lower_decode(self, params, state: DecodeState, steps: int | None = None, *,
                     attention: str | None = None, sampler: str | None = None,
                     xla_options: dict | None = None):
        """The decode program the next ``decode(params, state, steps)`` call would run, lowered
        (``jax.stages.Lowered``) and not run: ``.compile()`` it ahead, e.g. several in threads,
        and that call finds it compiled (jax caches the executable). ``attention``,
        ``sampler`` and ``xla_options`` override the engine's settings for this lowering only
        (the program a call runs after they are set), so threads need not change the engine."""
        steps = self.decode_steps if steps is None else int(steps)
        program, args, static = self._decode_call(
            params, state, self.slots.decoding(), steps, None, None, attention=attention,
            sampler=sampler, xla_options=xla_options)
        return program.lower(*args, **static)

    def _decode_call(self, params, state, active: list[int], steps: int, forced, stop_after, *,
                     attention: str | None = None, sampler: str | None = None,
                     xla_options: dict | None = None):
        """(program, arguments, static arguments) of a decode call of the ``active`` slots;
        ``decode`` and ``lower_decode`` both build their call here, so an ahead-of-time
        compile is of exactly the program the call runs."""
        rows = np.full(_batch_bucket(len(active), self.num_slots), self.num_slots, np.int32)
        rows[: len(active)] = active
        attention = attention or self.decode_choice.for_rows(len(rows))
        width, live_pages = self._decode_reads(active, steps, len(rows), attention)
        f = np.full((self.decode_steps, len(rows)), -1, np.int32)
        if forced is not None:
            f[: len(forced), : len(active)] = np.asarray(forced)[:, active]
        stop_after = len(active) + 1 if stop_after is None else max(1, int(stop_after))
        options = tuple(sorted((self.decode_xla_options if xla_options is None else xla_options).items()))
        program = decode_program_with(options) if options else decode_program
        args = (self.cfg, params, self._k, self._v, state, jnp.asarray(rows),
                jnp.asarray(self._table[:, :width]), live_pages, jnp.asarray(f), jnp.int32(steps),
                jnp.int32(stop_after))
        static = dict(steps=self.decode_steps, attention=attention, vocab_limit=self.vocab_limit,
                      max_len=self.max_len, kv_sharding=self._kv_sharding, interpret=self.interpret,
                      sampler=sampler or self.sampler)
        return program, args, static

    def start_cost(self, requests: Sequence[StartRequest]) -> int:
        """Pages ``start(requests)`` takes from the pool (served with ``self.params``)."""
        return start_cost(plan_start(requests, self.pages, self.max_len, self.params_version),
                          self.page_size)

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
        if forced is not None:
            self._check_ids(forced_ids(forced), "decode's forced tokens")
        active = self.slots.decoding()
        need = sum(self.pages_to_grow(s, steps) for s in active)
        if need > self.pages.num_free:
            raise OutOfPages(f"{len(active)} active slots need {need} pages for {steps} steps, "
                             f"{self.pages.num_free} free")
        for s in active:
            self.slots.grow(s, steps)
        t0 = time.perf_counter()
        program, args, static = self._decode_call(params, state, active, steps, forced, stop_after)
        self._k, self._v, state, outs = program(*args, **static)
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
        lengths = np.array([0 if info is None else info.length for info in self.slots])
        block = DecodeBlock(tokens, logprobs, valid, done, lengths)
        for s in active:
            info = self.slots[s]
            fed = int(block.valid[:, s].sum())
            if fed:
                last = int(np.flatnonzero(block.valid[:, s])[-1])
                info.pending = int(block.tokens[last, s])
                info.active = bool(block.done[last, s] == DoneReason.NOT_DONE)
            info.length += fed
            info.counter += fed
            info.budget -= fed
        block.lengths[active] = [self.slots[s].length for s in active]
        return state, block

    # ---- weights and memory ----------------------------------------------------------------
    def update_params(self, new_params) -> None:
        """Serve new weights: an ``nnx.split`` state of the served model's structure, or a
        module whose serving copy has the served one's shapes (a LoRA policy over the served
        base), copied once into the serving dtype and layout (``handoff.serving_copies``;
        several slices at once: ``handoff.update_engines``). A released engine gets its KV
        pool back."""
        graphdef, state = split_weights(new_params)
        update_engines([self], state, graphdef)

    def serve(self, weights: ServingWeights) -> None:
        """Take a hand-off's serving copy (made for ``self.layout``); make the pool again after
        ``release_memory``. Pages written under earlier weights are no longer shared."""
        if self.memory_released:
            self._k, self._v = self._new_pool()
        self.params = weights
        self.params_version += 1

    def release_memory(self) -> None:
        """Free the serving copy and the KV pool (``serving.release_during_update``: room for
        the train step on the same devices, docs/serving.md "Memory plan"); the next
        ``update_params`` makes both again. Held slots (partial rollouts paused with their KV)
        give their pages back (they are re-prefilled when continued); every other slot must be
        free."""
        for slot in sorted(self.held):
            self.free_resource(slot)
        if self.live_slots():
            raise ValueError(f"release_memory: slots {self.live_slots()} still hold requests")
        delete_arrays((self.params, self._k, self._v))
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
        return self.slots.free_slots()

    def live_slots(self) -> list[int]:
        return self.slots.live()

    def slot_length(self, slot: int) -> int:
        info = self.slots[slot]
        return 0 if info is None else info.length

    def free_tokens_in_slot(self, slot: int) -> int:
        return self.max_len - self.slot_length(slot)

    def slot_pages(self, slot: int) -> list[int]:
        info = self.slots[slot]
        return [] if info is None else list(info.pages)

    def slot_info(self, slot: int) -> SlotInfo:
        """A copy of the host mirror of a live slot (length, pending token, RNG counter,
        remaining budget, sampling, pages)."""
        info = self.slots[slot]
        if info is None:
            raise ValueError(f"slot {slot} holds no request")
        return dataclasses.replace(info, pages=list(info.pages))

    def is_held(self, slot: int) -> bool:
        """Whether ``slot`` still holds a rollout paused with its KV (``hold``): a decode state
        made since without keeping it freed it."""
        return slot in self.held

    def is_decoding(self, slot: int) -> bool:
        info = self.slots[slot]
        return info is not None and info.active

    def pages_to_grow(self, slot: int, num_tokens: int) -> int:
        """Pages ``slot`` must take to hold ``num_tokens`` more tokens (capped at max_len)."""
        return self.slots.pages_to_grow(slot, num_tokens)

    # ---- internals -------------------------------------------------------------------------
    @property
    def _kv_sharding(self):
        return self.placement.kv_sharding

    @property
    def _table(self) -> np.ndarray:
        return self.slots.table

    def _new_pool(self):
        return self.placement.new_pool(self.model_config, self.num_pages, self.page_size,
                                       self.cache_dtype)

    def _decode_reads(self, active: list[int], steps: int, batch: int, attention: str | None = None):
        """What a decode call of ``batch`` rows reads with ``attention`` (default: the path the
        engine runs at that batch): page-table columns, and for the ragged attention the list
        of the active slots' live pages (ids, rows in the compacted batch, first positions,
        count), in arrays of a fixed size per batch bucket."""
        size = self.page_size
        attention = attention or self.decode_choice.for_rows(batch)
        if attention == "reference":
            longest = max((self.slots[s].length + steps for s in active), default=0)
            width = self._context_pages(longest)
        else:  # the kernels and the ragged list stop at each row's length themselves
            width = self.table_width
        ids, rows, starts = [], [], []
        if attention == "ragged":
            for j, s in enumerate(active):  # rows are positions in the compacted batch
                info = self.slots[s]
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

    def _check_start(self, requests: Sequence[StartRequest]) -> None:
        """Refuse a ``start`` that would fail halfway, before it takes any page or slot (a
        failure after it had would leak both: pages allocated, slots bound but never fed)."""
        slots = [r.slot for r in requests]
        if len(set(slots)) < len(slots):
            raise ValueError(f"requests share a slot: {slots}")
        for i, r in enumerate(requests):
            self.slots.check(r.slot)
            if self.slots[r.slot] is not None:
                raise ValueError(f"slot {r.slot} holds a request")
            stop_row(r.sampling)  # at most MAX_STOP_IDS stop ids
            self._check_ids(r.history, f"request {i}'s history")
            self._check_ids(forced_ids(r.forced), f"request {i}'s forced token")

    def _check_ids(self, ids, what: str) -> None:
        check_token_ids(ids, self.model_config.vocab_size, what)

    def _weights_version(self, params) -> int | None:
        """The registry version of pages written with ``params``: the served copy's version;
        None for any other weights (their pages are neither registered nor looked up)."""
        return self.params_version if params is self.params else None

    def _run_rows(self, params, state, rows: list[FeedRow]):
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
        self._k, self._v, logits = feed_program(
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
        tok, lp = sample_program(logits, *(jnp.asarray(cols[c]) for c in (
            "rows", "seeds", "counters", "temperature", "top_k", "top_p", "forced")),
            vocab_limit=self.vocab_limit, sampler=self.sampler)
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
                info = self.slots[s.slot]
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
            info = self.slots[slot]
            sp = info.sampling
            vals["lengths"][q], vals["pending"][q], vals["active"][q] = (
                info.length, info.pending, info.active)
            vals["seeds"][q], vals["counters"][q], vals["budget"][q] = (
                sp.seed, info.counter, info.budget)
            vals["temperature"][q], vals["top_k"][q], vals["top_p"][q] = (
                sp.temperature, sp.top_k, sp.top_p)
            vals["stop_ids"][q] = stop_row(sp)
        c = self.num_slots
        src = np.zeros(c, np.int32)
        dst = np.full(c, self.num_pages, np.int32)  # out of range: skipped
        src[: len(copy_src)], dst[: len(copy_dst)] = copy_src, copy_dst
        t0 = time.perf_counter()
        self._k, self._v, state = insert_program(
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

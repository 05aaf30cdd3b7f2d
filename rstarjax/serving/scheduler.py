"""Rollout scheduler over several serving slices (rStar2-Agent §3.2, Fig. 7).

A *slice* is one ``Engine`` (its own slots, KV cache and, optionally, device group) driven by
its own thread. Rollouts are multi-turn *episodes* (see ``Episode``): decode until a stop,
hand the turn to the episode, which may start a tool call (a ``Future`` of the token ids to
append) and the slot waits while the other slots keep decoding; when the future resolves the
ids are appended with ``Engine.extend`` (no re-prefill) and decoding resumes.

Two assignment policies:

- ``"dynamic"`` (the paper's load-balanced scheduler): one shared queue. Given the maximum
  rollout length ``L``, a slice admits ``capacity_for(engine, L)`` new rollouts, the number
  its free KV capacity safely holds if every live rollout grew to ``L``; a slice pulls new
  rollouts the moment capacity frees. Tool calls are dispatched the moment they are parsed.
- ``"static"`` (the verl v0.2 baseline the paper compares against): requests are split
  equally across slices up front; with ``sync_turns=True`` each slice also runs its batch in
  lock-step turns (tool calls of a turn are executed together, the next turn starts when
  every call of the batch returned) and admits its next wave only when its batch is done.

Every wait is bounded: tool futures by ``tool_timeout_s`` (the episode is aborted), the whole
run by ``timeout_s`` (``TimeoutError``).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Protocol, Sequence

import numpy as np

from rstarjax.serving.engine import DoneReason, Engine
from rstarjax.serving.sampling import SamplingParams

POLICIES = ("dynamic", "static")


# ---- what an episode returns after a turn ------------------------------------------------

@dataclasses.dataclass
class Finish:
    """The episode is over; its slot is freed."""


@dataclasses.dataclass
class CallTool:
    """Wait for ``ids`` (a Future of token ids to append), then continue decoding."""

    ids: concurrent.futures.Future


@dataclasses.dataclass
class Extend:
    """Append ``ids`` and decode at most ``max_new_tokens`` more tokens."""

    ids: Sequence[int]
    max_new_tokens: int


class Episode(Protocol):
    """One rollout as the scheduler sees it (rl/agent_loop.py implements it)."""

    prompt_ids: Sequence[int]
    sampling: SamplingParams

    def forced_token(self, turn_offset: int) -> int:
        """Teacher-forced token at ``turn_offset`` of the current turn, or -1 to sample
        (scripted policies, benchmarks)."""

    def on_turn_end(self, ids: list[int], logprobs: list[float], reason: DoneReason
                    ) -> Finish | CallTool:
        ...

    def on_tool_ready(self, ids: Sequence[int], free_tokens_in_slot: int) -> Finish | Extend:
        ...

    def on_abort(self, why: str) -> None:
        ...


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

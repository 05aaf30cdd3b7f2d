"""Rollout scheduler over serving slices (rStar2-Agent §3.2, Fig. 7): the one drive loop of the
paged engines (``serving.completions.generate`` runs through it too).

A *slice* is one ``Engine`` (its own slots, page pool and, optionally, device) driven by its
own thread. Rollouts are multi-turn *episodes* (``Episode``): decode until a stop, hand the
turn to the episode, which may start a tool call (a ``Future`` of the token ids to append);
the rollout then waits, holding its pages, while the other slots keep decoding; when the
future resolves the ids are appended with ``Engine.extend`` (no re-prefill) and decoding
resumes. A rollout stays on the slice that holds its pages.

Admission by free pages (docs/serving.md has a worked example): a rollout (or the samples of
one prompt, which share its prefill and its full prompt pages) is admitted when the pool has
the pages to start it, plus a growth reserve of ``admit_reserve_tokens`` for it and for every
live rollout. With the reserve equal to the maximum rollout length ``L`` this is the paper's
estimate ("given a maximum rollout length L, we estimate the maximum number of rollouts K
that each GPU can safely handle") and nothing is ever preempted; a smaller reserve admits
more rollouts (their lengths are heavy-tailed) and, when pages run out mid-rollout, the
scheduler *preempts* the youngest rollout instead of failing: its pages return to the pool
and it is parked with its tokens and log-probs, then resumed (its conversation re-prefilled,
its RNG stream continued) before any new rollout is admitted. With ``adaptive_reserve`` a
slice starts with no reserve and doubles it at each preemption (``adaptive_growth``).

Partial rollouts (Kimi k1.5, arXiv 2501.12599, §2.6.2): ``run(..., token_budget=B)`` pauses a
rollout once it has sampled B tokens in this run (checked between decode calls, so at most
B + decode_steps - 1, and one more when a tool response arrives after B was spent: appending it
samples the response's first token): its pages return to the pool and it comes back in
``ScheduleStats.paused``, tokens, log-probs and RNG position kept. ``run(..., carried=paused)``
continues them first, by the re-prefill of a preempted rollout, under the weights the engines
hold then; with unchanged weights the tokens are those of an uninterrupted run.

Two assignment policies:

- ``"dynamic"`` (the paper's): one shared queue; a slice pulls new rollouts whenever its pages
  allow. Tool calls are dispatched the moment they are parsed.
- ``"static"`` (verl v0.2, the paper's baseline): requests split into equal contiguous
  chunks across slices up front; with ``sync_turns=True`` each slice also runs waves of its share in lock-step turns
  (a turn's tool calls return together before the next turn starts).

Per decode call a ``StepRecord`` notes pages in use, live / decoding / tool-waiting / parked
rollouts and preemptions so far (``SliceStats.timeline``). Every wait is bounded: tool futures
by ``tool_timeout_s`` (the episode is aborted), the run by ``timeout_s`` (``TimeoutError``);
a slice with nothing to decode blocks on its pending tool futures (no polling).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import math
import threading
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from rstarjax.models.kv_cache import pages_for
from rstarjax.serving.engine import Engine
from rstarjax.serving.programs import DoneReason, decode_kv_tokens
from rstarjax.serving.sampling import SamplingParams
from rstarjax.serving.schedule_stats import ScheduleStats, SliceStats, StepRecord
from rstarjax.serving.start_plan import StartRequest

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
        """``free_tokens_in_slot``: tokens the conversation may still grow by (to
        ``max_rollout_len``, or the slot's end); an ``Extend`` must leave room for one more."""

    def on_abort(self, why: str) -> None:
        ...


def capacity_for(engine: Engine, max_rollout_len: int) -> int:
    """Rollouts a slice can still admit with no risk of running out of pages (rStar2-Agent
    §3.2: "given a maximum rollout length L, we estimate the maximum number of rollouts K that
    each GPU can safely handle"): free pages minus the pages every live rollout may still
    grow into up to L, divided by the pages of one L-token rollout, at most the free slots."""
    if max_rollout_len > engine.max_len:
        raise ValueError(f"max rollout length {max_rollout_len} exceeds the slot size "
                         f"{engine.max_len}")
    growth = sum(engine.pages_to_grow(s, max_rollout_len) for s in engine.live_slots())
    per_rollout = pages_for(max_rollout_len, engine.page_size)
    return max(0, min(len(engine.free_slots()), (engine.free_pages - growth) // per_rollout))


def adaptive_growth(reserve: int, page_size: int, cap: int) -> int:
    """The growth reserve after a preemption under ``adaptive_reserve``: doubled, from one page,
    at most ``cap`` tokens. A slice that never runs out of pages keeps admitting what its pool
    holds (as launching every request would); one that does backs off towards the configured
    reserve in a few preemptions (multiplicative increase, as TCP's congestion window shrinks
    on a loss, mirrored)."""
    return min(int(cap), max(int(page_size), 2 * int(reserve)))


@dataclasses.dataclass(eq=False)  # identity: rollouts go in sets and lists by object
class _Rollout:
    episode: Episode
    seq: int  # admission order: the largest is the youngest (preempted first)
    prompt_len: int
    history: list[int]  # the whole conversation, the pending (last sampled) token included
    n_sampled: int = 0  # tokens the request sampled (its RNG stream position)
    slot: int | None = None  # None: parked (no pages)
    turn_ids: list[int] = dataclasses.field(default_factory=list)
    turn_logprobs: list[float] = dataclasses.field(default_factory=list)
    waiting: concurrent.futures.Future | None = None  # tool call in flight
    wait_since: float = 0.0
    append: tuple[list[int], int] | None = None  # ready tool ids + budget, not yet appended
    budget: int = 0  # tokens it may sample after the pending one (kept while parked)
    turn_start: int = 0  # cache length when its current turn started (prompt or tool turn in)
    run_start: int = 0  # n_sampled when the current run took it up (partial rollouts' budget)
    held_by: int | None = None  # paused with its KV kept: the index of the engine holding its slot


class _Source:
    """Where a slice gets its next episodes: the shared queue or its own static share."""

    def __init__(self, items):
        self._q = collections.deque(items)
        self._lock = threading.Lock()

    def __len__(self):
        with self._lock:
            return len(self._q)

    def pop_group(self, max_n: int, admit: Callable[[list], int]) -> list:
        """Pop up to ``max_n`` episodes from the head that share its prompt, as many as
        ``admit(group)`` says fit (atomically: other slices pop from the same queue)."""
        with self._lock:
            if not self._q or max_n < 1:
                return []
            key = tuple(self._q[0].prompt_ids)
            group = [self._q[0]]
            for ep in itertools.islice(self._q, 1, max_n):
                if tuple(ep.prompt_ids) != key:
                    break
                group.append(ep)
            k = admit(group)
            return [self._q.popleft() for _ in range(k)]


class RolloutScheduler:
    def __init__(self, engines: Sequence[Engine], *, max_rollout_len: int,
                 policy: str = "dynamic", sync_turns: bool | None = None,
                 admit_reserve_tokens: int | None = None, adaptive_reserve: bool = False,
                 decode_steps: int | None = None, stop_fraction: float = 0.25,
                 tool_timeout_s: float = 60.0, timeout_s: float = 3600.0):
        """``admit_reserve_tokens``: growth reserve per rollout for admission (default
        ``max_rollout_len``: the paper's safe estimate, never preempts); ``adaptive_reserve``:
        each slice starts a run with no reserve (it admits what its pool holds now) and every
        preemption doubles its reserve, from one page up to ``admit_reserve_tokens``
        (``adaptive_growth``); ``decode_steps``:
        tokens per decode call (default: each engine's); ``stop_fraction``: a decode call
        returns early once this fraction of its slots stopped (their tool calls go out and
        their slots refill without waiting for the remaining steps)."""
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
        self.reserve = self.max_rollout_len if admit_reserve_tokens is None \
            else int(admit_reserve_tokens)
        if self.reserve < 0:
            raise ValueError(f"admit_reserve_tokens must be >= 0, got {self.reserve}")
        self.adaptive_reserve = bool(adaptive_reserve)
        self.decode_steps = decode_steps
        if not 0.0 < stop_fraction <= 1.0:
            raise ValueError(f"stop_fraction must be in (0, 1], got {stop_fraction}")
        self.stop_fraction = float(stop_fraction)
        self.tool_timeout_s = float(tool_timeout_s)
        self.timeout_s = float(timeout_s)

    def run(self, episodes: Sequence[Episode], *, token_budget: int = 0,
            carried: Sequence["_Rollout"] = (), keep_kv: bool = False) -> ScheduleStats:
        """Run every episode to completion (their own objects collect the results), or with
        ``token_budget`` > 0 until it has sampled that many tokens in this run (it is then
        paused and returned in ``ScheduleStats.paused``). ``carried``: rollouts a previous run
        paused, continued before any new episode is admitted. ``keep_kv``: a paused rollout
        keeps its slot and KV pages (``Engine.hold``) and the next run decodes on from them;
        else, or when a run needs the pages for progress, it gives them back and is
        re-prefilled."""
        if token_budget < 0:
            raise ValueError(f"token_budget must be >= 0 (0 = no budget), got {token_budget}")
        if any((r.slot is not None and r.held_by is None) or r.waiting is not None or r.append is not None
               for r in carried):
            raise ValueError("carried rollouts must be ones a run paused (ScheduleStats.paused)")
        for ep in episodes:
            if len(ep.prompt_ids) >= self.max_rollout_len:
                raise ValueError(f"prompt of {len(ep.prompt_ids)} tokens leaves no room in the "
                                 f"maximum rollout length {self.max_rollout_len}")
        n = len(self.engines)
        if self.policy == "dynamic":
            shared = _Source(episodes)
            sources = [shared] * n
        else:
            # Contiguous equal chunks, as verl splits a batch across its workers (the 2G
            # samples of a prompt stay together, as do their lengths).
            bounds = np.linspace(0, len(episodes), n + 1).round().astype(int)
            sources = [_Source(episodes[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        stats = [SliceStats() for _ in range(n)]
        # a held rollout goes back to the slice holding its pages; any slice can re-prefill one
        loose = [r for r in carried if r.held_by is None]
        carry = [[r for r in carried if r.held_by == i] + loose[i::n] for i in range(n)]
        errors: list[BaseException] = []
        stop = threading.Event()
        deadline = time.monotonic() + self.timeout_s
        t0 = time.perf_counter()
        threads = [threading.Thread(target=self._guarded, daemon=True, name=f"slice-{i}",
                                    args=(e, i, src, st, stop, deadline, t0, errors, token_budget, c,
                                          keep_kv))
                   for i, (e, src, st, c) in enumerate(zip(self.engines, sources, stats, carry))]
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

    def _guarded(self, engine, index, source, stats, stop, deadline, t0, errors, token_budget, carried,
                 keep_kv):
        try:
            _SliceDriver(self, engine, source, stats, stop, deadline, t0, token_budget,
                         carried, index=index, keep_kv=keep_kv).run()
        except BaseException as e:  # surfaced by run(); stop the other slices too
            errors.append(e)
            stop.set()


class _SliceDriver:
    """The drive loop of one slice: settle tool results, resume preempted rollouts, admit
    new ones, decode; block on tool futures when nothing can decode."""

    def __init__(self, sched: RolloutScheduler, engine: Engine, source: _Source,
                 stats: SliceStats, stop: threading.Event, deadline: float, t0: float,
                 token_budget: int = 0, carried: Sequence[_Rollout] = (), index: int = 0,
                 keep_kv: bool = False):
        self.s, self.engine, self.source, self.stats = sched, engine, source, stats
        self.stop, self.deadline, self.t0 = stop, deadline, t0
        self.token_budget = int(token_budget)
        self.index, self.keep_kv = index, bool(keep_kv)
        self.live: dict[int, _Rollout] = {}  # slot -> rollout holding pages
        self.seq = itertools.count()
        # preempted (or paused by an earlier run), oldest first: carried ones older than any new
        self.parked: list[_Rollout] = []
        # held rollouts decode on in their slots; one whose slot a run without it freed since
        # (e.g. an evaluation on the same engines) is re-prefilled instead
        self.held = [r for r in carried if r.held_by is not None and engine.is_held(r.slot)]
        for r in carried:
            r.seq, r.run_start = next(self.seq), r.n_sampled
            if r not in self.held:
                r.slot, r.held_by = None, None
                self.parked.append(r)
        self.reserve = 0 if sched.adaptive_reserve else sched.reserve  # growth reserve, tokens
        self.state = None
        self.params = None
        self.steps = sched.decode_steps or engine.decode_steps
        if not 1 <= self.steps <= engine.decode_steps:
            raise ValueError(f"decode_steps {self.steps} must be in [1, "
                             f"{engine.decode_steps}] (the engine's)")
        # Budgets are capped to the rollout length only when it is below the slot size (else
        # the slot's own CONTEXT stop is the cap).
        self.cap = sched.max_rollout_len if sched.max_rollout_len < engine.max_len else None

    def run(self) -> None:
        e = self.engine
        self.state = e.init_decode_state(keep=[r.slot for r in self.held])
        for r in self.held:
            r.held_by = None
            self.live[r.slot] = r
        before = (e.busy_seconds, e.prefill_tokens, e.host_syncs)
        try:
            self.state = e.resume(self.state, [r.slot for r in self.held])
            while not self.stop.is_set():
                if time.monotonic() > self.deadline:
                    raise TimeoutError("rollout slice passed its deadline")
                self.params = e.params  # update_params between runs takes effect here
                progressed = self._settle_tools()
                progressed |= self._resume_parked()
                progressed |= self._admit()
                if self.token_budget:  # a pause frees a slot (and pages): admit into it next round
                    progressed |= self._pause_over_budget()
                if any(e.is_decoding(s) for s in self.live):
                    self._decode()
                    continue
                if not self.live and not self.parked and len(self.source) == 0:
                    break
                if not self._wait_for_tools() and not progressed:
                    if self._drop_held_kv():
                        continue
                    raise RuntimeError(
                        f"rollout slice stalled: {len(self.live)} live, {len(self.parked)} "
                        f"parked, {len(self.source)} queued, {e.free_pages} free pages")
        finally:
            self.stats.busy_s += e.busy_seconds - before[0]
            self.stats.prefill_tokens += e.prefill_tokens - before[1]
            self.stats.host_syncs += e.host_syncs - before[2]

    # ---- tokens and turns -------------------------------------------------------------------
    def _add_token(self, r: _Rollout, tok: int, lp: float, done: DoneReason) -> None:
        r.history.append(tok)
        r.turn_ids.append(tok)
        r.turn_logprobs.append(lp)
        r.n_sampled += 1
        if done == DoneReason.NOT_DONE:
            return
        action = r.episode.on_turn_end(r.turn_ids, r.turn_logprobs, done)
        r.turn_ids, r.turn_logprobs = [], []
        if isinstance(action, CallTool):
            r.waiting, r.wait_since = action.ids, time.monotonic()
        else:
            self._release(r)

    def _release(self, r: _Rollout) -> None:
        if r.slot is not None:
            self.engine.free_resource(r.slot)
            del self.live[r.slot]
            r.slot = None
        elif r in self.parked:
            self.parked.remove(r)

    def _preempt(self, r: _Rollout) -> None:
        """Free ``r``'s pages; it resumes later from its history (tokens and log-probs kept)."""
        self._unload(r)
        self.parked.append(r)
        self.parked.sort(key=lambda x: x.seq)
        self.stats.preemptions += 1
        if self.s.adaptive_reserve:
            self.reserve = adaptive_growth(self.reserve, self.engine.page_size, self.s.reserve)
            self.stats.reserve_tokens = self.reserve

    def _unload(self, r: _Rollout) -> None:
        """Take a live rollout off its slot and give its pages back, keeping what a resume by
        re-prefill needs (its remaining budget; history, tokens and RNG position are on ``r``)."""
        r.budget = self.engine.slot_info(r.slot).budget
        self.engine.free_resource(r.slot)
        del self.live[r.slot]
        r.slot = None

    def _pause_over_budget(self) -> bool:
        """Partial rollouts: a decoding rollout that sampled ``token_budget`` tokens in this
        run leaves it: held in its slot with its KV (``keep_kv``; a later run decodes on from
        it) or with its pages freed (a later run re-prefills it). Returns whether any left."""
        paused = len(self.stats.paused)
        for r in list(self.live.values()):
            if (self.engine.is_decoding(r.slot) and r.waiting is None and r.append is None
                    and r.n_sampled - r.run_start >= self.token_budget):
                if self.keep_kv:
                    r.budget = self.engine.slot_info(r.slot).budget  # for a re-prefill if it must be
                    self.state = self.engine.hold(self.state, r.slot)
                    del self.live[r.slot]
                    r.held_by = self.index
                else:
                    self._unload(r)
                self.stats.paused.append(r)
        return len(self.stats.paused) > paused

    def _drop_held_kv(self) -> bool:
        """A run that cannot progress while paused rollouts hold pages takes them back from the
        youngest (it is re-prefilled when continued). False when none holds any."""
        held = [r for r in self.stats.paused if r.held_by is not None]
        if not held:
            return False
        r = max(held, key=lambda x: x.seq)
        self.engine.free_resource(r.slot)
        r.slot, r.held_by = None, None
        return True

    def _youngest(self, exclude=()) -> _Rollout | None:
        cands = [r for r in self.live.values() if r not in exclude]
        return max(cands, key=lambda r: r.seq) if cands else None

    # ---- tool results -----------------------------------------------------------------------
    def _tool_outcome(self, r: _Rollout) -> bool:
        """Resolve a finished tool future into ``r.append`` (or end the episode). Returns
        whether ``r`` now needs its tool ids appended."""
        fut, r.waiting = r.waiting, None
        self.stats.tool_wait_s += time.monotonic() - r.wait_since
        try:
            ids = list(fut.result(timeout=0))
        except BaseException as exc:  # the tool layer failed: infrastructure, end cleanly
            r.episode.on_abort(f"tool call failed: {exc!r}")
            self._release(r)
            return False
        action = r.episode.on_tool_ready(ids, self._room(r))
        if isinstance(action, Finish):
            self._release(r)
            return False
        r.append = (list(action.ids), self._tool_turn_budget(r, action))
        return True

    def _room(self, r: _Rollout) -> int:
        """Tokens ``r``'s conversation may still grow by: to the rollout length cap where it is
        below the slot size, else to the slot's end."""
        return (self.engine.max_len if self.cap is None else self.cap) - len(r.history)

    def _tool_turn_budget(self, r: _Rollout, action: Extend) -> int:
        """The budget of the turn after ``action``'s tool ids, cut to the rollout length cap as
        ``_start_request`` cuts the first turn's (without the cap the slot's CONTEXT stop is it)."""
        budget = int(action.max_new_tokens)
        if self.cap is None:
            return budget
        room = self._room(r) - len(action.ids)
        if room < 1:
            raise ValueError(f"an episode appended {len(action.ids)} tool tokens to a rollout of "
                             f"{len(r.history)}, past max_rollout_len {self.cap}: it is told the "
                             f"room left (on_tool_ready's free_tokens_in_slot) and must finish")
        return min(budget, room)

    def _timed_out(self, r: _Rollout) -> bool:
        if time.monotonic() - r.wait_since <= self.s.tool_timeout_s:
            return False
        r.waiting.cancel()
        r.episode.on_abort(f"tool call did not return within {self.s.tool_timeout_s} s")
        self._release(r)
        return True

    def _settle_tools(self) -> bool:
        """Append the tool results that are ready (batched ``extend``); abort timed-out calls."""
        waiting = [r for r in self.live.values() if r.waiting is not None]
        if self.s.sync_turns and waiting:
            # Lock-step turns: nothing resumes while a slot still decodes or a call is out.
            if any(self.engine.is_decoding(s) for s in self.live):
                return False
            if any(not r.waiting.done() for r in waiting) and \
                    all(time.monotonic() - r.wait_since <= self.s.tool_timeout_s
                        for r in waiting):
                return False
        progressed = False
        ready = []
        for r in sorted(waiting, key=lambda x: x.seq):
            if not r.waiting.done():
                progressed |= self._timed_out(r)
                continue
            progressed = True
            if self._tool_outcome(r):
                ready.append(r)
        items = []
        for r in ready:
            if r.slot is None:  # preempted by an older ready rollout below
                continue
            ids, _ = r.append
            if not self._make_room(lambda: self.engine.pages_to_grow(r.slot, len(ids) + 1)
                                   + sum(self.engine.pages_to_grow(x.slot, len(x.append[0]) + 1)
                                         for x in items), keep=set(items) | {r}):
                self._preempt(r)  # it is the youngest: it waits for pages, parked
                continue
            items.append(r)
        if items:
            reqs = [(r.slot, r.append[0], r.append[1], r.episode.forced_token(0)) for r in items]
            self.state, outs = self.engine.extend_many(self.params, self.state, reqs)
            for r, out in zip(items, outs):
                r.history.extend(r.append[0])
                r.append = None
                r.turn_start = self.engine.slot_length(r.slot)
                self._add_token(r, out.token, out.logprob, out.done)
        return progressed

    def _make_room(self, need: Callable[[], int], keep) -> bool:
        """Preempt the youngest live rollouts outside ``keep`` until ``need()`` pages are free;
        False when only ``keep`` is left and it still does not fit."""
        while need() > self.engine.free_pages:
            if self._drop_held_kv():  # paused rollouts give their pages back first
                continue
            victim = self._youngest(exclude=keep)
            if victim is None or victim.seq < max(r.seq for r in keep):
                return False  # never preempt an older rollout for a younger one
            self._preempt(victim)
        return True

    # ---- resuming preempted rollouts ------------------------------------------------------------
    def _resume_request(self, r: _Rollout, slot: int) -> StartRequest:
        sampling = r.episode.sampling
        if r.append is not None:  # waiting on a tool when preempted: history + tool turn
            ids, budget = r.append
            return StartRequest(slot, r.history + ids, sampling, prompt_len=r.prompt_len,
                                counter=r.n_sampled, budget=budget,
                                forced=r.episode.forced_token(0))
        # Decoding when preempted: re-prefill all but the pending token, which is restored.
        return StartRequest(slot, r.history[:-1], sampling, prompt_len=r.prompt_len,
                            counter=r.n_sampled - 1, budget=r.budget + 1, forced=r.history[-1])

    def _resume_parked(self) -> bool:
        if not self.parked or (self.s.sync_turns and any(
                self.engine.is_decoding(s) for s in self.live)):
            return False
        progressed = False
        for r in list(self.parked):
            if r.waiting is not None:
                if not r.waiting.done():
                    progressed |= self._timed_out(r)
                    continue
                progressed = True
                if not self._tool_outcome(r):
                    continue
        ready = [r for r in self.parked if r.waiting is None]
        reqs, resumed = [], []
        free = self.engine.free_slots()
        for r in ready:  # oldest first; stop at the first that does not fit (no overtaking)
            if len(reqs) == len(free):
                break
            req = self._resume_request(r, free[len(reqs)])
            trial = reqs + [req]
            if not self._fits(trial, [len(q.history) + 1 for q in trial]):
                break
            reqs.append(req)
            resumed.append(r)
        if not reqs:
            return progressed
        self.state, outs = self.engine.start(self.params, self.state, reqs)
        for r, req, out in zip(resumed, reqs, outs):
            self.parked.remove(r)
            r.slot = req.slot
            self.live[req.slot] = r
            if r.append is not None:
                r.history.extend(r.append[0])
                r.append = None
                r.turn_start = self.engine.slot_length(r.slot)
                self._add_token(r, out.token, out.logprob, out.done)
            # else: the restored pending token was forced; it is in the history already (the
            # turn goes on: its start, and so its reserve, are unchanged)
        return True

    # ---- admission ------------------------------------------------------------------------------
    def _fits(self, reqs: list[StartRequest], lengths: list[int]) -> bool:
        """Pages to start ``reqs`` plus the growth reserve of every live and new rollout are
        free; one request with nothing live only has to fit (progress is certain)."""
        e = self.engine
        need = e.start_cost(reqs)
        if not self.live and len(reqs) == 1:
            return need <= e.free_pages
        reserve = sum(self._reserve_pages(r) for r in self.live.values())
        for n in lengths:
            target = min(n + self.reserve, e.max_len)
            reserve += pages_for(target, e.page_size) - pages_for(n, e.page_size)
        return need + reserve <= e.free_pages

    def _reserve_pages(self, r: _Rollout) -> int:
        """Pages a live rollout still holds in reserve: its current turn may grow to
        ``admit_reserve_tokens`` tokens (counted from the turn's start, so a turn's own
        tokens use up its reserve); one waiting on a tool keeps a whole reserve for its next
        turn (the tool's tokens and the model's answer)."""
        e = self.engine
        if r.waiting is not None or r.append is not None or not e.is_decoding(r.slot):
            return e.pages_to_grow(r.slot, self.reserve)
        grown = e.slot_length(r.slot) - r.turn_start
        return e.pages_to_grow(r.slot, max(0, self.reserve - grown))

    def _admit(self) -> bool:
        """Admit queued episodes (whole groups of one prompt where they fit) while pages and
        slots allow, then start them all in one batched ``Engine.start``."""
        if self.parked or (self.s.sync_turns and self.live):
            return False  # preempted rollouts resume first; static waves wait for the batch
        free = self.engine.free_slots()
        reqs: list[StartRequest] = []
        episodes: list = []
        while len(reqs) < len(free):
            trial: list[StartRequest] = []

            def how_many(group):
                for k in range(len(group), 0, -1):
                    cand = [self._start_request(ep, free[len(reqs) + i])
                            for i, ep in enumerate(group[:k])]
                    lengths = [len(q.history) for q in reqs + cand]
                    if self._fits(reqs + cand, lengths):
                        trial[:] = cand
                        return k
                return 0

            group = self.source.pop_group(len(free) - len(reqs), how_many)
            if not group:
                break
            reqs += trial
            episodes += group
        if not reqs:
            return False
        self.state, outs = self.engine.start(self.params, self.state, reqs)
        for ep, req, out in zip(episodes, reqs, outs):
            r = _Rollout(ep, next(self.seq), len(ep.prompt_ids), list(ep.prompt_ids),
                         slot=req.slot, turn_start=self.engine.slot_length(req.slot))
            self.live[req.slot] = r
            self.stats.episodes += 1
            self._add_token(r, out.token, out.logprob, out.done)
        return True

    def _start_request(self, ep: Episode, slot: int) -> StartRequest:
        budget = ep.sampling.max_new_tokens
        if self.cap is not None:
            budget = min(budget, self.cap - len(ep.prompt_ids))
        return StartRequest(slot, list(ep.prompt_ids), ep.sampling,
                            prompt_len=len(ep.prompt_ids), budget=budget,
                            forced=ep.forced_token(0))

    # ---- decoding -----------------------------------------------------------------------------
    def _decode(self) -> None:
        e = self.engine

        def need(n):
            return sum(e.pages_to_grow(s, n) for s in self.live if e.is_decoding(s))

        while True:  # fewer steps before preempting: some slots may stop in the meantime
            steps = self.steps
            while steps > 1 and need(steps) > e.free_pages:
                steps //= 2
            if need(steps) <= e.free_pages:
                break
            if not self._drop_held_kv():  # paused rollouts give their pages back first
                self._preempt(self._youngest())
        decoding = [s for s in self.live if e.is_decoding(s)]
        if not decoding:
            return
        forced = np.full((steps, e.num_slots), -1, np.int32)
        for s in decoding:
            r = self.live[s]
            for i in range(steps):
                forced[i, s] = r.episode.forced_token(len(r.turn_ids) + i)
        stop_after = max(1, math.ceil(self.s.stop_fraction * len(decoding)))
        # what held pages during the call's steps: counted before the tokens are taken, which
        # releases the rollouts that finished inside the call (counted after, the figures were
        # too low by every rollout that ended in a call: fewer live than tokens per step)
        live_during = len(self.live)
        t0 = time.perf_counter()
        self.state, block = e.decode(self.params, self.state, steps=steps, forced=forced,
                                     stop_after=stop_after)
        self.stats.decode_s += time.perf_counter() - t0
        pages_during = e.pages.num_used  # the call's peak: its pages grown, none released yet
        ran = int(block.valid.any(axis=1).sum())
        self.stats.decode_calls += 1
        self.stats.decode_steps += ran
        self.stats.generated_tokens += int(block.valid.sum())
        self.stats.decode_kv_tokens += decode_kv_tokens(block)
        for i in range(block.steps):
            for s in decoding:
                r = self.live.get(s)
                if r is not None and block.valid[i, s]:
                    self._add_token(r, int(block.tokens[i, s]), float(block.logprobs[i, s]),
                                    DoneReason(int(block.done[i, s])))
        waiting = sum(r.waiting is not None for r in self.live.values())
        self.stats.timeline.append(StepRecord(
            t=time.perf_counter() - self.t0, steps=ran, pages_in_use=pages_during,
            live=live_during, decoding=len(decoding),
            waiting=waiting, parked=len(self.parked), queued=len(self.source),
            preemptions=self.stats.preemptions))

    # ---- waiting ------------------------------------------------------------------------------
    def _wait_for_tools(self) -> bool:
        """Block until a pending tool future resolves (bounded by the nearest tool timeout and
        the run's deadline). False when no future is pending."""
        outstanding = [r for r in itertools.chain(self.live.values(), self.parked)
                       if r.waiting is not None and not r.waiting.done()]
        if not outstanding:
            return False
        now = time.monotonic()
        nearest = min(r.wait_since + self.s.tool_timeout_s for r in outstanding)
        timeout = max(0.0, min(nearest, self.deadline) - now) + 1e-3
        t0 = time.perf_counter()
        concurrent.futures.wait([r.waiting for r in outstanding], timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        self.stats.tool_blocked_s += time.perf_counter() - t0
        return True

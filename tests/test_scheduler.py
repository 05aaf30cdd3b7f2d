"""Rollout scheduler: page-capacity admission and preemption, shared prompt prefills, dynamic
hand-out, asynchronous tool waits (blocking, never spinning), bounded waits.

Episodes here are scripted protocol implementations (the agent loop's are tested in
test_agent_loop.py); engines run the real tiny model. Token-exactness under preemption is
tested against the full forward in test_engine.py.
"""
import concurrent.futures
import threading
import time

import jax.numpy as jnp
import pytest
from flax import nnx

from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.serving import DoneReason, SamplingParams
# the native API, and JetStream's prefill / insert in one test
from rstarjax.serving import JetStreamContractEngine as Engine
from rstarjax.serving.scheduler import (CallTool, Extend, Finish, RolloutScheduler,
                                        adaptive_growth, capacity_for)

MAX_LEN = 64
STOP = 3  # turn separator in the scripts


@pytest.fixture(scope="module")
def model():
    return Qwen3(ModelConfig.preset("tiny", dtype=jnp.float32), rngs=nnx.Rngs(0))


def make_engine(model, slots=2, **kw):
    return Engine(model, num_slots=slots, max_len=MAX_LEN, buckets=(16, MAX_LEN), page_size=8,
                  cache_dtype=jnp.float32, **kw)


class ScriptEpisode:
    """Turns of fixed tokens (each ends with STOP); between turns a 'tool' that answers
    ``tool_ids`` after ``tool_delay`` seconds (a timer thread), never (``None``) or already
    answered when the turn ends (``"now"``: no thread, so a run's schedule is deterministic)."""

    def __init__(self, turn_lengths, tool_delay=0.0, tool_ids=(5, 6)):
        self.prompt_ids = [1, 2]
        self.sampling = SamplingParams(temperature=0.0, stop_ids=(STOP,), max_new_tokens=60)
        self.script = [t for n in turn_lengths for t in [7] * (n - 1) + [STOP]]
        self.turns_left = len(turn_lengths)
        self.tool_delay, self.tool_ids = tool_delay, list(tool_ids)
        self.received, self.turn_end_times, self.aborted = [], [], None
        self.tool_returned_at = None

    def forced_token(self, offset):
        i = len(self.received) + offset
        return self.script[i] if i < len(self.script) else STOP

    def on_turn_end(self, ids, logprobs, reason):
        self.received += ids
        self.turn_end_times.append(time.monotonic())
        self.turns_left -= 1
        if self.turns_left == 0 or reason != DoneReason.STOP:
            return Finish()
        fut = concurrent.futures.Future()
        if self.tool_delay == "now":
            fut.set_result(self.tool_ids)
        elif self.tool_delay is not None:
            def answer():
                self.tool_returned_at = time.monotonic()
                fut.set_result(self.tool_ids)
            threading.Timer(self.tool_delay, answer).start()
        return CallTool(fut)

    def on_tool_ready(self, ids, free):
        return Extend(ids, max_new_tokens=60)

    def on_abort(self, why):
        self.aborted = why


def test_capacity_reserves_growth_of_live_rollouts(model):
    eng = make_engine(model, slots=4)  # 4 * 64 tokens = 32 pages of 8
    state = eng.init_decode_state()
    assert capacity_for(eng, MAX_LEN) == 4
    state = eng.insert(eng.prefill(eng.params, [1] * 10), state, 0)
    # 32 pages - 2 held - 6 the live rollout may still grow into, over 8 pages per L = 64 -> 3.
    assert capacity_for(eng, MAX_LEN) == 3
    assert capacity_for(eng, 16) == 3  # never more than the free slots
    with pytest.raises(ValueError):
        capacity_for(eng, MAX_LEN + 1)


def test_admission_by_pages_with_reserve_and_preemption_of_the_youngest(model):
    """Same episodes, a 12-page pool (1.5 rollouts of L): the paper's reserve (L) never
    preempts and runs them mostly one at a time; no reserve admits more and preempts the
    youngest when pages run out; both finish every episode with the same tokens, and the
    per-step records never show more pages in use than the pool has."""
    runs = {}
    for reserve in (None, 0):
        eng = make_engine(model, slots=4, kv_pages=12)
        eps = [ScriptEpisode([10, 20], tool_delay=0.05) for _ in range(5)]
        stats = RolloutScheduler([eng], max_rollout_len=MAX_LEN, admit_reserve_tokens=reserve,
                                 decode_steps=4).run(eps)
        st = stats.slices[0]
        assert all(e.received == e.script for e in eps)
        assert all(r.pages_in_use <= 12 for r in st.timeline) and st.timeline
        assert eng.pages.num_free == 12
        runs[reserve] = st
    safe, packed = runs[None], runs[0]
    assert safe.preemptions == 0 and packed.preemptions > 0
    assert max(r.live for r in packed.timeline) > max(r.live for r in safe.timeline)
    assert any(r.waiting for r in packed.timeline)  # admitted, waiting on a tool, reported


def test_adaptive_growth_doubles_from_one_page_to_the_cap():
    assert [adaptive_growth(r, 16, 256) for r in (0, 16, 32, 128, 256)] == [16, 32, 64, 256, 256]
    assert adaptive_growth(0, 16, 8) == 8  # never past the configured reserve


def test_adaptive_reserve_admits_what_the_pool_holds_until_a_preemption(model):
    """The same episodes as above, run with the configured reserve L (never preempts), with
    no reserve, and adaptively starting from no reserve: a pool that never overflows (a
    24 pages: 4 rollouts of 5 pages, 3 of L) admits as many at once as with no reserve; the tight 12-page pool preempts,
    and each preemption doubles the slice's reserve from one page (8 tokens) towards L, so it
    preempts no more often than with no reserve at all, and every episode finishes exactly.
    Tools answer at once: with timer threads, under load, the preemption counts depended on
    when each answer arrived."""
    def run(kv_pages, **kw):
        eng = make_engine(model, slots=4, kv_pages=kv_pages)
        eps = [ScriptEpisode([10, 20], tool_delay="now") for _ in range(5)]
        stats = RolloutScheduler([eng], max_rollout_len=MAX_LEN, decode_steps=4, **kw).run(eps)
        assert all(e.received == e.script for e in eps)
        assert eng.pages.num_free == kv_pages
        return stats.slices[0]

    roomy = {name: run(24, **kw) for name, kw in (
        ("L", {}), ("none", dict(admit_reserve_tokens=0)), ("adaptive", dict(adaptive_reserve=True)))}
    peak = {k: max(r.live for r in st.timeline) for k, st in roomy.items()}
    assert peak["adaptive"] == peak["none"] == 4 > peak["L"]
    assert roomy["adaptive"].preemptions == 0 and roomy["adaptive"].reserve_tokens == 0

    tight_none = run(12, admit_reserve_tokens=0)
    tight = run(12, adaptive_reserve=True)
    assert 0 < tight.preemptions <= tight_none.preemptions
    expected = 0
    for _ in range(tight.preemptions):
        expected = min(MAX_LEN, max(8, 2 * expected))
    assert tight.reserve_tokens == expected


def test_reserve_covers_a_turn_not_growth_past_it(model):
    """The growth reserve guarantees each turn ``admit_reserve_tokens`` tokens, counted from
    the turn's start: a turn already longer than that holds no reserve beyond its pages. A
    (50 tokens) and B (32) start in the 2 slots of a 10-page pool (pages of 8, reserve 24
    tokens); when B ends, A has grown 32 tokens past its reserve and holds 5 pages, so X
    (3 pages: 1 to start, 2 of reserve) fits in the 5 free ones and runs beside A. Reserving
    24 more tokens for A from its current length (3 pages) would keep X waiting until A ends."""
    eng = make_engine(model, slots=2, kv_pages=10)
    a, b, x = ScriptEpisode([50]), ScriptEpisode([32]), ScriptEpisode([4])
    stats = RolloutScheduler([eng], max_rollout_len=MAX_LEN, admit_reserve_tokens=24,
                             decode_steps=4).run([a, b, x])
    assert all(e.received == e.script for e in (a, b, x))
    assert stats.slices[0].preemptions == 0
    assert x.turn_end_times[0] < a.turn_end_times[0]  # admitted while A still decoded


def test_group_samples_share_one_prompt_prefill(model):
    eng = make_engine(model, slots=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    eps = []
    for p in prompts:
        for _ in range(4):
            e = ScriptEpisode([3])
            e.prompt_ids = list(p)
            eps.append(e)
    stats = RolloutScheduler([eng], max_rollout_len=MAX_LEN).run(eps)
    # 2 prompt prefills (the second prompt's group waits for free slots, then prefills once).
    assert stats.slices[0].prefill_tokens == sum(map(len, prompts))
    assert all(e.received == e.script for e in eps)


def test_tool_wait_does_not_stall_other_slots(model):
    eng = make_engine(model)
    slow = ScriptEpisode([4, 4], tool_delay=1.0)
    busy = ScriptEpisode([40])
    stats = RolloutScheduler([eng], max_rollout_len=MAX_LEN).run([slow, busy])
    assert busy.turn_end_times[0] < slow.tool_returned_at  # decoded while the tool ran
    assert slow.received == slow.script and busy.received == busy.script
    assert stats.slices[0].episodes == 2 and stats.slices[0].tool_wait_s > 0.5


def test_static_sync_turns_waits_for_the_batch(model):
    eng = make_engine(model)
    slow = ScriptEpisode([4, 4], tool_delay=0.2)
    busy = ScriptEpisode([40])
    RolloutScheduler([eng], max_rollout_len=MAX_LEN, policy="static").run([slow, busy])
    # Lock-step turns: the slow episode's second turn starts only after the busy turn ended.
    assert slow.turn_end_times[1] > busy.turn_end_times[0]


def test_dynamic_hands_out_work_as_capacity_frees(model):
    engines = [make_engine(model, slots=1), make_engine(model, slots=1)]
    RolloutScheduler(engines, max_rollout_len=MAX_LEN).run([ScriptEpisode([4])])  # compile
    # The first rollout holds its slice for 3 s (a slow tool call); short ones take ms each.
    long_first = [ScriptEpisode([2, 2], tool_delay=3.0)] + [ScriptEpisode([4]) for _ in range(7)]
    dyn = RolloutScheduler(engines, max_rollout_len=MAX_LEN, policy="dynamic").run(long_first)
    # The busy slice takes no more; the other takes the rest as its slot frees.
    assert sorted(s.episodes for s in dyn.slices) == [1, 7]
    eps = [ScriptEpisode([2, 2], tool_delay=3.0)] + [ScriptEpisode([4]) for _ in range(7)]
    sta = RolloutScheduler(engines, max_rollout_len=MAX_LEN, policy="static").run(eps)
    assert [s.episodes for s in sta.slices] == [4, 4]
    assert all(e.received == e.script for e in long_first + eps)


def test_waits_are_bounded(model):
    eng = make_engine(model)
    stuck = ScriptEpisode([4, 4], tool_delay=None)  # its tool never answers
    ok = ScriptEpisode([5])
    RolloutScheduler([eng], max_rollout_len=MAX_LEN, tool_timeout_s=0.3).run([stuck, ok])
    assert stuck.aborted and "0.3" in stuck.aborted and ok.received == ok.script
    with pytest.raises(TimeoutError):
        RolloutScheduler([eng], max_rollout_len=MAX_LEN, timeout_s=0.5).run(
            [ScriptEpisode([4, 4], tool_delay=None)])


def test_bad_input_and_episode_errors_surface(model):
    eng = make_engine(model)
    with pytest.raises(ValueError):
        RolloutScheduler([eng], max_rollout_len=MAX_LEN, policy="fifo")
    with pytest.raises(ValueError):
        RolloutScheduler([eng], max_rollout_len=MAX_LEN + 1)
    long_prompt = ScriptEpisode([4])
    long_prompt.prompt_ids = [1] * MAX_LEN
    with pytest.raises(ValueError):
        RolloutScheduler([eng], max_rollout_len=MAX_LEN).run([long_prompt])

    class Broken(ScriptEpisode):
        def on_turn_end(self, ids, logprobs, reason):
            raise RuntimeError("episode bug")

    with pytest.raises(RuntimeError, match="episode bug"):
        RolloutScheduler([make_engine(model)], max_rollout_len=MAX_LEN).run([Broken([4])])


def test_waiting_on_a_tool_blocks_instead_of_spinning(model):
    """Lock-step turns, one call back at once and one after 1 s: the slice sleeps on the
    pending future (the old loop polled the finished one at 100 % CPU)."""
    eng = make_engine(model)
    RolloutScheduler([eng], max_rollout_len=MAX_LEN, policy="static").run(
        [ScriptEpisode([2, 2], tool_delay=0.0), ScriptEpisode([2, 2], tool_delay=0.0)])  # compile
    eps = [ScriptEpisode([2, 2], tool_delay=0.0), ScriptEpisode([2, 2], tool_delay=1.0)]
    cpu0, wall0 = time.process_time(), time.monotonic()
    RolloutScheduler([eng], max_rollout_len=MAX_LEN, policy="static").run(eps)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert wall >= 1.0 and cpu < 0.5 * wall, (cpu, wall)
    assert all(e.received == e.script for e in eps)


def test_live_counts_the_rollouts_that_held_pages_during_each_call(model):
    """A decode step samples at most one token per rollout holding pages, so each call's tokens
    are at most its live count times its steps, and the run's at most mean_live x steps. The
    count was taken after the call released the rollouts that finished in it: 4 rollouts ending
    at once inside a 16-step call logged 0 live for a call that produced 4 x 5 tokens."""
    eng = make_engine(model, slots=4)
    eps = [ScriptEpisode([5 + i]) for i in range(4)]  # one turn each, all end inside the first call
    st = RolloutScheduler([eng], max_rollout_len=MAX_LEN, decode_steps=16).run(eps).slices[0]
    assert all(e.received == e.script for e in eps)
    assert [r.live for r in st.timeline][0] == 4 and st.timeline[0].decoding == 4
    assert st.generated_tokens <= sum(r.live * r.steps for r in st.timeline)
    assert st.generated_tokens <= st.mean_live * st.decode_steps
    assert max(r.pages_in_use for r in st.timeline) > 0  # the call's peak, before the releases

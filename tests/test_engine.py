"""Paged engine against an outside reference: repeated full (uncached) forward passes of the
model, through slot refills, preemption (re-prefill), ``extend``, shared prompt prefills and
tight page budgets."""
import concurrent.futures
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.serving import DoneReason, OutOfPages, SamplingParams, StartRequest, generate
# the native API and JetStream's contract (prefill / insert / generate / release) on one engine
from rstarjax.serving import JetStreamContractEngine as Engine
from rstarjax.serving.scheduler import CallTool, Extend, Finish, RolloutScheduler
from model_support import chaotic

MAX_LEN = 64
BUCKETS = (16, 64)
SLOTS = 4
PAGE = 8


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32)
    return chaotic(Qwen3(cfg, rngs=nnx.Rngs(0)), seed=1)


def _engine(model, slots=SLOTS, **kw):
    return Engine(model, num_slots=slots, max_len=MAX_LEN, buckets=BUCKETS, page_size=PAGE,
                  cache_dtype=jnp.float32, **kw)


_padded_forward = jax.jit(lambda state, tokens, graphdef: nnx.merge(graphdef, state)(tokens),
                          static_argnums=(2,))


def _full_logprobs(model, ids, temperature=1.0):
    """log_softmax of the uncached training forward's logits over the whole sequence, divided by
    ``temperature`` (float64 numpy).

    The sequence is right-padded to 2 * MAX_LEN so one compile serves every length:
    attention is causal, so padding after the sequence cannot change its logits."""
    graphdef, state = nnx.split(model)
    padded = np.zeros((1, 2 * MAX_LEN), np.int32)
    padded[0, : len(ids)] = ids
    logits = np.asarray(_padded_forward(state, jnp.asarray(padded), graphdef),
                        np.float64)[0, : len(ids)] / temperature
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def _greedy_reference(model, prompt, max_new, stops=()):
    seq, out = list(prompt), []
    for _ in range(max_new):
        tok = int(np.argmax(_full_logprobs(model, seq)[-1]))
        out.append(tok)
        seq.append(tok)
        if tok in stops:
            break
    return out


@pytest.mark.slow  # ~30 s on 2 shared cores: first compiles of the engine programs
def test_greedy_with_refill_and_mixed_lengths_equals_full_forward(model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (3, 17, 9, 30, 5)]
    max_new = 9
    refs = [_greedy_reference(model, p, max_new) for p in prompts]
    # A stop id that ends some requests early (mid-stream refill of their slot).
    stop = refs[0][2]
    refs = [r[: r.index(stop) + 1] if stop in r else r for r in refs]
    assert len({len(r) for r in refs}) > 1, "want requests of different lengths"
    eng = _engine(model)
    outs = generate(model, prompts, max_new, temperature=0.0, stop_ids=[stop], engine=eng)
    for p, o, r in zip(prompts, outs, refs):
        assert o.token_ids == r
        assert o.finish == ("stop" if r[-1] == stop else "length")
        lp = _full_logprobs(model, p + r[:-1])[len(p) - 1:]
        np.testing.assert_allclose(o.logprobs, lp[np.arange(len(r)), r], atol=1e-4)
    assert eng.pages.num_free == eng.num_pages  # every page returned


def test_sampled_logprobs_equal_training_forward(model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (4, 12, 7)]
    outs = generate(model, prompts, 12, temperature=0.9, top_p=0.95, top_k=50, seed=5,
                    engine=_engine(model))
    for p, o in zip(prompts, outs):
        ids = p + o.token_ids
        lp = _full_logprobs(model, ids[:-1], temperature=0.9)[len(p) - 1:]
        np.testing.assert_allclose(o.logprobs, lp[np.arange(len(o.token_ids)), o.token_ids],
                                   atol=1e-4)
    # Seeded per request: the same draws whatever the slot count (here 1 slot, 3 waves).
    one_slot = generate(model, prompts, 12, temperature=0.9, top_p=0.95, top_k=50, seed=5,
                        engine=_engine(model, slots=1))
    assert [o.token_ids for o in one_slot] == [o.token_ids for o in outs]


def test_generate_results_unchanged_when_a_tight_page_budget_forces_preemption(model):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (5, 11, 3, 9)]
    kw = dict(temperature=0.8, seed=3)
    roomy = generate(model, prompts, 30, **kw, engine=_engine(model))
    tight = _engine(model, kv_pages=10)  # 4 rollouts of <= 41 tokens need up to 24
    got = generate(model, prompts, 30, **kw, engine=tight)
    assert [o.token_ids for o in got] == [o.token_ids for o in roomy]
    np.testing.assert_allclose(np.concatenate([o.logprobs for o in got]),
                               np.concatenate([o.logprobs for o in roomy]), atol=1e-5)
    # Preempted requests were re-prefilled: more feed tokens than the prompts alone.
    assert tight.prefill_tokens > sum(map(len, prompts))
    assert tight.pages.num_free == tight.num_pages
    # The generate() signature: a kv_pages / page_size budget.
    small = generate(model, prompts, 30, **kw, num_slots=4, max_len=MAX_LEN, kv_pages=24,
                     page_size=4)
    assert [o.token_ids for o in small] == [o.token_ids for o in roomy]


class _ToolTurns:
    """Sampled (greedy) turns of ``turn_len`` tokens, each ended by its budget; between
    turns a 'tool' returns ``tool_ids`` after ``delay`` s; ``turns`` turns in all."""

    def __init__(self, prompt, turns, turn_len, tool_ids, delay, seed):
        self.prompt_ids = list(prompt)
        self.sampling = SamplingParams(temperature=0.0, max_new_tokens=turn_len, seed=seed)
        self.turns, self.turn_len, self.tool_ids, self.delay = turns, turn_len, tool_ids, delay
        self.convo = list(prompt)
        self.sampled = []  # (position in convo, token, logprob)
        self.done = 0

    def forced_token(self, offset):
        return -1

    def on_turn_end(self, ids, logprobs, reason):
        assert reason == DoneReason.BUDGET and len(ids) == self.turn_len
        for t, lp in zip(ids, logprobs):
            self.sampled.append((len(self.convo), t, lp))
            self.convo.append(t)
        self.done += 1
        if self.done == self.turns:
            return Finish()
        fut = concurrent.futures.Future()
        threading.Timer(self.delay, fut.set_result, (self.tool_ids[self.done - 1],)).start()
        return CallTool(fut)

    def on_tool_ready(self, ids, free):
        self.convo += list(ids)
        return Extend(ids, max_new_tokens=self.turn_len)

    def on_abort(self, why):
        raise AssertionError(why)


def _episodes(seed):
    rng = np.random.default_rng(seed)
    return [_ToolTurns(rng.integers(0, 512, size=int(rng.integers(3, 14))).tolist(), turns=3,
                       turn_len=int(rng.integers(4, 9)),
                       tool_ids=[rng.integers(0, 512, size=int(rng.integers(2, 7))).tolist()
                                 for _ in range(2)],
                       delay=float(rng.uniform(0.0, 0.05)), seed=i)
            for i in range(6)]


@pytest.mark.slow  # ~20 s: two scheduler runs plus the full-forward reference
def test_preemption_refills_and_extend_equal_full_forward_argmax(model):
    """Multi-turn greedy rollouts through a pool too small for them all: slots refill,
    rollouts are preempted (while decoding and while waiting on a tool) and re-prefilled,
    tool turns are appended with extend. Every sampled token is the full forward's argmax
    and its log-prob the full forward's, and the run equals one with ample pages."""
    eng = _engine(model, kv_pages=10)
    tight = _episodes(0)
    stats = RolloutScheduler([eng], max_rollout_len=MAX_LEN, admit_reserve_tokens=0,
                             decode_steps=4).run(tight)
    assert stats.slices[0].preemptions > 0, "the page budget should have forced preemption"
    assert eng.pages.num_free == eng.num_pages
    roomy = _episodes(0)
    RolloutScheduler([_engine(model)], max_rollout_len=MAX_LEN).run(roomy)
    for a, b in zip(tight, roomy):
        assert a.convo == b.convo
        np.testing.assert_allclose([s[2] for s in a.sampled], [s[2] for s in b.sampled],
                                   atol=1e-5)
        ref = _full_logprobs(model, a.convo)
        for pos, tok, lp in a.sampled:
            assert tok == int(np.argmax(ref[pos - 1])), f"position {pos}"
            assert abs(lp - ref[pos - 1, tok]) < 1e-4


def _sampled_at(episodes, temperature):
    for ep in episodes:
        ep.sampling = SamplingParams(temperature=temperature, max_new_tokens=ep.turn_len,
                                     seed=ep.sampling.seed)
    return episodes


@pytest.mark.parametrize("kv_pages,temperature,keep_kv", [
    (None, 0.0, False), (10, 1.0, False), (None, 1.0, True), (10, 0.0, True)])
def test_partial_rollouts_paused_and_continued_equal_uninterrupted_ones(model, kv_pages,
                                                                         temperature, keep_kv):
    """Partial rollouts: runs with a budget of 5 sampled tokens each pause the rollouts that
    reach it and the next run continues them (re-prefilled, or with ``keep_kv`` decoding on in
    the slots that kept their KV), until all finish; with unchanged weights every conversation
    and log-prob equals that of one uninterrupted run, greedy and sampled at T = 1 (the RNG
    stream continues; with a tight pool the runs also preempt, and held rollouts give their
    pages back). No run samples more than budget + decode_steps tokens of one rollout, and
    each run leaves the pool whole but for the pages the held rollouts keep."""
    budget, steps = 5, 4
    eng = _engine(model, **({"kv_pages": kv_pages} if kv_pages else {}))
    sched = RolloutScheduler([eng], max_rollout_len=MAX_LEN, admit_reserve_tokens=0,
                             decode_steps=steps)
    eps, carried, runs, held = _sampled_at(_episodes(0), temperature), [], 0, 0
    new = eps
    while new or carried:
        before = {id(r): r.n_sampled for r in carried}
        stats = sched.run(new, token_budget=budget, carried=carried, keep_kv=keep_kv)
        for r in stats.paused:
            # budget + steps - 1 from the decode calls, and one more when a tool response
            # arrives after the budget was spent (its first token is sampled as it is appended)
            assert r.n_sampled - before.get(id(r), 0) <= budget + steps
        kept = [r.slot for r in stats.paused if r.held_by is not None]
        held += len(kept)
        assert eng.pages.num_free == eng.num_pages - sum(len(eng.slot_pages(s)) for s in kept)
        new, carried, runs = [], stats.paused, runs + 1
        assert runs < 50, "partial rollouts did not finish"
    assert runs > 3  # the budget really paused them (turns of 4-8 tokens, 3 turns)
    assert (held > 0) == keep_kv
    roomy = _sampled_at(_episodes(0), temperature)
    RolloutScheduler([_engine(model)], max_rollout_len=MAX_LEN).run(roomy)
    for a, b in zip(eps, roomy):
        assert a.done == a.turns and a.convo == b.convo
        np.testing.assert_allclose([x[2] for x in a.sampled], [x[2] for x in b.sampled], atol=1e-5)


@pytest.mark.parametrize("keep_kv", [False, True])
def test_a_budget_pause_that_frees_the_last_slot_admits_the_queue(model, keep_kv):
    """More one-turn rollouts than slots, no tools: every admitted rollout reaches the budget in
    the same round and is paused, leaving nothing live. The freed slots take the queued
    rollouts in the next round (this once raised "rollout slice stalled" with every page
    free and a rollout queued); each pauses at the budget and the runs continue all to the
    end, equal to one uninterrupted run."""
    def one_turn():
        return [_ToolTurns(p.prompt_ids, turns=1, turn_len=12, tool_ids=[], delay=0.0, seed=i)
                for i, p in enumerate(_episodes(1))]
    eng = _engine(model, slots=2)
    sched = RolloutScheduler([eng], max_rollout_len=MAX_LEN, admit_reserve_tokens=0, decode_steps=4)
    eps = one_turn()
    stats = sched.run(eps, token_budget=4, keep_kv=keep_kv)
    assert len(stats.paused) == len(eps)  # all six admitted and paused in the one run
    carried, runs = stats.paused, 1
    while carried:
        carried, runs = sched.run([], token_budget=4, carried=carried, keep_kv=keep_kv).paused, runs + 1
        assert runs < 20, "partial rollouts did not finish"
    assert eng.pages.num_free == eng.num_pages
    roomy = one_turn()
    RolloutScheduler([_engine(model)], max_rollout_len=MAX_LEN).run(roomy)
    assert [a.convo for a in eps] == [b.convo for b in roomy]


def test_partial_rollout_arguments_are_checked(model):
    sched = RolloutScheduler([_engine(model)], max_rollout_len=MAX_LEN)
    with pytest.raises(ValueError, match="token_budget"):
        sched.run(_episodes(0), token_budget=-1)
    stats = sched.run(_episodes(1)[:2], token_budget=3)
    assert stats.paused and stats.as_dict()["paused"] == len(stats.paused)
    live = stats.paused[0]
    live.waiting = concurrent.futures.Future()  # not something a run pauses
    with pytest.raises(ValueError, match="carried rollouts"):
        sched.run([], carried=[live])


def test_shared_prompt_samples_equal_unshared_ones(model):
    """P prompts x n samples: one prefill per prompt, full prompt pages shared, the partial
    last page copied; every sample decodes exactly as if started alone."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (11, 16)]  # partial / full pages
    n = 2

    def reqs(share):
        out = []
        for i, p in enumerate(prompts):
            for j in range(n):
                out.append(StartRequest(len(out), p, SamplingParams(
                    temperature=1.0, seed=10 * i + j, max_new_tokens=20),
                    prompt_len=len(p) if share else 0))
        return out

    shared_eng = _engine(model)
    state = shared_eng.init_decode_state()
    rs = reqs(True)
    # pages: 11 tokens -> 2 (+1 partial copy per extra sample), 16 tokens -> 2 (all full)
    assert shared_eng.start_cost(rs) == (2 + 1) + 2
    state, firsts = shared_eng.start(shared_eng.params, state, rs)
    assert shared_eng.prefill_tokens == sum(map(len, prompts))  # P prefills, not P * n
    full = shared_eng.slot_pages(0)[0]
    assert shared_eng.pages.refcount(full) == n and shared_eng.slot_pages(1)[0] == full
    assert shared_eng.slot_pages(0)[1] != shared_eng.slot_pages(1)[1]  # partial page copied
    state, block = shared_eng.decode(shared_eng.params, state, steps=8)
    state, block2 = shared_eng.decode(shared_eng.params, state, steps=8)
    shared = np.concatenate([block.tokens, block2.tokens])
    shared_lp = np.concatenate([block.logprobs, block2.logprobs])

    alone = _engine(model)
    state = alone.init_decode_state()
    firsts_alone = []
    for r in reqs(False):
        state, [f] = alone.start(alone.params, state, [r])
        firsts_alone.append(f)
    assert alone.prefill_tokens == n * sum(map(len, prompts))
    state, block = alone.decode(alone.params, state, steps=8)
    state, block2 = alone.decode(alone.params, state, steps=8)
    assert [f.token for f in firsts] == [f.token for f in firsts_alone]
    np.testing.assert_allclose([f.logprob for f in firsts], [f.logprob for f in firsts_alone],
                               atol=1e-5)
    np.testing.assert_array_equal(shared, np.concatenate([block.tokens, block2.tokens]))
    np.testing.assert_allclose(shared_lp, np.concatenate([block.logprobs, block2.logprobs]),
                               atol=1e-5)
    assert len({tuple(shared[:, s]) for s in range(n)}) > 1  # the samples differ (seeds)


def _decode_slot(engine, state, slot, steps, log=None):
    """Step until ``slot`` is done; ``log`` (dict slot -> list) collects every slot's tokens."""
    toks, lps = [], []
    for _ in range(steps):
        state, res = engine.generate(engine.params, state)
        if log is not None:
            for s in np.flatnonzero(res.valid):
                log.setdefault(int(s), []).append(int(res.tokens[s]))
        if res.valid[slot]:
            toks.append(int(res.tokens[slot]))
            lps.append(float(res.logprobs[slot]))
        if res.done[slot]:
            break
    return state, toks, lps


def test_extend_equals_prefilling_the_whole_conversation(model):
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 512, size=11).tolist()
    tool = rng.integers(0, 512, size=13).tolist()
    eng = _engine(model)
    state = eng.init_decode_state()
    # A second, busy slot must not be disturbed by the extend.
    other = eng.prefill(eng.params, [7, 8, 9], sampling=SamplingParams(temperature=0, max_new_tokens=40))
    state = eng.insert(other, state, 1)
    log = {}
    pre = eng.prefill(eng.params, prompt, sampling=SamplingParams(temperature=0, max_new_tokens=5))
    state = eng.insert(pre, state, 0)
    state, turn1, _ = _decode_slot(eng, state, 0, 10, log)
    turn1 = [pre.token] + turn1
    assert len(turn1) == 5  # budget reached; the slot is now idle, as when waiting on a tool
    state, first = eng.extend(eng.params, state, 0, tool, max_new_tokens=6)
    state, rest, rest_lp = _decode_slot(eng, state, 0, 10, log)
    via_extend = [first.token] + rest
    assert eng.slot_length(0) == len(prompt) + len(turn1) + len(tool) + len(rest)

    # Reference 1: prefill the whole conversation in a fresh engine, then decode.
    eng2 = _engine(model)
    state2 = eng2.init_decode_state()
    convo = prompt + turn1 + tool
    pre2 = eng2.prefill(eng2.params, convo, sampling=SamplingParams(temperature=0, max_new_tokens=6))
    state2 = eng2.insert(pre2, state2, 0)
    state2, rest2, rest2_lp = _decode_slot(eng2, state2, 0, 10)
    assert via_extend == [pre2.token] + rest2
    np.testing.assert_allclose([first.logprob] + rest_lp, [pre2.logprob] + rest2_lp, atol=1e-5)
    # Reference 2: repeated full forwards.
    assert via_extend == _greedy_reference(model, convo, 6)
    # The busy slot decoded as if alone while slot 0 was extended next to it.
    other_tokens = [other.token] + log[1]
    assert other_tokens == _greedy_reference(model, [7, 8, 9], len(other_tokens))


def test_a_prefix_appended_to_equals_one_prefill_and_a_failed_append_keeps_its_pages(model):
    """JetStream's ``prefill(existing_prefix=...)``: appending to a prefix equals prefilling the
    whole text at once (its sampled token is fed first), and an append that is refused (past
    max_len, or more pages than are free) leaves the prefix holding its pages, so releasing it
    returns the pool whole (it once handed them over before the checks, and they leaked)."""
    rng = np.random.default_rng(3)
    head, tail = rng.integers(0, 512, size=11).tolist(), rng.integers(0, 512, size=9).tolist()
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    eng = _engine(model)
    pre = eng.prefill(eng.params, head, sampling=greedy)
    joined = eng.prefill(eng.params, tail, existing_prefix=pre)
    assert joined.length == len(head) + 1 + len(tail) and pre.pages == []
    assert joined.token == _greedy_reference(model, head + [pre.token] + tail, 1)[0]
    eng.release(joined)
    assert eng.pages.num_free == eng.num_pages

    pre = eng.prefill(eng.params, head, sampling=greedy)
    held = list(pre.pages)
    with pytest.raises(ValueError, match="max_len"):
        eng.prefill(eng.params, [1] * MAX_LEN, existing_prefix=pre)
    assert pre.pages == held
    eng.release(pre)
    assert eng.pages.num_free == eng.num_pages

    small = _engine(model, kv_pages=8)  # the head takes 2 pages of 8 tokens, another prompt 5
    pre = small.prefill(small.params, head, sampling=greedy)
    other = small.prefill(small.params, [5] * 40)
    with pytest.raises(OutOfPages):  # 32 tokens want 2 more pages, 1 is free
        small.prefill(small.params, [6] * 20, existing_prefix=pre)
    small.release(pre)
    small.release(other)
    assert small.pages.num_free == small.num_pages


def test_k_steps_per_device_call_one_host_sync(model):
    eng = _engine(model, decode_steps=8)
    state = eng.init_decode_state()
    state, _ = eng.start(eng.params, state, [StartRequest(
        s, [3 + s, 4, 5], SamplingParams(temperature=0, max_new_tokens=30)) for s in range(2)])
    syncs = eng.host_syncs
    state, block = eng.decode(eng.params, state)
    assert eng.host_syncs == syncs + 1 and block.valid.sum() == 2 * 8
    ref = _greedy_reference(model, [3, 4, 5], 9)
    assert block.tokens[:, 0].tolist() == ref[1:]
    # A call stops early once no slot is active: budgets end both slots mid-call.
    for _ in range(3):
        state, block = eng.decode(eng.params, state)
    assert not block.valid[-1].any() and eng.slot_info(0).active is False


def test_decode_kv_tokens_counts_what_each_step_attended_to(model):
    """The KV positions a decode call read (its HBM roofline's bytes): counted from the slots'
    lengths before the call, a row of length L that fed n tokens attended to L + 1, ..., L + n;
    rows that stop mid-call (a 2-token budget) count only their steps."""
    from rstarjax.serving.programs import decode_kv_tokens

    eng = _engine(model, decode_steps=4)
    state = eng.init_decode_state()
    prompts = {0: [3, 4, 5], 1: [6, 7, 8, 9, 10, 11, 12], 2: [5] * 12}
    budgets = {0: 30, 1: 3, 2: 30}
    state, _ = eng.start(eng.params, state, [StartRequest(
        s, p, SamplingParams(temperature=0, max_new_tokens=budgets[s])) for s, p in prompts.items()])
    before = {s: eng.slot_length(s) for s in prompts}
    state, block = eng.decode(eng.params, state)
    fed = block.valid.sum(axis=0)
    assert fed[1] < fed[0] == 4  # the 3-token budget ends row 1 inside the call
    expected = sum(sum(before[s] + i + 1 for i in range(int(fed[s]))) for s in prompts)
    assert decode_kv_tokens(block) == expected


def test_decode_xla_options_reach_the_decode_program_alone(model):
    """``decode_xla_options`` compile the decode program with XLA options of its own (cuBLAS
    GEMMs on a GPU; on CPU the GPU option changes nothing): the tokens are the full forward's
    greedy ones, and an option XLA does not know fails that compile by name, so the options
    really reach it."""
    from jax.errors import JaxRuntimeError

    prompt = [3, 4, 5]
    eng = _engine(model, slots=1, decode_steps=4,
                  decode_xla_options={"xla_gpu_enable_triton_gemm": False})
    state = eng.init_decode_state()
    state, _ = eng.start(eng.params, state, [StartRequest(
        0, prompt, SamplingParams(temperature=0, max_new_tokens=8))])
    state, block = eng.decode(eng.params, state)
    assert block.tokens[:, 0].tolist() == _greedy_reference(model, prompt, 5)[1:]
    eng.decode_xla_options = {"xla_no_such_option": True}
    with pytest.raises(JaxRuntimeError, match="xla_no_such_option"):
        eng.decode(eng.params, state)


def test_decode_attention_per_batch_size_runs_each_bucket_with_its_path(model, monkeypatch):
    """``decode_attention="ragged@4,reference"``: a decode program of at most 4 rows runs the
    ragged path, a larger one the reference (serving/decode_choice.py); both decode the full
    forward's greedy tokens."""
    import rstarjax.serving.engine as engine_module

    ran = []
    real = engine_module.decode_program

    def spy(*args, **kw):
        ran.append((len(args[5]), kw["attention"]))  # args[5]: the batch's rows
        return real(*args, **kw)

    monkeypatch.setattr(engine_module, "decode_program", spy)
    eng = _engine(model, slots=8, decode_steps=2, decode_attention="ragged@4,reference")
    assert eng.decode_attention == "ragged@4,reference"
    prompts = [[3, 4, 5], [7, 1], [9, 9, 2, 6], [5], [2, 8, 8], [6, 1, 4]]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    state = eng.init_decode_state()
    state, first = eng.start(eng.params, state, [StartRequest(i, p, greedy) for i, p in enumerate(prompts[:2])])
    state, block = eng.decode(eng.params, state)  # 2 active: the 4-row program
    tokens = {i: [int(first[i].token)] + block.tokens[:, i].tolist() for i in range(2)}
    state, later = eng.start(eng.params, state, [StartRequest(i, prompts[i], greedy) for i in range(2, 6)])
    state, block = eng.decode(eng.params, state)  # 6 active: the 8-row program
    for i in range(6):
        tokens[i] = tokens.get(i, [int(later[i - 2].token)]) + block.tokens[:, i].tolist()
    assert ran == [(4, "ragged"), (8, "reference")]
    for i, prompt in enumerate(prompts):
        assert tokens[i] == _greedy_reference(model, prompt, len(tokens[i])), i


def test_a_decode_program_compiled_ahead_is_the_one_the_call_runs(model):
    """``lower_decode(...).compile()`` for each of two paths (as threads would, not touching
    the engine), then ``decode`` under each: neither call compiles anything (counted by jax's
    backend-compile events), and the tokens are the full forward's greedy ones."""
    import threading

    compiles = []

    def count(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    eng = _engine(model, slots=2, decode_steps=2)
    state = eng.init_decode_state()
    prompt = [3, 4, 5]
    state, [first] = eng.start(eng.params, state, [StartRequest(
        0, prompt, SamplingParams(temperature=0, max_new_tokens=8))])
    lowered = [eng.lower_decode(eng.params, state, attention=a) for a in ("ragged", "reference")]
    threads = [threading.Thread(target=low.compile, daemon=True) for low in lowered]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
        assert not t.is_alive(), "a compile did not finish in 600 s"
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        tokens = [int(first.token)]
        for attention in ("ragged", "reference"):
            eng.decode_attention = attention
            state, block = eng.decode(eng.params, state)
            tokens += block.tokens[:, 0].tolist()
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == [], f"{len(compiles)} compiles in calls compiled ahead"
    assert tokens == _greedy_reference(model, prompt, 5)


def test_decode_choice_spec_and_its_errors():
    from rstarjax.serving.decode_choice import DecodeChoice, decode_choice_from_rows

    choice = DecodeChoice.parse("pallas_gpu_packed_layer@64, pallas_gpu_packed_rope")
    assert [choice.for_rows(r) for r in (4, 16, 64, 65, 256, 1024)] == \
        ["pallas_gpu_packed_layer"] * 3 + ["pallas_gpu_packed_rope"] * 3
    assert choice.spec() == "pallas_gpu_packed_layer@64,pallas_gpu_packed_rope"
    assert DecodeChoice.parse("ragged").paths == ((None, "ragged"),)
    # the fastest path per measured batch, neighbours merged; between two batches the larger's
    a, b = "ragged", "reference"
    assert decode_choice_from_rows({256: b, 32: a, 64: a}).spec() == f"{a}@64,{b}"
    assert decode_choice_from_rows({16: a, 64: b, 256: a}).spec() == f"{a}@16,{b}@64,{a}"
    for bad, why in [("flash", "not in"), ("ragged@64", "only the last"), ("ragged@x,reference", "whole number"),
                     ("ragged@64,ragged@16,reference", "increase"), ("ragged,reference", "only the last"),
                     ("ragged@0,reference", ">= 1"), ("", "not in")]:
        with pytest.raises(ValueError, match=why):
            DecodeChoice.parse(bad)


def test_stops_context_pages_and_bad_input(model):
    eng = _engine(model)
    state = eng.init_decode_state()
    with pytest.raises(ValueError):
        eng.prefill(eng.params, list(range(MAX_LEN + 1)))
    with pytest.raises(ValueError):
        eng.extend(eng.params, state, 0, [1, 2])  # no request in the slot
    pre = eng.prefill(eng.params, [1])
    with pytest.raises(ValueError):
        eng.insert(pre, state, SLOTS)
    eng.release(pre)
    pre = eng.prefill(eng.params, [1], sampling=SamplingParams(stop_ids=range(20)))
    with pytest.raises(ValueError):
        eng.insert(pre, state, 0)
    eng.release(pre)
    assert eng.pages.num_free == eng.num_pages
    # Context: a prompt of MAX_LEN - 3 tokens can feed 3 more tokens, so it samples 4.
    pre = eng.prefill(eng.params, [1] * (MAX_LEN - 3),
                      sampling=SamplingParams(temperature=0, max_new_tokens=50))
    state = eng.insert(pre, state, 0)
    with pytest.raises(ValueError):
        eng.insert(pre, state, 1)  # a prefix is inserted once
    state, toks, _ = _decode_slot(eng, state, 0, 10)
    assert len(toks) + 1 == 4 and eng.slot_length(0) == MAX_LEN
    assert eng.free_kv_tokens() == eng.kv_capacity_tokens - MAX_LEN
    with pytest.raises(ValueError):
        eng.extend(eng.params, state, 0, [1])
    eng.free_resource(0)
    assert eng.free_kv_tokens() == eng.kv_capacity_tokens
    assert eng.free_slots() == list(range(SLOTS))
    # A pool too small for what the caller asks: a clear error, no silent corruption.
    small = _engine(model, kv_pages=MAX_LEN // PAGE)
    st = small.init_decode_state()
    st = small.insert(small.prefill(small.params, [1] * 40), st, 0)
    with pytest.raises(OutOfPages):
        small.prefill(small.params, [2] * 30)
    with pytest.raises(ValueError, match="kv_pages"):
        _engine(model, kv_pages=MAX_LEN // PAGE - 1)  # cannot hold one max_len rollout


def test_update_params_serves_new_weights(model):
    other = chaotic(model, seed=7)
    eng = _engine(model)
    _, new_state = nnx.split(other)
    eng.update_params(new_state)
    out = generate(None, [[3, 4, 5]], 6, engine=eng)[0]
    assert out.token_ids == _greedy_reference(other, [3, 4, 5], 6)
    with pytest.raises(ValueError):
        eng.update_params({"not": jnp.zeros(3)})
    # bf16 serving (the default for bf16 models): one cast copy per update.
    bf = Engine(model, num_slots=SLOTS, max_len=MAX_LEN, page_size=PAGE, dtype=jnp.bfloat16)
    assert bf.params.layers[0]["up_proj"].dtype == jnp.bfloat16 and bf.cache_dtype == jnp.bfloat16
    bf.update_params(new_state)
    np.testing.assert_array_equal(
        np.asarray(bf.params.layers[1]["up_proj"], np.float32),
        np.asarray(other.layers.up_proj[1].astype(jnp.bfloat16), np.float32))


def _prompts_with_one_head(rng, head_pages, tails):
    """Prompts that agree on their first ``head_pages`` whole pages and differ after them."""
    head = rng.integers(0, 512, size=head_pages * PAGE).tolist()
    return [head + rng.integers(0, 512, size=n).tolist() for n in tails]


def _check_first_tokens(model, prompts, firsts):
    for p, f in zip(prompts, firsts):
        ref = _full_logprobs(model, p)[-1]
        assert f.token == int(np.argmax(ref))
        assert abs(f.logprob - ref[f.token]) < 1e-4


def test_prompts_sharing_whole_pages_in_one_start_read_them_after_they_are_written(model):
    """Different prompts with the same whole-page head, started in one call (issue 31): the
    later groups share the first group's head pages, yet every first token and the decode
    after it are the full forward's (they read the pages only once written)."""
    rng = np.random.default_rng(31)
    prompts = _prompts_with_one_head(rng, 2, (5, 3, 6))  # the shortest tail is fed first
    eng = _engine(model)
    state = eng.init_decode_state()
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    reqs = [StartRequest(s, p, sp, prompt_len=len(p)) for s, p in enumerate(prompts)]
    assert eng.start_cost(reqs) == 3 + 1 + 1  # the head's 2 pages are taken once
    free = eng.free_pages
    state, firsts = eng.start(eng.params, state, reqs)
    assert free - eng.free_pages == 3 + 1 + 1
    assert eng.slot_pages(1)[:2] == eng.slot_pages(0)[:2] == eng.slot_pages(2)[:2]  # shared
    assert eng.prefill_tokens == len(prompts[0]) + 3 + 6  # the others fed their tails only
    _check_first_tokens(model, prompts, firsts)
    state, block = eng.decode(eng.params, state, steps=4)
    for s, p in enumerate(prompts):
        ref = _greedy_reference(model, p, 5)
        assert [firsts[s].token] + block.tokens[:, s].tolist() == ref


def test_prefix_pages_of_older_weights_are_not_shared_after_an_update(model):
    """A slot still holds a prompt's pages written under the old weights (a rollout kept across
    an update); a new request with the same head after ``update_params`` must not use them."""
    rng = np.random.default_rng(32)
    old_prompt, new_prompt = _prompts_with_one_head(rng, 2, (3, 4))
    eng = _engine(model)
    state = eng.init_decode_state()
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    state, _ = eng.start(eng.params, state, [StartRequest(0, old_prompt, sp,
                                                          prompt_len=len(old_prompt))])
    other = chaotic(model, seed=11)
    eng.update_params(nnx.split(other)[1])
    req = StartRequest(1, new_prompt, sp, prompt_len=len(new_prompt))
    assert eng.start_cost([req]) == 3  # nothing to share under the new weights
    state, firsts = eng.start(eng.params, state, [req])
    assert not set(eng.slot_pages(1)) & set(eng.slot_pages(0))
    _check_first_tokens(other, [new_prompt], firsts)
    # Under the new weights the new pages are shared again.
    again = StartRequest(2, new_prompt[:16] + [7, 8], sp, prompt_len=18)
    assert eng.start_cost([again]) == 1
    state, firsts = eng.start(eng.params, state, [again])
    assert eng.slot_pages(2)[:2] == eng.slot_pages(1)[:2]
    _check_first_tokens(other, [again.history], firsts)

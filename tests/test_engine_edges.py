"""Edge cases of the paged engine, the rollout scheduler and their inputs, each checked against an
outside reference: the model's uncached full forward over the whole conversation (never the
engine's own earlier output).

Prompts of 1 token, one less / exactly / one more than a page, and of the slot's whole length; a
turn that ends on a page boundary and then an ``extend`` (an empty tool output too); a stop id
at the first sampled token, a one-token budget; the samples of one prompt reading their shared
pages after the sample that wrote them was freed and another rollout took its pages; sampled
multi-turn rollouts preempted by a tight pool equal to an unpreempted run, with a tool call that
never returns cancelled on the way; token ids outside the vocabulary refused before they reach
the pool; the rollout length cap over tool turns; the fused sampler's log-probs and vocab limit.
"""
import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.serving import DoneReason, Engine, SamplingParams, StartRequest
from rstarjax.serving.sampling import sample_tokens, sample_tokens_fused
from rstarjax.serving.scheduler import CallTool, Extend, Finish, RolloutScheduler
from model_support import chaotic, full_forward_logprobs, poison_pool

MAX_LEN = 64
PAGE = 8
SLOTS = 4
BUCKETS = (16, 64)  # the shapes of tests/test_engine.py
REF_ROWS = 8  # conversations per reference forward (one compiled shape)
LOGPROB_TOL = 1e-4  # float32 engine vs float32 full forward
TIE_TOL = 1e-5  # a greedy token this close to the forward's best is a float tie


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32)
    return chaotic(Qwen3(cfg, rngs=nnx.Rngs(0)), seed=1)


def _engine(model, **kw):
    return Engine(model, num_slots=SLOTS, max_len=MAX_LEN, buckets=BUCKETS, page_size=PAGE,
                  cache_dtype=jnp.float32, **kw)


# ---- the reference ----------------------------------------------------------------------------

def full_logprobs(model, convos) -> list[np.ndarray]:
    """The uncached forward's log-probs of each whole conversation, right-padded to 2 * MAX_LEN
    (``model_support``)."""
    return full_forward_logprobs(model, convos, rows=REF_ROWS, width=2 * MAX_LEN)


@dataclasses.dataclass
class Transcript:
    """A conversation as the engine produced it: every token, and per sampled token its position,
    id and log-prob; ``greedy``: sampled at temperature 0 (its tokens must be the argmax)."""

    convo: list[int]
    greedy: bool
    sampled: list[tuple[int, int, float]] = dataclasses.field(default_factory=list)

    def add_sampled(self, token: int, logprob: float) -> None:
        self.sampled.append((len(self.convo), int(token), float(logprob)))
        self.convo.append(int(token))


def mismatches(model, transcripts: list[Transcript]) -> list[str]:
    """Sampled tokens that disagree with the full forward: a greedy one that is not its argmax
    (beyond a float tie), or any log-prob off by more than LOGPROB_TOL."""
    bad = []
    for i, (t, ref) in enumerate(zip(transcripts, full_logprobs(model, [t.convo for t in transcripts]))):
        for pos, tok, lp in t.sampled:
            row = ref[pos - 1]  # the logits at pos - 1 predict the token at pos
            best = int(np.argmax(row))
            if t.greedy and tok != best and row[best] - row[tok] > TIE_TOL:
                bad.append(f"transcript {i} position {pos}: greedy {tok}, full forward {best}")
            elif abs(lp - row[tok]) > LOGPROB_TOL:
                bad.append(f"transcript {i} position {pos}: log-prob {lp:.6f}, full forward "
                           f"{row[tok]:.6f}")
    return bad


def _decode_all(engine, state, transcripts: dict[int, Transcript], steps=None):
    """One decode call; every valid token goes to its slot's transcript."""
    state, block = engine.decode(engine.params, state, steps=steps)
    for slot, t in transcripts.items():
        for i in np.flatnonzero(block.valid[:, slot]):
            t.add_sampled(block.tokens[i, slot], block.logprobs[i, slot])
    return state, block


def _decode_until_idle(engine, state, transcripts: dict[int, Transcript], steps=None):
    """Decode calls until none of ``transcripts``' slots decodes."""
    while any(engine.is_decoding(s) for s in transcripts):
        state, _ = _decode_all(engine, state, transcripts, steps)
    return state


# ---- page boundaries, the whole slot, tiny budgets ---------------------------------------------

def test_prompts_and_turns_on_page_boundaries_equal_the_full_forward(model):
    """Prompts of 1, PAGE - 1, PAGE, PAGE + 1 and 2 * PAGE tokens, each sampled by a group of two
    (shared full pages, copied partial page); every turn ends with the cache exactly on a page
    boundary, then an ``extend`` whose feed fills exactly one more page, then more decoding; then a
    third sample of the prompt starts on its registered pages."""
    rng = np.random.default_rng(0)
    eng = _engine(model)
    poison_pool(eng)
    state = eng.init_decode_state()
    transcripts = []
    for n in (1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE):
        prompt = rng.integers(1, 512, size=n).tolist()
        # budget b leaves the cache at n + b - 1 tokens (the last sampled one is pending)
        budget = (-(n - 1)) % PAGE or PAGE
        sp = [SamplingParams(temperature=t, seed=n + i, max_new_tokens=budget)
              for i, t in enumerate((0.0, 1.0))]
        ts = {s: Transcript(list(prompt), sp[s].greedy) for s in (0, 1)}
        state, outs = eng.start(eng.params, state, [StartRequest(s, prompt, sp[s], prompt_len=n)
                                                   for s in (0, 1)])
        for s, out in enumerate(outs):
            ts[s].add_sampled(out.token, out.logprob)
        state = _decode_until_idle(eng, state, ts, steps=4)
        for s, t in ts.items():
            assert len(t.sampled) == budget and eng.slot_length(s) % PAGE == 0
            tool = rng.integers(1, 512, size=PAGE - 1).tolist()  # pending + 7: one whole page
            t.convo += tool
            state, out = eng.extend(eng.params, state, s, tool, max_new_tokens=3)
            assert eng.slot_length(s) % PAGE == 0
            t.add_sampled(out.token, out.logprob)
        state = _decode_until_idle(eng, state, ts)
        # a later start of the prompt reads its registered full pages (its last token fed again)
        late = ts[2] = Transcript(list(prompt), True)
        state, [out] = eng.start(eng.params, state, [StartRequest(
            2, prompt, SamplingParams(temperature=0.0, max_new_tokens=3), prompt_len=n)])
        shared = (n - 1) // PAGE
        assert eng.slot_pages(2)[:shared] == eng.slot_pages(0)[:shared]
        late.add_sampled(out.token, out.logprob)
        state = _decode_until_idle(eng, state, {2: late})
        for s in ts:
            eng.free_resource(s)
        assert eng.free_pages == eng.num_pages
        transcripts += ts.values()
    bad = mismatches(model, transcripts)
    assert not bad, "\n".join(bad[:20])


def test_prompts_filling_the_slot_stop_at_its_context(model):
    """A prompt of MAX_LEN tokens samples one token (CONTEXT: it cannot be fed); one of MAX_LEN - 1
    samples two; an ``extend`` past the slot is refused and leaves the pages as they were."""
    rng = np.random.default_rng(1)
    eng = _engine(model)
    state = eng.init_decode_state()
    sp = SamplingParams(temperature=0.0, max_new_tokens=50)
    full, almost = (rng.integers(1, 512, size=n).tolist() for n in (MAX_LEN, MAX_LEN - 1))
    state, outs = eng.start(eng.params, state, [StartRequest(0, full, sp, prompt_len=MAX_LEN),
                                                StartRequest(1, almost, sp, prompt_len=MAX_LEN - 1)])
    assert outs[0].done == DoneReason.CONTEXT and outs[1].done == DoneReason.NOT_DONE
    ts = {0: Transcript(list(full), True), 1: Transcript(list(almost), True)}
    for s, out in enumerate(outs):
        ts[s].add_sampled(out.token, out.logprob)
    state, block = _decode_all(eng, state, {1: ts[1]})
    assert block.done[block.valid[:, 1], 1].tolist() == [DoneReason.CONTEXT]
    assert [eng.slot_length(s) for s in (0, 1)] == [MAX_LEN, MAX_LEN]
    free = eng.free_pages
    with pytest.raises(ValueError, match="exceed max_len"):
        eng.extend(eng.params, state, 0, [])
    assert eng.free_pages == free
    bad = mismatches(model, list(ts.values()))
    assert not bad, "\n".join(bad)
    for s in (0, 1):
        eng.free_resource(s)
    assert eng.free_pages == eng.num_pages


def test_first_token_stop_one_token_budget_and_an_empty_tool_output(model):
    """A stop id that is the very first sampled token ends the turn there (STOP, one token); a
    budget of one token ends it after one (BUDGET); an ``extend`` with no tokens (an empty tool
    output) continues from the pending token as the full forward does; a budget below one token
    is refused."""
    prompt = [11, 12, 13, 14, 15]
    first = int(np.argmax(full_logprobs(model, [prompt])[0][-1]))
    eng = _engine(model)
    state = eng.init_decode_state()
    stop_first = SamplingParams(temperature=0.0, stop_ids=(first,), max_new_tokens=20)
    one = SamplingParams(temperature=0.0, max_new_tokens=1)
    state, outs = eng.start(eng.params, state, [StartRequest(0, prompt, stop_first, prompt_len=5),
                                                StartRequest(1, prompt, one, prompt_len=5)])
    assert [(o.token, o.done) for o in outs] == [(first, DoneReason.STOP), (first, DoneReason.BUDGET)]
    assert not eng.is_decoding(0) and not eng.is_decoding(1)
    ts = {s: Transcript(list(prompt), True) for s in (0, 1)}
    for s, out in enumerate(outs):
        ts[s].add_sampled(out.token, out.logprob)
    for s in (0, 1):
        with pytest.raises(ValueError, match="budget"):
            eng.extend(eng.params, state, s, [], max_new_tokens=0)
        state, out = eng.extend(eng.params, state, s, [], max_new_tokens=3)  # an empty output
        ts[s].add_sampled(out.token, out.logprob)
    state = _decode_until_idle(eng, state, ts)
    assert all(len(t.sampled) == 4 for t in ts.values())
    bad = mismatches(model, list(ts.values()))
    assert not bad, "\n".join(bad)
    with pytest.raises(ValueError, match="budget"):
        eng.start(eng.params, state, [StartRequest(2, prompt, one, prompt_len=5, budget=0)])
    for s in (0, 1):
        eng.free_resource(s)
    assert eng.free_pages == eng.num_pages and eng.free_slots() == list(range(SLOTS))


# ---- shared prompt pages -----------------------------------------------------------------------

def test_group_samples_read_their_shared_pages_after_the_writer_is_gone(model):
    """Three sampled samples of one prompt share its full pages (written by the first). The first
    is freed mid-decode and an unrelated prompt takes its slot and pages; later the third is
    re-prefilled (a preempted rollout's resume: its history, its pending token forced) into
    another slot while it still holds the registered prompt pages, then freed. Every token of
    every rollout matches the full forward on a pool full of junk."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(1, 512, size=2 * PAGE + 3).tolist()
    other = rng.integers(1, 512, size=PAGE + 5).tolist()
    eng = _engine(model)
    poison_pool(eng, seed=2)
    state = eng.init_decode_state()
    sps = [SamplingParams(temperature=1.0, seed=40 + s, max_new_tokens=30) for s in range(3)]
    state, outs = eng.start(eng.params, state, [StartRequest(s, prompt, sps[s], prompt_len=len(prompt))
                                                for s in range(3)])
    shared = eng.slot_pages(0)[:2]
    assert all(eng.slot_pages(s)[:2] == shared for s in range(3))
    ts = {s: Transcript(list(prompt), False) for s in range(3)}
    for s, out in enumerate(outs):
        ts[s].add_sampled(out.token, out.logprob)
    state, _ = _decode_all(eng, state, ts, steps=4)
    done = [ts.pop(0)]  # the writer of the shared pages goes; its partial page is reused
    eng.free_resource(0)
    state, [out] = eng.start(eng.params, state, [StartRequest(
        0, other, SamplingParams(temperature=1.0, seed=7, max_new_tokens=30), prompt_len=len(other))])
    ts[0] = Transcript(list(other), False)
    ts[0].add_sampled(out.token, out.logprob)
    state, _ = _decode_all(eng, state, ts, steps=5)
    # resume slot 2's rollout in slot 3 by re-prefill, as the scheduler does after a preemption
    info, t2 = eng.slot_info(2), ts.pop(2)
    state = eng.hold(state, 2)
    state, [out] = eng.start(eng.params, state, [StartRequest(
        3, t2.convo[:-1], sps[2], prompt_len=len(prompt), counter=info.counter - 1,
        budget=info.budget + 1, forced=t2.convo[-1])])
    assert out.token == t2.convo[-1] and eng.slot_pages(3)[:2] == shared  # registered pages reused
    eng.free_resource(2)
    ts[3] = t2
    state, _ = _decode_all(eng, state, ts, steps=6)
    assert eng.pages.refcount(shared[0]) == 2  # slots 1 and 3
    bad = mismatches(model, done + list(ts.values()))
    assert not bad, "\n".join(bad[:20])
    for s in list(ts):
        eng.free_resource(s)
    assert eng.free_pages == eng.num_pages


# ---- preemption, tools, cancellation through the scheduler -------------------------------------

class ToolEpisode:
    """Turns of ``turn_lens`` sampled tokens, separated by tool responses (``tools``: token ids,
    answered at once, or None: a call that never returns). Records the conversation."""

    def __init__(self, prompt, sampling, turn_lens, tools):
        self.prompt_ids = list(prompt)
        self.sampling = dataclasses.replace(sampling, max_new_tokens=turn_lens[0])
        self.turn_lens, self.tools = list(turn_lens), list(tools)
        self.t = Transcript(list(prompt), sampling.greedy)
        self.turns, self.aborted, self.reasons = 0, None, []

    def forced_token(self, offset):
        return -1

    def on_turn_end(self, ids, logprobs, reason):
        for tok, lp in zip(ids, logprobs):
            self.t.add_sampled(tok, lp)
        self.reasons.append(reason)
        self.turns += 1
        if self.turns == len(self.turn_lens):
            return Finish()
        fut = concurrent.futures.Future()
        if self.tools[self.turns - 1] is not None:
            fut.set_result(self.tools[self.turns - 1])
        return CallTool(fut)

    def on_tool_ready(self, ids, free_tokens_in_slot):
        if len(ids) + 1 > free_tokens_in_slot:
            return Finish()
        self.t.convo += list(ids)
        return Extend(ids, max_new_tokens=min(self.turn_lens[self.turns], free_tokens_in_slot - len(ids)))

    def on_abort(self, why):
        self.aborted = why


def _workload(seed: int) -> list[ToolEpisode]:
    """Groups of 2 to 3 sampled samples of prompts of 5 to 20 tokens, two or three turns, tool
    responses of 0 to 6 tokens (an empty one too); the first group's first sample makes a tool
    call that never returns. At most 20 + 3 * 8 + 2 * 6 = 56 tokens per rollout."""
    rng = np.random.default_rng(seed)
    eps = []
    for g in range(4):
        prompt = rng.integers(1, 512, size=int(rng.integers(5, 21))).tolist()
        for _ in range(int(rng.integers(2, 4))):
            turns = [int(rng.integers(2, 9)) for _ in range(int(rng.integers(2, 4)))]
            tools = [rng.integers(1, 512, size=int(rng.integers(0, 7))).tolist() for _ in turns[1:]]
            eps.append(ToolEpisode(prompt, SamplingParams(temperature=1.0, seed=100 * seed + len(eps)),
                                   turns, tools))
    eps[0].tools[0] = None
    eps[1].tools[0] = []
    return eps


def test_preempted_sampled_tool_rollouts_equal_a_roomy_run_and_the_full_forward(model):
    """The same sampled multi-turn workload through a pool of 10 pages (preemption, resumes by
    re-prefill, a cancelled tool call holding pages meanwhile) and through a roomy one: the
    rollouts' tokens are identical (the sampler's key is fold_in(seed, counter), whatever slot or
    schedule), their log-probs equal the full forward's, and every page comes back."""
    runs = {}
    for kv_pages in (0, 10):
        eng = _engine(model, kv_pages=kv_pages, decode_steps=8)
        poison_pool(eng, seed=kv_pages)
        eps = _workload(5)
        stats = RolloutScheduler([eng], max_rollout_len=MAX_LEN, admit_reserve_tokens=0,
                                 decode_steps=4, tool_timeout_s=0.5).run(eps)
        assert eng.free_pages == eng.num_pages and eng.free_slots() == list(range(SLOTS))
        runs[kv_pages] = (eps, stats.slices[0].preemptions)
    (roomy, _), (tight, preemptions) = runs[0], runs[10]
    assert preemptions > 0, "the tight pool should have preempted rollouts"
    assert "did not return" in tight[0].aborted and "did not return" in roomy[0].aborted
    for i, (a, b) in enumerate(zip(roomy, tight)):
        assert a.t.convo == b.t.convo, f"rollout {i}: tokens differ between the two pools"
        np.testing.assert_allclose([x[2] for x in a.t.sampled], [x[2] for x in b.t.sampled],
                                   atol=1e-5, err_msg=f"rollout {i}")
        if i:
            assert a.turns == len(a.turn_lens)
    bad = mismatches(model, [e.t for e in tight])
    assert not bad, "\n".join(bad[:20])


def test_prompts_and_resumes_fed_in_chunks_equal_the_full_forward(model):
    """Feeds longer than ``prefill_chunk`` go in chunks, and rows past ``max_prefill_tokens`` in
    further calls (a long prompt, a long rollout re-prefilled after preemption): the same
    preempted workload through 8-token chunks, at most 16 tokens a call."""
    eng = Engine(model, num_slots=SLOTS, max_len=MAX_LEN, buckets=(8, 16), page_size=PAGE,
                 cache_dtype=jnp.float32, prefill_chunk=8, max_prefill_tokens=16, kv_pages=10)
    poison_pool(eng, seed=3)
    eps = _workload(6)
    stats = RolloutScheduler([eng], max_rollout_len=MAX_LEN, admit_reserve_tokens=0,
                             decode_steps=4, tool_timeout_s=0.3).run(eps)
    assert stats.slices[0].preemptions > 0 and eng.free_pages == eng.num_pages
    assert max(len(e.prompt_ids) for e in eps) > 8, "a prompt longer than one chunk"
    bad = mismatches(model, [e.t for e in eps])
    assert not bad, "\n".join(bad[:20])


def test_tool_turns_keep_a_rollout_within_max_rollout_len(model):
    """With a rollout length cap below the slot size, the episode is told the room left under
    the cap and a tool turn's budget is cut to it: the first turn was capped, later ones too."""
    eng = _engine(model)
    cap = 32
    ep = ToolEpisode([1, 2, 3, 4, 5], SamplingParams(temperature=1.0, seed=3), [10, 30, 30],
                     [[7, 8, 9], [10]])
    RolloutScheduler([eng], max_rollout_len=cap).run([ep])
    assert len(ep.t.convo) <= cap, f"a rollout of {len(ep.t.convo)} tokens, cap {cap}"
    assert ep.reasons[-1] == DoneReason.BUDGET
    bad = mismatches(model, [ep.t])
    assert not bad, "\n".join(bad)


def test_the_fused_sampler_in_the_engine_keeps_the_vocab_limit_and_the_full_forwards_logprobs(model):
    """The engine's fused sampler (one pass over the logits) on a preempted sampled workload: no
    id at or past ``vocab_limit`` is drawn, and every log-prob is the full forward's over the
    whole vocabulary."""
    limit = 300
    eng = _engine(model, kv_pages=10, sampler="fused", vocab_limit=limit)
    eps = _workload(5)
    stats = RolloutScheduler([eng], max_rollout_len=MAX_LEN, admit_reserve_tokens=0,
                             decode_steps=4, tool_timeout_s=0.3).run(eps)
    assert stats.slices[0].preemptions > 0
    tokens = [tok for e in eps for _, tok, _ in e.t.sampled]
    assert max(tokens) < limit and len(tokens) > 50
    bad = mismatches(model, [e.t for e in eps])
    assert not bad, "\n".join(bad[:20])


# ---- bad input ---------------------------------------------------------------------------------

def test_token_ids_outside_the_vocabulary_are_refused_before_the_pool(model):
    """An id outside [0, vocab) would embed as NaN (or wrap, if negative) and write NaN K/V into
    pages that a later, valid request reuses: it must be refused before any page is taken, in a
    prompt, a forced token and an extend; the pool then still serves requests exactly."""
    vocab = model.config.vocab_size
    eng = _engine(model)
    state = eng.init_decode_state()
    sp = SamplingParams(temperature=0.0, max_new_tokens=1)
    bad_prompts = [[1] * 9 + [vocab + 5] * 6, [1, -3, 2]]
    for prompt in bad_prompts:
        with pytest.raises(ValueError, match="vocabulary"):
            eng.start(eng.params, state, [StartRequest(0, prompt, sp, prompt_len=len(prompt))])
        assert eng.free_pages == eng.num_pages and eng.free_slots() == list(range(SLOTS))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.start(eng.params, state, [StartRequest(0, [1, 2], sp, prompt_len=2, forced=vocab)])
    assert eng.free_pages == eng.num_pages
    state, _ = eng.start(eng.params, state, [StartRequest(0, [1, 2, 3], sp, prompt_len=3)])
    used = eng.free_pages
    with pytest.raises(ValueError, match="vocabulary"):
        eng.extend(eng.params, state, 0, [4, vocab], max_new_tokens=2)
    assert eng.free_pages == used and eng.slot_length(0) == 3
    eng.free_resource(0)
    # the pool holds nothing a bad id wrote: a request on the reused pages is exact
    prompt = [5, 6, 7]
    t = Transcript(list(prompt), True)
    state, [out] = eng.start(eng.params, state, [StartRequest(
        1, prompt, SamplingParams(temperature=0.0, max_new_tokens=6), prompt_len=3)])
    t.add_sampled(out.token, out.logprob)
    state = _decode_until_idle(eng, state, {1: t})
    bad = mismatches(model, [t])
    assert not bad, "\n".join(bad)


def test_a_start_refused_takes_no_page_and_no_slot(model):
    """A start that names an occupied slot, one slot twice, a slot out of range or too many stop
    ids is refused before it takes anything (it took pages and bound slots, then raised)."""
    eng = _engine(model)
    state = eng.init_decode_state()
    sp = SamplingParams(temperature=0.0, max_new_tokens=3)
    state, _ = eng.start(eng.params, state, [StartRequest(0, [1, 2, 3], sp, prompt_len=3)])
    free = eng.free_pages
    for reqs in ([StartRequest(0, [4, 5, 6], sp, prompt_len=3)],
                 [StartRequest(1, [4, 5, 6], sp, prompt_len=3), StartRequest(1, [7, 8], sp, prompt_len=2)],
                 [StartRequest(SLOTS, [4, 5, 6], sp, prompt_len=3)],
                 [StartRequest(2, [4, 5], SamplingParams(stop_ids=range(20)), prompt_len=2)]):
        with pytest.raises(ValueError):
            eng.start(eng.params, state, reqs)
        assert eng.free_pages == free and eng.live_slots() == [0]


# ---- the fused sampler -------------------------------------------------------------------------

def test_fused_and_exact_samplers_report_the_tempered_logprob_and_respect_the_vocab_limit():
    """Both samplers, over several vocabulary chunks and a vocab limit inside a chunk: every
    token below the limit (high temperatures reach the tail), greedy rows the argmax below it,
    and every log-prob the float64 log_softmax(logits / T) of the full vocabulary (T = 1 for
    greedy rows) at the chosen token."""
    rng = np.random.default_rng(3)
    rows, vocab, limit, chunk = 6, 512, 300, 128
    logits = rng.normal(0, 3, size=(rows, vocab)).astype(np.float32)
    logits[:, limit:] += 8.0  # the padding ids are the likeliest: a leak would show
    temperature = np.array([0.0, 0.7, 1.0, 2.0, 5.0, 0.0], np.float32)
    scale = np.where(temperature > 0, temperature, 1.0)[:, None].astype(np.float64)
    z = logits.astype(np.float64) / scale
    ref = z - z.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    greedy = np.argmax(logits[:, :limit], axis=1)
    fused = jax.jit(lambda *a: sample_tokens_fused(*a, vocab_limit=limit, chunk=chunk))
    exact = jax.jit(lambda *a: sample_tokens(*a, vocab_limit=limit))
    seeds = jnp.arange(rows, dtype=jnp.int32) + 11
    for name, fn in (("fused", fused), ("exact", exact)):
        seen = set()
        for counter in range(40):
            tok, lp = jax.device_get(fn(jnp.asarray(logits), seeds, jnp.full(rows, counter, jnp.int32),
                                        jnp.asarray(temperature), jnp.zeros(rows, jnp.int32),
                                        jnp.ones(rows, jnp.float32), jnp.full(rows, -1, jnp.int32)))
            assert tok.max() < limit, f"{name} sampled a padding id"
            assert (tok[temperature == 0] == greedy[temperature == 0]).all(), name
            np.testing.assert_allclose(lp, ref[np.arange(rows), tok], atol=1e-5, err_msg=name)
            seen.add(int(tok[4]))
        assert len(seen) > 20, f"{name}: the T=5 row should reach many ids"


@pytest.mark.parametrize("temperature", [1e-2, 1e-3, 1e-4])
def test_log_probs_at_temperatures_near_zero_stay_at_most_zero(temperature):
    """Logits of a model's size divided by a small T are huge and the chosen token's log-prob
    near 0: both samplers keep it <= 0 (the train batch refuses a positive one) and within
    float32 rounding of the float64 log_softmax(logits / T)."""
    rng = np.random.default_rng(5)
    rows, vocab = 4, 512
    logits = rng.normal(0, 4, size=(rows, vocab)).astype(np.float32)
    logits[:, 7] = logits.max(-1) + rng.uniform(0, 2e-3, size=rows).astype(np.float32)  # near-ties
    z = logits.astype(np.float64) / np.float64(np.float32(temperature))
    ref = z - z.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    t = jnp.full(rows, temperature, jnp.float32)
    for name, fn in (("fused", sample_tokens_fused), ("exact", sample_tokens)):
        for counter in range(8):
            tok, lp = jax.device_get(jax.jit(fn)(jnp.asarray(logits), jnp.arange(rows, dtype=jnp.int32),
                                                 jnp.full(rows, counter, jnp.int32), t, jnp.zeros(rows, jnp.int32),
                                                 jnp.ones(rows, jnp.float32), jnp.full(rows, -1, jnp.int32)))
            assert (lp <= 0).all(), f"{name}: positive log-prob {lp.max():.3g} at T={temperature}"
            np.testing.assert_allclose(lp, ref[np.arange(rows), tok], atol=2e-7 * np.abs(z).max(),
                                       err_msg=name)


def test_extend_many_and_sampling_params_refuse_what_the_device_cannot_hold(model):
    """A slot given twice to one batched extend (both feeds would write its cache positions)
    and a seed past int32 (the engine's RNG key) are refused before anything is taken."""
    eng = _engine(model)
    state = eng.init_decode_state()
    sp = SamplingParams(temperature=0.0, max_new_tokens=1)
    state, _ = eng.start(eng.params, state, [StartRequest(0, [1, 2, 3], sp, prompt_len=3)])
    free = eng.free_pages
    with pytest.raises(ValueError, match="more than once"):
        eng.extend_many(eng.params, state, [(0, [4, 5], 2, -1), (0, [6], 2, -1)])
    assert eng.free_pages == free and eng.slot_length(0) == 3
    for seed in (2**31, -2**31 - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    SamplingParams(seed=2**31 - 1)

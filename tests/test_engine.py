"""Engine against an outside reference: repeated full (uncached) forward passes of the model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.serving import DoneReason, Engine, SamplingParams, generate

MAX_LEN = 64
BUCKETS = (16, 64)
SLOTS = 2


def _chaotic(model: Qwen3, seed: int, scale: float = 0.35) -> Qwen3:
    """Random weights with a large scale, so greedy continuations vary (a freshly initialised
    tiny model tends to repeat one token, which would make the comparisons weak)."""
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    leaves = [np.asarray(jax.random.normal(k, x.shape, x.dtype)) * scale
              for k, x in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32)
    return _chaotic(Qwen3(cfg, rngs=nnx.Rngs(0)), seed=1)


def _engine(model, slots=SLOTS):
    return Engine(model, num_slots=slots, max_len=MAX_LEN, buckets=BUCKETS,
                  cache_dtype=jnp.float32)


_padded_forward = jax.jit(lambda state, tokens, graphdef: nnx.merge(graphdef, state)(tokens),
                          static_argnums=(2,))


def _full_logprobs(model, ids):
    """log_softmax of the uncached training forward over the whole sequence (float64 numpy).

    The sequence is right-padded to MAX_LEN so one compile serves every length: attention is
    causal, so padding after the sequence cannot change its logits."""
    graphdef, state = nnx.split(model)
    padded = np.zeros((1, MAX_LEN), np.int32)
    padded[0, : len(ids)] = ids
    logits = np.asarray(_padded_forward(state, jnp.asarray(padded), graphdef)[0, : len(ids)],
                        np.float64)
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
    outs = generate(model, prompts, max_new, temperature=0.0, stop_ids=[stop],
                    engine=_engine(model))
    for p, o, r in zip(prompts, outs, refs):
        assert o.token_ids == r
        assert o.finish == ("stop" if r[-1] == stop else "length")
        lp = _full_logprobs(model, p + r[:-1])[len(p) - 1:]
        np.testing.assert_allclose(o.logprobs, lp[np.arange(len(r)), r], atol=1e-4)


def test_sampled_logprobs_equal_training_forward(model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (4, 12, 7)]
    outs = generate(model, prompts, 12, temperature=0.9, top_p=0.95, top_k=50, seed=5,
                    engine=_engine(model))
    for p, o in zip(prompts, outs):
        ids = p + o.token_ids
        lp = _full_logprobs(model, ids[:-1])[len(p) - 1:]
        np.testing.assert_allclose(o.logprobs, lp[np.arange(len(o.token_ids)), o.token_ids],
                                   atol=1e-4)
    # Seeded per request: the same draws whatever the slot count (here 1 slot, 3 waves).
    one_slot = generate(model, prompts, 12, temperature=0.9, top_p=0.95, top_k=50, seed=5,
                        engine=_engine(model, slots=1))
    assert [o.token_ids for o in one_slot] == [o.token_ids for o in outs]


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


def test_stops_context_and_bad_input(model):
    eng = _engine(model)
    state = eng.init_decode_state()
    with pytest.raises(ValueError):
        eng.prefill(eng.params, list(range(MAX_LEN + 1)))
    with pytest.raises(ValueError):
        eng.extend(eng.params, state, 0, [1, 2])  # no request in the slot
    with pytest.raises(ValueError):
        eng.insert(eng.prefill(eng.params, [1]), state, SLOTS)
    with pytest.raises(ValueError):
        eng.insert(eng.prefill(eng.params, [1], sampling=SamplingParams(stop_ids=range(20))),
                   state, 0)
    # Context: a prompt of MAX_LEN - 3 tokens can feed 3 more tokens, so it samples 4.
    pre = eng.prefill(eng.params, [1] * (MAX_LEN - 3),
                      sampling=SamplingParams(temperature=0, max_new_tokens=50))
    state = eng.insert(pre, state, 0)
    state, toks, _ = _decode_slot(eng, state, 0, 10)
    assert len(toks) + 1 == 4 and eng.slot_length(0) == MAX_LEN
    assert eng.free_kv_tokens() == eng.kv_capacity_tokens - MAX_LEN
    with pytest.raises(ValueError):
        eng.extend(eng.params, state, 0, [1])
    eng.free_resource(0)
    assert eng.free_kv_tokens() == eng.kv_capacity_tokens and eng.free_slots() == [0, 1]


def test_update_params_serves_new_weights_without_copy(model):
    other = _chaotic(model, seed=7)
    eng = _engine(model)
    _, new_state = nnx.split(other)
    eng.update_params(new_state)
    leaf_served = jax.tree.leaves(eng.params)[0]
    assert leaf_served is jax.tree.leaves(new_state)[0]
    out = generate(None, [[3, 4, 5]], 6, engine=eng)[0]
    assert out.token_ids == _greedy_reference(other, [3, 4, 5], 6)
    with pytest.raises(ValueError):
        eng.update_params({"not": jnp.zeros(3)})

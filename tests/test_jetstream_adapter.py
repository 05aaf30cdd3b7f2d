"""``serving.jetstream_engine.JetStreamEngine`` driven as JetStream's threads drive it (prefill,
insert, generate), in-process: nothing it is given raises out of it (JetStream SIGKILLs the
server on any exception in its threads), a request that cannot run or fails while decoding is
marked failed and ends while the others go on, a pool too small for the slots is refused, seeds
never leave the int32 range, and prompt + completion stays within ``max_len``.

Needs the optional ``[jetstream]`` extra (skipped without it, as tests/test_jetstream.py)."""
import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jetstream") is None,
                                reason='needs pip install -e ".[jetstream]"')

TOKENS, MAX_LEN, SLOTS, PAGE = 300, 64, 2, 8


@pytest.fixture(scope="module")
def model_and_tok():
    from flax import nnx

    from rstarjax.models import ModelConfig, Qwen3, load_tokenizer

    tok = load_tokenizer(TOKENS)
    cfg = ModelConfig.preset("tiny", vocab_size=tok.vocab_size, bos_token_id=tok.endoftext_id,
                             eos_token_id=tok.eos_id, tie_word_embeddings=False,
                             max_position_embeddings=2 * MAX_LEN, dtype="float32")
    return Qwen3(cfg, rngs=nnx.Rngs(0)), tok


def _adapter(model_and_tok, kv_pages=0, **sampling):
    from rstarjax.serving import JetStreamContractEngine
    from rstarjax.serving.jetstream_engine import JetStreamEngine, pool_pages
    from rstarjax.serving.sampling import SamplingParams

    model, tok = model_and_tok
    engine = JetStreamContractEngine(model, max_len=MAX_LEN, num_slots=SLOTS, page_size=PAGE,
                                     kv_pages=kv_pages or pool_pages(SLOTS, MAX_LEN, PAGE, 32),
                                     vocab_limit=tok.num_tokens, dtype="float32")
    params = dict(temperature=0.0, max_new_tokens=MAX_LEN)  # stops: <|im_end|>, <|endoftext|>
    params.update(sampling)
    return JetStreamEngine(engine, tok, SamplingParams(**params))


def _prefill(adapter, ids):
    padded = np.zeros(32, np.int32)
    padded[: len(ids)] = ids
    return adapter.prefill(params=adapter.engine.params, padded_tokens=padded, true_length=len(ids))


def _step(adapter, state):
    state, result = adapter.generate(adapter.engine.params, state)
    data = np.asarray(result.data)
    return state, data[:, 0], data[:, 1].astype(bool)


def test_a_pool_too_small_for_the_slots_is_refused(model_and_tok):
    from rstarjax.serving.jetstream_engine import PREFIXES_IN_FLIGHT, pool_pages

    need = pool_pages(SLOTS, MAX_LEN, PAGE, 32)
    assert need == SLOTS * 8 + PREFIXES_IN_FLIGHT * 4
    with pytest.raises(ValueError, match=f"needs {need}"):
        _adapter(model_and_tok, kv_pages=10)


def test_stop_ids_are_checked_when_built(model_and_tok):
    with pytest.raises(ValueError, match="at most 8 stop ids"):
        _adapter(model_and_tok, stop_ids=tuple(range(9)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _adapter(model_and_tok, stop_ids=(10**6,))


def test_request_seeds_wrap_in_int32(model_and_tok):
    from rstarjax.serving.jetstream_engine import request_seed

    assert [request_seed(2**31 - 2, i) for i in range(4)] == [2**31 - 2, 2**31 - 1, -2**31, -2**31 + 1]
    assert request_seed(5, 3) == 8 and request_seed(-2**31, 2**32) == -2**31
    adapter = _adapter(model_and_tok, temperature=1.0, seed=2**31 - 2)
    outcomes = [_prefill(adapter, [5, 6, 7]) for _ in range(3)]  # request 2: seed 2**31 wraps
    assert [o.error for o in outcomes] == [None] * 3
    assert [o.prefix.sampling.seed for o in outcomes] == [2**31 - 2, 2**31 - 1, -2**31]


def test_requests_that_cannot_run_are_marked_not_raised(model_and_tok):
    adapter = _adapter(model_and_tok)
    assert _prefill(adapter, []).error == ("INVALID_ARGUMENT", "empty prompt")
    assert _prefill(adapter, [TOKENS + 40]).error[0] == "INVALID_ARGUMENT"
    adapter.engine.pages.alloc(adapter.engine.pages.num_free)  # no page left for a prompt
    assert _prefill(adapter, [5, 6, 7]).error[0] == "RESOURCE_EXHAUSTED"


def test_prompt_plus_completion_is_at_most_max_len(model_and_tok):
    """A 1-token prompt gets MAX_LEN - 1 tokens and ends with finish "context"; the engine
    alone samples one past a full slot (generate()'s contract: max_len counts KV positions)."""
    adapter = _adapter(model_and_tok)
    state = adapter.init_decode_state()
    request = _prefill(adapter, [7])
    state = adapter.insert(request, state, 0)
    got = 0
    for _ in range(MAX_LEN + 4):
        state, tokens, valid = _step(adapter, state)
        got += int(valid[0])
        if got and not valid[0]:
            break
    assert got == MAX_LEN - 1 and request.finish == "context" and request.error is None


def test_running_out_of_pages_fails_the_youngest_request_only(model_and_tok):
    adapter = _adapter(model_and_tok)
    state = adapter.init_decode_state()
    old, young = _prefill(adapter, [5, 6, 7]), _prefill(adapter, [9, 10, 11])
    state = adapter.insert(old, state, 0)
    state, _, valid = _step(adapter, state)  # inserts the first
    state = adapter.insert(young, state, 1)
    state, _, valid = _step(adapter, state)
    assert valid.tolist() == [True, True]
    # something else took every free page: the next page a slot needs is not there
    adapter.engine.pages.alloc(adapter.engine.pages.num_free)
    seen = []
    for _ in range(12):
        state, _, valid = _step(adapter, state)  # never raises
        seen.append(valid.tolist())
        if not valid[1]:
            break
    assert seen[-1] == [True, False], seen
    assert young.error[0] == "RESOURCE_EXHAUSTED" and "ran out of pages" in young.error[1]
    assert old.error is None
    state, _, valid = _step(adapter, state)  # the old one goes on, on the pages freed
    assert valid.tolist() == [True, False]


def test_a_failing_decode_step_fails_its_requests_not_the_server(model_and_tok, monkeypatch):
    adapter = _adapter(model_and_tok)
    state = adapter.init_decode_state()
    request = _prefill(adapter, [5, 6, 7])
    state = adapter.insert(request, state, 0)
    state, _, valid = _step(adapter, state)
    assert valid[0]

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(adapter.engine, "generate", broken)
    state, _, valid = _step(adapter, state)
    assert not valid.any() and request.error == ("INTERNAL", "decode step failed: RuntimeError: device lost")
    assert adapter.engine.live_slots() == []
    monkeypatch.undo()
    again = _prefill(adapter, [5, 6, 7])  # the server serves on
    state = adapter.insert(again, state, 1)
    state, _, valid = _step(adapter, state)
    assert valid[1] and again.error is None


def test_a_failing_decode_step_keeps_the_pages_of_prompts_in_flight(model_and_tok, monkeypatch):
    """A prompt prefilled (in JetStream's queues) while a decode step fails keeps its pages: the
    state was rebuilt by returning every page to the pool, so a later prompt got the same pages
    (two requests on one KV region) and the second release raised in generate, which kills the
    server. The in-flight prompt then decodes as it would have."""
    adapter = _adapter(model_and_tok)
    state = adapter.init_decode_state()
    first = _prefill(adapter, [5, 6, 7])
    state = adapter.insert(first, state, 0)
    state, _, _ = _step(adapter, state)
    in_flight = _prefill(adapter, [9, 10, 11])
    held = set(in_flight.prefix.pages)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(adapter.engine, "generate", broken)
    state, _, _ = _step(adapter, state)
    monkeypatch.undo()
    assert first.error is not None and in_flight.error is None
    later = _prefill(adapter, [12, 13, 14])
    assert not set(later.prefix.pages) & held  # the pool did not hand its pages out again
    state = adapter.insert(in_flight, state, 0)
    state = adapter.insert(later, state, 1)
    for _ in range(2 * MAX_LEN):  # to the end of both, without raising
        state, _, valid = _step(adapter, state)
        if not valid.any():
            break
    assert in_flight.error is None and later.error is None
    assert adapter.engine.live_slots() == [] and adapter.engine.pages.num_used == 0


def test_a_failing_insert_fails_its_request(model_and_tok, monkeypatch):
    adapter = _adapter(model_and_tok)
    state = adapter.init_decode_state()
    request = _prefill(adapter, [5, 6, 7])
    free, held = adapter.engine.pages.num_free, len(request.prefix.pages)

    def broken(*args, **kwargs):
        raise ValueError("too many stop ids")

    monkeypatch.setattr(adapter.engine, "insert", broken)
    state = adapter.insert(request, state, 0)
    state, _, valid = _step(adapter, state)
    assert not valid.any() and request.error[0] == "INTERNAL"
    assert adapter.engine.pages.num_free == free + held  # its pages came back

"""Tensor-parallel serving slices against the one-device engine: greedy decoding through a slice
whose ``tensor`` axis spans 2, 4 or 8 of the simulated CPU devices gives the same tokens (exact)
and log-probs (1e-4) as one device, through shared-prompt prefill, multi-step decode and
``extend`` after a tool call; and the weights and KV pages really are split Megatron-style."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rstarjax.models.config import ModelConfig
from rstarjax.models.paged_attention import default_decode_implementation
from rstarjax.models.qwen3 import Qwen3
from rstarjax.serving import Engine, SamplingParams, StartRequest
from rstarjax.serving.programs import decode_program
from rstarjax.serving.slices import slice_meshes
from model_support import chaotic

MAX_LEN = 64
PAGE = 8
SLOTS = 4
BUDGET = 7  # tokens per turn


def _model(**overrides) -> Qwen3:
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32, **overrides)
    return chaotic(Qwen3(cfg, rngs=nnx.Rngs(0)), seed=3)


@pytest.fixture(scope="module")
def wide():
    """8 query heads, 8 kv heads: everything splits over 8 devices."""
    return _model(num_attention_heads=8, num_key_value_heads=8)


@pytest.fixture(scope="module")
def tiny():
    """4 query heads, 2 kv heads: kv pages split on TP-2, replicated on TP-4."""
    return _model()


def _engine(model, **placement) -> Engine:
    return Engine(model, num_slots=SLOTS, max_len=MAX_LEN, buckets=(16, 64), page_size=PAGE,
                  cache_dtype=jnp.float32, decode_steps=4, **placement)


def _rollouts(engine: Engine):
    """Per slot: the tokens and log-probs of a turn, an ``extend`` with a tool response, and a
    second turn. Slots 0 and 1 share a prompt (one prefill, shared pages)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, 13), None, rng.integers(1, 500, 21), rng.integers(1, 500, 5)]
    prompts[1] = prompts[0]
    tool = [rng.integers(1, 500, n) for n in (9, 3, 17, 6)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=BUDGET)
    params, state = engine.params, engine.init_decode_state()
    tokens = [[] for _ in range(SLOTS)]
    logprobs = [[] for _ in range(SLOTS)]

    def drain(state):
        while any(engine.is_decoding(s) for s in range(SLOTS)):
            state, block = engine.decode(params, state)
            for s in range(SLOTS):
                tokens[s] += block.tokens[block.valid[:, s], s].tolist()
                logprobs[s] += block.logprobs[block.valid[:, s], s].tolist()
        return state

    state, first = engine.start(params, state, [
        StartRequest(slot=s, history=p, sampling=sp, prompt_len=len(p))
        for s, p in enumerate(prompts)])
    for s, out in enumerate(first):
        tokens[s].append(out.token)
        logprobs[s].append(out.logprob)
    state = drain(state)
    for s in range(SLOTS):  # the tool responses come back
        state, out = engine.extend(params, state, s, tool[s], max_new_tokens=BUDGET)
        tokens[s].append(out.token)
        logprobs[s].append(out.logprob)
    drain(state)
    return tokens, np.array(logprobs)


@pytest.fixture(scope="module")
def reference(wide, tiny):
    one = jax.devices()[0]
    return {name: _rollouts(_engine(m, device=one)) for name, m in (("wide", wide),
                                                                     ("tiny", tiny))}


def _check_same(got, want):
    tokens, lps = got
    want_tokens, want_lps = want
    assert tokens == want_tokens
    assert all(len(t) == 2 * BUDGET for t in tokens)
    assert len({tuple(t) for t in tokens[1:]}) == SLOTS - 1  # distinct continuations
    np.testing.assert_allclose(lps, want_lps, atol=1e-4, rtol=0)


def _shard_shape(x) -> tuple[int, ...]:
    return x.addressable_shards[0].data.shape


def test_tp8_slice_decodes_like_one_device(wide, reference):
    [mesh] = slice_meshes(jax.devices(), tensor_parallel=8, num_slices=1)
    engine = _engine(wide, mesh=mesh)
    cfg = wide.config
    q_dim, d, f = cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    layer = engine.params.layers[0]
    # Megatron layout: q/k/v and gate/up split by output columns, o/down by input rows.
    assert _shard_shape(layer["q_proj"]) == (d, q_dim // 8)
    assert _shard_shape(layer["k_proj"]) == (d, q_dim // 8)
    assert _shard_shape(layer["o_proj"]) == (q_dim // 8, d)
    assert _shard_shape(layer["gate_proj"]) == (d, f // 8)
    assert _shard_shape(layer["down_proj"]) == (f // 8, d)
    assert engine._k[0].sharding.spec == P("tensor")  # pages split by kv head
    assert _shard_shape(engine._k[0])[0] == 1
    _check_same(_rollouts(engine), reference["wide"])
    # Still split after prefill, decode, insert and extend (programs keep the layout).
    assert engine._k[0].sharding.spec == P("tensor")
    assert _shard_shape(engine.params.layers[1]["o_proj"]) == (q_dim // 8, d)


def _lower_decode(engine: Engine):
    """The decode program of 4 active rows, lowered."""
    rows = jnp.arange(4, dtype=jnp.int32)
    width, live = engine._decode_reads([], 1, 4)
    return decode_program.lower(
        engine.cfg, engine.params, engine._k, engine._v, engine.init_decode_state(), rows,
        jnp.asarray(engine._table[:, :width]), live, jnp.full((engine.decode_steps, 4), -1),
        jnp.int32(1), jnp.int32(5), steps=engine.decode_steps, attention=engine.decode_attention,
        vocab_limit=None, max_len=engine.max_len, kv_sharding=engine._kv_sharding,
        interpret=engine.interpret)


def _decode_collectives(engine: Engine) -> dict[str, list[str]]:
    """Result shapes of the collectives in the compiled decode program of 4 active rows."""
    hlo = _lower_decode(engine).compile().as_text()
    return {op: [shape.split("{")[0] for shape in re.findall(rf"= (\S+) {op}(?:-start)?\(", hlo)]
            for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute")}


def test_tp8_decode_all_reduces_activations_never_gathers_weights(wide):
    """What makes it tensor parallel: per layer one all-reduce of the hidden state after the
    row-parallel o_proj and one after down_proj; no weight is gathered (only the small
    vocabulary-split logits are, for sampling)."""
    [mesh] = slice_meshes(jax.devices(), tensor_parallel=8)
    engine = _engine(wide, mesh=mesh)
    cfg = wide.config
    ops = _decode_collectives(engine)
    hidden = f"f32[4,1,{cfg.hidden_size}]"
    assert ops["all-reduce"].count(hidden) == 2 * cfg.num_hidden_layers
    weight_shapes = {x.shape for layer in engine.params.layers for x in layer.values()}
    gathered = {tuple(int(d) for d in re.findall(r"\d+", s)) for s in ops["all-gather"]}
    assert not gathered & weight_shapes
    assert all(s.startswith(("f32[4,", "s32[4,", "pred[4,")) for s in ops["all-gather"])
    assert not ops["all-to-all"] and not ops["collective-permute"]


@pytest.mark.parametrize("tensor, kv_split", [(2, True), (4, False)])
def test_tp_slice_kv_heads_divide_or_not(tiny, reference, tensor, kv_split):
    """2 kv heads: split on TP-2; on TP-4 the pages and k/v projections are replicated while
    the 4 query heads still split."""
    meshes = slice_meshes(jax.devices()[:4], tensor_parallel=tensor, num_slices=0)
    assert len(meshes) == 4 // tensor
    engine = _engine(tiny, mesh=meshes[-1])
    cfg = tiny.config
    kv_dim, q_dim = cfg.num_key_value_heads * cfg.head_dim, cfg.num_attention_heads * cfg.head_dim
    layer = engine.params.layers[0]
    assert _shard_shape(layer["q_proj"])[1] == q_dim // tensor
    assert _shard_shape(layer["k_proj"])[1] == (kv_dim // tensor if kv_split else kv_dim)
    assert engine._k[0].sharding.spec == (P("tensor") if kv_split else P())
    _check_same(_rollouts(engine), reference["tiny"])


def test_slice_meshes_layout_and_errors():
    devices = jax.devices()
    meshes = slice_meshes(devices, tensor_parallel=2, num_slices=3)
    assert [list(m.devices.flat) for m in meshes] == [devices[0:2], devices[2:4], devices[4:6]]
    assert all(m.axis_names == ("tensor",) for m in meshes)
    assert len(slice_meshes(devices, tensor_parallel=4, num_slices=0)) == 2
    with pytest.raises(ValueError, match="slices_per_host"):
        slice_meshes(devices, tensor_parallel=4, num_slices=3)
    with pytest.raises(ValueError, match="tensor_parallel"):
        slice_meshes(devices, tensor_parallel=9, num_slices=0)
    with pytest.raises(ValueError, match="device or a mesh"):
        Engine(_model(), max_len=MAX_LEN, device=devices[0], mesh=meshes[0])
    tp4 = slice_meshes(devices, tensor_parallel=4, num_slices=1)[0]
    with pytest.raises(ValueError, match="2 kv heads do not divide over 4 devices"):
        Engine(_model(), max_len=MAX_LEN, mesh=tp4, decode_attention="pallas_gpu")
    # Replicated pages: the portable path by default; split pages: the platform's default.
    assert Engine(_model(), max_len=MAX_LEN, mesh=tp4).decode_attention == "ragged"
    assert Engine(_model(), max_len=MAX_LEN, mesh=meshes[0]).decode_attention == \
        default_decode_implementation("cpu")


# ---- the Pallas decode kernels on a slice: once per device, on its kv heads -----------------

@pytest.mark.slow  # the Pallas interpreter inside every decode program
@pytest.mark.parametrize("name, tensor", [("tiny", 2), ("wide", 8)])
def test_tp_slice_decodes_through_the_gpu_kernel_like_one_device(request, reference, name,
                                                                 tensor):
    """The Triton paged-attention kernel (interpreted on CPU) under ``shard_map`` over kv
    heads gives the one-device engine's tokens and log-probs, through shared prefill, decode
    and ``extend``; the decode program adds no collective for attention (the pages never
    leave their device) and gathers no KV page."""
    [mesh] = slice_meshes(jax.devices()[:tensor], tensor_parallel=tensor, num_slices=1)
    model = request.getfixturevalue(name)
    engine = _engine(model, mesh=mesh, decode_attention="pallas_gpu", interpret=True)
    assert engine._k[0].sharding.spec == P("tensor")
    _check_same(_rollouts(engine), reference[name])
    # One per-device kernel region (shard_map) per layer.
    lowered = _lower_decode(engine).as_text()
    assert lowered.count("sdy.manual_computation") == model.config.num_hidden_layers
    ops = _decode_collectives(engine)
    cfg = model.config
    assert ops["all-reduce"].count(f"f32[4,1,{cfg.hidden_size}]") == 2 * cfg.num_hidden_layers
    # Only per-row values are gathered (the vocabulary-split logits, for sampling).
    assert all(s.startswith(("f32[4,", "s32[4,", "pred[4,")) for s in ops["all-gather"])
    assert not ops["all-to-all"] and not ops["collective-permute"]

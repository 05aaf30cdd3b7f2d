"""Qwen3 model: config presets vs published sizes, scan == unrolled, remat, packed segments,
and the dense cached decode kept as a test reference (tests/dense_decode.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dense_decode import KVCache, dense_decode
from rstarjax.models import ModelConfig, Qwen3

TINY32 = ModelConfig.preset("tiny", dtype=jnp.float32)


def _jit_forward(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens, positions, segment_ids):
        return nnx.merge(graphdef, state)(tokens, positions, segment_ids)
    return lambda tokens, positions=None, segment_ids=None: fwd(state, tokens, positions,
                                                                segment_ids)


def _jit_decode(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def dec(state, tokens, cache, num_new):
        return dense_decode(nnx.merge(graphdef, state), tokens, cache, num_new)
    return lambda tokens, cache, num_new: dec(state, tokens, cache, num_new)


@pytest.fixture(scope="module")
def tiny():
    return Qwen3(TINY32, rngs=nnx.Rngs(0))


# ---- config ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,total_b,non_embed_b", [
    # Parameter counts from the Qwen3 model cards (billions, rounded as published).
    ("qwen3-0.6b", 0.6, 0.44), ("qwen3-1.7b", 1.7, 1.4), ("qwen3-4b", 4.0, 3.6),
    ("qwen3-8b", 8.2, 6.95), ("qwen3-14b", 14.8, 13.2), ("qwen3-32b", 32.8, 31.2),
    ("qwen2.5-32b", 32.5, 31.0),
])
def test_presets_match_published_parameter_counts(name, total_b, non_embed_b):
    cfg = ModelConfig.preset(name)
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert cfg.num_params / 1e9 == pytest.approx(total_b, rel=0.06)
    assert (cfg.num_params - embed) / 1e9 == pytest.approx(non_embed_b, rel=0.06)


@pytest.mark.parametrize("name", ["qwen3-14b", "qwen2.5-32b", "tiny"])
def test_hf_dict_is_understood_by_transformers(name):
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig.preset(name)
    hf = cfg.to_hf_dict()
    cls = transformers.Qwen2Config if cfg.architecture == "Qwen2ForCausalLM" \
        else transformers.Qwen3Config
    tcfg = cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    back = ModelConfig.from_hf_dict({**tcfg.to_dict(), "architectures": hf["architectures"]})
    assert back == cfg.replace(dtype=back.dtype, param_dtype=back.param_dtype)
    assert tcfg.head_dim == cfg.head_dim and tcfg.num_key_value_heads == cfg.num_key_value_heads


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 8})
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8})
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_hf_dict({**ModelConfig.preset("tiny").to_hf_dict(),
                                  "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.preset("tiny", num_key_value_heads=3)
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("qwen3-7b")
    with pytest.raises(ValueError, match="attention_bias"):  # o_proj's bias has no place here
        ModelConfig.from_hf_dict({**ModelConfig.preset("tiny").to_hf_dict(), "attention_bias": True})


def test_a_qwen3_with_attention_bias_has_an_o_proj_bias_in_transformers():
    """Why ``attention_bias`` is refused for Qwen3 (not read as q/k/v biases as Qwen2's): the
    transformers class puts a bias on o_proj too."""
    transformers = pytest.importorskip("transformers")
    hf = ModelConfig.preset("tiny").to_hf_dict()
    tcfg = transformers.Qwen3Config(**{**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")},
                                       "attention_bias": True})
    names = dict(transformers.Qwen3ForCausalLM(tcfg).named_parameters())
    assert "model.layers.0.self_attn.o_proj.bias" in names


# ---- forward --------------------------------------------------------------------------------
@pytest.mark.slow
def test_scan_equals_unrolled_loop_values_and_grads(tiny):
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 12)), jnp.int32)
    unrolled = Qwen3(TINY32.replace(scan_layers=False), rngs=nnx.Rngs(0))
    remats = [Qwen3(TINY32.replace(remat_policy=p), rngs=nnx.Rngs(0))
              for p in ("dots", "attention", "dots_attention")]

    def loss(model):
        return jnp.mean(jax.nn.log_softmax(model(tokens))[..., 7])

    grads = [nnx.jit(nnx.grad(loss))(m) for m in (tiny, unrolled, *remats)]
    np.testing.assert_allclose(_jit_forward(tiny)(tokens), _jit_forward(unrolled)(tokens),
                               atol=1e-5)
    for g in grads[1:]:
        for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(g)):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(grads[0]))


def test_packed_segments_equal_separate_sequences(tiny):
    rng = np.random.RandomState(1)
    a, b = rng.randint(0, 512, 7), rng.randint(0, 512, 5)
    fwd = _jit_forward(tiny)
    packed = np.zeros((1, 16), np.int32)
    packed[0, :7], packed[0, 7:12] = a, b
    positions = np.zeros((1, 16), np.int32)
    positions[0, :7], positions[0, 7:12] = np.arange(7), np.arange(5)
    segments = np.zeros((1, 16), np.int32)
    segments[0, :7], segments[0, 7:12] = 1, 2
    out = fwd(jnp.asarray(packed), jnp.asarray(positions), jnp.asarray(segments))
    assert np.isfinite(np.asarray(out)).all()  # padding rows too: no NaN
    sep_a = fwd(jnp.asarray(a[None], jnp.int32))
    sep_b = fwd(jnp.asarray(b[None], jnp.int32))
    np.testing.assert_allclose(out[0, :7], sep_a[0], atol=1e-5)
    np.testing.assert_allclose(out[0, 7:12], sep_b[0], atol=1e-5)
    # Without segment ids, b would see a: the logits must differ (the mask matters).
    unsegmented = fwd(jnp.asarray(packed), jnp.asarray(positions), None)
    assert float(jnp.abs(unsegmented[0, 7:12] - sep_b[0]).max()) > 1e-3


def test_bf16_compute_gives_f32_logits_close_to_f32():
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, 512, (2, 10)), jnp.int32)
    m32 = Qwen3(TINY32, rngs=nnx.Rngs(3))
    m16 = Qwen3(TINY32.replace(dtype=jnp.bfloat16), rngs=nnx.Rngs(3))
    out16, out32 = _jit_forward(m16)(tokens), _jit_forward(m32)(tokens)
    assert out16.dtype == jnp.float32
    assert float(jnp.abs(out16 - out32).max()) < 0.05 * float(jnp.abs(out32).max()) + 1e-2


def test_bad_shapes_raise(tiny):
    with pytest.raises(ValueError, match="tokens"):
        tiny(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        tiny(jnp.zeros((1, 4), jnp.int32), segment_ids=jnp.ones((1, 3), jnp.int32))


# ---- decode ---------------------------------------------------------------------------------
def test_decode_chunked_prefill_then_steps_matches_forward(tiny):
    """Rows of different lengths: prefill in chunks of 4 (with padding), then token by token;
    every valid position's logits equal the full forward of that row alone."""
    rng = np.random.RandomState(4)
    prompt_lens, steps, chunk, max_len = [5, 9, 2], 4, 4, 24
    seqs = [rng.randint(0, 512, n + steps) for n in prompt_lens]
    decode = _jit_decode(tiny)
    cache = KVCache.init(TINY32, batch=3, max_len=max_len, dtype=jnp.float32)
    got = [[] for _ in seqs]
    done = [0, 0, 0]
    while any(done[r] < prompt_lens[r] for r in range(3)):
        tokens = rng.randint(0, 512, (3, chunk))  # padding is random junk on purpose
        num_new = np.zeros(3, np.int32)
        for r in range(3):
            n = min(chunk, prompt_lens[r] - done[r])
            tokens[r, :n] = seqs[r][done[r]:done[r] + n]
            num_new[r] = n
        logits, cache = decode(jnp.asarray(tokens, jnp.int32), cache, jnp.asarray(num_new))
        for r in range(3):
            got[r] += list(np.asarray(logits[r, :num_new[r]]))
            done[r] += num_new[r]
    np.testing.assert_array_equal(cache.lengths, prompt_lens)
    for s in range(steps):
        tokens = np.array([[seqs[r][prompt_lens[r] + s]] for r in range(3)], np.int32)
        logits, cache = decode(jnp.asarray(tokens), cache, jnp.ones(3, jnp.int32))
        for r in range(3):
            got[r].append(np.asarray(logits[r, 0]))
    np.testing.assert_array_equal(cache.lengths, np.array(prompt_lens) + steps)
    fwd = _jit_forward(tiny)
    for r in range(3):
        ref = fwd(jnp.asarray(seqs[r][None], jnp.int32))[0]
        np.testing.assert_allclose(np.stack(got[r]), ref, atol=2e-5)


def test_decode_drops_out_of_range_writes_never_clamps(tiny):
    """A row 2 short of max_len given 4 tokens: the 2 that fit land at the end, the rest are
    dropped; a clamping update (dynamic_update_slice) would shift them onto entries 4..7."""
    max_len = 8
    cache = KVCache.init(TINY32, batch=2, max_len=max_len, dtype=jnp.float32)
    rng = np.random.RandomState(5)
    prompt = jnp.asarray(rng.randint(0, 512, (2, 6)), jnp.int32)
    decode = _jit_decode(tiny)
    _, cache = decode(prompt, cache, jnp.array([6, 6], jnp.int32))
    before_k = np.asarray(cache.k)
    tail = jnp.asarray(rng.randint(0, 512, (2, 4)), jnp.int32)
    _, after = decode(tail, cache, jnp.array([4, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(after.k)[:, :, :6], before_k[:, :, :6])
    np.testing.assert_array_equal(after.lengths, [10, 6])
    # The two entries that fit equal what a fresh decode of the same 8 tokens writes there.
    fresh = KVCache.init(TINY32, batch=2, max_len=max_len, dtype=jnp.float32)
    _, fresh = decode(jnp.concatenate([prompt, tail[:, :2]], 1), fresh,
                           jnp.array([8, 8], jnp.int32))
    np.testing.assert_allclose(np.asarray(after.k)[:, 0, 6:], np.asarray(fresh.k)[:, 0, 6:],
                               atol=1e-5)


def test_kv_cache_init_validates():
    with pytest.raises(ValueError):
        KVCache.init(TINY32, batch=0, max_len=8)
    c = KVCache.init(TINY32, batch=3, max_len=8)
    assert c.k.shape == (2, 3, 8, 2, 16) and c.k.dtype == jnp.bfloat16
    assert c.lengths.dtype == jnp.int32
    assert len(jax.tree.leaves(c)) == 3  # a pytree: passes through jit


def _count_primitive(jaxpr, name: str) -> int:
    """Equations of primitive ``name`` in ``jaxpr`` and every jaxpr nested in its equations."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    count += _count_primitive(sub, name)
    return count


@pytest.mark.parametrize("policy, forwards", [("dots", 2), ("full", 2), ("dots_attention", 1),
                                              ("attention", 1)])
def test_the_attention_policies_run_cudnns_forward_once(monkeypatch, policy, forwards):
    """Under ``dots`` (and ``full``) remat the backward pass runs cuDNN's attention forward again
    (a cuDNN call is not a dot; an H200 profile showed 56 forward calls for 28 layers); the
    ``*attention`` policies keep its results. Traced with jax's cuDNN binding, its version checks
    stubbed: nothing is compiled, so no GPU is needed to count the calls."""
    import jax._src.cudnn.fused_attention_stablehlo as cudnn

    from rstarjax.models.attention import cudnn_attention
    from rstarjax.models.qwen3 import REMAT

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda *a, **k: True)

    def layer(x, w):
        q = (x @ w).reshape(1, 128, 2, 64)
        out = cudnn_attention(q, q, q, jnp.ones((1, 128), jnp.int32), max_segments=4)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    x = jnp.ones((128, 128), jnp.bfloat16)
    grad = jax.grad(jax.checkpoint(layer, policy=REMAT[policy], prevent_cse=False))
    jaxpr = jax.make_jaxpr(grad)(x, x).jaxpr
    assert _count_primitive(jaxpr, "dot_product_attention_fwd_wrapper") == forwards
    assert _count_primitive(jaxpr, "dot_product_attention_bwd_wrapper") == 1

"""The decode step's fused GEMMs (models/decode_gemm.py) in Pallas' interpreter, against the
model's own ops: ``rms_norm`` then ``@``, ``jax.nn.silu(gate) * up``, ``x + a @ w``, and the
whole fused decode layer against ``decoder_layer``. In bfloat16 the kernels round where the
model rounds, so they agree to the bit but for the accumulation order of a dot (at most one
bf16 step, in few elements); in float32 to float32 noise."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.models.config import ModelConfig
from rstarjax.models.decode_gemm import (GemmBlocking, matmul_residual, norm_matmul,
                                         pipeline_shared_bytes)
from rstarjax.models.lora import adapter_names
from rstarjax.models.qwen3 import (Qwen3, decode_layer_fused, decoder_layer, rms_norm,
                                   serving_config, serving_weights)

# small tiles so every kernel runs several row blocks, column blocks and k iterations
SMALL = GemmBlocking(block_rows=16, block_cols=32, block_k=32, min_cols=16)


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        return
    # bf16: equal but for a dot's accumulation order (one bf16 step at the value's magnitude)
    step = np.abs(want) * 2.0 ** -7 + 1e-6
    assert np.all(np.abs(got - want) <= step), np.max(np.abs(got - want) / step)
    assert np.mean(got == want) > 0.97, np.mean(got == want)


def _inputs(dtype, rows=20, depth=64, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    x = jax.random.normal(keys[0], (rows, depth), dtype)
    w_norm = 1.0 + 0.2 * jax.random.normal(keys[1], (depth,), jnp.float32)
    weight = lambda i, n, k=depth: (0.1 * jax.random.normal(keys[i], (k, n))).astype(dtype)  # noqa: E731
    return x, w_norm, weight


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_matmul_of_several_weights_is_the_norm_then_each_product(dtype):
    """Three weights of different widths in one launch (as q, k, v): each output is its own
    weight's product, over rows that are not a multiple of the tile (padded) and of a block."""
    x, w_norm, weight = _inputs(dtype)
    ws = (weight(2, 64), weight(3, 32), weight(4, 96))
    got = norm_matmul(x, w_norm, ws, eps=1e-6, blocking=SMALL, interpret=True)
    h = rms_norm(x, w_norm, 1e-6)
    assert [g.shape for g in got] == [(20, 64), (20, 32), (20, 96)]
    for g, w in zip(got, ws):
        assert g.dtype == dtype
        _close(g, h @ w, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_swiglu_is_the_models_mlp_activation(dtype):
    x, w_norm, weight = _inputs(dtype, seed=1)
    gate, up = weight(2, 128), weight(3, 128)
    x = 3.0 * x  # gates well into silu's curved part
    (got,) = norm_matmul(x, w_norm, (gate, up), eps=1e-6, swiglu=True, blocking=SMALL,
                         interpret=True)
    h = rms_norm(x, w_norm, 1e-6)
    _close(got, jax.nn.silu(h @ gate) * (h @ up), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_residual_adds_the_rounded_product(dtype):
    x, _, weight = _inputs(dtype, seed=2)
    a = jax.random.normal(jax.random.PRNGKey(9), (20, 128), dtype)
    w = weight(4, 64, 128)
    got = matmul_residual(a, w, x, blocking=SMALL, interpret=True)
    _close(got, x + a @ w, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_residual_kernels_sums_of_squares_feed_the_next_norm(dtype):
    """``matmul_residual(with_sums=True)`` writes its rows' squares summed per column block; the
    next ``norm_matmul(sums=)`` norms from them alone: the pair equals the model's ``x + a @ w``
    then ``rms_norm`` and the product, and the sums equal the squares of the model's rows."""
    x, w_norm, weight = _inputs(dtype, seed=3)
    a = jax.random.normal(jax.random.PRNGKey(8), (20, 128), dtype)
    w, ws = weight(4, 64, 128), (weight(5, 64), weight(6, 32))
    got, sums = matmul_residual(a, w, x, with_sums=True, blocking=SMALL, interpret=True)
    want = x + a @ w
    assert sums.shape == (4, 32) and sums.dtype == jnp.float32  # 16-wide column blocks, 32 rows
    np.testing.assert_allclose(np.asarray(sums).sum(0)[:20],
                               np.sum(np.asarray(want, np.float32) ** 2, axis=1), rtol=2e-2 if dtype
                               == jnp.bfloat16 else 1e-5)
    np.testing.assert_array_equal(np.asarray(sums)[:, 20:], 0.0)  # the tile's padded rows
    outs = norm_matmul(got, w_norm, ws, eps=1e-6, sums=sums, blocking=SMALL, interpret=True)
    h = rms_norm(want, w_norm, 1e-6)
    for g, wi in zip(outs, ws):
        _close(g, h @ wi, dtype)
    # the norm reads the sums, not its rows: four times the sums is half the rows' RMS scale
    outs = norm_matmul(got, w_norm, ws, eps=1e-6, sums=4 * sums, blocking=SMALL, interpret=True)
    h = rms_norm(want, w_norm, 0.25e-6)  # rsqrt(4 mean + eps) = rsqrt(mean + eps / 4) / 2
    for g, wi in zip(outs, ws):
        _close(g, (0.5 * (h @ wi).astype(jnp.float32)).astype(dtype), dtype)
    with pytest.raises(ValueError, match="column blocks"):
        norm_matmul(got, w_norm, ws, eps=1e-6, sums=sums[:, :16], blocking=SMALL, interpret=True)


def test_pipeline_stages_are_cut_to_what_shared_memory_holds_and_specs_round_trip():
    """A blocking whose pipelined tiles would overflow an SM's shared memory fails only when the
    device compiles it (Triton: out of resource), so the stages are cut before: SwiGLU's two
    128 x 128 weight tiles and a 64 x 128 x tile are 80 KB a stage, 2 of them fit 192 KB."""
    b = GemmBlocking()
    h100 = pipeline_shared_bytes("NVIDIA H100 80GB HBM3")
    assert h100 == 192 * 1024 and pipeline_shared_bytes("NVIDIA H200") == h100
    assert b.stages_for(64, 128, 128, weights=2, itemsize=2, shared_bytes=h100) == 2
    assert b.stages_for(64, 32, 128, weights=1, itemsize=2, shared_bytes=h100) == 4  # 24 KB a stage
    assert b.stages_for(256, 256, 256, weights=2, itemsize=4, shared_bytes=h100) == 1  # never below one
    # an MI300X block has 64 KB: one 48 KB stage of 64 x 128 tiles at most; an A100 fits 2 of them
    assert b.stages_for(64, 128, 128, weights=1, itemsize=2,
                        shared_bytes=pipeline_shared_bytes("AMD Instinct MI300X")) == 1
    assert b.stages_for(64, 128, 128, weights=1, itemsize=2,
                        shared_bytes=pipeline_shared_bytes("NVIDIA A100-SXM4-80GB")) == 2
    assert pipeline_shared_bytes("NVIDIA GeForce RTX 4090") == 64 * 1024
    assert GemmBlocking.from_spec(b.spec()) == b
    assert GemmBlocking.from_spec("64,256,64,128,64,8,3") == GemmBlocking(64, 256, 64, 128, 64, 8, 3)
    with pytest.raises(ValueError, match="7 integers"):
        GemmBlocking.from_spec("64,128,128")


def test_blocking_narrows_columns_until_the_grid_fills_and_refuses_odd_shapes():
    b = GemmBlocking()  # 64 x 128 x 128 tiles, 256 programs wanted, columns down to 32
    assert b.for_shape(64, 2048, (2048, 1024, 1024)) == (64, 32, 128)  # 128 programs at 32
    assert b.for_shape(256, 2048, (6144,)) == (64, 64, 128)  # 4 row blocks x 96
    assert b.for_shape(64, 2048, (65536,)) == (64, 128, 128)  # 512 programs already
    assert b.for_shape(16, 96, (48,)) == (16, 16, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        b.for_shape(64, 2048, (2056,))


@pytest.mark.parametrize("variant", ["qwen3", "qwen2.5"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_decode_layer_equals_decoder_layer(variant, dtype):
    """One decode token a row through ``decode_layer_fused`` and through ``decoder_layer``
    (both handing q/k/v to the same attention, which norms and rotates nothing: the fused layer
    is for the kernel that does), on a served copy's weights; Qwen2.5's q/k/v biases too."""
    extra = dict(qk_norm=False, attention_bias=True) if variant == "qwen2.5" else {}
    cfg = ModelConfig.preset("tiny", dtype=dtype, **extra)
    model = Qwen3(cfg, rngs=nnx.Rngs(3))
    w = serving_weights(model, dtype)
    scfg = serving_config(cfg, dtype)
    p = dict(w.layers[0])
    for name in ("q_bias", "k_bias", "v_bias"):
        if name in p:  # biases start at zero: make them count
            p[name] = p[name] + 0.5
    group = cfg.num_attention_heads // cfg.num_key_value_heads

    def attention(q, k, v):  # any function of all three will do
        kv = jnp.repeat(k * 0.5 + v, group, axis=2)
        return q * jnp.tanh(kv), None

    x = jax.random.normal(jax.random.PRNGKey(4), (5, 1, cfg.hidden_size), dtype)
    want, _ = decoder_layer(scfg, p, x, None, None, attention, attention_prepares_qk=True)
    got, _, sums = decode_layer_fused(scfg, p, x, attention, interpret=True)
    assert got.shape == want.shape and got.dtype == want.dtype
    _close(got, want, dtype)
    # the second layer norms its input from the sums the first one's last kernel wrote
    q = dict(w.layers[1])
    want, _ = decoder_layer(scfg, q, want, None, None, attention, attention_prepares_qk=True)
    got, _, _ = decode_layer_fused(scfg, q, got, attention, sums=sums, interpret=True)
    _close(got, want, dtype)


def test_fused_decode_layer_refuses_unmerged_adapters():
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32)
    p = {adapter_names("q_proj")[0]: jnp.zeros((64, 2))}
    with pytest.raises(ValueError, match="merged"):
        decode_layer_fused(serving_config(cfg), p, jnp.zeros((1, 1, 64)), lambda q, k, v: (q, None))


@pytest.mark.parametrize("layer, rope", [("pallas_gpu_packed_layer", "pallas_gpu_packed_rope"),
                                         ("pallas_mgpu_packed_layer", "pallas_mgpu_packed_rope")])
def test_engine_refuses_the_fused_layer_on_a_tensor_parallel_slice(layer, rope):
    """Its GEMMs are single-device kernels: on a slice the error names the switch to use (the
    same attention kernel, with XLA's GEMMs)."""
    from rstarjax.serving import Engine, slice_meshes

    [mesh] = slice_meshes(jax.devices()[:2], tensor_parallel=2, num_slices=1)
    model = Qwen3(ModelConfig.preset("tiny", dtype=jnp.float32), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=f"{layer}.*'{rope}'"):
        Engine(model, max_len=64, num_slots=2, kv_pages=16, mesh=mesh, decode_attention=layer)

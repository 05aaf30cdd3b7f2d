"""Packed attention (models/attention.py) against the dense masked reference: the blockwise
pure-JAX path and the Pallas kernels (interpret mode on CPU), values and gradients, GQA, packed
segments with padding, rows that are not a multiple of the tile; memory linear in T; the model
with each implementation; the kernels under a sharded mesh."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.models import ModelConfig, Qwen3
from rstarjax.models import attention as attn
from rstarjax.models.sharding import batch_sharding, make_mesh, shard_model, state_shardings


def _inputs(b=2, t=77, nq=4, nk=2, h=16, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, nq, h)), dtype)
    k = jnp.asarray(rng.normal(size=(b, t, nk, h)), dtype)
    v = jnp.asarray(rng.normal(size=(b, t, nk, h)), dtype)
    seg = np.zeros((b, t), np.int32)  # row 0: three segments then padding (id 0)
    seg[0, :30], seg[0, 30:60], seg[0, 60:70] = 1, 2, 3
    seg[1, :50], seg[1, 50:] = 1, 2  # row 1: a segment boundary inside a tile, no padding
    cot = jnp.asarray(rng.normal(size=(b, t, nq, h)), jnp.float32)
    return q, k, v, jnp.asarray(seg), cot


def _value_and_grads(fn, q, k, v, seg, cot):
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, seg).astype(jnp.float32) * cot)
    out = jax.jit(lambda q, k, v: fn(q, k, v, seg))(q, k, v)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    return out, grads


def _assert_close(got, want, atol):
    (out, grads), (ref_out, ref_grads) = got, want
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               atol=atol, rtol=atol)
    for g, r, name in zip(grads, ref_grads, "qkv"):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   atol=atol, rtol=atol, err_msg=f"d{name}")


@pytest.mark.parametrize("block,nq,nk", [(16, 4, 2), (32, 4, 4), (512, 6, 2), (8, 2, 1)])
def test_blockwise_equals_dense_values_and_grads(block, nq, nk):
    q, k, v, seg, cot = _inputs(nq=nq, nk=nk)
    ref = _value_and_grads(attn.dense_attention, q, k, v, seg, cot)
    got = _value_and_grads(lambda *a: attn.blockwise_attention(*a, block=block), q, k, v, seg, cot)
    _assert_close(got, ref, atol=2e-5)


def test_blockwise_bf16_close_to_dense_bf16():
    q, k, v, seg, cot = _inputs(dtype=jnp.bfloat16)
    ref = _value_and_grads(attn.dense_attention, q, k, v, seg, cot)
    got = _value_and_grads(lambda *a: attn.blockwise_attention(*a, block=16), q, k, v, seg, cot)
    assert got[0].dtype == jnp.bfloat16
    _assert_close(got, ref, atol=6e-2)


def test_blockwise_honours_any_segment_ids_like_dense():
    """Segment ids need not be contiguous or sorted: equality decides, as in the dense mask."""
    q, k, v, _, cot = _inputs(b=2, t=40)
    seg = jnp.asarray(np.random.default_rng(3).integers(0, 3, (2, 40)), jnp.int32)
    ref = _value_and_grads(attn.dense_attention, q, k, v, seg, cot)
    got = _value_and_grads(lambda *a: attn.blockwise_attention(*a, block=8), q, k, v, seg, cot)
    _assert_close(got, ref, atol=2e-5)


@pytest.mark.parametrize("kernel", ["splash", "pallas_gpu"])
def test_pallas_kernels_in_interpret_mode_equal_dense(kernel):
    q, k, v, seg, cot = _inputs(t=77)
    fn = {"splash": lambda *a: attn.splash_attention(*a, block=128, interpret=True),
          "pallas_gpu": lambda *a: attn.pallas_gpu_attention(*a, block=32, interpret=True)}[kernel]
    ref = _value_and_grads(attn.dense_attention, q, k, v, seg, cot)
    _assert_close(_value_and_grads(fn, q, k, v, seg, cot), ref, atol=2e-5)


def test_blockwise_memory_is_linear_in_length():
    """XLA's memory analysis of the gradient: dense grows ~4x per doubling of T, blockwise ~2x."""
    def temp(fn, t):
        q = jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
        seg = jax.ShapeDtypeStruct((1, t), jnp.int32)
        grad = jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(fn(q, k, v, s)), argnums=(0, 1, 2)))
        return grad.lower(q, kv, kv, seg).compile().memory_analysis().temp_size_in_bytes

    blockwise = lambda *a: attn.blockwise_attention(*a, block=256)
    ours = [temp(blockwise, t) for t in (2048, 4096, 8192)]
    dense = [temp(attn.dense_attention, t) for t in (2048, 4096)]
    assert dense[1] / dense[0] > 3.5  # the reference really is quadratic
    assert max(b / a for a, b in zip(ours, ours[1:])) < 2.2
    assert ours[-1] < dense[0]  # 8K blockwise below 2K dense


def test_segment_offsets_for_cudnn_match_a_python_reference():
    seg = np.array([[1, 1, 1, 2, 2, 0, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5], [1, 2, 3, 4, 4, 4, 0, 0]],
                   np.int32)

    def reference(row, m):
        starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
        ends = starts[1:] + [len(row)]
        lengths = [e - s for s, e in zip(starts, ends)]
        return lengths + [-1] * (m - len(lengths)), starts + [-1] * (m + 1 - len(starts))

    lengths, offsets = attn.segment_offsets(jnp.asarray(seg), 5)
    for r in range(3):
        want_len, want_off = reference(list(seg[r]), 5)
        assert list(np.asarray(lengths[r])) == want_len
        assert list(np.asarray(offsets[r])) == want_off
    assert list(np.asarray(attn.segment_run_count(jnp.asarray(seg)))) == [3, 1, 5]


def test_auto_choice_per_backend_and_errors():
    assert attn.choose_implementation("auto", 100_000, "tpu") == "splash"
    assert attn.choose_implementation("auto", 100_000, "cuda", jnp.bfloat16, 9.0) == "cudnn"
    assert attn.choose_implementation("auto", attn.DENSE_MAX_LEN, "cpu") == "dense"
    assert attn.choose_implementation("auto", attn.DENSE_MAX_LEN + 1, "cpu") == "blockwise"
    assert attn.choose_implementation("auto", 100_000, "rocm") == "blockwise"
    assert attn.choose_implementation("dense", 100_000, "tpu") == "dense"
    with pytest.raises(ValueError, match="not in"):
        attn.choose_implementation("flash", 10)
    q, k, v, seg, _ = _inputs()
    with pytest.raises(ValueError, match="segment_ids"):
        attn.packed_attention(q, k, v, seg[:, :5])
    with pytest.raises(ValueError, match="packed_attention"):
        ModelConfig.preset("tiny", packed_attention="flash")


# ---- the model with each implementation ---------------------------------------------------------
TINY32 = ModelConfig.preset("tiny", dtype=jnp.float32, attention_block_size=16)


def _packed_batch(b=2, t=48, seed=1):
    rng = np.random.RandomState(seed)
    tokens = jnp.asarray(rng.randint(0, 512, (b, t)), jnp.int32)
    seg = np.ones((b, t), np.int32)
    seg[0, 20:40], seg[0, 40:] = 2, 0
    seg[1, 33:] = 2
    positions = np.concatenate([np.arange(20), np.arange(20), np.arange(8)])[None].repeat(b, 0)
    positions[1] = np.concatenate([np.arange(33), np.arange(15)])
    return tokens, jnp.asarray(positions, jnp.int32), jnp.asarray(seg)


def _model_value_and_grads(cfg, tokens, positions, seg):
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state):
        logits = nnx.merge(graphdef, state)(tokens, positions, seg)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * (seg > 0)), logits
    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return logits, grads


@pytest.mark.parametrize("impl,extra", [("blockwise", {}), ("blockwise", {"remat_policy": "full"}),
                                        ("blockwise", {"scan_layers": False})])
def test_model_with_blockwise_attention_equals_dense(impl, extra):
    tokens, positions, seg = _packed_batch()
    ref_logits, ref_grads = _model_value_and_grads(TINY32.replace(packed_attention="dense"),
                                                   tokens, positions, seg)
    logits, grads = _model_value_and_grads(TINY32.replace(packed_attention=impl, **extra),
                                           tokens, positions, seg)
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")
    return make_mesh(data=2, fsdp=2, tensor=2)


@pytest.mark.parametrize("impl", ["blockwise", "pallas_gpu"])
def test_sharded_model_with_fused_attention_equals_single_device(mesh, impl):
    """Rows over (data, fsdp), heads over tensor: the blockwise path partitioned by XLA, the
    Pallas kernel per device under shard_map (interpret mode here)."""
    tokens, positions, seg = _packed_batch(b=4)
    cfg = TINY32.replace(packed_attention=impl, tie_word_embeddings=False)
    ref_logits, ref_grads = _model_value_and_grads(cfg.replace(packed_attention="dense"),
                                                   tokens, positions, seg)
    model = shard_model(Qwen3(cfg, rngs=nnx.Rngs(0)), mesh)
    graphdef, state = nnx.split(model)
    state_sh, data_sh = state_shardings(nnx.state(model), mesh), batch_sharding(mesh)

    def loss(state, tokens, positions, seg):
        logits = nnx.merge(graphdef, state)(tokens, positions, seg)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * (seg > 0)), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True),
                   in_shardings=(state_sh, data_sh, data_sh, data_sh))
    with jax.set_mesh(mesh):  # the Pallas kernel runs in interpret mode on CPU
        (_, logits), grads = step(state, *(jax.device_put(x, data_sh)
                                           for x in (tokens, positions, seg)))
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype, capability, expected", [
    (jnp.bfloat16, 9.0, "cudnn"), (jnp.float16, 10.0, "cudnn"),  # H100 / H200, B200
    (jnp.bfloat16, 8.0, "pallas_gpu"), (jnp.bfloat16, 8.9, "pallas_gpu"),  # A100, L40S / RTX 4090
    (jnp.float32, 9.0, "blockwise"), (jnp.float32, 8.0, "blockwise"),  # cuDNN takes no float32
])
def test_auto_on_cuda_picks_what_the_gpu_and_dtype_can_run(dtype, capability, expected):
    """auto was cuDNN on every NVIDIA GPU: its packed layout raised 'requires a GPU with at least
    Hopper architecture' on an A100 and 'Q must be fp16/bf16' for a float32 model (the demo's) at
    the first step's trace."""
    assert attn.choose_implementation("auto", 8192, "cuda", dtype, capability) == expected


def test_auto_on_cuda_lowers_where_cudnn_refuses(monkeypatch):
    """What auto picks for an A100 in bf16 and for a float32 model exports for CUDA, where cuDNN's
    packed layout is refused by jax itself (its check, run with the GPU generation faked)."""
    import jax._src.cudnn.fused_attention_stablehlo as cudnn
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    q, k, v, seg, _ = _inputs(t=128, h=64)
    for dtype, capability in ((jnp.bfloat16, 8.0), (jnp.float32, 9.0)):
        impl = attn.choose_implementation("auto", q.shape[1], "cuda", dtype, capability)
        fn = jax.jit(lambda q, k, v, s, impl=impl: attn.packed_attention(q, k, v, s, impl, interpret=False))
        args = [x.astype(dtype) for x in (q, k, v)] + [seg]
        monkeypatch.setattr(attn, "_platform", lambda: "cuda")
        jax.export.export(fn, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    with pytest.raises(Exception, match="Hopper|compute capability"):  # what auto used to pick
        monkeypatch.setattr(cudnn, "check_compute_capability", lambda *a, **k: False)
        fn = jax.jit(lambda q, k, v, s: attn.packed_attention(q, k, v, s, "cudnn", interpret=False))
        jax.export.export(fn, platforms=["cuda"])(*[x.astype(jnp.bfloat16) for x in (q, k, v)], seg)


def test_a_named_kernel_off_its_accelerator_or_with_tiles_it_cannot_take_is_one_line():
    """cudnn on ROCm or TPU failed at lowering ('MLIR translation rule ... not found'), pallas_gpu
    on TPU with a NameError; a splash block of 64 or a Triton block of 100 deep in the kernel."""
    with pytest.raises(ValueError, match="runs on cuda, not rocm"):
        attn.choose_implementation("cudnn", 1024, "rocm")
    with pytest.raises(ValueError, match="runs on tpu/cpu, not cuda"):
        attn.choose_implementation("splash", 1024, "cuda")
    with pytest.raises(ValueError, match="runs on cuda/rocm/cpu, not tpu"):
        attn.choose_implementation("pallas_gpu", 1024, "tpu")
    assert attn.choose_implementation("pallas_gpu", 1024, "cpu") == "pallas_gpu"  # the interpreter
    assert attn.block_problem("splash", 64) and not attn.block_problem("splash", 256)
    assert attn.block_problem("pallas_gpu", 100) and not attn.block_problem("pallas_gpu", 64)
    q, k, v, seg, _ = _inputs()
    with pytest.raises(ValueError, match="attention_block_size=100: the Pallas GPU kernel"):
        attn.packed_attention(q, k, v, seg, "pallas_gpu", block=100)


def test_the_platform_of_a_gpu_device_tells_rocm_from_cuda():
    """jax names both GPU kinds 'gpu' in places; the engine's decode default read
    ``device.platform`` alone and took 'gpu' for CUDA, so a ROCm device would have been sent to the
    Triton kernels the docs keep it off (and a float32 pool to ours)."""
    import types
    from rstarjax.models.paged_attention import default_decode_implementation

    def device(platform, version=""):
        return types.SimpleNamespace(platform=platform, client=types.SimpleNamespace(platform_version=version))

    assert attn.device_platform(device("gpu", "rocm 6.3.1")) == "rocm"
    assert attn.device_platform(device("gpu", "cuda 12080")) == "cuda"
    assert attn.device_platform(device("rocm")) == "rocm" and attn.device_platform(device("tpu")) == "tpu"
    for kv_dtype in (jnp.bfloat16, jnp.float32):
        platform = attn.device_platform(device("gpu", "rocm 6.3.1"))
        assert default_decode_implementation(platform, kv_dtype=kv_dtype) == "ragged"

"""The compiled GPU attention kernels (cuDNN fused attention, the Pallas Triton kernel) against
the dense masked reference in float32, values and gradients, on packed rows with padding.

Runs only on an NVIDIA GPU (``JAX_PLATFORMS=cuda python -m pytest tests/test_attention_gpu.py``);
on CPU the Pallas kernel is covered in interpret mode by tests/test_attention.py and cuDNN cannot
run at all."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstarjax.models import attention as attn

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda)")


def _packed_rows(b=2, t=512, nq=8, nk=2, h=128, seed=0):
    """Row 0: four segments of uneven lengths then padding; row 1: two segments, a boundary
    inside a kernel tile, no padding. bf16 inputs (what the kernels take), float32 cotangent."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.bfloat16) for n in (nq, nk, nk))
    seg = np.zeros((b, t), np.int32)
    seg[0, :100], seg[0, 100:260], seg[0, 260:300], seg[0, 300:450] = 1, 2, 3, 4
    seg[1, :333], seg[1, 333:] = 1, 2
    cot = jnp.asarray(rng.normal(size=(b, t, nq, h)), jnp.float32)
    return q, k, v, jnp.asarray(seg), cot


def _value_and_grads(fn, q, k, v, seg, cot):
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, seg).astype(jnp.float32) * cot)
    out = jax.jit(lambda q, k, v: fn(q, k, v, seg))(q, k, v)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    return out, grads


def _reference(q, k, v, seg, cot):
    """The dense masked attention in float32 (inputs upcast), the outside reference."""
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    return _value_and_grads(attn.dense_attention, *up, seg, cot)


def _assert_close(got, want):
    (out, grads), (ref_out, ref_grads) = got, want
    # bf16 inputs and bf16 outputs: errors relative to the tensor's scale
    for name, g, r in [("out", out, ref_out)] + list(zip(("dq", "dk", "dv"), grads, ref_grads)):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.all(np.isfinite(g)), name
        err = np.max(np.abs(g - r)) / (np.max(np.abs(r)) + 1e-6)
        assert err < 2e-2, f"{name}: max error {err:.3g} of the reference's scale"


@pytest.mark.parametrize("impl", ["cudnn", "pallas_gpu"])
def test_gpu_kernel_equals_dense_reference(impl):
    q, k, v, seg, cot = _packed_rows()
    fn = lambda *a: attn.packed_attention(*a, implementation=impl)  # noqa: E731
    _assert_close(_value_and_grads(fn, q, k, v, seg, cot), _reference(q, k, v, seg, cot))


def test_gpu_auto_equals_dense_reference_on_a_long_row():
    q, k, v, _, cot = _packed_rows(b=2, t=4096, seed=1)
    seg = jnp.asarray(np.repeat(np.arange(1, 9), 512)[None].repeat(2, 0), jnp.int32)  # 8 runs
    fn = lambda *a: attn.packed_attention(*a, implementation="auto")  # noqa: E731
    _assert_close(_value_and_grads(fn, q, k, v, seg, cot), _reference(q, k, v, seg, cot))


def test_cudnn_beyond_max_segments_falls_back_to_the_right_answer():
    q, k, v, _, cot = _packed_rows(b=2, t=256, seed=2)
    seg = jnp.asarray(np.repeat(np.arange(1, 65), 4)[None].repeat(2, 0), jnp.int32)  # 64 runs
    fn = lambda *a: attn.packed_attention(*a, implementation="cudnn", max_segments=32)  # noqa
    _assert_close(_value_and_grads(fn, q, k, v, seg, cot), _reference(q, k, v, seg, cot))


def test_cudnn_without_fallback_is_loud_beyond_max_segments():
    q, k, v, _, _ = _packed_rows(b=2, t=256)
    seg = jnp.asarray(np.repeat(np.arange(1, 65), 4)[None].repeat(2, 0), jnp.int32)
    out = attn.cudnn_attention(q, k, v, seg, max_segments=32)
    assert np.all(np.isnan(np.asarray(out, np.float32)))

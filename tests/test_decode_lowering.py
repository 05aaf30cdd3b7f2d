"""The engine's decode program lowers for every accelerator it may run on, here on CPU.

``jax.export`` with ``platforms=[...]`` lowers a program for a platform this machine does not
have: each decode attention the engine can pick is lowered inside the engine's real decode
program (the while loop of forward, sampling and bookkeeping) for CUDA, ROCm and TPU, so a change
that breaks one of them fails here, not on a lent GPU or a pod.

What lowering checks, and what it cannot: for a Pallas kernel on CUDA/ROCm it runs Pallas'
Triton lowering (block shapes, every op of the kernel body translated to Triton IR, which MLIR
verifies) and for TPU the Mosaic lowering. The Triton IR is only compiled to PTX/AMDGCN when XLA
compiles the program on the device itself (Triton's own passes: layouts, shared memory per
``num_stages``, register allocation), and that needs the GPU: a kernel that lowers here can
still fail there for too much shared memory, never for an op Pallas cannot lower. The Mosaic GPU
kernel (``pallas_mgpu_packed``) goes further here: Mosaic GPU's lowering picks every register
layout and shared-memory transfer plan on CPU (a layout it cannot serve fails here); only the
PTX is made on the device.
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

from rstarjax.models.config import ModelConfig
from rstarjax.models.paged_attention import default_decode_implementation
from rstarjax.models.qwen3 import Qwen3
from rstarjax.serving import engine as engine_module
from rstarjax.serving.engine import Engine

# head_dim 128 and 16-token pages: the shapes every kernel accepts (the TPU kernel wants 128).
CFG = ModelConfig.preset("tiny", head_dim=128, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
# Pallas' GPU kernels are Triton custom calls, which jax.export refuses to serialize unless told
# (no compatibility guarantee across jaxlib versions): the lowering is what is checked here.
TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
TPU_KERNEL = export.DisabledSafetyCheck.custom_call("tpu_custom_call")


class _Captured(Exception):
    pass


@pytest.fixture(scope="module")
def decode_call():
    """The arguments the engine passes its decode program (no request started: the program's
    shapes are the same, and no prefill compiles)."""
    model = Qwen3(CFG, rngs=nnx.Rngs(0))
    engine = Engine(model, max_len=64, num_slots=4, page_size=16, kv_pages=24, decode_steps=2,
                    dtype=jnp.bfloat16, decode_attention="pallas_gpu_packed")
    state = engine.init_decode_state()
    seen = {}

    def capture(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        raise _Captured

    real = engine_module.decode_program
    engine_module.decode_program = capture
    try:
        with pytest.raises(_Captured):
            engine.decode(engine.params, state)
    finally:
        engine_module.decode_program = real
    return real, seen["args"], seen["kwargs"]


def _lower(decode_call, platform, attention):
    program, args, kwargs = decode_call
    kwargs = {**kwargs, "attention": attention, "interpret": False}
    exported = export.export(program, platforms=[platform], disabled_checks=[TRITON, TPU_KERNEL])(
        *args, **kwargs)
    return exported.mlir_module()


LOWERED = [
    ("cuda", "pallas_gpu"), ("cuda", "pallas_gpu_packed"), ("cuda", "pallas_gpu_packed_append"),
    ("cuda", "pallas_gpu_packed_rope"), ("cuda", "pallas_gpu_packed_layer"),
    ("cuda", "pallas_mgpu_packed"), ("cuda", "pallas_mgpu_packed_rope"),
    ("cuda", "pallas_mgpu_packed_layer"), ("cuda", "ragged"),
    ("rocm", "auto"), ("rocm", "pallas_gpu_packed"), ("rocm", "pallas_gpu_packed_append"),
    ("rocm", "pallas_gpu_packed_rope"), ("rocm", "pallas_gpu_packed_layer"),
    ("tpu", "auto"), ("tpu", "ragged"),
]


@pytest.mark.parametrize("platform, attention", LOWERED)
def test_decode_program_lowers_for_the_platform(decode_call, platform, attention):
    if attention == "auto":  # what the engine picks there for a bf16 pool of 16-token pages
        attention = default_decode_implementation(platform, head_dim=128, page_size=16)
    text = _lower(decode_call, platform, attention)
    triton, mosaic = "__gpu$xla.gpu.triton", "mosaic_gpu_v2"
    kernels = {"pallas_gpu": [triton], "pallas_gpu_packed": [triton],
               "pallas_gpu_packed_append": [triton], "pallas_gpu_packed_rope": [triton],
               "pallas_gpu_packed_layer": [triton], "pallas_mgpu_packed": [mosaic],
               "pallas_mgpu_packed_rope": [mosaic],
               # the Mosaic GPU attention between our Triton GEMMs
               "pallas_mgpu_packed_layer": [mosaic, triton],
               "pallas_tpu": ["tpu_custom_call"]}.get(attention, [])
    for kernel in kernels:  # the kernels themselves are in the program, not a fallback
        assert kernel in text, (platform, attention, kernel)


def test_every_engine_arm_the_gpu_check_runs_is_lowered_above():
    """Each attention path of gpu_check's ``decode`` and ``decode_4k`` arms (ATTENTION:SAMPLER[:GEMMS]),
    as listed and as composed on the Mosaic GPU kernel (``ON_MOSAIC``), is one the test above
    lowers for CUDA, so no arm first fails to compile on a lent GPU."""
    gpu_check = _gpu_check()
    arms = ",".join([gpu_check.DECODE_ARMS, gpu_check.DECODE_4K_ARMS, *gpu_check.ON_MOSAIC.values()])
    attentions = {arm.split(":")[0] for arm in arms.split(",")}
    assert attentions <= {a for p, a in LOWERED if p == "cuda"}, attentions
    assert {"pallas_mgpu_packed_rope", "pallas_mgpu_packed_layer"} <= attentions
    assert set(gpu_check.ON_MOSAIC) <= set(arms.split(","))  # each composes an arm that runs


def test_auto_picks_a_kernel_on_tpu_and_the_portable_path_on_rocm():
    """The parametrized cases above lower what the engine picks: the Mosaic kernel on TPU."""
    assert default_decode_implementation("tpu", head_dim=128, page_size=16) == "pallas_tpu"
    assert default_decode_implementation("rocm", head_dim=128, page_size=16) == "ragged"


def _gpu_check():
    """benchmarks/gpu_check.py as a module (its flags are parsed in ``main``, not on import)."""
    benchmarks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import gpu_check

    return gpu_check


def _gpu_check_specs(name: str) -> list[str]:
    """The ';'-separated specs a constant of benchmarks/gpu_check.py lists."""
    return [b for b in getattr(_gpu_check(), name).split(";") if b]


def _gpu_check_blockings() -> list[tuple[int, ...]]:
    """The blockings benchmarks/gpu_check.py's kernels2 part runs (``PACKED_BLOCKINGS``)."""
    return [tuple(map(int, b.split(","))) for b in _gpu_check_specs("PACKED_BLOCKINGS")]


@pytest.mark.parametrize("blocking", _gpu_check_blockings() + [(1, 1, 1, 2, 1)])
def test_packed_kernel_variants_lower_for_cuda_at_qwen3_shapes(blocking):
    """Every blocking benchmarks/gpu_check.py's kernels2 part runs (and the engine's default,
    the first), at Qwen3-1.7B (16 q / 8 kv heads) and 8B (32 / 8) decode shapes, 256 and 32
    rows (one split and several), a 4,608-token table of 16-token pages (and of 64-token ones at
    256 rows); each also as the kernel
    that writes the step's K/V (``decode_attention_append``, its pools aliased to its outputs),
    and as that kernel norming and rotating q and k itself (``pallas_gpu_packed_rope``)."""
    from rstarjax.models.decode_kernel import (PACKED_BLOCKING, PackedBlocking,
                                               decode_attention_append, decode_attention_packed)

    assert PackedBlocking(*_gpu_check_blockings()[0]) == PACKED_BLOCKING
    blocking = PackedBlocking(*blocking)
    sd = jax.ShapeDtypeStruct
    # 16-token pages (the engine's) and 64-token ones (kernels2 measures both)
    for q_heads, rows, page in ((16, 256, 16), (32, 256, 16), (16, 32, 16), (16, 256, 64)):
        pool = sd((8, 65536 // page, page, 128), jnp.bfloat16)
        q, new = sd((rows, q_heads, 128), jnp.bfloat16), sd((rows, 8, 128), jnp.bfloat16)
        table, lengths = sd((rows, 4608 // page), jnp.int32), sd((rows,), jnp.int32)
        angles, norms = (sd((rows, 64), jnp.float32),) * 2, (sd((128,), jnp.bfloat16),) * 2
        calls = [
            (lambda q, k, v, t, n: decode_attention_packed(q, k, v, t, n, blocking=blocking),
             (q, pool, pool, table, lengths)),
            (lambda *a: decode_attention_append(*a, blocking=blocking),
             (q, new, new, lengths, pool, pool, table, lengths)),
            (lambda *a: decode_attention_append(*a[:8], rope=a[8], qk_norm=a[9], blocking=blocking),
             (q, new, new, lengths, pool, pool, table, lengths, angles, norms)),
        ]
        for fn, args in calls:
            text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[TRITON])(
                *args).mlir_module()
            assert "__gpu$xla.gpu.triton" in text
            _assert_kernels_profile_as(text, "decode_attention_", "attention")


@pytest.mark.parametrize("group", [3, 5, 6])
def test_packed_kernels_lower_for_gpus_at_any_gqa_group(group):
    """Query heads per kv head that are not a power of two (Qwen3-14B and Qwen2.5-32B: 40 / 8 = 5;
    Qwen2.5's 6 and 7) lower for CUDA and ROCm: Pallas' Triton lowering takes power-of-two blocks
    only, so the kernel pads the [G, H] queries (``decode_kernel.query_rows``). Each kernel the
    ``pallas_gpu_packed*`` arms run, on CUDA-core products and on the tensor cores, tiny shapes."""
    from rstarjax.models.decode_kernel import (PackedBlocking, decode_attention_append,
                                               decode_attention_packed)

    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    rows, kv_heads, h = 4, 2, 64
    pool = sd((kv_heads, 16, 16, h), bf)
    q, new = sd((rows, kv_heads * group, h), bf), sd((rows, kv_heads, h), bf)
    table, lengths = sd((rows, 8), jnp.int32), sd((rows,), jnp.int32)
    angles, norms = (sd((rows, h // 2), jnp.float32),) * 2, (sd((h,), bf),) * 2
    for blocking in (PackedBlocking(), PackedBlocking(tensor_cores=1)):
        calls = [
            (lambda *a: decode_attention_packed(*a, blocking=blocking), (q, pool, pool, table, lengths)),
            (lambda *a: decode_attention_append(*a[:8], rope=a[8], qk_norm=a[9], blocking=blocking),
             (q, new, new, lengths, pool, pool, table, lengths, angles, norms)),
        ]
        for (fn, args), platform in [(c, p) for c in calls for p in ("cuda", "rocm")]:
            text = export.export(jax.jit(fn), platforms=[platform], disabled_checks=[TRITON])(
                *args).mlir_module()
            assert "__gpu$xla.gpu.triton" in text


# (arm, platform, head_dim, page_size): shapes each kernel takes and shapes it refuses
KERNEL_SHAPES = [("pallas_gpu", "cuda", 64, 16), ("pallas_gpu", "cuda", 64, 48),
                 ("pallas_gpu", "cuda", 80, 16), ("pallas_gpu_packed", "cuda", 64, 96),
                 ("pallas_gpu_packed", "cuda", 96, 16), ("pallas_tpu", "tpu", 128, 16),
                 ("pallas_tpu", "tpu", 64, 16)]


@pytest.mark.parametrize("arm, platform, head_dim, page", KERNEL_SHAPES)
def test_kernel_problems_are_what_fails_to_lower(arm, platform, head_dim, page):
    """``paged_attention.kernel_problems`` (what ``auto`` avoids and the engine refuses in one
    line) names a shape exactly when the kernel does not lower for it: Triton's power-of-two
    blocks (48- and 96-token pages, Qwen2's head_dim 80 and 96), the TPU kernel's 128 lanes."""
    from rstarjax.models.paged_attention import kernel_problems, paged_decode_attention

    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    pool = sd((2, 16, page, head_dim), bf)
    args = (sd((4, 4, head_dim), bf), pool, pool, sd((4, 8), jnp.int32), sd((4,), jnp.int32))
    try:
        export.export(jax.jit(lambda *a: paged_decode_attention(*a, implementation=arm)),
                      platforms=[platform], disabled_checks=[TRITON, TPU_KERNEL])(*args)
        lowers = True
    except ValueError:
        lowers = False
    assert lowers == (not kernel_problems(arm, head_dim=head_dim, page_size=page))


@pytest.mark.parametrize("head_dim, page", [(128, 48), (128, 96), (80, 16), (96, 16), (128, 16)])
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float32])
def test_auto_on_cuda_picks_a_kernel_that_lowers(head_dim, page, kv_dtype):
    """``auto`` on CUDA never picks a kernel the shapes cannot lower (page sizes that are
    multiples of 16 but not powers of two fell to jax's Triton kernel, which then failed at the
    first decode on the GPU): those take the portable path."""
    from rstarjax.models.paged_attention import paged_decode_attention

    arm = default_decode_implementation("cuda", head_dim=head_dim, page_size=page, kv_dtype=kv_dtype)
    assert (arm == "ragged") == ((head_dim, page) != (128, 16) or kv_dtype == jnp.float32)
    if arm != "ragged":  # the pick lowers
        sd = jax.ShapeDtypeStruct
        pool = sd((2, 16, page, head_dim), kv_dtype)
        args = (sd((4, 10, head_dim), kv_dtype), pool, pool, sd((4, 8), jnp.int32), sd((4,), jnp.int32))
        text = export.export(jax.jit(lambda *a: paged_decode_attention(*a, implementation=arm)),
                             platforms=["cuda"], disabled_checks=[TRITON])(*args).mlir_module()
        assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("arm, head_dim, page, reason", [
    ("pallas_gpu", 128, 48, "page_size 48.*or choose another serving.page_size"),
    ("pallas_gpu_packed_rope", 128, 96, "page_size 96.*or choose another serving.page_size"),
    ("pallas_gpu_packed", 80, 16, "head_dim 80.*'auto' or 'ragged'$"),
    ("pallas_tpu", 64, 16, "head_dim 64.*'auto' or 'ragged'$")])
def test_the_engine_refuses_a_named_kernel_its_shapes_cannot_lower(arm, head_dim, page, reason):
    """A kernel named in ``serving.decode_attention`` that cannot lower for the engine's pool is
    refused when the engine is built, in one line naming the setting to change (not at the first
    decode's lowering on the GPU); interpreted (CPU tests) it runs any shape."""
    cfg = ModelConfig.preset("tiny", head_dim=head_dim, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    build = dict(max_len=96, num_slots=2, page_size=page, kv_pages=8, dtype=jnp.bfloat16,
                 decode_attention=arm)
    with pytest.raises(ValueError, match=f"decode_attention '{arm}' cannot run.*{reason}") as refused:
        Engine(model, **build)
    assert "\n" not in str(refused.value)
    assert Engine(model, interpret=True, **build).decode_attention == arm


def _assert_kernels_profile_as(text: str, prefix: str, group: str) -> None:
    """The Pallas kernels named ``prefix...`` in a lowered program fall in ``group`` when
    benchmarks/profile_summary.py reads a trace of them (it goes by kernel names)."""
    import re

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "benchmarks"))
    import profile_summary

    names = set(re.findall(rf"{prefix}\w+", text))
    assert names, f"no kernel named {prefix}* in the lowered program"
    assert {n: profile_summary.group_by_name(n) for n in names} == {n: group for n in names}


@pytest.mark.parametrize("rows", [4, 64, 256])
@pytest.mark.parametrize("model", ["qwen3-1.7b", "qwen3-8b"])
def test_fused_decode_gemms_lower_for_cuda_at_qwen3_shapes(model, rows):
    """``pallas_gpu_packed_layer``'s four GEMM kernels (models/decode_gemm.py) at the layer
    shapes of Qwen3-1.7B and 8B for the decode batches the engine compiles (4 rows: padded to
    the 16-row tile), with the default blocking and an 8-warp one."""
    from rstarjax.models.decode_gemm import GemmBlocking

    _lower_fused_decode_gemms(model, rows, (GemmBlocking(), GemmBlocking(
        block_cols=64, min_cols=64, num_warps=8)))


@pytest.mark.parametrize("spec", _gpu_check_specs("GEMM_BLOCKINGS"))
def test_every_blocking_the_gemms_part_sweeps_lowers_for_cuda(spec):
    """Each blocking gpu_check's ``gemms`` part runs (the engine's default first) lowers at the
    shapes it runs them: Qwen3-1.7B's layer at 64 and 256 rows."""
    from rstarjax.models.decode_gemm import GEMM_BLOCKING, GemmBlocking

    assert GemmBlocking.from_spec(_gpu_check_specs("GEMM_BLOCKINGS")[0]) == GEMM_BLOCKING
    for rows in (64, 256):
        _lower_fused_decode_gemms("qwen3-1.7b", rows, (GemmBlocking.from_spec(spec),))


def _lower_fused_decode_gemms(model: str, rows: int, blockings) -> None:
    """The GEMM kernels of a decode layer at ``model``'s shapes, exported for cuda: the norms
    summing their rows (the first layer) and from the sums the residual kernels write."""
    from rstarjax.models.decode_gemm import matmul_residual, norm_matmul

    cfg = ModelConfig.preset(model)
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    x, w_norm = sd((rows, d), bf), sd((d,), bf)
    for blocking in blockings:
        # the sums as the down projection's kernel writes them with this blocking
        _, sums = jax.eval_shape(lambda a, w, r: matmul_residual(a, w, r, with_sums=True, blocking=blocking),
                                 sd((rows, f), bf), sd((f, d), bf), x)
        calls = [
            (lambda x, n, a, b, c: norm_matmul(x, n, (a, b, c), eps=1e-6, blocking=blocking),
             (x, w_norm, sd((d, q), bf), sd((d, kv), bf), sd((d, kv), bf))),
            (lambda x, n, s, a, b, c: norm_matmul(x, n, (a, b, c), eps=1e-6, sums=s, blocking=blocking),
             (x, w_norm, sums, sd((d, q), bf), sd((d, kv), bf), sd((d, kv), bf))),
            (lambda a, w, r: matmul_residual(a, w, r, with_sums=True, blocking=blocking),
             (sd((rows, q), bf), sd((q, d), bf), x)),
            (lambda x, n, s, a, b: norm_matmul(x, n, (a, b), eps=1e-6, swiglu=True, sums=s,
                                               blocking=blocking),
             (x, w_norm, sums, sd((d, f), bf), sd((d, f), bf))),
            (lambda a, w, r: matmul_residual(a, w, r, with_sums=True, blocking=blocking),
             (sd((rows, f), bf), sd((f, d), bf), x)),
        ]
        for fn, args in calls:
            text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[TRITON])(
                *args).mlir_module()
            assert "__gpu$xla.gpu.triton" in text
            _assert_kernels_profile_as(text, "decode_gemm_", "matmul")


def _gpu_check_mosaic_blockings() -> list[tuple[int, ...]]:
    """The Mosaic GPU kernel's blockings benchmarks/gpu_check.py's kernels2 part runs."""
    return [tuple(map(int, b.split(","))) for b in
            _gpu_check_specs("MOSAIC_BLOCKINGS") + _gpu_check_specs("SHORT_ROW_MOSAIC")]


@pytest.mark.parametrize("blocking", sorted(set(_gpu_check_mosaic_blockings())))
def test_mosaic_kernel_variants_lower_for_cuda_at_qwen3_shapes(blocking):
    """Every blocking of the Mosaic GPU kernel kernels2 runs (the engine's default among them),
    at Qwen3-1.7B (16 q / 8 kv heads) and 8B (32 / 8) decode shapes, 256 and 32 rows, 4,608-token
    tables of 16- and 64-token pages: Mosaic GPU's lowering (register layouts, shared-memory
    transfer plans) and a shared-memory footprint an H100/H200 program can hold (227 KB); the
    same for the kernel that writes the step's K/V and norms and rotates q/k
    (``pallas_mgpu_packed_rope``, the engine's arm)."""
    from rstarjax.models.decode_kernel_mgpu import (MOSAIC_BLOCKING, MosaicBlocking,
                                                    decode_attention_mosaic,
                                                    decode_attention_mosaic_append)

    assert MOSAIC_BLOCKING in [MosaicBlocking(*b) for b in _gpu_check_mosaic_blockings()]
    blocking = MosaicBlocking(*blocking)
    sd = jax.ShapeDtypeStruct
    for q_heads, rows, page in ((16, 256, 16), (32, 256, 16), (16, 32, 16), (16, 256, 64)):
        assert blocking.shared_bytes(4608 // page, page, 128) <= 227 * 1024, (blocking, page)
        pool = sd((8, 65536 // page, page, 128), jnp.bfloat16)
        args = (sd((rows, q_heads, 128), jnp.bfloat16), pool, pool, sd((rows, 4608 // page), jnp.int32),
                sd((rows,), jnp.int32))
        text = export.export(jax.jit(lambda *a: decode_attention_mosaic(*a, blocking=blocking)),
                             platforms=["cuda"])(*args).mlir_module()
        assert "mosaic_gpu_v2" in text
        _assert_kernels_profile_as(text, "decode_attention_", "attention")
        assert blocking.shared_bytes(4608 // page, page, 128, append=True, rope=True) <= 227 * 1024
        new, angles, norm = sd((rows, 8, 128), jnp.bfloat16), sd((rows, 64), jnp.float32), sd((128,), jnp.bfloat16)

        def rope_kernel(q, k_new, v_new, slots, k, v, table, lengths, sin, cos, w_q, w_k):
            return decode_attention_mosaic_append(q, k_new, v_new, slots, k, v, table, lengths,
                                                  rope=(sin, cos), qk_norm=(w_q, w_k), blocking=blocking)
        text = export.export(jax.jit(rope_kernel), platforms=["cuda"])(
            args[0], new, new, args[4], pool, pool, args[3], args[4], angles, angles, norm, norm).mlir_module()
        assert "mosaic_gpu_v2" in text
        _assert_kernels_profile_as(text, "decode_attention_", "attention")


def test_the_mosaic_writing_kernel_lowers_for_cuda_on_a_slice():
    """On a tensor-parallel slice the writing Mosaic GPU kernel runs per device on its kv heads
    (``paged_decode_append(kv_sharding=...)``'s ``shard_map``, as the Triton one): that program
    lowers for CUDA. (Mosaic GPU's interpreter cannot run two devices' kernels at once, so the
    split is checked against the unsplit call only for the Triton kernel, tests/test_paged_attention.py.)"""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rstarjax.models.paged_attention import paged_decode_append

    sd = jax.ShapeDtypeStruct
    split = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("tensor",)), PartitionSpec("tensor"))
    rows, bf = 8, jnp.bfloat16
    pool = sd((4, 64, 16, 128), bf, sharding=split)

    def step(q, k_new, v_new, k, v, table, positions, valid, sin, cos, w_q, w_k):
        return paged_decode_append(q, k_new, v_new, k, v, table, positions, valid, rope=(sin, cos),
                                   qk_norm=(w_q, w_k), mosaic=True, kv_sharding=split)
    text = export.export(jax.jit(step), platforms=["cuda"])(
        sd((rows, 8, 128), bf), sd((rows, 4, 128), bf), sd((rows, 4, 128), bf), pool, pool,
        sd((rows, 8), jnp.int32), sd((rows,), jnp.int32), sd((rows,), jnp.bool_),
        sd((rows, 64), jnp.float32), sd((rows, 64), jnp.float32), sd((128,), bf), sd((128,), bf)
    ).mlir_module()
    assert "mosaic_gpu_v2" in text

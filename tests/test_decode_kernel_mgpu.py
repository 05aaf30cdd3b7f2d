"""The Mosaic GPU paged decode kernel (models/decode_kernel_mgpu.py) in Mosaic GPU's interpreter
against the pure-JAX paged reference: ragged lengths, page and block boundaries, shared prefix
pages, table entries past a row's length that name other rows' pages, GQA 2 / 4 / 8, slots reused
by later blocks; what it refuses; and the engine's paged forward through the switch. Its CUDA
lowering inside the engine's decode program is in tests/test_decode_lowering.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

from rstarjax.models.config import ModelConfig
from rstarjax.models.decode_kernel_mgpu import (MosaicBlocking, decode_attention_mosaic,
                                                decode_attention_mosaic_append)
from rstarjax.models.kv_cache import NO_PAGE, PagedKVCache
from rstarjax.models.paged_attention import paged_attention_reference, write_kv_pages, write_targets
from rstarjax.models.qwen3 import (Qwen3, apply_rope, paged_forward, rms_norm, rope_angles,
                                   serving_config, serving_weights)


def _case(seed, q_heads, kv_heads, head_dim, page, width, dtype=jnp.bfloat16):
    """Rows of length 1, exactly one page, one past a page boundary, several pages and a full
    table, the last two sharing their first two pages; entries past a row's live pages name
    pages of other rows (valid ids the kernel must mask, as the engine's clamped NO_PAGE are)."""
    rng = np.random.default_rng(seed)
    lengths = [1, page, page + 1, 3 * page + 2, page * width]
    num_pages = sum(-(-n // page) for n in lengths) + 2
    perm = rng.permutation(num_pages)
    table = np.full((len(lengths), width), NO_PAGE, np.int32)
    used = 0
    for i, n in enumerate(lengths):
        p = -(-n // page)
        table[i, :p] = perm[used:used + p]
        used += p
    table[4, :2] = table[3, :2]
    table = np.where(table == NO_PAGE, table[4, -1], table)
    k = jnp.asarray(rng.normal(size=(kv_heads, num_pages, page, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(kv_heads, num_pages, page, head_dim)), dtype)
    q = jnp.asarray(rng.normal(size=(len(lengths), q_heads, head_dim)), dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    table = jnp.asarray(table)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = paged_attention_reference(f32(q)[:, None], f32(k), f32(v), table, (lengths - 1)[:, None])[:, 0]
    return q, k, v, table, lengths, np.asarray(ref)


# p is rounded to the pool's dtype for the tensor cores, as a bf16 flash kernel does: ~4e-3 here;
# one token too many or too few in a row of <= 17 tokens moves its output by ~1/17
TOLERANCE = 1.5e-2


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, page, width, blocking, per_block", [
    # GQA 2, 128-byte rows: 64-token blocks of 8 pages, the full row 4 blocks, slots reused
    (4, 2, 64, 8, 32, MosaicBlocking(64, 2), 8),
    # GQA 4, Qwen3's head_dim and pages: 4 pages a block, 4 blocks over 3 slots
    (8, 2, 128, 16, 16, MosaicBlocking(64, 3), 4),
    # GQA 8, 32-byte rows (16-token steps): a page a block, 4 blocks over 2 slots
    (8, 1, 16, 16, 4, MosaicBlocking(16, 2), 1),
    # 32 tokens asked, but WGMMA steps over 64: the fewest pages above it (4), 2 blocks
    (4, 2, 128, 16, 8, MosaicBlocking(32, 2), 4),
])
def test_the_mosaic_kernel_equals_the_reference(q_heads, kv_heads, head_dim, page, width, blocking,
                                                per_block):
    """In the interpreter against the reference; and each case also lowers for CUDA, so no case
    passes here with a blocking Mosaic GPU would refuse on the device."""
    q, k, v, table, lengths, ref = _case(0, q_heads, kv_heads, head_dim, page, width)
    assert blocking.for_width(width, page, min(128, 2 * head_dim) // 2) == per_block
    got = decode_attention_mosaic(q, k, v, table, lengths, blocking=blocking, interpret=True)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=TOLERANCE)
    text = export.export(jax.jit(lambda *a: decode_attention_mosaic(*a, blocking=blocking)),
                         platforms=["cuda"])(q, k, v, table, lengths).mlir_module()
    assert "mosaic_gpu_v2" in text


def test_the_mosaic_kernel_refuses_what_it_cannot_run_in_one_line():
    q, k, v, table, lengths, _ = _case(1, 4, 2, 64, 8, 8)
    with pytest.raises(ValueError, match="pallas_mgpu_packed.*float32 pool"):
        decode_attention_mosaic(q, k.astype(jnp.float32), v.astype(jnp.float32), table, lengths,
                                interpret=True)
    many = jnp.zeros((q.shape[0], 18, 64), q.dtype)  # 9 query heads a kv head
    with pytest.raises(ValueError, match="9 query heads per kv head"):
        decode_attention_mosaic(many, k, v, table, lengths, interpret=True)
    with pytest.raises(ValueError, match="page_size 4"):
        decode_attention_mosaic(q, k.reshape(2, -1, 4, 64), v.reshape(2, -1, 4, 64), table, lengths,
                                interpret=True)
    with pytest.raises(ValueError, match="6 pages wide"):  # 8, 16, 24 or 48 tokens: none a multiple of 64
        decode_attention_mosaic(q, k, v, table[:, :6], lengths, interpret=True)
    new = jnp.zeros((q.shape[0], 2, 64), q.dtype)
    angles = (jnp.zeros((q.shape[0], 32)),) * 2
    with pytest.raises(ValueError, match="pallas_mgpu_packed_rope.*head_dim 64 with the rotary"):
        decode_attention_mosaic_append(q, new, new, lengths - 1, k, v, table, lengths, rope=angles,
                                       interpret=True)
    q, k, v, table, lengths, _ = _case(1, 4, 2, 16, 16, 4)  # 32-byte rows
    new = jnp.zeros((q.shape[0], 2, 16), q.dtype)
    with pytest.raises(ValueError, match="pallas_mgpu_packed_append.*head_dim 16 with the K/V write"):
        decode_attention_mosaic_append(q, new, new, lengths - 1, k, v, table, lengths, interpret=True)


@pytest.mark.parametrize("page, refused", [(48, True), (80, True), (256, True), (64, False)])
def test_the_mosaic_kernel_refuses_pages_over_hopper_s_shared_memory(page, refused):
    """Page sizes whose blocks (whole pages, multiples of 64 tokens) times the stages in flight
    overflow an H100/H200 program's 227 KiB of shared memory are refused in one line (48-token
    pages: 4-page blocks of 192 tokens, ~306 KiB), not by Mosaic GPU's lowering; the engine's
    64-token pages still lower for CUDA."""
    from rstarjax.models.decode_kernel_mgpu import MOSAIC_BLOCKING, SHARED_MEMORY_BYTES, problems

    shape = (16, 8, 128, page, jnp.bfloat16, 8)
    assert bool(problems(*shape)) == refused
    assert (MOSAIC_BLOCKING.shared_bytes(8, page, 128) > SHARED_MEMORY_BYTES) == refused
    sd = jax.ShapeDtypeStruct
    pool = sd((1, 16, page, 128), jnp.bfloat16)
    args = (sd((1, 2, 128), jnp.bfloat16), pool, pool, sd((1, 8), jnp.int32), sd((1,), jnp.int32))
    lower = lambda: export.export(decode_attention_mosaic, platforms=["cuda"])(*args)  # noqa: E731
    if refused:
        with pytest.raises(ValueError, match=f"cannot run page_size {page} .*KiB of shared memory"):
            lower()
    else:
        assert "mosaic_gpu_v2" in lower().mlir_module()


def test_shared_bytes_is_what_mosaic_gpu_counts(monkeypatch):
    """``MosaicBlocking.shared_bytes`` (what ``problems`` holds against the limit) is the count
    Mosaic GPU's lowering refuses a kernel by, to the byte: the writing, rotating kernel (every
    buffer, the angles and norm weights too) lowered past ``problems`` at 48-token pages."""
    import re

    from rstarjax.models import decode_kernel_mgpu

    monkeypatch.setattr(decode_kernel_mgpu, "problems", lambda *a, **k: [])
    blocking = decode_kernel_mgpu.MOSAIC_APPEND_BLOCKING
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    pool, new, lengths = sd((1, 16, 48, 128), bf), sd((1, 1, 128), bf), sd((1,), jnp.int32)
    angles, norm = sd((1, 64), jnp.float32), sd((128,), bf)

    def kernel(q, k_new, v_new, slots, k, v, table, lengths, sin, cos, w_q, w_k):
        return decode_attention_mosaic_append(q, k_new, v_new, slots, k, v, table, lengths,
                                              rope=(sin, cos), qk_norm=(w_q, w_k), blocking=blocking)
    with pytest.raises(ValueError, match="exceeds available shared memory") as over:
        export.export(jax.jit(kernel), platforms=["cuda"])(
            sd((1, 2, 128), bf), new, new, lengths, pool, pool, sd((1, 8), jnp.int32), lengths,
            angles, angles, norm, norm)
    counted = int(re.search(r"smem_bytes=(\d+)", str(over.value)).group(1))
    assert counted == blocking.shared_bytes(8, 48, 128, append=True, rope=True)


def test_the_engine_refuses_the_mosaic_arm_it_was_given_by_name(tiny_bf16):
    """The engine checks a Mosaic GPU arm's shapes when it is built and names the arm chosen:
    ``pallas_mgpu_packed_layer`` runs ``pallas_mgpu_packed_rope``'s kernel, whose own refusal
    cannot tell the two apart."""
    from rstarjax.serving import Engine

    _, model = tiny_bf16  # head_dim 16: 32-byte rows, no rotary embedding in the kernel
    for arm in ("pallas_mgpu_packed_layer", "pallas_mgpu_packed_rope"):
        with pytest.raises(ValueError, match=f"^decode_attention '{arm}' cannot run .*head_dim 16 "
                                             f"with the rotary embedding.*serving.decode_attention"):
            Engine(model, max_len=64, num_slots=2, page_size=16, kv_pages=8, dtype=jnp.bfloat16,
                   decode_attention=arm, interpret=True)


def test_the_mosaic_kernel_names_a_gpu_without_wgmma():
    """An A100, a Blackwell or an AMD GPU is refused in one line before Mosaic GPU compiles
    anything; a Hopper GPU and a CPU (lowering for CUDA from here) are not."""
    from types import SimpleNamespace

    from rstarjax.models.decode_kernel_mgpu import device_problem

    def gpu(capability="", version="cuda 12.9"):
        return SimpleNamespace(platform="gpu", compute_capability=capability,
                               client=SimpleNamespace(platform_version=version))
    assert "8.0" in device_problem(gpu("8.0"))
    assert "10.0" in device_problem(gpu("10.0"))
    assert "AMD" in device_problem(gpu(version="rocm 7.0.1"))
    assert device_problem(gpu("9.0")) is None
    assert device_problem(jax.devices()[0]) is None  # CPU: jax.export lowers for CUDA from here


@pytest.fixture(scope="module")
def tiny_bf16():
    """The tiny Qwen3 in bfloat16 (the kernel's pools are bf16/f16)."""
    cfg = ModelConfig.preset("tiny", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    return cfg, Qwen3(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tiny_bf16_wide():
    """The same with Qwen3's 128-dim heads (the kernel's rotary embedding needs 256-byte rows)."""
    cfg = ModelConfig.preset("tiny", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, head_dim=128)
    return cfg, Qwen3(cfg, rngs=nnx.Rngs(0))


# each switch of the kernel, with the model it runs (the plain kernel on 32-byte rows; "_layer":
# the writing kernel inside the layer of our fused GEMMs, models/decode_gemm.py)
SWITCHES = [("pallas_mgpu_packed", "tiny_bf16"), ("pallas_mgpu_packed_rope", "tiny_bf16_wide"),
            ("pallas_mgpu_packed_layer", "tiny_bf16_wide")]


@pytest.mark.parametrize("attention, model", SWITCHES)
def test_decode_through_the_mosaic_kernel_equals_reference_decode(attention, model, request):
    """The engine's paged forward (bf16 tiny model) with the kernel as its decode attention,
    through ``paged_forward``'s switch, against the same forward with the reference; with
    ``_rope``, the kernel writes the step's K/V and norms and rotates q and k itself."""
    cfg, model = request.getfixturevalue(model)
    scfg = serving_config(cfg)
    w = serving_weights(model, jnp.bfloat16)
    q, k, v, table, lengths, _ = _case(2, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, 16, 4)
    pool = lambda x: tuple(x for _ in range(cfg.num_hidden_layers))  # noqa: E731
    rows = jnp.asarray([0, 2, 4])  # lengths 1, 17, 64: the next token goes at these positions
    cache = PagedKVCache(pool(k), pool(v), table[rows], lengths[rows] - 1)
    tok = jnp.asarray([[3], [4], [5]], jnp.int32)
    ref, ref_cache = paged_forward(scfg, w, tok, cache, jnp.ones(3, jnp.int32))
    # under jit, as the engine runs it: eagerly, the ops queued behind the interpreted kernel
    # can deadlock with the interpreter's own callbacks (they dispatch jax ops too)
    forward = jax.jit(lambda w, cache: paged_forward(scfg, w, tok, cache, jnp.ones(3, jnp.int32),
                                                     decode_attention=attention, interpret=True))
    got, got_cache = forward(w, cache)
    assert float(jnp.max(jnp.abs(ref))) > 0.1
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=5e-2)
    # the first layer writes the reference's K/V bit for bit; later ones see the attention's rounding
    for layer, pools in enumerate(zip(got_cache.k + got_cache.v, ref_cache.k + ref_cache.v)):
        a, b = (np.asarray(x, np.float32) for x in pools)
        if layer % cfg.num_hidden_layers == 0:
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, b, atol=5e-2)


@pytest.mark.parametrize("attention, model", SWITCHES)
def test_the_engine_decodes_with_the_mosaic_kernel_as_with_the_reference(attention, model, request):
    """Through the engine and scheduler (idle slots, clamped table entries, 4 steps a call) on a
    pool full of junk (a read of a position nobody wrote moves the logits far): greedy tokens
    equal to the reference attention's, log-probs within bf16 rounding."""
    from model_support import poison_pool

    from rstarjax.serving import Engine
    from rstarjax.serving.completions import generate

    _, model = request.getfixturevalue(model)
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40))]
    out = {}
    for name in ("reference", attention):
        engine = Engine(model, max_len=96, num_slots=4, page_size=16, kv_pages=40, decode_steps=4,
                        dtype=jnp.bfloat16, decode_attention=name, interpret=True)
        poison_pool(engine)
        out[name] = generate(None, prompts, 20, engine=engine)
    for ref, got in zip(out["reference"], out[attention]):
        assert got.token_ids == ref.token_ids
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-2)


@pytest.mark.parametrize("head_dim, page, width, blocking, prepare", [
    # Qwen3's shapes in the engine's dtype: the q/k RMSNorm and the rotary embedding in the
    # kernel; 4 pages a block, the full row 4 blocks behind the new token's over 3 slots
    (128, 16, 16, MosaicBlocking(64, 3), "norm"),
    # the rotary embedding without the norm (Qwen2.5); 128-token blocks of 8 pages, 2 slots
    (128, 16, 16, MosaicBlocking(128, 2), "rope"),
    # the write alone, 128-byte rows of 64 dims: 8-token pages, 8 a block, 2 slots
    (64, 8, 32, MosaicBlocking(64, 2), ""),
])
def test_the_mosaic_append_kernel_equals_write_then_reference(head_dim, page, width, blocking,
                                                               prepare):
    """``pallas_mgpu_packed_rope``'s kernel: its pools are ``write_kv_pages``' of the model's
    own normed and rotated key (``rms_norm``, ``apply_rope``), bit for bit in bfloat16, at a
    page's first position (lengths 1 and page + 1), its last (a full page) and mid-page; a
    dropped write (row 3, idle) leaves the pool as it was; its output is the reference
    attention's over the written pools. Each case also lowers for CUDA."""
    q, k, v, table, lengths, _ = _case(3, 8, 2, head_dim, page, width)
    rng = np.random.default_rng(4)
    b, kh = q.shape[0], k.shape[0]
    k_new, v_new = (jnp.asarray(rng.normal(size=(b, kh, head_dim)), jnp.bfloat16) for _ in range(2))
    positions = lengths - 1
    valid = jnp.asarray([True, True, True, False, True])
    q_in, k_in, extra = q, k_new, {}
    if prepare:  # the model's own functions make the reference's q and k
        sin, cos = rope_angles(positions[:, None], head_dim, 1e6)
        norms = tuple(jnp.asarray(1 + 0.5 * rng.normal(size=head_dim), jnp.bfloat16) for _ in range(2))
        extra = dict(rope=(sin[:, 0], cos[:, 0]), qk_norm=norms if prepare == "norm" else None)
        if prepare == "norm":
            q_in, k_in = rms_norm(q_in, norms[0], 1e-6), rms_norm(k_in, norms[1], 1e-6)
        q_in, k_in = (apply_rope(x[:, None], sin, cos)[:, 0] for x in (q_in, k_in))
    k_ref, v_ref = write_kv_pages(k, v, k_in[:, None], v_new[:, None], table, positions[:, None],
                                  valid[:, None])
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = paged_attention_reference(f32(q_in)[:, None], f32(k_ref), f32(v_ref), table,
                                    positions[:, None])[:, 0]
    page_id, offset = write_targets(table, positions[:, None], valid[:, None], k.shape[1], page)
    slots = jnp.where(page_id[:, 0] < k.shape[1], page_id[:, 0] * page + offset[:, 0], -1)
    assert list(slots == -1) == [False, False, False, True, False]
    out, k_got, v_got = decode_attention_mosaic_append(q, k_new, v_new, slots, k, v, table, lengths,
                                                       blocking=blocking, interpret=True, **extra)
    np.testing.assert_array_equal(np.asarray(f32(k_got)), np.asarray(f32(k_ref)))
    np.testing.assert_array_equal(np.asarray(f32(v_got)), np.asarray(f32(v_ref)))
    at = table[3, positions[3] // page], positions[3] % page  # row 3's write: dropped
    np.testing.assert_array_equal(np.asarray(f32(k_got))[:, at[0], at[1]], np.asarray(f32(k))[:, at[0], at[1]])
    assert not np.array_equal(np.asarray(f32(k_got)), np.asarray(f32(k)))
    live = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(f32(out))[live], np.asarray(ref)[live], atol=TOLERANCE)
    text = export.export(jax.jit(lambda *a: decode_attention_mosaic_append(*a, blocking=blocking, **extra)),
                         platforms=["cuda"])(q, k_new, v_new, slots, k, v, table, lengths).mlir_module()
    assert "mosaic_gpu_v2" in text

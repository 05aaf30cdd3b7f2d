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
from rstarjax.models.decode_kernel_mgpu import MosaicBlocking, decode_attention_mosaic
from rstarjax.models.kv_cache import NO_PAGE, PagedKVCache
from rstarjax.models.paged_attention import paged_attention_reference
from rstarjax.models.qwen3 import Qwen3, paged_forward, serving_config, serving_weights


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


def test_decode_through_the_mosaic_kernel_equals_reference_decode(tiny_bf16):
    """The engine's paged forward (bf16 tiny model) with the kernel as its decode attention,
    through ``paged_forward``'s switch, against the same forward with the reference."""
    cfg, model = tiny_bf16
    scfg = serving_config(cfg)
    w = serving_weights(model, jnp.bfloat16)
    q, k, v, table, lengths, _ = _case(2, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, 16, 4)
    pool = lambda x: tuple(x for _ in range(cfg.num_hidden_layers))  # noqa: E731
    rows = jnp.asarray([0, 2, 4])  # lengths 1, 17, 64: the next token goes at these positions
    cache = PagedKVCache(pool(k), pool(v), table[rows], lengths[rows] - 1)
    tok = jnp.asarray([[3], [4], [5]], jnp.int32)
    ref, _ = paged_forward(scfg, w, tok, cache, jnp.ones(3, jnp.int32))
    got, _ = paged_forward(scfg, w, tok, cache, jnp.ones(3, jnp.int32),
                           decode_attention="pallas_mgpu_packed", interpret=True)
    assert float(jnp.max(jnp.abs(ref))) > 0.1
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=5e-2)


def test_the_engine_decodes_with_the_mosaic_kernel_as_with_the_reference(tiny_bf16):
    """Through the engine and scheduler (idle slots, clamped table entries, 4 steps a call):
    greedy tokens equal to the reference attention's, log-probs within bf16 rounding."""
    from rstarjax.serving import Engine
    from rstarjax.serving.completions import generate

    _, model = tiny_bf16
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40))]
    out = {}
    for attention in ("reference", "pallas_mgpu_packed"):
        engine = Engine(model, max_len=96, num_slots=4, page_size=16, kv_pages=40, decode_steps=4,
                        dtype=jnp.bfloat16, decode_attention=attention, interpret=True)
        out[attention] = generate(None, prompts, 20, engine=engine)
    for ref, got in zip(out["reference"], out["pallas_mgpu_packed"]):
        assert got.token_ids == ref.token_ids
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-2)

"""Paged KV attention against outside references: jax.nn.dot_product_attention over the same
keys laid out densely, the model's uncached training forward, and (for jax's shipped Pallas
kernels, run in interpret mode on CPU) the pure-JAX paged reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.models.config import ModelConfig
from rstarjax.models.kv_cache import NO_PAGE, PagedKVCache
from rstarjax.models.paged_attention import (default_decode_implementation, paged_attention_reference,
                                             paged_decode_attention, write_kv_pages)
from rstarjax.models.qwen3 import Qwen3, paged_forward, serving_config, serving_weights

TINY32 = ModelConfig.preset("tiny", dtype=jnp.float32)


def _bf16_exact(x):
    """Values a bf16 matmul reproduces exactly (the TPU interpreter multiplies in bf16)."""
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _random_paged(rng, b, kh, h, num_pages, page_size, lengths, width):
    """A pool of random pages and page tables whose rows own disjoint, shuffled pages."""
    k = _bf16_exact(rng.normal(size=(kh, num_pages, page_size, h)))
    v = _bf16_exact(rng.normal(size=(kh, num_pages, page_size, h)))
    perm = rng.permutation(num_pages)
    table = np.full((b, width), NO_PAGE, np.int32)
    used = 0
    for i, n in enumerate(lengths):
        p = -(-n // page_size)
        table[i, :p] = perm[used:used + p]
        used += p
    return k, v, table


def _dense_rows(pages, table, length):
    """[K, N, S, H] + one table row -> [length, K, H], the row's tokens in order."""
    kh, _, s, h = pages.shape
    rows = [pages[:, p] for p in table if p != NO_PAGE]
    return np.concatenate(rows, axis=1).transpose(1, 0, 2)[:length]


def test_reference_equals_dense_attention_over_the_same_tokens():
    rng = np.random.default_rng(0)
    b, t, n, kh, h, s = 3, 5, 4, 2, 16, 4
    lengths = [7, 13, 5]  # tokens of each row, the t queried ones included
    k, v, table = _random_paged(rng, b, kh, h, 16, s, lengths, 5)
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    # Queries at the last t positions of each row (causal over the row's tokens).
    positions = np.stack([np.arange(L - t, L) for L in lengths]).astype(np.int32)
    got = paged_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                    jnp.asarray(table), jnp.asarray(positions))
    for i, L in enumerate(lengths):
        keys = _dense_rows(k, table[i], L)[None]
        vals = _dense_rows(v, table[i], L)[None]
        mask = (np.arange(L)[None, :] <= positions[i][:, None])[None, None]
        ref = jax.nn.dot_product_attention(jnp.asarray(q[i:i + 1]), jnp.asarray(keys),
                                           jnp.asarray(vals), mask=jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(ref[0]), atol=2e-5)


def test_reference_query_blocks_equal_one_block(monkeypatch):
    """Long feeds are attended in query blocks (bounded logits memory): same numbers."""
    from rstarjax.models import paged_attention as pa

    rng = np.random.default_rng(1)
    k, v, table = _random_paged(rng, 2, 2, 8, 40, 4, [64, 40], 16)
    q = jnp.asarray(rng.normal(size=(2, 32, 4, 8)), jnp.float32)
    pos = jnp.asarray(np.stack([np.arange(32, 64), np.arange(8, 40)]), jnp.int32)
    one = pa.paged_attention_reference(q, k, v, table, pos)
    monkeypatch.setattr(pa, "QUERY_BLOCK", 8)
    blocked = pa.paged_attention_reference(q, k, v, table, pos)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(one), atol=1e-6)


def test_writes_of_padding_and_unpaged_positions_are_dropped():
    rng = np.random.default_rng(2)
    k = jnp.zeros((2, 6, 4, 8))
    table = jnp.asarray([[3, NO_PAGE], [1, 2]], jnp.int32)
    new = jnp.asarray(rng.normal(size=(2, 3, 2, 8)), jnp.float32)
    pos = jnp.asarray([[2, 3, 4], [5, 6, 7]], jnp.int32)  # row 0's position 4 has no page
    valid = jnp.asarray([[True, True, True], [True, True, False]])  # row 1's last: padding
    k2, _ = write_kv_pages(k, k, new, new, table, pos, valid)
    k2 = np.asarray(k2)
    np.testing.assert_array_equal(k2[:, 3, 2], np.asarray(new[0, 0]))
    np.testing.assert_array_equal(k2[:, 3, 3], np.asarray(new[0, 1]))
    np.testing.assert_array_equal(k2[:, 2, 1], np.asarray(new[1, 0]))  # pos 5 = page 2[1]
    np.testing.assert_array_equal(k2[:, 2, 2], np.asarray(new[1, 1]))
    written = np.zeros((6, 4), bool)
    written[3, 2] = written[3, 3] = written[2, 1] = written[2, 2] = True
    assert not np.abs(k2[:, ~written]).any()  # nothing else: no clamping, no page 0 writes


@pytest.fixture(scope="module")
def tiny():
    return Qwen3(TINY32, rngs=nnx.Rngs(0))


def test_paged_forward_chunked_prefill_then_steps_matches_training_forward(tiny):
    """Rows of different lengths in scattered pages: prefill in padded chunks, then token by
    token; each step's last-token logits equal the uncached forward of the row alone."""
    rng = np.random.default_rng(4)
    prompt_lens, steps, chunk, page = [5, 9, 2], 4, 4, 4
    seqs = [rng.integers(0, 512, n + steps) for n in prompt_lens]
    k, v = PagedKVCache.init_pool(TINY32, 24, page, jnp.float32)
    _, _, table = _random_paged(rng, 3, 2, 16, 24, page, [n + steps for n in prompt_lens], 4)
    cfg = serving_config(TINY32)
    w = serving_weights(tiny, jnp.float32)
    fwd = jax.jit(lambda w, c, t, n: paged_forward(cfg, w, t, c, n))
    cache = PagedKVCache(k, v, jnp.asarray(table), jnp.zeros(3, jnp.int32))
    done = [0, 0, 0]
    while any(done[r] < prompt_lens[r] for r in range(3)):
        tokens = rng.integers(0, 512, (3, chunk))  # padding is random junk on purpose
        num_new = np.zeros(3, np.int32)
        for r in range(3):
            n = min(chunk, prompt_lens[r] - done[r])
            tokens[r, :n] = seqs[r][done[r]:done[r] + n]
            num_new[r] = n
        _, cache = fwd(w, cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(num_new))
        done = [d + int(n) for d, n in zip(done, num_new)]
    got = [[] for _ in seqs]
    for s in range(steps):
        tokens = np.array([[seqs[r][prompt_lens[r] + s]] for r in range(3)], np.int32)
        logits, cache = fwd(w, cache, jnp.asarray(tokens), jnp.ones(3, jnp.int32))
        for r in range(3):
            got[r].append(np.asarray(logits[r]))
    np.testing.assert_array_equal(cache.lengths, np.array(prompt_lens) + steps)
    for r in range(3):
        ref = tiny(jnp.asarray(seqs[r][None], jnp.int32))[0, prompt_lens[r]:]
        np.testing.assert_allclose(np.stack(got[r]), np.asarray(ref), atol=2e-5)


def test_serving_weights_are_cast_once_and_unstacked(tiny):
    w = serving_weights(tiny, jnp.bfloat16)
    assert len(w.layers) == TINY32.num_hidden_layers and w.embed.dtype == jnp.bfloat16
    assert w.layers[1]["q_proj"].dtype == jnp.bfloat16
    assert w.layers[1]["input_norm"].dtype == jnp.float32  # norms stay as stored
    np.testing.assert_array_equal(np.asarray(w.layers[1]["q_proj"], np.float32),
                                  np.asarray(tiny.layers.q_proj[1].astype(jnp.bfloat16),
                                             np.float32))


# ---- the shipped Pallas kernels, in interpret mode, against the reference ------------------

def _decode_case(seed, b=3, n=32, kh=2, h=128, num_pages=40, page=16, width=8):
    rng = np.random.default_rng(seed)
    lengths = [5, 60, 128][:b]  # one partial page, several pages, a full table
    k, v, table = _random_paged(rng, b, kh, h, num_pages, page, lengths, width)
    q = _bf16_exact(rng.normal(size=(b, n, h)) * 0.3)
    ref = paged_decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                 jnp.asarray(table), jnp.asarray(lengths, jnp.int32))
    return q, k, v, table, np.asarray(lengths, np.int32), np.asarray(ref)


@pytest.mark.slow  # the Pallas interpreter: a few seconds
@pytest.mark.parametrize("blocking", [None, (8, 16, 8, 2), (2, 2, 4, 1)],
                         ids=["default", "4x8_4warps", "2x2_1stage"])
def test_pallas_gpu_paged_attention_interpreted_equals_reference(blocking, monkeypatch):
    """The engine's blocking, jax's defaults and a small one (benchmarks/serving.py
    --pallas-blocking compares them): a blocking changes how rows are cut, never what they
    attend to."""
    from rstarjax.models import paged_attention

    if blocking is not None:
        monkeypatch.setattr(paged_attention, "PALLAS_GPU_BLOCKING",
                            paged_attention.PallasGpuBlocking(*blocking))
    q, k, v, table, lengths, ref = _decode_case(0)
    got = paged_decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                 jnp.asarray(table), jnp.asarray(lengths),
                                 implementation="pallas_gpu", interpret=True)
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-5)


def test_pallas_gpu_blocking_divides_the_table():
    from rstarjax.models.paged_attention import PallasGpuBlocking

    for width in (8, 56, 288, 904):
        for blocking in (PallasGpuBlocking(), PallasGpuBlocking(8, 16, 8, 2), PallasGpuBlocking(16, 4)):
            per, splits = blocking.for_width(width)
            assert width % (per * splits) == 0
            assert per <= blocking.pages_per_block and splits <= blocking.max_k_splits
    assert PallasGpuBlocking().for_width(288) == (4, 8)  # the stage-1 main job on the H200
    assert PallasGpuBlocking(8, 16, 8, 2).for_width(288) == (8, 12)  # jax's defaults


@pytest.mark.slow  # the Mosaic interpreter: a few seconds
def test_pallas_tpu_paged_attention_interpreted_equals_reference():
    from jax.experimental.pallas import tpu as pltpu

    q, k, v, table, lengths, ref = _decode_case(1)
    q = _bf16_exact(q * 128 ** -0.5) * 128 ** 0.5  # the kernel sees q pre-scaled: keep it exact
    ref = np.asarray(paged_decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                            jnp.asarray(table), jnp.asarray(lengths)))
    with pltpu.force_tpu_interpret_mode():
        got = paged_decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                     jnp.asarray(table), jnp.asarray(lengths),
                                     implementation="pallas_tpu")
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-5)


@pytest.mark.slow  # both interpreters
@pytest.mark.parametrize("implementation, tensor", [("pallas_gpu", 2), ("pallas_gpu", 4),
                                                    ("pallas_tpu", 4)])
def test_kernels_split_over_kv_heads_equal_reference(implementation, tensor):
    """On a tensor-parallel slice each device runs the kernel on its kv heads and their query
    heads (``kv_sharding``): the result equals the unsplit reference, and stays split."""
    import contextlib

    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    q, k, v, table, lengths, _ = _decode_case(2, n=8, kh=4)
    q = _bf16_exact(q * 128 ** -0.5) * 128 ** 0.5  # exact for the TPU kernel's pre-scaling
    ref = np.asarray(paged_decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                            jnp.asarray(table), jnp.asarray(lengths)))
    pool = NamedSharding(Mesh(np.array(jax.devices()[:tensor]), ("tensor",)),
                         PartitionSpec("tensor"))
    interpreter = (pltpu.force_tpu_interpret_mode() if implementation == "pallas_tpu"
                   else contextlib.nullcontext())
    with interpreter:
        got = jax.jit(lambda *a: paged_decode_attention(
            *a, implementation=implementation, kv_sharding=pool,
            interpret=implementation == "pallas_gpu"))(
            jnp.asarray(q), jax.device_put(k, pool), jax.device_put(v, pool),
            jnp.asarray(table), jnp.asarray(lengths))
    assert got.sharding.spec == PartitionSpec(None, "tensor")
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-5)


def test_append_kernel_split_over_kv_heads_equals_unsplit():
    """On a tensor-parallel slice the writing kernels run on each device's kv heads (their
    query heads and new K/V beside them; the angles and norm weights whole): the outputs and
    the pools they write equal the unsplit call's, and stay split."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rstarjax.models.paged_attention import paged_decode_append

    q, k, v, table, lengths, _ = _decode_case(3, n=8, kh=4)
    rng = np.random.default_rng(9)
    k_new, v_new = (jnp.asarray(rng.normal(size=(len(lengths), 4, k.shape[-1])), jnp.float32)
                    for _ in range(2))
    args = (jnp.asarray(q), k_new, v_new)
    rest = (jnp.asarray(table), jnp.asarray(lengths) - 1, jnp.ones(len(lengths), bool))
    sin, cos = jnp.sin(k_new[:, 0, :64]), jnp.cos(k_new[:, 0, 64:])  # any angles will do
    prepare = dict(rope=(sin, cos), qk_norm=(1 + v_new[0, 0], 1 - v_new[1, 0]), eps=1e-6)
    pool = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("tensor",)), PartitionSpec("tensor"))
    for extra in ({}, prepare):  # the writing kernel, and the one that norms and rotates too
        ref = paged_decode_append(*args, jnp.asarray(k), jnp.asarray(v), *rest, interpret=True,
                                  **extra)
        got = jax.jit(lambda *a: paged_decode_append(*a, interpret=True, kv_sharding=pool, **extra))(
            *args, jax.device_put(k, pool), jax.device_put(v, pool), *rest)
        assert got[0].sharding.spec == PartitionSpec(None, "tensor")
        assert got[1].sharding.spec == PartitionSpec("tensor")
        for a, b in zip(got, ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.slow  # the Pallas interpreter over two layers: ~30 s a kernel
@pytest.mark.parametrize("kernel", ["pallas_gpu", "pallas_gpu_packed", "pallas_gpu_packed_append",
                                    "pallas_gpu_packed_rope", "pallas_gpu_packed_layer"])
def test_decode_through_a_gpu_kernel_equals_reference_decode(tiny, kernel):
    """The engine's whole paged forward with a GPU kernel (interpreted: jax's, or ours, or ours
    writing the K/V itself, or that also norming and rotating q and k, or that with the layer's
    projections as our fused GEMMs) as its decode attention, through ``paged_forward``'s switch (NO_PAGE
    entries, lengths as the engine passes them): the logits and the pools it returns."""
    cfg = serving_config(TINY32)
    w = serving_weights(tiny, jnp.float32)
    rng = np.random.default_rng(5)
    k, v, table = _random_paged(rng, 2, 2, 16, 16, 16, [20, 33], 4)
    k = tuple(jnp.asarray(k) for _ in range(2))
    v = tuple(jnp.asarray(v) for _ in range(2))
    cache = PagedKVCache(k, v, jnp.asarray(table), jnp.asarray([19, 32], jnp.int32))
    tok = jnp.asarray([[3], [4]], jnp.int32)
    ref, ref_cache = paged_forward(cfg, w, tok, cache, jnp.ones(2, jnp.int32))
    got, got_cache = paged_forward(cfg, w, tok, cache, jnp.ones(2, jnp.int32),
                                   decode_attention=kernel, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4)
    for a, b in zip(got_cache.k + got_cache.v, ref_cache.k + ref_cache.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_default_kernel_per_platform():
    assert default_decode_implementation("cpu") == "ragged"
    assert default_decode_implementation("cuda") == "pallas_gpu"
    assert default_decode_implementation("tpu") == "pallas_tpu"
    assert default_decode_implementation("tpu", head_dim=64) == "ragged"
    # The TPU kernel rounds K and V to bf16 inside: a float32 pool takes the exact path.
    assert default_decode_implementation("tpu", kv_dtype=jnp.float32) == "ragged"
    # jax's Triton kernel's dots are TF32 on CUDA: a float32 pool takes the portable path, whose
    # dots follow jax's matmul precision like the rest of the engine and the trainer
    assert default_decode_implementation("cuda", kv_dtype=jnp.float32) == "ragged"
    assert default_decode_implementation("cuda", page_size=48, kv_dtype=jnp.float32) == "ragged"
    # Triton's blocks are powers of two: 48- or 96-token pages, head_dim 80 or 96 take ragged
    for shape in (dict(page_size=48), dict(page_size=96), dict(head_dim=80), dict(head_dim=96)):
        assert default_decode_implementation("cuda", **shape) == "ragged", shape
    assert default_decode_implementation("rocm") == "ragged"


def test_ragged_decode_over_live_pages_equals_reference():
    """The portable decode path reads only the listed live pages (segment softmax per row)."""
    from rstarjax.models.paged_attention import ragged_decode_attention

    q, k, v, table, lengths, ref = _decode_case(2, h=16)
    ids, rows, starts = [], [], []
    for b, n in enumerate(lengths):
        pages = [p for p in table[b] if p != NO_PAGE][: -(-n // 16)]
        ids += pages
        rows += [b] * len(pages)
        starts += [16 * i for i in range(len(pages))]
    listed = len(ids)
    for chunk in (4, 3):  # several iterations of the online softmax, a partial last one
        pad = chunk * (-(-listed // chunk) + 1) - listed  # entries past the count: junk
        got = ragged_decode_attention(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(ids + [1] * pad),
            jnp.asarray(rows + [0] * pad), jnp.asarray(starts + [0] * pad), jnp.int32(listed),
            jnp.asarray(lengths), chunk=chunk)
        np.testing.assert_allclose(np.asarray(got), ref, atol=2e-5)


# ---- our packed decode kernel (models/decode_kernel.py), interpreted, against the reference --

def _packed_case(seed, n, kh=2, h=16, page=4, width=8, num_pages=40):
    """Rows of length 1, exactly one page, one past a page boundary, several pages and a full
    table; the last two rows share their first two pages (a shared prompt prefix)."""
    rng = np.random.default_rng(seed)
    lengths = [1, page, page + 1, 3 * page + 2, page * width]
    k, v, table = _random_paged(rng, len(lengths), kh, h, num_pages, page, lengths, width)
    table[4, :2] = table[3, :2]
    # Entries past a row's live pages are valid ids of other rows' pages (the engine's table
    # holds NO_PAGE there, clamped to 0): the kernel must mask them, not read them as its own.
    table = np.where(table == NO_PAGE, table[4, -1], table)
    q = rng.normal(size=(len(lengths), n, h)).astype(np.float32)
    ref = paged_attention_reference(jnp.asarray(q)[:, None], jnp.asarray(k), jnp.asarray(v),
                                    jnp.asarray(table),
                                    jnp.asarray(lengths, jnp.int32)[:, None] - 1)[:, 0]
    return q, k, v, table, np.asarray(lengths, np.int32), np.asarray(ref)


@pytest.mark.parametrize("n, blocking", [(4, (4, 8, 1 << 20)), (4, (2, 8, 1)), (8, (1, 3, 1 << 20)),
                                         (4, (4, 8, 1 << 20, 4, 3, 1)), (8, (2, 8, 1, 4, 3, 1)),
                                         (10, (4, 8, 1 << 20)), (10, (2, 8, 1))],
                         ids=["g2_4pages_splits", "g2_2pages_one_split", "g4_1page_3splits",
                              "g2_tensor_cores_splits", "g4_tensor_cores_one_split",
                              "g5_padded_splits", "g5_padded_one_split"])
def test_packed_decode_kernel_interpreted_equals_reference(n, blocking):
    """All query heads of a kv head in one block (GQA 2 and 4; 5, as Qwen3-14B, padded to 8
    rows); several pages per iteration or one; split-K over the live pages (short rows leave
    later splits empty) or one split normalised in the kernel; CUDA-core products or tensor-core
    dots (heads padded to 16 rows): each exactly the reference's attention."""
    from rstarjax.models.decode_kernel import PackedBlocking, decode_attention_packed

    q, k, v, table, lengths, ref = _packed_case(7, n)
    got = decode_attention_packed(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                  jnp.asarray(table), jnp.asarray(lengths),
                                  blocking=PackedBlocking(*blocking), interpret=True)
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-6)


@pytest.mark.parametrize("n, blocking, prepare", [
    (4, (4, 8, 1 << 20), ""), (4, (2, 8, 1), ""), (8, (1, 3, 1 << 20), ""),
    (4, (4, 8, 1 << 20, 4, 3, 1), ""), (4, (4, 8, 1 << 20), "norm"), (8, (2, 8, 1), "norm"),
    (4, (4, 8, 1 << 20, 4, 3, 1), "norm"), (4, (2, 8, 1 << 20), "rope"), (10, (2, 8, 1 << 20), "norm")],
    ids=["g2_4pages_splits", "g2_2pages_one_split", "g4_1page_3splits", "g2_tensor_cores_splits",
         "rope_norm_g2_splits", "rope_norm_g4_one_split", "rope_norm_tensor_cores", "rope_only",
         "rope_norm_g5_padded"])
def test_append_kernel_interpreted_equals_write_then_reference(n, blocking, prepare):
    """The kernel that writes the step's K/V itself (``pallas_gpu_packed_append``): its output
    is the reference attention after ``write_kv_pages`` of the same token, and its pools are
    that write's, bit for bit: rows whose token is a page's first (lengths 1 and page + 1), its
    last (a full page), mid-page; a dropped write (an idle row) leaves the pool as it was.
    ``prepare`` (``pallas_gpu_packed_rope``): q and k arrive unnormed and unrotated and the
    kernel applies the model's ``rms_norm`` (or not) and ``apply_rope`` itself."""
    from rstarjax.models import decode_kernel
    from rstarjax.models.decode_kernel import PackedBlocking
    from rstarjax.models.paged_attention import paged_decode_append
    from rstarjax.models.qwen3 import apply_rope, rms_norm, rope_angles

    q, k, v, table, lengths, _ = _packed_case(7, n)
    rng = np.random.default_rng(8)
    b, kh, h = len(lengths), k.shape[0], k.shape[-1]
    k_new, v_new = (_bf16_exact(rng.normal(size=(b, kh, h))) for _ in range(2))
    positions = lengths - 1
    valid = np.array([True, True, True, False, True])  # row 3: idle, its write dropped
    q_in, k_in, extra = jnp.asarray(q), jnp.asarray(k_new), {}
    if prepare:  # the model's own functions make the reference's q and k
        sin, cos = rope_angles(jnp.asarray(positions)[:, None], h, 10_000.0)
        norms = tuple(jnp.asarray(1 + 0.5 * rng.normal(size=h), jnp.float32) for _ in range(2))
        extra = dict(rope=(sin[:, 0], cos[:, 0]), qk_norm=norms if prepare == "norm" else None,
                     eps=1e-6)
        if prepare == "norm":
            q_in, k_in = rms_norm(q_in, norms[0], 1e-6), rms_norm(k_in, norms[1], 1e-6)
        q_in, k_in = (apply_rope(x[:, None], sin, cos)[:, 0] for x in (q_in, k_in))
    k_ref, v_ref = write_kv_pages(jnp.asarray(k), jnp.asarray(v), k_in[:, None],
                                  jnp.asarray(v_new)[:, None], jnp.asarray(table),
                                  jnp.asarray(positions)[:, None], jnp.asarray(valid)[:, None])
    ref = paged_attention_reference(q_in[:, None], k_ref, v_ref, jnp.asarray(table),
                                    jnp.asarray(positions)[:, None])[:, 0]
    real = decode_kernel.PACKED_BLOCKING
    decode_kernel.PACKED_BLOCKING = PackedBlocking(*blocking)
    try:
        out, k_got, v_got = paged_decode_append(
            jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(k), jnp.asarray(v),
            jnp.asarray(table), jnp.asarray(positions), jnp.asarray(valid), interpret=True, **extra)
    finally:
        decode_kernel.PACKED_BLOCKING = real
    # float32: the norm's mean summed in another order, so the written keys within 1e-6
    np.testing.assert_allclose(np.asarray(k_got), np.asarray(k_ref), atol=1e-6 if prepare else 0)
    np.testing.assert_array_equal(np.asarray(v_got), np.asarray(v_ref))
    assert not np.array_equal(np.asarray(k_got), k)  # the valid rows' writes happened
    page, offset = table[3, positions[3] // k.shape[2]], positions[3] % k.shape[2]
    np.testing.assert_array_equal(np.asarray(k_got)[:, page, offset], k[:, page, offset])  # row 3's: not
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=2e-6)


def test_rope_kernel_in_bfloat16_writes_the_model_s_keys():
    """In bfloat16 (the engine's dtype on a GPU) the kernel rounds where ``rms_norm`` and
    ``apply_rope`` round: the keys it writes are the model's, bit for bit, and its output is the
    reference's within the output's rounding."""
    from rstarjax.models.paged_attention import paged_decode_append
    from rstarjax.models.qwen3 import apply_rope, rms_norm, rope_angles

    q, k, v, table, lengths, _ = _packed_case(3, 4)
    rng = np.random.default_rng(4)
    bf = jnp.bfloat16
    b, kh, h = len(lengths), k.shape[0], k.shape[-1]
    q, k, v = (jnp.asarray(x, bf) for x in (q, k, v))
    k_new, v_new = (jnp.asarray(rng.normal(size=(b, kh, h)), bf) for _ in range(2))
    norms = tuple(jnp.asarray(1 + 0.5 * rng.normal(size=h), bf) for _ in range(2))
    positions = jnp.asarray(lengths - 1)
    sin, cos = rope_angles(positions[:, None], h, 1e6)
    q_in, k_in = (apply_rope(rms_norm(x[:, None], w, 1e-6), sin, cos)[:, 0]
                  for x, w in zip((q, k_new), norms))
    valid = jnp.ones(b, bool)
    k_ref, v_ref = write_kv_pages(k, v, k_in[:, None], v_new[:, None], jnp.asarray(table),
                                  positions[:, None], valid[:, None])
    ref = paged_attention_reference(q_in[:, None], k_ref, v_ref, jnp.asarray(table),
                                    positions[:, None])[:, 0]
    out, k_got, _ = paged_decode_append(q, k_new, v_new, k, v, jnp.asarray(table), positions, valid,
                                        interpret=True, rope=(sin[:, 0], cos[:, 0]),
                                        qk_norm=norms, eps=1e-6)
    np.testing.assert_array_equal(np.asarray(k_got, np.float32), np.asarray(k_ref, np.float32))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=1.6e-2)


def test_packed_blocking_splits_follow_the_batch():
    """One split where rows x kv heads fill the GPU (no combine), more for small batches; the
    pages per block always divide the table."""
    from rstarjax.models.decode_kernel import PackedBlocking

    blocking = PackedBlocking()
    assert blocking.for_shape(256, 8, 288) == (4, 1)
    assert blocking.for_shape(64, 8, 288) == (4, 2)
    assert blocking.for_shape(32, 8, 288) == (4, 4)
    assert blocking.for_shape(1, 8, 288) == (4, 8)
    assert blocking.for_shape(4, 8, 6) == (3, 2)  # at most width / pages per block splits
    # larger pages: fewer a block (at most MAX_BLOCK_TOKENS tokens an iteration)
    assert blocking.for_shape(256, 8, 72, page_size=64) == (2, 1)
    assert PackedBlocking(pages_per_block=8).for_shape(256, 8, 288, page_size=16) == (8, 1)
    assert PackedBlocking(pages_per_block=8).for_shape(256, 8, 36, page_size=128) == (1, 1)
    # a float32 pool's tokens are twice the bytes: half as many a block (the same shared memory)
    assert blocking.for_shape(256, 8, 144, page_size=32) == (4, 1)
    assert blocking.for_shape(256, 8, 144, page_size=32, itemsize=4) == (2, 1)



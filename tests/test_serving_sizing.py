"""KV sizing: the stage configs start for Qwen3-1.7B and 8B shapes on one 80 GB GPU (checked on
CPU: weights from ``jax.eval_shape``, pages from ``plan_kv``, the function the engine calls with
the device's free memory); a pool that cannot hold one rollout is refused with the numbers and
the flag that fixes it; the page allocator's counts."""
import os
import sys

import jax.numpy as jnp
import pytest
from flax import nnx

from rstarjax.models.config import ModelConfig
from rstarjax.models.kv_cache import kv_bytes_per_token
from rstarjax.models.qwen3 import Qwen3
from rstarjax.recipes.config import as_flags
from rstarjax.serving import Engine, PagePool, ServingConfig, plan_kv
from rstarjax.serving import placement as engine_mod  # where the engine reads free memory
from rstarjax.serving.sizing import serving_weight_bytes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "configs"))
import stage1  # noqa: E402
import stage2  # noqa: E402
import stage3  # noqa: E402

GPU_BYTES = 80 * 10**9  # one 80 GB H100 / A100


def engine_options(config) -> dict:
    """The engine options the RL recipe gives a config's rollouts (its rl and serving sections)."""
    max_len = int(config.rl.max_prompt_len) + int(config.rl.max_response_len)
    return ServingConfig(**dict(config.serving)).engine_options(max_len)


def _plan(config, cfg, total_bytes=GPU_BYTES):
    opts = engine_options(config)
    dtype = jnp.dtype(opts["dtype"] or cfg.dtype)
    weights = serving_weight_bytes(cfg, dtype)
    plan = plan_kv(cfg, max_len=opts["max_len"], page_size=opts["page_size"],
                   kv_pages=opts["kv_pages"], kv_memory_fraction=opts["kv_memory_fraction"],
                   num_slots=opts["num_slots"], dtype=dtype, free_bytes=total_bytes - weights)
    return plan, weights, opts


@pytest.mark.parametrize("preset", ["qwen3-1.7b", "qwen3-8b"])
@pytest.mark.parametrize("stage", [stage1, stage2, stage3], ids=["stage1", "stage2", "stage3"])
def test_stage_configs_start_on_one_80gb_gpu(stage, preset):
    config = stage.get_config()
    cfg = ModelConfig.preset(preset, dtype=jnp.dtype(config.model.dtype))
    plan, weights, opts = _plan(config, cfg)
    # bf16 serving copy of the weights, from the abstract model: 2 bytes per parameter (the
    # counts are checked against the model cards in test_model.py), norms in f32.
    assert weights == pytest.approx(2 * cfg.num_params, rel=1e-3)
    assert GPU_BYTES - weights - plan.kv_bytes >= 5e9  # left for the programs' activations
    # Many rollouts of the maximum length fit at once, and every slot has pages to start.
    assert plan.max_length_rollouts >= 16
    assert plan.num_slots == 256 and plan.num_pages >= plan.num_slots
    # The dense per-slot cache this replaces (64 slots x max_len) does not fit next to the
    # weights with the same headroom.
    dense = 64 * opts["max_len"] * kv_bytes_per_token(cfg, jnp.bfloat16)
    assert weights + dense > 0.9 * GPU_BYTES


def test_the_arithmetic_behind_the_plan():
    cfg = ModelConfig.preset("qwen3-8b")
    # 36 layers x 8 kv heads x 128 x (k, v) x 2 bytes.
    assert kv_bytes_per_token(cfg, jnp.bfloat16) == 36 * 8 * 128 * 2 * 2 == 147_456
    plan = plan_kv(cfg, max_len=2048 + 12288, page_size=16, dtype=jnp.bfloat16,
                   free_bytes=60 * 10**9, kv_memory_fraction=0.5)
    assert plan.num_pages == int(0.5 * 60e9 // (147_456 * 16))
    assert plan.pages_per_rollout == 14336 // 16
    assert plan.source == "memory"


def test_a_pool_that_cannot_hold_one_rollout_is_refused_with_numbers_and_flags():
    cfg = ModelConfig.preset("qwen3-8b")
    config = stage2.get_config()
    with pytest.raises(ValueError) as e:  # a 24 GB card: 16.4 GB of weights leave too little
        _plan(config, cfg, total_bytes=int(18.5e9))
    msg = as_flags(str(e.value))  # the settings it names, as the recipes print them
    for part in ("14336 tokens", "896 pages", "--config.serving.kv_pages",
                 "--config.serving.kv_memory_fraction", "--config.rl.max_response_len"):
        assert part in msg


def test_a_given_page_count_too_small_is_refused_naming_only_the_settings_that_help():
    """With serving.kv_pages given the pool is that many pages whatever kv_memory_fraction says:
    the refusal asks for more pages or shorter rollouts, not a larger fraction."""
    cfg = ModelConfig.preset("qwen3-1.7b")
    with pytest.raises(ValueError) as e:
        plan_kv(cfg, max_len=10240, kv_pages=639)  # one rollout needs 640 pages of 16 tokens
    msg = as_flags(str(e.value))
    assert "--config.serving.kv_pages=640 or more" in msg and "--config.rl.max_response_len" in msg
    assert "kv_memory_fraction" not in msg
    assert plan_kv(cfg, max_len=10240, kv_pages=640).num_pages == 640


def test_engine_sizes_its_pool_from_the_free_device_memory(monkeypatch):
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    per_page = kv_bytes_per_token(cfg, jnp.float32) * 8
    monkeypatch.setattr(engine_mod, "free_device_bytes", lambda device=None: 100 * per_page)
    eng = Engine(model, max_len=64, page_size=8, kv_memory_fraction=0.5)
    assert (eng.num_pages, eng.plan.source, eng.num_slots) == (50, "memory", 50)
    monkeypatch.setattr(engine_mod, "free_device_bytes", lambda device=None: 10 * per_page)
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        Engine(model, max_len=64, page_size=8, kv_memory_fraction=0.5)  # 5 pages < 8
    eng = Engine(model, max_len=64, page_size=8, kv_pages=9)  # explicit pages win
    assert (eng.num_pages, eng.plan.source) == (9, "kv_pages")


def test_page_pool_counts_shares_and_forgets_freed_prefixes():
    pool = PagePool(6, page_size=4)
    a = pool.alloc(3)
    assert pool.num_free == 3 and sorted(a) == [0, 1, 2]
    prompt = list(range(10))  # 2 full pages + 2 tokens
    pool.register_prefix(prompt, a, version=0)
    assert pool.lookup_prefix(prompt[:8] + [99], version=0) == tuple(a[:2])  # same full pages
    assert pool.lookup_prefix([99] + prompt, version=0) == ()  # a different full-page part
    assert pool.lookup_prefix(prompt[:9], version=0) == tuple(a[:2])
    pool.share(a[:2])
    pool.release(a)
    assert pool.num_free == 4 and pool.lookup_prefix(prompt, version=0) == tuple(a[:2])  # still held
    pool.release(a[:2])
    assert pool.num_free == 6 and pool.lookup_prefix(prompt, version=0) == ()  # freed: forgotten
    with pytest.raises(ValueError):
        pool.release([a[0]])
    with pytest.raises(RuntimeError):
        pool.alloc(7)


def test_page_pool_offers_prefix_pages_only_of_the_weights_they_were_written_with():
    pool = PagePool(8, page_size=4)
    prompt = list(range(9))  # 2 full pages + 1 token
    old = pool.alloc(3)
    pool.register_prefix(prompt, old, version=0)
    assert pool.lookup_prefix(prompt, version=1) == ()  # written under older weights
    new = pool.alloc(3)
    pool.register_prefix(prompt, new, version=1)
    assert pool.lookup_prefix(prompt, version=1) == tuple(new[:2])
    assert pool.lookup_prefix(prompt, version=0) == tuple(old[:2])  # each its own pages
    pool.release(old)  # the old weights' pages go; the new ones stay registered
    assert pool.lookup_prefix(prompt, version=0) == ()
    assert pool.lookup_prefix(prompt, version=1) == tuple(new[:2])
    with pytest.raises(ValueError, match="not allocated"):
        pool.register_prefix([7] * 8, old[:2], version=1)  # freed pages hold nothing
    with pytest.raises(ValueError, match="cannot hold"):
        pool.register_prefix([7] * 8, new[:1], version=1)
    with pytest.raises(TypeError):
        pool.lookup_prefix(prompt)  # the version is not optional

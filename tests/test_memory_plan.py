"""The colocated memory plan (serving.sizing.plan_memory / choose_colocated) against hand
arithmetic on the tiny preset, and against what a GPU measured at Qwen3-1.7B."""
import pytest

from rstarjax.models.config import ModelConfig
from rstarjax.recipes.config import as_flags
from rstarjax.serving.sizing import GB, choose_colocated, lora_trained_params, plan_memory

TINY = ModelConfig.preset("tiny")
# tiny: hidden 64, MLP 128, 4 query heads and 2 kv heads of 16, 2 layers, 512 tied tokens:
# per layer q 64*64 + k, v 2*64*32 + o 64*64 + MLP 3*64*128 + norms 2*64 + 2*16 = 37,024;
# 2 layers + embedding 512*64 + final norm 64
TINY_PARAMS = 2 * 37_024 + 512 * 64 + 64  # 106,880


def test_tiny_parameter_count_is_the_hand_count():
    assert TINY.num_params == TINY_PARAMS


def test_full_fine_tuning_plan_is_the_hand_arithmetic():
    p = plan_memory(TINY, rows=4, seq_len=32, micro_batch=2, remat_policy="full", kv_pool_bytes=10_000)
    assert p.params == 4 * TINY_PARAMS == 427_520  # float32 master weights
    assert p.optimizer == 8 * TINY_PARAMS  # AdamW's two float32 moments
    assert p.grads == 2 * 4 * TINY_PARAMS  # 2 micro-steps of 2 rows: the accumulator and one micro's
    assert p.activations == int(22.1 * 2 * 64 * 2 * 32)  # bytes x layers x hidden x micro rows x tokens
    assert p.serving == 2 * TINY_PARAMS  # the bf16 serving copy
    assert p.rollout_peak == 427_520 + 855_040 + 213_760 + 10_000
    assert p.update_peak == 427_520 + 855_040 + 855_040 + 181_043 + 213_760 + 10_000
    assert p.peak == p.update_peak
    # freed during the update: the update holds no serving copy and no pool
    r = plan_memory(TINY, rows=4, seq_len=32, micro_batch=4, remat_policy="full", kv_pool_bytes=10_000,
                    release_during_update=True)
    assert r.grads == 4 * TINY_PARAMS  # one micro-step: no accumulator
    assert r.update_peak == 427_520 + 855_040 + 427_520 + int(22.1 * 2 * 64 * 4 * 32)


def test_lora_plan_is_the_hand_arithmetic():
    # rank 4 on q, k, v, o, gate, up, down: r x (in + out) = 4 x (128 + 96 + 96 + 128 + 3 * 192) per layer
    adapters = 2 * 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    assert lora_trained_params(TINY, 4) == adapters == 8_192
    p = plan_memory(TINY, rows=2, seq_len=16, remat_policy="attention", lora_rank=4)
    assert p.params == 4 * adapters + 2 * TINY_PARAMS  # float32 adapters + the bf16 base
    assert p.optimizer == 8 * adapters and p.grads == 4 * adapters
    assert p.activations == int(26.4 * 2 * 64 * 2 * 16)


def test_choose_colocated_takes_the_fastest_policy_that_fits_then_the_largest_micro_batch():
    # tiny at 32 tokens: a rollout's KV is 2 pages x 16 tokens x 256 bytes = 8,192 bytes; a page 4,096
    state_serving = 4 * TINY_PARAMS + 8 * TINY_PARAMS + 2 * TINY_PARAMS
    grads = lambda micro: 4 * TINY_PARAMS * (2 if micro < 4 else 1)  # accumulating below 4 rows
    act = lambda policy_bytes, micro: int(policy_bytes * 2 * 64 * micro * 32)
    need = lambda policy_bytes, micro: state_serving + grads(micro) + act(policy_bytes, micro)
    # room beside 8 rollouts of KV for attention (26.4) at one row, not for dots_attention (44.0)
    device = int((need(26.4, 1) + 8 * 8192 + 100) / 0.95) + 1
    usable = int(device * 0.95)
    assert all(need(44.0, m) + 8 * 8192 > usable for m in (1, 2, 4))
    c = choose_colocated(TINY, rows=4, seq_len=32, device_bytes=device, min_pool_rollouts=8)
    # attention at 4 rows (one micro-step: no accumulator) needs less than at one row
    assert need(26.4, 4) < need(26.4, 1)
    assert not c.problems and (c.remat_policy, c.micro_batch) == ("attention", 4)
    assert c.kv_pages == (usable - need(26.4, 4)) // 4096
    assert c.plan.update_peak <= usable and c.plan.kv_pool == c.kv_pages * 4096
    # the engine's pool: kv_memory_fraction of what the state and the serving copy leave
    assert int(c.kv_memory_fraction * (device - state_serving)) // 4096 == c.kv_pages
    # a device too small for one row of the slowest policy: refused, naming the flags
    small = choose_colocated(TINY, rows=4, seq_len=32, device_bytes=state_serving)
    problem = as_flags(small.problems[0])  # the settings it names, as the recipes print them
    assert small.problems and "--config.trainer.micro_batch_size" in problem
    assert "--config.serving.release_during_update=True" in problem
    assert "--config.model.lora_rank" in problem


def test_the_plan_matches_what_the_gpu_measured_at_qwen3_1_7b():
    cfg = ModelConfig.preset("qwen3-1.7b")
    # the checkpoint of the H200 run held 20.6 GB: float32 weights and AdamW's two moments
    p = plan_memory(cfg, rows=16, seq_len=4608, micro_batch=8, remat_policy="full",
                    kv_pool_bytes=int(17e9))
    assert p.state / GB == pytest.approx(20.6, abs=0.1)
    # the H200 main job (docs/launch.md, 2026-11-26): 16 trained rows of 4,608 tokens in 2 micro-steps
    # of 8, a 17 GB pool, remat full: 100.7 GB at peak
    assert p.peak / GB == pytest.approx(100.7, rel=0.05)
    # full fine-tuning of 8B holds 16 bytes per parameter for the update: more than an 80 GB card
    assert plan_memory(ModelConfig.preset("qwen3-8b"), rows=1, seq_len=1).update_peak > 80 * GB


def test_the_start_check_refuses_an_update_that_does_not_fit_naming_the_flags():
    from rstarjax.serving.sizing import update_room_problems
    # tiny, 4 rows of 32 tokens in one micro-step, remat full: gradients 4 x 106,880 bytes,
    # activations 22.1 x 2 x 64 x 4 x 32, the serving copy 2 x 106,880, one rollout's KV 8,192
    need = 4 * TINY_PARAMS + int(22.1 * 2 * 64 * 4 * 32) + 2 * TINY_PARAMS + 8192
    kw = dict(rows=4, seq_len=32, micro_batch=4, remat_policy="full")
    assert update_room_problems(TINY, free_bytes=int(need / 0.95) + 1, **kw) == []
    [problem] = update_room_problems(TINY, free_bytes=int(need / 0.95) - 100, **kw)
    problem = as_flags(problem)  # the settings it names, as the recipes print them
    assert "--config.trainer.micro_batch_size, now 4" in problem
    assert "--config.serving.release_during_update=True" in problem and "--config.model.lora_rank=16" in problem
    # freed during the update: only the gradients and the activations count
    assert update_room_problems(TINY, free_bytes=int(need / 0.95) - 100, release_during_update=True, **kw) == []
    assert update_room_problems(TINY, free_bytes=None, **kw) == []  # CPU: no statistics, no check


def test_the_rl_stage_runs_the_start_check_on_one_device(monkeypatch):
    from types import SimpleNamespace

    from rstarjax.recipes import rl
    from rstarjax.serving import sizing
    from rstarjax.validation import ConfigError
    run = SimpleNamespace(
        rl=SimpleNamespace(prompts_per_step=2, group_size=2, max_prompt_len=16, max_response_len=16),
        trainer=SimpleNamespace(mini_batches=1, micro_batch_size=0),
        serving=SimpleNamespace(placement="colocated", trainer_processes=1, rollout_devices=0,
                                release_during_update=False, page_size=16))
    model = SimpleNamespace(config=TINY.replace(remat_policy="full"))
    monkeypatch.setattr(rl.jax, "device_count", lambda: 1)  # the tests run on 8 simulated devices
    monkeypatch.setattr(sizing, "free_device_bytes", lambda device=None: 10_000)  # a device that is full
    with pytest.raises(ConfigError, match="--config.serving.release_during_update=True"):
        rl.check_update_room(run, model)
    monkeypatch.setattr(sizing, "free_device_bytes", lambda device=None: 10**9)
    rl.check_update_room(run, model)  # room enough: nothing raised

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
    def run_with(kv_memory_fraction=None):
        return SimpleNamespace(
            rl=SimpleNamespace(prompts_per_step=2, group_size=2, max_prompt_len=16, max_response_len=16),
            trainer=SimpleNamespace(mini_batches=1, micro_batch_size=0), model=SimpleNamespace(lora_rank=0),
            loss=SimpleNamespace(kl_coef=0.0),
            serving=SimpleNamespace(placement="colocated", trainer_processes=1, rollout_devices=0,
                                    release_during_update=False, page_size=16, dtype=None,
                                    kv_memory_fraction=kv_memory_fraction, kv_pages=0))
    model = SimpleNamespace(config=TINY.replace(remat_policy="full"))
    monkeypatch.setattr(rl.jax, "device_count", lambda: 1)  # the tests run on 8 simulated devices
    monkeypatch.setattr(sizing, "free_device_bytes", lambda device=None: 10_000)  # a device that is full
    with pytest.raises(ConfigError, match="--config.serving.release_during_update=True"):
        rl.check_update_room(run_with(), model)
    monkeypatch.setattr(sizing, "free_device_bytes", lambda device=None: 10**9)
    rl.check_update_room(run_with(), model)  # room enough: nothing raised
    # the pool the run gives is what the engine takes: all but 0.1 % of the free memory
    with pytest.raises(ConfigError, match="--config.serving.kv_memory_fraction, now 0.999"):
        rl.check_update_room(run_with(kv_memory_fraction=0.999), model)


def test_the_start_check_counts_the_pool_the_run_gives_naming_its_flag():
    """A run that gives its pool (``serving.kv_pages``, or ``serving.kv_memory_fraction`` of what
    the serving copy leaves) is checked beside that pool, not beside one rollout's KV."""
    from rstarjax.serving.sizing import update_room_problems
    # tiny, 4 rows of 32 tokens in one micro-step, remat full; a page is 16 tokens x 256 bytes
    update = 4 * TINY_PARAMS + int(22.1 * 2 * 64 * 4 * 32) + 2 * TINY_PARAMS  # gradients, activations, serving
    kw = dict(rows=4, seq_len=32, micro_batch=4, remat_policy="full")
    free = int((update + 8192) / 0.95) + 1  # room for one rollout's KV (2 pages), not much more
    assert update_room_problems(TINY, free_bytes=free, **kw) == []
    assert update_room_problems(TINY, free_bytes=free, kv_pages=2, **kw) == []
    [problem] = update_room_problems(TINY, free_bytes=free, kv_pages=40, **kw)  # 40 x 4,096 bytes beside it
    assert f"it needs {(update + 40 * 4096) / GB:.1f} GB" in problem
    assert "--config.serving.kv_pages, now 40" in as_flags(problem)
    # a share: the engine takes floor(fraction x (free - serving copy) / page) pages
    [problem] = update_room_problems(TINY, free_bytes=free, kv_memory_fraction=0.9, **kw)
    pool = int(0.9 * (free - 2 * TINY_PARAMS) // 4096) * 4096
    assert f"it needs {(update + pool) / GB:.1f} GB" in problem and "a 0.0 GB KV pool" in problem
    assert "--config.serving.kv_memory_fraction, now 0.9" in as_flags(problem)
    # freed during the update, the pool is not beside it
    assert update_room_problems(TINY, free_bytes=free, kv_pages=40, release_during_update=True, **kw) == []


def test_the_start_check_refuses_issue_45s_shape_with_the_engines_default_share():
    """Qwen3-1.7B, 16 rows of 9,216 tokens, micro-batch 2, kv_memory_fraction 0.9 on an 80 GB H100:
    60.6 GB free once the weights and moments are in place; the engine takes 0.9 of the 57.2 GB the
    serving copy leaves (51.4 GB), leaving 5.7 GB for an update of 37.1 GB."""
    from rstarjax.serving.sizing import update_room_problems
    cfg = ModelConfig.preset("qwen3-1.7b", remat_policy="full")
    free = int(81.25e9) - 12 * cfg.num_params
    kw = dict(rows=16, seq_len=9216, micro_batch=2, free_bytes=free)
    [problem] = update_room_problems(cfg, kv_memory_fraction=0.9, **kw)
    assert "a 51.4 GB KV pool" in problem and "--config.serving.kv_memory_fraction, now 0.9" in as_flags(problem)
    [problem] = update_room_problems(cfg, kv_pages=28_000, **dict(kw, micro_batch=1))
    assert "--config.serving.kv_pages, now 28000" in as_flags(problem)


def test_the_kl_reference_is_a_float32_copy_of_what_trains():
    """loss.kl_coef > 0: rl/trainer.py keeps ``ref_params``, a copy of the params it trains (float32;
    with LoRA the adapters only): the plan counts the same bytes in the trainer's state."""
    import jax
    from flax import nnx

    from rstarjax.models import lora
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.models.qwen3 import Qwen3
    from rstarjax.rl import optim as optim_lib
    from rstarjax.rl import trainer as trainer_lib
    from rstarjax.rl.loss import LossConfig
    mesh = sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])

    def reference_bytes(model):
        t = trainer_lib.Trainer(model, optim_lib.OptimConfig(), LossConfig(kl_coef=0.001),
                                trainer_lib.TrainerConfig(), mesh=mesh)
        return sum(x.nbytes for x in jax.tree.leaves(t.ref_params))

    full = plan_memory(TINY, rows=2, seq_len=16, kl_reference=True)
    assert full.reference == 4 * TINY_PARAMS == reference_bytes(Qwen3(TINY, rngs=nnx.Rngs(0)))
    assert full.state == 16 * TINY_PARAMS  # weights, moments, reference
    assert plan_memory(TINY, rows=2, seq_len=16).reference == 0  # no KL term: no copy
    adapters = plan_memory(TINY, rows=2, seq_len=16, lora_rank=4, kl_reference=True).reference
    assert adapters == 4 * lora_trained_params(TINY, 4) == reference_bytes(
        lora.attach(Qwen3(TINY, rngs=nnx.Rngs(0)), 4, 8.0, mesh=mesh))


def test_the_kl_term_is_named_when_its_reference_is_what_breaks_the_fit():
    from rstarjax.serving.sizing import update_room_problems
    # the start check's free memory already lacks the reference: fits with 4 x N more, not without
    update = 4 * TINY_PARAMS + int(22.1 * 2 * 64 * 4 * 32) + 2 * TINY_PARAMS + 8192
    kw = dict(rows=4, seq_len=32, micro_batch=4, remat_policy="full", kl_reference=True)
    [problem] = update_room_problems(TINY, free_bytes=int(update / 0.95) - 100, **kw)
    assert "--config.loss.kl_coef=0" in as_flags(problem)
    [problem] = update_room_problems(TINY, free_bytes=int(update / 0.95) - 5 * TINY_PARAMS, **kw)
    assert "kl_coef" not in problem  # dropping the copy would not make room
    # the plan: a device one row fits without the reference only
    # all 4 rows at once: weights and moments, gradients, serving copy, activations, 8 rollouts' KV
    need = 12 * TINY_PARAMS + 4 * TINY_PARAMS + 2 * TINY_PARAMS + int(22.1 * 2 * 64 * 4 * 32) + 8 * 8192
    device = int((need + 2 * TINY_PARAMS) / 0.95)  # room for half the reference
    assert not choose_colocated(TINY, rows=4, seq_len=32, device_bytes=device, remat_policies=("full",)).problems
    refused = choose_colocated(TINY, rows=4, seq_len=32, device_bytes=device, remat_policies=("full",),
                               kl_reference=True)
    assert refused.problems and "--config.loss.kl_coef=0" in as_flags(refused.problems[0])


def test_the_serving_copy_and_the_pool_are_in_the_serving_dtype():
    """The engine serves in serving.dtype, else the model's compute dtype (Engine: ``dtype or
    model.config.dtype``): float32 is 4 bytes a weight and a KV value, not bf16's 2."""
    import jax.numpy as jnp

    from rstarjax.serving.sizing import update_room_problems
    assert plan_memory(TINY, rows=2, seq_len=16).serving == 2 * TINY_PARAMS
    assert plan_memory(TINY, rows=2, seq_len=16, serving_dtype="float32").serving == 4 * TINY_PARAMS
    f32 = TINY.replace(dtype=jnp.float32)  # model.dtype=float32: serves in float32 unless told
    assert plan_memory(f32, rows=2, seq_len=16).serving == 4 * TINY_PARAMS
    assert plan_memory(f32, rows=2, seq_len=16, serving_dtype="bfloat16").serving == 2 * TINY_PARAMS
    # activations were measured computing in bf16: float32's are taken twice as wide (predicted)
    assert plan_memory(f32, rows=2, seq_len=16, remat_policy="full").activations == int(22.1 * 2 * 64 * 2 * 16 * 2)
    # the start check: a float32 serving copy (4 x N) and rollout (2 pages x 16 x 512 bytes)
    kw = dict(rows=4, seq_len=32, micro_batch=4, remat_policy="full")
    bf16 = 4 * TINY_PARAMS + int(22.1 * 2 * 64 * 4 * 32) + 2 * TINY_PARAMS + 8192
    assert update_room_problems(TINY, free_bytes=int(bf16 / 0.95) + 1, **kw) == []
    [problem] = update_room_problems(TINY, free_bytes=int(bf16 / 0.95) + 1, serving_dtype="float32", **kw)
    assert f"it needs {(bf16 + 2 * TINY_PARAMS + 8192) / GB:.1f} GB" in problem
    # the plan's pool is counted in float32 pages: the fraction it returns gives the engine that pool
    device = 10**7
    c = choose_colocated(TINY, rows=4, seq_len=32, device_bytes=device, serving_dtype="float32")
    state_serving = 12 * TINY_PARAMS + 4 * TINY_PARAMS
    assert c.plan.kv_pool == c.kv_pages * 8192  # 16 tokens x 512 bytes a page
    assert int(c.kv_memory_fraction * (device - state_serving)) // 8192 == c.kv_pages


# ---- docs/launch.md's "Memory plan" table and README's memory sentence: what rstarjax.main plans ----
ONE_GPU_PROMPTS = 16  # docs/launch.md "One GPU": configs/stage1.py with --config.rl.prompts_per_step=16
DEVICES = (("H100 80 GB", int(81.25e9)), ("H200 141 GB", int(142.6e9)))  # bytes_limit at mem fraction 0.95


def one_gpu_stage1_plan(preset: str, device_bytes: int, lora_rank: int = 0, release: bool = False,
                        max_response_len: int | None = None):
    """``size_colocated`` as ``recipes/build.sized_by_memory_plan`` runs it for docs/launch.md's one-GPU
    stage-1 command with every size left open: the config's rows, row length, page size and remat."""
    import os
    import sys

    from rstarjax.models.kv_cache import pages_for
    from rstarjax.serving.sizing import REMAT_BY_SPEED, size_colocated
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
    import stage1
    c = stage1.get_config()
    seq_len = c.rl.max_prompt_len + (max_response_len or c.rl.max_response_len)
    cfg = ModelConfig.preset(preset, remat_policy=c.model.remat_policy)
    choice = size_colocated(cfg, rows=ONE_GPU_PROMPTS * c.rl.group_size // c.trainer.mini_batches, seq_len=seq_len,
                            device_bytes=device_bytes, page_size=c.serving.page_size, lora_rank=lora_rank,
                            release_during_update=release, remat_policies=REMAT_BY_SPEED,
                            rollouts=ONE_GPU_PROMPTS * c.rl.oversample)
    return choice, choice.kv_pages // pages_for(seq_len, c.serving.page_size)


def memory_plan_table_row(preset: str, device_name: str, device_bytes: int, lora_rank: int, release: bool) -> str:
    """One row of docs/launch.md's table, from the plan."""
    import re
    choice, rollouts = one_gpu_stage1_plan(preset, device_bytes, lora_rank, release)
    p = choice.plan
    cells = ["Qwen3-" + preset.split("-")[1].upper(), f"{device_name} ({device_bytes / GB:.1f} GB)",
             f"LoRA r={lora_rank}" if lora_rank else "full", "yes" if release else "no",
             f"{p.state / GB:.1f}", f"{p.grads / GB:.1f}", f"{p.serving / GB:.1f}"]
    if choice.problems:
        need = re.search(r"needs ([\d.]+) GB", choice.problems[0]).group(1)
        cells += [f"**does not fit**: {need} GB at one row, `{choice.remat_policy}`", "-", "-"]
    else:
        cells += [f"`{choice.remat_policy}`, {choice.micro_batch}", f"{p.activations / GB:.1f}",
                  f"{p.kv_pool / GB:.1f} GB ({rollouts})"]
    return "| " + " | ".join(cells) + " |"


def _doc(path):
    import os
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("preset", ["qwen3-1.7b", "qwen3-8b", "qwen3-14b"])
def test_the_launch_docs_memory_plan_table_is_what_main_plans(preset):
    """Each row of docs/launch.md's table is recomputed from the plan rstarjax.main runs
    (``size_colocated`` with the recipe's settings), so the doc cannot drift from the code."""
    launch = _doc("docs/launch.md")
    for device_name, device_bytes in DEVICES:
        for lora_rank in (0, 16):
            for release in (False, True):
                row = memory_plan_table_row(preset, device_name, device_bytes, lora_rank, release)
                assert row in launch, f"docs/launch.md's memory plan table lacks (or differs from) {row}"


def test_the_memory_figures_quoted_in_the_prose_are_the_plans():
    from rstarjax.recipes.build import PLANNED_KEYS
    from rstarjax.serving.sizing import describe_choice
    launch, readme = _doc("docs/launch.md"), _doc("README.md")
    (_, h100), (_, h200) = DEVICES
    on_h100, held = one_gpu_stage1_plan("qwen3-1.7b", h100)
    on_h200, _ = one_gpu_stage1_plan("qwen3-1.7b", h200)
    # the start line rstarjax.main prints for the one-GPU command on an H100, every size planned
    assert "rstarjax: " + describe_choice(on_h100, device_bytes=h100, planned=PLANNED_KEYS) in launch
    sentence = (f"`{on_h100.remat_policy}`, a micro-batch of {on_h100.micro_batch} and a "
                f"{on_h100.plan.kv_pool / GB:.1f} GB pool on an 80 GB H100, `{on_h200.remat_policy}`, "
                f"{on_h200.micro_batch} and {on_h200.plan.kv_pool / GB:.1f} GB on an H200")
    assert sentence in " ".join(readme.split())
    _, held_long = one_gpu_stage1_plan("qwen3-1.7b", h100, max_response_len=12288)
    assert f"{held} at L = 10,240 and {held_long} at L = 14,336" in " ".join(launch.split())

"""One GPU, colocated: the micro-batch and the KV pool's share the command line leaves open come from
the memory plan (serving.sizing.size_colocated, recipes/build.sized_by_memory_plan), the ones it
sets are kept, and a shape that cannot fit stops the start naming the flag (issue 45)."""
import json
import os
import sys

import pytest

from rstarjax.models.config import ModelConfig
from rstarjax.recipes.config import as_flags
from rstarjax.serving import sizing
from rstarjax.serving.sizing import plan_memory, plan_kv, size_colocated

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN17 = ModelConfig.preset("qwen3-1.7b", remat_policy="full")
H100 = int(81.25e9)  # an 80 GB H100's bytes_limit at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
ROWS, SEQ = 16, 1024 + 8192  # issue 45's shape: 2 prompts x G = 8 rows of 1K + 8K tokens
KV_TOKEN = 2 * 28 * 8 * 128 * 2  # K and V x layers x kv heads x head_dim x bf16 bytes


def update_with_pool(micro: int, pool_bytes: float) -> float:
    """What the update step holds beside a pool of ``pool_bytes`` at ``micro`` rows per micro-step."""
    return plan_memory(QWEN17, rows=ROWS, seq_len=SEQ, micro_batch=micro).update_peak + pool_bytes


def test_left_open_the_micro_batch_is_the_largest_that_fits_and_the_pool_gets_the_rest():
    c = size_colocated(QWEN17, rows=ROWS, seq_len=SEQ, device_bytes=H100)
    assert not c.problems and c.remat_policy == "full"  # the run's policy is kept
    usable, eight = 0.95 * H100, 8 * SEQ * KV_TOKEN
    assert update_with_pool(c.micro_batch, eight) <= usable  # fits beside 8 full-length rollouts
    bigger = [m for m in (2 * c.micro_batch, 4 * c.micro_batch) if ROWS % m == 0]
    assert bigger and update_with_pool(bigger[0], eight) > usable  # the next one up does not
    # the engine sizes its pool as the fraction of what the trainer's state and its serving copy
    # leave: the same pages the plan counted
    state_and_serving = 14 * QWEN17.num_params  # float32 weights (4) + 2 moments (8) + the bf16 copy (2)
    engine = plan_kv(QWEN17, max_len=SEQ, kv_memory_fraction=c.kv_memory_fraction,
                     free_bytes=H100 - state_and_serving)
    assert engine.num_pages == c.kv_pages
    assert update_with_pool(c.micro_batch, c.kv_pages * 16 * KV_TOKEN) <= usable


def test_a_given_pool_share_gets_the_largest_micro_batch_that_fits_beside_it():
    state_and_serving = 14 * QWEN17.num_params
    for fraction in (0.1, 0.3):
        c = size_colocated(QWEN17, rows=ROWS, seq_len=SEQ, device_bytes=H100, kv_memory_fraction=fraction)
        pool = fraction * (H100 - state_and_serving)
        assert not c.problems and c.kv_memory_fraction == fraction
        assert update_with_pool(c.micro_batch, pool) <= 0.95 * H100
        assert c.micro_batch == ROWS or update_with_pool(2 * c.micro_batch, pool) > 0.95 * H100
    assert size_colocated(QWEN17, rows=ROWS, seq_len=SEQ, device_bytes=H100, kv_memory_fraction=0.1).micro_batch \
        > size_colocated(QWEN17, rows=ROWS, seq_len=SEQ, device_bytes=H100, kv_memory_fraction=0.3).micro_batch


def test_given_sizes_that_cannot_fit_are_refused_naming_the_flag():
    # today's defaults on one GPU: 0.9 of the free memory for the pool starves the update
    c = size_colocated(QWEN17, rows=ROWS, seq_len=SEQ, device_bytes=H100, kv_memory_fraction=0.9)
    assert c.problems and "--config.serving.kv_memory_fraction=0.9" in as_flags(c.problems[0])
    c = size_colocated(QWEN17, rows=ROWS, seq_len=SEQ, device_bytes=H100, micro_batch=16)
    assert c.problems and "--config.trainer.micro_batch_size=16" in as_flags(c.problems[0])
    c = size_colocated(QWEN17, rows=ROWS, seq_len=SEQ, device_bytes=H100, micro_batch=1)
    assert not c.problems and c.micro_batch == 1  # a given micro-batch that fits is kept


def test_the_plan_takes_the_fastest_remat_policy_that_costs_the_rollouts_no_pool():
    """Left open, the remat policy is the fastest (dots_attention, attention, full: the update's MFU
    on an H200) whose KV pool holds as many maximum-length rollouts as full's, or all of a step's:
    on an H100 at issue 45's shape dots_attention with one row a micro-step holds the 15 rollouts
    that full with two does; for an 8B LoRA at 9K tokens, attention (the faster policy that fits)
    would hold 5 where full holds 9, so full; at 3K tokens, where full holds more than the step's
    32, attention holds them all too, and dots_attention fits none beside 8."""
    def held(c, seq):
        return c.kv_pages // (seq // 16)

    def planned(cfg, seq, lora):
        return size_colocated(cfg, rows=ROWS, seq_len=seq, device_bytes=H100, lora_rank=lora,
                              remat_policies=sizing.REMAT_BY_SPEED, rollouts=32)

    def fixed(cfg, seq, lora, remat):
        return size_colocated(cfg, rows=ROWS, seq_len=seq, device_bytes=H100, lora_rank=lora, remat_policy=remat)

    c = planned(QWEN17, SEQ, 0)
    assert (c.remat_policy, c.micro_batch) == ("dots_attention", 1)
    full = fixed(QWEN17, SEQ, 0, "full")
    assert full.micro_batch == 2 and held(c, SEQ) >= held(full, SEQ) == 15
    # the same pool arithmetic as the plan's: one row of dots_attention beside 15 rollouts fits
    assert update_with_pool(1, 15 * SEQ * KV_TOKEN) - plan_memory(QWEN17, rows=ROWS, seq_len=SEQ, micro_batch=1).activations \
        + plan_memory(QWEN17, rows=ROWS, seq_len=SEQ, micro_batch=1, remat_policy="dots_attention").activations <= 0.95 * H100

    q8 = ModelConfig.preset("qwen3-8b", remat_policy="full")
    c = planned(q8, SEQ, 16)
    assert c.remat_policy == "full" and held(fixed(q8, SEQ, 16, "attention"), SEQ) == 5 and held(c, SEQ) == 9
    c = planned(q8, 3072, 16)
    assert c.remat_policy == "attention" and held(c, 3072) >= 32 and held(fixed(q8, 3072, 16, "full"), 3072) > 32
    assert held(fixed(q8, 3072, 16, "dots_attention"), 3072) < 32


def _stage1_run(tmp_path, explicit=frozenset(), **overrides):
    """configs/stage1.py at issue 45's shape, parsed as rstarjax.main does (configs/base.py's 64-row
    micro-batch does not divide its 16 rows: left open for the plan unless ``explicit``)."""
    sys.path.insert(0, os.path.join(ROOT, "configs"))
    import stage1

    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse
    from rstarjax.validation import ConfigError
    data = tmp_path / "problems.jsonl"
    data.write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    c = stage1.get_config()
    c.model.random_init, c.model.preset = True, "qwen3-1.7b"
    c.data.train_path = str(data)
    c.rl.prompts_per_step, c.rl.oversample, c.rl.group_size, c.rl.max_prompt_len = 2, 16, 8, 1024
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        c[section][key] = value
    try:
        return parse(c, explicit=explicit)
    except ConfigError as e:
        return build.parse_sizes_open(c, explicit, e)


def test_a_one_gpu_rl_run_takes_what_the_command_line_leaves_open_from_the_plan(tmp_path, monkeypatch, capsys):
    from rstarjax.recipes import build
    from rstarjax.validation import ConfigError
    monkeypatch.setattr(build.jax, "device_count", lambda: 1)  # the tests run on 8 simulated devices
    monkeypatch.setattr(sizing, "device_bytes_limit", lambda device=None: H100)
    run = _stage1_run(tmp_path)
    assert (run.trainer.micro_batch_size, run.serving.kv_memory_fraction) == (0, 0.9)  # opened; configs/base.py
    planned = build.sized_by_memory_plan(run)
    want = size_colocated(QWEN17, rows=ROWS, seq_len=SEQ, device_bytes=H100, remat_policies=sizing.REMAT_BY_SPEED,
                          rollouts=32)
    assert planned.model.remat_policy == want.remat_policy == "dots_attention"  # configs: full
    assert planned.trainer.micro_batch_size == want.micro_batch
    assert planned.serving.kv_memory_fraction == pytest.approx(want.kv_memory_fraction, abs=1e-6)
    line = capsys.readouterr().out.strip()
    assert line.count("\n") == 0 and line.startswith("rstarjax: memory plan")
    assert f"trainer.micro_batch_size={want.micro_batch} (plan)" in line
    assert "model.remat_policy=dots_attention (plan)" in line
    assert f"predicted peak {want.plan.peak / 1e9:.1f} GB" in line

    # a value the command line gave is kept, the other planned beside it
    run = _stage1_run(tmp_path, {"trainer.micro_batch_size"}, **{"trainer.micro_batch_size": 1})
    planned = build.sized_by_memory_plan(run, explicit={"trainer.micro_batch_size"})
    assert planned.trainer.micro_batch_size == 1 and planned.serving.kv_memory_fraction != 0.9
    assert "trainer.micro_batch_size=1 (given)" in capsys.readouterr().out
    # a remat policy the command line gave is kept
    run = _stage1_run(tmp_path, {"model.remat_policy"}, **{"model.remat_policy": "full"})
    planned = build.sized_by_memory_plan(run, explicit={"model.remat_policy"})
    assert planned.model.remat_policy == "full" and planned.trainer.micro_batch_size == 2
    assert "model.remat_policy=full (given)" in capsys.readouterr().out
    # all three given: kept as they are (the start check judges them); both sizes given, the
    # fastest policy that fits beside them, and when none does, the start check judges them too
    both = {"trainer.micro_batch_size", "serving.kv_memory_fraction"}
    given = _stage1_run(tmp_path, both | {"model.remat_policy"}, **{"trainer.micro_batch_size": 1,
                                                                   "serving.kv_memory_fraction": 0.1})
    assert build.sized_by_memory_plan(given, explicit=both | {"model.remat_policy"}) is given
    assert build.sized_by_memory_plan(given, explicit=both).model.remat_policy == "dots_attention"
    assert "model.remat_policy=dots_attention (plan)" in capsys.readouterr().out
    given = _stage1_run(tmp_path, both, **{"trainer.micro_batch_size": 2, "serving.kv_memory_fraction": 0.9})
    with pytest.raises(ConfigError, match=r"--config\.serving\.kv_memory_fraction, now 0\.9"):
        build.sized_by_memory_plan(given, explicit=both)  # no policy fits beside its 51.4 GB pool
    # a given share that leaves the update no room: refused at the start, naming the flag
    with pytest.raises(ConfigError, match=r"--config\.serving\.kv_memory_fraction=0\.9"):
        build.sized_by_memory_plan(_stage1_run(tmp_path), explicit={"serving.kv_memory_fraction"})
    # CPU (no memory statistics) and several devices: the config's sizes, nothing printed
    monkeypatch.setattr(sizing, "device_bytes_limit", lambda device=None: None)
    assert build.sized_by_memory_plan(run) is run
    monkeypatch.setattr(sizing, "device_bytes_limit", lambda device=None: H100)
    monkeypatch.setattr(build.jax, "device_count", lambda: 2)
    assert build.sized_by_memory_plan(run) is run
    assert capsys.readouterr().out == ""


def test_rows_the_config_files_micro_batch_does_not_divide_are_sized_by_the_plan_on_one_gpu(tmp_path, monkeypatch):
    """configs/base.py's 64-row micro-batch does not divide 2 prompts x G = 8 rows: on one GPU the plan
    sets it (the first parse's error is not raised); on CPU that error stays the answer."""
    from rstarjax import main
    from rstarjax.recipes import build
    from rstarjax.validation import ConfigError
    sys.path.insert(0, os.path.join(ROOT, "configs"))
    import stage1
    data = tmp_path / "problems.jsonl"
    data.write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    c = stage1.get_config()
    c.model.random_init, c.model.preset, c.data.train_path = True, "qwen3-1.7b", str(data)
    c.rl.prompts_per_step, c.rl.oversample, c.rl.group_size, c.rl.max_prompt_len = 2, 16, 8, 1024
    c.lock()  # as the flag hands it over
    ran = []
    monkeypatch.setitem(main.RECIPES, "rl", lambda run, workdir: ran.append(run))
    with pytest.raises(ConfigError, match=r"micro_batch_size=64 must divide the mini-batch of 16 rows"):
        main.run(c, str(tmp_path / "w"))  # CPU: no memory statistics
    monkeypatch.setattr(main.jax, "device_count", lambda: 1)
    monkeypatch.setattr(build.jax, "device_count", lambda: 1)
    monkeypatch.setattr(sizing, "device_bytes_limit", lambda device=None: H100)
    main.run(c, str(tmp_path / "w"))
    want = size_colocated(QWEN17, rows=ROWS, seq_len=SEQ, device_bytes=H100, remat_policies=sizing.REMAT_BY_SPEED,
                          rollouts=32)
    assert (ran[0].model.remat_policy, ran[0].trainer.micro_batch_size) == (want.remat_policy, want.micro_batch)
    with pytest.raises(ConfigError, match=r"micro_batch_size=64 must divide"):  # given: judged as given
        main.run(c, str(tmp_path / "w"), explicit={"trainer.micro_batch_size"})


def test_given_sizes_the_plan_keeps_are_checked_beside_the_runs_own_pool(tmp_path, monkeypatch):
    """All three sizes given (or both sizes, with no remat policy fitting beside them): the run is
    kept as given, and judged now by the start check's arithmetic with the pool the engine will
    take, not one rollout's: issue 45's shape with 0.9 of the free memory (51.4 GB) or 28,000 pages
    (51.4 GB) leaves 5.7 GB for an update of 37.1 (25.4 at one row) GB: refused naming the flag."""
    from rstarjax.recipes import build
    from rstarjax.validation import ConfigError
    monkeypatch.setattr(build.jax, "device_count", lambda: 1)
    monkeypatch.setattr(sizing, "device_bytes_limit", lambda device=None: H100)
    both = {"trainer.micro_batch_size", "serving.kv_memory_fraction"}
    for explicit in (both, both | {"model.remat_policy"}):
        run = _stage1_run(tmp_path, explicit, **{"trainer.micro_batch_size": 2, "serving.kv_memory_fraction": 0.9})
        with pytest.raises(ConfigError, match=r"a 51\.4 GB KV pool.*--config\.serving\.kv_memory_fraction, now 0\.9"):
            build.sized_by_memory_plan(run, explicit=explicit)
    pages = {"trainer.micro_batch_size", "serving.kv_pages", "model.remat_policy"}
    run = _stage1_run(tmp_path, pages, **{"trainer.micro_batch_size": 1, "serving.kv_pages": 28_000})
    with pytest.raises(ConfigError, match=r"--config\.serving\.kv_pages, now 28000"):
        build.sized_by_memory_plan(run, explicit=pages)
    run = _stage1_run(tmp_path, pages, **{"trainer.micro_batch_size": 1, "serving.kv_pages": 5_000})
    assert build.sized_by_memory_plan(run, explicit=pages) is run  # 9.2 GB of pages: room to spare
    given = _stage1_run(tmp_path, both | {"model.remat_policy"}, **{"trainer.micro_batch_size": 1,
                                                                   "serving.kv_memory_fraction": 0.1})
    assert build.sized_by_memory_plan(given, explicit=both | {"model.remat_policy"}) is given


@pytest.mark.parametrize("overrides", [{"loss.kl_coef": 0.001}, {"serving.dtype": "float32"},
                                       {"model.dtype": "float32"}], ids=["kl", "serving-f32", "model-f32"])
def test_the_engines_pool_at_the_planned_share_leaves_the_update_its_room(tmp_path, monkeypatch, overrides):
    """What the trainer and the engine really hold: the KL term's float32 reference copy
    (loss.kl_coef > 0: 4 bytes per trained parameter), and a serving copy and KV pages in the
    serving dtype (serving.dtype, else model.dtype). The planned share of the memory they leave
    gives a pool beside which the planned update still fits the device less its 5 % margin."""
    import jax.numpy as jnp

    from rstarjax.recipes import build
    from rstarjax.serving.sizing import serving_weight_bytes
    monkeypatch.setattr(build.jax, "device_count", lambda: 1)
    monkeypatch.setattr(sizing, "device_bytes_limit", lambda device=None: H100)
    run = build.sized_by_memory_plan(_stage1_run(tmp_path, **overrides))
    cfg = build.model_config(run.model)
    assert cfg.dtype == jnp.dtype(run.model.dtype)
    dtype = jnp.dtype(run.serving.dtype or run.model.dtype)
    trainer_state = (16 if run.loss.kl_coef > 0 else 12) * cfg.num_params  # weights, moments (, reference)
    free_at_engine = H100 - trainer_state - serving_weight_bytes(cfg, dtype)
    pool = plan_kv(cfg, max_len=SEQ, kv_memory_fraction=run.serving.kv_memory_fraction,
                   free_bytes=free_at_engine, dtype=dtype)
    update = plan_memory(cfg, rows=ROWS, seq_len=SEQ, micro_batch=run.trainer.micro_batch_size,
                         remat_policy=run.model.remat_policy)
    assert update.grads + update.activations + 0.05 * H100 <= free_at_engine - pool.kv_bytes


def test_a_given_share_the_kl_reference_pushes_past_the_device_names_loss_kl_coef():
    """1.7B at issue 45's shape, one row, 0.45 of the free memory for the pool: fits, but not beside
    the KL term's 6.9 GB reference copy; at 0.6 dropping the copy would not help, so it is not named."""
    kw = dict(rows=ROWS, seq_len=SEQ, device_bytes=H100, micro_batch=1, kv_memory_fraction=0.45)
    assert not size_colocated(QWEN17, **kw).problems
    c = size_colocated(QWEN17, **kw, kl_reference=True)
    assert c.problems and "--config.loss.kl_coef=0" in as_flags(c.problems[0])
    assert c.plan.reference == 4 * QWEN17.num_params
    c = size_colocated(QWEN17, **dict(kw, kv_memory_fraction=0.6), kl_reference=True)
    assert c.problems and "kl_coef" not in c.problems[0]

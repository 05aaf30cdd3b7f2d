"""Configs: presets carry the paper's numbers; bad configs fail at start with a fix-it message."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))

import base  # noqa: E402
import stage1  # noqa: E402
import stage2  # noqa: E402
import stage3  # noqa: E402

from rstarjax.recipes.config import parse  # noqa: E402
from rstarjax.validation import ConfigError  # noqa: E402


def good_config(tmp_path, mod=stage1, arg=None):
    c = mod.get_config(arg)
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    c.data.train_path = str(data)
    c.model.random_init = True
    c.model.preset = "tiny"
    return c


def test_presets_follow_the_paper():
    s1, s2, s3 = stage1.get_config(), stage2.get_config(), stage3.get_config()
    # §4.3: 512 prompts x 2G=32 -> G=16, lr 1e-6; 8K -> 12K -> 12K; 300 + 85 + 125 = 510 steps
    assert (s1.rl.prompts_per_step, s1.rl.oversample, s1.rl.group_size) == (512, 32, 16)
    assert s1.optim.learning_rate == s2.optim.learning_rate == s3.optim.learning_rate == 1e-6
    assert (s1.rl.max_response_len, s2.rl.max_response_len, s3.rl.max_response_len) == (8192, 12288, 12288)
    assert (s1.rl.max_turns, s2.rl.max_turns, s3.rl.max_turns) == (10, 10, 15)
    assert (s1.total_steps, s2.total_steps, s3.total_steps) == (300, 385, 510)
    # Clip-Higher, no KL, no entropy (§2.2.1); stage 3 resets the optimizer (§4.3)
    assert (s1.loss.eps_low, s1.loss.eps_high, s1.loss.kl_coef, s1.loss.entropy_coef) == (0.2, 0.28, 0.0, 0.0)
    assert s3.checkpoint.reset_optimizer and not s1.checkpoint.reset_optimizer
    assert s3.filter.k == 8 and stage3.get_config("filter").mode == "filter"
    assert base.get_config().mode == "rl"
    # every loss field is one LossConfig knows (the run's loss section is parsed into it)
    from rstarjax.rl.loss import LossConfig
    LossConfig(**dict(s1.loss))


def test_valid_config_passes(tmp_path):
    parse(good_config(tmp_path), num_devices=8)


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c.rl, "oversample", 24), "oversample=24 must be 2 \\* group_size = 32"),
    (lambda c: setattr(c.model, "random_init", False), "model.hf_path is empty"),
    (lambda c: setattr(c.data, "train_path", "/nonexistent/x.jsonl"), "train_path='/nonexistent/x.jsonl' does not exist"),
    (lambda c: (setattr(c.mesh, "fsdp", 3)), "does not fit the 8 devices"),
    (lambda c: setattr(c.trainer, "micro_batch_size", 100), "micro_batch_size=100 must divide"),
    (lambda c: (setattr(c.trainer, "micro_batch_size", 4), setattr(c.mesh, "data", 8), setattr(c.mesh, "fsdp", 1)),
     "multiple of data\\*fsdp=8"),
    (lambda c: setattr(c.rl, "max_turns", 0), "max_turns=0 must be >= 1"),
    (lambda c: setattr(c.checkpoint, "init_from", "/nope"), "init_from='/nope' is not a directory"),
    (lambda c: setattr(c, "mode", "dance"), "mode='dance' is unknown"),
    (lambda c: (setattr(c.loss, "decoupled_cap", 5.0), setattr(c.trainer, "recompute_old_logprobs", False)),
     "decoupled_cap=5.0 needs --config.trainer.recompute_old_logprobs=True"),
    (lambda c: setattr(c.distributed, "silence_s", 3.0), "silence_s=3.0 must be >= 10"),
])
def test_inconsistent_values_fail_with_a_fix(tmp_path, change, message):
    c = good_config(tmp_path)
    change(c)
    with pytest.raises(ConfigError, match=message):
        parse(c, num_devices=8)


@pytest.mark.parametrize("tp, slices, num_processes, message", [
    (16, 1, 1, "serving.tensor_parallel=16 exceeds the 8 devices of each process"),
    (4, 3, 1, "serving.slices_per_host=3 slices of tensor_parallel=4 devices need 12"),
    (8, 1, 2, "serving.tensor_parallel=8 exceeds the 4 devices of each process"),
    (0, 2, 1, "slices_per_host=2 needs tensor_parallel >= 1"),
    (-1, 1, 1, "tensor_parallel=-1 must be >= 0"),
])
def test_serving_slices_must_fit_the_host(tmp_path, tp, slices, num_processes, message):
    c = good_config(tmp_path)
    c.serving.tensor_parallel, c.serving.slices_per_host = tp, slices
    with pytest.raises(ConfigError, match=message):
        parse(c, num_devices=8, num_processes=num_processes)


def test_serving_slices_that_fit(tmp_path):
    c = good_config(tmp_path)
    c.serving.tensor_parallel, c.serving.slices_per_host = 4, 0
    run = parse(c, num_devices=8)
    assert (run.serving.tensor_parallel, run.serving.slices_per_host) == (4, 0)
    c.serving.slices_per_host = 2
    parse(c, num_devices=8)


def test_all_errors_reported_together(tmp_path):
    c = good_config(tmp_path)
    c.rl.oversample = 3
    c.rl.max_turns = 0
    with pytest.raises(ConfigError) as e:
        parse(c, num_devices=8)
    assert "oversample=3" in str(e.value) and "max_turns=0" in str(e.value)


def test_stage3_needs_a_stage2_checkpoint(tmp_path):
    c = good_config(tmp_path, stage3)
    with pytest.raises(ConfigError, match="need --config.checkpoint.init_from"):
        parse(c, num_devices=8)
    c.checkpoint.init_from = str(tmp_path)
    parse(c, num_devices=8)


def _main(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "rstarjax.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_command_line_rejects_unknown_keys_and_bad_values(tmp_path):
    """The real entry point: a typo in an override and a missing data path both exit non-zero
    with a message naming the key, before any model is built."""
    r = _main("--config=configs/stage2.py", f"--workdir={tmp_path}", "--config.rl.max_turn=10")
    assert r.returncode != 0 and "max_turn" in r.stderr
    r = _main("--config=configs/stage2.py", f"--workdir={tmp_path}", "--config.rl.max_turns=12")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--config.model.hf_path is empty" in r.stderr and "--config.data.train_path is empty" in r.stderr


def test_moved_keys_name_their_replacement(tmp_path):
    """Boolean options that became named choices (or moved section) fail with the new flag."""
    r = _main("--config=configs/stage1.py", f"--workdir={tmp_path}", "--config.loss.dr_grpo=True")
    assert r.returncode == 2 and "--config.loss.advantage_estimator=dr_grpo" in r.stderr, r.stderr[-2000:]
    c = good_config(tmp_path)
    c.loss.gspo = True  # a config built in code, with the old key
    with pytest.raises(ConfigError, match="--config.loss.gspo was replaced: use --config.loss.policy_loss=gspo"):
        parse(c)


def test_sft_and_eval_modes_name_their_missing_inputs():
    import eval as eval_config  # configs/eval.py
    import sft

    with pytest.raises(ConfigError, match="--config.sft.data_path is empty"):
        parse(sft.get_config())
    with pytest.raises(ConfigError, match="--config.eval.paths is empty"):
        parse(eval_config.get_config())
    c = eval_config.get_config()
    c.eval.paths = "/nonexistent/aime24.jsonl"
    with pytest.raises(ConfigError, match="aime24.jsonl' does not exist"):
        parse(c)


def test_loss_options_are_settable_and_kl_dynamic_sampling_validated(tmp_path):
    c = good_config(tmp_path)
    c.loss.advantage_estimator = "dr_grpo"
    c.loss.dual_clip_c = 3.0
    c.rl.roc_variant = "topk"
    parse(c)  # every LossConfig option has a config key
    from rstarjax.rl.loss import LossConfig

    assert LossConfig(**dict(c.loss)).advantage_estimator == "dr_grpo"
    # the KL term and DAPO dynamic sampling are wired into the RL loop: accepted
    c.loss.kl_coef = 0.1
    c.rl.dynamic_sampling = True
    parse(c)
    assert parse(c).rl.dynamic_sampling_max_rounds == 3
    c.rl.dynamic_sampling_max_rounds = 0
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds=0 must be an integer >= 1"):
        parse(c)
    c.rl.dynamic_sampling_max_rounds = 1
    c.loss.kl_coef = -0.1
    with pytest.raises(ConfigError, match="kl_coef and entropy_coef must be >= 0"):
        parse(c)


def test_tool_pool_filter_and_baseline_options(tmp_path):
    c = good_config(tmp_path)
    assert c.rl.num_tool_workers == 0 and c.rl.reject_equal_reward  # host-sized pool; §4.3 filter on
    c.rl.num_tool_workers = -1
    with pytest.raises(ConfigError, match="num_tool_workers=-1 must be an integer >= 0"):
        parse(c)
    c = good_config(tmp_path)
    c.rl.roc = False  # the GRPO baseline samples group_size rollouts: oversample is not consulted
    c.rl.oversample = 3
    parse(c)
    c = good_config(tmp_path)
    c.rl.roc_variant = "topk"
    c.rl.group_size, c.rl.oversample = 3, 6
    with pytest.raises(ConfigError, match="roc_min_negatives \\+ roc_min_positives = 4"):
        parse(c)
    c.rl.chat_format = "fancy"
    with pytest.raises(ConfigError, match="chat_format='fancy'"):
        parse(c)


def test_profile_rstar2_official(tmp_path):
    """--config.profile=rstar2_official (issue #27): the official code's settings everywhere they
    apply; the paper's stay the default; a key given on the command line keeps its value."""
    import eval as eval_preset

    paper = parse(good_config(tmp_path))
    assert (paper.profile, paper.rl.chat_format, paper.reward.mode, paper.loss.dual_clip_c,
            paper.loss.token_mean, paper.rl.roc_penalty) == ("paper", "rstar2", "answer", None, "batch", "paper")
    c = good_config(tmp_path)
    c.profile = "rstar2_official"
    run = parse(c)
    assert (run.rl.chat_format, run.reward.mode, run.rl.roc_variant, run.rl.roc_penalty, run.rl.max_turns,
            run.rl.max_tool_response_chars, run.loss.dual_clip_c, run.loss.token_mean) == (
        "rstar2_official", "official", "topk", "official_text", 5, 256, 3.0, "micro_batch")
    assert run.agent().reward_mode == "official"
    c.rl.max_turns = 7
    assert parse(c, explicit={"rl.max_turns"}).rl.max_turns == 7  # the command line wins
    c.profile = "nope"
    with pytest.raises(ConfigError, match="profile"):
        parse(c)
    # configs/eval.py with the profile: examples/aime_eval.sh's sampling, lengths and turns
    e = eval_preset.get_config()
    e.profile = "rstar2_official"
    e.model.random_init, e.model.preset = True, "tiny"
    e.eval.paths = str(tmp_path / "train.jsonl")
    ev = parse(e).eval
    assert (ev.chat_format, ev.temperature, ev.top_p, ev.k, ev.max_turns, ev.max_prompt_len, ev.max_response_len) == (
        "rstar2_official", 0.0, 1.0, 16, 5, 2048, 30720)
    assert parse(e).eval_agent().reward_mode == "official" and parse(e).eval_agent().max_turns == 5
    c = good_config(tmp_path)
    c.reward.mode = "whole"
    with pytest.raises(ConfigError, match="--config.reward.mode"):
        parse(c)


@pytest.mark.parametrize("placement, rollout_devices, fsdp, num_devices, message", [
    ("disaggregated", 0, -1, 8, "placement='disaggregated' needs rollout_devices >= 1"),
    ("colocated", 2, -1, 8, "placement='disaggregated' needs rollout_devices >= 1"),
    ("spread", 0, -1, 8, "placement"),
    ("disaggregated", 8, -1, 8, "rollout_devices=8 must leave the trainer some of the 8 devices"),
    ("disaggregated", 2, 8, 8, "does not fit the 6 devices the rollout slices leave"),
])
def test_disaggregated_placement_must_leave_the_trainer_its_devices(tmp_path, placement, rollout_devices, fsdp,
                                                                    num_devices, message):
    c = good_config(tmp_path)
    c.serving.placement, c.serving.rollout_devices, c.mesh.fsdp = placement, rollout_devices, fsdp
    with pytest.raises(ConfigError, match=message):
        parse(c, num_devices=num_devices)


@pytest.mark.parametrize("processes, rollout_devices, tensor_parallel", [(3, 2, 0), (2, 2, 0), (2, 4, 2)])
def test_disaggregated_placement_across_processes_rolls_out_on_whole_processes(
        tmp_path, processes, rollout_devices, tensor_parallel):
    c = good_config(tmp_path)
    c.serving.placement, c.serving.rollout_devices, c.mesh.fsdp = "disaggregated", rollout_devices, -1
    c.serving.tensor_parallel = tensor_parallel
    with pytest.raises(ConfigError, match="every other process rolls out on all of its own as one slice"):
        parse(c, num_devices=4 * processes, num_processes=processes)
    c.serving.rollout_devices, c.serving.tensor_parallel = 4, 0  # process 0 trains, the others roll out
    parse(c, num_devices=4 * processes, num_processes=processes)


def test_a_disaggregated_two_process_run_sizes_the_trainer_by_its_one_process(tmp_path):
    c = good_config(tmp_path)
    c.serving.placement, c.serving.rollout_devices, c.mesh.fsdp = "disaggregated", 4, -1
    c.rl.prompts_per_step, c.rl.group_size, c.trainer.micro_batch_size = 3, 16, 4
    # 3 prompts per step need not split over 2 processes: only process 0 trains
    run = parse(c, num_devices=8, num_processes=2)
    assert run.serving.trainer_devices_of(range(8)) == [0, 1, 2, 3]


def test_several_training_processes_each_drive_as_many_rollout_processes(tmp_path):
    """``serving.trainer_processes``: processes 0 .. T - 1 train over all their devices together
    (the mesh, the batch and the prompts split over them), the others roll out, as many for
    each trainer."""
    c = good_config(tmp_path)
    c.serving.placement, c.serving.rollout_devices, c.mesh.fsdp = "disaggregated", 4, 8
    c.serving.trainer_processes = 2
    c.rl.prompts_per_step, c.rl.group_size, c.trainer.micro_batch_size = 4, 16, 8
    parse(c, num_devices=16, num_processes=4)  # 2 train on 8 devices, 2 roll out
    parse(c, num_devices=24, num_processes=6)  # 2 rollout processes for each trainer
    for processes, message in ((5, "the 3 left must be a positive multiple of 2"),
                               (2, "the 0 left must be a positive multiple of 2")):
        with pytest.raises(ConfigError, match=message):
            parse(c, num_devices=4 * processes, num_processes=processes)
    c.mesh.fsdp = 16
    with pytest.raises(ConfigError, match="does not fit the 8 devices"):
        parse(c, num_devices=16, num_processes=4)
    c.mesh.fsdp, c.rl.prompts_per_step = 8, 3
    with pytest.raises(ConfigError, match="prompts_per_step=3 must be a positive multiple of the 2 processes"):
        parse(c, num_devices=16, num_processes=4)
    c.rl.prompts_per_step, c.serving.trainer_processes = 4, 1  # one trainer: its own 4 devices only
    with pytest.raises(ConfigError, match="does not fit the 4 devices"):
        parse(c, num_devices=12, num_processes=3)
    with pytest.raises(ConfigError, match="needs a multi-process run"):
        c.serving.trainer_processes = 2
        parse(c, num_devices=8)
    c.serving.placement, c.serving.rollout_devices = "colocated", 0
    with pytest.raises(ConfigError, match="only placement='disaggregated' sets processes apart"):
        parse(c, num_devices=16, num_processes=4)


def test_disaggregated_placement_takes_the_trainers_mesh_from_the_devices_it_leaves(tmp_path):
    c = good_config(tmp_path)
    c.serving.placement, c.serving.rollout_devices, c.mesh.fsdp = "disaggregated", 4, -1
    c.rl.prompts_per_step, c.rl.group_size, c.trainer.micro_batch_size = 4, 16, 4
    run = parse(c, num_devices=8)  # fsdp = -1 resolves to the 4 devices the rollouts leave
    assert run.serving.trainer_devices_of(range(8)) == [0, 1, 2, 3]
    assert run.serving.rollout_devices_of(range(8)) == [4, 5, 6, 7]
    import demo

    c = demo.get_config()
    c.serving.placement, c.serving.rollout_devices = "disaggregated", 1
    with pytest.raises(ConfigError, match="is for RL stages"):
        parse(c)


def test_the_decode_attention_and_the_sampler_are_serving_settings(tmp_path):
    """serving.decode_attention / serving.sampler reach the engines (issue 46: our decode kernel
    and the fused sampler chosen by flag, not only by Engine's arguments); a name not offered is
    refused at start, naming the choices."""
    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.models import ModelConfig, Qwen3
    from rstarjax.serving import Engine

    c = good_config(tmp_path)
    assert (c.serving.decode_attention, c.serving.sampler, c.serving.decode_gemms) == (
        "auto", "exact", "xla")  # the defaults
    c.serving.decode_attention, c.serving.sampler = "reference", "fused"
    c.serving.decode_gemms = "cublas"
    options = parse(c, num_devices=8).serving.engine_options(64)
    assert (options["decode_attention"], options["sampler"]) == ("reference", "fused")
    assert options["decode_xla_options"] == {"xla_gpu_enable_triton_gemm": False}
    model = Qwen3(ModelConfig.preset("tiny", dtype=jnp.float32), rngs=nnx.Rngs(0))
    engine = Engine(model, **options)
    assert (engine.decode_attention, engine.sampler) == ("reference", "fused")
    assert engine.decode_xla_options == {"xla_gpu_enable_triton_gemm": False}
    c.serving.decode_attention = "ragged@16,reference"  # one path per batch size
    engine = Engine(model, **parse(c, num_devices=8).serving.engine_options(64))
    assert (engine.decode_choice.for_rows(16), engine.decode_choice.for_rows(64)) == ("ragged", "reference")
    c.serving.decode_attention = "ragged@16"  # the last path must cover every larger batch
    with pytest.raises(ConfigError, match="decode_attention='ragged@16'.*only the last"):
        parse(c, num_devices=8)
    c.serving.decode_attention, c.serving.sampler = "flash", "greedy"
    c.serving.decode_gemms = "cutlass"
    with pytest.raises(ConfigError) as e:
        parse(c, num_devices=8)
    assert "decode_attention='flash'" in str(e.value) and "pallas_gpu_packed" in str(e.value)
    assert "sampler='greedy'" in str(e.value) and "'fused'" in str(e.value)
    assert "decode_gemms='cutlass'" in str(e.value) and "'cublas'" in str(e.value)


@pytest.mark.parametrize("micro, message", [
    (0, r"the 3 rows of a mini-batch \(--config.rl.prompts_per_step=1 x --config.rl.group_size=3"),
    (3, r"--config.trainer.micro_batch_size=3 must be a multiple of data\*fsdp=2")])
def test_rows_that_do_not_split_over_the_devices_name_the_flags_that_set_them(tmp_path, micro, message):
    """With micro_batch_size=0 the micro-batch is the derived mini-batch: the error names the flags
    that make it (once it named micro_batch_size=3, a value nobody set); a micro-batch set by
    hand is named as set."""
    c = good_config(tmp_path)
    c.rl.prompts_per_step, c.rl.group_size, c.rl.oversample, c.trainer.micro_batch_size = 1, 3, 6, micro
    with pytest.raises(ConfigError, match=message):
        parse(c, num_devices=2)

"""Every bad input a user brings gets one line per problem and exit 2 before any work (issue 47):
``python -m rstarjax.check_config`` and the start of a run (``recipes.config.parse``) check the
data file (a readable file of a known layout, not empty), the model directory (config.json of a
supported architecture, safetensors whose headers match the config and whose sizes match their
headers, a tokenizer that fits the vocabulary), and a misspelled ``--config.KEY``."""
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from rstarjax import check_config  # noqa: E402


@pytest.fixture(scope="module")
def user_inputs(tmp_path_factory):
    """A good tiny HF model (sharded safetensors with an index, its tokenizer) and problems."""
    from test_stages import _tiny_hf_model

    d = tmp_path_factory.mktemp("user")
    _tiny_hf_model(str(d / "model"))
    (d / "problems.jsonl").write_text('{"problem": "What is 1 + 1?", "answer": "2"}\n')
    return d


def _check(capsys, model, data, *extra):
    """check_config's exit status and its stderr lines for a stage-1 launch on 8 devices."""
    status = check_config.main(["--devices=8", "--config=configs/stage1.py", f"--config.model.hf_path={model}",
                                f"--config.data.train_path={data}", "--config.trainer.micro_batch_size=32",
                                *extra])
    err = capsys.readouterr().err
    return status, [line.strip() for line in err.splitlines() if line.strip()]


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _copy_model(user_inputs, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(user_inputs / "model", model)
    [shard] = [f for f in os.listdir(model) if f.endswith(".safetensors")]
    return model, model / shard


def test_good_inputs_pass(user_inputs, capsys, at_root):
    assert _check(capsys, user_inputs / "model", user_inputs / "problems.jsonl") == (0, [])


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_text(""), "problems.jsonl' is empty"),
    (lambda p: p.mkdir(), "problems.jsonl' is a directory: give one .jsonl / .json / .parquet file (docs/data.md)"),
    (lambda p: p.write_text('{"question_text": "1+1", "solution": "2"}\n' * 3),
     "problems.jsonl' its first 3 rows lack the columns of a known layout; found ['question_text', 'solution']; "
     "accepted: a problem column (problem, Problem, question, Question) with an answer column (answer, Answer, "
     "expected_answer, final_answer, ground_truth, solution_answer), or verl's prompt + "
     "reward_model.ground_truth (docs/data.md)"),
    (lambda p: p.write_text("not json\n{also not\n"), "problems.jsonl' its first 2 rows are not JSON (bad_json"),
])
def test_a_bad_data_file_is_one_line_before_any_work(user_inputs, tmp_path, capsys, at_root, make, message):
    data = tmp_path / "problems.jsonl"
    make(data)
    status, lines = _check(capsys, user_inputs / "model", data)
    assert status == 2 and len(lines) == 2 and lines[0] == "invalid config:", lines
    assert lines[1].startswith("--config.data.train_path=") and message in lines[1], lines[1]


def test_a_data_file_of_an_unknown_type_or_unreadable(user_inputs, tmp_path, capsys, at_root):
    data = tmp_path / "problems.csv"
    data.write_text("problem,answer\n1+1,2\n")
    status, lines = _check(capsys, user_inputs / "model", data)
    assert status == 2 and lines[1].endswith("problems.csv' is not a .jsonl / .json / .parquet file (docs/data.md)")
    if os.geteuid() != 0:  # root reads whatever the permissions say
        data = tmp_path / "locked.jsonl"
        data.write_text('{"problem": "p", "answer": "1"}\n')
        data.chmod(0)
        status, lines = _check(capsys, user_inputs / "model", data)
        assert status == 2 and lines[1].endswith("is not readable (check its permissions)")


def test_rows_past_a_few_bad_ones_still_pass(user_inputs, tmp_path, capsys, at_root):
    """The check reads the first rows for a known layout; bad rows among them are the loader's
    to skip and count, not a reason to refuse the file."""
    data = tmp_path / "problems.jsonl"
    data.write_text('{not json\n{"x": 1}\n{"problem": "p", "answer": "1"}\n')
    assert _check(capsys, user_inputs / "model", data) == (0, [])


def _rewrite_header(path, change):
    """Rewrite a safetensors file's header through ``change(header)``, its data kept."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def test_a_damaged_model_directory_names_the_file(user_inputs, tmp_path, capsys, at_root):
    data = user_inputs / "problems.jsonl"
    model, shard = _copy_model(user_inputs, tmp_path)
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:  # cut to a third, as an interrupted download leaves it
        f.truncate(size // 3)
    status, lines = _check(capsys, model, data)
    assert status == 2 and len(lines) == 2, lines
    assert f"{shard.name} is {size // 3} bytes but its header describes {size} (truncated)" in lines[1]

    model, shard = _copy_model(user_inputs, tmp_path / "b")

    def transpose_gate(header):
        info = header["model.layers.0.mlp.gate_proj.weight"]
        info["shape"] = info["shape"][::-1]
    _rewrite_header(shard, transpose_gate)
    status, lines = _check(capsys, model, data)
    assert status == 2 and len(lines) == 2, lines
    assert f"{shard.name}: tensor 'model.layers.0.mlp.gate_proj.weight' has shape" in lines[1]
    assert "config.json implies" in lines[1]

    model, shard = _copy_model(user_inputs, tmp_path / "c")
    _rewrite_header(shard, lambda h: h["model.norm.weight"].update(shape=[7]))
    status, lines = _check(capsys, model, data)
    assert status == 2 and f"{shard.name}: tensor 'model.norm.weight' of shape [7] F32 needs 28 bytes" in lines[1]


def test_an_unsupported_architecture_or_a_tokenizer_too_large(user_inputs, tmp_path, capsys, at_root):
    data = user_inputs / "problems.jsonl"
    model, _ = _copy_model(user_inputs, tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama")))
    status, lines = _check(capsys, model, data)
    assert status == 2 and len(lines) == 2 and "config.json: field 'architectures'=['LlamaForCausalLM']" in lines[1]
    assert "is unsupported; supported:" in lines[1]

    model, _ = _copy_model(user_inputs, tmp_path / "b")
    os.remove(model / "tokenizer.json")  # then the run takes Qwen3's full tokenizer
    status, lines = _check(capsys, model, data)
    assert status == 2 and len(lines) == 2, lines
    assert "Qwen3's tokenizer (no tokenizer.json here) has 151669 tokens but config.json's vocab_size is" in lines[1]
    assert _check(capsys, model, data, "--config.model.tokenizer_num_regular_tokens=300") == (0, [])
    model, _ = _copy_model(user_inputs, tmp_path / "c")
    os.remove(model / "model.safetensors.index.json")
    status, lines = _check(capsys, model, data)
    assert status == 2 and "has neither model.safetensors nor model.safetensors.index.json" in lines[1]


def test_a_misspelled_key_is_one_line_with_the_key_meant(user_inputs, tmp_path, capsys, at_root):
    data = user_inputs / "problems.jsonl"
    status, lines = _check(capsys, user_inputs / "model", data, "--config.rl.lerning_rate=1e-6")
    assert (status, lines) == (2, ["--config.rl.lerning_rate=1e-6 does not parse: the config has no key "
                                   "'rl.lerning_rate'; did you mean --config.optim.learning_rate?"])
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "rstarjax.main", "--config=configs/stage1.py",
                        f"--workdir={tmp_path}", "--config.rl.max_turn=12"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == ["--config.rl.max_turn=12 does not parse: the config has no key "
                                             "'rl.max_turn'; did you mean --config.rl.max_turns?"]
    assert not os.listdir(tmp_path)  # before any work


def test_sft_data_needs_a_messages_column(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "configs"))
    import sft

    from rstarjax.recipes.config import parse
    from rstarjax.validation import ConfigError

    c = sft.get_config()
    c.model.random_init, c.model.preset = True, "tiny"
    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "hi", "completion": "hello"}\n')
    c.sft.data_path = str(data)
    with pytest.raises(ConfigError, match=r"sft.jsonl' its first 1 rows lack the columns of a known layout; "
                                          r"found \['completion', 'prompt'\]; accepted: a \"messages\" column"):
        parse(c)
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    parse(c)


# ---- at the start of a run (rstarjax.main.run_to_exit_status): found only once it reads it all --------
def _stage1(user_inputs, data, workdir, **checkpoint):
    """run_to_exit_status of a tiny stage 1 on ``data``: (status, its stderr lines)."""
    from test_stages import _load, _rl_sizes

    c = _rl_sizes(_load("stage1"), 1)
    c.model.hf_path, c.data.train_path = str(user_inputs / "model"), str(data)
    c.rl.num_tool_workers = 1
    for key, value in checkpoint.items():
        setattr(c.checkpoint, key, value)
    return c, str(workdir)


def _exit(capsys, c, workdir):
    from rstarjax.main import run_to_exit_status

    status = run_to_exit_status(c, workdir)
    err = capsys.readouterr().err
    return status, [line for line in err.splitlines() if line.startswith("rstarjax") or line.startswith("--")]


def test_a_data_file_without_a_usable_row_is_one_line_not_a_traceback(user_inputs, tmp_path, capsys):
    data = tmp_path / "fractions.jsonl"
    data.write_text("".join(json.dumps({"problem": f"Half of {i}?", "answer": f"\\frac{{{i}}}{{2}}"}) + "\n"
                            for i in range(1, 9, 2)))
    status, lines = _exit(capsys, *_stage1(user_inputs, data, tmp_path / "w"))
    assert status == 2 and len(lines) == 1 and "no usable rows" in lines[0], lines
    assert "non_integer_answer=4" in lines[0] and "data.answer_filter=any" in lines[0], lines


def test_init_from_a_runs_workdir_names_its_checkpoints(user_inputs, tmp_path, capsys):
    """An easy mistake: the previous stage's WORKDIR for its WORKDIR/checkpoints."""
    previous = tmp_path / "stage1"
    (previous / "checkpoints").mkdir(parents=True)
    status, lines = _exit(capsys, *_stage1(user_inputs, user_inputs / "problems.jsonl", tmp_path / "w",
                                           init_from=str(previous)))
    assert status == 2 and len(lines) == 1, lines
    assert f"give its checkpoints, --config.checkpoint.init_from={previous / 'checkpoints'}" in lines[0], lines


def test_init_from_a_step_or_an_hf_directory_says_what_it_is(user_inputs, tmp_path, capsys):
    """Two more near misses, which said only "holds no finished checkpoint (did the previous stage
    save one?)": one step of a run's checkpoints (DIR/N), and a HuggingFace model directory (it
    goes to --config.model.hf_path). Export's --checkpoint gets the same words, with its --step."""
    import jax.numpy as jnp

    from rstarjax.export import _finished_steps
    from rstarjax.io import checkpoint as ckpt_lib

    checkpoints = tmp_path / "stage1" / "checkpoints"
    with ckpt_lib.Checkpointer(str(checkpoints), ckpt_lib.CheckpointConfig(async_save=False)) as ck:
        ck.save(7, {"w": jnp.ones(2)}, {"step": 7})
    status, lines = _exit(capsys, *_stage1(user_inputs, user_inputs / "problems.jsonl", tmp_path / "w",
                                           init_from=str(checkpoints / "7")))
    assert status == 2 and len(lines) == 1, lines
    assert (f"it is step 7 of a run's checkpoints, give that directory, --config.checkpoint.init_from={checkpoints} "
            "(its newest finished step is the one used)") in lines[0], lines
    with pytest.raises(FileNotFoundError, match=f"give that directory, --checkpoint {checkpoints} --step 7"):
        _finished_steps(str(checkpoints / "7"))
    status, lines = _exit(capsys, *_stage1(user_inputs, user_inputs / "problems.jsonl", tmp_path / "w2",
                                           init_from=str(user_inputs / "model")))
    assert status == 2 and len(lines) == 1, lines
    assert ("it is a HuggingFace model directory, not a run's checkpoints: give it as "
            f"--config.model.hf_path={user_inputs / 'model'}, without --config.checkpoint.init_from") in lines[0], lines


def test_a_workdir_in_use_or_not_writable_is_refused_before_any_work(user_inputs, tmp_path, capsys):
    """Two runs in one workdir deleted each other's checkpoints; an unwritable one failed with an
    OSError after the work (eval lost its results)."""
    from rstarjax.main import workdir_lock

    workdir = tmp_path / "w"
    c, _ = _stage1(user_inputs, user_inputs / "problems.jsonl", workdir)
    with workdir_lock(str(workdir)):  # another run holds it
        status, lines = _exit(capsys, c, str(workdir))
    assert status == 2 and f"--workdir={str(workdir)!r} is in use by another run (pid {os.getpid()}" in lines[-1], lines
    assert not (workdir / "checkpoints").exists()
    (tmp_path / "a_file").write_text("")
    status, lines = _exit(capsys, c, str(tmp_path / "a_file" / "run"))
    assert status == 2 and "cannot be written" in lines[-1] and "a_file/run" in lines[-1], lines


@pytest.mark.parametrize("flag, message", [
    ("--config.seed=-1", "--config.seed=-1 must be in [0, 2**32)"),
    ("--config.optim.learning_rate=inf", "--config.optim.learning_rate=inf must be a finite number > 0"),
])
def test_values_that_would_crash_later_are_refused_at_start(user_inputs, capsys, at_root, flag, message):
    status, lines = _check(capsys, user_inputs / "model", user_inputs / "problems.jsonl", flag)
    assert status == 2 and message in lines, lines


def test_benchmarks_whose_files_share_a_name_are_told_apart(tmp_path):
    """HF downloads are often all test.parquet: one result overwrote the other's."""
    from rstarjax.recipes.evaluate import dataset_names, load_benchmarks

    assert dataset_names(["/d/aime24/test.parquet", "/d/math500/test.parquet", "x/amc.jsonl"]) == [
        "aime24/test", "math500/test", "amc"]
    for name, n in (("a", 2), ("b", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "problems.jsonl").write_text(
            "".join(json.dumps({"problem": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(n)))
    got = load_benchmarks([str(tmp_path / "a" / "problems.jsonl"), str(tmp_path / "b" / "problems.jsonl")])
    assert {k: len(v) for k, v in got.items()} == {"a/problems": 2, "b/problems": 3}


@pytest.mark.parametrize("preset, message", [
    ("eval.py:bogus", "--config: the config file raised ValueError: configs/eval.py takes no variant, got 'bogus'"),
    ("demo.py:cii", "--config: the config file raised ValueError: configs/demo.py takes '', 'ci'"),
])
def test_a_misspelled_preset_variant_is_one_line(capsys, at_root, preset, message):
    status = check_config.main(["--devices=8", f"--config=configs/{preset}"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith(message), lines


# ---- settings that parsed, then crashed mid-run or silently did something else (refused at start) ----
MODE_ARGS = {  # a good command line of each mode, on a tiny random model (paths filled in by _parse)
    "rl": ["--config=configs/stage1.py", "--config.trainer.micro_batch_size=0", "--config.data.train_path={data}"],
    "filter": ["--config=configs/stage3.py:filter", "--config.data.train_path={data}"],
    "sft": ["--config=configs/sft.py", "--config.sft.data_path={sft}"],
    "eval": ["--config=configs/eval.py", "--config.eval.paths={data}"],
    "demo": ["--config=configs/demo.py:ci"],
}


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    (tmp_path / "problems.jsonl").write_text('{"problem": "What is 1 + 1?", "answer": "2"}\n')
    (tmp_path / "sft.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                        '{"role": "assistant", "content": "hello"}]}\n')
    return tmp_path


def _parse(inputs, mode, *extra, devices=1, processes=1):
    """check_config's typed config of a ``mode`` command line with ``extra`` flags (``{data}``,
    ``{sft}``, ``{dir}``: the fixture's files) on ``devices`` in ``processes``; ConfigError when
    refused."""
    paths = dict(data=inputs / "problems.jsonl", sft=inputs / "sft.jsonl", dir=inputs)
    tiny = [] if mode == "demo" else ["--config.model.preset=tiny", "--config.model.random_init=True"]
    argv = [a.format(**paths) for a in (*MODE_ARGS[mode], *tiny, *extra)]
    return check_config.check(argv, devices, processes)


def _refusal(inputs, mode, *extra) -> list[str]:
    from rstarjax.validation import ConfigError

    with pytest.raises(ConfigError) as e:
        _parse(inputs, mode, *extra)
    return [line.strip() for line in str(e.value).splitlines() if line.strip() != "invalid config:"]


@pytest.mark.parametrize("mode, flag", [
    ("rl", "--config.rl.rollout_timeout_s=inf"),  # the scheduler's Thread.join(inf): OverflowError
    ("eval", "--config.eval.timeout_s=inf"),
    ("rl", "--config.checkpoint.preemption_grace_s=inf"),  # threading.Timer(inf) at the first SIGTERM
    ("rl", "--config.rl.length_penalty_coef=inf"),  # inf rewards, NaN advantages
    ("rl", "--config.loss.kl_coef=inf"),  # an inf loss: every update skipped as non-finite
    ("rl", "--config.optim.grad_clip_norm=nan"),
    ("sft", "--config.sft.grad_clip_norm=nan"),
    ("rl", "--config.distributed.silence_s=inf"),
])
def test_a_non_finite_value_is_refused_at_start(inputs, mode, flag):
    assert _refusal(inputs, mode, flag) == [f"{flag} must be a finite number"]


def test_inf_stays_a_value_where_it_means_no_cap(inputs):
    run = _parse(inputs, "rl", "--config.loss.decoupled_cap=inf", "--config.loss.eps_high=inf")
    assert run.loss.decoupled_cap == run.loss.eps_high == float("inf")
    # a section's own message about the value is kept, not doubled
    assert _refusal(inputs, "rl", "--config.optim.learning_rate=nan") == [
        "--config.optim.learning_rate=nan must be a finite number > 0"]


@pytest.mark.parametrize("flag, message", [
    ("--config.sft.max_steps=-1", "--config.sft.max_steps=-1 must be >= 0"),  # plan[:-1] dropped a step
    ("--config.sft.min_lr_ratio=-1", "--config.sft.min_lr_ratio=-1.0 must be in [0, 1]"),  # an LR below 0
    ("--config.sft.min_lr_ratio=2", "--config.sft.min_lr_ratio=2.0 must be in [0, 1]"),
    ("--config.sft.weight_decay=-0.1", "--config.sft.weight_decay=-0.1 must be >= 0"),
    # found only by the trainer, built after the model
    ("--config.sft.compute_dtype=float33", "--config.sft.compute_dtype='float33' is not a dtype name"),
])
def test_sft_settings_that_misbehaved_are_refused(inputs, flag, message):
    [line] = _refusal(inputs, "sft", flag)
    assert line.startswith(message), line


def test_eval_names_are_one_per_file_and_its_flags_are_its_own(inputs):
    """``--config.eval.names=a,b`` arrived as the one name 'a,b'; with two files the run failed
    with a ValueError after loading; a bad eval.timeout_s named a flag that does not exist."""
    two = f"--config.eval.paths={inputs / 'problems.jsonl'},{inputs / 'problems.jsonl'}"
    assert _parse(inputs, "eval", two, "--config.eval.names=aime,math").eval.names == ("aime", "math")
    [line] = _refusal(inputs, "eval", "--config.eval.names=aime,math")
    assert line.startswith("--config.eval.names='aime,math' gives 2 names for the 1 files of --config.eval.paths")
    [line] = _refusal(inputs, "eval", "--config.eval.timeout_s=0")
    assert line.startswith("--config.eval.timeout_s=0.0 must be > 0"), line
    [line] = _refusal(inputs, "eval", "--config.eval.num_slots=-1")
    assert line.startswith("--config.eval.num_slots=-1 must be >= 0"), line


def test_the_filter_never_overwrites_its_input_nor_samples_one_rollout_k_times(inputs):
    """Its output is written after every rollout: a directory there failed at the end, and the
    data file itself was overwritten with the filtered set."""
    [line] = _refusal(inputs, "filter", "--config.filter.output_path={dir}")
    assert line == f"--config.filter.output_path={str(inputs)!r} is a directory: give the .jsonl file to write"
    [line] = _refusal(inputs, "filter", "--config.filter.output_path={data}")
    assert "is --config.data.train_path: the filtered set would overwrite the problems" in line, line
    [line] = _refusal(inputs, "filter", "--config.rl.temperature=0")
    assert line.startswith("--config.rl.temperature=0 samples the same rollout --config.filter.k=8 times"), line
    _parse(inputs, "filter", "--config.rl.temperature=0", "--config.filter.k=1")


@pytest.mark.parametrize("flag, message", [
    ("--config.demo.task_kinds=bogus", "--config.demo.task_kinds='bogus': ['bogus'] unknown; choose among multiply,"),
    ("--config.demo.num_eval_problems=0", "--config.demo.num_eval_problems=0 must be >= 1"),  # accuracy NaN
    ("--config.demo.num_rl_problems=-1", "--config.demo.num_rl_problems=-1 must be >= 1"),
    ("--config.demo.num_slots=-1", "--config.demo.num_slots=-1 must be >= 0"),
    ("--config.demo.in_head_fraction.count_divisible=2.0",
     "--config.demo.in_head_fraction.count_divisible=2.0 must be a share in [0, 1]"),
    ("--config.demo.model.num_attention_heads=3", "--config.demo.model (ModelConfig fields over model.preset='tiny'): "
                                                  "num_attention_heads=3 must be a multiple of num_key_value_heads=2"),
    ("--config.checkpoint.init_from={dir}", "--config.checkpoint.init_from="),  # the demo never reads it
])
def test_the_demo_section_is_checked_at_start(inputs, flag, message):
    [line] = _refusal(inputs, "demo", flag)
    assert line.startswith(message), line


def test_demo_task_kinds_take_a_comma_separated_list(inputs):
    assert _parse(inputs, "demo", "--config.demo.task_kinds=multiply,modpow").demo.task_kinds == ("multiply", "modpow")


def test_settings_the_run_would_not_read_are_refused(inputs):
    """An SFT run never reads checkpoint.init_from; a tokenizer_path that is not there fell back
    to Qwen3's full tokenizer, both without a word."""
    [line] = _refusal(inputs, "sft", "--config.checkpoint.init_from={dir}")
    assert line.startswith(f"--config.checkpoint.init_from={str(inputs)!r} is not read by mode='sft': drop it"), line
    [line] = _refusal(inputs, "rl", "--config.model.tokenizer_path=/nonexistent/tok")
    assert line.startswith("--config.model.tokenizer_path='/nonexistent/tok' is not a directory"), line
    [line] = _refusal(inputs, "rl", "--config.model.tokenizer_path={dir}")
    assert line.startswith(f"--config.model.tokenizer_path={str(inputs)!r} has no tokenizer.json"), line


def test_a_kv_pool_too_small_for_one_rollout_is_refused_before_the_model(inputs):
    """The engine refuses it too, but only once the (14B) model is built."""
    [line] = _refusal(inputs, "rl", "--config.serving.kv_pages=639")  # 2048 + 8192 tokens: 640 pages of 16
    assert line.startswith("--config.serving.kv_pages=639 cannot hold one maximum-length rollout: 10240 tokens"), line
    assert "set --config.serving.kv_pages=640 or more" in line
    _parse(inputs, "rl", "--config.serving.kv_pages=640")
    [line] = _refusal(inputs, "eval", "--config.serving.kv_pages=640")  # eval's budgets: 2048 + 30720
    assert "need 2048 pages" in line, line


def test_a_demo_typo_exits_2_before_writing_anything(tmp_path):
    """Through the entry point: it wrote config.json, generated data and raised a traceback."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "rstarjax.main", "--config=configs/demo.py:ci", f"--workdir={tmp_path}",
                        "--config.demo.task_kinds=multiply,modpw"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and lines[-2:] == [
        "invalid config:", "  --config.demo.task_kinds='multiply,modpw': ['modpw'] unknown; choose among multiply,"
        "modpow,count_divisible,digit_sum_power,count_divisible_large (none = multiply,modpow,count_divisible,"
        "digit_sum_power)"], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not os.listdir(tmp_path)


def test_a_tool_response_cap_and_admission_reserve_out_of_range_are_refused(inputs):
    """A negative cap cut the official protocol's tool text at text[:-n] (0 meant no cut in one
    protocol, an empty text in the other); a reserve above 1 only blocks admissions."""
    [line] = _refusal(inputs, "rl", "--config.rl.max_tool_response_chars=-1")
    assert line.startswith("--config.rl.max_tool_response_chars=-1 must be >= 1"), line
    assert _refusal(inputs, "rl", "--config.rl.max_tool_response_chars=0")
    for value in ("1.5", "inf"):  # (inf: int(inf * max_len) raised an OverflowError mid-run)
        assert _refusal(inputs, "rl", f"--config.serving.admit_reserve_fraction={value}") == [
            f"--config.serving.admit_reserve_fraction={float(value)} must be in [0, 1] (1.0 never preempts)"]
    _parse(inputs, "rl", "--config.serving.admit_reserve_fraction=1.0", "--config.rl.max_tool_response_chars=1")


@pytest.mark.parametrize("arg", ["--devices=abc", "--devices=0", "--processes=-2"])
def test_check_config_counts_that_are_no_count_are_one_line(arg, capsys):
    """int('abc') raised a ValueError traceback out of check_config.main."""
    assert check_config.main(["--devices=8", arg, "--config=configs/stage1.py"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"check_config: {arg!r}: ") and "takes a count >= 1" in line, line


def _refusal_on(inputs, mode, devices, processes, *extra) -> list[str]:
    """check_config's refusal lines for a ``mode`` command line on ``devices`` in ``processes``."""
    from rstarjax.validation import ConfigError
    with pytest.raises(ConfigError) as e:
        _parse(inputs, mode, *extra, devices=devices, processes=processes)
    return [line.strip() for line in str(e.value).splitlines() if line.strip() != "invalid config:"]


@pytest.mark.parametrize("mode", ["sft", "demo"])
def test_an_sft_micro_batch_the_mesh_cannot_split_is_refused_by_the_checker(inputs, mode):
    """check_config said ok; the run then built the model, encoded the data and died in the
    trainer with a traceback that named no flag."""
    assert _refusal_on(inputs, mode, 8, 1, "--config.sft.micro_batch_size=3") == [
        "--config.sft.micro_batch_size=3 must be a multiple of data*fsdp=8 (each device takes an equal share "
        "of every micro-batch; 0 takes the step's rows whole)"]
    check_config.check([a.format(sft=inputs / "sft.jsonl") for a in MODE_ARGS["sft"]]
                       + ["--config.model.preset=tiny", "--config.model.random_init=True",
                          "--config.sft.micro_batch_size=16"], 8, 1)


def test_a_multi_process_cluster_needs_a_multi_process_command(inputs):
    """With neither distributed.num_processes nor distributed.auto each host would run a
    single-process job of its own into the same workdir; the checker said ok."""
    [line] = _refusal_on(inputs, "rl", 16, 2)
    assert line.startswith("the cluster has 2 processes but the command starts a single-process run: "
                           "set --config.distributed.num_processes=2"), line
    from rstarjax.validation import ConfigError
    argv = [a.format(data=inputs / "problems.jsonl") for a in MODE_ARGS["rl"]] + [
        "--config.model.preset=tiny", "--config.model.random_init=True", "--config.distributed.auto=True"]
    try:
        check_config.check(argv, 16, 2)
    except ConfigError as e:  # other rules may apply; not this one
        assert "single-process run" not in str(e)


@pytest.mark.parametrize("flags, hint", [
    (["--config.mesh.data=3"], ": --config.mesh.data=3 does not divide 8"),
    (["--config.mesh.fsdp=2", "--config.mesh.tensor=2"], ", e.g. --config.mesh.fsdp=-1"),
])
def test_a_mesh_that_does_not_fit_names_the_axis_to_change(inputs, flags, hint):
    """The hint was always '--config.mesh.fsdp=-1', already set when data=3 was the problem."""
    [line] = _refusal_on(inputs, "rl", 8, 1, *flags)
    assert line.startswith("mesh (data, fsdp, tensor)=") and hint in line, line


def test_a_tool_timeout_the_code_judge_sandbox_cannot_take_is_refused_at_start(inputs):
    """The official protocol runs each call's sandbox 1 s past rl.tool_timeout_s, within the code
    pool's 600 s cap: 599.5 made every call an infrastructure error; refused when the rollouts
    were built, after the model. Now one line at start, naming the flag."""
    [line] = _refusal(inputs, "rl", "--config.profile=rstar2_official", "--config.rl.tool_timeout_s=599.5")
    assert line.startswith("--config.rl.tool_timeout_s=599.5 must be <= 599 seconds with the code_judge"), line
    _parse(inputs, "rl", "--config.profile=rstar2_official", "--config.rl.tool_timeout_s=599")
    _parse(inputs, "rl", "--config.rl.tool_timeout_s=599.5")  # the paper's protocol has no such margin

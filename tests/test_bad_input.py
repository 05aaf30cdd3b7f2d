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

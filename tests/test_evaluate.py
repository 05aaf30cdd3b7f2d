"""Evaluation metrics against independent references (subset enumeration, hand-computed tables)."""
import itertools
import json
import math

import numpy as np
import pytest

from rstarjax.recipes import evaluate as ev
from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, Trajectory


def _pass_at_k_enumerated(correct, k):
    """Probability that a uniformly random k-subset holds a correct sample, by enumeration."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 1, 1), (5, 2, 3), (6, 3, 2), (8, 1, 8), (8, 7, 4), (7, 7, 3)])
def test_pass_at_k_matches_enumeration(n, c, k):
    correct = [True] * c + [False] * (n - c)
    assert ev.pass_at_k(n, c, k) == pytest.approx(_pass_at_k_enumerated(correct, k), abs=1e-12)
    assert ev.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_large_n_stable():
    # C(200, 100) overflows float; the product form must still agree with exact rationals.
    n, c, k = 200, 3, 100
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert ev.pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("args", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_rejects_bad_input(args):
    with pytest.raises(ValueError):
        ev.pass_at_k(*args)


def test_majority_vote_cases():
    # "1,000" and "1000" are the same vote; it wins 2 to 1 and is correct.
    assert ev.majority_vote(["1,000", "7", "1000"], [True, False, True]) is True
    # the wrong answer has the majority
    assert ev.majority_vote(["7", "7", "5"], [False, False, True]) is False
    # None never votes: the single real answer wins
    assert ev.majority_vote([None, None, "5"], [False, False, True]) is True
    # no answers at all
    assert ev.majority_vote([None, None], [False, False]) is False
    # tie 1-1: the first to reach the top count wins
    assert ev.majority_vote(["3", "4"], [False, True]) is False
    assert ev.majority_vote(["4", "3"], [True, False]) is True
    with pytest.raises(ValueError):
        ev.majority_vote(["1"], [True, False])


def _traj(text, reward, n_model=3, n_tool=2, finish=FinishReason.ANSWERED, graded=None, tool_text=""):
    """A verified sample: the verifier judged ``text`` (``graded``: what it judged, if other);
    ``tool_text`` is a program's output in the response (never judged)."""
    segs = [Segment(SegmentKind.MODEL, np.arange(n_model), np.zeros(n_model))]
    if n_tool:
        segs.append(Segment(SegmentKind.TOOL, np.arange(n_tool)))
    verified = finish not in (FinishReason.MAX_LENGTH, FinishReason.ERROR)
    return Trajectory(prompt_ids=np.arange(4), segments=segs, reward=reward, finish=finish,
                      response_text=tool_text + text, graded_text=(graded or text) if verified else None)


def _box(x):
    return f"<answer>\\boxed{{{x}}}</answer>"


def test_dataset_metrics_hand_computed(tmp_path):
    records = [{"uid": "a", "problem": "p1", "answer": "12"}, {"uid": "b", "problem": "p2", "answer": "5"}]
    groups = [
        # 1 of 4 right; majority (3x "11") is wrong; lengths 5,5,5,5
        [_traj(_box(12), 1.0), _traj(_box(11), 0.0), _traj(_box(11), 0.0), _traj(_box(11), 0.0)],
        # 1 of 4 right, majority right ("5" once, others no answer); lengths 1+0 ... (model only)
        [_traj("no answer", 0.0, 1, 0), _traj(_box(5), 1.0, 1, 0), _traj("x", 0.0, 1, 0), _traj("y", 0.0, 1, 0)],
    ]
    out = ev.evaluate_records({"toy": records}, lambda recs, k: groups, k=4, out_dir=str(tmp_path))
    m = out["toy"]
    assert m["pass@1"] == pytest.approx((0.25 + 0.25) / 2)
    assert m["maj@4"] == pytest.approx(0.5)
    assert m["pass@4"] == pytest.approx(1.0)
    assert m["mean_response_length"] == pytest.approx((5 + 1) / 2)
    lines = (tmp_path / "eval_samples.jsonl").read_text().splitlines()
    assert [json.loads(l)["uid"] for l in lines] == ["a", "b"]
    assert json.loads(lines[0])["answers"] == ["12", "11", "11", "11"]
    assert "| toy | 2 | 25.0 | 50.0 | 100.0 | 3 |" in (tmp_path / "eval_table.md").read_text()


def test_votes_are_the_answers_the_verifier_judged(tmp_path):
    """maj@k against its definition (the most frequent answer equals the gold): a program that
    prints a box casts no vote, nor does a sample cut at its length (scored 0 unverified); the
    winner is judged by its own verdicts, whichever sample comes first."""
    rec = [{"uid": "a", "problem": "p", "answer": "5"}]
    printed = "<tool_response>\\boxed{6}</tool_response>"
    cut = _traj(_box(5), 0.0, finish=FinishReason.MAX_LENGTH)  # truncated after writing a box
    group = [cut, _traj(_box(5), 1.0), _traj(_box(7), 0.0),
             _traj("see above", 0.0, tool_text=printed), _traj(_box(5), 1.0, tool_text=printed),
             _traj(_box(7), 0.0)]
    m = ev.evaluate_records({"d": rec}, lambda recs, k: [group], k=6)["d"]
    assert m["maj@6"] == 1.0  # votes: 5, 7, 5, 7 -> a tie that 5 reached first
    order = [cut, _traj(_box(7), 0.0), _traj(_box(5), 1.0), _traj(_box(5), 1.0)]
    assert ev.evaluate_records({"d": rec}, lambda recs, k: [order], k=4)["d"]["maj@4"] == 1.0
    wrong = [_traj("x", 0.0, tool_text=printed.replace("6", "5"))] * 2 + [_traj(_box(6), 0.0)]
    assert ev.evaluate_records({"d": rec}, lambda recs, k: [wrong], k=3)["d"]["maj@3"] == 0.0


def test_an_answer_past_what_python_reads_as_a_number_votes_by_its_text(tmp_path):
    huge = "9" * 5000  # int() refuses over 4,300 digits; the verifier reads no answer over 1,000 characters
    assert ev.answer_key(huge) == huge and ev.answer_key(huge + ".5") == huge + ".5"
    rec = [{"uid": "a", "problem": "p", "answer": "5"}]
    group = [_traj(_box(huge), 0.0), _traj(_box(huge), 0.0), _traj(_box(5), 1.0)]
    m = ev.evaluate_records({"d": rec}, lambda recs, k: [group], k=3, out_dir=str(tmp_path))["d"]
    assert (m["maj@3"], m["pass@1"]) == (0.0, pytest.approx(1 / 3))
    assert (tmp_path / "eval_results.json").exists()


def test_infrastructure_failures_are_not_scored_as_the_model_s(tmp_path):
    """A sample a dead sandbox or a silent verifier ended is left out of every figure and
    counted; a problem left with none is not scored; none left at all is an error."""
    recs = [{"uid": "a", "problem": "p", "answer": "5"}, {"uid": "b", "problem": "q", "answer": "3"}]
    err = _traj("", 0.0, finish=FinishReason.ERROR)
    groups = [[_traj(_box(5), 1.0), err, _traj(_box(5), 1.0), err], [err, err, err, err]]
    m = ev.evaluate_records({"d": recs}, lambda r, k: groups, k=4, out_dir=str(tmp_path))["d"]
    # problem a: 2 scored samples, both right; pass@4 on n = 2 caps k at 2; problem b: unscored
    assert (m["num_problems"], m["pass@1"], m["maj@4"], m["pass@4"]) == (1, 1.0, 1.0, 1.0)
    assert (m["infra_errors"], m["problems_unscored"]) == (6, 1)
    assert "6 samples ended in an infrastructure failure" in (tmp_path / "eval_table.md").read_text()
    with pytest.raises(RuntimeError, match="infrastructure failure"):
        ev.evaluate_records({"d": recs[1:]}, lambda r, k: groups[1:], k=4)


def test_dataset_metrics_rejects_too_few_samples():
    r = ev.ProblemResult("u", "d", "p", "1", ["1"], [True], [3])
    with pytest.raises(ValueError, match="fewer than k"):
        ev.dataset_metrics([r], k=2)


def test_load_benchmarks_layouts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    aime24 = tmp_path / "aime24.jsonl"  # HuggingFaceH4/aime_2024 layout
    aime24.write_text("\n".join(json.dumps({"id": i, "problem": f"P{i}", "solution": "...", "answer": str(i)})
                                for i in range(3)))
    aime25 = tmp_path / "aime25.jsonl"  # opencompass AIME2025 layout
    aime25.write_text(json.dumps({"question": "Q", "answer": "70"}) + "\n")
    math500 = tmp_path / "math500.parquet"  # HuggingFaceH4/MATH-500 layout, non-integer answers kept
    pq.write_table(pa.Table.from_pylist([{"problem": "M", "solution": "s", "answer": "\\frac{1}{2}",
                                          "subject": "Algebra", "level": 2, "unique_id": "x"}]), math500)
    out = ev.load_benchmarks([str(aime24), str(aime25), str(math500)])
    assert list(out) == ["aime24", "aime25", "math500"]
    assert [r["answer"] for r in out["aime24"]] == ["0", "1", "2"]
    assert out["aime25"][0]["problem"] == "Q"
    assert out["math500"][0]["answer"] == "\\frac{1}{2}"
    with pytest.raises(FileNotFoundError):
        ev.load_benchmarks([str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError):
        ev.load_benchmarks([])


@pytest.mark.slow
def _tiny_eval_inputs(tmp_path, problems: int):
    """A random tiny model (1,000-token BPE) saved under ``tmp_path/hf`` and ``problems`` sums as
    a benchmark file: (the model's directory, the benchmark's path)."""
    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.models import ModelConfig, Qwen3, load_tokenizer, save_hf

    tok = load_tokenizer(1000)
    cfg = ModelConfig.preset("tiny", vocab_size=tok.num_tokens, dtype=jnp.float32,
                             bos_token_id=tok.endoftext_id, eos_token_id=tok.eos_id)
    save_hf(Qwen3(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "hf"), tokenizer=tok)
    bench = tmp_path / "toy.jsonl"
    bench.write_text("\n".join(json.dumps({"problem": f"Compute {i} + {i}.", "answer": str(2 * i)})
                               for i in range(problems)))
    return tmp_path / "hf", bench


def test_run_eval_end_to_end(tmp_path):
    """run_eval on a saved random tiny model: k samples per problem through the real agent loop
    and sandbox; the table agrees with the per-sample rewards, which agree with the verifier."""
    from rstarjax.env import is_correct

    sys_path = __import__("sys").path
    sys_path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "configs"))
    import eval as eval_config

    hf, bench = _tiny_eval_inputs(tmp_path, 3)
    c = eval_config.get_config()
    c.model.hf_path = str(hf)
    c.model.dtype = "float32"
    c.model.tokenizer_num_regular_tokens = 1000
    c.eval.paths = str(bench)
    c.eval.k = 2
    c.eval.max_turns = 2
    c.eval.max_response_len = 24
    c.eval.max_prompt_len = 200
    c.eval.num_slots = 4
    c.eval.chat_format = "compact"
    c.eval.timeout_s = 600.0
    c.rl.num_tool_workers = 1
    c.mesh.fsdp = -1
    from rstarjax.recipes.config import parse

    out = ev.run_eval(parse(c), str(tmp_path / "run"))
    rows = [json.loads(l) for l in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["samples"]) == 2 for r in rows)
    rewards = [s["reward"] for r in rows for s in r["samples"]]
    assert out["toy"]["pass@1"] == pytest.approx(np.mean(rewards))
    for r in rows:
        for s in r["samples"]:
            assert s["response_length"] <= 24
            assert s["reward"] == float(is_correct(s["response"], r["gold"])) or s["finish"] == "max_length"


def _descendant_names(pid: int) -> set[str]:
    """The process names (``comm``) of ``pid``'s children and their children."""
    import os

    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        children.setdefault(int(rest[1]), []).append(int(entry))
        names[int(entry)] = name
    found, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(names[child])
            stack.append(child)
    return found


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_mid_evaluation_ends_in_one_line(tmp_path, signame):
    """SIGINT / SIGTERM while the evaluation rolls out: one line saying what was kept, exit
    128 + the signal, no result files. Before, Ctrl-C aborted the interpreter under the rollout
    threads (exit 134, "terminate called after throwing ...") and SIGTERM killed it silently."""
    import os
    import signal
    import subprocess
    import sys
    import time

    hf, bench = _tiny_eval_inputs(tmp_path, 4)
    root = __import__("pathlib").Path(__file__).parents[1]
    flags = {"model.hf_path": hf, "model.dtype": "float32", "model.tokenizer_num_regular_tokens": 1000,
             "eval.paths": bench, "eval.k": 16, "eval.max_turns": 4, "eval.max_response_len": 400,
             "eval.max_prompt_len": 200, "eval.num_slots": 4, "eval.chat_format": "compact",
             "rl.num_tool_workers": 1, "logging.progress_bar": False}
    out = tmp_path / "log"
    with open(out, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rstarjax.main", f"--config={root}/configs/eval.py",
                                 f"--workdir={tmp_path / 'run'}", *(f"--config.{k}={v}" for k, v in flags.items())],
                                cwd=root, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        deadline = time.monotonic() + 300
        while "rj-zygote" not in _descendant_names(proc.pid):  # the code pool starts right before the rollouts
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(getattr(signal, signame))
        status = proc.wait(timeout=120)
    finally:
        proc.kill()
    log_text = out.read_text()
    assert status == 128 + getattr(signal, signame), log_text[-3000:]
    assert f"stopped on {signame}: abandoned the evaluation in progress" in log_text, log_text[-3000:]
    assert "Fatal Python error" not in log_text and "Traceback" not in log_text, log_text[-3000:]
    assert not (tmp_path / "run" / "eval_results.json").exists()


def test_run_eval_evaluates_the_checkpoint_init_from_names(tmp_path, monkeypatch):
    """With ``checkpoint.init_from`` (a run's checkpoints) the evaluated policy holds that
    checkpoint's weights, not ``model.hf_path``'s (they were ignored: the base model was scored);
    an init_from without a checkpoint is one line before any model is built."""
    import sys

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.models import ModelConfig, Qwen3, load_tokenizer, save_hf
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import StageError

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "configs"))
    import eval as eval_config

    tok = load_tokenizer(1000)
    cfg = ModelConfig.preset("tiny", vocab_size=tok.num_tokens, dtype=jnp.float32,
                             bos_token_id=tok.endoftext_id, eos_token_id=tok.eos_id)
    save_hf(Qwen3(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "hf"), tokenizer=tok)
    trained = nnx.state(Qwen3(cfg, rngs=nnx.Rngs(5)), nnx.Param)
    with ckpt_lib.Checkpointer(str(tmp_path / "run" / "checkpoints"), ckpt_lib.CheckpointConfig(async_save=False)) as ck:
        ck.save(4, {"params": trained}, {"step": 4})
    (tmp_path / "empty").mkdir()
    bench = tmp_path / "toy.jsonl"
    bench.write_text(json.dumps({"problem": "Compute 1 + 1.", "answer": "2"}) + "\n")

    class Built(Exception):
        pass

    def rollouts(model, *args, **kwargs):  # where the run starts sampling: the policy it samples from
        raise Built(model)

    monkeypatch.setattr(ev.build, "rollouts", rollouts)
    class NoPool:  # the code pool, never used: the run stops where it would start sampling
        def close(self, drain_timeout=None):
            pass

    monkeypatch.setattr(ev.build, "executor", lambda *a, **k: NoPool())
    c = eval_config.get_config()
    c.model.hf_path, c.model.dtype, c.model.tokenizer_num_regular_tokens = str(tmp_path / "hf"), "float32", 1000
    c.eval.paths, c.mesh.fsdp = str(bench), -1
    c.checkpoint.init_from = str(tmp_path / "run" / "checkpoints")
    with pytest.raises(Built) as e:
        ev.run_eval(parse(c), str(tmp_path / "eval"))
    got = nnx.state(e.value.args[0], nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c.checkpoint.init_from = str(tmp_path / "run")  # the workdir, not its checkpoints
    monkeypatch.setattr(ev.build, "policy", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(StageError, match="give its checkpoints"):
        ev.run_eval(parse(c), str(tmp_path / "eval"))


def test_an_over_long_benchmark_prompt_is_skipped_and_counted_before_any_model(tmp_path, monkeypatch, caplog):
    """A benchmark problem whose prompt is longer than ``eval.max_prompt_len`` is skipped with a
    warning naming its row, before the model is built (it failed the whole evaluation after the
    model and the code pool were up); a benchmark left with none is one line (DataError)."""
    import sys

    from rstarjax.io.data import DataError
    from rstarjax.recipes.config import parse

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "configs"))
    import eval as eval_config

    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"problem": "Compute 1 + 1.", "answer": "2"}) + "\n"
                     + json.dumps({"problem": "word " * 3000, "answer": "3"}) + "\n")
    c = eval_config.get_config()
    c.model.preset, c.model.random_init, c.model.tokenizer_num_regular_tokens = "tiny", True, 400
    c.eval.paths, c.eval.max_prompt_len, c.mesh.fsdp = str(bench), 2048, -1
    built = {}
    monkeypatch.setattr(ev.build, "policy", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("built")))
    monkeypatch.setattr(ev, "evaluate_records", lambda datasets, *a, **k: built.update(datasets) or {})
    with pytest.raises(RuntimeError, match="built"):  # reached the model: the long row was dropped first
        with caplog.at_level("WARNING"):
            ev.run_eval(parse(c), str(tmp_path / "eval"))
    assert "prompt_too_long=1 (rows bench.jsonl:2)" in caplog.text
    bench.write_text(json.dumps({"problem": "word " * 3000, "answer": "3"}) + "\n")
    with pytest.raises(DataError, match="every prompt is longer than --config.eval.max_prompt_len=2048"):
        ev.run_eval(parse(c), str(tmp_path / "eval"))


def test_equal_numbers_written_differently_share_a_vote():
    """maj@k: one vote per value where the text writes an exact number (integers with any
    thousands grouping, decimals, integer fractions), so "12", "12.0" and "12.00" are one vote
    as the verifier scores them; "1 2" (two numbers) stays apart from 12; white space elsewhere
    does not split a vote."""
    key = ev.answer_key
    assert key("1 000") == key("1000") == key("1,000") == key("1\\,000")
    assert key("12") == key("12.0") == key("12.00") != key("1 2")
    assert key(r"\frac{1}{2}") == key("0.5") == key(r"\dfrac12") == key("1/2") == key(".50") != key("1/3")
    assert key(r"-\frac{3}{4}") == key("-0.75") == key("-3/4")
    assert key("x = 3") == key("x=3")
    assert key(r"\frac{x}{2}") == key(r"\frac {x} {2}")
    assert key("1/0") == "1/0" and key("3,3") != key("33")
    assert ev.majority_vote(["12", "12.0", "12.00", "7", "7"], [True, True, True, False, False])



def test_load_benchmarks_names_golds_the_verifier_cannot_use_and_keeps_every_row(tmp_path, monkeypatch, caplog):
    """A benchmark is scored over all its problems as published; the rows whose gold the verifier
    cannot use as a mathematical object (an empty box, text it does not parse, a comparison that
    would time out) are counted and named in one warning line instead of loading silently."""
    from rstarjax.io import data as data_lib

    monkeypatch.setattr(data_lib, "VERIFIER_COMPARE_TIMEOUT_S", 1)
    answers = ["\\boxed{}", "3", "}", "\\frac{1}{2}", "10^{10^{10}}"]
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"problem": f"P{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
    with caplog.at_level("WARNING", logger="rstarjax.recipes.evaluate"):
        out = ev.load_benchmarks([str(bench)])
    assert [r["answer"] for r in out["bench"]] == answers
    lines = [r.getMessage() for r in caplog.records if "the verifier cannot use" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("benchmark bench: 3 of 5 rows have a gold answer")
    assert "[the verifier's comparison with it takes over 1 s]" in lines[0]


def test_the_prompt_format_is_the_models_recorded_one_unless_named():
    """eval.chat_format unset: the model's recorded format (else rstar2, a plain HF model's case);
    named: that one, with a warning when the model records another."""
    assert ev.choose_chat_format("", "compact", "meta") == ("compact", None)
    assert ev.choose_chat_format("", None, "meta") == ("rstar2", None)
    assert ev.choose_chat_format("compact", "compact", "meta") == ("compact", None)
    chat, warning = ev.choose_chat_format("rstar2", "compact", "the checkpoint's meta")
    assert chat == "rstar2" and "compact" in warning and "the checkpoint's meta" in warning
    assert ev.choose_chat_format("rstar2_official", None, "meta") == ("rstar2_official", None)


def test_a_hf_directory_records_the_format_its_chat_template_is(tmp_path):
    """save_hf writes the trained format's Jinja template: that names the format; a template of
    no known format (a plain HF model's own) or no tokenizer_config.json names none."""
    from rstarjax.models import load_tokenizer

    tok = load_tokenizer(1000)
    for name in ("compact", "rstar2", "rstar2_official"):
        tok.save_pretrained(tmp_path / name, chat_template=name)
        assert ev.hf_dir_chat_format(str(tmp_path / name)) == name
    tok.save_pretrained(tmp_path / "plain", chat_template="{{ messages[0]['content'] }}")
    assert ev.hf_dir_chat_format(str(tmp_path / "plain")) is None
    assert ev.hf_dir_chat_format(str(tmp_path / "nowhere")) is None
    assert ev.recorded_chat_format(str(tmp_path / "compact"), {"chat_format": "rstar2"})[0] == "rstar2"
    assert ev.recorded_chat_format(str(tmp_path / "compact"), {})[0] is None  # a checkpoint older than the record
    assert ev.recorded_chat_format(str(tmp_path / "compact"), None)[0] == "compact"


def test_eval_results_keep_the_prompt_format(tmp_path):
    rec = [{"uid": "p", "problem": "1+1?", "answer": "2"}]
    group = [_traj(r"\boxed{2}", 1.0, 3)]
    out = ev.evaluate_records({"d": rec}, lambda recs, k: [group], k=1, out_dir=str(tmp_path),
                              chat_format_used="compact")
    assert out["d"]["chat_format"] == "compact"
    assert json.loads((tmp_path / "eval_results.json").read_text())["d"]["chat_format"] == "compact"
    assert "| d |" in (tmp_path / "eval_table.md").read_text()


def test_run_eval_asks_in_the_format_the_model_was_trained_with(tmp_path, monkeypatch, caplog):
    """A model exported with the compact format (the demo's) is evaluated in it when
    eval.chat_format is not given; a named other format is used, with one warning line."""
    import sys

    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.models import ModelConfig, Qwen3, load_tokenizer, save_hf
    from rstarjax.recipes.config import parse

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "configs"))
    import eval as eval_config

    tok = load_tokenizer(1000)
    cfg = ModelConfig.preset("tiny", vocab_size=tok.num_tokens, dtype=jnp.float32,
                             bos_token_id=tok.endoftext_id, eos_token_id=tok.eos_id)
    save_hf(Qwen3(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "hf"), tokenizer=tok, chat_format="compact")
    bench = tmp_path / "toy.jsonl"
    bench.write_text(json.dumps({"problem": "Compute 1 + 1.", "answer": "2"}) + "\n")

    class Built(Exception):
        pass

    def rollouts(model, tokenizer, executor, agent, sampling, max_prompt_len, chat, *args, **kwargs):
        raise Built(chat)  # where the run starts sampling: the format its prompts are in

    class NoPool:
        def close(self, drain_timeout=None):
            pass

    monkeypatch.setattr(ev.build, "rollouts", rollouts)
    monkeypatch.setattr(ev.build, "executor", lambda *a, **k: NoPool())
    c = eval_config.get_config()
    c.model.hf_path, c.model.dtype, c.model.tokenizer_num_regular_tokens = str(tmp_path / "hf"), "float32", 1000
    c.eval.paths, c.mesh.fsdp = str(bench), -1
    with pytest.raises(Built) as e:
        ev.run_eval(parse(c), str(tmp_path / "eval"))
    assert e.value.args[0] == "compact"
    c.eval.chat_format = "rstar2"
    with caplog.at_level("WARNING"), pytest.raises(Built) as e:
        ev.run_eval(parse(c), str(tmp_path / "eval"))
    assert e.value.args[0] == "rstar2"
    assert "--config.eval.chat_format=rstar2 differs from the format the model was trained with (compact" in caplog.text

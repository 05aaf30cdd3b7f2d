"""The embedded demo, CI-sized (configs/demo.py:ci): every stage runs for real (SFT, agent-loop
eval with the sandbox and verifier, GRPO-RoC, export, plots) and the summary is consistent."""
import importlib.util
import json
import pathlib

import pytest

CONFIG = pathlib.Path(__file__).parents[1] / "configs" / "demo.py"


def _config(arg):
    spec = importlib.util.spec_from_file_location("demo_config", CONFIG)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


def test_config_variants():
    full, ci = _config(None), _config("ci")
    assert full.demo.num_eval_problems >= 200  # the README's claim is measured on >= 200 problems
    assert full.rl.oversample == 2 * full.rl.group_size  # RoC samples 2G, keeps G
    assert ci.total_steps < full.total_steps
    with pytest.raises(ValueError):
        _config("bogus")


@pytest.mark.slow
def test_demo_ci_end_to_end(tmp_path):
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.demo import run_demo

    c = _config("ci")
    c.mesh.fsdp = 1
    c.mesh.data = -1
    summary = run_demo(parse(c), str(tmp_path))
    on_disk = json.loads((tmp_path / "demo_summary.json").read_text())
    assert on_disk["num_eval_problems"] == c.demo.num_eval_problems
    for key in ("sft_accuracy", "rl_accuracy"):
        assert 0.0 <= on_disk[key] <= 1.0
    assert on_disk["rl_steps"] == c.total_steps
    # the accuracies are what the held-out samples say
    rows = [json.loads(l) for l in (tmp_path / "heldout_samples.jsonl").read_text().splitlines()]
    assert len(rows) == c.demo.num_eval_problems
    assert on_disk["sft_accuracy"] == pytest.approx(sum(r["sft"]["reward"] > 0 for r in rows) / len(rows))
    assert on_disk["rl_accuracy"] == pytest.approx(sum(r["rl"]["reward"] > 0 for r in rows) / len(rows))
    # per-kind figures: each kind's accuracy is what its held-out samples say
    from rstarjax.recipes.demo_tasks import kind_of
    for phase in ("sft", "rl"):
        for kind, acc in on_disk[phase]["accuracy_by_kind"].items():
            mine = [r[phase]["reward"] > 0 for r in rows if kind_of(r["problem"]) == kind]
            assert acc == pytest.approx(sum(mine) / len(mine), abs=1e-4)
        assert 0.0 <= on_disk[phase]["tool_call_rate"] <= 1.0
    # held-out problems never appear in the SFT or RL training data
    train = {json.loads(l)["problem"] for l in (tmp_path / "rl_train.jsonl").read_text().splitlines()}
    sft = {json.loads(l)["messages"][0]["content"] for l in (tmp_path / "sft_traces.jsonl").read_text().splitlines()}
    assert not ({r["problem"] for r in rows} & (train | sft))
    assert (tmp_path / "hf" / "config.json").exists()
    assert (tmp_path / "plots" / "reward.png").exists() and (tmp_path / "plots" / "sft_loss.png").exists()
    with pytest.raises(FileExistsError):
        run_demo(parse(c), str(tmp_path))
    assert summary["sft_accuracy"] == on_disk["sft_accuracy"]

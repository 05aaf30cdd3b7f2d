"""rstarjax.report: curves from metrics.jsonl written by the real MetricsWriter, PNG output."""
import json
import subprocess
import sys

import numpy as np
import pytest

from rstarjax import report
from rstarjax.io.metrics_log import MetricsWriter


def _write_run(path, rewards, tool_err, offset=0):
    with MetricsWriter(str(path), tensorboard=False) as w:
        for i, (r, e) in enumerate(zip(rewards, tool_err)):
            w.write(i + 1 + offset, {"rollout/reward_mean": r, "rollout_all/reward_mean": r / 2,
                                     "rollout/tool_error_ratio_positive": e,
                                     "roc/tool_error_ratio_positive_before": 2 * e,
                                     "rollout/response_length_mean": 100.0 + i, "train/lr": float("nan")})


def test_curve_keeps_last_record_per_step_and_drops_non_finite():
    recs = [{"step": 1, "a": 1.0}, {"step": 2, "a": 5.0}, {"step": 2, "a": 6.0}, {"step": 3, "a": "nan"},
            {"step": 4, "b": 1.0}, {"step": 5, "a": 7}]
    assert report.curve(recs, "a") == ([1, 2, 5], [1.0, 6.0, 7.0])
    assert report.curve(recs, "missing") == ([], [])


def test_render_writes_pngs(tmp_path):
    import matplotlib.image

    _write_run(tmp_path / "logs", [0.1, 0.3, 0.5], [0.2, 0.1, 0.05])
    with MetricsWriter(str(tmp_path / "sft" / "logs"), tensorboard=False) as w:
        for s in range(1, 4):
            w.write(s, {"sft/loss": 3.0 / s, "sft/lr": 1e-3})
    paths = report.render(str(tmp_path))
    names = sorted(p.rsplit("/", 1)[1] for p in paths)
    assert names == ["learning_rate.png", "response_length.png", "reward.png", "sft_loss.png",
                     "tool_error_positive.png"]  # no truncation / tool-call data: no empty plots
    img = matplotlib.image.imread(paths[0])
    assert img.ndim == 3 and img.shape[0] > 100 and np.std(img) > 0


def test_compare_reports_each_run(tmp_path):
    _write_run(tmp_path / "roc" / "logs", [0.2, 0.4], [0.1, 0.3])
    _write_run(tmp_path / "grpo" / "logs", [0.2, 0.3], [0.4, 0.6])
    out = report.compare([str(tmp_path / "roc"), str(tmp_path / "grpo")], str(tmp_path / "plots"))
    assert out["roc"]["tool_error_ratio_positive"] == pytest.approx(0.2)
    assert out["grpo"]["tool_error_ratio_positive"] == pytest.approx(0.5)
    assert out["grpo"]["tool_error_ratio_positive_all_rollouts"] == pytest.approx(1.0)
    assert out["roc"]["steps"] == 2
    assert (tmp_path / "plots" / "compare_tool_error_positive.png").exists()


def test_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError):
        report.render(str(tmp_path))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text('{"step": 1, "sft/loss": 1.0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        report.render(str(tmp_path))
    # a torn last line (killed mid-write) is tolerated
    (tmp_path / "logs" / "metrics.jsonl").write_text('{"step": 1, "sft/loss": 1.0}\n{"step": 2, "sft/lo')
    assert [p.rsplit("/", 1)[1] for p in report.render(str(tmp_path))] == ["sft_loss.png"]
    # a run that logged no step yet: an error saying so, not an exit 0 that wrote nothing
    (tmp_path / "logs" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="nothing to plot.*no step"):
        report.render(str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "rstarjax.report", str(tmp_path / "nothing")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no metrics.jsonl" in r.stderr


def test_compare_keeps_every_run_and_prints_strict_json(tmp_path):
    """Two runs both named ``run`` were one (the second overwrote the first) and fewer labels than
    runs dropped the rest, exit 0: now each is labelled by its path, labels must be one a run, and
    the summary is strict JSON (a figure with no data is null, never NaN)."""
    _write_run(tmp_path / "a" / "run" / "logs", [0.2, 0.4], [0.1, 0.3])
    _write_run(tmp_path / "b" / "run" / "logs", [0.8, 1.0], [0.0, 0.0])
    runs = [str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")]
    assert report.run_labels(runs) == ["a/run", "b/run"]
    out = report.compare(runs, str(tmp_path / "plots"))
    assert sorted(out) == ["a/run", "b/run"] and out["b/run"]["reward_mean"] == pytest.approx(0.45)
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        report.compare(runs, str(tmp_path / "plots"), ["A"])
    r = subprocess.run([sys.executable, "-m", "rstarjax.report", runs[0], "--compare", runs[1],
                        "--out", str(tmp_path / "plots")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert sorted(printed) == ["a/run", "b/run"]


@pytest.mark.parametrize("line", ["[1, 2]", '{"step": null, "sft/loss": 1.0}'])
def test_a_record_that_is_no_object_or_has_no_step_is_said_not_a_traceback(tmp_path, line):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text(f'{{"step": 1, "sft/loss": 1.0}}\n{line}\n{{"step": 2, "sft/loss": 0.5}}\n')
    r = subprocess.run([sys.executable, "-m", "rstarjax.report", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    if line.startswith("["):
        assert r.returncode == 2 and "line 2 is not a JSON object" in r.stderr, r.stderr
    else:  # a record without a usable step draws no point; the others do
        assert r.returncode == 0 and r.stdout.strip().endswith("sft_loss.png"), r.stderr

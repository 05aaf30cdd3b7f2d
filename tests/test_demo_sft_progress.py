"""The demo's SFT stage over a long run: a progress line every few dozen steps, periodic
checkpoints a re-run resumes from, and a re-run after SFT finished that reports the SFT it
resumed (its losses and time), not "nan -> nan (0s)"."""
import importlib.util
import json
import math
import pathlib

import pytest

from rstarjax.recipes import demo

ROOT = pathlib.Path(__file__).parents[1]


def test_durations_read_as_an_eta():
    assert [demo.duration(s) for s in (0, 44.6, 60, 725, 3780, float("nan"))] == [
        "0s", "45s", "1m00s", "12m05s", "1h03m", "?"]


def test_a_progress_line_every_n_steps_with_the_pace_after_the_first_step():
    """Lines at steps 50, 100, ... (not at the last: the summary line reports it); the pace counts
    from the end of the first step, whose compile would otherwise make the ETA hours long."""
    lines, now = [], [0.0]
    progress = demo.SFTProgress(50, say=lines.append, clock=lambda: now[0])
    for step in range(1, 151):
        now[0] = 100.0 + 0.5 * step if step > 1 else 60.0  # the first step: 60 s of compile
        progress(step, 150, {"sft/loss": 3.0 / step})
    assert lines == [demo.sft_progress_line(50, 150, 3.0 / 50, 49 / (125.0 - 60.0)),
                     demo.sft_progress_line(100, 150, 3.0 / 100, 99 / (150.0 - 60.0))]
    assert lines[0].startswith("SFT step 50/150: loss 0.060, 0.75 steps/s, ETA 2m13s")


def test_a_ci_sized_sft_prints_no_progress_line():
    lines = []
    progress = demo.SFTProgress(demo.SFT_PROGRESS_EVERY, say=lines.append)
    for step in range(1, 5):
        progress(step, 4, {"sft/loss": 1.0})
    assert lines == []


def test_a_progress_line_after_a_resume_counts_from_the_resumed_step():
    lines, now = [], [0.0]
    progress = demo.SFTProgress(50, say=lines.append, clock=lambda: now[0])
    for step in range(201, 251):
        now[0] = float(step)
        progress(step, 1000, {"sft/loss": 1.0})
    assert lines == [demo.sft_progress_line(250, 1000, 1.0, 1.0)]


FINISHED = {"steps": 4, "start_step": 0, "first_loss": 7.2, "final_loss": 6.1, "seconds": 93.0}


def test_a_rerun_after_sft_finished_keeps_the_runs_losses_and_time():
    fresh = {"steps": 4, "start_step": 4, "first_loss": math.nan, "final_loss": math.nan, "seconds": 0.01}
    s = demo.resumed_sft_summary(fresh, FINISHED, {1: 7.2, 4: 6.1})
    assert (s["first_loss"], s["final_loss"], s["seconds"], s["resumed_at_step"]) == (7.2, 6.1, 93.0, 4)
    assert demo.sft_summary_line(s) == ("SFT: resumed at step 4 of 4 (nothing left to train); "
                                        "loss 7.200 -> 6.100 (93s)")
    assert demo.resumed_timing_note(s) == {
        "sft_resumed_at_step": 4,
        "timing_note": "resumed at SFT step 4: wall_seconds and rl_seconds are this process's; sft_seconds: 93s"}
    # no saved summary (a workdir of an older version): the losses from the log, the time said unknown
    s = demo.resumed_sft_summary(fresh, None, {1: 7.2, 4: 6.1})
    assert (s["first_loss"], s["final_loss"]) == (7.2, 6.1)
    assert demo.sft_summary_line(s) == ("SFT: resumed at step 4 of 4 (nothing left to train); loss 7.200 -> 6.100 "
                                        "(time unknown: an earlier run trained it)")
    assert "nan" not in demo.sft_summary_line(s)


def test_a_run_resumed_mid_sft_says_what_its_time_covers():
    fresh = {"steps": 1000, "start_step": 200, "first_loss": 2.0, "final_loss": 0.5, "seconds": 480.0}
    s = demo.resumed_sft_summary(fresh, None, {1: 7.0, 200: 2.1})
    assert s["first_loss"] == 7.0 and s["final_loss"] == 0.5
    assert demo.sft_summary_line(s) == ("SFT: resumed at step 200, trained to step 1000; loss 7.000 -> 0.500 "
                                        "(480s for steps 201-1000)")
    assert demo.resumed_sft_summary(dict(FINISHED), None, {}) == FINISHED  # not resumed: as trained
    assert demo.resumed_timing_note(FINISHED) == {}
    assert demo.sft_summary_line(FINISHED) == "SFT: 4 steps, loss 7.200 -> 6.100 (93s)"


def _ci_run():
    spec = importlib.util.spec_from_file_location("demo_config", ROOT / "configs" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config("ci")
    c.mesh.fsdp, c.mesh.data = 1, -1
    c.demo.num_sft_problems, c.sft.batch_size = 16, 4  # 4 steps
    from rstarjax.recipes.config import parse
    return parse(c)


def test_sft_checkpoints_periodically_and_a_rerun_resumes_it(tmp_path, monkeypatch, capsys):
    """Stopped after step 3 with a checkpoint every 2 steps, the re-run resumes at step 2 (each
    step logged once); a third run, SFT finished, reports the second's losses and time."""
    from rstarjax.recipes import build, demo_tasks

    run = _ci_run()
    tasks = demo_tasks.generate_tasks(run.demo.num_sft_problems, "train", seed=run.seed)
    setup = demo.DemoSetup(build.tokenizer(run.model), build.mesh(run.mesh),
                           {"sft_traces": demo_tasks.make_sft_traces(tasks, seed=run.seed)}, "", 0.0, {})
    monkeypatch.setattr(demo, "SFT_CHECKPOINT_EVERY", 2)

    class Disconnected(Exception):
        pass

    class StopsAfter3(demo.SFTProgress):
        def __call__(self, step, total, metrics):
            if step == 3:
                raise Disconnected

    monkeypatch.setattr(demo, "SFTProgress", StopsAfter3)
    with pytest.raises(Disconnected):
        demo.train_sft_policy(run, setup, str(tmp_path))
    monkeypatch.undo()
    monkeypatch.setattr(demo, "SFT_CHECKPOINT_EVERY", 2)
    _, second = demo.train_sft_policy(run, setup, str(tmp_path))
    assert second["resumed_at_step"] == 2 and second["steps"] == 4
    logged = [json.loads(l) for l in (tmp_path / "sft" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert second["first_loss"] == logged[0]["sft/loss"] and second["final_loss"] == logged[-1]["sft/loss"]
    assert "SFT: resumed at step 2, trained to step 4" in capsys.readouterr().out
    _, third = demo.train_sft_policy(run, setup, str(tmp_path))
    out = capsys.readouterr().out
    assert "SFT: resumed at step 4 of 4 (nothing left to train)" in out and "nan" not in out
    assert (third["first_loss"], third["final_loss"], third["seconds"]) == (
        second["first_loss"], second["final_loss"], second["seconds"])
    assert json.loads((tmp_path / "sft" / "sft_summary.json").read_text())["seconds"] == second["seconds"]

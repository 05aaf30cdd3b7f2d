"""What a run killed at an unlucky moment (SIGKILL, an out-of-memory kill, power loss: no handler
runs, unlike SIGTERM / SIGINT in tests/test_reliability.py) leaves for the next one: a JSONL log
torn mid-line, a summary cut mid-write, a checkpoint mid-save, the workdir's lock. The next run,
``rstarjax.report`` and the stage-3 filter's resume must read past it: no traceback, no hang, no
finished work lost, no damaged data used.
"""
import dataclasses
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from process_support import read_lines_until, worker_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORN = '{"step": 3, "wall_time": 17.5, "train/lo'  # a record a kill cut short: no closing brace, no newline


class Killed(BaseException):
    """A kill in the middle of a write, simulated: nothing after it runs (no ``except Exception``)."""


def kill_while_encoding(monkeypatch, is_target, after_chunks=3):
    """Every JSON encoding of an object ``is_target`` accepts stops with ``Killed`` after
    ``after_chunks`` pieces: ``json.dump`` has written those to the file by then (streamed),
    ``json.dumps`` has written nothing. Other JSON (the metrics, Orbax's meta) is untouched."""
    original = json.JSONEncoder.iterencode

    def iterencode(self, o, _one_shot=False):
        chunks = original(self, o, _one_shot)
        if not is_target(o):
            yield from chunks
            return
        for i, chunk in enumerate(chunks):
            if i == after_chunks:
                raise Killed
            yield chunk

    monkeypatch.setattr(json.JSONEncoder, "iterencode", iterencode)


# ============================================================================ the metrics log
def test_a_metrics_log_torn_in_its_first_record_reads_whole_after_the_resume(tmp_path):
    """Killed while writing step 1's record: the resumed run (from step 0) logs steps 1 and 2
    after it. The torn record was kept (there was no whole record to rewrite the log from) and
    step 1 was glued onto it: ``read_metrics`` (the report, the demo's comparison) raised."""
    from rstarjax.io.metrics_log import MetricsWriter, read_metrics

    logdir = tmp_path / "logs"
    logdir.mkdir()
    (logdir / "metrics.jsonl").write_text(TORN)
    with MetricsWriter(str(logdir), tensorboard=False, resume_step=0) as w:
        w.write(1, {"train/loss": 1.0})
        w.write(2, {"train/loss": 0.5})
    assert [(r["step"], r["train/loss"]) for r in read_metrics(str(logdir / "metrics.jsonl"))] == [(1, 1.0), (2, 0.5)]


def test_a_writer_without_a_resume_step_appends_after_a_torn_line_on_a_line_of_its_own(tmp_path):
    """The demo's SFT writer (no resume step) appends to the log of a demo killed mid-record:
    the first new record was glued onto the torn line, which then sat mid-file, and
    ``rstarjax.report`` failed on it ("line 3 is not JSON")."""
    from rstarjax import report
    from rstarjax.io.metrics_log import MetricsWriter, read_metrics

    logdir = tmp_path / "sft" / "logs"
    logdir.mkdir(parents=True)
    whole = [json.dumps({"step": s, "sft/loss": 2.0 / s}) + "\n" for s in (1, 2)]
    (logdir / "metrics.jsonl").write_text("".join(whole) + TORN)
    with MetricsWriter(str(logdir), tensorboard=False) as w:
        for s in (1, 2, 3):
            w.write(s, {"sft/loss": 1.0 / s})
    records = read_metrics(str(logdir / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 1, 2, 3]  # the rerun's steps, the last of each wins
    assert report.curve(records, "sft/loss") == ([1, 2, 3], [1.0, 0.5, 1.0 / 3])
    assert report.main([str(tmp_path), "--out", str(tmp_path / "plots")]) == 0


def test_a_last_record_whole_but_for_its_newline_is_kept(tmp_path):
    from rstarjax.io.metrics_log import MetricsWriter, read_metrics

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "x": 1.0}))
    with MetricsWriter(str(tmp_path), tensorboard=False, resume_step=1) as w:
        w.write(2, {"x": 2.0})
    assert [r["x"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1.0, 2.0]


# ============================================================================ the stage-3 filter
def _trajectories(records, n, solved):
    from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, ToolErrorCounts, Trajectory

    return [Trajectory(prompt_ids=np.ones(4), segments=[Segment(SegmentKind.MODEL, np.ones(3), np.zeros(3))],
                       turns=1, tool_calls=0, tool_errors=ToolErrorCounts(), answer_tags=1,
                       finish=FinishReason.ANSWERED, reward=float(j < solved[r["problem"]]), group_id=g)
            for g, r in enumerate(records) for j in range(n)]


def test_a_filter_progress_file_torn_by_a_kill_keeps_the_batches_finished_after_it(tmp_path):
    """Killed while writing batch 2's line of the progress file: the rerun rolls out batches 2
    and 3 and records them, and a third run rolls out nothing. Batch 2's new line was glued onto
    the torn one and lost: the third run rolled it out again (hours of rollouts at full size)."""
    from rstarjax.recipes import stage3_filter as F

    records = [{"problem": f"p{i}", "answer": str(i)} for i in range(6)]
    solved = {"p0": 4, "p1": 3, "p2": 4, "p3": 0, "p4": 4, "p5": 1}
    calls = []

    def rollout_fn(recs, n, seed, version):
        calls.append([r["problem"] for r in recs])
        return _trajectories(recs, n, solved)

    path = str(tmp_path / "filtered.jsonl.progress.jsonl")
    F.filter_problems(records[:2], rollout_fn, k=4, batch_prompts=2, seed=0, progress_path=path)
    with open(path, "a") as f:  # batch 2's line, cut short
        f.write('{"key": "0123456789abcdef0123", "start": 2, "cou')
    calls.clear()
    kept, summary = F.filter_problems(records, rollout_fn, k=4, batch_prompts=2, seed=0, progress_path=path)
    assert calls == [["p2", "p3"], ["p4", "p5"]] and summary["resumed_problems"] == 2
    calls.clear()
    again, summary = F.filter_problems(records, rollout_fn, k=4, batch_prompts=2, seed=0, progress_path=path)
    assert calls == [] and summary["resumed_problems"] == 6
    assert [r["problem"] for r in again] == [r["problem"] for r in kept] == ["p1", "p3", "p5"]


# ============================================================================ summaries
def test_a_summary_cut_mid_write_leaves_the_old_file_or_none(tmp_path, monkeypatch):
    """``write_json_atomic``, ``write_jsonl_atomic``: a kill while the new contents are written
    leaves the old file whole (and no file where there was none)."""
    from rstarjax.io import files

    path = str(tmp_path / "summary.json")
    files.write_json_atomic(path, {"kept": 1, "total": 2})
    kill_while_encoding(monkeypatch, lambda o: isinstance(o, dict) and o.get("kept") == 5)
    with pytest.raises(Killed):
        files.write_json_atomic(path, {"kept": 5, "total": 9, "histogram": [1, 2, 3]})
    assert json.loads(open(path).read()) == {"kept": 1, "total": 2}
    with pytest.raises(Killed):
        files.write_json_atomic(str(tmp_path / "new.json"), {"kept": 5, "total": 9})
    assert not os.path.exists(tmp_path / "new.json")


def test_an_sft_run_killed_while_writing_its_summary_reruns_cleanly(tmp_path, monkeypatch, capsys):
    """Killed while ``sft_summary.json`` was written, after the last checkpoint: the rerun
    trains nothing and returns the summary on disk. The summary was written in place (open
    "w", then streamed), so the kill left it cut short and the rerun's ``json.load`` raised a
    JSONDecodeError traceback."""
    from test_sft import NUM_REGULAR, tiny_sft_run

    from rstarjax.models import load_tokenizer
    from rstarjax.recipes import sft

    run = tiny_sft_run(load_tokenizer(NUM_REGULAR), tmp_path, conversations=4)
    workdir = tmp_path / "run"
    with monkeypatch.context() as m:
        kill_while_encoding(m, lambda o: isinstance(o, dict) and "final_loss" in o)
        with pytest.raises(Killed):
            sft.run_sft(run, str(workdir))
    summary = workdir / "sft_summary.json"
    assert not summary.exists() or json.loads(summary.read_text())
    again = sft.run_sft(run, str(workdir))
    assert "nothing to train" in capsys.readouterr().out
    assert json.loads(summary.read_text())["steps"] == again["steps"] == 1


def test_an_sft_export_killed_mid_write_leaves_the_last_whole_model(tmp_path, monkeypatch):
    """``sft.export_hf`` wrote WORKDIR/hf in place: a rerun killed while writing the shards'
    index left the old shards under a torn index (a model that fails to load, or, with other
    shards, loads a mix). Now the directory is written beside it and renamed in whole."""
    from test_sft import NUM_REGULAR, tiny_sft_run

    from rstarjax.models import load_hf, load_tokenizer
    from rstarjax.recipes import sft

    run = tiny_sft_run(load_tokenizer(NUM_REGULAR), tmp_path, conversations=4)
    run = dataclasses.replace(run, sft=dataclasses.replace(run.sft, export_hf=True))
    workdir = tmp_path / "run"
    sft.run_sft(run, str(workdir))
    hf = workdir / "hf"
    index = (hf / "model.safetensors.index.json").read_text()
    with monkeypatch.context() as m:
        kill_while_encoding(m, lambda o: isinstance(o, dict) and "weight_map" in o)
        with pytest.raises(Killed):
            sft.run_sft(run, str(workdir))
    assert (hf / "model.safetensors.index.json").read_text() == index
    load_hf(str(hf))  # loads whole
    assert sorted(p.name for p in workdir.iterdir() if p.name.startswith(".hf")) == []


# ============================================================================ a checkpoint mid-save
KILLED_MID_SAVE = """
import asyncio, sys
import numpy as np
from orbax.checkpoint._src.path import atomicity
from rstarjax.io import checkpoint as ckpt_lib

async def hang(self):  # step 2's arrays and meta are written; the rename that commits it never comes
    print("writing step 2", flush=True)
    await asyncio.sleep(600)

ckpt = ckpt_lib.Checkpointer(sys.argv[1], ckpt_lib.CheckpointConfig(async_save=True))
ckpt.save(1, {"w": np.full((64, 64), 1.0, np.float32)}, {"step": 1})
ckpt.wait()
atomicity.AtomicRenameTemporaryPath.finalize = hang
ckpt.save(2, {"w": np.full((64, 64), 2.0, np.float32)}, {"step": 2})
ckpt.wait()
"""


def test_a_run_killed_mid_save_resumes_from_the_last_committed_step_and_saves_that_step_again(tmp_path):
    """SIGKILL while step 2's checkpoint is written: Orbax left ``2.orbax-checkpoint-tmp`` (no
    rename, so no step 2), the resume restores step 1, and saving step 2 again replaces the
    leftover directory (Orbax removes an unfinished one of the same step)."""
    import jax
    import jax.numpy as jnp

    from rstarjax.io import checkpoint as ckpt_lib

    directory = str(tmp_path / "checkpoints")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_SAVE, directory], env=worker_env(1),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        try:
            read_lines_until(proc, lambda line: line.startswith("writing step 2"), timeout=300)
        except (TimeoutError, EOFError) as e:
            pytest.fail(f"the save never reached its commit: {e}")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert sorted(os.listdir(directory)) == ["1", "2.orbax-checkpoint-tmp"]
    abstract = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(
        jax.devices()[0]))}
    ckpt = ckpt_lib.Checkpointer(directory, ckpt_lib.CheckpointConfig(async_save=False))
    try:
        assert ckpt.all_steps() == [1]
        state, meta, step = ckpt.restore_newest(abstract)
        assert step == 1 and meta["step"] == 1 and float(state["w"][0, 0]) == 1.0
        assert ckpt.save(2, {"w": jnp.full((64, 64), 2.0)}, {"step": 2})
    finally:
        ckpt.close()
    assert sorted(os.listdir(directory)) == ["1", "2"]


# ============================================================================ the workdir lock
def test_a_workdir_whose_run_was_killed_holding_its_lock_starts_the_next_run(tmp_path):
    """The lock is an ``flock``, dropped by the kernel with the killed process; the pid it
    left in the file does not refuse the next run."""
    from rstarjax.main import LOCK_NAME, workdir_lock

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from rstarjax.main import workdir_lock\n"
                               "with workdir_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)",
                               str(tmp_path)], env=worker_env(1), stdout=subprocess.PIPE, text=True)
    try:
        assert read_lines_until(holder, lambda line: True, timeout=120)[-1].strip() == "held"
        stale = (tmp_path / LOCK_NAME).read_text().strip()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    assert stale == str(holder.pid)
    with workdir_lock(str(tmp_path)):
        assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())


# ============================================================================ the next stage's init_from
def test_a_stage_started_from_a_stage_that_stopped_short_of_its_total_steps_says_so(tmp_path):
    """Stage 1 killed at step 6 of 10 (its newest checkpoint: step 6), then stage 2 started from
    it (a chain run with ``;``, or by hand): its start line said only "from step 6 of ...", and
    stage 2 trained on from a stage that had not finished, unnoticed."""
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import start_line
    from tiny_run import tiny_rl_config

    (tmp_path / "train.jsonl").write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
    run = parse(tiny_rl_config(tmp_path / "train.jsonl", 4, **{"trainer.micro_batch_size": 2}))
    meta = {"init_from": "/runs/stage1/checkpoints", "init_from_step": 6, "init_from_stage": "rl",
            "init_from_total_steps": 10}
    line = start_line(run, meta, None, 6)
    assert line.startswith("rstarjax: rl stage fresh at step 6 from step 6 of /runs/stage1/checkpoints (a rl "
                           "checkpoint; that stage ended at step 6 of its total_steps=10")
    assert line.endswith("; training to total_steps=4")
    finished = dict(meta, init_from_step=10)
    assert "ended at" not in start_line(run, finished, None, 10)


# ============================================================================ export
def test_an_export_killed_mid_write_leaves_a_staging_folder_the_next_export_removes(tmp_path):
    """A killed export's hidden ``.OUT.export-*`` folder (a whole model copy) was left for good;
    the next export beside it removes it, and keeps one a live export still writes into."""
    from rstarjax.export import staging_dir
    from rstarjax.io.files import remove_abandoned_stagings

    out = tmp_path / "hf"
    script = ("import sys, time; from rstarjax.export import staging_dir\n"
              "s = staging_dir(sys.argv[1]); open(s.path + '/model-00001.safetensors', 'w').write('x' * 1000)\n"
              "print(s.path, flush=True); time.sleep(60)")
    writers = [subprocess.Popen([sys.executable, "-c", script, str(out)], env=worker_env(1),
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    killed, live = writers
    try:
        killed_path, live_path = (read_lines_until(w, lambda line: True, timeout=120)[-1].strip() for w in writers)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        assert os.path.isdir(killed_path)  # what a kill leaves
        (tmp_path / ".hf2.export-keep").mkdir()  # another --out's staging: not ours to judge
        (tmp_path / ".hf.export-old").mkdir()  # from before staging folders had locks
        (tmp_path / ".hf.export-old.replaced").mkdir()
        mine = staging_dir(str(out))
        try:
            assert not os.path.exists(killed_path) and not os.path.exists(killed_path + ".lock")
            assert os.path.isdir(live_path) and os.path.exists(live_path + ".lock")
            assert not (tmp_path / ".hf.export-old").exists()
            assert not (tmp_path / ".hf.export-old.replaced").exists()
            assert (tmp_path / ".hf2.export-keep").is_dir()
            assert remove_abandoned_stagings(str(out)) == []  # the live one and ours are held
        finally:
            mine.close()
        assert not os.path.exists(mine.path) and not os.path.exists(mine.lock_path)
    finally:
        for w in writers:
            w.kill()
            w.wait(timeout=30)
    assert remove_abandoned_stagings(str(out)) == [live_path]  # killed too now
    assert os.listdir(tmp_path) == [".hf2.export-keep"]

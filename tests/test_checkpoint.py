"""Checkpoints: save/restore round trip, keep-N, and SIGKILL-resume determinism of the RL loop.

The resume test runs the real ``run_rl`` loop (tiny model, real RoC / advantages / batch / loss /
optimizer / Orbax) in subprocesses with a deterministic stand-in for the rollout engine, kills
one with SIGKILL after a checkpoint, resumes it, and compares its final parameters with an
uninterrupted run. This file doubles as the worker: ``python tests/test_checkpoint.py WORKDIR N``.
"""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from process_support import output_of, worker_env
from tiny_run import tiny_rl_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))


# ------------------------------------------------------------------------------ worker side
def fake_rollout_fn(records, n, seed, policy_version):
    """Deterministic trajectories from (problem text, seed): what an engine would return."""
    from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, ToolErrorCounts, Trajectory

    out = []
    for g, rec in enumerate(records):
        h = int(hashlib.sha256(rec["problem"].encode()).hexdigest()[:8], 16)
        rng = np.random.default_rng([h, seed])
        prompt = rng.integers(1, 500, size=rng.integers(2, 8)).astype(np.int32)
        for j in range(n):
            k = int(rng.integers(1, 6))
            segs = [Segment(SegmentKind.MODEL, rng.integers(1, 500, k), -rng.random(k) * 3)]
            if rng.random() < 0.5:
                segs.append(Segment(SegmentKind.TOOL, rng.integers(1, 500, 2)))
                segs.append(Segment(SegmentKind.MODEL, rng.integers(1, 500, 2), -rng.random(2) * 3))
            calls = int(rng.integers(0, 3))
            out.append(Trajectory(
                prompt_ids=prompt, segments=segs, turns=len(segs), tool_calls=calls,
                tool_errors=ToolErrorCounts(execution=int(rng.integers(0, calls + 1))),
                answer_tags=int(rng.integers(0, 3)), finish=FinishReason.ANSWERED,
                # half right, half wrong: every group keeps a learning signal through RoC
                reward=float((j + h) % 2 == 0), group_id=g, policy_version=policy_version))
    if os.environ.get("WORKER_SLOW"):
        time.sleep(float(os.environ["WORKER_SLOW"]))
    return out


def worker_config(workdir, total_steps, in_process=False):
    return tiny_rl_config(os.path.join(workdir, "train.jsonl"), total_steps, in_process=in_process, **{
        "optim.learning_rate": 1e-3, "optim.warmup_steps": 2, "trainer.micro_batch_size": 2,
        "checkpoint.every_steps": 1, "checkpoint.keep": 2})


def in_process_config(workdir, total_steps):
    """``worker_config`` for a stage run inside the test process: a one-device mesh, no
    TensorBoard, checkpoints written before the step returns."""
    return worker_config(workdir, total_steps, in_process=True)


def worker(workdir, total_steps):
    import jax
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl

    cfg = worker_config(workdir, total_steps)
    tr = run_rl(parse(cfg), workdir, rollout_fn=fake_rollout_fn)
    np.savez(os.path.join(workdir, "final.npz"), *[np.asarray(x) for x in jax.tree.leaves(tr.state.params)])


def write_data(workdir, n=7):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "train.jsonl"), "w") as f:
        for i in range(n):
            f.write(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n")


def launch(workdir, steps, slow=None):
    env = worker_env(2)
    if slow:
        env["WORKER_SLOW"] = str(slow)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), workdir, str(steps)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(proc, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker timed out:\n{output_of(proc)[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def committed_steps(ckpt_dir):
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(int(d) for d in os.listdir(ckpt_dir)
                  if d.isdigit() and os.path.exists(os.path.join(ckpt_dir, d, "commit_success.txt")))


# ------------------------------------------------------------------------------ tests
@pytest.mark.slow
def test_sigkill_and_resume_reaches_the_same_parameters(tmp_path):
    steps = 4
    ref, killed = str(tmp_path / "ref"), str(tmp_path / "killed")
    write_data(ref)
    write_data(killed)  # 7 problems, 2 per step: the data order wraps an epoch, and must resume right

    proc = launch(killed, steps, slow=1.0)
    ref_proc = launch(ref, steps)
    deadline = time.time() + 400
    while not any(s >= 2 for s in committed_steps(os.path.join(killed, "checkpoints"))):
        assert proc.poll() is None, output_of(proc)[-3000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    done_before = committed_steps(os.path.join(killed, "checkpoints"))
    assert max(done_before) < steps

    finished(ref_proc, 400)
    finished(launch(killed, steps), 400)

    a = np.load(os.path.join(ref, "final.npz"))
    b = np.load(os.path.join(killed, "final.npz"))
    assert len(a.files) == len(b.files) > 0
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k])
    # the resumed run really resumed (it did not start again from step 0)
    logged = [json.loads(line)["step"] for line in open(os.path.join(killed, "logs", "metrics.jsonl"))]
    assert logged.count(1) == 1 and logged[-1] == steps
    # and the run did learn at every step
    from rstarjax.io.metrics_log import read_metrics
    recs = read_metrics(os.path.join(ref, "logs", "metrics.jsonl"))
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    assert all(r["train/grad_norm"] > 0 for r in recs)
    assert committed_steps(os.path.join(ref, "checkpoints")) == [steps - 1, steps]  # keep=2


def test_checkpointer_round_trip_keep_n_and_meta(tmp_path):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rstarjax.models import sharding as sharding_lib
    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.rl.trainer import TrainState

    mesh = sharding_lib.make_mesh(1, 4, 2)
    shard = NamedSharding(mesh, P("fsdp", "tensor"))
    rep = NamedSharding(mesh, P())
    rng = np.random.default_rng(0)

    def state(i):
        w = jax.device_put(rng.normal(size=(8, 6)).astype(np.float32), shard)
        return TrainState({"w": w, "b": jax.device_put(np.float32(i), rep)},
                          {"mu": jax.device_put(np.full((8, 6), i, np.float32), shard)},
                          jax.device_put(jnp.int32(i), rep))

    saved = {}
    with ckpt_lib.Checkpointer(str(tmp_path / "c"), ckpt_lib.CheckpointConfig(every_steps=1, keep=2)) as ck:
        for i in (1, 2, 3):
            saved[i] = jax.device_get(state(i))
            ck.save(i, state(i) if False else jax.device_put(saved[i], TrainState(
                {"w": shard, "b": rep}, {"mu": shard}, rep)),
                {"step": i, "rng": ckpt_lib.key_to_json(jax.random.key(i)), "data_state": {"next_index": i}})
        ck.wait()
        assert ck.all_steps() == [2, 3]
        target = TrainState({"w": shard, "b": rep}, {"mu": shard}, rep)
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=s),
                                saved[3], target)
        got, meta = ck.restore(abstract)
    np.testing.assert_array_equal(np.asarray(got.params["w"]), saved[3].params["w"])
    assert got.params["w"].sharding == shard
    assert int(got.step) == 3 and meta["data_state"] == {"next_index": 3}
    assert jnp.array_equal(jax.random.key_data(ckpt_lib.key_from_json(meta["rng"])),
                           jax.random.key_data(jax.random.key(3)))
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
        ckpt_lib.Checkpointer(str(tmp_path / "empty")).restore(abstract)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))


def _stage_config(init_from, reset):
    from rstarjax.io.checkpoint import CheckpointConfig
    from rstarjax.recipes.config import RunConfig

    return RunConfig(checkpoint=CheckpointConfig(init_from=init_from, reset_optimizer=reset))


def test_stage_handoff_keeps_or_resets_the_optimizer(tmp_path):
    """init_from a previous stage: params and step always carry over; the optimizer state too,
    unless reset_optimizer (stage 3, §4.3) gives fresh AdamW moments."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_trainer import tiny_model

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes.rl import initial_state
    from rstarjax.rl import optim as optim_lib
    from rstarjax.rl import trainer as trainer_lib
    from rstarjax.rl.loss import LossConfig

    mesh = sharding_lib.make_mesh(1, 2, 2, devices=jax.devices()[:4])

    def make():
        return trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(), LossConfig(),
                                   trainer_lib.TrainerConfig(), mesh=mesh)

    prev = make()
    # a "trained" previous stage: shifted params, non-zero moments, step 7
    prev.state = trainer_lib.TrainState(
        jax.tree.map(lambda x: x + 1.0, prev.state.params),
        jax.tree.map(lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.floating) else x + 3, prev.state.opt_state),
        prev.state.step + 7)
    src = str(tmp_path / "stage2")
    with ckpt_lib.Checkpointer(src) as ck:
        ck.save(7, prev.state, {"step": 7})
    want_params = [np.asarray(x) for x in jax.tree.leaves(prev.state.params)]
    want_opt = [np.asarray(x) for x in jax.tree.leaves(prev.state.opt_state)]

    for reset in (False, True):
        nxt = make()
        fresh_opt = [np.asarray(x) for x in jax.tree.leaves(nxt.state.opt_state)]
        own = ckpt_lib.Checkpointer(str(tmp_path / f"stage3_{reset}"))
        meta = initial_state(nxt, own, _stage_config(src, reset))
        own.close()
        assert nxt.step == 7 and meta["step"] == 7 and "data_state" not in meta
        for a, b in zip(jax.tree.leaves(nxt.state.params), want_params):
            np.testing.assert_array_equal(np.asarray(a), b)
        expected_opt = fresh_opt if reset else want_opt
        for a, b in zip(jax.tree.leaves(nxt.state.opt_state), expected_opt):
            np.testing.assert_array_equal(np.asarray(a), b)
        assert jax.tree.leaves(nxt.state.params)[0].sharding == jax.tree.leaves(nxt.param_sharding)[0]


# ------------------------------------------------------------------------------ integrity (issue 47)
def _numpy_fingerprint(a: np.ndarray) -> int:
    """The fingerprint recomputed in numpy from its definition (checkpoint._leaf_fingerprint):
    each uint32 word of the array's bits mixed with its flat position, summed modulo 2**32."""
    a = np.ascontiguousarray(a)
    w = (a.view(np.uint32) if a.dtype.itemsize == 4 else a.view(np.uint16).astype(np.uint32)).ravel()
    pos = np.arange(w.size, dtype=np.uint64).astype(np.uint32)
    h = (w ^ (pos * np.uint32(0x9E3779B9))) * np.uint32(0x85EBCA6B)
    h = (h ^ (h >> np.uint32(13))) * np.uint32(0xC2B2AE35)
    return int(np.sum(h ^ (h >> np.uint32(16)), dtype=np.uint32))


def test_fingerprints_match_numpy_and_do_not_depend_on_the_mesh():
    """The same array, on one device or sharded over eight in two layouts, has one fingerprint,
    the one numpy computes from the definition; one changed element or two swapped rows change it."""
    import jax
    import ml_dtypes
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.models import sharding as sharding_lib

    rng = np.random.default_rng(0)
    arrays = {"w": rng.normal(size=(16, 24)).astype(np.float32),
              "h": rng.normal(size=(8, 32)).astype(ml_dtypes.bfloat16),
              "count": np.int32(7)}
    want = {k: _numpy_fingerprint(np.asarray(v)) for k, v in arrays.items()}
    one = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), arrays)
    assert ckpt_lib.finite_and_fingerprints(one) == (True, want)
    mesh = sharding_lib.make_mesh(1, 4, 2)
    for spec in (P("fsdp", "tensor"), P("tensor", "fsdp")):
        sharded = {"w": jax.device_put(arrays["w"], NamedSharding(mesh, spec)),
                   "h": jax.device_put(arrays["h"], NamedSharding(mesh, spec)),
                   "count": jax.device_put(arrays["count"], NamedSharding(mesh, P()))}
        assert len(sharded["w"].sharding.device_set) == 8
        assert ckpt_lib.finite_and_fingerprints(sharded)[1] == want
    changed = arrays["w"].copy()
    changed[3, 5] = np.nextafter(changed[3, 5], np.float32(np.inf))
    swapped = arrays["w"][[1, 0] + list(range(2, 16))]
    for other in (changed, swapped):
        assert ckpt_lib.finite_and_fingerprints({"w": other})[1]["w"] != want["w"]


def _small_state(i):
    import jax.numpy as jnp

    from rstarjax.rl.trainer import TrainState

    rng = np.random.default_rng(i)  # random bits: the array files hold about their size in bytes
    return TrainState({"w": jnp.asarray(rng.normal(size=(256, 512)).astype(np.float32)),
                       "b": jnp.asarray(rng.normal(size=(512,)).astype(np.float32))},
                      {"mu": jnp.asarray(rng.normal(size=(256, 512)).astype(np.float32))}, jnp.int32(i))


def _largest_array_file(step_dir):
    import glob

    files = [f for f in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
             if os.path.isfile(f)]
    assert files, os.listdir(step_dir)
    return max(files, key=os.path.getsize)


def damage(step_dir, how, other_dir=None):
    """``cut``: the largest array file cut to a third (a torn copy); ``bytes@F``: 4 KB of random
    bytes written over it at fraction F of its length (a bad disk block); ``swap``: the array files
    of ``other_dir`` (another checkpoint of the same shapes) in their place, every file valid (a
    copy gone wrong: what only the fingerprints can tell)."""
    import shutil

    if how == "swap":
        shutil.rmtree(os.path.join(step_dir, "state"))
        shutil.copytree(os.path.join(other_dir, "state"), os.path.join(step_dir, "state"))
        return
    path = _largest_array_file(step_dir)
    with open(path, "rb") as f:
        data = f.read()
    if how == "cut":
        data = data[: len(data) // 3]
    else:
        at = int(float(how.split("@")[1]) * (len(data) - 4096))
        data = data[:at] + np.random.default_rng(at).bytes(4096) + data[at + 4096:]
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("how", ["cut", "bytes@0.05", "bytes@0.5", "bytes@0.95", "swap"])
def test_a_damaged_newest_checkpoint_falls_back_with_one_warning(tmp_path, caplog, how):
    """Steps 1 and 2 saved, then step 2's largest array file damaged: the resume restores step 1
    exactly, with one warning line naming step 2's directory and why, and sets step 2 aside.
    With step 1 damaged too, nothing restores: one ``CheckpointError`` line naming both."""
    import jax

    from rstarjax.io import checkpoint as ckpt_lib

    directory = str(tmp_path / "c")
    with ckpt_lib.Checkpointer(directory, ckpt_lib.CheckpointConfig(async_save=False)) as ck:
        for i in (1, 2, 3):
            ck.save(i, _small_state(i), {"step": i})
    spare = str(tmp_path / "spare")  # step 3's files, for "swap"
    os.rename(os.path.join(directory, "3"), spare)
    damage(os.path.join(directory, "2"), how, spare)
    want = jax.device_get(_small_state(1))
    abstract = ckpt_lib.abstract_like(_small_state(0))
    with ckpt_lib.Checkpointer(directory) as ck, caplog.at_level("WARNING"):
        caplog.clear()
        state, meta, step = ck.restore_newest(abstract)
    assert step == 1 and meta["step"] == 1
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("rstarjax")]
    assert len(warnings) == 1 and len(warnings[0].splitlines()) == 1, warnings
    assert f"checkpoint {directory}/2 does not restore (" in warnings[0]
    assert "resuming from step 1 of" in warnings[0]
    assert sorted(os.listdir(directory)) == ["1", "2.unreadable"]

    damage(os.path.join(directory, "1"), how, spare)
    with ckpt_lib.Checkpointer(directory) as ck:
        with pytest.raises(ckpt_lib.CheckpointError, match=r"no checkpoint in .* restores: step 1: ") as e:
            ck.restore_newest(abstract)
    assert len(str(e.value).splitlines()) == 1


def test_the_loop_waits_for_the_copy_not_the_write(tmp_path):
    """An async save returns once the arrays are off the device: with a write made slow (Orbax's
    background commit held 3 s, as a slow disk would), the caller's wait is a small fraction of
    the write, and ``write_seconds`` reports the write once it committed."""
    import time as time_lib

    from rstarjax.io import checkpoint as ckpt_lib

    slow_s = 3.0
    with ckpt_lib.Checkpointer(str(tmp_path / "c"), ckpt_lib.CheckpointConfig(every_steps=1)) as ck:
        committed = ck._write_committed

        def slow_commit():  # runs on Orbax's finalize thread, after the files are written
            time_lib.sleep(slow_s)
            committed()

        ck._write_committed = slow_commit
        ck.save(1, _small_state(1), {"step": 1})  # compiles the check pass
        ck.wait()
        assert ck.write_seconds() >= slow_s
        t0 = time_lib.perf_counter()
        ck.save(2, _small_state(2), {"step": 2})
        waited = time_lib.perf_counter() - t0
        assert ck.write_seconds() is None  # still writing
        ck.wait()
        written = ck.write_seconds()
    assert written is not None and written >= slow_s
    assert waited < written / 3, (waited, written)


def _run_logged_stage(tmp_path, monkeypatch, steps: int, **checkpoint):
    """A tiny in-process RL stage saving every step, with these ``checkpoint`` settings; its
    metrics records."""
    import jax

    from rstarjax.io.metrics_log import read_metrics
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path / "run")
    write_data(workdir)
    c = in_process_config(workdir, steps)
    c.checkpoint.async_save = True
    for key, value in checkpoint.items():
        setattr(c.checkpoint, key, value)
    run_rl(parse(c), workdir, rollout_fn=fake_rollout_fn)
    return read_metrics(os.path.join(workdir, "logs", "metrics.jsonl")), workdir


def test_the_rl_loop_logs_the_checkpoint_wait_and_its_write_apart(tmp_path, monkeypatch):
    """With the copy in the loop (``background_copy=False``) each saving step logs the loop's
    wait (``time/checkpoint``) and Orbax's copy off the device within it
    (``time/checkpoint_copy``); the background write (``time/checkpoint_write``) is logged once it
    committed, the stage's last one with its last step."""
    recs, _ = _run_logged_stage(tmp_path, monkeypatch, 2, background_copy=False)
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert 0 < r["time/checkpoint_copy"] <= r["time/checkpoint"], r
        assert "time/checkpoint_copy_wait" not in r
    assert recs[-1]["time/checkpoint_write"] > 0


def test_the_checkpoint_copy_runs_behind_the_next_rollouts(tmp_path, monkeypatch):
    """``background_copy`` (the default): a save returns after the finite check, its copy off the
    device (made slow here: 2 s, as 20 GB over PCIe would be) runs behind the next step's
    rollouts (1.2 s), and only that step's update waits, for what is left of it
    (``time/checkpoint_copy_wait``), before it donates the arrays being copied. Each checkpoint
    restores the parameters of its own step, not those of the update after it (without the hold
    the update deletes the arrays under the copy: the save fails)."""
    import jax
    import orbax.checkpoint as ocp

    from rstarjax.io import checkpoint as ckpt_lib

    slow_s, rollout_s = 2.0, 1.2
    save, copy = ckpt_lib.Checkpointer.save, ckpt_lib.Checkpointer._copy_and_write
    saved_params = {}  # the parameters the loop handed to each save, as they were then

    def noting_save(self, step, state, meta, force=False):
        saved_params[step] = [np.array(x) for x in jax.tree.leaves(state.params)]
        return save(self, step, state, meta, force)

    def slow_copy(self, step, state, meta, force):
        time.sleep(slow_s)  # the arrays stay the caller's meanwhile: the update must not donate them
        return copy(self, step, state, meta, force)

    monkeypatch.setattr(ckpt_lib.Checkpointer, "save", noting_save)
    monkeypatch.setattr(ckpt_lib.Checkpointer, "_copy_and_write", slow_copy)
    monkeypatch.setenv("WORKER_SLOW", str(rollout_s))  # each round of rollouts takes this long
    recs, workdir = _run_logged_stage(tmp_path, monkeypatch, 3)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs[1:]:  # the loop's part: the finite check and fingerprints (compiled at step 1), a thread started
        assert r["time/checkpoint"] < slow_s / 4, r
    assert "time/checkpoint_copy" not in recs[0] and "time/checkpoint_copy_wait" not in recs[0]
    for r in recs[1:]:  # the previous save's copy, and what this step's update waited for it
        assert r["time/checkpoint_copy"] >= slow_s, r
        assert r["time/update"] > slow_s - rollout_s - 0.5, r
    assert slow_s - rollout_s - 0.5 < recs[1]["time/checkpoint_copy_wait"] < slow_s - rollout_s + 0.5, recs[1]
    # the stage's last step waits for its own copy too (and its write), as any stage end
    assert recs[2]["time/checkpoint_copy_wait"] > slow_s, recs[2]

    for step in (2, 3):  # keep=2
        state = ocp.StandardCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step), "state"))
        got = jax.tree.leaves(state["params"])
        assert len(got) == len(saved_params[step])
        for x, want in zip(got, saved_params[step]):
            np.testing.assert_array_equal(np.asarray(x), want)
    assert saved_params[2][0].tobytes() != saved_params[3][0].tobytes()


def test_a_background_copy_that_fails_or_hangs_is_one_line_at_the_next_wait(tmp_path, monkeypatch):
    """A copy running behind the loop that raises is raised again, as one ``CheckpointWriteError``
    line naming the step, by the next wait for it (the update's hold, a save, ``wait``); one that
    does not end within ``checkpoint.copy_timeout_s`` stops the loop with an error naming the
    flag, instead of letting an update change the arrays under it, or waiting forever."""
    import threading

    from rstarjax.io import checkpoint as ckpt_lib

    def broken_copy(self, step, state, meta, force):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_lib.Checkpointer, "_copy_and_write", broken_copy)
    with ckpt_lib.Checkpointer(str(tmp_path / "a"), ckpt_lib.CheckpointConfig(every_steps=1)) as ck:
        assert ck.save(1, _small_state(1), {"step": 1})  # started: the error is the thread's
        with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
            ck.wait_copied()
        assert len(str(e.value).splitlines()) == 1
        assert "checkpoint 1 could not be written" in str(e.value) and "the disk is full" in str(e.value)
        assert ck.wait_copied() == 0.0  # raised once

    release = threading.Event()

    def hung_copy(self, step, state, meta, force):
        release.wait(30)
        return False

    monkeypatch.setattr(ckpt_lib.Checkpointer, "_copy_and_write", hung_copy)
    ck = ckpt_lib.Checkpointer(str(tmp_path / "b"), ckpt_lib.CheckpointConfig(every_steps=1, copy_timeout_s=0.3))
    try:
        ck.save(1, _small_state(1), {"step": 1})
        t0 = time.perf_counter()
        with pytest.raises(ckpt_lib.CheckpointWriteError, match=r"checkpoint 1 .*copy_timeout_s=0.3 s"):
            ck.wait_copied()
        assert time.perf_counter() - t0 < 5
    finally:
        release.set()
        ck.close()


def test_a_save_is_due_when_a_step_jumps_over_its_multiple_or_past_the_end(tmp_path):
    """An RL step with ``trainer.mini_batches`` > 1 advances the global step by several updates:
    a save point it jumps over, or a last step it passes, is still due."""
    from rstarjax.io import checkpoint as ckpt_lib

    with ckpt_lib.Checkpointer(str(tmp_path / "ck"), ckpt_lib.CheckpointConfig(every_steps=3)) as ck:
        assert ck.should_save(3) and not ck.should_save(4) and ck.should_save(7, 7)
        assert ck.should_save(4, 10, previous_step=2) and not ck.should_save(5, 10, previous_step=3)
        assert ck.should_save(8, 7, previous_step=6)  # passed the stage's end


def test_mini_batches_save_every_due_step_and_the_last(tmp_path, monkeypatch):
    """``trainer.mini_batches=2``: each RL step is two updates (global steps 2, 4, 6, 8 to reach
    total_steps=7); every_steps=3 is due at 4 (it passed 3), 6, and 8 (past the end). Before,
    only 6 was saved: the stage's last step, 8 != 7, was never written."""
    import jax

    from rstarjax.io.metrics_log import read_metrics
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path / "run")
    write_data(workdir)
    c = in_process_config(workdir, 7)
    c.trainer.mini_batches, c.checkpoint.every_steps, c.checkpoint.keep = 2, 3, 10
    run_rl(parse(c), workdir, rollout_fn=fake_rollout_fn)
    steps = [r["step"] for r in read_metrics(os.path.join(workdir, "logs", "metrics.jsonl"))]
    assert steps == [2, 4, 6, 8]
    assert committed_steps(os.path.join(workdir, "checkpoints")) == [4, 6, 8]


def test_the_copy_off_the_device_skips_pinned_host_memory_when_asked(tmp_path, monkeypatch):
    """``checkpoint.pinned_host_transfer=False`` (the A/B of the 22.6 s wait on an H200) reaches Orbax:
    with the backend taken for a GPU (Orbax's default pins there; this CPU has pinned host memory too)
    the default stages every array through pinned host memory and False through none, and the state
    saved either way restores exactly."""
    import jax

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.rl.trainer import TrainState

    state = _small_state(1)
    device_put = jax.device_put
    for pinned in (True, False):
        put_kinds = []

        def spying_put(x, device=None, *a, **k):
            put_kinds.append(getattr(device, "memory_kind", None))
            return device_put(x, device, *a, **k)

        cfg = ckpt_lib.CheckpointConfig(every_steps=1, async_save=False, pinned_host_transfer=pinned)
        directory = str(tmp_path / f"pinned_{pinned}")
        with monkeypatch.context() as m:
            m.setattr(jax, "default_backend", lambda: "gpu")  # read when Orbax makes its handler
            with ckpt_lib.Checkpointer(directory, cfg) as ck:
                m.setattr(jax, "device_put", spying_put)
                ck.save(1, state, {"step": 1})
        pinned_puts = put_kinds.count("pinned_host")
        assert pinned_puts == (len(jax.tree.leaves(state)) if pinned else 0), (pinned, put_kinds)
        with ckpt_lib.Checkpointer(directory, cfg) as ck:
            restored, meta = ck.restore(ckpt_lib.abstract_like(state))
        assert meta["step"] == 1 and isinstance(restored, TrainState)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_checkpoint_without_fingerprints_restores_with_a_warning(tmp_path, caplog):
    """Its arrays cannot be checked: say so rather than restore them silently."""
    import logging

    from rstarjax.io import checkpoint as ckpt_lib

    with caplog.at_level(logging.WARNING):
        ckpt_lib.verify_fingerprints({"w": np.zeros(3)}, None, str(tmp_path / "4"))
    assert "records no fingerprints" in caplog.text and str(tmp_path / "4") in caplog.text


def test_a_params_restore_refuses_to_leave_a_params_array_behind(tmp_path):
    """Orbax's partial restore reads only what it is asked for: a params array the model lacks
    (a trained untied lm_head, read into a model whose config says tied) would be dropped without
    a word. Refused, naming it; the optimizer state a params-only restore leaves behind on
    purpose (a stage hand-off, an export) is no such array."""
    import jax
    import jax.numpy as jnp

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.rl.trainer import TrainState

    params = {"embed": jnp.arange(32.0).reshape(8, 4), "lm_head": jnp.full((4, 8), 2.0)}
    directory = str(tmp_path / "c")
    with ckpt_lib.Checkpointer(directory, ckpt_lib.CheckpointConfig(async_save=False)) as ck:
        ck.save(3, TrainState(params, {"mu": jax.tree.map(jnp.zeros_like, params)}, jnp.int32(3)), {"step": 3})
    restored, _, _ = ckpt_lib.restore_params(directory, ckpt_lib.abstract_like(params), 3)
    for name, saved in params.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(saved))
    tied = ckpt_lib.abstract_like({"embed": params["embed"]})
    with pytest.raises(ValueError, match=rf"checkpoint {directory}/3 holds params/lm_head, which the model restored "
                                         "onto lacks: tie_word_embeddings=true would drop it") as info:
        ckpt_lib.restore_params(directory, tied, 3)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"holds params/embed, which the model restored onto lacks \(a partial restore"):
        ckpt_lib.restore_params(directory, ckpt_lib.abstract_like({"lm_head": params["lm_head"]}), 3)


_FAILED_RESTORES = r"""
import gc, glob, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.rl.trainer import TrainState
directory, how = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
params = {f"w{i}": jnp.asarray(rng.normal(size=(64, 128)).astype(np.float32)) for i in range(12)}
with ckpt_lib.Checkpointer(directory, ckpt_lib.CheckpointConfig(async_save=False)) as ck:
    ck.save(1, TrainState(params, {}, jnp.int32(1)), {"step": 1})
for path in glob.glob(os.path.join(directory, "1", "state", "**", "d", "*"), recursive=True):
    with open(path, "r+b") as f:
        f.truncate(0 if how == "cut" else os.path.getsize(path) // 3)
for manifest in glob.glob(os.path.join(directory, "1", "state", "**", "manifest.ocdbt"), recursive=True):
    if how == "manifest":
        with open(manifest, "r+b") as f:
            f.truncate(os.path.getsize(manifest) // 2)
abstract = ckpt_lib.abstract_like(params)
for _ in range(10):
    try:
        ckpt_lib.restore_params(directory, abstract, 1)
        raise SystemExit("restored a damaged checkpoint")
    except ckpt_lib.UnreadableCheckpoint as e:
        reason = e.reason
    gc.collect()
time.sleep(0.5)
gc.collect()
print("unreadable:", reason)
"""


@pytest.mark.parametrize("how", ["cut", "manifest"])
def test_a_failed_restore_leaves_no_tracebacks_behind(tmp_path, how):
    """A restore of damaged arrays fails in one line (``UnreadableCheckpoint``), and nothing else:
    the reads Orbax abandoned when its event loop closed used to print dozens of tracebacks
    ("Event loop is closed", "Task exception was never retrieved") per damaged checkpoint."""
    r = subprocess.run([sys.executable, "-c", _FAILED_RESTORES, str(tmp_path / "c"), how], env=worker_env(1),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "unreadable:" in r.stdout, (r.stdout, r.stderr[-3000:])
    noise = [line for line in r.stderr.splitlines() if "Traceback" in line or "never retrieved" in line
             or "Exception ignored" in line]
    assert not noise, r.stderr[-3000:]

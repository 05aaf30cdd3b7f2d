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

from process_support import worker_env

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


def worker_config(workdir, total_steps):
    import base

    c = base.get_config()
    c.total_steps = total_steps
    c.model.preset = "tiny"
    c.model.random_init = True
    c.model.dtype = "float32"
    c.model.remat_policy = "none"
    c.data.train_path = os.path.join(workdir, "train.jsonl")
    c.rl.prompts_per_step = 2
    c.rl.group_size = 2
    c.rl.oversample = 4
    c.rl.max_prompt_len = 8
    c.rl.max_response_len = 8
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = 2
    c.trainer.micro_batch_size = 2
    c.checkpoint.every_steps = 1
    c.checkpoint.keep = 2
    c.logging.progress_bar = False
    return c


def in_process_config(workdir, total_steps):
    """``worker_config`` for a stage run inside the test process: a one-device mesh, no
    TensorBoard, checkpoints written before the step returns."""
    c = worker_config(workdir, total_steps)
    c.mesh.fsdp, c.mesh.data = 1, 1
    c.logging.tensorboard = False
    c.checkpoint.async_save = False
    return c


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
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"worker timed out:\n{out[-3000:]}")
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
        assert proc.poll() is None, proc.communicate()[0][-3000:]
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

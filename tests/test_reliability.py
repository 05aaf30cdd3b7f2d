"""Runs that survive what clusters do to them (issue #32): a diverging update, preemption
signals, a corrupt newest checkpoint, bad or over-long data rows, finite data running out,
values that pass the checks but break the run, leaks after a kill, the policy server's exposure.

The signal tests run a tiny stage 1 (``tests/test_stages.py``'s model, problems and sizes; the
real engine, code pool and verifier) in a subprocess: this file is also that worker
(``python tests/test_reliability.py WORKDIR OVERRIDES_JSON``), and the worker of the
two-process run (``python tests/test_reliability.py two-processes WORKDIR PORT PID``). One
interrupted run (the ``interrupted_runs`` fixture: SIGTERM, then SIGINT twice, then a resume past
a corrupt checkpoint to the end of its data) serves the tests of several parts.
"""
import errno
import glob
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from process_support import own_other_address, start_on_stand_in_jetstream, worker_env
from tiny_run import tiny_rl_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

HAS_WANDB = importlib.util.find_spec("wandb") is not None


def _one_device_trainer(layers=1, **trainer_options):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.models import ModelConfig, Qwen3
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.rl import optim as optim_lib
    from rstarjax.rl import trainer as trainer_lib
    from rstarjax.rl.loss import LossConfig

    model = Qwen3(ModelConfig.preset("tiny", dtype=jnp.float32, num_hidden_layers=layers), rngs=nnx.Rngs(0))
    return trainer_lib.Trainer(model, optim_lib.OptimConfig(learning_rate=1e-3, warmup_steps=0), LossConfig(),
                               trainer_lib.TrainerConfig(**trainer_options),
                               mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ============================================================================ 1. non-finite updates
def test_a_non_finite_update_is_skipped_and_counted():
    """A nan in the batch makes the loss nan: the jitted step keeps params and Adam's state (the
    LR schedule's count moves on, as verl's scheduler), advances the step and says so in its
    metrics; the next finite batch trains as usual."""
    from test_trainer import random_batch

    from rstarjax.rl.optim import advance_schedule

    tr = _one_device_trainer(recompute_old_logprobs=False)
    params, opt = _leaves(tr.state.params), _leaves(advance_schedule(tr.state.opt_state))
    bad = random_batch()
    bad["advantages"][0, bad["loss_mask"][0] > 0] = np.nan
    m = tr.train(bad)
    assert m["train/skipped_nonfinite"] == 1.0 and not np.isfinite(m["train/loss"]) and tr.step == 1
    for a, b in zip(_leaves(tr.state.params) + _leaves(tr.state.opt_state), params + opt):
        np.testing.assert_array_equal(a, b)
    m = tr.train(random_batch(1))
    assert m["train/skipped_nonfinite"] == 0.0 and np.isfinite(m["train/update_norm"]) and tr.step == 2
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(tr.state.params), params))


def test_a_checkpoint_of_non_finite_params_is_refused(tmp_path):
    import jax

    from rstarjax.io import checkpoint as ckpt_lib

    tr = _one_device_trainer()
    state = jax.tree.map(lambda x: x, tr.state)
    state.params = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.inf) if x.dtype.kind == "f" else x,
                                state.params)
    with ckpt_lib.Checkpointer(str(tmp_path / "c"), ckpt_lib.CheckpointConfig(async_save=False)) as ck:
        with pytest.raises(ckpt_lib.NonFiniteState, match="checkpoint 5 not written"):
            ck.save(5, state, {"step": 5})
        assert ck.all_steps() == []


def _scripted_run(tmp_path, total_steps, rows=8, **overrides):
    """``run_rl`` on the tiny preset with test_checkpoint's deterministic rollouts, in this
    process on one device: (config, workdir) with ``rows`` problems written there.
    ``overrides``: "section.key" -> value."""
    from test_checkpoint import write_data

    workdir = str(tmp_path / "run")
    write_data(workdir, rows)
    return _scripted_config(workdir, total_steps, **overrides), workdir


def _scripted_config(workdir, total_steps, **overrides):
    return tiny_rl_config(os.path.join(workdir, "train.jsonl"), total_steps, **{
        "optim.learning_rate": 1e-3, "optim.warmup_steps": 0, "trainer.micro_batch_size": 0,
        "checkpoint.every_steps": 1, "checkpoint.keep": 10, **overrides})


@pytest.fixture
def one_device(monkeypatch):
    import jax

    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))


def test_a_diverging_run_stops_naming_step_and_quantity_and_saves_only_finite_params(tmp_path, one_device):
    """With a learning rate that diverges (1e12: step 1's update is finite and huge, every
    gradient after it nan), the steps after it are skipped, the run stops after
    ``trainer.max_nonfinite_steps`` of them in a row naming the steps and the quantity, and
    every checkpoint on disk holds finite parameters."""
    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.io.metrics_log import read_metrics
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import NonFiniteTraining, run_rl
    from test_checkpoint import fake_rollout_fn

    c, workdir = _scripted_run(tmp_path, 6, **{"optim.learning_rate": 1e12, "trainer.max_nonfinite_steps": 2})
    with pytest.raises(NonFiniteTraining, match=r"steps 2-3: 2 updates in a row were not finite, the last with "
                                                r"grad_norm=nan.*parameters are still those of step 1"):
        run_rl(parse(c), workdir, rollout_fn=fake_rollout_fn)
    recs = read_metrics(os.path.join(workdir, "logs", "metrics.jsonl"))
    assert [(r["step"], r["train/skipped_nonfinite"]) for r in recs] == [(1, 0.0), (2, 1.0), (3, 1.0)]
    tr = _one_device_trainer(layers=2)  # the tiny preset's shapes
    with ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints")) as ck:
        assert ck.all_steps() == [1, 2]  # step 3 stopped the run before its save
        for step in ck.all_steps():
            params, _, _ = ckpt_lib.restore_params(ck.directory, ckpt_lib.abstract_like(tr.state.params), step)
            assert all(np.isfinite(x).all() for x in _leaves(params)), step


# ============================================================================ the tiny stage 1 in a subprocess
def stage1_worker(workdir, overrides):
    """A tiny stage 1 through ``rstarjax.main`` (real engine, code pool, verifier), exiting with
    the status the command line would. ``overrides``: "section.key" -> value, plus total_steps.
    ``SLOW_STOP`` (seconds) delays the save after a stop signal: time for a second signal."""
    from rstarjax.main import exit_with, run_to_exit_status
    from rstarjax.recipes import rl
    from test_stages import _load, _rl_sizes

    if os.environ.get("SLOW_STOP"):
        save_last = rl._save_last

        def slow_save_last(*args, **kwargs):
            time.sleep(float(os.environ["SLOW_STOP"]))
            return save_last(*args, **kwargs)

        rl._save_last = slow_save_last
    c = _rl_sizes(_load("stage1"), overrides.pop("total_steps"))
    c.rl.num_tool_workers = 1
    c.rl.reject_equal_reward = False  # the untrained model is always wrong: train on its groups anyway
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(c, section), name, value)
    exit_with(run_to_exit_status(c, workdir))  # as rstarjax.main exits



@pytest.fixture(scope="module")
def stage1_inputs(tmp_path_factory):
    """The tiny HF model and 26 problems (13 steps of 2) a user would bring."""
    from test_stages import _problems, _tiny_hf_model

    root = tmp_path_factory.mktemp("inputs")
    _tiny_hf_model(str(root / "model"))
    _problems(str(root / "problems.jsonl"), 26)
    return {"model.hf_path": str(root / "model"), "data.train_path": str(root / "problems.jsonl")}


def _launch(workdir, inputs, slow_stop=0.0, **overrides):
    """The worker on ``workdir`` with its own TMPDIR (where the code pool makes its sandbox
    directory), output in WORKDIR/out-N.log; returns (process, log path)."""
    tmp = os.path.join(workdir, "tmp")
    os.makedirs(tmp, exist_ok=True)
    env = worker_env(1, TMPDIR=tmp)
    if slow_stop:
        env["SLOW_STOP"] = str(slow_stop)
    n = len([f for f in os.listdir(workdir) if f.startswith("out-")])
    out = os.path.join(workdir, f"out-{n}.log")
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), workdir,
                                 json.dumps({**inputs, **overrides})], env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, out


def _logged_steps(workdir):
    from rstarjax.io.metrics_log import read_metrics

    path = os.path.join(workdir, "logs", "metrics.jsonl")
    return [r["step"] for r in read_metrics(path)] if os.path.exists(path) else []


def _wait_until(proc, out, ready, timeout=600.0):
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run ended early ({proc.returncode}):\n{open(out).read()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out:\n{open(out).read()[-4000:]}")
        time.sleep(0.05)


def _sandbox_dirs(workdir):
    return sorted(glob.glob(os.path.join(workdir, "tmp", "rstarjax-sandbox-*")))


@pytest.fixture(scope="module")
def interrupted_runs(stage1_inputs, tmp_path_factory):
    """One tiny stage 1, interrupted the ways a cluster does it, in one workdir:

    A. SIGTERM after step 3 (checkpoints only on a signal: every 100 steps);
    B. resumed with checkpoints every 2 steps, then SIGINT twice, the second while the first's
       save is still pending (SLOW_STOP): an exit at once, like a SIGKILL;
    C. resumed after the test corrupted B's newest checkpoint, with one pass over the data
       (``data.num_epochs=1``: 13 steps), until it runs out.
    Returns what each phase left: exit status, seconds from the (last) signal to the exit,
    the log, the logged steps, the committed checkpoints, the sandbox directories."""
    from test_checkpoint import committed_steps

    workdir = str(tmp_path_factory.mktemp("interrupted") / "run")
    os.makedirs(workdir)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    phases = {}

    def record(name, proc, out, t_signal, **extra):
        try:
            status = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"phase {name} did not exit:\n{open(out).read()[-4000:]}")
        phases[name] = dict(status=status, seconds=time.monotonic() - t_signal, log=open(out).read(),
                            logged=_logged_steps(workdir), checkpoints=committed_steps(ckpt_dir),
                            sandboxes=_sandbox_dirs(workdir), **extra)

    grace = {"checkpoint.preemption_grace_s": 60.0}
    proc, out = _launch(workdir, stage1_inputs, total_steps=100, **grace, **{"checkpoint.every_steps": 100})
    _wait_until(proc, out, lambda: len(_logged_steps(workdir)) >= 3)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    record("A", proc, out, t)

    last_a = phases["A"]["logged"][-1]
    proc, out = _launch(workdir, stage1_inputs, slow_stop=30.0, total_steps=100, **grace,
                        **{"checkpoint.every_steps": 2})
    _wait_until(proc, out, lambda: len(_logged_steps(workdir)) >= last_a + 2)
    proc.send_signal(signal.SIGINT)
    _wait_until(proc, out, lambda: "SIGINT received" in open(out).read())
    t = time.monotonic()
    proc.send_signal(signal.SIGINT)
    record("B", proc, out, t)

    newest = phases["B"]["checkpoints"][-1]
    corrupted = _corrupt_checkpoint(os.path.join(ckpt_dir, str(newest)))
    proc, out = _launch(workdir, stage1_inputs, total_steps=100, **grace,
                        **{"checkpoint.every_steps": 2, "checkpoint.keep": 10, "data.num_epochs": 1})
    record("C", proc, out, time.monotonic(), corrupted=(newest, corrupted))
    return phases


def _corrupt_checkpoint(step_dir):
    """Garbage over the newest checkpoint's metadata (a torn write): what a bare
    JSONDecodeError came from. Returns the file's path."""
    path = os.path.join(step_dir, "meta", "metadata")
    assert os.path.exists(path), os.listdir(os.path.join(step_dir, "meta"))
    with open(path, "w") as f:
        f.write('{"step": 7, "rng": [0, ')
    return path


# ============================================================================ 3. SIGTERM / SIGINT
def test_sigterm_saves_the_last_finished_step_closes_the_code_pool_and_exits(interrupted_runs):
    a = interrupted_runs["A"]
    assert a["status"] == 128 + signal.SIGTERM, a["log"][-3000:]
    assert a["seconds"] < 60.0  # within checkpoint.preemption_grace_s, by the clean path:
    assert "stopped on SIGTERM" in a["log"] and f"step {a['logged'][-1]} is saved" in a["log"], a["log"][-3000:]
    # the last finished step is on disk although no periodic save was due (every 100 steps)
    assert a["checkpoints"] == [a["logged"][-1]] and a["logged"][-1] >= 3
    assert a["sandboxes"] == []  # the code pool was closed (it removes its sandbox directory)


def test_a_second_signal_exits_at_once_without_saving(interrupted_runs):
    a, b = interrupted_runs["A"], interrupted_runs["B"]
    assert b["status"] == 128 + signal.SIGINT, b["log"][-3000:]
    assert "second stop signal (SIGINT): exiting at once" in b["log"]
    assert b["seconds"] < 10.0  # not the 30 s the pending save would have taken
    assert "is saved" not in b["log"]
    # B wrote only its periodic checkpoints (every 2 steps), not one for its last step
    assert all(s % 2 == 0 for s in set(b["checkpoints"]) - set(a["checkpoints"]))


def test_the_first_signal_abandons_rollouts_in_progress():
    """In-process: inside ``SignalGuard.rollouts()`` a SIGTERM raises ``StepAbandoned`` at once;
    outside it only records the request (the step finishes); a request already made abandons
    the next rollouts before they start."""
    from rstarjax.recipes import preemption

    previous = signal.getsignal(signal.SIGTERM)
    with preemption.SignalGuard(grace_s=60.0) as guard:
        with pytest.raises(preemption.StepAbandoned):
            with guard.rollouts():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler interrupts this
        assert guard.request.signum == signal.SIGTERM and guard.abandoned
        with pytest.raises(preemption.StepAbandoned):
            with guard.rollouts():
                pytest.fail("rollouts started after a stop signal")
    assert signal.getsignal(signal.SIGTERM) is previous  # the previous handler is back
    with preemption.SignalGuard(grace_s=60.0, can_abandon=False) as guard:  # multi-process: never abandon
        with guard.rollouts():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        assert guard.request.signum == signal.SIGTERM and guard.stop_signal(4) == signal.SIGTERM


def two_process_worker(workdir, port, pid):
    """Process ``pid`` of a 2-process scripted run (2 CPU devices each, gloo collectives)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    from rstarjax.recipes import preemption
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl
    from test_checkpoint import fake_rollout_fn

    c = _scripted_config(workdir, 100, **{"mesh.fsdp": -1, "checkpoint.every_steps": 100})
    try:
        run_rl(parse(c), workdir, rollout_fn=fake_rollout_fn)
    except preemption.Interrupted as e:
        print(e, flush=True)
        sys.exit(e.exit_status)


@pytest.mark.slow
def test_a_signal_to_one_process_stops_every_process_after_the_same_step(tmp_path):
    """Two processes train in lockstep; SIGTERM reaches process 1 only: at the next step boundary
    both agree to stop, both save that one step (one checkpoint: the multi-process save) and
    both exit with SIGTERM's status."""
    import socket

    from test_checkpoint import committed_steps, write_data

    workdir = str(tmp_path / "run")
    write_data(workdir, 8)
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = worker_env(2, WORKER_SLOW="0.3")
    outs = [os.path.join(workdir, f"process-{i}.log") for i in range(2)]
    procs = []
    for i in range(2):
        with open(outs[i], "w") as f:
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "two-processes", workdir,
                                           str(port), str(i)], env=env, stdout=f, stderr=subprocess.STDOUT))
    try:
        _wait_until(procs[0], outs[0], lambda: len(_logged_steps(workdir)) >= 2)
        procs[1].send_signal(signal.SIGTERM)
        statuses = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [open(o).read() for o in outs]
    assert statuses == [128 + signal.SIGTERM] * 2, [log[-3000:] for log in logs]
    last = _logged_steps(workdir)[-1]
    assert committed_steps(os.path.join(workdir, "checkpoints")) == [last]
    assert all(f"stopped on SIGTERM: step {last} is saved" in log for log in logs), [log[-2000:] for log in logs]


def test_every_process_stops_after_the_same_step():
    from rstarjax.recipes.preemption import agreed_stop

    assert agreed_stop([[0, 7], [0, 7]]) == 0  # nobody asked
    assert agreed_stop([[0, 7], [15, 7]]) == 15  # one process got SIGTERM: all stop after step 7
    with pytest.raises(RuntimeError, match=r"different steps \[7, 8\]"):
        agreed_stop([[15, 7], [15, 8]])



# ============================================================================ 4. a corrupt newest checkpoint
def _truncate_arrays(step_dir):
    """Half of every array data file of a checkpoint's state (a torn write): Orbax's raw
    OUT_OF_RANGE error on restore."""
    files = [f for f in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True) if os.path.isfile(f)]
    assert files
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        with open(f, "wb") as fh:
            fh.write(data[: len(data) // 2])


def test_resume_falls_back_past_corrupt_checkpoints(tmp_path, caplog):
    """Steps 1-3 saved; 3's meta and 2's arrays are corrupted: the resume takes step 1, warns
    naming both directories, and moves them out of the way, so the resumed run can save
    steps 2 and 3 again. With every checkpoint unreadable nothing is moved and the error lists
    each one's reason."""
    import jax

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import rl as rl_recipe
    from rstarjax.recipes.config import RunConfig

    tr = _one_device_trainer()
    directory = str(tmp_path / "checkpoints")
    with ckpt_lib.Checkpointer(directory, ckpt_lib.CheckpointConfig(async_save=False)) as ck:
        for step in (1, 2, 3):
            state = jax.tree.map(lambda x: x + step if x.dtype.kind == "f" else x, tr.state)
            state.step = state.step + step
            ck.save(step, state, {"step": step, "stage": "rl", "init_from": ""})
    want = _leaves(jax.tree.map(lambda x: x + 1 if x.dtype.kind == "f" else x, tr.state.params))
    _corrupt_checkpoint(os.path.join(directory, "3"))
    _truncate_arrays(os.path.join(directory, "2"))

    fresh = _one_device_trainer()
    with ckpt_lib.Checkpointer(directory) as ck, caplog.at_level("WARNING"):
        meta = rl_recipe.initial_state(fresh, ck, RunConfig())
        assert meta["step"] == 1 and fresh.step == 1 and ck.all_steps() == [1]
    for a, b in zip(_leaves(fresh.state.params), want):
        np.testing.assert_array_equal(a, b)
    warned = caplog.text
    for step, why in ((3, "JSONDecodeError"), (2, "OUT_OF_RANGE")):
        assert f"checkpoint {directory}/{step} does not restore ({why if step == 3 else 'ValueError'}" in warned
        assert f"{directory}/{step} (moved to {directory}/{step}.unreadable)" in warned
    assert "OUT_OF_RANGE" in warned and sorted(os.listdir(directory)) == ["1", "2.unreadable", "3.unreadable"]

    _truncate_arrays(os.path.join(directory, "1"))
    with ckpt_lib.Checkpointer(directory) as ck:
        with pytest.raises(ckpt_lib.CheckpointError, match=r"no checkpoint in .* restores: step 1: ValueError: "
                                                            r"OUT_OF_RANGE"):
            rl_recipe.initial_state(_one_device_trainer(), ck, RunConfig())
    assert sorted(os.listdir(directory)) == ["1", "2.unreadable", "3.unreadable"]  # nothing more moved


def test_an_interrupted_run_resumes_past_its_corrupt_newest_checkpoint(interrupted_runs):
    """Phase C of the interrupted run: B's newest checkpoint was corrupted; C names it, resumes
    from the one before and trains to its end."""
    c = interrupted_runs["C"]
    step, _ = c["corrupted"]
    assert c["status"] == 0, c["log"][-4000:]
    assert f"/checkpoints/{step} does not restore (JSONDecodeError" in c["log"]
    assert f"/checkpoints/{step} (moved to " in c["log"]
    fallback = max(s for s in interrupted_runs["B"]["checkpoints"] if s < step)
    assert f"resuming from step {fallback} of " in c["log"]
    assert step in c["checkpoints"]  # and the resumed run could save that step again



# ============================================================================ 2. over-long prompts
class _ModelBuilt(Exception):
    """Raised where the run would build its model."""


def test_over_long_prompts_are_skipped_at_load_before_the_model_is_built(stage1_inputs, tmp_path, monkeypatch,
                                                                           caplog):
    """Rows 3 and 9 of the problems have prompts over ``rl.max_prompt_len``: they are measured
    as the engine encodes them, skipped and counted with their row numbers before the model
    (and the code pool) is built, instead of stopping the run when drawn."""
    from rstarjax.main import run
    from rstarjax.recipes import build
    from rstarjax.rl.config import RLConfig
    from test_stages import _load, _rl_sizes

    data = tmp_path / "problems.jsonl"
    lines = open(stage1_inputs["data.train_path"]).read().splitlines()[:10]
    for row in (3, 9):
        lines[row - 1] = json.dumps({"problem": f"How many words (row {row})? " + "word " * 300, "answer": "300"})
    data.write_text("\n".join(lines) + "\n")

    def no_model(*args, **kwargs):
        raise _ModelBuilt

    monkeypatch.setattr(build, "policy", no_model)
    c = _rl_sizes(_load("stage1"), 2)
    c.model.hf_path, c.data.train_path = stage1_inputs["model.hf_path"], str(data)
    with caplog.at_level("WARNING"), pytest.raises(_ModelBuilt):
        run(c, str(tmp_path / "run"))
    assert ("dataset: 2 prompts longer than --config.rl.max_prompt_len=160 tokens skipped; prompt_too_long=2 "
            "(rows problems.jsonl:3, problems.jsonl:9)") in caplog.text

    records, report = build.problems(str(data), RLConfig(), None)  # a scripted rollout_fn
    assert len(records) == 10 and not report.skipped  # measures nothing: it encodes no prompt



# ============================================================================ 7. the data loader
def test_bad_rows_are_skipped_and_counted_each_with_its_reason_and_row(tmp_path):
    """One file with a byte that is not UTF-8, answers of 5,000 digits (a JSON number and a
    string), answers of the wrong type, and duplicates: the good rows load, and each bad one is
    counted under its own reason with its line number."""
    from rstarjax.io.data import load_problems

    huge = "9" * 5000
    lines = [
        json.dumps({"problem": "one", "answer": "1"}).encode(),  # 1
        b'{"problem": "caf\xe9 au lait", "answer": "2"}',  # 2: latin-1, not UTF-8
        b'{"problem": "big number", "answer": ' + huge.encode() + b"}",  # 3
        json.dumps({"problem": "big string", "answer": huge}).encode(),  # 4
        json.dumps({"problem": "a list", "answer": [1, 2]}).encode(),  # 5
        json.dumps({"problem": "a null", "answer": None}).encode(),  # 6
        json.dumps({"problem": "a bool", "answer": True}).encode(),  # 7
        json.dumps({"problem": "one", "answer": "1"}).encode(),  # 8: duplicate of row 1
        json.dumps({"problem": "one", "answer": "11"}).encode(),  # 9: the same problem, another answer
        json.dumps({"problem": "two", "answer": 2}).encode(),  # 10
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    records, report = load_problems(str(path))
    assert [(r["problem"], r["answer"], r["uid"]) for r in records] == [("one", "1", "mixed.jsonl:1"),
                                                                          ("two", "2", "mixed.jsonl:10")]
    assert dict(report.skipped) == {"not_utf8": 1, "answer_too_long": 2, "answer_wrong_type": 3, "duplicate": 1,
                                    "duplicate_other_answer": 1}
    assert report.rows["not_utf8"] == ["mixed.jsonl:2 [byte 17 of the line is b'\\xe9']"]
    assert report.rows["answer_too_long"] == [f"mixed.jsonl:{n} [5000 digits, Python's limit is 4300]" for n in (3, 4)]
    assert report.rows["answer_wrong_type"] == ["mixed.jsonl:5 [answer is list]", "mixed.jsonl:6 [answer is null]",
                                                "mixed.jsonl:7 [answer is bool]"]
    assert report.rows["duplicate"] == ["mixed.jsonl:8 [of mixed.jsonl:1]"]
    assert report.rows["duplicate_other_answer"] == ["mixed.jsonl:9 [of mixed.jsonl:1, answer '1']"]
    assert "2/10 rows kept" in str(report) and "answer_wrong_type=3 (rows mixed.jsonl:5 [answer is list]" in str(report)

    one_document = tmp_path / "list.json"
    one_document.write_bytes(b'[{"problem": "one", "answer": "1"},\n {"problem": "caf\xe9", "answer": "2"}]')
    with pytest.raises(ValueError, match=r"list.json: line 2 is not UTF-8 \(byte b'\\xe9' at offset 53\)"):
        load_problems(str(one_document))



# ============================================================================ 6. values that break a run
@pytest.mark.parametrize("key, value, message", [
    ("tool_timeout_s", 0.0, r"--config.rl.tool_timeout_s=0.0 must be in \(0, 600\] seconds, the code pool's limit"),
    ("tool_timeout_s", 601.0, r"--config.rl.tool_timeout_s=601.0 must be in \(0, 600\] seconds"),
    ("rollout_timeout_s", 0.0, r"--config.rl.rollout_timeout_s=0.0 must be > 0 seconds"),
])
def test_timeouts_that_would_break_every_rollout_are_refused_at_start(tmp_path, key, value, message):
    import stage1

    from rstarjax.recipes.config import parse
    from rstarjax.validation import ConfigError

    c = stage1.get_config()
    c.model.random_init, c.model.preset = True, "tiny"
    c.data.train_path = str(tmp_path / "train.jsonl")
    (tmp_path / "train.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    parse(c)
    setattr(c.rl, key, value)
    with pytest.raises(ConfigError, match=message):
        parse(c)


def test_a_long_tool_limit_is_not_cut_short_by_the_schedulers_wait():
    """The scheduler's wait on the code pool outlasts the tool's own limit with room for a
    call's queueing, at every allowed limit, so a slow tool call ends as the tool's timeout
    (the model's doing), never as an infrastructure wait; short limits keep the agent's default."""
    from rstarjax.rl.agent_loop import AgentConfig
    from rstarjax.rl.config import RLConfig

    for limit in (0.5, 5.0, 45.0, 100.0, 600.0):
        agent = RLConfig(tool_timeout_s=limit).agent()
        assert agent.tool_timeout_s == limit
        assert agent.tool_wait_s >= 2 * limit and agent.tool_wait_s >= AgentConfig().tool_wait_s


def test_the_data_position_counts_rows_so_a_new_batch_size_skips_nothing():
    """Two steps of 2 prompts, then a resume with 3 per step: the next batch is rows 5-7 of
    the same order (a position counting batches would restart at row 7, skipping two). A
    checkpoint written before rows were counted (``{"next_index": batches}``) resumes as before."""
    from rstarjax.io.data import make_dataset

    records = [{"problem": f"p{i}", "answer": str(i)} for i in range(20)]
    order = [r["problem"] for b in make_dataset(records, 1, seed=3, num_epochs=1, process_index=0, process_count=1)
             for r in b]
    it = iter(make_dataset(records, 2, seed=3, num_epochs=None, process_index=0, process_count=1))
    assert [r["problem"] for _ in range(2) for r in next(it)] == order[:4]
    state = json.loads(json.dumps(it.get_state()))
    assert state == {"rows": 4}
    resumed = iter(make_dataset(records, 3, seed=3, num_epochs=None, process_index=0, process_count=1))
    resumed.set_state(state)
    assert [r["problem"] for r in next(resumed)] == order[4:7]
    old = iter(make_dataset(records, 2, seed=3, num_epochs=None, process_index=0, process_count=1))
    old.set_state({"next_index": 2})
    assert [r["problem"] for r in next(old)] == order[4:6]



# ============================================================================ 5. finite data running out
def test_finite_data_that_runs_out_is_saved_and_said(interrupted_runs):
    """Phase C reads its one pass over the 26 problems to the end: it saves step 13 (not a
    periodic step: every 2) and says how many steps ran and why it stopped."""
    c = interrupted_runs["C"]
    fallback = max(s for s in interrupted_runs["B"]["checkpoints"] if s < c["corrupted"][0])
    assert c["status"] == 0, c["log"][-4000:]
    assert c["logged"][-1] == 13 and c["checkpoints"][-1] == 13
    assert (f"the data ran out at step 13, before total_steps=100: {13 - fallback} steps ran in this run; "
            "data.num_epochs=1 pass over 26 problems at 2 per step give 13 steps. Step 13 is saved. Raise "
            "--config.data.num_epochs (0 = repeat forever) to train on.") in c["log"]



# ============================================================================ 8. leaks after a kill
def test_each_step_is_logged_once_and_no_sandbox_directory_is_left(interrupted_runs):
    """After the kill in B (its last steps were logged, not saved) and C's resume from an older
    checkpoint, metrics.jsonl holds every step once; B's sandbox directory, left by the kill, was
    removed when C started its code pool."""
    b, c = interrupted_runs["B"], interrupted_runs["C"]
    assert len(b["sandboxes"]) == 1  # the kill left one behind
    assert c["logged"] == list(range(1, 14))
    assert c["sandboxes"] == []


def test_a_resumed_writer_keeps_each_step_once_in_every_log(tmp_path, monkeypatch):
    """A writer resumed at step 3 after a run that logged 1-5 and was killed writing 6:
    metrics.jsonl drops 4-5 and the torn line (4-5 are logged again with the resumed values),
    TensorBoard purges from step 4, and the W&B run, resumed by its id, takes only the steps it
    does not hold."""
    from rstarjax.io.metrics_log import MetricsWriter, read_metrics

    logdir = str(tmp_path / "logs")
    wandb = None
    if HAS_WANDB:
        for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
            monkeypatch.setenv(var, str(tmp_path / "wandb_home" / sub))
        monkeypatch.setenv("WANDB_MODE", "offline")
        wandb = {"project": "rstarjax-test", "name": "resumed"}
    with MetricsWriter(logdir, tensorboard=True, wandb=wandb, resume_step=0) as w:
        for step in range(1, 6):
            w.write(step, {"x": float(step)})
    with open(os.path.join(logdir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 6, "wall_ti')  # the kill came in the middle of a line
    with MetricsWriter(logdir, tensorboard=True, wandb=wandb, resume_step=3) as w:
        for step in range(4, 8):
            w.write(step, {"x": 10.0 * step})
    assert [(r["step"], r["x"]) for r in read_metrics(os.path.join(logdir, "metrics.jsonl"))] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0), (7, 70.0)]
    from tensorboardX.proto import event_pb2

    purges = []
    for path in sorted(glob.glob(os.path.join(logdir, "tb", "events.out.tfevents.*"))):
        data, pos = open(path, "rb").read(), 0
        while pos + 12 <= len(data):
            length = int.from_bytes(data[pos:pos + 8], "little")
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                purges.append(event.step)
    assert purges == [4]  # TensorBoard drops the earlier events of steps >= 4
    if HAS_WANDB:
        from test_wandb import read_wandb_run

        runs = sorted(glob.glob(os.path.join(logdir, "wandb", "offline-run-*")))
        # offline-run-DATE_TIME-ID, and "-1" after it when both started within one second
        ids = {re.fullmatch(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)(?:-\d+)?", os.path.basename(r)).group(1)
               for r in runs}
        assert len(runs) == 2 and len(ids) == 1  # one W&B run, resumed
        first, second = (read_wandb_run(r)[1] for r in runs)
        assert sorted(first) == [1, 2, 3, 4, 5] and sorted(second) == [6, 7]


def test_only_stale_sandbox_directories_are_removed(tmp_path):
    """Empty and named by no live process: removed. In use by a live zygote (its command line
    names it) or not empty: kept."""
    from rstarjax.env.cleanup import remove_stale_sandbox_dirs

    stale, live, full = (tmp_path / f"rstarjax-sandbox-{n}" for n in ("stale", "live", "full"))
    for d in (stale, live, full):
        d.mkdir()
    (full / "w0").mkdir()
    (tmp_path / "unrelated").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(live)])
    try:
        # The precondition, checked rather than assumed: the holder is alive and its command
        # line, as other processes read it, names the directory (a CI run once found it not).
        deadline = time.monotonic() + 10
        while str(live).encode() not in pathlib.Path(f"/proc/{holder.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline and holder.poll() is None, ("holder", holder.poll())
            time.sleep(0.01)
        assert remove_stale_sandbox_dirs(str(tmp_path)) == [str(stale)], ("holder", holder.poll())
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rstarjax-sandbox-full", "rstarjax-sandbox-live", "unrelated"]


_FULL_DISK_WORKER = """
import os, sys
import jax, jax.numpy as jnp
from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.rl.trainer import TrainState

state = TrainState({"w": jax.random.normal(jax.random.key(0), (256, 1024))}, {}, jnp.int32(0))
try:
    with ckpt_lib.Checkpointer(os.path.join(sys.argv[1], "checkpoints")) as ck:  # async saves
        for step in (1, 2, 3):
            ck.save(step, state, {"step": step})
except ckpt_lib.CheckpointWriteError as e:  # in one write: the Orbax threads print to stderr meanwhile
    import traceback
    lines = "".join(traceback.format_exception(e)).splitlines()
    os.write(2, f"\\n{type(e).__module__}.{type(e).__qualname__}: {e}\\ntraceback lines: {len(lines)}\\n".encode())
    os._exit(1)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root to mount a small tmpfs")
def test_a_full_disk_during_an_async_save_is_named_in_one_line(tmp_path):
    """The workdir on a 300 KiB tmpfs (in a private mount namespace) and a 1 MiB state: the
    asynchronous save of step 1 fails; the next save raises one line naming the step, the
    directory and the full disk, not Orbax's hundreds of lines of threads and asyncio."""
    mount = tmp_path / "disk"
    mount.mkdir()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = (f"mount -t tmpfs -o size=300k tmpfs {mount} || exit 99; "
              f"exec {sys.executable} -c '{_FULL_DISK_WORKER}' {mount}")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode == 99:
        pytest.skip("cannot mount a tmpfs here")
    assert r.returncode == 1
    error = (f"rstarjax.io.checkpoint.CheckpointWriteError: checkpoint 1 could not be written to {mount}/checkpoints: "
             "the disk is full (no space left on device): free space there or give --workdir a larger disk; "
             "no checkpoint is complete")
    lines = r.stderr.strip().splitlines()
    assert error in lines, r.stderr[-3000:]
    # the exception's whole traceback is short (the worker wrote it in one write, as Orbax's
    # threads may print their own tracebacks to stderr at the same time)
    assert int(lines[lines.index(error) + 1].split(": ")[1]) < 10, r.stderr[-3000:]


# ============================================================================ 9. who may use the policy server
class _RecordingGrpc:
    """The part of the ``grpc`` module ``rstarjax.serve`` uses, recording what it is asked for."""

    class LocalConnectionType:
        LOCAL_TCP, UDS = "local_tcp", "uds"

    @staticmethod
    def local_server_credentials(kind):
        return ("local", kind)

    @staticmethod
    def ssl_server_credentials(pairs, root_certificates=None, require_client_auth=False):
        return ("ssl", pairs, root_certificates, require_client_auth)

    @staticmethod
    def insecure_server_credentials():
        return ("insecure",)


def test_the_policy_server_admits_loopback_only_unless_exposed_over_tls(tmp_path, monkeypatch, capsys):
    """Default: gRPC local credentials (loopback peers only), passed to JetStream's
    ``server_lib.run``, which would otherwise use insecure ones on every interface. ``--expose``
    needs a server certificate and key; a client CA makes client certificates required."""
    import types

    from rstarjax import serve

    parse = serve.build_parser().parse_args
    grpc = _RecordingGrpc
    assert serve.server_credentials(parse(["--hf_path", "m"]), grpc) == ("local", "local_tcp")
    for pem in ("cert", "key", "ca"):
        (tmp_path / f"{pem}.pem").write_bytes(f"PEM {pem}".encode())
    tls = ["--expose", "--tls_cert", str(tmp_path / "cert.pem"), "--tls_key", str(tmp_path / "key.pem")]
    assert serve.server_credentials(parse(["--hf_path", "m", *tls]), grpc) == (
        "ssl", [(b"PEM key", b"PEM cert")], None, False)
    with_ca = parse(["--hf_path", "m", *tls, "--tls_client_ca", str(tmp_path / "ca.pem")])
    assert serve.access_errors(with_ca) == []
    assert serve.server_credentials(with_ca, grpc) == ("ssl", [(b"PEM key", b"PEM cert")], b"PEM ca", True)

    assert serve.access_errors(parse(["--hf_path", "m", "--expose"])) == [
        "--expose serves other machines over TLS: give --tls_cert and --tls_key (PEM files)"]
    assert serve.access_errors(parse(["--hf_path", "m", "--tls_cert", str(tmp_path / "cert.pem")])) == [
        "--tls_cert only apply with --expose (without it only this machine may connect)"]
    with pytest.raises(SystemExit) as exit_info:  # refused before anything is loaded
        serve.main(["--hf_path", "m", "--expose", "--tls_cert", "nope.pem", "--tls_key", str(tmp_path / "key.pem")])
    assert exit_info.value.code == 2 and "--tls_cert='nope.pem' is not a file" in capsys.readouterr().err

    calls = {}
    server_lib = types.SimpleNamespace(run=lambda **kw: calls.update(kw) or "server")
    assert start_on_stand_in_jetstream(monkeypatch, grpc, server_lib) == "server"
    assert calls["credentials"] == ("local", "local_tcp") and calls["port"] == 9000


# A gRPC server and two clients, in a process of their own: gRPC's core threads and fork
# handlers would otherwise live in the pytest worker for the rest of its tests.
GRPC_PEERS = """
import sys
from concurrent.futures import ThreadPoolExecutor
import grpc
from rstarjax import serve

other = sys.argv[1]
server = grpc.server(ThreadPoolExecutor(2))
echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Echo": echo}),))
port = server.add_secure_port("[::]:0", serve.server_credentials(serve.build_parser().parse_args(
    ["--hf_path", "m"]), grpc))
server.start()

def call(host):
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            return channel.unary_unary("/test.Echo/Echo")(b"ping", timeout=10)
        except grpc.RpcError as e:
            return e.code()

try:
    print(call("127.0.0.1"), call(other))
finally:
    server.stop(0)
"""


def test_the_default_credentials_refuse_a_peer_on_another_address():
    """With real gRPC: a server on every interface (as JetStream binds) with the default
    credentials answers a client over loopback (an insecure channel, as JetStream's own clients
    use) and refuses the same client at another address of this machine."""
    pytest.importorskip("grpc")
    other = own_other_address()
    if other is None:
        pytest.skip("no address but loopback here")
    r = subprocess.run([sys.executable, "-c", GRPC_PEERS, other], env=worker_env(1), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["b'ping'", "StatusCode.UNAVAILABLE"], r.stdout


if __name__ == "__main__":
    if sys.argv[1] == "two-processes":
        two_process_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        stage1_worker(sys.argv[1], json.loads(sys.argv[2]))


# ============================================================================ 10. a metrics log that cannot be written
class _FullDiskLog:
    """A metrics.jsonl that takes ``room`` lines, then fails as a full disk does (its close too)."""

    def __init__(self, real, room):
        self.real, self.room = real, room

    def write(self, line):
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= 1
        return self.real.write(line)

    def fileno(self):
        return self.real.fileno()

    def close(self):
        self.real.close()
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_metrics_log_on_a_full_disk_stops_the_run_in_one_line_with_its_steps_saved(tmp_path, monkeypatch, capsys):
    """The disk fills after two steps' records: the run stops at step 3 with one line naming the
    log and the full disk, step 3 (trained, not logged) saved for the same command to resume;
    never a chain of OSErrors with no path, nor the steps lost."""
    from test_batch_filter import run_config, scripted

    import jax

    from rstarjax import main as main_lib
    from rstarjax.io import metrics_log
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    opened = metrics_log.MetricsWriter.__init__

    def with_full_disk(self, *a, **k):
        opened(self, *a, **k)
        self._jsonl = _FullDiskLog(self._jsonl, room=2)

    monkeypatch.setattr(metrics_log.MetricsWriter, "__init__", with_full_disk)
    workdir = str(tmp_path)
    with open(os.path.join(workdir, "train.jsonl"), "w") as f:
        f.writelines(json.dumps({"problem": f"problem {p}", "answer": str(p)}) + "\n" for p in range(2, 12))
    c = run_config(workdir, 5)
    c.checkpoint.every_steps = 100  # no periodic save before the end
    cfg = parse(c)
    with pytest.raises(metrics_log.MetricsWriteError) as e:
        run_rl(cfg, workdir, rollout_fn=scripted(lambda p: [1, 0] * 2))
    log_path = os.path.join(workdir, "logs", "metrics.jsonl")
    assert str(e.value) == (f"the metrics log {log_path} could not be written: the disk is full (no space left on "
                            "device): free space there or give --workdir a larger disk")
    assert e.value.__notes__ == [f"step 3 is saved in {workdir}: the same command resumes from it"]
    assert sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()) == [3]
    assert [json.loads(x)["step"] for x in open(log_path)] == [1, 2]
    monkeypatch.setattr(main_lib, "run", lambda *a, **k: (_ for _ in ()).throw(e.value))
    assert main_lib.run_to_exit_status(None, workdir) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"rstarjax: {e.value}", e.value.__notes__[0]]


def test_a_metrics_log_deleted_under_the_run_is_an_error_not_a_silent_loss(tmp_path):
    from rstarjax.io import metrics_log

    writer = metrics_log.MetricsWriter(str(tmp_path / "logs"), tensorboard=False)
    writer.write(1, {"a": 1.0})
    shutil.rmtree(tmp_path / "logs")  # a cleanup that took the workdir with it
    with pytest.raises(metrics_log.MetricsWriteError, match="metrics.jsonl is gone: it was deleted during the run"):
        writer.write(2, {"a": 2.0})
    writer.close()  # said once: closing does not raise it again

"""Disaggregated placement across processes (``serving.placement='disaggregated'`` in a 2-process
run, ``rl.remote``): process 0 trains on its CPU device, process 1 rolls out on its own (the
real paged engine, scheduler, code pool and verifier; jax.distributed with gloo collectives,
localhost coordinator). The policy is scripted (teacher-forced tokens, half of each group
right), so the rollouts are the same in any placement while the engine still computes every
log-prob from the weights it was handed.

The run must train exactly as the same stage on one process with both device groups (trainer on
one, the rollout slice on the other): the same parameters, synchronous and with
``rl.max_staleness=1`` (each round one version behind); and the weights reach the rollout
process device to device, not through the host. This file doubles as the worker:
``python tests/test_rollout_process.py PORT PROCESS_ID WORKDIR STALENESS DEVICES`` (PORT 0: one
process with 2 x DEVICES devices).
"""
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from process_support import communicate_all, free_port, output_of, worker_env

STEPS = int(os.environ.get("RJ_STEPS", 3))  # the death test runs longer
WAIT_S = 300  # one 2-process run; past it the workers are killed and the test fails
TOOL = "execute_python_code_with_standard_io"


def write_data(workdir):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "train.jsonl"), "w") as f:
        for i in range(40):
            f.write(json.dumps({"problem": f"What is {i}*7?", "answer": "42"}) + "\n")


def rollout_processes() -> int:
    """How many rollout processes the case runs (``RJ_ROLLOUT_PROCS``, default 1)."""
    return int(os.environ.get("RJ_ROLLOUT_PROCS", 1))


def trainer_processes() -> int:
    """How many processes train (``RJ_TRAINER_PROCS``, default 1): processes 0 .. that - 1."""
    return int(os.environ.get("RJ_TRAINER_PROCS", 1))


def colocated() -> bool:
    """``RJ_COLOCATED=1``: the reference of several training processes, each rolling out on its
    own device as a colocated multi-process run does (no rollout processes)."""
    return os.environ.get("RJ_COLOCATED") == "1"


def stage_config(workdir, staleness: int, devices: int, reference: bool = False):
    """``reference``: the same stage on one process, the rollout devices of every rollout
    process there as slices of ``devices`` each."""
    from tiny_run import tiny_rl_config

    from rstarjax.recipes.config import parse

    c = tiny_rl_config(os.path.join(workdir, "train.jsonl"), STEPS, in_process=False, **{
        "seed": 0, "model.tokenizer_num_regular_tokens": 486, "rl.max_prompt_len": 192, "rl.max_response_len": 256,
        "rl.max_turns": 4})
    c.rl.chat_format = "compact"
    c.rl.max_staleness = staleness
    c.rl.partial_rollout_tokens = int(os.environ.get("RJ_PARTIAL", 0))  # the partial-rollout case
    if c.rl.partial_rollout_tokens:
        # one token per decode call: a rollout pauses at exactly its budget. With k > 1 it pauses
        # within k - 1 tokens past it, where the calls (shared with rollouts whose tool timing
        # varies) happen to end, and the two runs compared here could pause at other tokens
        c.serving.decode_steps = 1
    if staleness:
        c.loss.decoupled_cap = 5.0
    c.serving.placement, c.serving.rollout_devices = "disaggregated", devices
    c.serving.trainer_processes = trainer_processes()
    if reference and rollout_processes() > 1:
        c.serving.rollout_devices, c.serving.tensor_parallel = devices * rollout_processes(), devices
    if colocated():
        c.serving.placement, c.serving.rollout_devices, c.serving.trainer_processes = "colocated", 0, 1
    c.serving.num_slots, c.serving.kv_pages = 8, 8 * (256 + 192) // 16
    c.trainer.micro_batch_size = 0
    c.mesh.fsdp, c.mesh.data = devices * trainer_processes(), 1
    c.checkpoint.every_steps, c.checkpoint.async_save = 1000, False
    c.distributed.silence_s = float(os.environ.get("RJ_SILENCE_S", 120))
    c.logging.progress_bar = c.logging.tensorboard = False
    return parse(c)


def tiny_model():
    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.models.config import ModelConfig
    from rstarjax.models.qwen3 import Qwen3

    return Qwen3(ModelConfig.preset("tiny", dtype=jnp.float32, vocab_size=512, hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=1), rngs=nnx.Rngs(0))


def scripted_rollouts(run, executor, model):
    """The recipe's rollouts with a scripted policy: one real tool call, then an answer (right
    for even samples)."""
    from rstarjax.models.chat_template import COMPACT
    from rstarjax.recipes import build
    from rstarjax.rl.agent_loop import ColocatedRollouts

    class Scripted(ColocatedRollouts):
        def requests(self, records, n_per_prompt, seed, policy_version, sampling=None, group_ids=None):
            reqs = super().requests(records, n_per_prompt, seed, policy_version, sampling, group_ids)
            for i, req in enumerate(reqs):
                k = int(records[i // n_per_prompt]["problem"].split()[2].split("*")[0])
                think = self.tokenizer.encode(" think")[0]
                answer = 42 if req.sample_index % 2 == 0 else 41
                req.script = ([think] * (4 + k % 5) + self.tokenizer.encode(
                    '<tool_call>\n{"name": "' + TOOL + '", "arguments": {"code": "print(' + str(k) + ')", '
                    '"input": ""}}\n</tool_call>') + [think] * 3
                    + self.tokenizer.encode(f"<answer>\\boxed{{{answer}}}</answer><|im_end|>"))
            return reqs

    return Scripted(model, tokenizer=build.tokenizer(run.model), executor=executor, agent=run.agent(),
                    sampling=run.rl.sampling(), max_prompt_len=run.rl.max_prompt_len, fmt=COMPACT,
                    serving=run.serving)


def worker(port: int, pid: int, workdir: str, staleness: int, devices: int):
    import jax

    if port:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if not colocated():  # as rstarjax.main.init_distributed does for this layout
            jax.config.update("jax_enable_recoverability", True)
        processes = trainer_processes() + (0 if colocated() else rollout_processes())
        jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=processes,
                                   process_id=pid, initialization_timeout=120)
        if not colocated():
            from rstarjax.rl import mailbox

            mailbox.leave_last(trainer_processes())
    from rstarjax.processes import trainer_of
    from rstarjax.env import CodeExecutor
    from rstarjax.recipes.rl import run_rl
    from rstarjax.rl import remote

    run = stage_config(workdir, staleness, devices, reference=not port)
    model = tiny_model()
    if port and pid >= trainer_processes() and not colocated():  # a rollout process: serve its trainer's rounds
        with CodeExecutor(num_workers=1) as executor:
            rounds = remote.serve_remote(scripted_rollouts(run, executor, model), wait_s=WAIT_S,
                                         trainer=trainer_of(pid, trainer_processes()),
                                         silence_s=run.distributed.silence_s)
        with open(os.path.join(workdir, f"rollout_process-{pid}.json"), "w") as f:
            json.dump({"rounds": rounds}, f)
        return
    host_copies = []
    if port and not colocated():  # the weights must not go through the host on their way to the rollout process
        import jax._src.array as array_mod

        real_value, handing_off = array_mod.ArrayImpl._value, threading.local()
        array_mod.ArrayImpl._value = property(  # noted on the thread of a hand-off only
            lambda self: (getattr(handing_off, "on", False) and host_copies.append(self.shape))
            or real_value.fget(self))

        def watched(method):
            def call(*args):
                handing_off.on = True
                try:
                    return method(*args)
                finally:
                    handing_off.on = False
            return call

        for name in ("stage_params", "serve_staged"):
            setattr(remote.RemoteRollouts, name, watched(getattr(remote.RemoteRollouts, name)))
        tr = run_rl(run, workdir, model=model)
        array_mod.ArrayImpl._value = real_value
    else:  # the same stage on one process (the trainer on device 0, the rollout slice on device 1),
        # or colocated on each training process's own device
        with CodeExecutor(num_workers=1) as executor:
            rollouts = scripted_rollouts(run, executor, model)
            tr = run_rl(run, workdir, rollout_fn=rollouts, model=model,
                        on_update=lambda t: rollouts.update_params(t.served_model()))
    params = host_copy(tr)  # (a program of every training process)
    if pid == 0:
        np.savez(os.path.join(workdir, "params.npz"), *params)
    with open(os.path.join(workdir, f"host_copies-{pid}.json"), "w") as f:
        json.dump({"host_copies": host_copies}, f)


def host_copy(trainer) -> list:
    """The trainer's parameters as host arrays (gathered over the training processes' mesh)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    whole = jax.jit(lambda t: t, out_shardings=NamedSharding(trainer.mesh, PartitionSpec()))(trainer.state.params)
    return [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(whole)]



def launch(port, pid, workdir, staleness, devices, per_process, **env_vars):
    """One worker with ``per_process`` CPU devices; ``devices``: each side's (trainer, rollouts)."""
    env = worker_env(per_process, **env_vars)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), str(port), str(pid), workdir,
                             str(staleness), str(devices)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(procs):
    outs = communicate_all(procs, WAIT_S)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]


def metrics_of(workdir):
    with open(os.path.join(workdir, "logs", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow  # ~3 x 80 s on 2 cores
@pytest.mark.parametrize("staleness, devices, partial", [(0, 1, 0), (1, 2, 0), (1, 1, 20)])
def test_a_rollout_process_apart_trains_as_one_process_with_two_device_groups(tmp_path, staleness, devices,
                                                                             partial):
    """``devices`` per side: 2 shards every weight over the trainer's FSDP mesh and the rollout
    process's TP-2 slice, each shard copied to its own device. ``partial``: partial rollouts of
    at most that many tokens per round, the paused ones (and their KV) kept in the rollout
    process between steps (here with ``max_staleness=1`` too: the trainer's rollout thread runs
    the partial rounds)."""
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    for d in (two, one):
        write_data(d)
    port, env = free_port(), dict(RJ_PARTIAL=str(partial))
    finish([launch(port, i, two, staleness, devices, per_process=devices, **env) for i in range(2)])
    finish([launch(0, 0, one, staleness, devices, per_process=2 * devices, **env)])

    assert_same_params(two, one)
    m2, m1 = metrics_of(two), metrics_of(one)
    assert [m["step"] for m in m2] == list(range(1, STEPS + 1))
    for a, b in zip(m2, m1):  # the same rollouts, the same rewards, the same update
        for key in ("rollout/reward_mean", "train/trained_tokens", "train/loss", "train/grad_norm"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-6, err_msg=key)
        # the rollout process served the weights the trainer had (checked on fresh rounds)
        assert a.get("train/logprob_gap_max", 0.0) < 1e-4
    if staleness and not partial:  # every round after the first sampled one version behind its update
        assert [m["async/policy_lag_max"] for m in m2] == [0.0] + [1.0] * (STEPS - 1)
    if partial:  # rollouts were paused in the rollout process and trained steps later
        lag = "async/policy_lag_max" if staleness else "partial/policy_lag_max"
        assert max(m["partial/rollouts_paused"] for m in m2) > 0 and max(m[lag] for m in m2) >= 1
        for a, b in zip(m2, m1):
            assert a["partial/rollouts_carried"] == b["partial/rollouts_carried"]
    with open(os.path.join(two, "rollout_process-1.json")) as f:
        assert json.load(f)["rounds"] >= STEPS  # and it stopped when the trainer did
    with open(os.path.join(two, "host_copies-0.json")) as f:
        assert json.load(f)["host_copies"] == []


@pytest.mark.slow  # ~60 s on 2 cores
def test_two_rollout_processes_share_each_round_as_two_slices_do_in_one_process(tmp_path):
    """A trainer process and two rollout processes (one CPU device each): every round is split
    by prompt groups over the two, each paused rollout goes on where it started, the weights
    reach both after every update, and the stage trains as on one process whose two rollout
    slices share the rounds, with ``max_staleness=1`` and partial rollouts on."""
    many, one = str(tmp_path / "many"), str(tmp_path / "one")
    for d in (many, one):
        write_data(d)
    env, port = dict(RJ_PARTIAL="20", RJ_ROLLOUT_PROCS="2"), free_port()
    finish([launch(port, i, many, 1, 1, per_process=1, **env) for i in range(3)])
    finish([launch(0, 0, one, 1, 1, per_process=3, **env)])
    assert_trains_as(many, one, trainers=(0,), rollout_processes=(1, 2))


def assert_same_params(got_dir, want_dir):
    """The two runs' final parameters (``params.npz``) agree to float noise."""
    got, want = np.load(os.path.join(got_dir, "params.npz")), np.load(os.path.join(want_dir, "params.npz"))
    assert len(got.files) == len(want.files) > 0
    for k in want.files:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def assert_trains_as(got_dir, want_dir, trainers, rollout_processes):
    """The partial-rollout stage in ``got_dir`` trained as the one in ``want_dir``: the same
    parameters, rewards, trained tokens, losses and carried rollouts, some rollouts paused; every
    rollout process served rounds and stopped with its trainer, and no training process copied
    weights through its host."""
    assert_same_params(got_dir, want_dir)
    m_got, m_want = metrics_of(got_dir), metrics_of(want_dir)
    assert [m["step"] for m in m_got] == list(range(1, STEPS + 1))
    for a, b in zip(m_got, m_want):
        for key in ("rollout/reward_mean", "train/trained_tokens", "train/loss", "partial/rollouts_carried"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert max(m["partial/rollouts_paused"] for m in m_got) > 0
    for pid in rollout_processes:
        with open(os.path.join(got_dir, f"rollout_process-{pid}.json")) as f:
            assert json.load(f)["rounds"] >= 1
    for pid in trainers:
        with open(os.path.join(got_dir, f"host_copies-{pid}.json")) as f:
            assert json.load(f)["host_copies"] == []


@pytest.mark.slow  # ~90 s on 2 cores
def test_two_training_processes_each_drive_their_own_rollout_process(tmp_path):
    """``serving.trainer_processes=2``: processes 0 and 1 train together (one update over both
    their devices, each its own data share) and each drives the rollout process of its own
    (2 and 3): their rounds, their paused rollouts and their weights, each copied from the
    trainer's own devices. It trains as the two training processes do colocated, each
    rolling out its own share on its own device, with ``max_staleness=1`` and partial
    rollouts on."""
    apart, colocated_dir = str(tmp_path / "apart"), str(tmp_path / "colocated")
    for d in (apart, colocated_dir):
        write_data(d)
    env = dict(RJ_PARTIAL="20", RJ_TRAINER_PROCS="2", RJ_ROLLOUT_PROCS="2")
    port = free_port()
    finish([launch(port, i, apart, 1, 1, per_process=1, **env) for i in range(4)])
    port = free_port()
    finish([launch(port, i, colocated_dir, 1, 1, per_process=1, RJ_COLOCATED="1", **env) for i in range(2)])
    assert_trains_as(apart, colocated_dir, trainers=(0, 1), rollout_processes=(2, 3))


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))


@pytest.mark.slow  # ~70 s and ~100 s on 2 cores
@pytest.mark.parametrize("trainers", [1, 2])
def test_the_trainer_saves_what_it_finished_when_the_rollout_process_dies(tmp_path, trainers):
    """SIGKILL a rollout process after two steps: its trainer process is not aborted by the
    coordination service, notices the silent heartbeat within its bound, saves its last finished
    step and exits with an error that says so (no hang, nothing finished lost). With two
    training processes (each driving one rollout process, the last one killed) both learn of it
    at the same step and save it together, and the other rollout process is stopped; the same
    four processes started again resume from that step (their checkpoint written by both)."""
    import time

    workdir = str(tmp_path)
    write_data(workdir)
    env = dict(RJ_STEPS="50", RJ_SILENCE_S="10", RJ_TRAINER_PROCS=str(trainers), RJ_ROLLOUT_PROCS=str(trainers))
    port = free_port()
    procs = [launch(port, i, workdir, 0, 1, 1, **env) for i in range(2 * trainers)]
    first, dying = procs[0], procs[-1]
    try:
        log, t0 = os.path.join(workdir, "logs", "metrics.jsonl"), time.monotonic()
        while not (os.path.exists(log) and len(metrics_of(workdir)) >= 2):
            if time.monotonic() - t0 > WAIT_S or first.poll() is not None:
                pytest.fail("two steps were not logged:\n" + output_of(first)[-3000:])
            time.sleep(0.2)
        dying.kill()
        t_kill = time.monotonic()
        outs = communicate_all(procs[:-1], 120)
        waited = time.monotonic() - t_kill
    finally:
        for p in procs:
            p.kill()
    trainer_outs = outs[:trainers]
    for p, out in zip(procs, trainer_outs):
        assert p.returncode == 1, out[-4000:]
    owner = trainer_outs[-1]  # the trainer of the killed rollout process
    assert "RolloutProcessDied" in owner and "beat no heartbeat" in owner, owner[-4000:]
    if trainers > 1:
        assert "the rollouts of training process 1 failed" in trainer_outs[0], trainer_outs[0][-4000:]
        assert procs[trainers].returncode == 0, outs[trainers][-4000:]  # its own rollout process: stopped
    steps = [m["step"] for m in metrics_of(workdir)]
    for out in trainer_outs:
        assert f"step {steps[-1]} is saved in {workdir}" in out, out[-4000:]
    # silence_s 10 s, looked at every 5 s: well within a minute, nowhere near a round's wait
    assert waited < 60, waited
    saved = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    assert saved == [steps[-1]] and steps == list(range(1, steps[-1] + 1)), (saved, steps)
    if trainers > 1:
        env["RJ_STEPS"] = str(steps[-1] + 2)
        port = free_port()
        finish([launch(port, i, workdir, 0, 1, 1, **env) for i in range(2 * trainers)])
        assert [m["step"] for m in metrics_of(workdir)] == list(range(1, steps[-1] + 3))

"""Multi-process colocated RL: 2 processes x 4 CPU devices (jax.distributed, gloo CPU collectives,
localhost coordinator). The trainer's state is split over both processes; each process hands
itself a full serving copy (``serving.handoff``), rolls out its own prompt groups through the
paged engine on two TP-2 slices of its own devices (its own prompts and seeds, so its own
rollout lengths, prefill buckets and decode step counts), and the processes' rows join one
global update. The update must equal a 1-process ``rl_step`` on the same trajectories.

The code environment is a stub (instant tool answers, a verifier that scores the text by a
checksum): the subject is the serving/training hand-off, and the random tiny policy would never
earn a real reward. This file doubles as the worker:
``python tests/test_multihost_rollout.py PORT PROCESS_ID OUT_DIR``.
"""
import concurrent.futures
import os
import pickle
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from process_support import free_port, worker_env

STEPS = 2
PROCESSES = 2
PROMPTS_PER_PROCESS = 2
# different lengths on purpose: each process's prompts land in other prefill buckets
PROBLEMS = ["What is 6*7?", "Compute the sum of the first one hundred positive integers, then "
            "subtract the square of twelve and give the result in binary.",
            "1+1?", "Let x be the smallest prime greater than forty. What is x squared minus x?",
            "2*3?", "How many ways can eight rooks be placed on a chessboard so that none attacks "
            "another, counted up to rotation?", "7-5?", "Name the largest two-digit prime."]
WAIT_S = 420  # the whole 2-process run; past it the workers are killed and the test fails


class StubExecutor:
    """Instant tool answers; the verifier's verdict is a checksum bit of the model's text (mixed
    rewards, so groups survive the equal-reward filter)."""

    def submit(self, code, stdin="", timeout=None):
        from rstarjax.env import ExecResult

        fut = concurrent.futures.Future()
        fut.set_result(ExecResult("stdout", f"{len(code)}\n"))
        return fut

    def submit_verify(self, response_text, gold, timeout=None, mode="answer"):
        fut = concurrent.futures.Future()
        fut.set_result(bool(zlib.crc32(response_text.encode()) & 1))
        return fut


def rl_config():
    from rstarjax.rl.config import RLConfig

    return RLConfig(prompts_per_step=PROCESSES * PROMPTS_PER_PROCESS, group_size=2, oversample=4,
                    roc_variant="topk", roc_min_negatives=1, roc_min_positives=1, max_turns=2,
                    max_prompt_len=256, max_response_len=96, chat_format="compact",
                    rollout_timeout_s=240.0)


def tiny_policy():
    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.models.config import ModelConfig
    from rstarjax.models.qwen3 import Qwen3

    return Qwen3(ModelConfig.preset("tiny", dtype=jnp.float32, num_hidden_layers=1), rngs=nnx.Rngs(0))


def make_trainer(mesh):
    from rstarjax.rl import optim as optim_lib
    from rstarjax.rl import trainer as trainer_lib
    from rstarjax.rl.loss import LossConfig

    return trainer_lib.Trainer(tiny_policy(),
                               optim_lib.OptimConfig(learning_rate=1e-3, warmup_steps=1), LossConfig(),
                               trainer_lib.TrainerConfig(recompute_old_logprobs=True), mesh=mesh)


def step_records(step: int) -> list[dict]:
    """The global prompts of ``step`` (the data pipeline hands process p its ``host_shard``)."""
    n = PROCESSES * PROMPTS_PER_PROCESS
    return [{"problem": PROBLEMS[(step * n + i) % len(PROBLEMS)], "answer": "42"} for i in range(n)]


def worker(port: int, pid: int, out_dir: str):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=PROCESSES,
                               process_id=pid, initialization_timeout=120)
    from flax import nnx
    from jax.experimental import multihost_utils

    from rstarjax.io.data import host_shard
    from rstarjax.models.chat_template import COMPACT
    from rstarjax.models.sharding import make_mesh
    from rstarjax.models.tokenizer import load_tokenizer
    from rstarjax.rl.agent_loop import ColocatedRollouts
    from rstarjax.serving.colocated import ServingConfig
    from rstarjax.rl.loss import LossConfig
    from rstarjax.rl.step import rl_step
    from rstarjax.serving.handoff import is_process_local

    assert jax.process_count() == PROCESSES and jax.local_device_count() == 4
    cfg = rl_config()
    # fsdp spans both processes: every parameter split by "embed" has half its rows on each host
    trainer = make_trainer(make_mesh(1, 4, 2))
    rollouts = ColocatedRollouts(trainer.model(), tokenizer=load_tokenizer(486), executor=StubExecutor(),
                                 agent=cfg.agent(), sampling=cfg.sampling(), max_prompt_len=cfg.max_prompt_len,
                                 fmt=COMPACT, serving=ServingConfig(tensor_parallel=2, slices_per_host=2),
                                 num_slots=4)
    assert len(rollouts.engines) == 2
    recorded, metrics, served = [], [], []

    def recording(records, n, seed, version):
        trajs, timings = rollouts(records, n, seed, version)
        recorded.append(trajs)
        return trajs, timings

    for step in range(STEPS):
        records = step_records(step)[host_shard(PROCESSES * PROMPTS_PER_PROCESS, pid, PROCESSES)]
        metrics.append(rl_step(trainer, recording, records, cfg, LossConfig(), seed=1000 * step + pid))
        rollouts.update_params(trainer.model())
        # every engine serves a copy on its own slice of this host's devices: no program of
        # rollout can involve the other process
        for e in rollouts.engines:
            assert is_process_local(e.params), "a serving copy spans another process's devices"
        served.append(np.asarray(rollouts.engines[1].params.embed))
    params = multihost_utils.process_allgather(nnx.state(trainer.model(), nnx.Param), tiled=True)
    with open(os.path.join(out_dir, f"process{pid}.pkl"), "wb") as f:
        pickle.dump({"trajectories": recorded, "metrics": metrics, "served_embed": served,
                     "decode_steps": sum(e.decode_steps_run for e in rollouts.engines),
                     "prefill_tokens": sum(e.prefill_tokens for e in rollouts.engines),
                     "params": [np.asarray(x) for x in jax.tree.leaves(params)]}, f)
    jax.distributed.shutdown()


def test_handoff_in_one_process_keeps_the_values_in_the_local_layout():
    """The hand-off's reshard and re-wrap in one process (8 devices): the trainer's FSDP x TP
    layout becomes the local slice layout, values untouched."""
    import jax
    from flax import nnx

    from rstarjax.models.sharding import make_mesh, shard_model, state_shardings
    from rstarjax.serving.handoff import ProcessHandoff

    state = nnx.split(shard_model(tiny_policy(), make_mesh(1, 4, 2)))[1]  # the trainer's layout
    handoff = ProcessHandoff(state)
    assert dict(handoff.mesh.shape) == {"process": 1, "tensor": jax.local_device_count()}
    out = handoff(state)
    want = jax.tree.leaves(state_shardings(state, handoff.local))
    assert any(w.spec != jax.sharding.PartitionSpec() for w in want)  # some leaves really split
    for a, b, w in zip(jax.tree.leaves(state), jax.tree.leaves(out), want, strict=True):
        assert b.sharding.is_equivalent_to(w, b.ndim), (b.sharding, w)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    one = jax.device_put(state, jax.local_devices()[0])  # a state on part of the devices: placed
    for b, w in zip(jax.tree.leaves(handoff(one)), want, strict=True):
        assert b.sharding.is_equivalent_to(w, b.ndim)



def replay_reference(runs):
    """The 1-process run: ``rl_step`` over all processes' prompts at once, its rollout function
    replaying the recorded trajectories (process 1's groups numbered after process 0's)."""
    import dataclasses

    import jax
    from flax import nnx

    from rstarjax.models.sharding import make_mesh
    from rstarjax.rl.loss import LossConfig
    from rstarjax.rl.step import rl_step

    cfg = rl_config()
    trainer = make_trainer(make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    metrics = []
    for step in range(STEPS):
        trajs = [dataclasses.replace(t, group_id=t.group_id + p * PROMPTS_PER_PROCESS)
                 for p, run in enumerate(runs) for t in run["trajectories"][step]]

        def replay(records, n, seed, version, trajs=trajs):
            assert len(records) * n == len(trajs)
            return trajs, {}

        metrics.append(rl_step(trainer, replay, step_records(step), cfg, LossConfig(), seed=0))
    return trainer, [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model(), nnx.Param))], metrics


@pytest.mark.slow
def test_two_processes_roll_out_per_host_and_update_as_one(tmp_path):
    port = free_port()
    env = worker_env(4)
    logs = [tmp_path / f"process{i}.log" for i in range(PROCESSES)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(port), str(i), str(tmp_path)],
                              env=env, stdout=open(logs[i], "w"), stderr=subprocess.STDOUT)
             for i in range(PROCESSES)]
    try:  # a failed process leaves the other waiting in a collective: stop at the first failure
        deadline = time.monotonic() + WAIT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tails = "\n".join(f"--- process {i} ---\n" + logs[i].read_text()[-3000:] for i in range(PROCESSES))
    assert None not in codes or any(codes), f"multi-process rollout hung past {WAIT_S} s\n{tails}"
    assert codes == [0] * PROCESSES, f"exit codes {codes}\n{tails}"
    runs = []
    for pid in range(PROCESSES):
        with open(tmp_path / f"process{pid}.pkl", "rb") as f:
            runs.append(pickle.load(f))
    # the processes really ran different programs: other prompts, other rollout lengths
    lengths = [[sorted(len(t.response_ids) for t in trajs) for trajs in run["trajectories"]] for run in runs]
    assert lengths[0] != lengths[1]
    assert runs[0]["prefill_tokens"] != runs[1]["prefill_tokens"]
    assert all(m["filter/updated"] == 1.0 for run in runs for m in run["metrics"])

    ref, want, ref_metrics = replay_reference(runs)
    assert ref.step == STEPS
    for p, run in enumerate(runs):
        np.testing.assert_allclose([m["train/grad_norm"] for m in run["metrics"]],
                                   [m["train/grad_norm"] for m in ref_metrics], rtol=1e-4)
    got = runs[0]["params"]
    assert len(got) == len(want) and runs[1]["params"][0].shape == got[0].shape
    for g, h, w in zip(got, runs[1]["params"], want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5)
        np.testing.assert_array_equal(g, h)
    # each process served the updated policy (its embedding; the head is tied to it)
    embed = np.asarray(ref.model().embed[...])
    for run in runs:
        np.testing.assert_allclose(run["served_embed"][-1], embed, rtol=1e-4, atol=2e-5)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

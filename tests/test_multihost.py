"""Multi-process training: 2 processes x 2 CPU devices (jax.distributed, gloo CPU collectives,
localhost coordinator), each feeding only its own half of the batch, reach the parameters of a
1-process run on the whole batch; the second batch has padding rows (rejected groups), which
each process arranges in its own rows and every process skips together. This file doubles
as the worker:
``python tests/test_multihost.py PORT PROCESS_ID OUT.npz``.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from process_support import communicate_all, free_port, worker_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

STEPS = 2


def batches():
    """Step 1: every row trained; step 2: half the rows padding, one real and one padding row
    per 2-row micro-batch slot as given (so the arrangement must move them)."""
    from test_trainer import random_batch

    out = [random_batch(s) for s in range(1, STEPS + 1)]
    for k in out[-1]:
        out[-1][k][[1, 2, 5, 6]] = 0
    return out


def run_training(batches, mesh, process_rows=None):
    """AdamW steps on the tiny model; with ``process_rows`` each process passes only its rows."""
    from test_trainer import tiny_model

    from rstarjax.rl import optim as optim_lib
    from rstarjax.rl import trainer as trainer_lib
    from rstarjax.rl.loss import LossConfig

    tr = trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(learning_rate=1e-3, warmup_steps=1), LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=4, recompute_old_logprobs=True), mesh=mesh)
    metrics = []
    for b in batches:
        if process_rows is not None:
            b = {k: v[process_rows] for k, v in b.items()}
        metrics.append(tr.train(b))
    return tr, metrics


def worker(port: int, pid: int, out: str):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    from jax.experimental import multihost_utils
    from test_trainer import B

    from rstarjax.models import sharding as sharding_lib

    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
    mesh = sharding_lib.make_mesh(2, 1, 2)  # data across the two processes, tensor within each
    half = B // 2
    tr, metrics = run_training(batches(), mesh, process_rows=slice(pid * half, (pid + 1) * half))
    params = multihost_utils.process_allgather(tr.state.params, tiled=True)
    if pid == 0:
        np.savez(out, grad_norm=np.array([m["train/grad_norm"] for m in metrics]),
                 **{f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))})
    jax.distributed.shutdown()



@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    import jax

    from rstarjax.models import sharding as sharding_lib

    port, out = free_port(), str(tmp_path / "multi.npz")
    env = worker_env(2)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(port), str(i), out], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    # the 1-process reference on the whole batch while the workers run
    ref, ref_metrics = run_training(batches(), sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    try:
        logs = communicate_all(procs, 500)
    except subprocess.TimeoutExpired:
        pytest.fail("multi-process workers timed out")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    got = np.load(out)
    np.testing.assert_allclose(got["grad_norm"], [m["train/grad_norm"] for m in ref_metrics], rtol=1e-4)
    want = [np.asarray(x) for x in jax.tree.leaves(ref.state.params)]
    assert len(want) == len([k for k in got.files if k.startswith("p")])
    for i, w in enumerate(want):
        np.testing.assert_allclose(got[f"p{i}"], w, rtol=1e-4, atol=2e-5)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

"""benchmarks/rl_pipeline.py --smoke end to end: every arm (colocated, and disaggregated over two
processes) runs the real RL stage (engine, scheduler, code pool, verifier, RoC, update, hand-off)
and it prints the JSON line docs/training.md reads. Only counts are asserted, never speeds:
figures come from idle-machine runs."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("sync", "partial", "async", "async_partial", "processes_sync", "processes_async")
KEYS = ("partial_speedup", "policy_lag_max", "policy_lag_mean", "async_speedup", "async_colocated_speedup",
        "async_policy_lag_max", "async_partial_speedup", "async_partial_policy_lag_max", *ARMS)


@pytest.mark.slow  # ~4.5 min on 2 cores: six short RL stages
def test_smoke_run_trains_every_arm_and_the_partial_and_async_ones_carry_rollouts_across_updates():
    """Every arm: synchronous, partial, asynchronous colocated (alone and with partial
    rollouts), and disaggregated (a trainer
    process and a rollout process, each on its own CPU device and core) synchronous and
    asynchronous. (The one-process disaggregated arms run outside the smoke run only.)"""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)  # one device: the benchmark's mesh
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "rl_pipeline.py"), "--smoke"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert not [k for k in KEYS if k not in line]
    for arm in ARMS:
        assert line[arm]["trained_tokens"] > 0 and line[arm]["steps"] == 1
    # a 16-token budget pauses the scripted rollouts (tens of tokens): some trained tokens were
    # sampled by the policy before the last update
    assert line["policy_lag_max"] >= 1
    # the rollout thread sampled a round under the weights before the update that trained it,
    # never two updates before
    assert line["async_policy_lag_max"] == 1
    assert line["async_partial_policy_lag_max"] >= 1 and line["async_partial"]["rounds_per_step"] >= 1
    assert line["processes_async"]["policy_lag_max"] == 1 and line["async_speedup"] > 0
    assert "disaggregated_sync" not in line


def test_an_unknown_arm_is_refused_before_anything_runs():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "rl_pipeline.py"), "--smoke",
                          "--arms", "async,asynch"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "unknown arms ['asynch']" in out.stderr

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
    assert line["processes_async"]["policy_lag_max"] == 1
    assert "disaggregated_sync" not in line
    # every speedup divides by the fastest synchronous arm of the round (one round here: the
    # arms' own figures), never by a slower layout's synchronous arm
    fastest = max(("sync", "processes_sync"), key=lambda a: line[a]["trained_tokens_per_s"])
    assert line["baseline"] == [fastest]
    for name, arm in (("partial_speedup", "partial"), ("async_colocated_speedup", "async"),
                      ("async_partial_speedup", "async_partial"), ("async_speedup", "processes_async")):
        want = line[arm]["trained_tokens_per_s"] / line[fastest]["trained_tokens_per_s"]
        assert line[name] == pytest.approx(want, rel=1e-9) and line["spread"][name] == [line[name]] * 2
    assert line["same_layout_speedup"]["async_speedup"] == pytest.approx(
        line["processes_async"]["trained_tokens_per_s"] / line["processes_sync"]["trained_tokens_per_s"], rel=1e-9)
    assert line["async_speedup"] <= line["same_layout_speedup"]["async_speedup"] * (1 + 1e-9)


SUMMARY_PROBE = """
import json, runpy, sys
sys.argv = ["rl_pipeline.py", "--smoke"]
g = runpy.run_path(PATH, run_name="rl_pipeline")
def arm(tps, lag=None):
    return {"trained_tokens_per_s": tps, **({} if lag is None else {"policy_lag_max": lag, "policy_lag_mean": lag / 2})}
runs = {"sync": [arm(490.0), arm(500.0)], "partial": [arm(480.0, 3), arm(470.0, 5)], "async": [], "async_partial": [],
        "disaggregated_sync": [], "disaggregated_async": [],
        "processes_sync": [{**arm(350.0), "pinned": 1.0}, {**arm(510.0), "pinned": 1.0}],
        "processes_async": [arm(510.0, 1), arm(520.0, 1)]}
print(json.dumps({"order": [g["round_order"](["sync", "partial", "async"], r) for r in (0, 1, 2)],
                  "summary": g["summary"](runs)}))
"""


def test_each_speedup_divides_by_the_rounds_fastest_synchronous_arm_and_rounds_alternate():
    """The summary of two made-up rounds: in round 0 the two-process synchronous arm is slower
    than the colocated loop (as measured on 2 cores), in round 1 faster; each round's ratio is
    taken against that round's fastest, the lag is the largest over rounds, and the arms' order
    reverses every other round."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = SUMMARY_PROBE.replace("PATH", repr(os.path.join(ROOT, "benchmarks", "rl_pipeline.py")))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["order"] == [["sync", "partial", "async"], ["async", "partial", "sync"], ["sync", "partial", "async"]]
    line = got["summary"]
    assert line["baseline"] == ["sync", "processes_sync"]
    assert line["spread"]["async_speedup"] == pytest.approx([520 / 510, 510 / 490])  # [min, max]
    assert line["async_speedup"] == pytest.approx((510 / 490 + 520 / 510) / 2)
    assert line["same_layout_speedup"]["async_speedup"] == pytest.approx((510 / 350 + 520 / 510) / 2)
    assert line["spread"]["partial_speedup"] == pytest.approx([470 / 510, 480 / 490])
    assert line["policy_lag_max"] == 5 and line["async_policy_lag_max"] == 1
    assert line["async_colocated_speedup"] is None and line["async_speedup_one_process"] is None


def test_an_unknown_arm_is_refused_before_anything_runs():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "rl_pipeline.py"), "--smoke",
                          "--arms", "async,asynch"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "unknown arms ['asynch']" in out.stderr

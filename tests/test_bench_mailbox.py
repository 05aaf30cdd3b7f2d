"""benchmarks/mailbox.py end to end at a tiny volume (two jax.distributed processes, a few
hundred KB per message), and its line fit and projection by hand."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# by its path: the standard library has a module called mailbox too
_spec = importlib.util.spec_from_file_location("bench_mailbox", os.path.join(ROOT, "benchmarks", "mailbox.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_paper_step_is_1_6_gb_of_token_ids_and_logprobs():
    assert bench.paper_bytes() == 512 * 32 * 12_288 * (4 + 4) == 1_610_612_736


def test_the_line_through_the_trials_projects_the_paper_step():
    # 2 s per GB and 0.5 s of fixed cost, exactly
    trials = [{"arm": arm, "rollouts": r, "bytes": r * 12_288 * 8, "seconds": 0.5 + 2e-9 * r * 12_288 * 8 * k,
               "run": 0} for r in (128, 512) for arm, k in (("mailbox", 1), ("socket", 0.5))]
    out = bench.summarize(trials, 12_288)
    assert out["lines"]["mailbox"]["slope_s_per_gb"] == pytest.approx(2.0)
    assert out["lines"]["mailbox"]["intercept_s"] == pytest.approx(0.5)
    assert out["paper_step_projected_s"]["mailbox"] == pytest.approx(0.5 + 2 * 1.610612736)
    assert out["paper_step_projected_s"]["socket"] == pytest.approx(0.5 + 1.610612736)
    assert out["volumes"][1]["mailbox"]["median_s"] == pytest.approx(0.5 + 2e-9 * 512 * 12_288 * 8)


def test_two_processes_move_messages_through_the_coordination_service():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "mailbox.py"), "--rollouts", "2,8",
                          "--tokens", "4096", "--runs", "1", "--wait-s", "120"],
                         capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert [v["bytes"] for v in res["volumes"]] == [2 * 4096 * 8, 8 * 4096 * 8]
    assert {t["arm"] for t in res["trials"]} == {"mailbox", "socket"} and len(res["trials"]) == 4
    assert all(t["seconds"] > 0 for t in res["trials"])

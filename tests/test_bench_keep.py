"""benchmarks/keep.py: R runs of a benchmark, their median and spread, and what an interrupted
series keeps. The benchmark here is a small script whose figure changes from run to run (a
counter file), so the medians below are known before keep.py computes them."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEP = os.path.join(ROOT, "benchmarks", "keep.py")

# Run i (from 0) prints tokens_per_s = FIGURES[i]; run FAIL_AT (if set) exits 3 instead.
BENCH = textwrap.dedent("""
    import json, os, sys
    figures = [30.0, 10.0, 20.0, 50.0]
    counter = sys.argv[1]
    i = int(open(counter).read()) if os.path.exists(counter) else 0
    open(counter, "w").write(str(i + 1))
    if os.environ.get("FAIL_AT") == str(i):
        sys.exit(3)
    print("warming up")
    print(json.dumps({"tokens_per_s": figures[i], "arms": {"ours": figures[i], "base": 5},
                      "order": ["ours", "base"], "label": "run %d" % i, "ok": True}))
""")


def keep(tmp_path, *extra, env=None):
    bench = tmp_path / "bench.py"
    bench.write_text(BENCH)
    out = tmp_path / "results"
    cmd = [sys.executable, KEEP, "toy", "--allow-dirty", "--out-dir", str(out), *extra, "--",
           sys.executable, str(bench), str(tmp_path / "counter")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    files = sorted(out.glob("cpu-*-toy.json")) if out.exists() else []
    return done, (json.loads(files[0].read_text()) if files else None)


def test_three_runs_give_the_median_and_spread_with_provenance(tmp_path):
    done, doc = keep(tmp_path, "--runs", "3", "--machine", "test host")
    assert done.returncode == 0, done.stderr
    assert doc["runs_finished"] == doc["runs_asked"] == 3
    assert doc["result"]["tokens_per_s"] == 20.0  # median of 30, 10, 20
    assert doc["spread"]["tokens_per_s"] == [10.0, 30.0]
    assert doc["result"]["arms"] == {"ours": 20.0, "base": 5}
    assert doc["result"]["order"] == ["ours", "base"] and doc["result"]["ok"] is True
    assert doc["result"]["label"] == ["run 0", "run 1", "run 2"]  # texts that differ: every value
    assert [r["tokens_per_s"] for r in doc["runs"]] == [30.0, 10.0, 20.0]
    for key in ("command", "commit", "machine", "date"):
        assert doc[key], key
    assert doc["machine"].startswith("test host; ") and "load average" in doc["machine"]
    assert "bench.py" in doc["command"] and "jax" in doc["versions"]


def test_a_failed_run_keeps_the_runs_before_it(tmp_path):
    done, doc = keep(tmp_path, "--runs", "3", env={"FAIL_AT": "2"})
    assert done.returncode == 1
    assert "run 3 exited 3" in done.stderr
    assert doc["runs_finished"] == 2 and doc["runs_asked"] == 3
    assert doc["result"]["tokens_per_s"] == 20.0  # median of 30, 10
    assert doc["spread"]["tokens_per_s"] == [10.0, 30.0]


def test_a_run_that_prints_no_json_is_a_clear_error(tmp_path):
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, KEEP, "toy", "--allow-dirty", "--out-dir", str(out), "--",
                           sys.executable, "-c", "print('no json here')"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "last stdout line is not JSON" in done.stderr and "no json here" in done.stderr
    assert not out.exists() or not list(out.iterdir())


def test_a_run_past_its_limit_is_stopped(tmp_path):
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, KEEP, "toy", "--allow-dirty", "--timeout-s", "2",
                           "--out-dir", str(out), "--", sys.executable, "-c",
                           "import time; time.sleep(60)"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "--timeout-s 2" in done.stderr


@pytest.mark.parametrize("argv", [["toy"], ["toy", "--runs", "0", "--", "true"]])
def test_bad_arguments_are_refused(argv):
    done = subprocess.run([sys.executable, KEEP, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr

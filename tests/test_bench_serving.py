"""benchmarks/serving.py --device cpu --smoke (--quick's sizes, without its untimed compile round)
end to end: it prints the JSON line docs/serving.md
reads, and the checks that ride along hold (greedy tokens equal HF transformers' and the dense
engine's, rollouts token for token the dense engine's). Only counts are asserted, never speeds:
figures come from idle-machine runs (docs/serving.md)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("paged_concurrency_ratio", "prompt_prefill_reduction", "host_syncs_per_token",
        "makespan_speedup_vs_dense_engine", "makespan_speedup_vs_static_async",
        "makespan_speedup_vs_static_sync", "makespan_speedup_vs_static_launch_all",
        "decode_speedup_vs_hf", "prefill_token_ratio", "static_split_imbalance",
        "decode_idle_frac", "decode_idle_frac_fifo_dispatch", "makespan_speedup_vs_fifo_dispatch")


@pytest.mark.slow  # ~100 s on 2 cores
def test_quick_cpu_run_prints_every_figure_and_its_checks_hold():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)  # the benchmark's own 2 slices on the host's devices
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "serving.py"),
                          "--device", "cpu", "--smoke"], capture_output=True, text=True,
                         env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert not [k for k in KEYS if k not in line]
    # Outside references: HF transformers' greedy tokens, the dense engine's rollouts.
    assert line["decode_greedy_match_hf"] == 1.0
    assert line["decode_greedy_match_dense_engine"] == 1.0
    assert line["prompt_prefill_same_tokens"] == 1.0
    assert line["rollouts_same_tokens_as_dense_engine"] == 1.0
    assert line["fifo_dispatch_same_tokens"] == 1.0  # the dispatch order changes no rollout
    assert 0.0 <= line["tool_blocked_frac"] <= line["decode_idle_frac"] <= 1.0
    assert line["reward_mean"] == 1.0 and line["tool_calls"] > 0
    # Counts (not timings): one prefill per prompt, not per sample; a host sync per decode
    # call of several steps; more rollouts live in the same KV memory while others wait.
    assert line["prompt_prefill_reduction"] >= 16
    assert line["host_syncs_per_token"] <= 1 / 8
    assert line["paged_live_while_queued"] > line["dense_live_while_queued"] > 0
    assert line["prefill_tokens_extend"] < line["prefill_tokens_reprefill"]

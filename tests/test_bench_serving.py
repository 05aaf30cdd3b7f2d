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


@pytest.mark.slow  # ~150 s on 2 cores (HF's torch.compile arm ~40 s of it)
def test_quick_cpu_run_prints_every_figure_and_its_checks_hold():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)  # the benchmark's own 2 slices on the host's devices
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "serving.py"),
                          "--device", "cpu", "--smoke", "--hf-arms", "dynamic,static,compiled"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert not [k for k in KEYS if k not in line]
    # Outside references: HF transformers' greedy tokens, the dense engine's rollouts.
    assert line["decode_greedy_match_hf"] == 1.0
    for arm in ("dynamic", "static", "compiled"):  # every HF arm decodes the same greedy tokens
        assert line[f"decode_greedy_match_hf_{arm}"] == 1.0 and line[f"decode_tok_s_hf_{arm}"] > 0
    assert line["decode_hf_fastest_arm"] in ("dynamic", "static", "compiled")
    assert line["decode_greedy_match_dense_engine"] == 1.0
    assert line["prompt_prefill_same_tokens"] == 1.0
    assert line["rollouts_same_tokens_as_dense_engine"] == 1.0
    assert line["fifo_dispatch_same_tokens"] == 1.0  # the dispatch order changes no rollout
    assert 0.0 <= line["tool_blocked_frac"] <= line["decode_idle_frac"] <= 1.0
    assert line["reward_mean"] == 1.0 and line["tool_calls"] > 0
    # Counts (not timings): one prefill per prompt, not per sample (so the reduction is the
    # samples per prompt, by construction); a host sync per decode call of several steps,
    # against the dense engine's one per step counted in the same run; more rollouts live in
    # the same KV memory while others wait.
    assert line["prompt_prefill_reduction"] == line["prompt_prefill_samples_per_prompt"]
    assert line["host_syncs_per_decode_step_dense_engine"] >= 1.0
    assert line["host_syncs_per_decode_step"] <= line["host_syncs_per_decode_step_dense_engine"] / 4
    assert line["host_sync_reduction_vs_dense_engine"] == pytest.approx(
        line["host_syncs_per_token_dense_engine"] / line["host_syncs_per_token"], rel=1e-2)  # 4-decimal figures
    assert line["paged_live_while_queued"] > line["dense_live_while_queued"] > 0
    assert line["prefill_tokens_extend"] < line["prefill_tokens_reprefill"]


ROOFLINE_PROBE = """
import json, runpy, sys
sys.argv = ["serving.py", "--device", "cpu"]
g = runpy.run_path(PATH, run_name="bench_serving")
from rstarjax.models.config import ModelConfig
from rstarjax.serving.sizing import serving_weight_bytes
import jax.numpy as jnp
out = {}
for preset in ("qwen3-1.7b", "qwen3-8b"):
    cfg = ModelConfig.preset(preset, dtype=jnp.bfloat16)
    out[preset] = {"read": g["decode_weight_bytes_read"](cfg, 64), "served": serving_weight_bytes(cfg, jnp.bfloat16),
                   "tied": cfg.tie_word_embeddings, "vocab": cfg.vocab_size, "hidden": cfg.hidden_size}
print(json.dumps(out))
"""


def test_the_decode_roofline_reads_an_untied_input_embedding_only_at_its_rows():
    """A decode step gathers 64 rows of Qwen3-8B's untied 151,936 x 4,096 input table, not the
    table (it reads the separate LM head whole); Qwen3-1.7B's tied table is the LM head, read
    whole. The 8B byte count by hand: the served copy less the table plus 64 rows."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = ROOFLINE_PROBE.replace("PATH", repr(os.path.join(ROOT, "benchmarks", "serving.py")))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    small, big = got["qwen3-1.7b"], got["qwen3-8b"]
    assert small["tied"] and small["read"] == small["served"]
    assert not big["tied"] and (big["vocab"], big["hidden"]) == (151936, 4096)
    assert big["read"] == big["served"] - 151936 * 4096 * 2 + 64 * 4096 * 2
    # the H200 figure of 2026-11-26 (benchmarks/profiles/h200-2026-11-26/gpu_check.json):
    # 22.4968 GB per step counted the whole table; corrected, 45.7 % is 43.2 %
    corrected = 0.4571 * (22.4968e9 - (big["served"] - big["read"])) / 22.4968e9
    assert round(100 * corrected, 1) == 43.2

"""benchmarks/bench_tokenizer.py at a small corpus: the same ids as HF `tokenizers`, and its
speedup divided by the faster of HF's two arms (it was quoted against the slower one)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tokenizer_benchmark_compares_with_the_faster_hf_arm():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_tokenizer.py"), "--chars", "50000"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["identical"] is True and res["chars"] >= 50000
    fastest = max(res["baseline_hf_tokenizers_batch_mchars_per_s"], res["baseline_hf_tokenizers_single_mchars_per_s"])
    assert res["speedup_vs_hf"] == pytest.approx(res["ours_tiktoken_mchars_per_s"] / fastest, rel=0.05, abs=0.05)
    assert res["speedup_vs_hf"] <= res["speedup_vs_hf_single"]

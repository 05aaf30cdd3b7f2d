"""benchmarks/bench_trainer.py: the model-FLOP count by hand, and the --plan / --memory-scan modes
end to end at tiny sizes (one JSON line; a plan that cannot fit exits 1 naming the fix)."""
import json
import os
import subprocess
import sys

import pytest

from rstarjax.models import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)  # the plan sets its own simulated device count
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_trainer.py"),
                           *args], capture_output=True, text=True, env=env, timeout=600)


def test_train_flops_per_token_by_hand():
    cfg = ModelConfig.preset("qwen3-14b")
    d, f, hd, nq, nkv, layers, v = 5120, 17408, 128, 40, 8, 40, 151936
    per_layer = d * nq * hd + d * nkv * hd + d * nkv * hd + nq * hd * d + d * f + d * f + f * d
    seq = 8192
    causal_pairs_per_token = (seq + 1) / 2  # query t sees t + 1 keys, averaged over t
    attention_fwd = layers * 2 * (2 * nq * hd) * causal_pairs_per_token  # QK^T and PV
    want = 3 * (2 * (layers * per_layer + d * v) + attention_fwd)  # forward + 2x backward
    assert cfg.train_flops_per_token(seq) == pytest.approx(want, rel=1e-12)


@pytest.mark.slow
def test_plan_refuses_what_cannot_fit_and_names_the_fix():
    tiny = ["--plan", "--models", "tiny", "--meshes", "h100x1", "--plan-seq", "256"]
    ok = _bench(*tiny, "--kv-slots", "4")
    assert ok.returncode == 0, ok.stderr[-2000:]
    plan = json.loads(ok.stdout.strip().splitlines()[-1])["plans"][0]
    assert plan["fits"] and 0 <= plan["train_peak_gb"] < plan["usable_gb"]
    too_many = _bench(*tiny, "--kv-slots", str(10 ** 9))
    assert too_many.returncode == 1
    plan = json.loads(too_many.stdout.strip().splitlines()[-1])["plans"][0]
    assert not plan["fits"] and "concurrent rollouts" in plan["problems"][0]
    assert "DOES NOT FIT" in too_many.stderr


@pytest.mark.slow
def test_plan_activations_on_one_device_are_not_the_optimizer_update():
    """On one device the step's peak is its optimizer update (the new AdamW moments and the
    updates, 3 x the float32 weights, held beside the old ones until the non-finite guard picks
    them), not its backward pass: step temp - gradient came out exactly the optimizer's bytes and
    was printed as the activations (4.77 GB for Qwen3-0.6B at 512 tokens). The activations are
    the forward and backward's own temp: within 3x of plan_memory's (measured on an H100)."""
    import jax.numpy as jnp
    from rstarjax.serving.sizing import plan_memory
    out = _bench("--plan", "--models", "qwen3-0.6b", "--meshes", "h100x1", "--plan-seq", "512",
                 "--kv-slots", "4")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout.strip().splitlines()[-1])["plans"][0]
    assert plan["activations_gb"] != plan["optimizer_gb"]
    cfg = ModelConfig.preset("qwen3-0.6b", dtype=jnp.bfloat16)
    analytic = plan_memory(cfg, rows=1, seq_len=512, remat_policy="full").activations / 1e9
    assert analytic / 3 <= plan["activations_gb"] <= 3 * analytic, (plan["activations_gb"], analytic)
    # the update is the peak here: what it holds beyond the gradient is the new moments
    assert plan["update_gb"] == pytest.approx(plan["optimizer_gb"], abs=0.02)
    parts = plan["params_gb"] + plan["optimizer_gb"] + plan["grads_gb"]
    assert plan["train_peak_gb"] == pytest.approx(parts + max(plan["activations_gb"], plan["update_gb"]), abs=0.03)
    assert f"activations {plan['activations_gb']}, update {plan['update_gb']})" in out.stderr


@pytest.mark.slow
def test_memory_scan_prints_peak_bytes_per_length():
    out = _bench("--memory-scan", "--lengths", "256,512", "--vocab", "512", "--no-baseline")
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(res["peak_bytes"]) == {"256", "512"} and res["ran_lengths"] == [256, 512]
    assert 0.5 < res["growth_per_doubling_max"] < 2.2


@pytest.mark.slow
def test_padding_mode_skips_the_padding_micro_batches_with_the_same_weights():
    out = _bench("--padding", "0.5", "--batch", "8", "--seq", "64", "--micro", "2", "--steps", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["bench"] == "trainer_padding" and res["micro_batches"] == 4
    assert res["padding_micro_batches_skipped"] == 2
    assert res["max_param_diff"] < 1e-5 and res["updates_each"] >= 3
    # one timing each (--repeats 1): the speedup is its two arms' ratio, not a number of its own
    # (the step times are rounded to 0.1 ms in the line, hence the tolerance)
    assert res["repeats"] == 1 and res["speedup_range"] == [res["speedup"], res["speedup"]]
    assert res["speedup"] == pytest.approx(res["all_rows_step_s"] / res["skip_step_s"], rel=0.03)


@pytest.mark.slow
def test_lora_plan_counts_the_adapters_frozen_base_and_serving_copy():
    """--lora-rank: trained parameters are the adapters alone (r (in + out) per projection and
    layer, by hand), the frozen base counted in bf16, the serving copy in both peaks."""
    out = _bench("--plan", "--lora-rank", "4", "--models", "tiny", "--meshes", "t4", "--plan-seq", "256",
                 "--kv-slots", "4")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout.strip().splitlines()[-1])["plans"][0]
    cfg = ModelConfig.preset("tiny")
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, 4 * 16, 2 * 16
    per_layer = 4 * ((d + q) + (d + kv) * 2 + (q + d) + (d + f) * 2 + (f + d))
    assert plan["lora_rank"] == 4 and plan["trained_params"] == cfg.num_hidden_layers * per_layer
    assert plan["frozen_gb"] == pytest.approx(cfg.num_params * 2 / 1e9, abs=0.01)
    assert plan["serving_copy_gb"] == pytest.approx(cfg.num_params * 2 / 1e9, abs=0.01)
    assert plan["mesh"] == "t4" and plan["usable_gb"] == pytest.approx(15.2) and plan["fits"]


def test_optimizer_guard_benchmark_runs_and_both_guards_agree():
    """benchmarks/optimizer_guard.py at a tiny size: its JSON line, and the branch (the trainer's
    guard) gives the parameters and moments the elementwise select did."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "optimizer_guard.py"),
                          "--params-m", "0.02", "--repeats", "1", "--steps", "1"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["same_params_and_moments"] is True
    assert line["branch_step_ms"] > 0 and line["select_step_ms"] > 0


@pytest.mark.slow
def test_the_previous_step_baseline_runs_beside_ours():
    """``--baseline previous`` (the step before chunked vocabularies: full [B, L, V] logits)
    traces the trainer's step with an old forward patched in; it broke silently when the
    forward's signature grew (a TypeError at its first trace), as no test ran it."""
    out = _bench("--batch", "4", "--seq", "64", "--steps", "1", "--vocab", "512", "--baseline", "previous",
                 "--dtype", "float32")
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["baseline_step_s"] > 0 and res["trainer_step_s"] > 0
    scan = _bench("--memory-scan", "--lengths", "256,512", "--vocab", "512")  # its baseline: the same
    assert scan.returncode == 0, scan.stderr[-2000:]
    res = json.loads(scan.stdout.strip().splitlines()[-1])
    assert res["growth_per_doubling_max"] > 0

"""The prepared device check (benchmarks/gpu_check.py) and the kernel sweep run on CPU at the tiny
shape, so neither rots between sessions that are lent a GPU."""
import json
import os
import re
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "OUT")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.mark.slow  # the stage-1 main job at tiny size twice (the h100 part after a 3-step SFT), a decode
#                   and a train benchmark, the checkpoint A/B: ~8 min on a loaded 2-core CPU, cold
def test_gpu_check_runs_every_part_at_the_tiny_shape(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"),
                           "--shape", "tiny", "--out", str(out), "--commit", "test",
                           "--parts", "env,main,serving,train,h100,ckpt"],
                          capture_output=True, text=True, env=_env(), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    parts = report["parts"]
    assert set(parts) == {"env", "main", "h100", "ckpt", "serving_tiny", "train_1x256"}
    assert all(p["ok"] for p in parts.values()), {k: p["error"] for k, p in parts.items()}

    main = parts["main"]["result"]
    steps = main["steps"]
    assert len(steps) == 2 and main["checkpoints"] == ["2"]  # 2 RL steps, the last one saved
    for s in steps:
        for key in ("prefill_s", "decode_s", "old_logprobs_s", "update_s", "handoff_s",
                    "decode_tok_s", "trained_tok_s"):
            assert s[key] > 0, (key, s)
        # the pool holds every rollout at full length and the tiny model calls no tool: nothing
        # is preempted or prefilled twice
        assert s["preemptions"] == 0 and s["reprefilled_tokens"] == 0, s
        # 2 prompts x G=2 kept rows of at most 48 response tokens are trained
        assert 0 < s["trained_tokens"] <= 2 * 2 * 48
        # every one of the 8 rollouts decodes at most 48 tokens, the first from the prefill
        assert 0 < s["generated_tokens"] <= 8 * 47
    assert "checkpoint_s" in steps[1] and "checkpoint_s" not in steps[0]
    metrics = [json.loads(x) for x in (out / "main_metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]

    # h100: the memory plan sized the run, a short SFT ran, then stage 1 from its checkpoint
    agent = parts["h100"]["result"]
    plan = agent["plan"]
    assert plan["remat_policy"] in ("dots_attention", "attention", "full") and 4 % plan["micro_batch"] == 0
    assert 0 < plan["kv_memory_fraction"] <= 1 and plan["peak_gb"] <= plan["device_gb"]
    assert agent["sft"]["steps"] == 3 and agent["sft"]["last_loss"] < agent["sft"]["first_loss"]
    assert agent["sft"]["skipped_nonfinite"] == 0  # counted from the SFT's own metrics
    assert len(agent["steps"]) == 2 and agent["checkpoints"] == ["2"]  # saved at 1 and 2, keep=1
    # step 1's save copied behind step 2's rollouts; step 2's update waited for what was left
    assert agent["steps"][1]["checkpoint_copy_s"] > 0 and agent["steps"][1]["checkpoint_copy_wait_s"] >= 0
    for s in agent["steps"]:
        for key in ("rollout_s", "decode_s", "prefill_s", "old_logprobs_s", "update_s", "handoff_s"):
            assert s[key] > 0, (key, s)
        assert 0 <= s["tool_call_rate"] <= 1 and s["tool_calls_per_rollout"] >= 0 and "compile_s" in s
        # what the decode steps read, for their roofline: every decoded token attends to its
        # prompt (>= 30 tokens of the demo's problems) and more
        assert s["decode_steps"] > 0 and s["decode_kv_tokens"] > 30 * s["generated_tokens"] > 0, s
    assert "checkpoint_s" in agent["steps"][1]
    # jax's compile log, split by step: step 1 compiled the engine's prefill feed; step 2 compiled no
    # prefill-phase program again at a shape step 1 had compiled (058d7df)
    assert "feed_program" in agent["compiled_programs"]["1"], agent["compiled_programs"]
    assert "step" in agent["compiled_programs"]["1"]  # the train step, compiled by step 1's update
    assert agent["step2_prefill_recompiles"] == [], agent["step2_prefill_compiles"]
    assert [m["step"] for m in map(json.loads, (out / "h100_metrics.jsonl").read_text().splitlines())] == [1, 2]
    # the job sizes itself from the plan only where the device reports its memory: not on CPU
    assert agent["run_plan"] == ""

    # ckpt: what a save adds to a step, the shipped copy behind the rollouts first, then in the loop
    ckpt = parts["ckpt"]["result"]
    arms = [r["arm"] for r in ckpt["runs"]]
    assert arms == ["background_pinned", "pinned", "background_pageable", "pageable"][:len(arms)] and len(arms) >= 2
    assert all(r["wait_s"] > 0 and r["copy_s"] > 0 and r["write_s"] > 0 for r in ckpt["runs"]), ckpt
    behind, in_loop = ckpt["runs"][0], ckpt["runs"][1]
    assert behind["work_s"] > 0 and behind["update_wait_s"] >= 0 and behind["step_increase_s"] >= behind["wait_s"]
    assert in_loop["step_increase_s"] == in_loop["wait_s"] and "work_s" not in in_loop
    assert ckpt["arrays"] == 3 * 13 and ckpt["pinned_step_increase_s"] > 0 and ckpt["device_get_gbps"] > 0

    serving = parts["serving_tiny"]["result"]
    assert serving["tiny_b4_decode_tok_s"] > 0 and serving["tiny_b4_calls"] == 4
    with tarfile.open(out / "traces.tar") as tar:
        names = set(tar.getnames())
    assert {"decode_tiny_b4.json.gz", "train_tiny_1x256.json.gz"} <= names
    # the table comes last, one row per main step
    table = proc.stdout[proc.stdout.rindex("-" * 100 + "\n", 0, len(proc.stdout) - 102):]
    assert "main step 1" in table and "main step 2" in table and "decode tiny_b4" in table
    assert "h100 plan" in table and "h100 step 2" in table
    assert re.search(r"h100 step-2 prefill recompiles +none", table)
    assert re.search(r"ckpt +0.0 GB in 39 arrays; device_get", table)
    assert re.search(r"ckpt background_pinned +step \+[0-9.]+ s \(save [0-9.]+ s, rollouts [0-9.]+ s, "
                     r"update waited [0-9.]+ s\); copy [0-9.]+ s, write [0-9.]+ s", table)
    assert re.search(r"ckpt pinned +step \+[0-9.]+ s \(save [0-9.]+ s\); copy", table)


def test_an_engine_arm_that_does_not_compile_is_a_row_not_the_end():
    """A decode arm whose program fails to compile (here a name the engine refuses; on a device,
    a kernel Triton cannot fit) is reported as an error row; the arms after it still run."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "decode_kernel_sweep.py"),
                           "--engine", "--tiny", "--batches", "4",
                           "--engine-arms", "reference:exact,nonsense:exact"],
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["attention"]: r for r in map(json.loads, proc.stdout.splitlines()) if r.get("engine")}
    assert "nonsense" in rows["nonsense"]["error"] and "step_ms" not in rows["nonsense"]
    assert rows["reference"]["calls"] == 2 and rows["reference"]["decode_tok_s"] > 0  # tiny: 2 rounds


@pytest.mark.slow  # the Pallas interpreter: ~25 s
def test_kernels_part_runs_the_sweep_against_the_reference(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"),
                           "--shape", "tiny", "--parts", "env,kernels", "--out", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "gpu_check.json").read_text())["parts"]["kernels"]["result"]["rows"]
    triton = [r for r in rows if r["arm"] == "triton"]
    assert triton[0]["default"] and all("us" in r for r in triton) and len(triton) > 1
    # every blocking computes the float32 reference's attention (bf16 rounding apart)
    assert max(r["max_diff_vs_reference"] for r in triton) < 0.05
    # cuDNN's arms need a GPU: here each is a row with the reason, not a crash
    cudnn = {r["arm"]: r for r in rows if r["arm"].startswith("cudnn")}
    assert set(cudnn) == {"cudnn", "cudnn_packed"}
    assert all("error" in r or r["max_diff_vs_reference"] < 0.05 for r in cudnn.values())


def test_budget_cuts_each_limit_and_skips_the_parts_that_do_not_fit(tmp_path, monkeypatch):
    """--parts is the order the parts run in; --budget-s cuts a part's limit to what the command
    has left, and a part that would start with under MIN_PART_S left is skipped, said in the JSON
    and the table, without failing the command (the parts that ran are what it was for)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g
    monkeypatch.setattr(g.BUDGET, "deadline", None)  # restored after the test
    ran = []

    def kernels2_uses_up_the_budget(shape, args, log, env):
        ran.append(("kernels2", g.BUDGET.clip(300)))  # its tiny limit
        g.BUDGET.deadline = time.perf_counter() + g.MIN_PART_S / 2  # as if it had run that long
        return {"rows": []}

    monkeypatch.setattr(g, "part_env", lambda *a: ran.append(("env", 0)) or {"device_kind": "cpu"})
    monkeypatch.setattr(g, "part_kernels2", kernels2_uses_up_the_budget)
    monkeypatch.setattr(g, "part_ckpt", lambda *a: pytest.fail("ckpt had no budget left"))
    assert g.main(["--shape", "tiny", "--parts", "kernels2,env,ckpt", "--budget-s", "120",
                   "--out", str(tmp_path)]) == 0
    assert [name for name, _ in ran] == ["env", "kernels2"] and 100 < ran[1][1] <= 120
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert parts["kernels2"]["ok"] and not parts["kernels2"]["skipped"]
    assert parts["ckpt"]["skipped"] and "--budget-s 120" in parts["ckpt"]["error"]
    assert ("ckpt", parts["ckpt"]["error"]) in g.summary_rows({k: g.PartResult(**v) for k, v in parts.items()})


def test_a_mosaic_kernel_that_fails_its_canary_is_left_out_of_the_later_parts(tmp_path, monkeypatch):
    """kernels2 first calls each Mosaic GPU kernel once in a process of its own: where that ran
    past its time (a kernel hung on the device) or a kernel failed, kernels2's sweeps run without
    the Mosaic kernel and the decode parts without its arms, said in their results and the table;
    where it passed, or kernels2 did not run, the arms stay."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g
    monkeypatch.setattr(g.BUDGET, "deadline", None)
    commands = []

    def run_part(name, argv, timeout_s, log, env=None, cwd=None):
        commands.append((name, argv, timeout_s))
        if "--canary" in argv:
            return None, '{"canary": true, "arm": "mosaic", "ok": true}\n'  # then it hung
        return 0, ""

    monkeypatch.setattr(g, "run_part", run_part)
    monkeypatch.setattr(g, "part_env", lambda *a: {"device_kind": "cpu"})
    assert g.main(["--shape", "tiny", "--parts", "env,kernels2,decode", "--out", str(tmp_path)]) == 0
    canary, *sweeps = [c for c in commands if c[0] == "kernels2"]
    assert canary[2] == g.MOSAIC_CANARY_S["tiny"]
    assert sweeps and all(argv[argv.index("--arms") + 1] == "packed" for _, argv, _ in sweeps)
    decodes = [argv[argv.index("--engine-arms") + 1] for name, argv, _ in commands if name.startswith("decode")]
    assert len(decodes) == 2 and not any("pallas_mgpu" in arms for arms in decodes), decodes
    assert all("pallas_gpu_packed_rope:fused" in arms for arms in decodes)
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert not parts["kernels2"]["result"]["mosaic_canary"]["ok"]
    assert "ran past its time" in parts["decode"]["result"]["left_out"]
    table = dict(g.summary_rows({k: g.PartResult(**v) for k, v in parts.items()}))
    assert table["kernel2 mosaic canary"].startswith("failed") and "decode arms" in table
    # kernels2 not run in this command: the decode part keeps the Mosaic arms
    assert g.mosaic_arms_out({}, g.DECODE_ARMS) == (g.DECODE_ARMS, "")


def _kernels2_rows(mosaic_us: float, packed_us: float, **mosaic_fields) -> list[dict]:
    """kernels2's rows at its two 16-token-page shapes (each kernel's better blocking counts),
    and at 64-token pages, where the Mosaic GPU kernel is always far ahead (not the engine's)."""
    rows = []
    for batch, context in ((256, 4096), (64, 640)):
        rows += [{"arm": "packed", "batch": batch, "context": context, "page_size": 16,
                  "us": packed_us * f, "gbps": 1.0, "max_diff_vs_reference": 0.004} for f in (1.3, 1.0)]
        rows += [{"arm": "mosaic", "batch": batch, "context": context, "page_size": 16,
                  "us": mosaic_us * f, "gbps": 1.0, "max_diff_vs_reference": 0.004, **mosaic_fields} for f in (1.0, 1.2)]
        rows.append({"arm": "mosaic", "batch": batch, "context": context, "page_size": 64, "us": 1.0, "gbps": 1.0,
                     "max_diff_vs_reference": 0.004})
    return rows


def test_the_composed_decode_arms_run_on_the_kernel_kernels2_timed_faster(tmp_path, monkeypatch):
    """The decode parts' arms that change the rope arm (our fused GEMMs, cuBLAS GEMMs) run on
    the Mosaic GPU kernel where kernels2 timed it faster than the Triton one alone at the
    engine's pages, and as listed where it was slower, gave wrong answers or was not timed; the
    two rope arms stay either way, the traced fused-GEMM arm follows, the table says which."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g

    def faster(rows):
        return g.faster_kernel({"kernels2": g.PartResult("kernels2", True, 1.0, {"rows": rows})})

    mosaic, why = faster(_kernels2_rows(mosaic_us=90.0, packed_us=100.0))
    assert mosaic and "geometric mean 0.90x" in why, why
    arms = g.on_faster_kernel(g.DECODE_ARMS, mosaic).split(",")
    assert {"pallas_mgpu_packed_layer:fused", "pallas_mgpu_packed_rope:fused:cublas"} <= set(arms)
    assert {"pallas_gpu_packed_rope:fused", "pallas_mgpu_packed_rope:fused"} <= set(arms)
    assert not {"pallas_gpu_packed_layer:fused", "pallas_gpu_packed_rope:fused:cublas"} & set(arms)
    assert len(arms) == len(g.DECODE_ARMS.split(","))
    for rows in (_kernels2_rows(mosaic_us=110.0, packed_us=100.0),  # slower
                 _kernels2_rows(mosaic_us=50.0, packed_us=100.0, max_diff_vs_reference=0.3),  # wrong
                 [r for r in _kernels2_rows(50.0, 100.0) if r["arm"] == "packed"],  # not timed
                 []):
        assert not faster(rows)[0], rows
    assert g.faster_kernel({}) == (False, "kernels2 timed no Mosaic GPU kernel beside the Triton one")
    assert g.on_faster_kernel(g.DECODE_4K_ARMS, False) == g.DECODE_4K_ARMS

    # wired into the decode parts at the GPU shape (each part's process faked)
    monkeypatch.setattr(g.BUDGET, "deadline", None)
    commands = []

    def run_part(name, argv, timeout_s, log, env=None, cwd=None):
        commands.append((name, argv))
        if "--canary" in argv:
            return 0, "".join(json.dumps({"canary": True, "arm": a, "ok": True, "max_diff_vs_reference": 0.01})
                              + "\n" for a in ("mosaic", "mosaic_rope"))
        if name == "kernels2" and "256" in argv:
            return 0, "".join(json.dumps(r) + "\n" for r in _kernels2_rows(mosaic_us=80.0, packed_us=100.0))
        return 0, ""

    monkeypatch.setattr(g, "run_part", run_part)
    monkeypatch.setattr(g, "part_env", lambda *a: {"device_kind": "cpu"})
    assert g.main(["--parts", "env,kernels2,decode", "--out", str(tmp_path)]) == 0
    decodes = {name: argv for name, argv in commands if name.startswith("decode")}
    assert set(decodes) == {"decode", "decode_4k"}
    for argv in decodes.values():
        arms = argv[argv.index("--engine-arms") + 1].split(",")
        assert "pallas_mgpu_packed_rope:fused:cublas" in arms and "pallas_gpu_packed_rope:fused" in arms
    traced = decodes["decode"][decodes["decode"].index("--trace-arms") + 1]
    assert traced == "pallas_gpu_packed_rope:fused,pallas_mgpu_packed_layer:fused"
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert parts["decode"]["result"]["composed_on"]["kernel"] == "mosaic"
    table = dict(g.summary_rows({k: g.PartResult(**v) for k, v in parts.items()}))
    assert table["decode _layer and cublas arms"].startswith("on the mosaic kernel: kernels2")


def test_the_best_decode_choice_runs_each_batch_with_its_fastest_path():
    """The decode part's rows -> a ``serving.decode_attention`` per (prompt, sampler, GEMMs): the
    fused layer wins at 32 and 64 rows, the rope arm at 256; a batch one path did not measure
    (or failed at) is left out, and a group of one path proposes nothing."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g

    def row(batch, attention, ms, sampler="fused", **kw):
        return {"batch": batch, "attention": attention, "sampler": sampler, "gemms": "xla",
                "prompt_len": 512, "step_ms": ms, **kw}

    rows = [row(256, "pallas_gpu_packed_rope", 9.0), row(256, "pallas_gpu_packed_layer", 9.5),
            row(64, "pallas_gpu_packed_rope", 4.0), row(64, "pallas_gpu_packed_layer", 3.1),
            row(32, "pallas_gpu_packed_rope", 3.5), row(32, "pallas_gpu_packed_layer", 2.9),
            row(16, "pallas_gpu_packed_layer", 1.0),  # rope not measured at 16: left out
            {"batch": 128, "attention": "pallas_gpu_packed_rope", "sampler": "fused", "prompt_len": 512,
             "error": "out of pages"},
            row(256, "pallas_gpu", 12.0, sampler="exact")]  # alone in its group
    [best] = g.best_decode_choices(rows)
    assert best["decode_attention"] == "pallas_gpu_packed_layer@64,pallas_gpu_packed_rope"
    assert best["step_ms"] == {32: 2.9, 64: 3.1, 256: 9.0}
    assert (best["sampler"], best["gemms"], best["prompt_len"]) == ("fused", "xla", 512)


def test_peaks_are_looked_up_by_the_most_specific_device_name():
    """benchmarks/hardware.py, the one table every benchmark divides by: an H100 PCIe is not
    an SXM H100, case does not matter, a CPU has no peak."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import hardware

    assert hardware.hbm_peak_gbps("NVIDIA H100 PCIe") == 2000
    assert hardware.hbm_peak_gbps("NVIDIA H100 80GB HBM3") == 3350
    assert hardware.hbm_peak_gbps("NVIDIA H200") == 4800
    assert hardware.hbm_peak_gbps("NVIDIA GH200 480GB") == 4000  # not an H200's
    assert hardware.hbm_peak_gbps("NVIDIA L40S") == 864 and hardware.hbm_peak_gbps("NVIDIA L4") == 300
    assert hardware.bf16_peak_flops("TPU v5 lite") == 197e12 and hardware.bf16_peak_flops("tpu v5p") == 459e12
    assert hardware.hbm_peak_gbps("cpu") is None and hardware.bf16_peak_flops(None) is None


def test_decode_roofline_of_a_step():
    """The rollout's decode against the HBM roofline, by hand: 100 steps reading 3.44 GB of
    weights and 2e6 KV positions of 114,688 bytes on an H200 (4.8 TB/s) need 0.1195 s."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g

    step = {"decode_steps": 100, "decode_kv_tokens": 2_000_000, "rollout_s": 0.3, "decode_s": 0.25}
    inputs = {"decode_weight_bytes": 3.44e9, "kv_bytes_per_token": 114_688}
    got = g.decode_roofline(step, inputs, "NVIDIA H200")
    need = (100 * 3.44e9 + 2e6 * 114_688) / 4.8e12
    assert got == {"decode_roofline_s": round(need, 3), "rollout_vs_roofline": round(0.3 / need, 3),
                   "decode_roofline_fraction": round(need / 0.25, 4)}
    assert g.decode_roofline(step, inputs, "cpu") == {}  # no peak known: no figure


def test_parts_are_picked_by_name_or_by_family(tmp_path, monkeypatch):
    """``--parts decode`` runs the decode family (decode, then decode_4k); ``--parts decode_4k``
    that part alone, so a later loan can run what an earlier one's budget skipped."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g
    monkeypatch.setattr(g.BUDGET, "deadline", None)
    ran = []
    monkeypatch.setattr(g, "part_env", lambda *a: {"device_kind": "cpu"})
    monkeypatch.setattr(g, "part_decode", lambda *a, name="decode", gemm_blocking="", results=None:
                        ran.append((name, gemm_blocking)) or {"rows": []})
    monkeypatch.setattr(g, "part_gemms", lambda *a: ran.append(("gemms", "")) or {
        "rows": [], "best": {"best_gemm_blocking": "64,128,128,256,64,4,4"}})
    measured = "64,128,128,256,64,4,4"
    for parts, expected in (("env,decode", [("decode", ""), ("decode_4k", "")]),
                            ("env,decode_4k", [("decode_4k", "")]),
                            # the decode parts after gemms run its best blocking; before it, their own
                            ("env,gemms,decode", [("gemms", ""), ("decode", measured), ("decode_4k", measured)]),
                            ("env,decode,gemms", [("decode", ""), ("decode_4k", ""), ("gemms", "")])):
        ran.clear()
        assert g.main(["--shape", "tiny", "--parts", parts, "--out", str(tmp_path)]) == 0
        assert ran == expected, (parts, ran)


def test_the_rl_jobs_run_unconfined_only_where_the_env_part_found_the_code_pool_so(tmp_path, monkeypatch):
    """The env part starts the code pool once (here, confined: a call runs, no gap); the RL jobs
    (main, h100, lora) get env.allow_unconfined=True only where the pool ran unconfined, so a lent
    machine whose kernel refuses the sandbox's namespaces measures the job instead of losing the
    part to the refusal; the table says which."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g

    env = g.part_env(g.SHAPES["tiny"], g.parse_args(["--shape", "tiny", "--commit", "t"]), open(os.devnull, "w"),
                     {**_env(), "PYTHONPATH": ROOT})
    pool = env["code_pool"]
    assert pool["ran"] and pool["gap"] is None, pool  # this machine confines it (tests/test_env_filesystem.py)
    confined = {"env": g.PartResult("env", True, 1.0, env)}
    assert not g.allows_unconfined(confined) and not g.allows_unconfined({})
    table = dict(g.summary_rows(confined))
    assert table["code pool"].startswith("confined: fresh_root True, own_tmp True"), table
    gap = "no fresh root (isolate=False)"
    unconfined = {"env": g.PartResult("env", True, 1.0, {**env, "code_pool": {**pool, "gap": gap}})}
    assert g.allows_unconfined(unconfined)
    assert table != dict(g.summary_rows(unconfined))
    assert "env.allow_unconfined=True" in dict(g.summary_rows(unconfined))["code pool"]
    assert not g.allows_unconfined({"env": g.PartResult("env", True, 1.0, {"code_pool": {"ran": False, "gap": gap}})})
    flag = "--config.env.allow_unconfined=True"
    shape = g.SHAPES["tiny"]
    assert flag in g.main_job_argv(shape, "hf", "d", "w", True) and flag not in g.main_job_argv(shape, "hf", "d", "w")
    plan = {"device_reported": True}
    agent, lora = g.AGENT_SHAPES["tiny"], g.LORA_SHAPES["tiny"]
    assert flag in g.agent_rl_argv(agent, plan, "hf", "d", "i", "w", True)
    assert flag not in g.agent_rl_argv(agent, plan, "hf", "d", "i", "w")
    assert flag in g.lora_rl_argv(lora, plan, "d", "w", True) and flag not in g.lora_rl_argv(lora, plan, "d", "w")
    # wired: the main job of a command whose env part found the pool unconfined (processes faked)
    monkeypatch.setattr(g.BUDGET, "deadline", None)
    monkeypatch.setattr(g, "part_env", lambda *a: unconfined["env"].result)
    jobs = []
    monkeypatch.setattr(g, "run_part", lambda name, argv, *a, **k: jobs.append((name, argv)) or (0, ""))
    g.main(["--shape", "tiny", "--parts", "env,main", "--out", str(tmp_path)])
    assert [flag in argv for name, argv in jobs if name == "main"] == [True], jobs


def test_the_h100_part_alone_is_held_to_an_h100s_memory(tmp_path, monkeypatch):
    """--h100-mem-fraction: the h100 part's processes get that XLA_PYTHON_CLIENT_MEM_FRACTION (an
    H200 held to 80 GB), the command's other parts keep the whole card."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g
    monkeypatch.setattr(g.BUDGET, "deadline", None)
    fractions = {}

    def run_part(name, argv, timeout_s, log, env=None, cwd=g.ROOT):
        fractions[name] = env["XLA_PYTHON_CLIENT_MEM_FRACTION"]
        return 1, ""  # every part fails at once: only the environments are looked at

    monkeypatch.setattr(g, "run_part", run_part)
    monkeypatch.setattr(g, "part_env", lambda *a: {"device_kind": "cpu"})
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    g.main(["--shape", "tiny", "--parts", "env,h100,ckpt", "--h100-mem-fraction", "0.54", "--out", str(tmp_path)])
    assert fractions == {"h100/inputs": "0.54", "ckpt": "0.95"}


def test_traces_are_packed_in_volumes_under_the_return_limit(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from gpu_check import pack_traces
    for name, size in (("a.json.gz", 600), ("b/c.xplane.pb", 600), ("d.json.gz", 300), ("e.txt", 5000)):
        path = tmp_path / "traces" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
    names = pack_traces(str(tmp_path / "traces"), str(tmp_path / "traces.tar"), limit=1000)
    assert names == ["a.json.gz", "b/c.xplane.pb", "d.json.gz"]
    volumes = [tarfile.open(tmp_path / v).getnames() for v in ("traces.tar", "traces_2.tar")]
    assert volumes == [["a.json.gz"], ["b/c.xplane.pb", "d.json.gz"]]
    assert not (tmp_path / "traces_3.tar").exists()


@pytest.mark.slow  # the Pallas interpreter, and two engine decode programs: ~3 min
def test_decode_kernel_parts_run_at_the_tiny_shape(tmp_path):
    """Issue 46's parts: our kernels alone beside jax's (each against the float32 reference), and
    the engine's decode with our kernel (writing the step's K/V, norming and rotating q/k) and
    the fused sampler beside the portable path, its one call traced with its HLO (what the next
    fusion is read from)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"),
                           "--shape", "tiny", "--parts", "env,kernels2,gemms,decode", "--out", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]
    rows = parts["kernels2"]["result"]["rows"]
    # first each Mosaic GPU kernel once, in a process of its own: both ran and matched
    canary = parts["kernels2"]["result"]["mosaic_canary"]
    assert canary["ok"] and [r["arm"] for r in canary["rows"]] == ["mosaic", "mosaic_rope"], canary
    assert "kernel2 mosaic canary" in proc.stdout
    # jax's kernel first; then our Triton kernel's blockings and our Mosaic GPU kernel's, in turn
    assert [r["arm"] for r in rows] == ["triton", "packed", "mosaic", "packed"], rows
    assert all("us" in r and r["max_diff_vs_reference"] < 0.05 for r in rows), rows
    gemms = parts["gemms"]["result"]
    assert {(r["kind"], r["arm"]) for r in gemms["rows"]} == {
        (k, a) for k in ("layer", "qkv", "o", "gate_up", "down") for a in ("xla", "xla:cublas", "ours")}
    assert all(r["us_per_layer"] > 0 and r.get("max_diff_vs_xla", 0) < 0.1 for r in gemms["rows"]), gemms
    assert all(r["compiled_ahead_s"] > 0 for r in gemms["rows"]), gemms  # each arm compiled ahead
    decode = {(r["attention"], r["sampler"]): r for r in parts["decode"]["result"]["rows"]}
    layer = decode.pop(("pallas_gpu_packed_layer", "fused"))
    # the decode part's fused-GEMM arm runs the blocking the gemms part measured best
    assert layer["gemm_blocking"] == gemms["best"]["best_gemm_blocking"], (layer, gemms["best"])
    assert set(decode) == {("pallas_gpu_packed_rope", "fused"), ("ragged", "exact")}
    assert decode[("ragged", "exact")]["gemms"] == "cublas"  # an arm's XLA options of its own
    assert all(r["calls"] == 2 and r["decode_tok_s"] > 0 for r in decode.values())
    # the arms' programs compiled ahead in threads (their first calls then only run them)
    assert all(r["compile_threads"] == 2 and r["compiled_ahead_s"] > 0 for r in (*decode.values(), layer))
    traced = decode[("pallas_gpu_packed_rope", "fused")]
    assert traced.get("trace_bytes", 0) > 0 and "trace" not in decode[("ragged", "exact")], traced
    names = json.loads((out / "gpu_check.json").read_text())["traces"]
    assert "decode/decode_b4_pallas_gpu_packed_rope_fused.json.gz" in names, names
    assert "decode/decode_b4_pallas_gpu_packed_layer_fused.json.gz" in names, names  # ours traced too
    long = {(r["attention"], r["sampler"]): r for r in parts["decode_4k"]["result"]["rows"]}
    assert set(long) == set(decode) and all(r["prompt_len"] == 160 for r in long.values()), long
    assert all(r["context"] > max(d["context"] for d in decode.values()) for r in long.values())
    assert "kernel2 b4 ctx40 packed" in proc.stdout
    assert "decode b4 ctx24 pallas_gpu_packed_rope fused" in proc.stdout
    assert "gemms b32 layer ours" in proc.stdout and "gemms best blocking" in proc.stdout
    assert "decode b4 ctx160 ragged exact cublas" in proc.stdout
    # rope and layer (fused, XLA's GEMMs) were both measured: the per-batch choice is printed
    assert "decode best per batch ctx24 fused xla" in proc.stdout


@pytest.mark.slow  # a tiny LoRA stage 1 of 2 steps: ~80 s on a 2-core CPU
def test_the_lora_part_runs_stage_1_with_adapters_at_the_tiny_shape(tmp_path):
    """``lora`` (issue 45 item 5): configs/stage1.py on the preset's random weights with LoRA,
    the memory plan's choice given to the job; its steps and checkpoint come back, and the table
    has a row a step beside the plan's."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--shape", "tiny",
                           "--out", str(out), "--commit", "test", "--parts", "env,lora"],
                          capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lora = json.loads((out / "gpu_check.json").read_text())["parts"]["lora"]
    assert lora["ok"], lora["error"]
    r = lora["result"]
    assert r["lora_rank"] == 4 and (2 * 2) % r["plan"]["micro_batch"] == 0  # 2 prompts x G=2 trained rows
    assert len(r["steps"]) == 2 and r["checkpoints"] == ["2"]
    for s in r["steps"]:
        assert s["decode_s"] > 0 and s["update_s"] > 0 and 0 < s["trained_tokens"] <= 2 * 2 * 32, s
        assert "update_mfu" not in s  # full fine-tuning's FLOPs would overstate a LoRA update
    log = (out / "gpu_check.log").read_text()
    assert "--config.model.lora_rank=4" in log and "--config.model.random_init=True" in log
    assert re.search(r"rl stage fresh at step 0 from tiny with random weights", log)
    assert "lora step 2" in proc.stdout and "lora plan (tiny, rank 4)" in proc.stdout


def test_the_agent_model_flag_changes_the_random_models_fields(tmp_path):
    """--agent-model KEY=VALUE,...: ModelConfig fields of the h100 part's random model (the
    1.7B's depth and initialisation scale on the tiny shape, docs/launch.md), typed, checked by
    name; the inputs script builds the model with them (its JSON line reports layers and hidden)."""
    import argparse

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g

    args = argparse.Namespace(agent_model="num_hidden_layers=3,hidden_size=96,head_dim=24,initializer_range=0.05")
    overrides = g.agent_model_overrides(args)
    assert overrides == {"num_hidden_layers": 3, "hidden_size": 96, "head_dim": 24, "initializer_range": 0.05}
    with pytest.raises(SystemExit, match="hidden_sise"):
        g.agent_model_overrides(argparse.Namespace(agent_model="hidden_sise=96"))
    # --h100-rl-flags: settings on top of the stage-1 run's (a smaller pool after a start-check refusal)
    flags = g.rl_flag_overrides(g.parse_args(["--h100-rl-flags", "serving.kv_memory_fraction=0.15"]))
    argv = g.agent_rl_argv(g.AGENT_SHAPES["tiny"], {"device_reported": True}, "hf", "d", "i", "w", extra=flags)
    assert "--config.serving.kv_memory_fraction=0.15" in argv
    with pytest.raises(SystemExit, match="SECTION.KEY=VALUE"):
        g.rl_flag_overrides(argparse.Namespace(h100_rl_flags="kv_memory_fraction=0.15"))
    a = g.AGENT_SHAPES["tiny"]
    spec = dict(model=a.model, regular=a.tokenizer_regular_tokens, rows=4, rollouts=8, seq_len=1184,
                plan_device_gb=80.0, problems=4, traces=4, model_overrides=overrides,
                hf=str(tmp_path / "hf"), data=str(tmp_path / "p.jsonl"), sft=str(tmp_path / "s.jsonl"))
    out = subprocess.run([sys.executable, "-c", g.MAKE_AGENT_INPUTS, json.dumps(spec)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    made = json.loads(out.stdout.strip().splitlines()[-1])
    assert (made["layers"], made["hidden"]) == (3, 96)
    saved = json.load(open(tmp_path / "hf" / "config.json"))
    assert saved["initializer_range"] == 0.05 and saved["head_dim"] == 24


# ---- a lent device: no rstarjax installed, budgets that run out, flags that do not fit -----------------
HIDE_EDITABLE = ("import sys\n"  # the editable install's finder gone: rstarjax only where sys.path has it
                 "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)\n"
                 "                    and 'editable' not in type(f).__module__]\n")


def test_the_command_runs_where_rstarjax_is_importable_only_from_the_repository(tmp_path):
    """As on a lent device (its wheels in /tmp/site, rstarjax installed nowhere): run from another
    folder, PYTHONPATH without the repository, the editable install hidden. The script puts the
    repository root on its own path, so the parent's rstarjax imports (the --agent-model check, the
    table's decode choice) work, the table is printed whole and the scratch folder is removed."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_EDITABLE)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**_env(), "PYTHONPATH": str(site), "TMPDIR": str(scratch)}
    hidden = subprocess.run([sys.executable, "-c", "import rstarjax"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert hidden.returncode != 0 and "No module named 'rstarjax'" in hidden.stderr  # the device's case
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--shape", "tiny",
                           "--parts", "env", "--agent-model", "num_hidden_layers=2", "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("-" * 100):]
    assert re.search(r"device +cpu driver", table) and "not made" not in table, table
    assert table.rstrip().endswith("-" * 100)
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text())["parts"]["env"]["ok"]
    assert not list(scratch.iterdir())  # the scratch folder went


def _fake_env_part(g, monkeypatch, tmp_path):
    monkeypatch.setattr(g.BUDGET, "deadline", None)
    monkeypatch.setattr(g, "part_env", lambda *a: {"device_kind": "cpu"})
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    monkeypatch.setattr(g.tempfile, "tempdir", str(scratch))
    return scratch


def test_a_table_section_that_fails_is_a_row_and_the_scratch_goes_whatever_fails(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g
    scratch = _fake_env_part(g, monkeypatch, tmp_path)

    def broken(results):
        raise ModuleNotFoundError("No module named 'rstarjax'")

    monkeypatch.setattr(g, "decode_rows", broken)
    rows = dict(g.summary_rows({"env": g.PartResult("env", True, 1.0, {"device_kind": "cpu", "jax": "x"})}))
    assert rows["device"].startswith("cpu") and "No module named" in rows["table (broken)"], rows
    assert g.main(["--shape", "tiny", "--parts", "env", "--out", str(tmp_path / "out")]) == 0
    assert not list(scratch.iterdir())

    def crash(*a, **k):
        raise RuntimeError("the disk is full")

    monkeypatch.setattr(g, "pack_traces", lambda *a: crash())
    monkeypatch.setattr(g, "print_table", crash)
    with pytest.raises(RuntimeError, match="disk is full"):
        g.main(["--shape", "tiny", "--parts", "env", "--out", str(tmp_path / "out")])
    assert not list(scratch.iterdir())  # removed all the same (finally)


def test_a_killed_ckpt_part_keeps_the_setup_and_the_arms_it_printed(tmp_path, monkeypatch):
    """The device's kill (its limit, or what --budget-s left it) mid-arm: the part fails, saying it
    ran out of its time, with the setup's figures (printed first) and the arms that ended."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g
    _fake_env_part(g, monkeypatch, tmp_path)
    setup = {"setup": True, "state_gb": 20.6, "arrays": 930, "device_get_s": 5.1, "device_get_gbps": 4.0,
             "work_alone_s": 10.2}
    arm = {"arm": "background_pinned", "wait_s": 0.02, "work_s": 10.5, "update_wait_s": 1.2, "step_increase_s": 1.5,
           "copy_s": 11.0, "write_s": 20.1, "arm_s": 33.0, "predicted_s": 35.6}
    printed = json.dumps(setup) + "\n" + json.dumps(arm) + '\n{"arm": "pinned", "wait'  # cut by the kill
    monkeypatch.setattr(g, "run_part", lambda name, argv, timeout_s, *a, **k: (None, printed))
    assert g.main(["--shape", "tiny", "--parts", "env,ckpt", "--out", str(tmp_path)]) == 1
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["ckpt"]
    assert not part["ok"] and "ran out of its 200 s time limit" in part["error"], part["error"]
    assert part["result"]["state_gb"] == 20.6 and part["result"]["runs"] == [arm]
    table = dict(g.summary_rows({"ckpt": g.PartResult(**part)}))
    assert table["ckpt"].startswith("20.6 GB in 930 arrays") and table["ckpt background_pinned"].startswith("step +1.5 s")


def test_a_ckpt_arm_runs_only_where_its_predicted_seconds_fit_the_part(tmp_path, monkeypatch):
    """The checkpoint A/B itself (tiny state): the setup line comes first; an arm whose predicted
    seconds do not fit what the part's limit leaves is not started, the first arm included (its
    prediction from the plain copy and CKPT_WRITE_GBPS), the later ones from the arms measured
    (here a slow write, 3 s, as 20.6 GB to a lent machine's disk)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g
    monkeypatch.setattr(g.BUDGET, "deadline", None)
    shape, env = g.SHAPES["tiny"], {**_env(), "PYTHONPATH": ROOT}
    with open(tmp_path / "log", "w") as log:
        monkeypatch.setattr(g, "CKPT_WRITE_GBPS", 1e-9)  # the first arm's write predicted to take ages
        none = g.part_ckpt(shape, None, log, env, str(tmp_path))
        assert none["runs"] == [] and none["arms_not_run"] == list(g.CKPT_ARMS), none
        assert none["state_gb"] == 0.0 and "background_pinned predicted" in none["arms_not_run_why"]
        monkeypatch.setattr(g, "CKPT_WRITE_GBPS", 1.0)
        # a 3 s write in every arm, and 4.5 s left once the setup is done: the first arm runs, the
        # second (predicted from it) does not
        slow = g.CKPT_AB.replace("    ck.wait()\n", "    ck.wait()\n    time.sleep(3)\n")
        slow = slow.replace('out = {**setup, "runs": []}\n', 'out = {**setup, "runs": []}\na["deadline"] = time.time() + 4.5\n')
        assert slow.count("time.sleep(3)") == 1 and slow.count("+ 4.5") == 1
        monkeypatch.setattr(g, "CKPT_AB", slow)
        one = g.part_ckpt(shape, None, log, env, str(tmp_path))
    assert [r["arm"] for r in one["runs"]] == ["background_pinned"] and one["runs"][0]["arm_s"] >= 3, one
    assert one["arms_not_run"] == list(g.CKPT_ARMS[1:]) and "pinned predicted" in one["arms_not_run_why"]
    lines = [json.loads(x) for x in (tmp_path / "log").read_text().splitlines() if x.startswith("{")]
    assert lines[0].get("setup") and "runs" not in lines[0]  # the setup's figures first
    rows = dict(g.summary_rows({"ckpt": g.PartResult("ckpt", True, 1.0, one)}))
    assert rows["ckpt arms not run"].startswith("pinned, background_pageable, pageable: pinned predicted")


def _plan_line(given: dict, device_gb: float = 81.25):
    """The h100 part's plan step (PRINT_PLAN) for its GPU shape on a device reporting
    ``device_gb``, the sizes ``given``: (exit status, its JSON line)."""
    import contextlib
    import io
    import types

    import jax.numpy as jnp

    import gpu_check as g
    from rstarjax.models import ModelConfig
    from rstarjax.recipes.config import as_flags
    from rstarjax.serving.sizing import REMAT_BY_SPEED, size_colocated

    s = g.AGENT_SHAPES["gpu"]
    device = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": int(device_gb * 1e9)})
    a = dict(rows=s.prompts * s.group, rollouts=s.prompts * s.samples, seq_len=s.prompt_len + s.response_len,
             plan_device_gb=s.plan_device_gb, given=given)
    names = dict(a=a, cfg=ModelConfig.preset(s.model, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16),
                 jax=types.SimpleNamespace(devices=lambda: [device]), json=json, sys=sys,
                 size_colocated=size_colocated, REMAT_BY_SPEED=REMAT_BY_SPEED, as_flags=as_flags)
    out, code = io.StringIO(), 0
    with contextlib.redirect_stdout(out):
        try:
            exec(g.PRINT_PLAN, names)
        except SystemExit as e:
            code = e.code
    return code, json.loads(out.getvalue())


def test_h100_rl_flags_sizes_are_planned_before_the_inputs_and_sft(tmp_path, monkeypatch):
    """--h100-rl-flags serving.kv_memory_fraction=0.5 on an H100 (81.25 GB): the stage-1 job's plan
    refuses it (a 28.6 GB pool), so the part's own plan step does, before the model is written and
    the SFT runs, naming the flag, the largest value that fits and the plan's own; a value that
    fits is planned with, and the table's plan row says it was given."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g
    from rstarjax.serving.sizing import size_colocated

    code, line = _plan_line({"serving.kv_memory_fraction": 0.5})
    assert code == 3 and len(line["problems"]) == 1, line
    problem = line["problems"][0]
    assert problem.startswith("--h100-rl-flags serving.kv_memory_fraction=0.5: ") and "28.6 GB KV pool" in problem
    largest = float(re.search(r"the largest serving.kv_memory_fraction that fits is ([0-9.]+)", problem).group(1))
    assert "the plan's own, left open: serving.kv_memory_fraction=0.2813" in problem, problem
    assert 0.2813 < largest < 0.5  # past the plan's own it trades the remat policy for the pool
    code, fits = _plan_line({"serving.kv_memory_fraction": largest})
    assert code == 0 and fits["plan"]["kv_memory_fraction"] == largest
    assert _plan_line({"serving.kv_memory_fraction": round(largest + 0.002, 3)})[0] == 3  # the largest, to 0.001
    code, given = _plan_line({"serving.kv_memory_fraction": 0.2})
    assert code == 0 and given["plan"]["kv_memory_fraction"] == 0.2 and given["plan"]["given"]
    assert size_colocated  # the plan function the job's own plan calls (recipes/build.py)
    rows = dict(g.agent_rows(g.PartResult("h100", True, 1.0, {"plan": given["plan"]})))
    assert "(kv_memory_fraction 0.200, given)" in rows["h100 plan"], rows
    code, open_plan = _plan_line({})
    assert code == 0 and "(kv_memory_fraction 0.281, the plan's)" in dict(
        g.agent_rows(g.PartResult("h100", True, 1.0, {"plan": open_plan["plan"]})))["h100 plan"]

    # wired: the inputs step gets the flag's sizes; its refusal ends the part before the SFT
    _fake_env_part(g, monkeypatch, tmp_path)
    ran = []

    def run_part(name, argv, timeout_s, log, env=None, cwd=None):
        ran.append(name)
        spec = json.loads(argv[-1])
        assert spec["given"] == {"serving.kv_memory_fraction": 0.5}
        return 3, json.dumps({**line, "plan": {**line["plan"], "given": spec["given"]}}) + "\n"

    monkeypatch.setattr(g, "run_part", run_part)
    assert g.main(["--shape", "tiny", "--parts", "env,h100", "--out", str(tmp_path),
                   "--h100-rl-flags", "serving.kv_memory_fraction=0.5"]) == 1
    assert ran == ["h100/inputs"]
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["h100"]
    assert "--h100-rl-flags serving.kv_memory_fraction=0.5" in part["error"] and part["result"]["plan"]
    assert json.loads((tmp_path / "h100_result.json").read_text())["plan"]["given"]
    # a value that does not parse is refused before anything runs
    ran.clear()
    with pytest.raises(SystemExit, match="serving.kv_memory_fraction=half"):
        g.main(["--shape", "tiny", "--parts", "env,h100", "--h100-rl-flags", "serving.kv_memory_fraction=half"])
    assert ran == []


def _fake_h100(g, monkeypatch, sft_code, rl_code, rl_steps):
    """run_part for the h100 part's three processes: the inputs as the tiny shape prints them, the
    SFT and the stage-1 job ending with the given status and metrics."""
    plan = {"plan": {"remat_policy": "none", "micro_batch": 4, "kv_pages": 99, "kv_memory_fraction": 0.9,
                     "device_gb": 80.0, "device_reported": False, "peak_gb": 1.0, "kv_pool_gb": 1.0, "given": {}},
            "problems": []}
    ran = []

    def run_part(name, argv, timeout_s, log, env=None, cwd=None):
        ran.append((name, timeout_s))
        if name == "h100/inputs":
            return 0, json.dumps(plan) + "\n" + json.dumps({"params_b": 0.1, "prompt_tokens": 30}) + "\n"
        workdir = next(x.split("=", 1)[1] for x in argv if x.startswith("--workdir="))
        os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
        steps = 2 if name == "h100/sft" else rl_steps
        with open(os.path.join(workdir, "logs", "metrics.jsonl"), "w") as f:
            for i in range(steps):
                f.write(json.dumps({"step": i + 1, "sft/loss": 3.0 - i, "wall_time": time.time(),
                                    "time/rollout": 2.0, "timing/rollout_decode_s": 1.5}) + "\n")
        return (sft_code if name == "h100/sft" else rl_code), ""

    monkeypatch.setattr(g, "run_part", run_part)
    return ran


def test_an_sft_that_runs_out_of_time_keeps_the_plan_and_its_figures(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g
    _fake_env_part(g, monkeypatch, tmp_path)
    ran = _fake_h100(g, monkeypatch, sft_code=None, rl_code=0, rl_steps=0)
    assert g.main(["--shape", "tiny", "--parts", "env,h100", "--out", str(tmp_path)]) == 1
    assert [n for n, _ in ran] == ["h100/inputs", "h100/sft"]
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["h100"]
    assert "the SFT ran out of its 1500 s time limit" in part["error"] and "None" not in part["error"], part["error"]
    for result in (part["result"], json.loads((tmp_path / "h100_result.json").read_text())):
        assert result["plan"]["micro_batch"] == 4 and result["sft"]["steps"] == 2 and "sft_s" in result
        assert result["params_b"] == 0.1
    rows = dict(g.agent_rows(g.PartResult(**part)))
    assert "h100 plan" in rows and rows["h100 SFT"].startswith("2 steps")


def test_a_stage1_job_stopped_before_step_2_says_so(tmp_path, monkeypatch):
    """The step-2 rows say nothing was compiled on step 2 only where step 2 ran: a job that ran out
    of time after step 1 (e.g. --budget-s 60) says "step 2 not reached", and its time limit."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g
    _fake_env_part(g, monkeypatch, tmp_path)
    _fake_h100(g, monkeypatch, sft_code=0, rl_code=None, rl_steps=1)
    assert g.main(["--shape", "tiny", "--parts", "env,h100", "--out", str(tmp_path)]) == 1
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["h100"]
    assert "the stage-1 job ran out of its 600 s time limit (killed)" in part["error"], part["error"]
    assert part["result"]["step2_prefill_recompiles"] is None and len(part["result"]["steps"]) == 1
    rows = dict(g.summary_rows({"h100": g.PartResult(**part)}))
    assert rows["h100 step-2 prefill recompiles"] == "step 2 not reached (1 step(s) finished)", rows
    assert "exited None" not in rows["h100"]
    # where step 2 ran and compiled nothing at step 1's shapes: "none"
    _fake_h100(g, monkeypatch, sft_code=0, rl_code=0, rl_steps=2)
    assert g.main(["--shape", "tiny", "--parts", "env,h100", "--out", str(tmp_path)]) == 0
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["h100"]
    assert dict(g.agent_rows(g.PartResult(**part)))["h100 step-2 prefill recompiles"] == "none"


def test_the_documented_first_loan_command_parses_and_imports_from_the_repository():
    """docs/launch.md "What the next lent GPU runs": the first loan's one command runs both issues'
    parts, issue 46's kernels alone right after the h100 part, with the repository on PYTHONPATH."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check as g
    doc = open(os.path.join(ROOT, "docs", "launch.md")).read()
    section = doc[doc.index("### What the next lent GPU runs"):doc.index("## One host with several GPUs")]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    assert "export PYTHONPATH=/tmp/site:$PWD" in section
    argv = command.split("gpu_check.py", 1)[1].replace("<the commit, literally>", "abc").split()
    args = g.parse_args(argv)
    assert args.parts == "env,h100,kernels2,ckpt,gemms,decode" and 0 < args.budget_s <= 600 - 30
    assert "kv_memory_fraction=0.5" not in section

"""benchmarks/profile_summary.py against what is known without it: a hand-written Chrome trace
whose groups, times and gaps are worked out here by hand, and a real XLA:CPU trace of a jitted
matmul + elementwise function whose dot count and FLOPs follow from the calls issued."""
import gzip
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import profile_summary as ps  # noqa: E402


def _meta(pid, name, tid=None):
    e = {"ph": "M", "pid": pid, "name": "thread_name" if tid is not None else "process_name",
         "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


def _kernel(name, ts, dur, tid=14, module="jit_step", **args):
    a = {"hlo_module": module, "hlo_op": "command_buffer_1", **args} if module else dict(args)
    return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": a}


# A GPU trace laid out by hand: times in us. Compute stream 14, H2D stream 15.
GPU_EVENTS = [
    _meta(1, "/device:GPU:0"), _meta(1, "Stream #14(Compute,Memset)", 14),
    _meta(1, "Stream #15(MemcpyH2D)", 15), _meta(701, "/host:CPU"), _meta(701, "python3", 7),
    # host-side events, one even with XLA args: never device time on a GPU trace
    {"ph": "X", "pid": 701, "tid": 7, "ts": 0.0, "dur": 500.0, "name": "PjitFunction(step)"},
    {"ph": "X", "pid": 701, "tid": 7, "ts": 5.0, "dur": 1.0, "name": "thunk",
     "args": {"hlo_op": "fusion.1", "hlo_module": "jit_step"}},
    _kernel("MemcpyH2D", 90.0, 5.0, tid=15, module=None,
            memcpy_details="kind_src:pinned kind_dst:device size:4096 dest:0 async:1"),
    _kernel("gemm_fusion_dot_1", 100.0, 10.0, flops="2000000"),            # matmul
    _kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128", 112.0, 8.0),  # matmul
    _kernel("paged_attention_block_h_16_pages_per_compute_block_8", 120.0, 5.0),  # attention
    _kernel("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)",
            125.0, 2.0),                                                    # attention
    _kernel("loop_multiply_fusion", 132.0, 2.0),                           # elementwise/norm
    _kernel("input_reduce_fusion_3", 134.0, 3.0),                          # elementwise/norm
    _kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 140.0, 4.0),      # collectives
    _kernel("loop_dynamic_update_slice_fusion_2", 150.0, 1.0),            # copies
    _kernel("Memset 0", 151.0, 1.0, Memset_details="kind:unknown num_bytes:64 async:0"),  # copies
    _kernel("nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_TNT", 160.0, 6.0),  # matmul
    _kernel("mystery_kernel", 166.0, 4.0),                                 # other
    _kernel("loop_add_fusion", 400.0, 10.0, module="jit__other_program"),  # another program
]


def _write(tmp_path, events, name="perfetto_trace.json.gz"):
    run = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    run.mkdir(parents=True, exist_ok=True)
    with gzip.open(run / name, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)
    return run / name


def test_hand_written_gpu_trace_gives_exactly_the_known_groups_times_and_gaps(tmp_path):
    _write(tmp_path, GPU_EVENTS)
    s = ps.build_summary(str(tmp_path), module="jit_step")  # a folder: the trace is found
    assert s["device"] == "gpu" and s["modules"] == {"jit_step": {"time_us": 46.0, "count": 11}}
    g = s["groups"]
    want = {"matmul": (24.0, 3), "attention": (7.0, 2), "elementwise/norm": (5.0, 2),
            "collectives": (4.0, 1), "copies": (2.0, 2), "other": (4.0, 1)}
    assert {k: (v["time_us"], v["count"]) for k, v in g.items()} == want
    # kernels from 100 to 170, none overlapping: busy is their sum, 10+8+5+2+2+3+4+1+1+6+4
    assert s["span_us"] == 70.0 and s["busy_us"] == 46.0
    # idle: 110-112, 127-132, 137-140, 144-150, 152-160
    assert s["gaps"]["count"] == 5 and s["gaps"]["total_us"] == 2 + 5 + 3 + 6 + 8
    assert s["gaps"]["largest_us"] == 8.0
    assert s["gaps"]["largest"][0]["after"] == "Memset 0"
    assert s["gaps"]["largest"][0]["before"].startswith("nvjet_sm90")
    assert g["matmul"]["flops"] == 2e6 and g["copies"]["bytes"] == 64.0
    assert g["matmul"]["share"] == pytest.approx(24 / 46) and g["matmul"]["of_span"] == \
        pytest.approx(24 / 70)
    assert s["top_ops"][0]["op"] == "gemm_fusion_dot_1"
    assert s["top_ops"][0]["tflop_per_s"] == pytest.approx(2e6 / 10e-6 / 1e12)
    names = {o["op"] for o in s["top_ops"]}
    assert "cudnn::fusion::compute_dot_do_o_specialized<true, 64>" in names  # C++ name trimmed

    other = ps.build_summary(str(tmp_path), module="jit_other")  # runs of _ read as one
    assert other["modules"] == {"jit__other_program": {"time_us": 10.0, "count": 1}}

    everything = ps.build_summary(str(tmp_path))  # no module filter: the H2D copy, jit_other
    assert everything["span_us"] == 320.0 and everything["busy_us"] == 46 + 5 + 10
    assert everything["groups"]["copies"]["bytes"] == 4096 + 64
    # a window in ms from the trace's first event (ts 0): keeps events starting in [0.13, 0.16)
    window = ps.build_summary(str(tmp_path), start_ms=0.13, end_ms=0.16)
    assert window["events"] == 5 and window["span_us"] == 152 - 132


def test_cpu_ops_nest_and_are_charged_their_self_time(tmp_path):
    """XLA:CPU: ops are host-thread events with hlo_op/hlo_module args; a while holds its body."""
    op = lambda name, ts, dur, ordinal="0": {  # noqa: E731
        "ph": "X", "pid": 701, "tid": 3, "ts": ts, "dur": dur, "name": name,
        "args": {"hlo_op": name, "hlo_module": "jit_f", "device_ordinal": ordinal}}
    events = [_meta(701, "/host:CPU"), _meta(701, "tf_XLAPjRtCpuClient/1", 3),
              op("while.1", 0.0, 10.0), op("dot.2", 1.0, 4.0), op("add.3", 6.0, 2.0),
              op("transpose.4", 12.0, 3.0), op("dot.9", 20.0, 1.0, ordinal="1"),
              {"ph": "X", "pid": 701, "tid": 3, "ts": 2.0, "dur": 1.0, "name": "Await"}]
    _write(tmp_path, events)
    s = ps.build_summary(str(tmp_path), device_id=0)
    assert s["device"] == "cpu"
    times = {o["op"]: o["time_us"] for o in s["top_ops"]}
    assert times == {"while.1": 4.0, "dot.2": 4.0, "add.3": 2.0, "transpose.4": 3.0}
    assert {k: v["time_us"] for k, v in s["groups"].items() if v["count"]} == \
        {"other": 4.0, "matmul": 4.0, "elementwise/norm": 2.0, "copies": 3.0}
    assert s["busy_us"] == 13.0 and s["span_us"] == 15.0 and s["gaps"]["total_us"] == 2.0


@pytest.mark.parametrize("name, group", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopB_TNN", "matmul"),
    ("cutlass3x_sm90_tensorop_gemm_bf16", "matmul"),
    ("gemm_fusion_dot_12", "matmul"), ("dot.3", "matmul"),
    ("triton_softmax_fusion_2", "elementwise/norm"), ("loop_fusion", "elementwise/norm"),
    ("input_reduce_fusion_4", "elementwise/norm"), ("loop_rsqrt_fusion", "elementwise/norm"),
    ("ragged_decode_attention", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
    ("all-reduce-start.1", "collectives"), ("ncclDevKernel_ReduceScatter_Sum_f32", "collectives"),
    ("MemcpyD2H", "copies"), ("copy.4", "copies"), ("loop_transpose_fusion", "copies"),
    ("loop_dynamic_update_slice_fusion_3", "copies"), ("while.2", "other"),
])
def test_kernel_names_fall_in_their_groups(name, group):
    assert ps.group_by_name(name) == group


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    """A real jax.profiler trace: f (one dot, then tanh*2+1) called 3 times, g (a reduction)
    once, after a warm-up outside the trace."""
    out = tmp_path_factory.mktemp("trace")
    n = 192

    @jax.jit
    def f(a, b):
        return jnp.tanh(a @ b) * 2 + 1

    @jax.jit
    def g(x):
        return jnp.sum(x * x, axis=-1)

    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    jax.block_until_ready((f(a, a), g(a)))
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        for _ in range(3):
            r = f(a, a)
        jax.block_until_ready(g(r))
    return out, n, 3


def test_real_cpu_trace_counts_the_dots_issued_and_their_flops(cpu_trace):
    out, n, calls = cpu_trace
    s = ps.build_summary(str(out))
    assert s["device"] == "cpu" and s["hlo_source"]  # the xplane.pb beside it was read
    matmul = s["groups"]["matmul"]
    assert matmul["count"] == calls
    assert matmul["flops"] == calls * 2 * n ** 3
    # the dot op reads a and b and writes its n x n float32 result, whatever it is fused with
    assert matmul["bytes"] == calls * 3 * 4 * n * n
    assert s["groups"]["elementwise/norm"]["count"] >= 1  # g's reduction at least
    assert sum(v["share"] for v in s["groups"].values()) == pytest.approx(1.0, abs=1e-4)
    assert all(gap["gap_us"] >= 0 for gap in s["gaps"]["largest"]) and s["gaps"]["total_us"] >= 0
    assert s["busy_us"] + s["gaps"]["total_us"] == pytest.approx(s["span_us"], abs=1e-2)
    assert s["busy_us"] <= s["span_us"] and set(s["modules"]) == {"jit_f", "jit_g"}

    only_g = ps.build_summary(str(out), module="jit_g")
    assert set(only_g["modules"]) == {"jit_g"} and only_g["groups"]["matmul"]["count"] == 0
    assert only_g["events"] >= 1 and only_g["span_us"] < s["span_us"]


def test_cli_prints_a_table_then_one_json_line(cpu_trace, capsys):
    out, _, calls = cpu_trace
    ps.main([str(out), "--top", "3"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("trace: ") and any(line.startswith("matmul") for line in lines)
    result = json.loads(lines[-1])
    assert result["benchmark"] == "profile_summary" and len(result["top_ops"]) <= 3
    ps.main([str(out), "--json-only", "--no-hlo"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["hlo_source"] is None

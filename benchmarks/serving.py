"""Serving benchmark: prints ONE JSON line of figures, each next to its baseline from this run.

The baseline engine is the dense-cache engine this project shipped before the paged one,
vendored verbatim in ``benchmarks/baseline_dense_engine.py`` (from commit 01727d7), run in the
same process on the same weights and workloads.

CPU (``--device cpu``):
(1) decode tokens/s: ``generate`` on the paged engine vs HF transformers ``generate`` and vs
    the dense engine; same config, same weights (greedy tokens checked identical), same batch;
    compiles excluded (a warm-up call first). HF runs in every arm of ``--hf-arms``: its default
    dynamic KV cache (``dynamic``), a static cache (``static``), and a static cache with the
    forward under ``torch.compile`` (``compiled``; transformers skips its own auto-compile on
    CPU); ``decode_speedup_vs_hf`` is against the fastest arm of each run, named in
    ``decode_hf_fastest_arm``, each arm's tokens/s beside it.
(2) host syncs per decode step and per generated token, in the paged run of (1), next to the
    dense engine's in the same run (its explicit ``jax.device_get`` calls, counted: one per
    step). Per token divides by the batch, so the dense engine's one sync per step already
    meets a 1/batch target: the per-step figures and their ratio are the ones to quote.
(3) prompt-prefill tokens for P prompts x 2G = 32 samples: shared group prompts vs the dense
    engine (one prefill per sample). The reduction equals the samples per prompt **by
    construction** (each group's prompt is prefilled once instead of once per sample): a
    check that the sharing happens, not a measurement.
(4) heavy-tailed multi-turn rollouts with real sandboxed tool calls (P prompts x 16 samples,
    a prompt's difficulty scaling all its samples) on 2 slices, at an equal KV memory budget
    per slice (dense: 4 slots x 2048 tokens; paged: the same 8,192 tokens as 512 pages of 16,
    32 slots, growth reserve 1/8 of L as configs/base.py): concurrency (live rollouts per
    decode step while rollouts wait to be admitted; peak) and makespan, paged + dynamic
    scheduler vs the dense engine + its dynamic scheduler; and, on the paged engine, vs static
    allocation (equal contiguous chunks, as verl splits a batch) without turn sync and with
    lock-step turns (verl v0.2), and static allocation that launches every request at once
    and evicts on overflow (no growth reserve: rStar2-Agent §3.2's SGLang case). Wall-clock
    and, since the 2 slices share 2 CPU cores, the busiest slice's decode steps. The decode
    slices' idle fraction with the code pool's staged dispatch (tool calls before reward
    verifications, SkyRL-Agent §3.2's pipeline dispatcher) and with one FIFO lane.
(5) prefill tokens spent by ``extend`` vs re-prefilling the conversation at every turn.

GPU (``--device gpu``): decode tokens/s and the fraction of the HBM roofline ((weight bytes
read + live KV bytes) per step / step time / peak bandwidth) for Qwen3-1.7B and 8B shapes with
random bf16 weights at 64 and 256 concurrent rollouts. The weight bytes read are the serving
copy's, less an untied input embedding, of which a step reads only its rows
(``decode_weight_bytes_read``; Qwen3-8B's 1.24 GB table: counted whole before 2026-11-28, its
64-row H200 figure 45.7 % is 43.2 %).

``--repeat N`` runs every (ours, baseline) pair N times, alternating; each figure is the median
and ``spread`` holds [min, max] per figure.

    python benchmarks/serving.py [--device cpu|gpu] [--quick | --smoke] [--repeat 3]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
ap.add_argument("--smoke", action="store_true",
                help="--quick without the untimed compile round of the rollouts: every figure "
                     "and check, but the timings include compiles (tests/test_bench_serving.py)")
ap.add_argument("--slices", type=int, default=2)
ap.add_argument("--repeat", type=int, default=0, help="alternating runs (default 1 quick, 3)")
ap.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
ap.add_argument("--hf-arms", default="",
                help="comma-separated HF generate arms: dynamic, static, compiled (default: all; "
                     "--smoke: dynamic)")
ap.add_argument("--reserve-fraction", type=float, default=0.125,
                help="admission growth reserve, fraction of L (configs/base.py default)")
ap.add_argument("--adaptive-reserve", type=int, default=None, choices=(0, 1),
                help="1: the scheduler's adaptive reserve (no reserve until a preemption, then "
                     "doubling up to --reserve-fraction); default: configs/base.py's")
ap.add_argument("--peak-gbps", type=float, default=0.0,
                help="GPU HBM peak GB/s (default: from the device kind)")
ap.add_argument("--presets", default="qwen3-1.7b,qwen3-8b",
                help="--device gpu / --sizing-check: model shapes (random weights)")
ap.add_argument("--batches", default="64,256", help="--device gpu: concurrent rollouts")
ap.add_argument("--decode-attention", default="auto",
                help="--device gpu / --sizing-check: Engine(decode_attention=...)")
ap.add_argument("--sizing-check", action="store_true",
                help="build the engine of each stage config from the free device memory "
                     "(serving section as shipped), start a maximum-length rollout and two "
                     "shared 2048-token prompts x 16 samples, run a few decode calls")
ap.add_argument("--stages", default="stage1,stage2", help="--sizing-check: configs/<stage>.py")
ap.add_argument("--pallas-blocking", default="",
                help="--device gpu: PAGES_PER_BLOCK,MAX_K_SPLITS,NUM_WARPS,NUM_STAGES for the "
                     "Triton decode kernel (models/paged_attention.py PallasGpuBlocking)")
ap.add_argument("--trace-dir", default="",
                help="--device gpu: a jax.profiler trace of one decode call per preset x batch "
                     "(decode_<preset>_b<batch>.json.gz; read with benchmarks/profile_summary.py)")
ap.add_argument("--param-dtype", default="bfloat16",
                help="--sizing-check: the model's stored weights next to the serving copy "
                     "(float32: a colocated trainer's master weights)")
args = ap.parse_args()
if args.device == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.slices}")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import baseline_dense_engine as dense  # noqa: E402
from hardware import hbm_peak_gbps  # noqa: E402
from rstarjax.env import CodeExecutor  # noqa: E402
from rstarjax.models.chat_template import COMPACT, encode_prompt  # noqa: E402
from rstarjax.models.config import ModelConfig  # noqa: E402
from rstarjax.models.kv_cache import kv_bytes_per_token  # noqa: E402
from rstarjax.models.qwen3 import Qwen3  # noqa: E402
from rstarjax.models.tokenizer import load_tokenizer  # noqa: E402
from rstarjax.rl.agent_loop import AgentConfig, RolloutRequest, run_rollouts  # noqa: E402
from rstarjax.serving import Engine, SamplingParams, StartRequest, generate  # noqa: E402
from rstarjax.serving.colocated import ServingConfig  # noqa: E402
from rstarjax.serving.scheduler import RolloutScheduler  # noqa: E402
from rstarjax.serving.sizing import decode_weight_bytes_read, serving_weight_bytes  # noqa: E402
from tracing import trace_one_call  # noqa: E402

TOOL = "execute_python_code_with_standard_io"
ADAPTIVE = (bool(args.adaptive_reserve) if args.adaptive_reserve is not None
            else bool(ServingConfig().adaptive_reserve))
args.quick = args.quick or args.smoke
HF_ARMS = ("dynamic", "static", "compiled")
hf_arms = [a for a in (args.hf_arms or ("dynamic" if args.smoke else ",".join(HF_ARMS))).split(",") if a]
if unknown := [a for a in hf_arms if a not in HF_ARMS]:
    ap.error(f"--hf-arms: {unknown} not in {HF_ARMS}")
REPEAT = args.repeat or (1 if args.quick else 3)


def alternate(ours, baseline):
    """Run ``ours`` and ``baseline`` REPEAT times, alternating; lists of their dicts."""
    a, b = [], []
    for _ in range(REPEAT):
        a.append(ours())
        b.append(baseline())
    return a, b


def median_figures(runs: list[dict]) -> tuple[dict, dict]:
    out, spread = {}, {}
    for k in runs[0]:
        vals = [r[k] for r in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[k] = statistics.median(vals)
            if len(vals) > 1 and min(vals) != max(vals):
                spread[k] = [min(vals), max(vals)]
        else:  # a name (e.g. the fastest HF arm): one value, or each run's when they differ
            out[k] = vals[0] if all(v == vals[0] for v in vals) else vals
    return out, spread


# ---- (1), (2) decode ---------------------------------------------------------------------

def bench_decode(quick: bool) -> list[dict]:
    batch, prompt_len, new = (4, 16, 32) if quick else (8, 32, 64)
    cfg = ModelConfig.preset("demo", dtype=jnp.float32, vocab_size=4096)  # hidden 256, 4 layers
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()
    engine = Engine(model, num_slots=batch, max_len=prompt_len + new, cache_dtype=jnp.float32,
                    buckets=(prompt_len, prompt_len + new))
    old = dense.Engine(model, num_slots=batch, max_len=prompt_len + new,
                       buckets=(prompt_len, prompt_len + new), cache_dtype=jnp.float32)
    generate(None, prompts, new, engine=engine)  # compile
    dense.generate(None, prompts, new, engine=old)
    hf_run = None if args.skip_hf else _hf_decoder(model, prompts, new)
    n = batch * new

    def ours():
        syncs, steps, toks = engine.host_syncs, engine.decode_steps_run, engine.generated_tokens
        t0 = time.perf_counter()
        out = generate(None, prompts, new, engine=engine)
        dt = time.perf_counter() - t0
        return {"t": dt, "tokens": [o.token_ids for o in out],
                "syncs": engine.host_syncs - syncs, "steps": engine.decode_steps_run - steps,
                "decoded": engine.generated_tokens - toks}

    def baseline():
        t0 = time.perf_counter()
        with counting_device_gets() as dense_syncs:
            out = dense.generate(None, prompts, new, engine=old)
        r = {"t_dense": time.perf_counter() - t0, "dense_tokens": [o.token_ids for o in out],
             "dense_syncs": dense_syncs[0]}
        if hf_run is not None:
            r.update(hf_run())
        return r

    a, b = alternate(ours, baseline)
    runs = []
    for x, y in zip(a, b):
        r = {"decode_tok_s": n / x["t"], "decode_tok_s_dense_engine": n / y["t_dense"],
             "decode_speedup_vs_dense_engine": y["t_dense"] / x["t"],
             "decode_greedy_match_dense_engine": float(x["tokens"] == y["dense_tokens"]),
             "host_syncs_per_token": x["syncs"] / n,
             "host_syncs_per_decode_step": x["syncs"] / max(1, x["steps"]),
             # the baseline's, same run: its explicit device_get calls over the same decode steps
             "host_syncs_per_token_dense_engine": y["dense_syncs"] / n,
             "host_syncs_per_decode_step_dense_engine": y["dense_syncs"] / max(1, x["steps"]),
             "host_sync_reduction_vs_dense_engine": y["dense_syncs"] / max(1, x["syncs"]),
             "decode_batch": batch, "decode_new_tokens": new}
        if hf_run is not None:
            r.update(hf_figures(x, y, n))
        runs.append(r)
    return runs


@contextlib.contextmanager
def counting_device_gets():
    """Counts ``jax.device_get`` calls inside the block (the dense engine's host syncs: it has
    no counter of its own); yields a one-item list holding the count."""
    count, real = [0], jax.device_get

    def counted(x):
        count[0] += 1
        return real(x)

    jax.device_get = counted
    try:
        yield count
    finally:
        jax.device_get = real


def hf_figures(ours: dict, hf: dict, n: int) -> dict:
    """One run's HF figures: each arm's tokens/s and greedy match, the speedup against the
    fastest arm (the strongest baseline of the run)."""
    r = {}
    for arm in hf_arms:
        r[f"decode_tok_s_hf_{arm}"] = n / hf[f"t_hf_{arm}"]
        r[f"decode_speedup_vs_hf_{arm}"] = hf[f"t_hf_{arm}"] / ours["t"]
        r[f"decode_greedy_match_hf_{arm}"] = float(np.mean(
            [t == h for t, h in zip(ours["tokens"], hf[f"hf_tokens_{arm}"])]))
    fastest = min(hf_arms, key=lambda arm: hf[f"t_hf_{arm}"])
    r.update({"decode_tok_s_hf": n / hf[f"t_hf_{fastest}"], "decode_hf_fastest_arm": fastest,
              "decode_speedup_vs_hf": hf[f"t_hf_{fastest}"] / ours["t"],
              "decode_greedy_match_hf": min(r[f"decode_greedy_match_hf_{arm}"] for arm in hf_arms)})
    return r


def _hf_decoder(model, prompts, new):
    """A function timing one greedy ``generate`` of every HF arm (``hf_arms``), each its own
    model instance on the same weights, warmed up (and, for ``compiled``, compiled) first."""
    import torch
    import transformers

    from rstarjax.models.hf import save_hf

    torch.set_num_threads(os.cpu_count() or 1)
    dev = "cuda" if args.device == "gpu" else "cpu"
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, d, tokenizer=False)  # random ids: the benchmark needs no tokenizer
        models = {arm: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
                  .to(dev).eval() for arm in hf_arms}
    if "compiled" in models:
        models["compiled"].forward = torch.compile(models["compiled"].forward, dynamic=False)
    ids = torch.tensor(prompts, device=dev)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    arm_kw = {"dynamic": {}, "static": {"cache_implementation": "static"},
              "compiled": {"cache_implementation": "static"}}
    with torch.no_grad():
        for arm, hf in models.items():
            hf.generate(ids, **kw, **arm_kw[arm])  # warm-up (the compile, for ``compiled``)

    def run():
        out = {}
        for arm, hf in models.items():
            with torch.no_grad():
                t0 = time.perf_counter()
                tokens = hf.generate(ids, **kw, **arm_kw[arm])
                out[f"t_hf_{arm}"] = time.perf_counter() - t0
            out[f"hf_tokens_{arm}"] = tokens[:, len(prompts[0]):].cpu().numpy().tolist()
        return out

    return run


# ---- (3) shared group prompts ---------------------------------------------------------------

def bench_group_prefill(quick: bool) -> dict:
    tok = load_tokenizer(486)
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32, vocab_size=512, hidden_size=128,
                             intermediate_size=256)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    p, group = (2, 32) if quick else (4, 32)
    prompts = [encode_prompt(tok, f"What is {i} * 7? Show your work.", COMPACT) for i in range(p)]
    batch = [q for q in prompts for _ in range(group)]
    max_len = max(map(len, prompts)) + 8
    ours = Engine(model, num_slots=group, max_len=max_len, cache_dtype=jnp.float32)
    old = dense.Engine(model, num_slots=group, max_len=max_len, cache_dtype=jnp.float32)
    a = generate(None, batch, 8, temperature=1.0, engine=ours)
    b = dense.generate(None, batch, 8, temperature=1.0, engine=old)
    return {"prompt_prefill_tokens_shared": ours.prefill_tokens,
            "prompt_prefill_tokens_dense_engine": old.prefill_tokens,
            # = the samples per prompt by construction (one prefill per group, not per sample):
            # it checks that the prompts are shared; it measures nothing
            "prompt_prefill_reduction": old.prefill_tokens / max(1, ours.prefill_tokens),
            "prompt_prefill_prompts": p, "prompt_prefill_samples_per_prompt": group,
            "prompt_prefill_same_tokens": float([x.token_ids for x in a] == [y.token_ids for y in b])}


# ---- (4), (5) multi-turn rollouts ----------------------------------------------------------------

def heavy_tailed_workload(tok, n: int, seed: int, quick: bool, samples_per_prompt: int = 16):
    """Scripted multi-turn rollouts, ``samples_per_prompt`` per prompt (the 2G samples of a
    group). A prompt's difficulty (log-normal) scales the turn lengths and the number of
    tool calls of all its samples, as in RL, where every sample of a hard problem runs long;
    within it, turns ~ 1 + Geometric, turn lengths log-normal, each tool call runs real code
    (sleeping a log-normal time, printing a result)."""
    rng = np.random.default_rng(seed)
    reqs = []
    filler = tok.encode(" think")[0]
    difficulty = rng.lognormal(0.0, 0.6, size=n // samples_per_prompt + 1)
    for i in range(n):
        g = i // samples_per_prompt
        prompt = encode_prompt(tok, f"What is {g}*7?", COMPACT)
        turns = []
        num_calls = min(int(rng.geometric(min(0.9, 0.45 / difficulty[g]))) - 1, 4)
        for k in range(num_calls + 1):
            mu = (3.2 if quick else 3.6) + np.log(difficulty[g])
            length = int(np.clip(rng.lognormal(mu, 0.9), 4, 160 if quick else 300))
            if k < num_calls:
                sleep = float(np.clip(rng.lognormal(-2.5, 1.0), 0.01, 1.0))
                code = f"import time\ntime.sleep({sleep:.3f})\nprint({i}*{k})"
                call = tok.encode('<tool_call>\n{"name": "' + TOOL + '", "arguments": '
                                  + json.dumps({"code": code, "input": ""}) + "}\n</tool_call>")
                turns += [filler] * length + call
            else:
                turns += [filler] * length + tok.encode("<answer>\\boxed{42}</answer><|im_end|>")
        reqs.append(RolloutRequest(prompt, "42", g, SamplingParams(seed=i), script=turns))
    return reqs


def bench_rollouts(quick: bool) -> tuple[list[dict], list[dict]]:
    tok = load_tokenizer(486)
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32, vocab_size=512, hidden_size=128,
                             intermediate_size=256)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    max_len, dense_slots, page = 2048, 4, 16
    devices = (jax.devices() * args.slices)[: args.slices]
    kv_pages = dense_slots * max_len // page  # the dense slots' KV memory, in pages
    paged = [Engine(model, num_slots=32, max_len=max_len, page_size=page, kv_pages=kv_pages,
                    cache_dtype=jnp.float32, buckets=(64, 256, 1024, max_len), device=d)
             for d in devices]
    old = [dense.Engine(model, num_slots=dense_slots, max_len=max_len,
                        buckets=(64, 256, 1024, max_len), cache_dtype=jnp.float32, device=d)
           for d in devices]
    cfg_a = AgentConfig(max_turns=8, max_response_len=max_len - 200, tool_timeout_s=5.0)
    n = 80 if quick else 128  # quick: still more rollouts than the 2 x 32 slots (some wait)
    reserve = int(args.reserve_fraction * max_len)  # serving.admit_reserve_fraction

    def sched(policy="dynamic", sync=None, reserve=reserve, adaptive=ADAPTIVE):
        return RolloutScheduler(paged, max_rollout_len=max_len, policy=policy, sync_turns=sync,
                                admit_reserve_tokens=reserve, adaptive_reserve=adaptive,
                                tool_timeout_s=60)

    # the pool's dispatch: tool calls before verifications (ours), and one FIFO lane (baseline)
    with CodeExecutor(num_workers=2) as ex, CodeExecutor(num_workers=2, dispatch="fifo") as ex_fifo:

        def run(s, engines, pool=ex):
            for e in engines:
                e.prefill_tokens = 0
                if hasattr(e, "occupied_slot_steps"):
                    e.occupied_slot_steps = e.generate_calls = 0
            trajs, timings = run_rollouts(s, tok, pool, heavy_tailed_workload(tok, n, 0, quick),
                                          cfg_a)
            return trajs, timings, sum(e.prefill_tokens for e in engines)

        def ours():
            trajs, t, prefill = run(sched(), paged)
            return {"trajs": trajs, "t": t, "prefill": prefill}

        def baseline():
            for e in old:
                e.occupied_while_queued = e.steps_while_queued = 0
            trajs, t, _ = run(dense.RolloutScheduler(old, max_rollout_len=max_len), old)
            live = sum(e.occupied_slot_steps / max(1, e.generate_calls) for e in old)
            queued = sum(e.occupied_while_queued / max(1, e.steps_while_queued) for e in old)
            r = {"trajs": trajs, "t": t, "live": live, "live_queued": queued}
            for name, policy, sync in (("static_async", "static", False),
                                       ("static_sync", "static", True)):
                r[name] = run(sched(policy, sync, adaptive=False), paged)[1]
            # Static allocation as rStar2-Agent §3.2 describes it: even shares, every request
            # launched at once (no KV-aware admission: a prompt that fits starts), a rollout
            # evicted and recomputed when the pages run out.
            r["static_launch_all"] = run(sched("static", False, reserve=0, adaptive=False), paged)[1]
            # SkyRL-Agent §3.2's question: how idle the decode slices are without the staged
            # dispatch (the same scheduler; the pool serves calls in arrival order)
            r["fifo_trajs"], r["fifo_dispatch"], _ = run(sched(), paged, pool=ex_fifo)
            return r

        # One untimed round first: every arm compiles the programs of this workload's shapes
        # (a timed first round would charge its compiles to whichever arm runs first). A smoke
        # run reports no timing anyone reads, only counts and token equality.
        if not args.smoke:
            ours(), baseline()
        a, b = alternate(ours, baseline)
    runs, extend_runs = [], []
    for x, y in zip(a, b):
        t, d = x["t"], y["t"]
        ms = lambda r: r["timing/rollout_makespan_s"]  # noqa: E731
        same = all(p.response_ids.tolist() == q.response_ids.tolist()
                   for p, q in zip(x["trajs"], y["trajs"]))
        runs.append({
            "rollouts": n, "slices": len(paged), "kv_tokens_per_slice": kv_pages * page,
            # Live rollouts per decode step while more waited to be admitted (both engines
            # full): what an equal KV budget holds at once. Whole-run means include the tail.
            "paged_live_while_queued": t["timing/rollout_mean_live_while_queued"],
            "dense_live_while_queued": y["live_queued"],
            "paged_concurrency_ratio": t["timing/rollout_mean_live_while_queued"]
            / max(1e-9, y["live_queued"]),
            "paged_mean_live": t["timing/rollout_mean_live"], "dense_mean_live": y["live"],
            "paged_max_live": t["timing/rollout_max_live"],
            "paged_max_pages_in_use": t["timing/rollout_max_pages_in_use"],
            "paged_preemptions": t["timing/rollout_preemptions"],
            "paged_adaptive_reserve": float(ADAPTIVE),
            "paged_reserve_tokens_end": t["timing/rollout_reserve_tokens_max"],
            "makespan_paged_s": ms(t), "makespan_dense_engine_s": ms(d),
            "makespan_speedup_vs_dense_engine": ms(d) / ms(t),
            "makespan_static_async_s": ms(y["static_async"]),
            "makespan_static_sync_s": ms(y["static_sync"]),
            "makespan_speedup_vs_static_async": ms(y["static_async"]) / ms(t),
            "makespan_speedup_vs_static_sync": ms(y["static_sync"]) / ms(t),
            "makespan_static_launch_all_s": ms(y["static_launch_all"]),
            "makespan_speedup_vs_static_launch_all": ms(y["static_launch_all"]) / ms(t),
            "preemptions_static_launch_all": y["static_launch_all"]["timing/rollout_preemptions"],
            "makespan_steps_paged": t["timing/rollout_max_slice_steps"],
            "makespan_steps_dense_engine": d["timing/rollout_max_slice_steps"],
            "makespan_steps_static_async": y["static_async"]["timing/rollout_max_slice_steps"],
            "busy_fraction_paged": t["timing/rollout_busy_fraction_mean"],
            # the decode slices' idle share of the makespan, and the part of it with nothing
            # to decode but tool calls to wait for: staged dispatch vs one FIFO lane
            "decode_idle_frac": t["timing/rollout_idle_fraction_mean"],
            "decode_idle_frac_fifo_dispatch": y["fifo_dispatch"]["timing/rollout_idle_fraction_mean"],
            "tool_blocked_frac": t["timing/rollout_tool_blocked_fraction_mean"],
            "tool_blocked_frac_fifo_dispatch": y["fifo_dispatch"]["timing/rollout_tool_blocked_fraction_mean"],
            "makespan_speedup_vs_fifo_dispatch": ms(y["fifo_dispatch"]) / ms(t),
            "fifo_dispatch_same_tokens": float(all(
                p.response_ids.tolist() == q.response_ids.tolist() and p.reward == q.reward
                for p, q in zip(x["trajs"], y["fifo_trajs"]))),
            "busy_fraction_dense_engine": d["timing/rollout_busy_fraction_mean"],
            "rollout_host_syncs_per_token": t["timing/rollout_host_syncs"]
            / max(1, t["timing/rollout_generated_tokens"]),
            # Work balance of the static split (forced tokens of each contiguous share over
            # the mean share): at equal rollouts per slice, the most a shared queue can gain
            # over static allocation without turn sync on this workload.
            "static_split_imbalance": _static_imbalance(x["trajs"], len(paged)),
            "rollouts_same_tokens_as_dense_engine": float(same),
            "tool_calls": int(sum(tr.tool_calls for tr in x["trajs"])),
            "reward_mean": float(np.mean([tr.reward for tr in x["trajs"]])),
        })
        # (5) extend vs re-prefilling the whole conversation at every tool turn.
        reprefill = 0
        for tr in x["trajs"]:
            hist = len(tr.prompt_ids)
            reprefill += hist
            for seg in tr.segments:
                hist += len(seg.ids)
                if seg.kind == "tool":
                    reprefill += hist
        extend_runs.append({"prefill_tokens_extend": x["prefill"],
                            "prefill_tokens_reprefill": reprefill,
                            "prefill_token_ratio": reprefill / max(1, x["prefill"])})
    return runs, extend_runs


def _static_imbalance(trajs, slices: int) -> float:
    """Largest contiguous equal share's generated + tool tokens over the mean share."""
    work = np.array([sum(len(seg.ids) for seg in tr.segments) for tr in trajs], float)
    bounds = np.linspace(0, len(work), slices + 1).round().astype(int)
    shares = [work[i:j].sum() for i, j in zip(bounds[:-1], bounds[1:])]
    return float(max(shares) / np.mean(shares))


# ---- GPU: decode throughput and HBM roofline ------------------------------------------------------



def _peak_gbps(dev) -> float:
    return args.peak_gbps or hbm_peak_gbps(dev.device_kind) or 0


def _random_model(preset: str, param_dtype=jnp.bfloat16):
    cfg = ModelConfig.preset(preset, dtype=jnp.bfloat16, param_dtype=param_dtype)
    return Qwen3(cfg, rngs=nnx.Rngs(0))


def set_pallas_blocking(spec: str) -> str:
    """``--pallas-blocking``: the Triton decode kernel's blocking for every engine built after;
    returns the one in use, as the flag spells it."""
    from rstarjax.models import paged_attention

    if spec:
        per, splits, warps, stages = (int(x) for x in spec.split(","))
        paged_attention.PALLAS_GPU_BLOCKING = paged_attention.PallasGpuBlocking(
            per, splits, warps, stages)
    return ",".join(str(v) for v in dataclasses.astuple(paged_attention.PALLAS_GPU_BLOCKING))


def bench_gpu(quick: bool) -> dict:
    """Decode tokens/s and fraction of the HBM roofline at each preset x batch: every slot
    holds a 512-token prompt and decodes ``calls`` device calls of 16 steps; bytes per step =
    the weight bytes a step reads (``decode_weight_bytes_read``) + the live KV of every slot
    (mean length over the calls)."""
    dev = jax.devices()[0]
    peak = _peak_gbps(dev)
    out = {"device_kind": dev.device_kind, "peak_hbm_gbps": peak,
           "pallas_blocking": set_pallas_blocking(args.pallas_blocking)}
    prompt_len, calls = 512, (4 if quick else 16)
    for preset in args.presets.split(","):
        for batch in map(int, args.batches.split(",")):
            model = _random_model(preset)
            cfg = model.config
            engine = Engine(model, num_slots=batch, max_len=prompt_len + 16 * (calls + 2) + 8,
                            kv_memory_fraction=0.8, decode_attention=args.decode_attention)
            del model
            gc.collect()
            rng = np.random.default_rng(0)
            state = engine.init_decode_state()
            reqs = [StartRequest(s, rng.integers(0, cfg.vocab_size, prompt_len).tolist(),
                                 SamplingParams(temperature=1.0, seed=s, max_new_tokens=10**6))
                    for s in range(batch)]
            state, _ = engine.start(engine.params, state, reqs)
            state, _ = engine.decode(engine.params, state)  # compile
            jax.block_until_ready(state)
            # each call ends in its one host sync, so a call's wall time is its device time plus
            # the host's bookkeeping: the median over calls is the figure, with its range
            lengths, call_s, call_steps = [], [], []
            for _ in range(calls):
                lengths.append(np.mean([engine.slot_length(s) for s in range(batch)]))
                t0 = time.perf_counter()
                state, block = engine.decode(engine.params, state)
                call_s.append(time.perf_counter() - t0)
                call_steps.append(block.steps)
            step_ms = [1e3 * t / n for t, n in zip(call_s, call_steps)]
            weights = decode_weight_bytes_read(cfg, batch)
            kv = float(np.mean(lengths)) * batch * kv_bytes_per_token(cfg, jnp.bfloat16)
            step_s = statistics.median(step_ms) / 1e3
            key = f"{preset}_b{batch}"
            out[f"{key}_decode_tok_s"] = batch / step_s
            out[f"{key}_step_ms"] = 1e3 * step_s
            out[f"{key}_step_ms_range"] = [round(min(step_ms), 3), round(max(step_ms), 3)]
            out[f"{key}_calls"] = calls
            out[f"{key}_bytes_per_step_gb"] = (weights + kv) / 1e9
            if peak:
                out[f"{key}_roofline_fraction"] = (weights + kv) / (peak * 1e9) / step_s
            out[f"{key}_decode_attention"] = engine.decode_attention
            if args.trace_dir:
                def one_call():
                    nonlocal state
                    state, block = engine.decode(engine.params, state)
                    return state
                traced = trace_one_call(one_call, os.path.join(args.trace_dir, f"decode_{key}.json.gz"))
                out.update({f"{key}_{k}": v for k, v in traced.items()})
            del engine, state
            gc.collect()
    return out


# ---- sizing from memory: the stage configs start on this device -------------------------------

def sizing_check() -> dict:
    """For each preset x stage config: the engine the trainer builds
    (``ServingConfig.engine_options``: the shipped ``serving`` section, pool sized from the free
    device memory), then one rollout of the maximum length (``max_prompt_len +
    max_response_len`` minus the decode steps run) and 2 prompts of ``max_prompt_len`` tokens
    x 16 samples sharing their prefill, and 4 decode calls. Prints the plan and the device's
    memory (peak bytes in use) per pair."""
    import importlib

    from rstarjax.serving.colocated import ServingConfig

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "configs"))
    dev = jax.devices()[0]
    out = {"device_kind": dev.device_kind, "param_dtype": args.param_dtype}
    calls = 4
    for preset in args.presets.split(","):
        for stage in args.stages.split(","):
            key = f"{preset}_{stage}"
            config = importlib.import_module(stage).get_config()
            t0 = time.perf_counter()
            model = _random_model(preset, jnp.dtype(args.param_dtype))
            cfg = model.config
            opts = ServingConfig(**dict(config.serving)).engine_options(
                int(config.rl.max_prompt_len) + int(config.rl.max_response_len))
            try:
                engine = Engine(model, decode_attention=args.decode_attention, **opts)
            except ValueError as e:  # refused: the numbers and the flag that fixes it
                out[f"{key}_started"] = False
                out[f"{key}_refusal"] = str(e)
                del model
                gc.collect()
                continue
            plan = engine.plan
            rng = np.random.default_rng(0)
            long_len = engine.max_len - 16 * calls - 1
            prompt_len = int(config.rl.max_prompt_len)
            sp = lambda s: SamplingParams(temperature=1.0, seed=s, max_new_tokens=10**6)  # noqa: E731
            reqs = [StartRequest(0, rng.integers(0, cfg.vocab_size, long_len).tolist(), sp(0),
                                 prompt_len=long_len)]
            for g in range(2):
                prompt = rng.integers(0, cfg.vocab_size, prompt_len).tolist()
                reqs += [StartRequest(1 + 16 * g + i, prompt, sp(1 + 16 * g + i),
                                      prompt_len=prompt_len) for i in range(16)]
            state = engine.init_decode_state()
            state, _ = engine.start(engine.params, state, reqs[:1])
            state, _ = engine.start(engine.params, state, reqs[1:])
            steps = 0
            for _ in range(calls):
                state, block = engine.decode(engine.params, state)
                steps += block.steps
            jax.block_until_ready(state)
            stats = dev.memory_stats() or {}
            out.update({
                f"{key}_started": True, f"{key}_max_len": engine.max_len,
                f"{key}_kv_source": plan.source, f"{key}_kv_pages": plan.num_pages,
                f"{key}_kv_gb": plan.kv_bytes / 1e9, f"{key}_num_slots": plan.num_slots,
                f"{key}_max_length_rollouts": plan.max_length_rollouts,
                f"{key}_free_gb_at_sizing": (plan.free_bytes or 0) / 1e9,
                f"{key}_serving_weights_gb": serving_weight_bytes(cfg, engine.dtype) / 1e9,
                f"{key}_longest_slot": engine.slot_length(0),
                f"{key}_prompt_prefill_tokens": engine.prefill_tokens,
                f"{key}_decode_steps": steps, f"{key}_decode_attention": engine.decode_attention,
                f"{key}_peak_gb_in_use": stats.get("peak_bytes_in_use", 0) / 1e9,
                f"{key}_bytes_limit_gb": stats.get("bytes_limit", 0) / 1e9,
                f"{key}_wall_s": time.perf_counter() - t0,
            })
            del engine, state, model
            gc.collect()
    return out


def main():
    t0 = time.time()
    figures = {"device": args.device, "backend": jax.default_backend()}
    spread = {}
    if args.sizing_check:
        figures.update(sizing_check())
    elif args.device == "gpu":
        figures.update(bench_gpu(args.quick))
    else:
        figures["repeat"] = REPEAT
        for runs in (bench_decode(args.quick),):
            med, sp = median_figures(runs)
            figures.update(med)
            spread.update(sp)
        figures.update(bench_group_prefill(args.quick))
        rollouts, extend = bench_rollouts(args.quick)
        for runs in (rollouts, extend):
            med, sp = median_figures(runs)
            figures.update(med)
            spread.update(sp)
    figures["spread"] = spread
    figures["bench_wall_s"] = time.time() - t0
    rnd = lambda v: round(v, 4) if isinstance(v, float) else v  # noqa: E731
    figures = {k: ({kk: [rnd(x) for x in vv] for kk, vv in v.items()} if isinstance(v, dict)
                   else rnd(v)) for k, v in figures.items()}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

"""Serving benchmark: prints ONE JSON line of figures, each next to its baseline from this run.

(1) decode tokens/s of the slot engine vs HF transformers ``generate`` (PyTorch), same
    config, same weights (checked: identical greedy tokens), same batch; compile excluded
    (warm-up call first), ``transformers`` with its default (dynamic) KV cache.
(2) prefill tokens spent by ``Engine.extend`` on a multi-turn workload vs re-prefilling the
    whole conversation every turn (what JetStream/tunix-style loops do), and the seconds spent.
(3) rollout makespan of the dynamic KV-capacity scheduler + asynchronous tool calls vs the
    static equal allocation with lock-step turns (verl v0.2, rStar2-Agent Fig. 7 top), on a
    heavy-tailed multi-turn workload with real tool calls in the sandbox; engine busy fraction.

    python benchmarks/serving.py [--device cpu|gpu] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
ap.add_argument("--slices", type=int, default=2)
args = ap.parse_args()
if args.device == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.slices}")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rstarjax.env import CodeExecutor  # noqa: E402
from rstarjax.models.chat_template import COMPACT, encode_prompt  # noqa: E402
from rstarjax.models.config import ModelConfig  # noqa: E402
from rstarjax.models.hf import save_hf  # noqa: E402
from rstarjax.models.qwen3 import Qwen3  # noqa: E402
from rstarjax.models.tokenizer import load_tokenizer  # noqa: E402
from rstarjax.rl.agent_loop import AgentConfig, RolloutRequest, run_rollouts  # noqa: E402
from rstarjax.serving import Engine, SamplingParams, generate  # noqa: E402
from rstarjax.serving.scheduler import RolloutScheduler  # noqa: E402

TOOL = "execute_python_code_with_standard_io"


def bench_decode(quick: bool) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    batch, prompt_len, new = (4, 16, 16) if quick else (8, 32, 64)
    cfg = ModelConfig.preset("demo", dtype=jnp.float32, vocab_size=4096)  # hidden 256, 4 layers
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, size=(batch, prompt_len)).tolist()
    engine = Engine(model, num_slots=batch, max_len=prompt_len + new,
                    buckets=(prompt_len, prompt_len + new), cache_dtype=jnp.float32)
    generate(None, prompts, new, engine=engine)  # compile
    t0 = time.perf_counter()
    ours = generate(None, prompts, new, engine=engine)
    t_ours = time.perf_counter() - t0

    dev = "cuda" if args.device == "gpu" else "cpu"
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, d, tokenizer=False)  # random ids: the benchmark needs no tokenizer
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(dev).eval()
    ids = torch.tensor(prompts, device=dev)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, **kw)  # warm-up
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)
        t_hf = time.perf_counter() - t0
    hf_tokens = out[:, prompt_len:].cpu().numpy().tolist()
    same = float(np.mean([a.token_ids == b for a, b in zip(ours, hf_tokens)]))
    n = batch * new
    return {"decode_tok_s": n / t_ours, "decode_tok_s_hf": n / t_hf,
            "decode_speedup_vs_hf": t_hf / t_ours, "decode_greedy_match_hf": same,
            "decode_batch": batch, "decode_new_tokens": new}


def heavy_tailed_workload(tok, n: int, seed: int, quick: bool):
    """Scripted multi-turn rollouts: turns ~ 1 + Geometric, turn lengths log-normal, each tool
    call runs real code (sleeping a log-normal time, printing a result)."""
    rng = np.random.default_rng(seed)
    prompt = encode_prompt(tok, "What is 6*7?", COMPACT)
    reqs = []
    filler = tok.encode(" think")[0]
    for i in range(n):
        turns = []
        num_calls = min(int(rng.geometric(0.45)) - 1, 4)
        for k in range(num_calls + 1):
            length = int(np.clip(rng.lognormal(3.2 if quick else 3.6, 0.9), 4, 160 if quick else 300))
            if k < num_calls:
                sleep = float(np.clip(rng.lognormal(-2.5, 1.0), 0.01, 1.0))
                code = f"import time\ntime.sleep({sleep:.3f})\nprint({i}*{k})"
                call = tok.encode('<tool_call>\n{"name": "' + TOOL + '", "arguments": '
                                  + json.dumps({"code": code, "input": ""}) + "}\n</tool_call>")
                turns += [filler] * length + call
            else:
                turns += [filler] * length + tok.encode("<answer>\\boxed{42}</answer><|im_end|>")
        reqs.append(RolloutRequest(prompt, "42", i, SamplingParams(seed=i), script=turns))
    return reqs


def bench_rollouts(quick: bool) -> dict:
    tok = load_tokenizer(486)
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32, vocab_size=512, hidden_size=128,
                             intermediate_size=256)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    max_len = 2048
    devices = jax.devices()[: args.slices]
    engines = [Engine(model, num_slots=4, max_len=max_len, buckets=(64, 256, 1024, max_len),
                      cache_dtype=jnp.float32, device=d) for d in devices]
    while len(engines) < args.slices:  # fewer devices than slices: share one
        engines.append(Engine(model, num_slots=4, max_len=max_len, buckets=engines[0].buckets,
                              cache_dtype=jnp.float32))
    cfg_a = AgentConfig(max_turns=8, max_response_len=max_len - 200, tool_timeout_s=5.0)
    n = 16 if quick else 48
    out = {}
    with CodeExecutor(num_workers=2) as ex:
        # Warm-up: compile every program on every slice.
        warm = heavy_tailed_workload(tok, n, seed=0, quick=quick)
        run_rollouts(RolloutScheduler(engines, max_rollout_len=max_len), tok, ex, warm, cfg_a)
        results = {}
        for name, policy, sync in (("dynamic", "dynamic", False), ("static_sync", "static", True),
                                   ("static_async", "static", False)):
            reqs = heavy_tailed_workload(tok, n, seed=0, quick=quick)
            for e in engines:
                e.prefill_tokens = 0
            sched = RolloutScheduler(engines, max_rollout_len=max_len, policy=policy,
                                     sync_turns=sync, tool_timeout_s=60)
            trajs, timings = run_rollouts(sched, tok, ex, reqs, cfg_a)
            results[name] = (trajs, timings, sum(e.prefill_tokens for e in engines))
        dyn, st = results["dynamic"][1], results["static_sync"][1]
        out.update({
            "rollouts": n, "slices": len(engines),
            "makespan_dynamic_s": dyn["timing/rollout_makespan_s"],
            "makespan_static_sync_s": st["timing/rollout_makespan_s"],
            "makespan_static_async_s": results["static_async"][1]["timing/rollout_makespan_s"],
            "makespan_speedup": st["timing/rollout_makespan_s"] / dyn["timing/rollout_makespan_s"],
            # Decode steps of the busiest slice: the makespan in engine steps. A step costs the
            # same whatever number of its slots are active (fixed shapes), so this is the
            # device-time makespan free of CPU contention between slices on a 2-core host.
            "makespan_steps_dynamic": dyn["timing/rollout_max_slice_steps"],
            "makespan_steps_static_sync": st["timing/rollout_max_slice_steps"],
            "makespan_steps_static_async":
                results["static_async"][1]["timing/rollout_max_slice_steps"],
            "makespan_steps_speedup": st["timing/rollout_max_slice_steps"]
                / dyn["timing/rollout_max_slice_steps"],
            "busy_fraction_dynamic": dyn["timing/rollout_busy_fraction_mean"],
            "busy_fraction_static_sync": st["timing/rollout_busy_fraction_mean"],
            "tool_calls": int(sum(t.tool_calls for t in results["dynamic"][0])),
            "reward_mean": float(np.mean([t.reward for t in results["dynamic"][0]])),
        })
        # (2) extend vs re-prefill: replay the dynamic run's conversations, re-prefilling the
        # whole history at every turn boundary as a loop without `extend` must.
        trajs, _, extend_tokens = results["dynamic"]
        eng = engines[0]
        reprefill_tokens, t_reprefill = 0, 0.0
        for t in trajs:
            hist = list(t.prompt_ids)
            reprefill_tokens += len(hist)
            for seg in t.segments:
                hist += seg.ids.tolist()
                if seg.kind == "tool":
                    t0 = time.perf_counter()
                    eng.prefill(eng.params, hist)
                    t_reprefill += time.perf_counter() - t0
                    reprefill_tokens += len(hist)
        out.update({"prefill_tokens_extend": extend_tokens,
                    "prefill_tokens_reprefill": reprefill_tokens,
                    "prefill_token_ratio": reprefill_tokens / max(1, extend_tokens),
                    "reprefill_s": t_reprefill})
    return out


def main():
    t0 = time.time()
    figures = {"device": args.device, "backend": jax.default_backend()}
    figures.update(bench_decode(args.quick))
    figures.update(bench_rollouts(args.quick))
    figures["bench_wall_s"] = time.time() - t0
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items()}))


if __name__ == "__main__":
    main()

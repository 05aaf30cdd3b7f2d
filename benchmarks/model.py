"""Forward+backward tokens/s of the jitted rstarjax Qwen3 vs transformers (PyTorch eager) on the
same config and batch; prints ONE JSON line.

  python benchmarks/model.py                          # CPU, demo config, fp32, one run of each
  python benchmarks/model.py --vocab 8192 --alternate 3   # 3 alternating runs (ours, torch, ...)
  python benchmarks/model.py --attention-sweep        # CPU: dense vs blockwise attention, fwd+bwd
  python benchmarks/model.py --device gpu --preset qwen3-0.6b --batch 8 --seq 2048 --dtype bfloat16

``--alternate N`` runs each side N times, alternating, each in a fresh process (so neither
side's thread pool or allocator state leaks into the other's timing), and reports the median and
the range. Compilation (JAX) and the first step (torch) are excluded from the timings.
On GPU the line also has MFU (model FLOPs: ModelConfig.train_flops_per_token).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
parser.add_argument("--preset", default="demo")
parser.add_argument("--vocab", type=int, default=None, help="override vocab_size")
parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--seq", type=int, default=256)
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
parser.add_argument("--remat", default="none")
parser.add_argument("--attention", default="auto", help="ModelConfig.packed_attention")
parser.add_argument("--no_scan", action="store_true", help="unrolled layers instead of lax.scan")
parser.add_argument("--iters", type=int, default=5)
parser.add_argument("--peak_tflops", type=float, default=989.0, help="H100 SXM bf16 dense")
parser.add_argument("--no_torch", action="store_true")
parser.add_argument("--only", choices=["jax", "torch"], default=None)
parser.add_argument("--alternate", type=int, default=0, help="N alternating runs per side")
parser.add_argument("--attention-sweep", action="store_true")
args = parser.parse_args()
if args.device == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def alternate():
    """``--alternate N``: ours, torch, ours, ... each in a fresh process; medians and ranges."""
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--alternate")]
    if "--alternate" in sys.argv:  # "--alternate N" form
        i = sys.argv.index("--alternate")
        passthrough = [a for j, a in enumerate(sys.argv[1:], 1) if j not in (i, i + 1)]
    runs = {"jax": [], "torch": []}
    last = {}
    for _ in range(args.alternate):
        for side in ("jax", "torch"):
            out = subprocess.run([sys.executable, __file__, *passthrough, "--only", side],
                                 capture_output=True, text=True, check=True, env=os.environ)
            last[side] = json.loads(out.stdout.strip().splitlines()[-1])
            runs[side].append(last[side][f"{side}_tokens_per_s" if side == "jax"
                                         else "torch_eager_tokens_per_s"])
    ratios = [j / t for j, t in zip(runs["jax"], runs["torch"])]
    result = {k: v for k, v in last["jax"].items() if not k.startswith("jax_")}
    result.update(
        runs=args.alternate, jax_tokens_per_s=statistics.median(runs["jax"]),
        jax_range=[min(runs["jax"]), max(runs["jax"])], jax_runs=runs["jax"],
        torch_eager_tokens_per_s=statistics.median(runs["torch"]),
        torch_range=[min(runs["torch"]), max(runs["torch"])], torch_runs=runs["torch"],
        torch_threads=last["torch"]["torch_threads"],
        speedup_vs_torch=round(statistics.median(ratios), 3),
        speedup_range=[round(min(ratios), 3), round(max(ratios), 3)])
    print(json.dumps(result))


if args.alternate:
    alternate()
    sys.exit(0)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rstarjax.models import ModelConfig, Qwen3  # noqa: E402
from rstarjax.models import attention as attention_lib  # noqa: E402

overrides = {"dtype": getattr(jnp, args.dtype), "remat_policy": args.remat,
             "packed_attention": args.attention, "scan_layers": not args.no_scan}
if args.vocab:
    overrides["vocab_size"] = args.vocab
if args.layers:
    overrides["num_hidden_layers"] = args.layers
cfg = ModelConfig.preset(args.preset, **overrides)
tokens_np = np.random.RandomState(0).randint(0, cfg.vocab_size, (args.batch, args.seq))
n_tokens = args.batch * args.seq


def loss_fn(model, tokens):
    """Mean next-token NLL, computed as the trainer does (``Qwen3.token_logprobs``: fused
    log-sum-exp and gather, the vocabulary in chunks for long rows)."""
    logp, _ = model.token_logprobs(tokens, with_entropy=False)
    return -jnp.sum(logp) / (tokens.shape[0] * (tokens.shape[1] - 1))


def bench_jax():
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    step = jax.jit(jax.value_and_grad(lambda st, t: loss_fn(nnx.merge(graphdef, st), t)))
    tokens = jnp.asarray(tokens_np, jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(step(state, tokens))
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(step(state, tokens))
    t0 = time.perf_counter()
    for _ in range(args.iters):
        out = step(state, tokens)
    jax.block_until_ready(out)
    return n_tokens * args.iters / (time.perf_counter() - t0), compile_s


def bench_torch():
    import torch
    import transformers
    hf = cfg.to_hf_dict()
    cls = transformers.Qwen2Config if cfg.architecture == "Qwen2ForCausalLM" \
        else transformers.Qwen3Config
    tcfg = cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    dev = "cuda" if args.device == "gpu" and torch.cuda.is_available() else "cpu"
    tdtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model_cls = transformers.Qwen2ForCausalLM if cls is transformers.Qwen2Config \
        else transformers.Qwen3ForCausalLM
    tmodel = model_cls(tcfg).to(dev, tdtype).train()
    tokens = torch.as_tensor(tokens_np, device=dev)

    def step():
        tmodel.zero_grad(set_to_none=True)
        logits = tmodel(tokens).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))
        loss.backward()
    step()
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (n_tokens * args.iters / (time.perf_counter() - t0), torch.get_num_threads(),
            tmodel.config._attn_implementation)


def attention_sweep():
    """fwd+bwd ms of the attention alone at the demo's head shape: dense vs blockwise tiles."""
    def ms(fn, t, b, nq=4, nk=2, h=32, reps=5):
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.normal(size=(b, t, nq, h)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(b, t, nk, h)), jnp.float32) for _ in range(2))
        seg = jnp.ones((b, t), jnp.int32)
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg)), argnums=(0, 1, 2)))
        jax.block_until_ready(grad(q, k, v))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(grad(q, k, v))
            times.append(time.perf_counter() - t0)
        return round(1e3 * statistics.median(times), 1)

    rows = []
    for t, b in ((128, 32), (256, 16), (384, 16), (416, 16), (1024, 4), (2048, 2), (4096, 1)):
        row = {"seq": t, "batch": b, "dense_ms": ms(attention_lib.dense_attention, t, b)}
        for block in (64, 128, 256):
            row[f"blockwise{block}_ms"] = ms(
                lambda q, k, v, s, block=block: attention_lib.blockwise_attention(q, k, v, s, block),
                t, b)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    print(json.dumps({"benchmark": "attention_fwd_bwd_sweep", "device": jax.devices()[0].device_kind,
                      "heads": 4, "kv_heads": 2, "head_dim": 32, "dtype": "float32", "rows": rows}))


if args.attention_sweep:
    attention_sweep()
    sys.exit(0)

result = {
    "benchmark": "model_fwd_bwd", "device": jax.devices()[0].device_kind,
    "preset": args.preset, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
    "params": cfg.num_params, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
    "remat": args.remat, "attention": attention_lib.choose_implementation(args.attention, args.seq, dtype=cfg.dtype),
    "scan_layers": cfg.scan_layers, "iters": args.iters,
}
if args.only != "torch":
    jax_tps, compile_s = bench_jax()
    result.update(jax_tokens_per_s=round(jax_tps, 1), jax_compile_s=round(compile_s, 2))
    if args.device == "gpu":
        result["mfu"] = round(cfg.train_flops_per_token(args.seq) * jax_tps
                              / (args.peak_tflops * 1e12), 4)
if not args.no_torch and args.only != "jax":
    torch_tps, threads, torch_attn = bench_torch()
    result.update(torch_eager_tokens_per_s=round(torch_tps, 1), torch_threads=threads,
                  torch_attention=torch_attn)
    if "jax_tokens_per_s" in result:
        result["speedup_vs_torch"] = round(result["jax_tokens_per_s"] / torch_tps, 3)
print(json.dumps(result))

"""Forward+backward tokens/s of the jitted rstarjax Qwen3 vs transformers (PyTorch eager) on the
same config and batch, in one process; prints ONE JSON line.

  python benchmarks/model.py                          # CPU, demo config, fp32
  python benchmarks/model.py --device gpu --preset qwen3-0.6b --batch 8 --seq 2048 --dtype bfloat16

On GPU the line also has MFU = 6 * N * tokens/s / peak_flops (N = parameter count).
"""
import argparse
import json
import os
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
parser.add_argument("--iters", type=int, default=5)
parser.add_argument("--peak_tflops", type=float, default=989.0, help="H100 SXM bf16 dense")
parser.add_argument("--no_torch", action="store_true")
args = parser.parse_args()
if args.device == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rstarjax.models import ModelConfig, Qwen3  # noqa: E402

overrides = {"dtype": getattr(jnp, args.dtype), "remat_policy": args.remat}
if args.vocab:
    overrides["vocab_size"] = args.vocab
if args.layers:
    overrides["num_hidden_layers"] = args.layers
cfg = ModelConfig.preset(args.preset, **overrides)
tokens_np = np.random.RandomState(0).randint(0, cfg.vocab_size, (args.batch, args.seq))
n_tokens = args.batch * args.seq


def loss_fn(model, tokens):
    logits = model(tokens)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def bench_jax():
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    step = jax.jit(jax.value_and_grad(lambda st, t: loss_fn(nnx.merge(graphdef, st), t)))
    tokens = jnp.asarray(tokens_np, jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(step(state, tokens))
    compile_s = time.perf_counter() - t0
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
    return n_tokens * args.iters / (time.perf_counter() - t0), torch.get_num_threads()


jax_tps, compile_s = bench_jax()
result = {
    "benchmark": "model_fwd_bwd", "device": jax.devices()[0].device_kind,
    "preset": args.preset, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
    "params": cfg.num_params, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
    "remat": args.remat, "iters": args.iters,
    "jax_tokens_per_s": round(jax_tps, 1), "jax_compile_s": round(compile_s, 2),
}
if not args.no_torch:
    torch_tps, threads = bench_torch()
    result.update(torch_eager_tokens_per_s=round(torch_tps, 1), torch_threads=threads,
                  speedup_vs_torch=round(jax_tps / torch_tps, 3))
if args.device == "gpu":
    result["mfu"] = round(6 * cfg.num_params * jax_tps / (args.peak_tflops * 1e12), 4)
print(json.dumps(result))

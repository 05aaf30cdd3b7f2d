"""Trainer step throughput vs a naive full-batch baseline, in the same process.

    python benchmarks/bench_trainer.py [--preset tiny|demo|qwen3-0.6b] [--batch 16] [--seq 256]
        [--micro 4] [--steps 5] [--dtype bfloat16]

Prints ONE JSON line. ``trainer``: rstarjax.rl.trainer.Trainer (jitted, sharded over every
device with fsdp, micro-batched, donated state). ``baseline``: one jax.jit(value_and_grad) of
eq. 6 over the whole batch on one device + optax AdamW, no micro-batching, no sharding (what a
first implementation would write). Tokens/s counts all B*L positions.
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rstarjax.models import sharding as sharding_lib
from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.rl import optim as optim_lib
from rstarjax.rl import trainer as trainer_lib
from rstarjax.rl.loss import LossConfig


def make_batch(b, l, vocab, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(b, l)).astype(np.int32)
    mask = np.zeros((b, l), np.float32)
    mask[:, l // 4:] = 1.0
    adv = (np.where(rng.random(b) < 0.5, 1.0, -1.0)[:, None] * mask).astype(np.float32)
    old = (-5.0 + rng.normal(0, 0.3, (b, l)) * mask).astype(np.float32) * mask
    return dict(tokens=tokens, positions=np.broadcast_to(np.arange(l, dtype=np.int32), (b, l)).copy(),
                segment_ids=np.ones((b, l), np.int32), loss_mask=mask, old_logprobs=old, advantages=adv,
                rollout_logprobs=old)


def baseline_step_fn(model, opt):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, batch):
        logits = nnx.merge(graphdef, p, rest)(batch["tokens"], positions=batch["positions"],
                                              segment_ids=batch["segment_ids"])
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32)),
                                   batch["tokens"][:, 1:, None], -1)[..., 0]
        m, a, o = batch["loss_mask"][:, 1:], batch["advantages"][:, 1:], batch["old_logprobs"][:, 1:]
        r = jnp.exp(logp - o)
        return -jnp.sum(jnp.minimum(r * a, jnp.clip(r, 0.8, 1.28) * a) * m) / jnp.sum(m)

    @jax.jit
    def step(p, s, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return step, params


def timed(fn, steps):
    fn()  # compile + warm-up (twice: a first output can differ in weak types and recompile once)
    jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(steps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=0, help="micro-batch rows (0 = whole batch)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    cfg = ModelConfig.preset(args.preset, dtype=jnp.dtype(args.dtype))
    batch = make_batch(args.batch, args.seq, cfg.vocab_size)
    ocfg = optim_lib.OptimConfig(learning_rate=1e-6, warmup_steps=20)

    opt = optim_lib.make_optimizer(ocfg)
    base_step, params = baseline_step_fn(Qwen3(cfg, rngs=nnx.Rngs(0)), opt)
    dev0 = jax.devices()[0]
    params = jax.device_put(params, dev0)
    state = [params, opt.init(params)]
    gb = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, dev0)

    def run_base():
        state[0], state[1], loss = base_step(state[0], state[1], gb)
        return loss

    t_base = timed(run_base, args.steps)

    mesh = sharding_lib.make_mesh(1, -1, 1)
    tr = trainer_lib.Trainer(Qwen3(cfg, rngs=nnx.Rngs(0)), ocfg, LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=args.micro, recompute_old_logprobs=False),
                             mesh=mesh)
    g = tr.put_batch(batch)

    def run_trainer():
        with jax.set_mesh(tr.mesh):
            tr.state, m = tr.step_fn(args.batch)(tr.state, g, jnp.float32(0.0))
        return m["loss"]

    t_tr = timed(run_trainer, args.steps)
    tokens = args.batch * args.seq
    print(json.dumps({
        "bench": "trainer_step", "device": str(dev0.device_kind), "devices": jax.device_count(),
        "preset": args.preset, "params_m": round(cfg.num_params / 1e6, 2), "batch": args.batch,
        "seq": args.seq, "micro_batch": args.micro or args.batch, "dtype": args.dtype,
        "trainer_step_s": round(t_tr, 4), "trainer_tokens_per_s": round(tokens / t_tr, 1),
        "baseline_step_s": round(t_base, 4), "baseline_tokens_per_s": round(tokens / t_base, 1),
        "speedup": round(t_base / t_tr, 3),
    }))


if __name__ == "__main__":
    main()

"""The train step's memory and speed: XLA's own memory analysis, tokens/s, MFU, and a memory plan.

    # speed (default): rstarjax.rl.trainer.Trainer vs a baseline, --repeats alternating timings
    python benchmarks/bench_trainer.py [--preset tiny] [--batch 16] [--seq 256] [--micro 4]
        [--steps 5] [--dtype bfloat16] [--baseline plain|previous] [--repeats 3] [--peak-tflops X]
    # GPU: MFU of a Qwen3-1.7B shape at 8K tokens (bf16)
    python benchmarks/bench_trainer.py --preset qwen3-1.7b --batch 1 --seq 8192 --steps 3 \
        --remat full --no-baseline
    # memory growth in the row length: 2K..16K on a small Qwen3 shape (the 16K step runs)
    python benchmarks/bench_trainer.py --memory-scan
    # per-device memory of the stage-2 rows (prompt 2048 + response 12288) on a device mesh;
    # exits 1, naming what to change, when a plan cannot fit
    python benchmarks/bench_trainer.py --plan [--models qwen3-1.7b,qwen3-8b,qwen3-14b]
        [--meshes h100x8,v5p-64] [--micro-rows 1] [--remat full] [--kv-slots 8]
    # LoRA (docs/lora.md): Qwen3-1.7B stage 1 on a 16 GB Colab GPU / TPU, Qwen3-14B stage 2 on one H100
    python benchmarks/bench_trainer.py --plan --lora-rank 16 --models qwen3-1.7b --meshes t4,v5e-1,l4 \
        --plan-seq 8192 --kv-slots 4
    python benchmarks/bench_trainer.py --plan --lora-rank 16 --models qwen3-14b --meshes h100x1 --kv-slots 4
    # padding rows (rejected groups): Trainer.train skipping all-padding micro-batches vs not
    python benchmarks/bench_trainer.py --padding 0.5 [--batch 32 --seq 512 --micro 4]
    # largest row length whose train step fits one device (GPU: measured, else XLA:CPU analysis)
    python benchmarks/bench_trainer.py --max-len --preset qwen3-1.7b --hbm-gb 80

Each mode prints ONE JSON line (docs/training.md explains the method and the figures).

Peak memory of a compiled step is ``argument + output + temp - alias`` bytes from
``jit(step).lower(...).compile().memory_analysis()`` (donated state aliases the output).
MFU = model FLOPs per token x tokens/s / (devices x device peak FLOP/s), with the model FLOPs of
one training token from ``ModelConfig.train_flops_per_token``: 6 x (matmul parameters, LM head
included, embedding lookup not) + 6 x layers x heads x head_dim x (T + 1) for causal attention
over a row of T tokens (forward QK^T and PV are 2 x 2 x heads x head_dim x (T + 1) / 2 per token
and layer; backward twice the forward). Recomputation (remat) is not model FLOPs.
"""
import argparse
import contextlib
import json
import os
import sys
import time

PLAN_MESHES = {
    # name: (devices, HBM GB per device, (data, fsdp, tensor), usable fraction). Usable: what a
    # jax process can allocate (GPU: set XLA_PYTHON_CLIENT_MEM_FRACTION=0.95; the default 0.75
    # leaves 60 GB of an 80 GB H100).
    "h100x8": (8, 80, (1, 8, 1), 0.95),
    "h100x1": (1, 80, (1, 1, 1), 0.95),
    # TPU v5p-64: 64 TensorCores = 32 chips (one jax device each, megacore), 95 GB HBM per chip
    "v5p-64": (32, 95, (1, 32, 1), 0.95),
    # Colab: a T4 (16 GB), a TPU v5e-1 (one chip, 16 GB HBM), an L4 (24 GB)
    "t4": (1, 16, (1, 1, 1), 0.95),
    "v5e-1": (1, 16, (1, 1, 1), 0.95),
    "l4": (1, 24, (1, 1, 1), 0.95),
}



def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--memory-scan", action="store_true")
    mode.add_argument("--plan", action="store_true")
    mode.add_argument("--max-len", action="store_true")
    mode.add_argument("--padding", type=float, default=None, metavar="FRACTION",
                      help="rows that are padding (rejected groups): skip_padding on vs off")
    ap.add_argument("--preset", default=None, help="model shape (default: tiny; scan: tiny widths)")
    ap.add_argument("--vocab", type=int, default=None, help="override vocab_size")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=0, help="micro-batch rows (0 = whole batch)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default=None, help="compute dtype (default bfloat16; scan float32)")
    ap.add_argument("--remat", default=None, help="remat policy (default: preset's; plan: full)")
    ap.add_argument("--attention", default="auto", help="ModelConfig.packed_attention")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--baseline", choices=["plain", "previous"], default="plain")
    ap.add_argument("--repeats", type=int, default=1, help="alternating timings (ours, baseline)")
    ap.add_argument("--overrides", default="", help='ModelConfig fields as JSON, e.g. {"hidden_size": 128}')
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU")
    ap.add_argument("--trace-dir", default="", help="speed: a jax.profiler trace of one step of "
                    "ours (train_<preset>_<batch>x<seq>.json.gz; benchmarks/profile_summary.py reads it)")
    ap.add_argument("--lengths", default="2048,4096,8192,16384", help="--memory-scan row lengths")
    ap.add_argument("--models", default="qwen3-1.7b,qwen3-8b,qwen3-14b", help="--plan presets")
    ap.add_argument("--meshes", default="h100x8,v5p-64", help=f"--plan meshes {sorted(PLAN_MESHES)}")
    ap.add_argument("--plan-seq", type=int, default=2048 + 12288, help="stage 2: prompt + response")
    ap.add_argument("--micro-rows", type=int, default=1, help="--plan rows per device per micro-step")
    ap.add_argument("--kv-slots", type=int, default=8, help="--plan concurrent rollouts per device")
    ap.add_argument("--lora-rank", type=int, default=0, help="--plan: LoRA adapters of this rank on every "
                    "projection, the base frozen in bf16 (0 = full fine-tuning)")
    ap.add_argument("--serving-copy", action="store_true", help="--plan: count the engine's bf16 serving "
                    "copy of the weights (always counted with --lora-rank)")
    ap.add_argument("--release-serving", action="store_true", help="--plan: the serving copy and KV are "
                    "freed during the update (serving.release_during_update)")
    ap.add_argument("--hbm-gb", type=float, default=80.0, help="--max-len device memory")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.plan:  # simulate the largest mesh's devices on the host (compile only, nothing runs)
    _n = max(PLAN_MESHES[m][0] for m in ARGS.meshes.split(","))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_n}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from rstarjax.models import sharding as sharding_lib  # noqa: E402
from rstarjax.models.config import ModelConfig  # noqa: E402
from rstarjax.models.logprobs import token_logprobs_and_entropy  # noqa: E402
from rstarjax.models.qwen3 import Qwen3  # noqa: E402
from rstarjax.rl import loss as loss_lib  # noqa: E402
from rstarjax.rl import optim as optim_lib  # noqa: E402
from rstarjax.rl import trainer as trainer_lib  # noqa: E402
from hardware import bf16_peak_flops  # noqa: E402  (benchmarks/, this script's folder)
from tracing import trace_one_call  # noqa: E402

GB = 1e9


# ---------------------------------------------------------------------------------------------
# FLOPs and memory accounting
# ---------------------------------------------------------------------------------------------
def device_peak_flops(override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    # CPU: no meaningful peak (None); pass --peak-tflops to get an MFU anyway
    return bf16_peak_flops(jax.devices()[0].device_kind)


def memory_stats(compiled) -> dict:
    """Per-device bytes of a compiled executable (XLA's buffer assignment)."""
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes \
        - m.alias_size_in_bytes
    return {"peak_bytes": int(peak), "temp_bytes": int(m.temp_size_in_bytes),
            "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes)}


def per_device_bytes(abstract_tree, shardings) -> int:
    """Bytes one device holds of ``abstract_tree`` placed with ``shardings`` (same structure)."""
    leaves = jax.tree.leaves(abstract_tree)
    shards = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    total = 0
    for leaf, sh in zip(leaves, shards):
        shape = sh.shard_shape(leaf.shape) if leaf.shape else ()
        total += int(np.prod(shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
    return total


# ---------------------------------------------------------------------------------------------
# Steps: ours (Trainer), today's (dense mask + full logits), a plain baseline
# ---------------------------------------------------------------------------------------------
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


def full_logits_forward(graphdef, rest, params, batch, compute_dtype, with_entropy=True, temperature=1.0):
    """The trainer's forward before chunked vocabularies: [B, L, V] float32 logits, then the
    log-softmax (what ``trainer.forward_logprobs`` computed until then; its signature now)."""
    if compute_dtype is not None:
        params = trainer_lib.cast_floating(params, compute_dtype)
    model = nnx.merge(graphdef, params, rest)
    logits = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    logprobs, entropy = token_logprobs_and_entropy(logits.astype(jnp.float32) / temperature, batch["tokens"])
    return logprobs, (entropy if with_entropy else None)


@contextlib.contextmanager
def previous_train_step():
    """Trace the trainer's step as it was before fused attention and chunked vocabularies (with a
    ``packed_attention="dense"`` model): the same step function, the old forward."""
    saved = trainer_lib.forward_logprobs
    trainer_lib.forward_logprobs = full_logits_forward
    try:
        yield
    finally:
        trainer_lib.forward_logprobs = saved


def single_device_trainer(cfg: ModelConfig, micro: int = 0) -> trainer_lib.Trainer:
    mesh = sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    return trainer_lib.Trainer(Qwen3(cfg, rngs=nnx.Rngs(0)),
                               optim_lib.OptimConfig(learning_rate=1e-6, warmup_steps=20),
                               loss_lib.LossConfig(),
                               trainer_lib.TrainerConfig(micro_batch_size=micro,
                                                         recompute_old_logprobs=False),
                               mesh=mesh)


def compile_step(tr: trainer_lib.Trainer, batch: dict, skip_padding: bool = False):
    rows = batch["tokens"].shape[0]
    with jax.set_mesh(tr.mesh):
        return tr.step_fn(rows, None, skip_padding).lower(tr.state, batch, jnp.float32(0.0)).compile()


def baseline_step_fn(model, opt):
    """A plain jit(value_and_grad) of eq. 6 over the whole batch with full logits."""
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
    jax.block_until_ready(fn())  # warm-up (a first output can differ in weak types: compile twice)
    jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(steps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / steps


def model_config(args, preset_default="tiny", dtype_default="bfloat16", **extra) -> ModelConfig:
    overrides = {"dtype": jnp.dtype(args.dtype or dtype_default),
                 "packed_attention": args.attention, **extra,
                 **(json.loads(args.overrides) if args.overrides else {})}
    if args.vocab:
        overrides["vocab_size"] = args.vocab
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.remat:
        overrides["remat_policy"] = args.remat
    return ModelConfig.preset(args.preset or preset_default, **overrides)


# ---------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------
def _trainer_runner(cfg, args, batch, previous=False):
    """A zero-argument callable running one update of a Trainer over every device (fsdp), and
    the Trainer. ``previous``: the step as it was before this change (``previous_train_step``)."""
    mesh = sharding_lib.make_mesh(1, -1, 1)
    tr = trainer_lib.Trainer(Qwen3(cfg, rngs=nnx.Rngs(0)),
                             optim_lib.OptimConfig(learning_rate=1e-6, warmup_steps=20),
                             loss_lib.LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=args.micro,
                                                       recompute_old_logprobs=False), mesh=mesh)
    g = tr.put_batch(batch)
    with previous_train_step() if previous else contextlib.nullcontext():
        step = tr.step_fn(args.batch)
        compiled = compile_step(tr, g)
        with jax.set_mesh(tr.mesh):  # trace (and compile) now, under the patch
            tr.state, _ = step(tr.state, g, jnp.float32(0.0))

    def run():
        with jax.set_mesh(tr.mesh):
            tr.state, m = step(tr.state, g, jnp.float32(0.0))
        return m["loss"]
    return run, compiled


def _plain_runner(cfg, batch):
    opt = optim_lib.make_optimizer(optim_lib.OptimConfig(learning_rate=1e-6, warmup_steps=20))
    base_step, params = baseline_step_fn(Qwen3(cfg, rngs=nnx.Rngs(0)), opt)
    dev0 = jax.devices()[0]
    params = jax.device_put(params, dev0)
    state = [params, opt.init(params)]
    gb = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, dev0)

    def run():
        state[0], state[1], loss = base_step(state[0], state[1], gb)
        return loss
    return run


def speed(args) -> dict:
    """Step time of the Trainer vs a baseline in the same process, ``--repeats`` alternating
    timings of ``--steps`` steps each (ours, baseline, ours, ...): medians and ranges.
    Baselines: ``plain`` = one jit(value_and_grad) with full logits on one device, no
    micro-batching; ``previous`` = this Trainer's step before fused attention and chunked
    vocabularies (dense [T, T] mask, full [B, T, V] logits)."""
    cfg = model_config(args)
    batch = make_batch(args.batch, args.seq, cfg.vocab_size)
    tokens = args.batch * args.seq
    flops = cfg.train_flops_per_token(args.seq)
    peak = device_peak_flops(args.peak_tflops)
    out = {"bench": "trainer_step", "device": str(jax.devices()[0].device_kind),
           "devices": jax.device_count(), "preset": args.preset or "tiny",
           "overrides": args.overrides, "params_m": round(cfg.num_params / 1e6, 2),
           "batch": args.batch, "seq": args.seq, "micro_batch": args.micro or args.batch,
           "dtype": jnp.dtype(cfg.dtype).name, "remat": cfg.remat_policy,
           "attention": cfg.packed_attention, "train_flops_per_token": flops,
           "baseline": None if args.no_baseline else args.baseline, "repeats": args.repeats}
    ours, compiled = _trainer_runner(cfg, args, batch)
    out.update({f"trainer_{k}": v for k, v in memory_stats(compiled).items()
                if k in ("peak_bytes", "temp_bytes")})
    base = None
    if not args.no_baseline:
        if args.baseline == "previous":
            base, base_compiled = _trainer_runner(cfg.replace(packed_attention="dense"), args,
                                                  batch, previous=True)
            out["baseline_peak_bytes"] = memory_stats(base_compiled)["peak_bytes"]
        else:
            base = _plain_runner(cfg, batch)
    t_ours, t_base = [], []
    for _ in range(args.repeats):
        t_ours.append(timed(ours, args.steps))
        if base is not None:
            t_base.append(timed(base, args.steps))
    t_tr = float(np.median(t_ours))
    out.update(trainer_step_s=round(t_tr, 4), trainer_step_s_range=[round(min(t_ours), 4),
                                                                    round(max(t_ours), 4)],
               trainer_tokens_per_s=round(tokens / t_tr, 1))
    if peak:
        out.update(peak_tflops=peak / 1e12,
                   mfu=round(flops * tokens / t_tr / (peak * jax.device_count()), 4))
    if args.trace_dir:
        name = f"train_{args.preset or 'tiny'}_{args.batch}x{args.seq}.json.gz"
        out.update(trace_one_call(ours, os.path.join(args.trace_dir, name)))
    if base is not None:
        ratios = [b / o for o, b in zip(t_ours, t_base)]
        t_b = float(np.median(t_base))
        out.update(baseline_step_s=round(t_b, 4),
                   baseline_step_s_range=[round(min(t_base), 4), round(max(t_base), 4)],
                   baseline_tokens_per_s=round(tokens / t_b, 1),
                   speedup=round(float(np.median(ratios)), 3),
                   speedup_range=[round(min(ratios), 3), round(max(ratios), 3)])
    return out


def padded_batch(args, vocab: int) -> dict:
    """``make_batch`` whose last ``--padding`` fraction of rows are padding, as
    ``rl.batch.place_rows`` leaves the rows of rejected groups (pad tokens, positions and
    segment ids 0, nothing trained)."""
    batch = make_batch(args.batch, args.seq, vocab)
    real = args.batch - int(round(args.batch * args.padding))
    for k in batch:
        batch[k][real:] = 0
    return batch


def padding(args) -> dict:
    """``Trainer.train`` (old-log-prob recompute + one update, as an RL step runs it) on a batch
    whose last ``--padding`` of rows are padding: ``skip_padding`` (real rows moved into the
    first micro-batches, all-padding ones skipped) vs computing every row, alternating
    ``--repeats`` timings of ``--steps`` steps from the same initial weights; the two end up
    with the same weights (``max_param_diff``)."""
    cfg = model_config(args, dtype_default="float32")
    batch = padded_batch(args, cfg.vocab_size)
    mesh = sharding_lib.make_mesh(1, -1, 1)

    def trainer(skip):
        return trainer_lib.Trainer(Qwen3(cfg, rngs=nnx.Rngs(0)),
                                   optim_lib.OptimConfig(learning_rate=1e-4, warmup_steps=0),
                                   loss_lib.LossConfig(),
                                   trainer_lib.TrainerConfig(micro_batch_size=args.micro,
                                                             skip_padding=skip), mesh=mesh)

    ours, base = trainer(True), trainer(False)
    runs = {id(ours): 0, id(base): 0}
    peaks = [memory_stats(compile_step(tr, tr.put_batch(batch), tr.cfg.skip_padding))["peak_bytes"]
             for tr in (ours, base)]

    def run(tr):
        def one():
            runs[id(tr)] += 1
            return tr.train(batch)["train/loss"]
        return one

    t_ours, t_base = [], []
    for _ in range(args.repeats):
        t_ours.append(timed(run(ours), args.steps))
        t_base.append(timed(run(base), args.steps))
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree.leaves(ours.state.params), jax.tree.leaves(base.state.params)))
    ratios = [b / o for o, b in zip(t_ours, t_base)]
    micro = args.micro or args.batch
    return {"bench": "trainer_padding", "device": str(jax.devices()[0].device_kind),
            "devices": jax.device_count(), "preset": args.preset or "tiny",
            "overrides": args.overrides, "batch": args.batch, "seq": args.seq,
            "micro_batch": micro, "micro_batches": args.batch // micro,
            "padding_fraction": args.padding,
            "padding_micro_batches_skipped": (args.batch - int((batch["loss_mask"].any(1)).sum()))
            // micro, "repeats": args.repeats, "updates_each": runs[id(ours)],
            "skip_step_s": round(float(np.median(t_ours)), 4),
            "skip_step_s_range": [round(min(t_ours), 4), round(max(t_ours), 4)],
            "all_rows_step_s": round(float(np.median(t_base)), 4),
            "all_rows_step_s_range": [round(min(t_base), 4), round(max(t_base), 4)],
            "speedup": round(float(np.median(ratios)), 3),
            "speedup_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "max_param_diff": diff, "skip_peak_bytes": peaks[0], "all_rows_peak_bytes": peaks[1]}


def growth(values: dict) -> float | None:
    """Largest ratio between consecutive lengths' values, per doubling of the length (None for
    one length: nothing to compare)."""
    keys = sorted(values)
    ratios = [(values[b] / values[a]) ** (1.0 / np.log2(b / a)) for a, b in zip(keys, keys[1:])]
    return round(max(ratios), 3) if ratios else None


def memory_scan(args) -> dict:
    """Peak memory of one train step (1 row) per row length, ours vs the step before this
    change (dense [T, T] mask, full [T, V] logits), on a small Qwen3 shape with the real
    vocabulary. Ours also runs, once per length after compiling, to show it fits."""
    lengths = [int(x) for x in args.lengths.split(",")]
    vocab = args.vocab or 151936
    cfg = model_config(args, dtype_default="float32", vocab_size=vocab)
    res = {"bench": "trainer_memory_scan", "device": jax.devices()[0].device_kind,
           "preset": args.preset or "tiny", "vocab": vocab, "layers": cfg.num_hidden_layers,
           "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
           "dtype": jnp.dtype(cfg.dtype).name, "remat": cfg.remat_policy, "rows": 1,
           "attention": cfg.packed_attention, "vocab_chunk_len": cfg.vocab_chunk_len}
    peak, temp, tps, base_peak, base_temp = {}, {}, {}, {}, {}
    for t in lengths:
        batch = make_batch(1, t, vocab)
        if not args.no_baseline:
            old = single_device_trainer(cfg.replace(packed_attention="dense"))
            with previous_train_step():
                old_mem = memory_stats(compile_step(old, old.put_batch(batch)))
            base_peak[t], base_temp[t] = old_mem["peak_bytes"], old_mem["temp_bytes"]
            del old
        tr = single_device_trainer(cfg)
        g = tr.put_batch(batch)
        mem = memory_stats(compile_step(tr, g))
        peak[t], temp[t] = mem["peak_bytes"], mem["temp_bytes"]
        step = tr.step_fn(1)
        with jax.set_mesh(tr.mesh):
            tr.state, m = step(tr.state, g, jnp.float32(0.0))  # compile + first run
            jax.block_until_ready(m)
            t0 = time.perf_counter()
            tr.state, m = step(tr.state, g, jnp.float32(0.0))
            loss = float(jax.device_get(m["loss"]))
        tps[t] = round(t / (time.perf_counter() - t0), 1)
        if not np.isfinite(loss):
            raise RuntimeError(f"non-finite loss at T={t}")
        del tr, g
        print(f"T={t}: peak {peak[t] / GB:.3f} GB (temp {temp[t] / GB:.3f}), "
              f"before {base_peak.get(t, 0) / GB:.3f} GB, {tps[t]} tokens/s", file=sys.stderr)
    res.update(peak_bytes=peak, temp_bytes=temp, growth_per_doubling_max=growth(peak),
               temp_growth_per_doubling_max=growth(temp), tokens_per_s=tps,
               ran_lengths=sorted(tps))
    if base_peak:
        res.update(before_peak_bytes=base_peak, before_temp_bytes=base_temp,
                   before_growth_per_doubling_max=growth(base_peak))
    return res


# ---------------------------------------------------------------------------------------------
# --plan: per-device memory at the paper's scale
# ---------------------------------------------------------------------------------------------
def abstract_train_step(cfg: ModelConfig, mesh, rows: int, seq: int, grads_only: bool = False):
    """The Trainer's step for ``cfg`` on ``mesh``, compiled from shapes alone (no parameter is
    allocated): (compiled, abstract params, their shardings, abstract opt state, shardings).

    ``grads_only``: the step's forward and backward alone (its micro-batch scan summing the
    float32 gradient, which is the output), without the optimizer update: XLA's temp is then
    the activations and nothing else (``plan_one``)."""
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    # LoRA: the adapters train, the bf16 base is an argument (as Trainer.step_fn passes it)
    graphdef, params, frozen = nnx.split(abstract, nnx.LoRAParam if cfg.lora_rank else nnx.Param, ...)
    # XLA:CPU has no bf16 GEMM: it converts the bf16 base to float32, a convert it hoists out of
    # the layer loop as an f32 copy of the stacked weights (4 bytes per base parameter in temp)
    # that GPUs and TPUs, which multiply in bf16, never make. Compiling with a float32 base
    # leaves temp = activations + the adapters' gradients; plan_one counts the base at bf16.
    frozen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
                          if jnp.issubdtype(x.dtype, jnp.floating) else x, frozen)
    optimizer = optim_lib.make_optimizer(optim_lib.OptimConfig())
    param_sh = sharding_lib.state_shardings(params, mesh)
    frozen_sh = sharding_lib.state_shardings(frozen, mesh)
    replicated = NamedSharding(mesh, P())
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_sh = optax.tree_utils.tree_map_params(optimizer, lambda _, s: s, opt_state, param_sh,
                                              transform_non_params=lambda _: replicated)
    state = trainer_lib.TrainState(params, opt_state, jax.ShapeDtypeStruct((), jnp.int32))
    state_sh = trainer_lib.TrainState(param_sh, opt_sh, replicated)
    batch_sh = sharding_lib.batch_sharding(mesh)
    micro_loss = loss_lib.policy_micro_loss(loss_lib.LossConfig())
    keys = micro_loss.keys
    batch = {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32 if k in ("tokens", "positions",
                                     "segment_ids") else jnp.float32) for k in keys}
    micro_sh = NamedSharding(mesh, P(None, *batch_sh.spec))
    def step(rest, state, batch, denom):
        return trainer_lib.make_train_step(graphdef, rest, optimizer, micro_loss, 1, None, micro_sh)(
            state, batch, denom)

    def grads_step(rest, params, batch, denom):  # make_train_step's scan, without the update
        def loss_of(p, micro):
            logprobs, entropy = trainer_lib.forward_logprobs(graphdef, rest, p, micro, None,
                                                             micro_loss.with_entropy)
            return micro_loss.fn(logprobs, entropy, micro, denom)

        grad_fn = jax.value_and_grad(loss_of, has_aux=True)
        micros = jax.lax.with_sharding_constraint(
            {k: trainer_lib.split_micro_batches(v, 1) for k, v in batch.items()}, micro_sh)

        def accumulate(grads, micro):
            return jax.tree.map(jnp.add, grads, grad_fn(params, micro)[1]), None
        return jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), micros)[0]

    if grads_only:
        jitted = jax.jit(grads_step, in_shardings=(frozen_sh, param_sh, {k: batch_sh for k in keys},
                                                   replicated), out_shardings=param_sh)
        args = (frozen, params)
    else:
        jitted = jax.jit(step, in_shardings=(frozen_sh, state_sh, {k: batch_sh for k in keys}, replicated),
                         out_shardings=(state_sh, replicated), donate_argnums=(1,))
        args = (frozen, state)
    with jax.set_mesh(mesh):
        compiled = jitted.lower(*args, batch, jax.ShapeDtypeStruct((), jnp.float32)).compile()
    return compiled, params, param_sh, opt_state, opt_sh


def plan_one(name: str, mesh_name: str, args) -> dict:
    """Per-device GB of params, optimizer, gradients, activations and rollout KV for the train
    step of ``name`` at ``args.plan_seq`` on ``mesh_name``, and whether it fits."""
    n_dev, hbm_gb, axes, usable_frac = PLAN_MESHES[mesh_name]
    devices = jax.devices()[:n_dev]
    mesh = sharding_lib.make_mesh(*axes, devices=devices)
    dp = axes[0] * axes[1]
    rows = args.micro_rows * dp
    remat = args.remat or "full"
    full = ModelConfig.preset(name, dtype=jnp.bfloat16, remat_policy=remat,
                              packed_attention="blockwise", lora_rank=args.lora_rank)
    # XLA's analysis of the real widths at depth 2 and 3; temp is linear in depth under
    # scan-over-layers, so depth L is extrapolated from the two. (Depth 1 is no use: XLA
    # simplifies a one-trip loop and assigns its buffers differently.) Two programs: the whole
    # step (its temp at its peak: the train peak) and its forward and backward alone (temp =
    # the activations). The step's temp is gradient + activations only where the backward pass
    # is its peak: its optimizer update computes the new AdamW moments (and the updates, in the
    # gradient's place) beside the old ones before the non-finite guard's branch picks them,
    # 3 x the trained float32 bytes, the peak of a 1-device step whenever the moments outweigh
    # the activations (step temp - gradient then came out as the optimizer's bytes exactly, and
    # the plan printed that as the activations).
    def extrapolated(grads_only):
        temps = [memory_stats(abstract_train_step(full.replace(num_hidden_layers=depth), mesh, rows,
                                                  args.plan_seq, grads_only)[0])["temp_bytes"]
                 for depth in (2, 3)]
        return temps[0] + (full.num_hidden_layers - 2) * (temps[1] - temps[0]), temps[1] - temps[0]
    temp_full, _ = extrapolated(False)
    act_bytes, per_layer_act = extrapolated(True)
    act_bytes = max(act_bytes, 0)
    # params / optimizer / gradients of the full depth: shapes (jax.eval_shape) x shardings
    abstract = nnx.eval_shape(lambda: Qwen3(full, rngs=nnx.Rngs(0)))
    _, params, frozen = nnx.split(abstract, nnx.LoRAParam if full.lora_rank else nnx.Param, ...)
    param_sh = sharding_lib.state_shardings(params, mesh)
    optimizer = optim_lib.make_optimizer(optim_lib.OptimConfig())
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_sh = optax.tree_utils.tree_map_params(optimizer, lambda _, s: s, opt_state, param_sh,
                                              transform_non_params=lambda _: NamedSharding(mesh, P()))
    trained_bytes = per_device_bytes(params, param_sh)
    frozen_bytes = per_device_bytes(frozen, sharding_lib.state_shardings(frozen, mesh))
    p_bytes = trained_bytes + frozen_bytes  # resident weights: trained (f32) + frozen base (LoRA: bf16)
    o_bytes = per_device_bytes(opt_state, opt_sh)
    g_bytes = trained_bytes  # the f32 gradient accumulator of the micro-batch scan
    # the step's peak in its optimizer update, if there, beyond the gradient: the new moments
    # and the updates (0 where the backward pass is the peak, the update hidden under it)
    update_bytes = temp_full - g_bytes if temp_full - g_bytes > 1.001 * act_bytes else 0
    kv_token = full.num_hidden_layers * 2 * full.num_key_value_heads * full.head_dim * 2  # bf16
    kv_slot = kv_token * args.plan_seq
    kv_bytes = args.kv_slots * kv_slot
    # the engine's bf16 copy of the (merged) weights, tensor-sharded like the base
    count_serving = bool(args.lora_rank or args.serving_copy)
    serving_bytes = full.num_params * 2 // max(axes[2], 1) if count_serving else 0
    # what the engine holds through the update unless serving.release_during_update frees it
    held_in_update = serving_bytes + kv_bytes if count_serving and not args.release_serving else 0
    usable = usable_frac * hbm_gb * GB
    train_peak = p_bytes + o_bytes + g_bytes + max(act_bytes, update_bytes) + held_in_update
    # colocated: weights and optimizer stay resident next to the serving copy and the KV pool
    rollout_peak = p_bytes + o_bytes + serving_bytes + kv_bytes
    max_slots = int(max(usable - p_bytes - o_bytes - serving_bytes, 0) // kv_slot)
    problems = []
    lora_hint = "" if full.lora_rank else " or train LoRA adapters only (--config.model.lora_rank=16)"
    if p_bytes + o_bytes + g_bytes > usable:
        problems.append(f"params+optimizer+grads alone need {(p_bytes + o_bytes + g_bytes) / GB:.1f} GB "
                        f"of {usable / GB:.0f} GB: shard over more devices (a larger mesh, fsdp) or "
                        f"add tensor parallelism (--config.mesh.tensor){lora_hint}")
    elif update_bytes and p_bytes + o_bytes + g_bytes + update_bytes + held_in_update > usable:
        fixes = ["shard over more devices (a larger mesh, fsdp) or add tensor parallelism "
                 f"(--config.mesh.tensor){lora_hint}"]
        if held_in_update and p_bytes + o_bytes + g_bytes + update_bytes <= usable:
            fixes.insert(0, "free the serving copy and KV during the update (--config.serving."
                            "release_during_update=true, --release-serving here)")
        problems.append(f"train step needs {train_peak / GB:.1f} GB of {usable / GB:.0f} GB: the "
                        f"optimizer update holds {update_bytes / GB:.1f} GB of new AdamW moments and "
                        "updates beside the weights, moments and gradients, whatever the rows; "
                        + "; or ".join(fixes))
    elif train_peak > usable:
        per_row = act_bytes / args.micro_rows
        rows_fit = int(max(usable - p_bytes - o_bytes - g_bytes - held_in_update, 0) // per_row)
        fixes = [f"at most {rows_fit} row(s) per device per micro-step fit "
                 f"(trainer.micro_batch_size = {rows_fit} x data x fsdp)" if rows_fit else
                 "not even one row fits: shorter rows or tensor parallelism (--config.mesh.tensor)"]
        if remat != "full":
            fixes.append(f"model.remat_policy=full (now {remat})")
        if held_in_update:
            released = int(max(usable - p_bytes - o_bytes - g_bytes, 0) // per_row)
            fixes.insert(0, "free the serving copy and KV during the update (--config.serving."
                            f"release_during_update=true, --release-serving here): then {released} row(s) fit")
        problems.append(f"train step needs {train_peak / GB:.1f} GB of {usable / GB:.0f} GB: "
                        f"activations {act_bytes / GB:.1f} GB for {args.micro_rows} row(s) of "
                        f"{args.plan_seq} tokens per device; " + "; or ".join(fixes))
    if rollout_peak > usable:
        problems.append(f"rollout KV for {args.kv_slots} slots x {args.plan_seq} tokens "
                        f"({kv_bytes / GB:.1f} GB) does not fit next to the weights"
                        f"{', the serving copy' if serving_bytes else ''} and optimizer: at most "
                        f"{max_slots} concurrent rollouts per device (--config.serving.num_slots)")
    r = lambda x: round(x / GB, 2)
    return {"model": name, "mesh": mesh_name, "devices": n_dev, "mesh_axes": axes,
            "hbm_gb": hbm_gb, "usable_gb": r(usable), "seq": args.plan_seq,
            "rows_per_device": args.micro_rows, "remat": remat, "lora_rank": full.lora_rank,
            "trained_params": int(sum(x.size for x in jax.tree.leaves(params))),
            "params_gb": r(p_bytes), "frozen_gb": r(frozen_bytes), "optimizer_gb": r(o_bytes), "grads_gb": r(g_bytes),
            "serving_copy_gb": r(serving_bytes), "serving_released_in_update": bool(args.release_serving),
            "activations_gb": r(act_bytes), "activations_per_layer_gb": r(per_layer_act),
            "update_gb": r(update_bytes),
            "train_peak_gb": r(train_peak), "rollout_kv_gb": r(kv_bytes),
            "kv_slots": args.kv_slots, "kv_per_slot_gb": r(kv_slot),
            "max_kv_slots": max_slots, "rollout_peak_gb": r(rollout_peak),
            "fits": not problems, "problems": problems}


def plan(args) -> dict:
    plans = []
    for mesh_name in args.meshes.split(","):
        if mesh_name not in PLAN_MESHES:
            raise SystemExit(f"unknown mesh {mesh_name!r}; known: {sorted(PLAN_MESHES)}")
        for name in args.models.split(","):
            p = plan_one(name, mesh_name, args)
            status = "fits" if p["fits"] else "DOES NOT FIT: " + "; ".join(p["problems"])
            print(f"{name} on {mesh_name}: train {p['train_peak_gb']} GB (params "
                  f"{p['params_gb']}, optimizer {p['optimizer_gb']}, grads {p['grads_gb']}, "
                  f"activations {p['activations_gb']}"
                  + (f", update {p['update_gb']}" if p["update_gb"] else "") +
                  f"), rollout {p['rollout_peak_gb']} GB "
                  f"(KV {p['rollout_kv_gb']}) of {p['usable_gb']} GB usable: {status}",
                  file=sys.stderr)
            plans.append(p)
    return {"bench": "trainer_plan", "method": "XLA:CPU memory analysis at depth 2 and 3 on a "
            "simulated mesh, extrapolated in depth, of the step (train peak) and of its forward and "
            "backward alone (activations); params/optimizer from jax.eval_shape",
            "plans": plans, "all_fit": all(p["fits"] for p in plans)}


def max_len(args) -> dict:
    """Largest multiple of 1024 whose 1-row train step fits ``--hbm-gb`` on one device, by
    bisection on XLA's memory analysis of the compiled step (compile only)."""
    cfg = model_config(args, preset_default="qwen3-1.7b", remat_policy=args.remat or "full")
    mesh = sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    budget = 0.95 * args.hbm_gb * GB

    def peak(seq):
        compiled = abstract_train_step(cfg, mesh, 1, seq)[0]
        return memory_stats(compiled)["peak_bytes"]

    lo, hi = 1, 256  # in units of 1024 tokens
    if peak(lo * 1024) > budget:
        return {"bench": "trainer_max_len", "max_len": 0, "hbm_gb": args.hbm_gb}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid * 1024) <= budget else (lo, mid)
    return {"bench": "trainer_max_len", "device": jax.devices()[0].device_kind,
            "preset": args.preset or "qwen3-1.7b", "remat": cfg.remat_policy,
            "dtype": jnp.dtype(cfg.dtype).name, "hbm_gb": args.hbm_gb, "max_len": lo * 1024,
            "peak_gb_at_max": round(peak(lo * 1024) / GB, 2)}


def main():
    if ARGS.memory_scan:
        out = memory_scan(ARGS)
    elif ARGS.plan:
        out = plan(ARGS)
    elif ARGS.max_len:
        out = max_len(ARGS)
    elif ARGS.padding is not None:
        out = padding(ARGS)
    else:
        out = speed(ARGS)
    print(json.dumps(out))
    if ARGS.plan and not out["all_fit"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Non-reasoning SFT (rStar2-Agent §4.1, §5.1): chat records with tool calls, loss on the
assistant's tokens only, packed sequences, AdamW with 4 % linear warmup then cosine decay.

Records are OpenAI-style ``{"messages": [...]}`` (assistant ``tool_calls``, ``role="tool"``
results) rendered by ``models.chat_template`` exactly as the rollout tokenizes them turn by turn,
so SFT trains on the same ids RL later samples. Training reuses the RL machinery: the
``Trainer``'s sharded ``TrainState`` on the same mesh, Orbax checkpoints (``rl.checkpoint``,
so RL's ``checkpoint.init_from`` can start from an SFT run) and the metrics writer.

Packing: each optimizer step takes ``batch_size`` conversations (the paper's 128), packs them
first-fit into rows of ``seq_len`` tokens (``rl.batch.pack_first_fit``; ``positions`` restart
and ``segment_ids`` separate the conversations), and pads to one fixed row count computed over
the whole run, so the step compiles once. The loss is the mean NLL over every assistant token of
the step (token-mean over the batch, as verl's SFT trainer).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rstarjax.models import chat_template as ct
from rstarjax.rl import loss as loss_lib
from rstarjax.rl.batch import pack_first_fit
from rstarjax.rl.trainer import Trainer, TrainerConfig, TrainState, cast_floating, split_micro_batches

log = logging.getLogger(__name__)

SFT_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """rStar2-Agent §5.1: 3 epochs, lr 5e-6, 4 % warm-up, cosine decay, batch 128."""

    epochs: int = 3
    batch_size: int = 128  # conversations per optimizer step
    learning_rate: float = 5e-6
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0  # cosine decays to learning_rate * min_lr_ratio
    weight_decay: float = 0.01
    grad_clip_norm: float = 1.0
    seq_len: int = 4096  # packed row length; longer conversations are dropped (and counted)
    micro_batch_size: int = 0  # rows per gradient-accumulation micro-step; 0 = all rows at once
    max_steps: int = 0  # > 0: stop early (CI / demo); the schedule still spans max_steps
    seed: int = 0
    compute_dtype: str | None = None

    def __post_init__(self):
        for name in ("epochs", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"sft.learning_rate must be > 0, got {self.learning_rate}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"sft.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")

    @classmethod
    def from_config(cls, c) -> "SFTConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(c).items() if k in names})


# ---- data ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class SFTExample:
    ids: np.ndarray  # int32[n]
    mask: np.ndarray  # bool[n]: True where the model generated the token (loss on it)


def load_conversations(path: str) -> list[list[dict]]:
    """``{"messages": [...]}`` rows of a jsonl / json / parquet file. Rows without a message list
    raise (SFT data is curated: a silently skipped row is lost training signal)."""
    from rstarjax.rl.data import read_rows

    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"SFT data file {path!r} does not exist (set --config.sft.data_path)")
    rows, bad = read_rows(path)
    if bad:
        raise ValueError(f"{path}: {sum(bad.values())} line(s) are not valid JSON")
    out = []
    for i, row in enumerate(rows):
        msgs = row.get("messages") if isinstance(row, Mapping) else None
        if isinstance(msgs, str):  # parquet exports sometimes store the list as a JSON string
            msgs = json.loads(msgs)
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{path}: row {i} has no 'messages' list")
        out.append(msgs)
    if not out:
        raise ValueError(f"{path}: no conversations")
    return out


def encode_examples(tokenizer, conversations: Sequence[Sequence[Mapping[str, Any]]], seq_len: int,
                    fmt: ct.ChatFormat = ct.RSTAR2) -> tuple[list[SFTExample], dict[str, int]]:
    """Tokenize with the chat template (assistant mask = loss mask). Conversations longer than
    ``seq_len`` or without any assistant token are dropped and counted in the returned stats."""
    examples, stats = [], {"too_long": 0, "no_assistant_tokens": 0}
    for i, msgs in enumerate(conversations):
        try:
            enc = ct.encode_conversation(tokenizer, msgs, fmt=fmt)
        except (ValueError, TypeError) as e:
            raise ValueError(f"conversation {i}: {e}") from e
        if len(enc.ids) > seq_len:
            stats["too_long"] += 1
            continue
        if not enc.assistant_mask.any():
            stats["no_assistant_tokens"] += 1
            continue
        # The first token is template text, so a packed boundary is never a training target.
        assert not enc.assistant_mask[0]
        examples.append(SFTExample(enc.ids, enc.assistant_mask))
    if stats["too_long"] or stats["no_assistant_tokens"]:
        log.warning("SFT: dropped %s of %d conversations", stats, len(conversations))
    if not examples:
        raise ValueError(f"no usable SFT conversation (of {len(conversations)}; {stats}); raise sft.seq_len?")
    return examples, stats


def plan_batches(lengths: Sequence[int], batch_size: int, epochs: int, seq_len: int, seed: int) -> list[list[list[int]]]:
    """Per optimizer step, the packed rows (lists of example indices). Each epoch is a fresh
    permutation cut into ``batch_size`` chunks (the last one may be smaller); deterministic in
    ``seed`` so a resumed run replays the same plan."""
    plan = []
    n = len(lengths)
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(n)
        for start in range(0, n, batch_size):
            chunk = order[start:start + batch_size]
            rows = pack_first_fit([lengths[i] for i in chunk], seq_len)
            plan.append([[int(chunk[j]) for j in row] for row in rows])
    return plan


def pack_rows(examples: Sequence[SFTExample], rows: Sequence[Sequence[int]], num_rows: int, seq_len: int,
              pad_id: int) -> dict[str, np.ndarray]:
    """Packed [num_rows, seq_len] arrays (design.md TrainBatch layout: column t holds target t)."""
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} packed rows do not fit the fixed {num_rows}")
    tokens = np.full((num_rows, seq_len), pad_id, np.int32)
    positions = np.zeros((num_rows, seq_len), np.int32)
    segment_ids = np.zeros((num_rows, seq_len), np.int32)
    loss_mask = np.zeros((num_rows, seq_len), np.float32)
    for r, row in enumerate(rows):
        col = 0
        for seg, i in enumerate(row, start=1):
            ex = examples[i]
            n = len(ex.ids)
            if col + n > seq_len:
                raise ValueError(f"row {r} overflows seq_len={seq_len}")
            tokens[r, col:col + n] = ex.ids
            positions[r, col:col + n] = np.arange(n)
            segment_ids[r, col:col + n] = seg
            loss_mask[r, col:col + n] = ex.mask
            col += n
    return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids, "loss_mask": loss_mask}


# ---- schedule and loss ---------------------------------------------------------------------------
def warmup_steps_for(total_steps: int, warmup_ratio: float) -> int:
    """verl's SFT trainer: int(warmup_ratio * total_steps)."""
    return int(warmup_ratio * total_steps)


def sft_learning_rate(step, total_steps: int, peak_lr: float, warmup_ratio: float = 0.04,
                      min_lr_ratio: float = 0.0):
    """rStar2-Agent §5.1 SFT schedule: linear warm-up over ``warmup_ratio`` of the steps, then
    cosine decay to ``peak_lr * min_lr_ratio``.

    Exactly verl's / transformers' ``get_cosine_schedule_with_warmup`` (LambdaLR semantics: the
    update after ``step`` previous updates uses lr(step); warm-up starts at 0), so a run here can
    be compared with a verl SFT run step for step. Works on Python numbers and jax scalars (it is
    the optax schedule)."""
    warmup = warmup_steps_for(total_steps, warmup_ratio)
    step = jnp.asarray(step, jnp.float32)
    warm = step / max(warmup, 1)
    progress = (step - warmup) / max(total_steps - warmup, 1)
    cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    frac = jnp.where(step < warmup, warm, jnp.maximum(0.0, cosine))
    return peak_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * frac)


def make_sft_optimizer(cfg: SFTConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = lambda s: sft_learning_rate(s, total_steps, cfg.learning_rate, cfg.warmup_ratio, cfg.min_lr_ratio)
    adamw = optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=cfg.weight_decay)
    if cfg.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
    return adamw


def masked_nll_sum(logprobs: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Sum over trained tokens of -log pi(token | prefix)."""
    return -jnp.sum(logprobs * loss_mask)


def make_sft_step(graphdef, rest, optimizer, num_micro: int, compute_dtype=None, micro_sharding=None):
    """Pure ``(TrainState, batch) -> (TrainState, metrics)``: token-mean NLL over the whole batch,
    gradients accumulated over ``num_micro`` micro-batches (exact: the denominator is global)."""

    def micro_loss(params, micro, denom):
        if compute_dtype is not None:
            params = cast_floating(params, compute_dtype)
        model = nnx.merge(graphdef, params, rest)
        logp, _ = model.token_logprobs(micro["tokens"], positions=micro["positions"],
                                       segment_ids=micro["segment_ids"], with_entropy=False)
        nll = masked_nll_sum(logp, micro["loss_mask"])
        return nll / denom, nll

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch):
        denom = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
        micros = {k: split_micro_batches(batch[k], num_micro) for k in SFT_KEYS}
        if micro_sharding is not None:
            micros = jax.lax.with_sharding_constraint(micros, micro_sharding)

        def body(carry, micro):
            grads, loss = carry
            (l, _), g = grad_fn(state.params, micro, denom)
            return (jax.tree.map(jnp.add, grads, g), loss + l), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        (grads, loss), _ = jax.lax.scan(body, (zeros, jnp.float32(0.0)), micros)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "tokens": denom}
        return TrainState(params, opt_state, state.step + 1), metrics

    return step


# ---- the trainer ---------------------------------------------------------------------------------
class SFTTrainer:
    """The RL ``Trainer``'s sharded state and mesh with the SFT step and optimizer."""

    def __init__(self, model: nnx.Module, cfg: SFTConfig, total_steps: int, num_rows: int, mesh=None):
        self.cfg = cfg
        self.total_steps = total_steps
        self.optimizer = make_sft_optimizer(cfg, total_steps)
        self.trainer = Trainer(model, None, loss_lib.LossConfig(),
                               TrainerConfig(micro_batch_size=cfg.micro_batch_size,
                                             compute_dtype=cfg.compute_dtype),
                               mesh=mesh, optimizer=self.optimizer)
        self.num_rows = num_rows
        t = self.trainer
        num_micro = t._num_micro(num_rows)
        step = make_sft_step(t.graphdef, t.rest, self.optimizer, num_micro, cfg.compute_dtype, t._micro_sharding())
        shardings = {k: t.batch_sharding for k in SFT_KEYS}
        self._step = jax.jit(step, in_shardings=(t.state_sharding, shardings),
                             out_shardings=(t.state_sharding, t.replicated), donate_argnums=(0,))

    @property
    def state(self) -> TrainState:
        return self.trainer.state

    @state.setter
    def state(self, value: TrainState) -> None:
        self.trainer.state = value

    @property
    def step(self) -> int:
        return self.trainer.step

    def train_step(self, arrays: Mapping[str, np.ndarray]) -> dict[str, float]:
        t = self.trainer
        batch = {k: jax.device_put(np.asarray(arrays[k]), t.batch_sharding) for k in SFT_KEYS}
        lr = float(sft_learning_rate(self.step, self.total_steps, self.cfg.learning_rate,
                                     self.cfg.warmup_ratio, self.cfg.min_lr_ratio))
        with jax.set_mesh(t.mesh):
            t.state, m = self._step(t.state, batch)
        m = jax.device_get(m)
        return {"sft/loss": float(m["loss"]), "sft/grad_norm": float(m["grad_norm"]),
                "sft/tokens": float(m["tokens"]), "sft/lr": lr}

    def model(self) -> nnx.Module:
        return self.trainer.model()


def fixed_num_rows(plan: Sequence[Sequence[Sequence[int]]], multiple: int) -> int:
    """One row count for every step (one compile): the most any step needs, rounded up."""
    most = max(len(rows) for rows in plan)
    return -(-most // multiple) * multiple


def train_sft(model: nnx.Module, tokenizer, conversations, cfg: SFTConfig, *, mesh=None,
              fmt: ct.ChatFormat = ct.RSTAR2, workdir: str | None = None, checkpoint_cfg=None,
              meta: Mapping[str, Any] | None = None, metrics_writer=None, log_every: int = 10,
              ) -> tuple[SFTTrainer, dict[str, Any]]:
    """Train ``model`` on ``conversations``; returns the trainer (``.model()`` is the SFT policy)
    and a summary. With ``workdir`` + ``checkpoint_cfg`` it checkpoints every ``every_steps``
    and at the end, and resumes from the latest checkpoint there."""
    from rstarjax.rl import checkpoint as ckpt_lib

    examples, drop_stats = encode_examples(tokenizer, conversations, cfg.seq_len, fmt)
    plan = plan_batches([len(e.ids) for e in examples], cfg.batch_size, cfg.epochs, cfg.seq_len, cfg.seed)
    if cfg.max_steps:
        plan = plan[:cfg.max_steps]
    total = len(plan)
    # rows: a multiple of the data-parallel devices and of the micro-batch (one compiled shape)
    dp = mesh.shape["data"] * mesh.shape["fsdp"] if mesh is not None else len(jax.devices())
    multiple = math.lcm(cfg.micro_batch_size or 1, dp)
    num_rows = fixed_num_rows(plan, multiple)
    trainer = SFTTrainer(model, cfg, total, num_rows, mesh=mesh)

    ckpt = None
    start = 0
    if workdir and checkpoint_cfg is not None:
        ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), checkpoint_cfg)
        if ckpt.latest_step() is not None:
            t = trainer.trainer
            state, _ = ckpt.restore(ckpt_lib.abstract_like(t.state, t.state_sharding))
            trainer.state = state
            start = trainer.step
            log.info("SFT: resumed at step %d of %d", start, total)
    base_meta = dict(meta or {})
    base_meta.update(stage="sft", total_steps=total)
    t0 = time.time()
    last: dict[str, float] = {}
    losses = []
    for s in range(start, total):
        arrays = pack_rows(examples, plan[s], num_rows, cfg.seq_len, tokenizer.pad_id)
        last = trainer.train_step(arrays)
        losses.append(last["sft/loss"])
        last["sft/epoch"] = (s + 1) * cfg.epochs / max(total, 1) if not cfg.max_steps else float("nan")
        if metrics_writer is not None:
            metrics_writer.write(s + 1, last)
        if log_every and ((s + 1) % log_every == 0 or s + 1 == total):
            log.info("sft step %d/%d loss %.4f lr %.2e", s + 1, total, last["sft/loss"], last["sft/lr"])
        if ckpt is not None and ckpt.should_save(s + 1, total):
            ckpt.save(s + 1, trainer.state, base_meta)
    if ckpt is not None:
        ckpt.close()
    summary = {"steps": total, "examples": len(examples), "dropped": drop_stats, "rows_per_step": num_rows,
               "final_loss": losses[-1] if losses else float("nan"), "first_loss": losses[0] if losses else float("nan"),
               "seconds": time.time() - t0}
    return trainer, summary


# ---- entry point -----------------------------------------------------------------------------------
def chat_format(name: str) -> ct.ChatFormat:
    formats = {"rstar2": ct.RSTAR2, "compact": ct.COMPACT}
    if name not in formats:
        raise ValueError(f"chat_format must be one of {sorted(formats)}, got {name!r}")
    return formats[name]


def build_tokenizer(config):
    """The tokenizer of ``config.model``: ``tokenizer_num_regular_tokens`` > 0 picks a
    small-vocabulary variant; else the ``tokenizer.json`` in ``tokenizer_path`` (default
    ``hf_path``) says which (so an exported small model reloads with its own); else Qwen3's."""
    from rstarjax.models.tokenizer import load_tokenizer_for

    m = config.model
    path = m.get("tokenizer_path", "") or ("" if m.get("random_init", False) else m.get("hf_path", ""))
    return load_tokenizer_for(path, int(m.get("tokenizer_num_regular_tokens", 0) or 0))


def check_vocab(model, tokenizer) -> None:
    """The model must have an embedding row for every token the tokenizer can produce."""
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model only {model.config.vocab_size} "
                         "embedding rows: set --config.model.tokenizer_num_regular_tokens (or "
                         "--config.model.tokenizer_path) to the model's tokenizer")


def build_model(config, mesh, tokenizer=None):
    """The policy to fine-tune: ``model.hf_path`` (a HF checkpoint) or, with ``model.random_init``,
    a fresh ``model.preset`` whose vocabulary is sized to the tokenizer (the demo's small-vocab
    model; ``rl.trainer.build_model`` keeps the preset's vocabulary, hence this variant)."""
    from rstarjax.models import ModelConfig, Qwen3, load_hf
    from rstarjax.models.sharding import shard_model

    dtype = jnp.dtype(config.model.dtype)
    if not config.model.get("random_init", False):
        if not config.model.hf_path:
            raise ValueError("set --config.model.hf_path=DIR (a HF Qwen3 checkpoint), or "
                             "--config.model.random_init=True to train a freshly initialised model.preset")
        return load_hf(config.model.hf_path, dtype=dtype, mesh=mesh)
    overrides = {"dtype": dtype}
    if tokenizer is not None:
        overrides.update(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.endoftext_id,
                         eos_token_id=tokenizer.eos_id)
    cfg = ModelConfig.preset(config.model.preset, **overrides)
    model = Qwen3(cfg, rngs=nnx.Rngs(int(config.seed)))
    return shard_model(model, mesh)


def model_meta(model, tokenizer) -> dict[str, Any]:
    """What ``rstarjax.export`` needs to rebuild the model from a checkpoint alone."""
    check_vocab(model, tokenizer)
    return {"model_config": model.config.to_hf_dict(),
            "tokenizer_num_regular_tokens": int(tokenizer.num_regular_tokens)}


def run_sft(config, workdir: str) -> dict[str, Any]:
    """``mode=sft``: fine-tune config.model on config.sft.data_path; checkpoints and metrics in
    ``workdir``; with ``sft.export_hf`` also a HF directory ``workdir/hf``."""
    from rstarjax.models import save_hf
    from rstarjax.models.sharding import make_mesh
    from rstarjax.rl import checkpoint as ckpt_lib
    from rstarjax.rl.metrics import MetricsWriter

    os.makedirs(workdir, exist_ok=True)
    cfg = SFTConfig.from_config(config.sft)
    mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    tokenizer = build_tokenizer(config)
    conversations = load_conversations(config.sft.data_path)
    model = build_model(config, mesh, tokenizer)
    with MetricsWriter(os.path.join(workdir, "logs"), enabled=jax.process_index() == 0,
                       tensorboard=config.logging.tensorboard) as mw:  # where RL writes its metrics too
        trainer, summary = train_sft(
            model, tokenizer, conversations, cfg, mesh=mesh, fmt=chat_format(config.sft.chat_format),
            workdir=workdir, checkpoint_cfg=ckpt_lib.CheckpointConfig.from_config(config.checkpoint),
            meta=model_meta(model, tokenizer), metrics_writer=mw)
    if config.sft.get("export_hf", False):
        save_hf(trainer.model(), os.path.join(workdir, "hf"), tokenizer=tokenizer)
    with open(os.path.join(workdir, "sft_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary

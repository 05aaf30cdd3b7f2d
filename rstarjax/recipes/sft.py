"""Non-reasoning SFT (rStar2-Agent §4.1, §5.1): chat records with tool calls, loss on the
assistant's tokens only, packed sequences, AdamW with 4 % linear warmup then cosine decay.

Records are OpenAI-style ``{"messages": [...]}`` (assistant ``tool_calls``, ``role="tool"``
results) rendered by ``models.chat_template`` exactly as the rollout tokenizes them turn by turn,
so SFT trains on the same ids RL later samples. Training is the trainer core's update
(``rl.trainer.Trainer.update``) with the masked NLL (``rl.loss.NLL``) on the same mesh, Orbax
checkpoints (``io.checkpoint``, so RL's ``checkpoint.init_from`` can start from an SFT run) and
the metrics log.

Packing: each optimizer step takes ``batch_size`` conversations (the paper's 128), packs them
first-fit into rows of ``seq_len`` tokens (``rl.batch.pack_first_fit`` / ``place_rows``:
``positions`` restart and ``segment_ids`` separate the conversations), and pads to one fixed row
count computed over the whole run, so the step compiles once. The loss is the mean NLL over every
assistant token of the step (token-mean over the batch, as verl's SFT trainer).

Data is curated: a row it cannot train as written (not JSON, no assistant turn, its own ``tools``,
a call to a tool the format does not offer, ...) stops the run naming FILE:ROW; conversations
longer than ``seq_len`` are dropped, and named in a warning (docs/data.md, docs/training.md "SFT").
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.io import files
from rstarjax.io.data import EXAMPLE_ROWS, BadRow, DataError, read_numbered_rows
from rstarjax.io.metrics_log import MetricsWriteError, MetricsWriter, read_metrics
from rstarjax.models import chat_template as ct
from rstarjax.models import save_hf
from rstarjax.recipes import build, lora_base, preemption
from rstarjax.recipes.config import RunConfig, SFTConfig, wandb_init_args
from rstarjax.rl import loss as loss_lib
from rstarjax.rl.batch import SEQUENCE_KEYS, pack_first_fit, place_rows
from rstarjax.rl.optim import adamw, cosine_with_warmup
from rstarjax.rl.trainer import NonFiniteStreak, Trainer, TrainerConfig, TrainState
from rstarjax.validation import StageError

log = logging.getLogger(__name__)


# ---- data ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class SFTExample:
    ids: np.ndarray  # int32[n]
    mask: np.ndarray  # bool[n]: True where the model generated the token (loss on it)


def conversation_rows(path: str, fmt: ct.ChatFormat = ct.RSTAR2) -> tuple[list[list[dict]], list[str]]:
    """``{"messages": [...]}`` rows of a jsonl / json / parquet file and where each is
    ("FILE:ROW"). Rows without a message list raise (SFT data is curated: a silently skipped row
    is lost training signal), so do lines that are not JSON (the first few named, with the
    parser's message) and rows whose own ``tools`` are not ``fmt``'s (``row_tools_mismatch``)."""
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"SFT data file {path!r} does not exist (set --config.sft.data_path)")
    out, where, bad = [], [], []
    for number, row in read_numbered_rows(path):
        if isinstance(row, BadRow):
            bad.append(f"{path}:{number} ({row.reason}: {row.detail})" if row.detail else f"{path}:{number} ({row.reason})")
            continue
        msgs = row.get("messages") if isinstance(row, Mapping) else None
        if isinstance(msgs, str):  # parquet exports sometimes store the list as a JSON string
            try:
                msgs = json.loads(msgs)
            except ValueError as e:
                raise DataError(f"{path}:{number}: 'messages' is a string that is not JSON ({e})") from None
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{path}:{number}: row has no 'messages' list")
        mismatch = row_tools_mismatch(row.get("tools"), fmt)
        if mismatch:
            raise DataError(f"{path}:{number}: {mismatch}")
        out.append(msgs)
        where.append(f"{path}:{number}")
    if bad:
        raise DataError(f"{path}: {len(bad)} line(s) are not valid JSON or not UTF-8: {first_rows(bad)}")
    if not out:
        raise DataError(f"{path}: no conversations")
    return out, where


def first_rows(rows: Sequence[str]) -> str:
    """The first ``EXAMPLE_ROWS`` of ``rows`` ("FILE:ROW"), and how many more there are."""
    more = len(rows) - EXAMPLE_ROWS
    return ", ".join(rows[:EXAMPLE_ROWS]) + (f" and {more} more" if more > 0 else "")


def row_tools_mismatch(tools: Any, fmt: ct.ChatFormat) -> str | None:
    """Why a row's own ``tools`` (the OpenAI / HF function-calling column) are not the tools
    ``fmt``'s prompts offer (``ct.offered_tools``), or None. SFT renders fmt's tools block whatever
    a row lists: a row with other tools would train calls to a tool its prompt never showed, and
    rendering the row's own would train prompts RL never shows (its rollouts offer fmt's python
    tool only). None or [] (a column every row of an export has) brings no tools of its own."""
    if isinstance(tools, str):  # parquet exports store nested columns as JSON strings too
        try:
            tools = json.loads(tools)
        except ValueError as e:
            return f"'tools' is a string that is not JSON ({e})"
    if tools is None or (isinstance(tools, list) and not tools):
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        return f"'tools' must be a list of function schemas, got {tools!r:.80}"
    theirs = [_function_of(t) for t in tools]
    ours = [_function_of(t) for t in ct.offered_tools(fmt)]
    if sorted(map(_canonical_json, theirs)) == sorted(map(_canonical_json, ours)):
        return None
    names = [f.get("name") for f in theirs]
    expected = [f.get("name") for f in ours]
    same_names = sorted(map(str, names)) == sorted(map(str, expected))
    return (f"the row's own 'tools' {names}{' (with other schemas)' if same_names else ''} are not the chat "
            f"format's {expected}: SFT prompts offer the format's tool only, as the RL rollouts do (drop the "
            "row's 'tools' and call that tool, or set --config.sft.chat_format to a format that offers them)")


def _function_of(tool: Mapping[str, Any]) -> Any:
    """A tool's function schema: ``{"type": "function", "function": {...}}`` or the bare function."""
    return tool.get("function", tool)


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def load_conversations(path: str, fmt: ct.ChatFormat = ct.RSTAR2) -> list[list[dict]]:
    """The conversations of ``conversation_rows``."""
    return conversation_rows(path, fmt)[0]


def multi_call_turns(messages: Sequence[Mapping[str, Any]]) -> int:
    """Assistant turns of ``messages`` that hold more than one tool call."""
    return sum(1 for m in messages
               if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list) and len(m["tool_calls"]) > 1)


def encode_examples(tokenizer, conversations: Sequence[Sequence[Mapping[str, Any]]], seq_len: int,
                    fmt: ct.ChatFormat = ct.RSTAR2, where: Sequence[str] | None = None,
                    ) -> tuple[list[SFTExample], dict[str, Any]]:
    """Tokenize with the chat template (assistant mask = loss mask). A conversation the template
    cannot render, or without an assistant message (nothing to train: a broken export, most
    likely), is a ``DataError`` naming it (``where[i]``, "FILE:ROW", else its index).

    Conversations longer than ``seq_len`` tokens are dropped whole (by design: a cut one would
    train a turn without its end), counted in the returned stats with their first rows, and said
    in a warning. In the paper layout (``fmt.stops_at_tool_call``) an assistant turn with several
    tool calls trains text the rollout never reaches (its engine stops at the first </tool_call>
    and runs that call): such turns are counted and their first rows named in a warning, not
    refused (data written for the official layout, whose loop runs the first call of a turn,
    has them)."""
    examples, too_long, multi_call_rows, multi_calls = [], [], [], 0
    for i, msgs in enumerate(conversations):
        name = where[i] if where else f"conversation {i}"
        try:
            enc = ct.encode_conversation(tokenizer, msgs, fmt=fmt)
        except (ValueError, TypeError, AttributeError, KeyError) as e:
            raise DataError(f"{name}: {e}") from e
        if not enc.assistant_mask.any():
            raise DataError(f"{name}: the conversation has no assistant message: nothing to train on "
                            "(SFT trains the assistant's turns; fix or remove the row)")
        if len(enc.ids) > seq_len:
            too_long.append(name)
            continue
        if fmt.stops_at_tool_call and multi_call_turns(msgs):
            multi_calls += multi_call_turns(msgs)
            multi_call_rows.append(name)
        # The first token is template text, so a packed boundary is never a training target.
        assert not enc.assistant_mask[0]
        examples.append(SFTExample(enc.ids, enc.assistant_mask))
    stats = {"too_long": len(too_long), "too_long_rows": too_long[:EXAMPLE_ROWS],
             "multi_call_turns": multi_calls, "multi_call_rows": multi_call_rows[:EXAMPLE_ROWS]}
    if too_long:
        log.warning("SFT: dropped %d of %d conversations longer than --config.sft.seq_len=%d tokens: %s",
                    len(too_long), len(conversations), seq_len, first_rows(too_long))
    if multi_calls:
        log.warning("SFT: %d assistant turns hold several tool calls (%s): the rollout stops at a turn's first "
                    "</tool_call> and runs that call alone, so what follows it is trained but never sampled "
                    "(write one call a turn; the official layout, chat_format rstar2_official, samples whole turns)",
                    multi_calls, first_rows(multi_call_rows))
    if not examples:
        source = f"{where[0].rsplit(':', 1)[0]}: " if where else ""
        raise DataError(f"{source}no usable SFT conversation (of {len(conversations)}): every one is longer than "
                        f"--config.sft.seq_len={seq_len} tokens ({first_rows(too_long)})")
    return examples, stats


def examples_digest(examples: Sequence[SFTExample]) -> str:
    """A digest of the encoded examples in order (ids and loss masks): what a step's batch
    indexes into. It changes with the data, the tokenizer, the chat format and the conversations
    ``seq_len`` drops; not with the file's path (moved data is the same data)."""
    digest = hashlib.sha256()
    for ex in examples:
        for data in (np.asarray(ex.ids, "<i4").tobytes(), np.asarray(ex.mask, np.uint8).tobytes()):
            digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:16]


def format_name(fmt: ct.ChatFormat) -> str:
    """The config name of ``fmt`` (``ct.CHAT_FORMATS``), "custom" for another."""
    return next((name for name, known in ct.CHAT_FORMATS.items() if known == fmt), "custom")


def sft_identity(examples: Sequence[SFTExample], cfg: SFTConfig, fmt: ct.ChatFormat) -> dict[str, Any]:
    """What fixes the plan of batches a step number indexes into (``plan_batches``): the encoded
    examples, ``batch_size``, ``seed`` and ``seq_len`` (packing), and the chat format (also in the
    digest: named for the message). Every SFT checkpoint keeps it; a resume with another is
    refused (``check_same_plan``). ``epochs`` and ``max_steps`` are not in it: each epoch's
    permutation is keyed by [seed, epoch], so more epochs extend the same plan."""
    return {"examples_digest": examples_digest(examples), "num_examples": len(examples),
            "batch_size": int(cfg.batch_size), "seed": int(cfg.seed), "seq_len": int(cfg.seq_len),
            "chat_format": format_name(fmt)}


def plan_differences(then: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The fields of two ``sft_identity`` records that differ, each as the flag that sets it."""
    out = []
    if then.get("examples_digest") != now["examples_digest"]:
        out.append(f"the data as encoded ({then.get('num_examples', '?')} conversations, digest "
                   f"{then.get('examples_digest')}; now {now['num_examples']}, {now['examples_digest']}: "
                   "--config.sft.data_path, the tokenizer)")
    for field in ("batch_size", "seed", "seq_len", "chat_format"):
        if field in then and then[field] != now[field]:
            out.append(f"--config.sft.{field}={now[field]} (it was {then[field]})")
    return out


def check_same_plan(meta: Mapping[str, Any], now: Mapping[str, Any], directory: str, step: int) -> None:
    """StageError when the checkpoint in ``directory`` (``meta``: its meta) was trained on
    another plan than ``now`` (``sft_identity``): resuming would continue at step ``step`` of a
    plan of other batches. Checkpoints without the record (older ones) cannot tell: they resume."""
    then = meta.get("sft_identity")
    if not then:
        return
    differ = plan_differences(then, now)
    if differ:
        raise StageError(f"{directory} holds checkpoints (step {step}) of an SFT run on another plan: "
                         f"{'; '.join(differ)}. Resume with the data and settings it was trained with, "
                         "or give this run a new --workdir")


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
    """Packed [num_rows, seq_len] arrays of ``SEQUENCE_KEYS`` (design.md TrainBatch layout: column
    t holds target t), by the packer RL batches use."""
    return place_rows([{"tokens": ex.ids, "loss_mask": ex.mask} for ex in examples], rows, num_rows, seq_len,
                      pad_id)


# ---- the trainer ---------------------------------------------------------------------------------
def sft_optimizer(cfg: SFTConfig, total_steps: int):
    """AdamW on the §5.1 schedule (``optim.cosine_with_warmup``) over ``total_steps`` updates."""
    return adamw(lambda s: cosine_with_warmup(s, total_steps, cfg.learning_rate, cfg.warmup_ratio, cfg.min_lr_ratio),
                 cfg.weight_decay, cfg.grad_clip_norm)


class SFTTrainer:
    """The trainer core with the SFT optimizer, updating on the masked NLL (``loss.NLL``)."""

    def __init__(self, model: nnx.Module, cfg: SFTConfig, total_steps: int, num_rows: int, mesh=None):
        self.cfg = cfg
        self.total_steps = total_steps
        self.trainer = Trainer(model, None, None,
                               TrainerConfig(micro_batch_size=cfg.micro_batch_size, compute_dtype=cfg.compute_dtype),
                               mesh=mesh, optimizer=sft_optimizer(cfg, total_steps))
        self.trainer.num_micro(num_rows)  # a micro-batch size that does not fit fails here, not mid-run

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
        """One update on packed host arrays (the whole global batch, the same on every process)."""
        arrays = {k: arrays[k] for k in SEQUENCE_KEYS}
        if self.trainer.cfg.skip_padding:  # unused packed rows fill whole micro-batches, skipped
            arrays = self.trainer.arrange_rows(arrays, whole_batch=True)
        batch = {k: jax.device_put(np.asarray(v), self.trainer.batch_sharding) for k, v in arrays.items()}
        lr = float(cosine_with_warmup(self.step, self.total_steps, self.cfg.learning_rate, self.cfg.warmup_ratio,
                                      self.cfg.min_lr_ratio))
        m = jax.device_get(self.trainer.update(batch, loss_lib.NLL))
        return {"sft/loss": float(m["loss"]), "sft/grad_norm": float(m["grad_norm"]),
                "sft/tokens": float(m["tokens"]), "sft/lr": lr, "sft/update_norm": float(m["update_norm"]),
                "sft/skipped_nonfinite": float(m["skipped_nonfinite"])}

    def hold_state(self, wait) -> None:
        """``Trainer.hold_state``: the next step waits for ``wait()`` before it changes the state."""
        self.trainer.hold_state(wait)

    def model(self) -> nnx.Module:
        return self.trainer.model()


def fixed_num_rows(plan: Sequence[Sequence[Sequence[int]]], multiple: int) -> int:
    """One row count for every step (one compile): the most any step needs, rounded up."""
    most = max(len(rows) for rows in plan)
    return -(-most // multiple) * multiple


def train_sft(model: nnx.Module, tokenizer, conversations, cfg: SFTConfig, *, mesh=None,
              fmt: ct.ChatFormat = ct.RSTAR2, workdir: str | None = None, checkpoint_cfg=None,
              meta: Mapping[str, Any] | None = None, metrics_writer=None, log_every: int = 10,
              encoded: tuple[list[SFTExample], dict[str, int]] | None = None,
              open_metrics: Callable[[int], Any] | None = None,
              on_step: Callable[[int, int, Mapping[str, float]], None] | None = None,
              ) -> tuple[SFTTrainer, dict[str, Any]]:
    """Train ``model`` on ``conversations``; returns the trainer (``.model()`` is the SFT policy)
    and a summary. With ``workdir`` + ``checkpoint_cfg`` it checkpoints every ``every_steps``
    and at the end, and resumes from the latest checkpoint there. ``encoded``: what
    ``encode_examples`` already made of ``conversations`` (a run checks its data first).
    ``open_metrics(start)``: opens the metrics writer (closed here) once the step resumed from is
    known, so that the steps after it which a killed run logged are logged once (a damaged
    newest checkpoint resumes from an older step); or an open ``metrics_writer``.
    ``on_step(step, total, metrics)``: called after each step trained (a caller's progress line).

    Every checkpoint's meta records ``sft_identity`` (the encoded data, batch size, seed,
    seq_len, chat format); a resume with other ones is refused (``check_same_plan``): its step
    would index another plan. ``epochs`` and ``max_steps`` may change on a resume (train longer:
    the epochs already planned stay the same), and the learning-rate schedule is then recomputed
    over the new total, as a fresh run of that length would have it (the start line says so):
    the resumed step takes the new schedule's rate, so a longer run goes back up its longer
    cosine (and, with warmup past the resumed step, its longer warmup) rather than staying at
    the old run's final rate."""
    examples, drop_stats = encoded or encode_examples(tokenizer, conversations, cfg.seq_len, fmt)
    identity = sft_identity(examples, cfg, fmt)
    plan = plan_batches([len(e.ids) for e in examples], cfg.batch_size, cfg.epochs, cfg.seq_len, cfg.seed)
    steps_per_epoch = len(plan) / cfg.epochs
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

            def same_run(saved: dict, step: int) -> None:  # this run's plan, and (LoRA) its base
                check_same_plan(saved, identity, ckpt.directory, step)
                lora_base.check_same_base(saved, meta or {}, ckpt.directory)

            # the newest checkpoint that reads and verifies (a damaged newer one is set aside, one warning)
            state, saved_meta, resumed = ckpt.restore_newest(ckpt_lib.abstract_like(t.state, t.state_sharding),
                                                             check_meta=same_run)
            trainer.state = state
            start = trainer.step
            source = f"resumed from step {start} ({ckpt.step_dir(resumed)})" + schedule_note(
                saved_meta.get("total_steps"), total)
    if jax.process_index() == 0:
        if not start:
            source = "fresh at step 0"
        print(f"rstarjax: sft {source}; training to step {total} on {len(examples)} conversations",
              flush=True)
        if start >= total:  # a rerun of a finished run: said, not a silent no-op
            print(f"rstarjax: sft in {workdir} is already at step {start} >= {total}: nothing to train", flush=True)
    opened = open_metrics(start) if open_metrics is not None else None
    metrics_writer = opened or metrics_writer
    base_meta = dict(meta or {})
    base_meta.update(stage="sft", total_steps=total, sft_identity=identity)
    t0 = time.time()
    last: dict[str, float] = {}
    losses = []
    # SIGTERM / SIGINT: the step in progress finishes, is saved, and the run stops (as RL's
    # stages do, recipes/preemption.py); without a checkpointer the signal keeps its default
    guard = (preemption.SignalGuard(checkpoint_cfg.preemption_grace_s, can_abandon=False)
             if ckpt is not None else contextlib.nullcontext())
    # a diverged run stops (its updates skipped, the newest checkpoint the last good one)
    nonfinite = NonFiniteStreak(cfg.max_nonfinite_steps, "sft",
                                ("sft.learning_rate", "sft.max_nonfinite_steps"))
    try:
        with guard:
            for s in range(start, total):
                arrays = pack_rows(examples, plan[s], num_rows, cfg.seq_len, tokenizer.pad_id)
                last = trainer.train_step(arrays)
                losses.append(last["sft/loss"])
                last["sft/epoch"] = (s + 1) / steps_per_epoch  # (with sft.max_steps too: it was nan there,
                # which TensorBoard's writer warned about at every step)
                if metrics_writer is not None:
                    try:
                        metrics_writer.write(s + 1, last)
                    except MetricsWriteError as e:  # a full disk, say: the step trained is kept
                        _save_after_failure(e, ckpt, s + 1, trainer, base_meta, workdir)
                        raise
                if log_every and ((s + 1) % log_every == 0 or s + 1 == total):
                    log.info("sft step %d/%d loss %.4f lr %.2e", s + 1, total, last["sft/loss"], last["sft/lr"])
                if on_step is not None:
                    on_step(s + 1, total, last)
                diverged = nonfinite.observe(s + 1, last, ckpt.latest_step() if ckpt is not None else None)
                if diverged is not None:
                    raise diverged
                stop = guard.stop_signal(s + 1) if ckpt is not None else 0
                if ckpt is not None and (stop or ckpt.should_save(s + 1, total)):
                    ckpt.save(s + 1, trainer.state, base_meta)
                    trainer.hold_state(ckpt.wait_copied)  # the copy goes on while the next rows are packed
                    if metrics_writer is not None:  # a resume logs only the steps after its checkpoint
                        metrics_writer.flush()
                if stop:  # (the finally below waits for the save before this reaches the caller)
                    raise preemption.Interrupted(stop, s + 1, True, False)
    finally:
        try:
            if ckpt is not None:
                ckpt.close()
        finally:
            if opened is not None:
                opened.close()
    summary = {"steps": total, "start_step": start, "examples": len(examples),
               "dropped": {k: drop_stats[k] for k in ("too_long", "too_long_rows") if k in drop_stats},
               "multi_call_turns": {k: drop_stats[k] for k in ("multi_call_turns", "multi_call_rows") if k in drop_stats},
               "sft_identity": identity, "rows_per_step": num_rows,
               "final_loss": losses[-1] if losses else float("nan"), "first_loss": losses[0] if losses else float("nan"),
               "seconds": time.time() - t0}
    return trainer, summary


def schedule_note(saved_total: Any, total: int) -> str:
    """What the start line adds when a resumed run's total differs from its checkpoint's (another
    ``epochs`` / ``max_steps``): the schedule is recomputed over the new total."""
    if saved_total is None or int(saved_total) == total:
        return ""
    return (f"; the checkpoint's run was to reach step {int(saved_total)}: the learning-rate schedule "
            f"(warmup + cosine) is recomputed over {total} steps")


def _save_after_failure(failure: Exception, ckpt, step: int, trainer, meta: dict, workdir: str) -> None:
    """Save ``step``, finished when ``failure`` stopped the run, and note on it whether it is."""
    if ckpt is None:
        return
    try:
        if step not in ckpt.all_steps():
            ckpt.save(step, trainer.state, meta)
        ckpt.wait()
    except Exception as e:  # (the same full disk, most likely): said, the first failure raised
        failure.add_note(f"step {step} could not be saved in {workdir}: {str(e).splitlines()[0] if str(e) else e!r}")
        return
    failure.add_note(f"step {step} is saved in {workdir}: the same command resumes from it")


def _logged_first_loss(path: str, otherwise: float) -> float:
    """``sft/loss`` of step 1 in the metrics log ``path`` (``otherwise`` when it holds none)."""
    try:
        records = read_metrics(path)
    except (OSError, ValueError):
        return otherwise
    first = next((r for r in records if r.get("step") == 1 and "sft/loss" in r), None)
    return float(first["sft/loss"]) if first is not None else otherwise


# ---- entry point -----------------------------------------------------------------------------------
def resume_step(workdir: str, checkpoint_cfg) -> int | None:
    """The step ``train_sft`` in ``workdir`` resumes from (None: it starts afresh)."""
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), checkpoint_cfg)
    try:
        return ckpt.latest_step()
    finally:
        ckpt.close()


def run_sft(run: RunConfig, workdir: str) -> dict[str, Any]:
    """``mode=sft``: fine-tune ``run.model`` on ``run.sft.data_path``; checkpoints and metrics in
    ``workdir``; with ``sft.export_hf`` also a HF directory ``workdir/hf``."""
    os.makedirs(workdir, exist_ok=True)
    mesh = build.mesh(run.mesh)
    tokenizer = build.tokenizer(run.model)
    fmt = ct.chat_format(run.sft.chat_format)
    conversations, where = conversation_rows(run.sft.data_path, fmt)
    # the data is checked (one line naming FILE:ROW) before the model is read
    encoded = encode_examples(tokenizer, conversations, run.sft.seq_len, fmt, where)
    start = resume_step(workdir, run.checkpoint)
    # A resume restores every parameter before anything reads them: the HF weights are not read.
    # With LoRA the checkpoints hold adapters only: the frozen base always comes from HF.
    model = build.policy(run.model, mesh, run.seed, read_weights=start is None or run.model.lora_rank > 0,
                         **build.vocabulary_of(tokenizer))
    meta = build.model_meta(model, tokenizer, run.sft.chat_format)
    if model.config.lora_rank:  # which base the adapters in the checkpoints belong to
        meta["lora_base"] = lora_base.with_hash(lora_base.model_record(run.model, run.seed),
                                                nnx.state(model, nnx.Not(nnx.LoRAParam)))
    logdir = os.path.join(workdir, "logs")  # where RL writes its metrics too (each step once)

    def open_metrics(resumed: int) -> MetricsWriter:  # at the step restored (an older one past a damaged newest)
        return MetricsWriter(logdir, enabled=jax.process_index() == 0, tensorboard=run.logging.tensorboard,
                             wandb=wandb_init_args(run, workdir), resume_step=resumed)

    trainer, summary = train_sft(
        model, tokenizer, conversations, run.sft, mesh=mesh, fmt=fmt,
        workdir=workdir, checkpoint_cfg=run.checkpoint, meta=meta,
        open_metrics=open_metrics, encoded=encoded)
    if summary["start_step"]:  # resumed: the run's first loss is its step 1's, logged by the run that began it
        summary["first_loss"] = _logged_first_loss(os.path.join(logdir, "metrics.jsonl"), summary["first_loss"])
    if run.sft.export_hf:
        # (a LoRA policy unmerged: save_hf merges it into float32 weights, no bf16 rounding)
        with files.staged_dir(os.path.join(workdir, "hf")) as hf_dir:  # whole or not at all
            save_hf(trainer.trainer.lora_model(), hf_dir, tokenizer=tokenizer, chat_format=run.sft.chat_format)
    summary_path = os.path.join(workdir, "sft_summary.json")
    if start is not None and start >= summary["steps"] and os.path.exists(summary_path):
        with open(summary_path) as f:  # nothing trained now: the run's own summary (its losses) stays
            return json.load(f)
    files.write_json_atomic(summary_path, summary)  # whole or not at all: the rerun above reads it
    return summary

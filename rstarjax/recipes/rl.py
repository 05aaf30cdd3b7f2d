"""An RL stage (rStar2-Agent §4.3): GRPO-RoC steps (``rl.step.rl_step``) from the stage's starting
state to ``total_steps``, resumable from its workdir.

The hand-offs between the stages of the recipe are ``initial_state``'s (docs/training.md "Stage
hand-offs"); the KL term's reference policy is ``setup_reference``'s; each stage reads its data in
its own order (``stage_data_seed``).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from rstarjax.processes import any_process
from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.io import compile_cache
from rstarjax.io import data as data_lib
from rstarjax.io.metrics_log import MetricsWriteError, MetricsWriter, step_line
from rstarjax.layout import layout_of
from rstarjax.models import lora
from rstarjax.recipes import build, lora_base, preemption, sources
from rstarjax.recipes.config import RunConfig, as_flags, wandb_init_args
from rstarjax.rl.step import EmptyBatchStreak, rl_step
from rstarjax.rl.trainer import NonFiniteStreak, NonFiniteTraining, Trainer, TrainState  # noqa: F401
from rstarjax.rl.trajectory import RolloutFn, RolloutsFailed
from rstarjax.serving import sizing
from rstarjax.validation import ConfigError, StageError  # noqa: F401  (StageError: its import path of old)

log = logging.getLogger(__name__)


def stage_data_seed(seed: int, stage_start_step: int) -> int:
    """The data-shuffle seed of a stage that starts at global step ``stage_start_step``: each
    stage of a chain reads its data in a new order (stage 2 must not replay stage 1's), and a
    resumed stage, which records its start, in the same order again. Stage 1 (start 0) uses
    ``seed`` itself."""
    if stage_start_step == 0:
        return int(seed)
    return int(np.random.default_rng([int(seed), int(stage_start_step)]).integers(0, 2**31 - 1))


def problem_batches(run: RunConfig, seed: int, records: list[dict]):
    """grain iterator over this process's share of ``records``, ``prompts_per_step`` per step
    (repeats when ``data.num_epochs == 0``), shuffled with ``seed`` (``data.handling="official"``:
    in the official loader's order, ``io.data.OfficialOrder``)."""
    return data_lib.make_dataset(records, sources.prompts_per_process(run), seed=seed,
                                 num_epochs=run.data.num_epochs or None, shuffle=run.data.shuffle,
                                 handling=run.data.handling)


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)

def initial_state(trainer: Trainer, ckpt: ckpt_lib.Checkpointer, run: RunConfig, base_record: dict | None = None,
                  data_digest: str | None = None) -> dict:
    """Put the stage's starting state into ``trainer`` and return its record (the checkpoint meta
    of a resume, else ``{"step", "stage_start_step", "init_from", ...}``). The hand-off rules:

    * this workdir has a checkpoint of this stage: resume it (params, optimizer, step, RNG key,
      data-iterator state). A workdir holding another stage's checkpoints is refused: each stage
      of a chain gets its own ``--workdir``. Another stage: another ``init_from``, or (``stage_identity``)
      another optimizer or reference reset at its start, or other data (``data_digest``, the
      problems this run draws from: ``io.data.records_digest``; None: not checked);
    * else ``checkpoint.init_from`` is an SFT checkpoint (its meta says ``stage: sft``): params
      only; step 0, a fresh optimizer (so the LR warmup runs);
    * else ``init_from`` is an RL checkpoint: params + optimizer state + global step, or with
      ``checkpoint.reset_optimizer`` params + step and a fresh optimizer (its schedule, warmup
      included, restarts with it: rStar2-Agent §4.3 resets the optimizer for stage 3);
    * else the model as built (``model.hf_path`` or the seeded preset), step 0.

    LoRA (``trainer.lora``): the checkpoints hold the adapters (and their optimizer state), and
    the record ``lora_base`` (returned, saved in every checkpoint) names the frozen base and its
    hash (``recipes.lora_base``): a resume rebuilds that base; ``init_from`` a full-parameter
    checkpoint (an SFT run) makes its params the base with fresh adapters (step 0 from SFT, a
    fresh optimizer); ``init_from`` a LoRA checkpoint continues its adapters on its base.
    """
    record = _initial_state(trainer, ckpt, run, data_digest)
    if trainer.lora and "lora_base" not in record:  # the base as built (``base_record``: as given)
        record["lora_base"] = lora_base.with_hash(base_record or lora_base.model_record(run.model, run.seed),
                                                  trainer.frozen)
    return record


def _initial_state(trainer: Trainer, ckpt: ckpt_lib.Checkpointer, run: RunConfig, data_digest: str | None) -> dict:
    init_from = os.path.abspath(run.checkpoint.init_from) if run.checkpoint.init_from else ""
    if init_from and _same_dir(init_from, ckpt.directory):
        raise StageError(f"--config.checkpoint.init_from={run.checkpoint.init_from!r} is this run's own "
                         "checkpoint directory: give each stage its own --workdir (a workdir resumes by itself)")
    if ckpt.latest_step() is not None:
        def same_stage(meta: dict, step: int) -> None:
            if meta.get("stage") == "sft":
                raise StageError(f"{ckpt.directory} holds an SFT run's checkpoints: give the RL stage its own "
                                 "--workdir and start it with --config.checkpoint.init_from=SFT_WORKDIR/checkpoints")
            recorded = meta.get("init_from", "")
            # checkpoints that predate the stage record ("stage" absent) cannot tell: they resume
            if "stage" in meta and init_from and (not recorded or not _same_dir(recorded, init_from)):
                raise StageError(
                    f"{ckpt.directory} holds checkpoints of another run (started from "
                    f"{recorded or 'the base model'!r}, now at step {step}), not of a stage started "
                    f"from {init_from!r}: give this stage a new --workdir")
            if data_digest is not None and meta.get("stage_identity"):  # (absent before 2026-12-07: cannot tell)
                _check_stage_identity(meta, stage_identity(run, data_digest), ckpt.directory, step)

            if trainer.lora != ("lora_base" in meta):
                raise StageError(f"{ckpt.directory} holds {'LoRA adapters' if 'lora_base' in meta else 'full parameters'}"
                                 f" but --config.model.lora_rank={run.model.lora_rank}: resume with the setting "
                                 "it was trained with")
            flags = trainer.lora and _lora_flags(meta, run)
            if flags:
                raise StageError(f"{ckpt.directory} holds adapters of another LoRA setting: resume with {flags}")

        abstract = ckpt_lib.abstract_like(trainer.state, trainer.state_sharding)
        # the newest checkpoint that restores: a torn or corrupt newer one is skipped, with a warning
        on_disk = ckpt.all_steps()
        trainer.state, meta, step = ckpt.restore_newest(abstract, check_meta=same_stage)
        if trainer.lora:
            meta["lora_base"] = lora_base.restore_base(trainer, meta["lora_base"])
        # (for the start line: the step resumed and the newer checkpoints that did not restore)
        return dict(meta, resumed=True, resumed_step=int(step), skipped_steps=[int(s) for s in on_disk if s > step])
    if not init_from:
        return {"step": 0, "stage_start_step": 0}
    src_step, src_meta = build.init_from_checkpoint(run.checkpoint.init_from)
    if src_meta.get("stage") == "sft":
        # The SFT policy learned one format's prompts, tool name and turn layout: RL in another
        # samples from a policy that never saw them. (A checkpoint without the record was
        # written with build.model_meta's default, the rStar2 format, as rstarjax.export reads it.)
        sft_format = src_meta.get("chat_format", "rstar2")
        if sft_format != run.rl.chat_format:
            raise StageError(
                f"--config.checkpoint.init_from={run.checkpoint.init_from!r} is an SFT run on chat_format "
                f"{sft_format!r}, and this stage has --config.rl.chat_format={run.rl.chat_format!r}: run RL with "
                f"--config.rl.chat_format={sft_format} (or the SFT again with --config.sft.chat_format="
                f"{run.rl.chat_format})")
    src = ckpt_lib.Checkpointer(init_from, ckpt_lib.CheckpointConfig(async_save=False))
    try:
        from_sft = src_meta.get("stage") == "sft"
        base = None
        if trainer.lora and "lora_base" not in src_meta:  # full params: the new adapters' base
            base = {"source": "checkpoint", "path": init_from, "step": int(src_step)}
            lora_base.load_checkpoint_base(trainer, init_from, src_step)
            step = 0 if from_sft else int(src_meta.get("step", src_step))
            trainer.state = TrainState(trainer.state.params, trainer.state.opt_state,
                                       jax.device_put(jnp.int32(step), trainer.replicated))
            base = lora_base.with_hash(base, trainer.frozen)
        elif trainer.lora != ("lora_base" in src_meta):
            raise StageError(f"--config.checkpoint.init_from={run.checkpoint.init_from!r} holds LoRA adapters: "
                             f"continue it with --config.model.lora_rank={src_meta.get('lora', {}).get('rank', 'R')} "
                             "(or export it merged, rstarjax.export, and start from that HF directory)")
        elif trainer.lora:
            mismatch = _lora_flags(src_meta, run)
            if mismatch:
                raise StageError(f"--config.checkpoint.init_from={run.checkpoint.init_from!r} holds adapters of "
                                 f"another LoRA setting: continue them with {mismatch} (or export them merged, "
                                 "rstarjax.export, and start new adapters from that HF directory)")
            base = lora_base.restore_base(trainer, src_meta["lora_base"])
        if trainer.lora and "lora_base" not in src_meta:
            pass  # fresh adapters and optimizer on the new base, set above
        elif from_sft or run.checkpoint.reset_optimizer:
            abstract = ckpt_lib.abstract_like(trainer.state.params, trainer.param_sharding)
            # the newest that verifies: a damaged newer one is skipped, said in one warning
            params, src_meta, src_step = ckpt_lib.restore_params_newest(init_from, abstract, newest=src_step)
            step = 0 if from_sft else int(src_meta.get("step", src_step))
            trainer.state = TrainState(params, trainer.state.opt_state,
                                       jax.device_put(jnp.int32(step), trainer.replicated))
            trainer.reset_optimizer()
        else:
            abstract = ckpt_lib.abstract_like(trainer.state, trainer.state_sharding)
            # the newest that restores and verifies (a damaged newer one is set aside, one warning)
            trainer.state, src_meta, src_step = src.restore_newest(abstract)
    finally:
        src.close()
    # a new stage reads its data from the start, in a new order (stage_data_seed)
    return {"step": trainer.step, "stage_start_step": trainer.step, "init_from": init_from,
            "init_from_step": int(src_step), "init_from_stage": "sft" if from_sft else "rl",
            # the total that stage was to reach (SFT's meta: total_steps): the start line says when it fell short
            "init_from_total_steps": src_meta.get("total_steps" if from_sft else "stage_total_steps"),
            **({"lora_base": base} if base is not None else {})}


def stage_identity(run: RunConfig, data_digest: str) -> dict:
    """What makes a workdir's checkpoints this stage's besides where it started (``init_from``):
    what it reset at its start (stage 3: the optimizer and the reference) and the problems its
    data position indexes into (``io.data.records_digest``). Every checkpoint of the stage keeps
    it; a resume with another is refused (``_check_stage_identity``)."""
    return {"reset_optimizer": bool(run.checkpoint.reset_optimizer),
            "update_reference": bool(run.checkpoint.update_reference), "data_digest": data_digest}


def _check_stage_identity(meta: dict, now: dict, directory: str, step: int) -> None:
    """StageError when the checkpoints in ``directory`` (``meta``: the newest's) are of a stage
    other than ``now`` (``stage_identity``): resuming would skip this stage's resets at its start
    or read its data from another dataset's position."""
    then = meta["stage_identity"]
    for flag in ("reset_optimizer", "update_reference"):
        if bool(then.get(flag)) != now[flag]:
            raise StageError(
                f"{directory} holds checkpoints (step {step}) of a stage run with checkpoint.{flag}={bool(then.get(flag))}, "
                f"and this one has --config.checkpoint.{flag}={now[flag]} (stage 3 resets the optimizer and the "
                "reference at its start): give this stage a new --workdir, or resume with the setting it was run with")
    if then.get("data_digest") != now["data_digest"]:
        raise StageError(
            f"{directory} holds checkpoints (step {step}) of a stage that drew from other problems "
            f"({meta.get('train_path', 'its data')!r}, {meta.get('num_problems', '?')} problems) than "
            "--config.data.train_path gives now: its data position would index other rows. Give this stage a "
            "new --workdir, or resume with the data (and data settings) it was trained on")


def _lora_flags(meta: dict, run: RunConfig) -> str:
    """The flags that give this run the LoRA setting of the checkpoint with ``meta`` ("" = it has it)."""
    m = run.model
    return lora_base.lora_setting_flags(meta.get("lora"), m.lora_rank, m.lora_alpha, m.lora_target_names)


def checkpoint_replaces_weights(run: RunConfig, ckpt: ckpt_lib.Checkpointer) -> bool:
    """Whether ``initial_state`` overwrites every parameter of the policy as built (a resume of
    this workdir, or ``checkpoint.init_from``) before anything reads them: then the HF weights
    need not be read (minutes for a 14B model at every stage start). The KL term's "initial"
    reference is the policy as built, so with ``loss.kl_coef > 0`` they are always read."""
    if run.loss.kl_coef > 0 or run.model.lora_rank > 0:  # LoRA: the checkpoints hold adapters only
        return False
    return bool(run.checkpoint.init_from) or ckpt.latest_step() is not None


def setup_reference(trainer: Trainer, run: RunConfig, meta: dict) -> dict | None:
    """Choose the KL term's frozen reference policy (only with ``loss.kl_coef > 0``) and return
    the record of that choice, saved in every checkpoint's meta as ``"reference"``.

    * default: the initial policy, i.e. the params the trainer was built with (``build.policy``:
      the HF weights, or the seeded random preset), before any checkpoint was restored. The
      Trainer copied them at construction;
    * ``checkpoint.update_reference`` (stage 3, rStar2-Agent §4.3): the policy loaded from
      ``checkpoint.init_from`` (the previous stage's latest checkpoint, by its step number).

    The reference is never saved: on resume it is REBUILT deterministically from this record (the
    same initial weights, or ``restore_params(init_from, step)``), so a SIGKILL-resumed run trains
    against the very same reference without doubling the checkpoint size.
    """
    if run.loss.kl_coef <= 0:
        return None
    if not (run.checkpoint.update_reference and run.checkpoint.init_from):
        return {"source": "initial"}
    record = meta.get("reference")
    if record and record.get("source") == "init_from":  # resuming this stage: the same checkpoint again
        abstract = ckpt_lib.abstract_like(trainer.state.params, trainer.param_sharding)
        params, _, _ = ckpt_lib.restore_params(record["path"], abstract, step=int(record["step"]))
        trainer.set_reference(params)
        return dict(record)
    if "init_from_step" not in meta:
        raise ValueError("update_reference: the run resumed from a checkpoint without a reference "
                         "record; cannot tell which init_from step was the reference")
    trainer.set_reference()  # initial_state just loaded the previous stage's policy
    return {"source": "init_from", "path": os.path.abspath(run.checkpoint.init_from),
            "step": int(meta["init_from_step"])}



def check_update_room(run: RunConfig, model: nnx.Module) -> None:
    """One device, colocated: ConfigError naming the flags when the memory left beside the trainer's
    weights and AdamW moments cannot hold the update next to the engine (``serving.sizing.
    update_room_problems``); nothing on CPU (no memory statistics) or on several devices."""
    if not layout_of(run.serving).one_device:
        return
    # the pool the engine will take (the run's kv_pages or kv_memory_fraction), in its dtype, and
    # the KL reference: as the plan counted them before any model was built (build.plan_inputs)
    problems = sizing.update_room_problems(
        model.config, **build.plan_inputs(run), micro_batch=run.trainer.micro_batch_size,
        free_bytes=sizing.free_device_bytes(), kv_memory_fraction=run.serving.kv_memory_fraction,
        kv_pages=run.serving.kv_pages)
    if problems:
        raise ConfigError(as_flags("invalid config:\n  " + "\n  ".join(problems)))


def device_memory_metrics() -> dict[str, float]:
    """Peak and current bytes in use on this process's busiest device, in GB (GPU/TPU; CPU
    devices keep no such statistics and give nothing)."""
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    peak = max((s.get("peak_bytes_in_use", 0) for s in stats), default=0)
    if not peak:
        return {}
    return {"perf/device_peak_gb": peak / 1e9,
            "perf/device_in_use_gb": max(s.get("bytes_in_use", 0) for s in stats) / 1e9,
            "perf/device_limit_gb": max(s.get("bytes_limit", 0) for s in stats) / 1e9}


def run_rl(run: RunConfig, workdir: str, rollout_fn: RolloutFn | None = None, model: nnx.Module | None = None,
           on_update: Callable[[Trainer], None] | None = None, model_source: dict | None = None) -> Trainer | None:
    """``mode=rl``: GRPO-RoC updates until the global step reaches ``run.total_steps``, resumable
    from ``workdir``; the stage hand-off rules are ``initial_state``'s. In a disaggregated
    multi-process run, processes 0 .. ``serving.trainer_processes`` - 1 train (``rstarjax.processes``)
    and every other process serves a share of one trainer's rollouts (``recipes.rollout_process``;
    it returns None).

    ``rollout_fn`` defaults to the agent loop on a colocated serving engine; ``on_update`` is
    called once the starting state is in place (so the very first rollouts sample the restored
    policy) and after every update (the colocated engine takes the new params in memory there).

    SIGTERM / SIGINT stop the stage cleanly (``recipes.preemption``): the last finished step is
    saved, the code pool closed, and ``preemption.Interrupted`` raised.

    ``model_source``: where a given ``model``'s weights come from, as a ``recipes.lora_base``
    record (e.g. ``{"source": "checkpoint", "path": SFT_CKPT_DIR, "step": N}``): with LoRA it is
    the base record the checkpoints carry, so a resume and ``rstarjax.export`` can rebuild it.
    """
    # this process's part in the run's layout: a rollout process serves rollouts (None), a training
    # process trains over its transport (rollout processes, or the engines the stage builds)
    return sources.with_transport(run, rollout_fn, on_update,
                                  lambda fn, update: _run_rl(run, workdir, fn, model, update, model_source))


def _run_rl(run: RunConfig, workdir: str, rollout_fn, model, on_update, model_source) -> Trainer:
    guard = preemption.SignalGuard(run.checkpoint.preemption_grace_s,
                                   can_abandon=layout_of(run.serving).single_process)
    with guard:  # from here on a signal is a request to stop, answered within the grace period
        tokenizer = build.tokenizer(run.model)
        # the data first: its bad and over-long rows are reported before minutes of model loading
        records, _ = build.problems(run.data.train_path, run.rl, tokenizer if rollout_fn is None else None,
                                    run.data.answer_filter, run.data.handling)
        mesh = build.mesh(run.mesh, run.serving)
        ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), run.checkpoint)
        executor, before_update = None, None
        try:
            base_record, model_built = None, model is None
            if model_built:
                model = build.policy(run.model, mesh, run.seed,
                                     read_weights=not checkpoint_replaces_weights(run, ckpt))
            elif run.model.lora_rank and not model.config.lora_rank:  # a given policy (the demo's SFT) is the base
                model = lora.attach(model, run.model.lora_rank, run.model.lora_alpha, run.model.lora_target_names,
                                    seed=run.seed, mesh=mesh)
                base_record = dict(model_source or {"source": "model", "path": "(the policy given to run_rl)"})
            # what rstarjax.export needs to rebuild the model from a checkpoint of this run alone
            if rollout_fn is None or len(tokenizer) <= model.config.vocab_size:
                export_meta = build.model_meta(model, tokenizer, run.rl.chat_format)  # raises when the vocabularies disagree
            else:  # a scripted rollout function on a preset whose table fits no tokenizer: the architecture only
                export_meta = {"model_config": model.config.to_hf_dict(), **build.lora_meta(model)}
            trainer = Trainer(model, run.optim, run.loss, run.trainer, mesh=mesh,
                              logit_temperature=run.rl.temperature)  # what rollouts sample at
            meta = initial_state(trainer, ckpt, run, base_record, data_lib.records_digest(records))
            if rollout_fn is None:
                check_update_room(run, model)  # before minutes of rollouts: the memory plan's start check
                executor = build.executor(run.rl.num_tool_workers, run.env.allow_unconfined)
                rollouts = build.rollouts(trainer.served_model(), tokenizer, executor, run.agent(), run.rl.sampling(),
                                          run.rl.max_prompt_len, run.rl.chat_format, run.serving)
                rollout_fn, on_update = rollouts, lambda tr: rollouts.update_params(tr.served_model())
                if run.serving.release_during_update:  # freed before each update, made again by on_update
                    before_update = rollouts.release_memory
            # the dtype the engine serves in sets the log-prob gap alarm's threshold (None: a rollout
            # function that does not say, e.g. a scripted one: no count)
            serving_dtype = getattr(rollout_fn, "serving_dtype", None)
            return _train_stage(run, workdir, trainer, ckpt, meta, records, rollout_fn, on_update, export_meta,
                                before_update, guard, serving_dtype,
                                given_policy=None if model_built else given_policy_origin(model_source))
        finally:
            ckpt.close()  # waits for the last async save
            if executor is not None:  # the code-execution pool this stage started
                # after a signal, calls still in flight are of an abandoned step: no need to wait
                executor.close(drain_timeout=0.0 if guard.request is not None else None)


def _train_stage(run: RunConfig, workdir, trainer, ckpt, meta, problems, rollout_fn, on_update, export_meta,
                 before_update=None, guard: preemption.SignalGuard | None = None,
                 serving_dtype=None, given_policy: str | None = None) -> Trainer:
    """``run_rl``'s loop, from the stage's starting state to ``run.total_steps``: draw a round
    from the stage's rollout source (``recipes.sources``: the rollout mode lives there), train on
    it, hand the update to the engines, checkpoint, log. ``guard`` (installed by the caller) says
    when a signal asks it to stop. ``serving_dtype``: the dtype the rollouts are served in (None:
    unknown, e.g. a scripted ``rollout_fn``; no log-prob gap count). ``given_policy``: where a
    policy handed to ``run_rl`` comes from, for the start line (None: the model was built here)."""
    guard = guard or preemption.SignalGuard(0.0, can_abandon=False)  # never installed: never asks
    data_iter, base_key, restart, record = _stage_data(run, meta, problems, export_meta)
    if on_update is not None:
        on_update(trainer)  # the engine serves the restored policy from the first rollout on
    source = sources.make_source(run, rollout_fn, on_update, data_iter, base_key, trainer.step, restart, guard,
                                 trainer.policy_version)
    save = _saver(trainer, ckpt, base_key, dict(record, **_reference_record(trainer, run, meta)),
                  source.keeps_in_flight)
    start, is_main = trainer.step, jax.process_index() == 0
    writer, bar = _open_log(run, workdir, meta, ckpt, start, is_main, given_policy)
    empty = EmptyBatchStreak(run.rl.max_rejected_batches)  # batches in a row that trained no group
    nonfinite = NonFiniteStreak(run.trainer.max_nonfinite_steps)
    # the data position after the last finished step and the prompts then in flight: what its
    # checkpoint records (batches drawn since, by a rejected or an abandoned step, are drawn again)
    finished_data = source.snapshot()
    attempts, stop_signal, ended = 0, 0, ""  # rollout rounds since the last update; why it ended early
    try:
        while trainer.step < run.total_steps:
            stop_signal = guard.stop_signal(trainer.step)
            if stop_signal:
                break
            step, compiled_before = trainer.step, compile_cache.compile_seconds()
            rnd = source.next_round()
            if rnd is None:  # no process has a prompt left
                ended = "data"
                break
            try:
                metrics = rl_step(trainer, rnd.rollouts, rnd.records, run.rl, run.loss,
                                  step_seed(base_key, step, attempts), more_records=rnd.more_records,
                                  before_update=before_update, serving_dtype=serving_dtype,
                                  stale_rollouts=rnd.stale, partial=rnd.partial)
            except preemption.StepAbandoned:  # the train state is still that of the last finished step
                stop_signal = guard.request.signum
                break
            except RolloutsFailed:
                if guard.request is None:
                    raise
                # the stop this process was told of also reached its rollout processes, which
                # stopped the round first (Ctrl-C reaches every process of a run): a stop, not a failure
                stop_signal = guard.request.signum
                break
            attempts += 1
            metrics = source.settle(metrics, trainer.policy_version, updated=trainer.step > step)
            if metrics is None:  # the round trained nothing yet: its work counts in the step that does
                continue
            if trainer.step == step:  # every group was rejected: no update, as the official trainer
                if nothing_left_to_learn(empty, metrics, step):
                    ended = "solved"
                    break
                continue
            metrics["filter/rejected_batches"] = float(empty.batches)
            attempts = 0
            empty.reset()
            finished_data = source.snapshot()
            t_handoff = time.perf_counter()
            source.after_update(trainer)  # the engines serve the new policy (now, or between rounds)
            metrics["time/handoff"] = time.perf_counter() - t_handoff
            _checkpoint_and_log(run, step, trainer.step, metrics, save, finished_data, ckpt, writer, nonfinite,
                                compiled_before, is_main)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics.get('rollout/reward_mean', 0):.3f}",
                            len=f"{metrics.get('rollout/response_length_mean', 0):.0f}")
        if stop_signal:
            saved = _save_last(trainer.step, start, save, finished_data, ckpt)
            raise preemption.Interrupted(stop_signal, trainer.step, saved, guard.abandoned)
        if ended:  # a stage that trained nothing still leaves its policy for the next stage's init_from
            saved = _save_last(trainer.step, start, save, finished_data, ckpt, keep_unchanged=True)
            _say_ended(run, ended, len(problems), trainer.step, start, saved, empty, is_main)
    except (RolloutsFailed, MetricsWriteError) as failure:  # the infrastructure, not the model: keep what finished
        _note_saved(failure, trainer.step, start, save, finished_data, ckpt, workdir)
        raise
    finally:
        source.close()
        bar.close()
        writer.close()
    return trainer


def _stage_data(run: RunConfig, meta: dict, problems: list, export_meta: dict) -> tuple:
    """The stage's data iterator (at the resumed position), RNG key, the prompts in flight at the
    checkpoint resumed (started again first), and the record every checkpoint of it keeps."""
    stage_start = int(meta.get("stage_start_step", 0))
    data_seed = int(meta.get("data_seed", stage_data_seed(run.seed, stage_start)))
    data_iter = iter(problem_batches(run, data_seed, problems))
    resumed_state, in_flight = sources.resumed_share(meta)
    if meta.get("resumed") and resumed_state is not None:
        data_iter.set_state(resumed_state)
    base_key = ckpt_lib.key_from_json(meta["rng"]) if "rng" in meta else jax.random.key(run.seed)
    restart = list(in_flight or []) if meta.get("resumed") else []
    record = {"stage": "rl", "init_from": meta.get("init_from", ""),
              "init_from_step": meta.get("init_from_step"), "stage_start_step": stage_start,
              "data_seed": data_seed, "stage_total_steps": run.total_steps, **export_meta,
              "stage_identity": stage_identity(run, data_lib.records_digest(problems)),
              "train_path": str(run.data.train_path), "num_problems": len(problems),
              **({"lora_base": meta["lora_base"]} if "lora_base" in meta else {})}
    return data_iter, base_key, restart, record


def _reference_record(trainer: Trainer, run: RunConfig, meta: dict) -> dict:
    reference = setup_reference(trainer, run, meta)
    return {"reference": reference} if reference else {}


def _saver(trainer: Trainer, ckpt: ckpt_lib.Checkpointer, base_key, record: dict, keeps_in_flight: bool):
    """``save(step, (data_state, prompts in flight))``: a checkpoint of the stage at ``step``."""
    def save(step: int, finished) -> bool:
        data_state, pending = finished
        saved = ckpt.save(step, trainer.state, {
            "step": step, "rng": ckpt_lib.key_to_json(base_key), "data_state": data_state, **record,
            **sources.in_flight_record(keeps_in_flight, data_state, pending)})
        trainer.hold_state(ckpt.wait_copied)  # a copy off the device behind the next rollouts
        return saved
    return save


def step_seed(base_key, step: int, attempts: int) -> int:
    """One seed per (step, process), derived from the run key: the same rollouts after a resume,
    independent samples on every process (and for each batch drawn again at this step:
    ``attempts`` rounds since the last update)."""
    step_key = jax.random.fold_in(base_key, step)
    if attempts:
        step_key = jax.random.fold_in(step_key, attempts)
    step_key = jax.random.fold_in(step_key, jax.process_index())
    return int(jax.random.randint(step_key, (), 0, 2**31 - 1))


def _open_log(run: RunConfig, workdir: str, meta: dict, ckpt, start: int, is_main: bool,
              given_policy: str | None = None):
    """The stage's metrics writer and progress bar, after its start line."""
    # the steps after ``start`` that a killed run logged are logged again: kept once
    writer = MetricsWriter(os.path.join(workdir, "logs"), enabled=is_main, tensorboard=run.logging.tensorboard,
                           wandb=wandb_init_args(run, workdir), resume_step=start)
    if is_main:
        print(start_line(run, meta, ckpt, start, given_policy), flush=True)
    if start >= run.total_steps and is_main:
        print(f"rstarjax: {workdir} is already at global step {start} >= total_steps={run.total_steps}: "
              "nothing to train (raise --config.total_steps to train on)", flush=True)
    bar = tqdm.tqdm(total=run.total_steps, initial=start, disable=not (is_main and run.logging.progress_bar),
                    desc="rl", dynamic_ncols=True)
    return writer, bar


def nothing_left_to_learn(empty: EmptyBatchStreak, metrics: dict, step: int) -> bool:
    """A step that trained no group (every one rejected): whether ``rl.max_rejected_batches`` in a
    row had equal rewards alone (the policy solved or never solves them: the stage ends); raises
    ``RolloutsFailed`` when groups short of rollouts by infrastructure errors are among them."""
    log.warning("step %d: no group of the batch is left to train on (rejected %.0f%%, %d infra-short); "
                "drawing the next batch", step + 1, 100 * metrics.get("filter/rejected_frac", 0.0),
                metrics.get("filter/infra_short_groups", 0))
    if not empty.observe(metrics):
        return False
    # equal rewards alone are the data and the policy: nothing left to learn, not a failure;
    # groups short of rollouts by infrastructure errors are the environment's
    if not any_process(empty.infra_failing):
        return True
    # the infrastructure's failure, not the model's: saved and said in one line (exit 1)
    raise RolloutsFailed(
        f"{empty.batches} rollout batches in a row left no group to train on at step {step + 1}, "
        f"with rollouts lost to infrastructure errors ({empty.shares()}): the environment is "
        "failing. Check the rollout metrics (filter/infra_trajectories) and the tool pool's log")


def _checkpoint_and_log(run: RunConfig, old_step: int, new_step: int, metrics: dict, save, finished_data, ckpt,
                        writer, nonfinite: NonFiniteStreak, compiled_before: float, is_main: bool) -> None:
    """After the update from ``old_step`` to ``new_step`` (several updates apart with
    ``trainer.mini_batches`` > 1): stop on a non-finite streak, save when due, log."""
    diverged = nonfinite.observe(new_step, metrics, ckpt.latest_step())
    if diverged is not None:  # logged, never saved: the newest checkpoint stays the last good one
        writer.write(new_step, metrics)
        raise diverged
    saving = ckpt.should_save(new_step, run.total_steps, previous_step=old_step)
    if saving:
        t_save = time.perf_counter()
        save(new_step, finished_data)
        # with async_save, the part the loop waits for: the finite check and fingerprints on the
        # device, and Orbax's copy off the device unless it runs behind the next step's rollouts
        # (checkpoint.background_copy: its update waits for what is left, time/checkpoint_copy_wait);
        # the write goes on behind
        metrics["time/checkpoint"] = time.perf_counter() - t_save
        if new_step >= run.total_steps:  # the stage ends: its last write is waited for anyway
            ckpt_lib.wait_reporting(ckpt, lambda: writer.write(new_step, metrics))
    # what became known since the last step: the copy's seconds, the update's wait for it, and the
    # write's seconds once it committed
    metrics.update({f"time/{name}": seconds for name, seconds in ckpt.take_timings().items()})
    metrics.update(device_memory_metrics())
    metrics["time/compile"] = compile_cache.compile_seconds() - compiled_before
    writer.write(new_step, metrics)
    if saving:  # a resume from this checkpoint logs only the steps after it: these must be on disk
        writer.flush()
    if is_main and not run.logging.progress_bar:  # the bar's figures, one line per step
        print(step_line(new_step, run.total_steps, metrics), flush=True)


def _say_ended(run: RunConfig, ended: str, num_problems: int, step: int, start: int, saved: bool,
               empty: EmptyBatchStreak, is_main: bool) -> None:
    """Log (and on process 0 print) why the stage stopped before ``total_steps``."""
    message = (solved_message(run, num_problems, step, start, saved, empty) if ended == "solved"
               else data_ran_out_message(run, num_problems, step, start, saved))
    log.info("%s", message)
    if is_main:
        print(f"rstarjax: {message}", flush=True)


def _note_saved(failure: Exception, step: int, start: int, save, finished_data, ckpt, workdir: str) -> None:
    """Save the last finished step after the rollouts failed, and note on ``failure`` whether it is."""
    if step == start:
        failure.add_note(f"no step finished in this run since step {start}: nothing new to save")
    elif _save_last(step, start, save, finished_data, ckpt):
        failure.add_note(f"step {step} is saved in {workdir}: the same command resumes from it")
    else:
        failure.add_note(f"step {step} could not be saved in {workdir}")


def _save_last(step: int, start: int, save, data_state, ckpt, keep_unchanged: bool = False) -> bool:
    """Save ``step``, the last finished one, unless it is on disk already or this run finished
    none; wait for the write. Whether ``step`` is on disk now. ``keep_unchanged``: a stage that
    ended having trained nothing and holding no checkpoint saves the policy it started from, so
    that the next stage (``checkpoint.init_from``) starts from it instead of finding nothing."""
    unchanged_but_needed = keep_unchanged and step == start and not ckpt.all_steps()
    if (step > start or unchanged_but_needed) and step not in ckpt.all_steps():
        save(step, data_state)
    ckpt.wait()
    return step in ckpt.all_steps()


def given_policy_origin(model_source: dict | None) -> str:
    """How the start line names a policy handed to ``run_rl`` (the demo's SFT policy), from its
    ``recipes.lora_base`` record when the caller gave one."""
    if model_source and model_source.get("source") == "checkpoint":
        return f"the given policy (step {model_source.get('step', '?')} of {model_source['path']})"
    return "the given policy"


def start_line(run: RunConfig, meta: dict, ckpt: ckpt_lib.Checkpointer, step: int,
               given_policy: str | None = None) -> str:
    """The line a stage prints as it starts: fresh (from the model as built, from ``given_policy``
    when the caller handed one in, or from which checkpoint of ``checkpoint.init_from``) or
    resumed from step N (which checkpoint, and the newer ones skipped because they did not
    restore), and where it trains to."""
    if meta.get("resumed"):
        line = f"resumed from step {step} ({ckpt.step_dir(meta.get('resumed_step', step))})"
        skipped = meta.get("skipped_steps") or []
        if skipped:
            line += (f"; skipped the newer checkpoint{'s' if len(skipped) > 1 else ''} of step "
                     f"{', '.join(map(str, skipped))}, which did not restore (the warning above says why)")
    elif meta.get("init_from"):
        line = (f"fresh at step {step} from step {meta.get('init_from_step')} of {meta['init_from']} "
                f"(a {meta.get('init_from_stage', 'rl')} checkpoint{_short_of_total(meta)})")
    elif given_policy:  # the preset's random_init describes the model the caller started from, not this one
        line = f"fresh at step {step} from {given_policy}"
    else:
        source = (f"{run.model.preset} with random weights (seed {run.seed})" if run.model.random_init
                  else run.model.hf_path or run.model.preset)
        line = f"fresh at step {step} from {source}"
    return f"rstarjax: rl stage {line}; training to total_steps={run.total_steps}"


def _short_of_total(meta: dict) -> str:
    """When ``init_from``'s checkpoint is short of the total its stage was to train to: words
    that say so. A stage killed mid-way (SIGKILL, no message) leaves a valid checkpoint that the
    next stage would otherwise start from unnoticed (a stage that ran out of data or of things
    to learn stops short too, and said why)."""
    step, total = meta.get("init_from_step"), meta.get("init_from_total_steps")
    if not isinstance(step, int) or not isinstance(total, int) or step >= total:
        return ""
    return (f"; that stage ended at step {step} of its total_steps={total}: if it was interrupted, resume it "
            "in its own workdir first")


def solved_message(run: RunConfig, num_problems: int, step: int, start: int, saved: bool,
                   streak: EmptyBatchStreak) -> str:
    """Why a stage stopped early when ``rl.max_rejected_batches`` batches in a row had only
    equal-reward groups (none short of rollouts by an infrastructure error): which share of them
    the policy answered all wrong and all right, and what was saved."""
    ended = f"{step - start} steps ran in this run. " + _saved_words(step, start, saved)
    if streak.all_correct_only:
        return (f"the policy answered every rollout right in {streak.batches} batches in a row at step "
                f"{step} (before total_steps={run.total_steps}): equal rewards carry no advantage, so there is "
                f"nothing left to learn from these {num_problems} problems. " + ended
                + "Train on harder problems (the recipe's stage 3 filters them) to go on.")
    return (f"nothing left to learn at step {step} (before total_steps={run.total_steps}): in {streak.batches} "
            f"batches in a row every group's rollouts got equal rewards ({streak.shares()}; no infrastructure "
            f"error), which carry no advantage. " + ended
            + "All-wrong groups are problems the policy never solves from these "
            f"{num_problems}: check their answers (docs/data.md), or start from a stronger policy (more SFT); "
            "all-correct ones are solved.")


def _saved_words(step: int, start: int, saved: bool) -> str:
    """What an early end left on disk, in the words of its message."""
    if not saved:
        return "No step was trained, nothing saved. "
    if step == start:
        return (f"No step was trained; the policy it started from is saved as step {step}, for the next "
                "stage's --config.checkpoint.init_from. ")
    return f"Step {step} is saved. "


def data_ran_out_message(run: RunConfig, num_problems: int, step: int, start: int, saved: bool) -> str:
    """Why a stage with finite data stopped before ``total_steps``, and how to go on."""
    per_step = run.rl.prompts_per_step
    epochs = run.data.num_epochs
    return (f"the data ran out at step {step}, before total_steps={run.total_steps}: {step - start} steps ran in "
            f"this run; data.num_epochs={epochs} pass{'es' if epochs != 1 else ''} over {num_problems} problems at "
            f"{per_step} per step give {num_problems * epochs // per_step} steps. "
            + _saved_words(step, start, saved)
            + "Raise --config.data.num_epochs (0 = repeat forever) to train on.")

"""What every recipe builds the same way: the device mesh, the policy, its tokenizer, the code
executor and the colocated rollout function (one builder each)."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from rstarjax.env import CodeExecutor
from rstarjax.layout import layout_of
from rstarjax.env.isolation import require_confined
from rstarjax.models import ModelConfig, Qwen3, load_hf, lora
from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.io import data as data_lib
from rstarjax.models.chat_template import chat_format, encode_prompt
from rstarjax.models.hf import read_config
from rstarjax.models.sharding import make_mesh, shard_model
from rstarjax.models.tokenizer import Tokenizer, load_tokenizer_for
from rstarjax.recipes import lora_base
from rstarjax.recipes.config import PROFILES, MeshConfig, ModelSource, RunConfig, as_flags, parse
from rstarjax.rl.agent_loop import AgentConfig, ColocatedRollouts
from rstarjax.rl.config import RLConfig
from rstarjax.serving import sizing
from rstarjax.serving.colocated import ServingConfig
from rstarjax.serving.sampling import SamplingParams
from rstarjax.validation import ConfigError, StageError


def mesh(cfg: MeshConfig, serving: ServingConfig | None = None) -> Mesh:
    """The trainer's mesh: over every device, or (``serving.placement='disaggregated'``) over
    those the rollout slices leave: in one process its last ``rollout_devices``; across
    processes the rollout processes', so the training processes' own."""
    devices = None if serving is None else layout_of(serving).trainer_devices(jax.devices())
    return make_mesh(cfg.data, cfg.fsdp, cfg.tensor, devices=devices)


def tokenizer(src: ModelSource) -> Tokenizer:
    """The tokenizer of ``src``: ``tokenizer_num_regular_tokens`` > 0 picks a small-vocabulary
    variant; else the ``tokenizer.json`` in ``tokenizer_path`` (default ``hf_path``) says which (so
    an exported small model reloads with its own); else Qwen3's."""
    path = src.tokenizer_path or ("" if src.random_init else src.hf_path)
    # a tokenizer_path apart from the model is checked against the model's config.json's ids
    return load_tokenizer_for(path, src.tokenizer_num_regular_tokens,
                              config_dir=src.tokenizer_path if src.random_init else src.hf_path)


def vocabulary_of(tok: Tokenizer) -> dict[str, Any]:
    """ModelConfig fields that size a fresh model to ``tok`` (its padded table, its special ids)."""
    return dict(vocab_size=tok.vocab_size, bos_token_id=tok.endoftext_id, eos_token_id=tok.eos_id)


def policy(src: ModelSource, mesh: Mesh, seed: int, *, read_weights: bool = True,
           **preset_overrides) -> nnx.Module:
    """The policy on ``mesh``: the HF checkpoint at ``src.hf_path``, or (``src.random_init``) a
    seeded ``src.preset`` with ``preset_overrides`` (e.g. ``vocabulary_of(tokenizer)``; the preset's
    own vocabulary otherwise) and random weights (tests, demos). ``read_weights=False``: the HF
    model's structure with zeros (a checkpoint restored next replaces every parameter)."""
    dtype = jnp.dtype(src.dtype)
    if not src.random_init:
        model = load_hf(src.hf_path, dtype=dtype, mesh=mesh, remat_policy=src.remat_policy,
                        read_weights=read_weights)
    else:
        cfg = ModelConfig.preset(src.preset, dtype=dtype, remat_policy=src.remat_policy, **preset_overrides)
        model = shard_model(Qwen3(cfg, rngs=nnx.Rngs(int(seed))), mesh)
    if src.lora_rank > 0:  # the weights become the frozen bf16 base of fresh adapters
        model = lora.attach(model, src.lora_rank, src.lora_alpha, src.lora_target_names, seed=int(seed), mesh=mesh)
    return model


def check_vocab(model, tok: Tokenizer) -> None:
    """The model must have an embedding row for every token the tokenizer can produce: a
    ``ConfigError`` (one line at the command line) naming the settings that pick the tokenizer."""
    if len(tok) > model.config.vocab_size:
        raise ConfigError(f"the tokenizer has {len(tok)} tokens but the model only {model.config.vocab_size} "
                          "embedding rows: set model.tokenizer_num_regular_tokens (or model.tokenizer_path) "
                          "to the model's tokenizer")


def model_meta(model, tok: Tokenizer, chat_format: str = "rstar2") -> dict[str, Any]:
    """What ``rstarjax.export`` needs to rebuild the model from a checkpoint alone (and the chat
    format it was trained with, whose template the HF export carries)."""
    check_vocab(model, tok)
    return {"model_config": model.config.to_hf_dict(), "tokenizer_num_regular_tokens": int(tok.num_regular_tokens),
            "chat_format": chat_format, **lora_meta(model)}


def lora_meta(model) -> dict[str, Any]:
    """``{"lora": {rank, alpha, targets}}`` of a LoRA policy (its checkpoints hold adapters), else {}."""
    cfg = model.config
    if not cfg.lora_rank:
        return {}
    return {"lora": {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "targets": list(cfg.lora_targets)}}


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def tool_workers(requested: int, cores: int | None = None) -> int:
    """Heavy workers of the code pool: ``requested`` when > 0, else one per host core (each
    worker runs ``slots_per_worker`` sandboxes, and as many lean workers come with them)."""
    if requested < 0:
        raise ValueError(f"rl.num_tool_workers must be >= 0 (0 = one per host core), got {requested}")
    return int(requested) if requested > 0 else max(1, host_cores() if cores is None else int(cores))


def problems(train_path: str, rl: RLConfig, tok: Tokenizer | None, answer_filter: str = "integer",
             handling: str = "paper") -> tuple[list[dict], data_lib.DataReport]:
    """The problems of ``train_path`` a run rolls out, and the report of what was skipped: read
    and checked before any model or code pool is built. Rows the loader cannot use are skipped
    and counted (``io.data.load_problems``), and with ``tok`` (the engine's prompts; None for a
    scripted rollout function) so are those whose prompt, encoded as the rollouts do, exceeds
    ``rl.max_prompt_len``: one such row would otherwise stop the run when drawn, hours in, and
    again at every restart. ``answer_filter``: the answers kept (``data.answer_filter``);
    ``handling``: what is done to the rows (``data.handling``)."""
    records, report = data_lib.load_problems(train_path, answer_filter=answer_filter, handling=handling)
    if tok is not None:
        fmt = chat_format(rl.chat_format)
        records = data_lib.drop_long_prompts(records, report, lambda problem: len(encode_prompt(tok, problem, fmt)),
                                             rl.max_prompt_len, "--config.rl.max_prompt_len")
    return records, report


def executor(num_tool_workers: int, allow_unconfined: bool = False) -> CodeExecutor:
    """The started code executor a run's rollouts use (``rl.num_tool_workers``); close it after.
    ConfigError (one line, exit 2) where its sandboxes could read the host's files, the data's
    answers included, unless ``env.allow_unconfined``."""
    pool = CodeExecutor(num_workers=tool_workers(num_tool_workers)).start()
    try:
        require_confined(pool.isolation, allow_unconfined)
    except RuntimeError as e:
        pool.close()
        raise ConfigError(as_flags(str(e))) from None
    return pool


def rollouts(model, tok: Tokenizer, executor: CodeExecutor, agent: AgentConfig, sampling: SamplingParams,
             max_prompt_len: int, chat: str, serving: ServingConfig, num_slots: int | None = None
             ) -> ColocatedRollouts:
    """The agent loop on a paged serving engine over ``model``'s devices (``rl.agent_loop``),
    sized by ``serving``; ``num_slots`` (> 0) overrides ``serving.num_slots``. ConfigError (exit
    2) naming the flags when the KV pool cannot hold one rollout (``serving.sizing.plan_kv``)."""
    check_vocab(model, tok)
    try:
        return ColocatedRollouts(model, tokenizer=tok, executor=executor, agent=agent, sampling=sampling,
                                 max_prompt_len=max_prompt_len, fmt=chat_format(chat), serving=serving,
                                 num_slots=num_slots)
    except ConfigError as e:
        raise ConfigError(as_flags(str(e))) from None


# the sizes a colocated run on one device takes from the memory plan unless the command line gives them
PLANNED_KEYS = ("model.remat_policy", "trainer.micro_batch_size", "serving.kv_memory_fraction")


def model_config(src: ModelSource) -> ModelConfig:
    """The architecture ``policy`` builds for ``src`` (its HF config.json, else the preset), its
    compute dtype (``model.dtype``: the engine serves in it unless ``serving.dtype`` says) and its
    LoRA targets, read without building the model: what the memory plan needs."""
    dtype = jnp.dtype(src.dtype)
    if src.random_init:
        cfg = ModelConfig.preset(src.preset, dtype=dtype, remat_policy=src.remat_policy)
    else:
        cfg = read_config(src.hf_path, dtype=dtype, remat_policy=src.remat_policy)
    return cfg.replace(lora_targets=src.lora_target_names) if src.lora_rank else cfg


def plan_inputs(run: RunConfig) -> dict[str, Any]:
    """What the memory plan (``sizing.size_colocated``) and its start check (``sizing.
    update_room_problems``) read of ``run`` whatever the sizes: a step's trained rows and their
    length, the page size, LoRA, whether the serving copy and pool are freed for the update, the
    serving dtype (None: ``model.dtype``, as the engine takes it) and whether the KL term keeps a
    reference copy."""
    rl = run.rl
    return dict(rows=rl.prompts_per_step * rl.group_size // run.trainer.mini_batches,
                seq_len=rl.max_prompt_len + rl.max_response_len, page_size=run.serving.page_size,
                lora_rank=run.model.lora_rank, release_during_update=run.serving.release_during_update,
                serving_dtype=run.serving.dtype or None, kl_reference=run.loss.kl_coef > 0)


def check_given_sizes(run: RunConfig, cfg: ModelConfig, device_bytes: int) -> None:
    """The start check (``sizing.update_room_problems``) of the sizes ``run`` gave, made before any
    model is loaded at the memory the plan predicts free once the trainer's state is in place: the
    pool it counts is the run's own (``serving.kv_pages``, or ``serving.kv_memory_fraction`` of what
    the serving copy leaves), so a pool that leaves the update no room stops the start here, naming
    the flags. ConfigError when it does not fit."""
    inputs = plan_inputs(run)
    state = sizing.plan_memory(cfg, rows=inputs["rows"], seq_len=inputs["seq_len"], lora_rank=inputs["lora_rank"],
                               kl_reference=inputs["kl_reference"]).state
    problems = sizing.update_room_problems(
        cfg, **inputs, micro_batch=run.trainer.micro_batch_size, free_bytes=device_bytes - state,
        remat_policy=run.model.remat_policy, kv_memory_fraction=run.serving.kv_memory_fraction,
        kv_pages=run.serving.kv_pages)
    if problems:
        raise ConfigError(as_flags("invalid config:\n  " + "\n  ".join(problems)))


def parse_sizes_open(config, explicit, error: ConfigError) -> RunConfig:
    """``parse`` of ``config`` with ``trainer.micro_batch_size``, unless the command line gave it,
    at 0 (all rows: it divides any mini-batch): for a run whose micro-batch the memory plan may still
    set (``sized_by_memory_plan``; e.g. configs/base.py's 64 and 2 prompts x G = 8 rows). Raises
    ``error``, the first parse's, when the config has other problems too."""
    if "trainer.micro_batch_size" in explicit or "trainer" not in config:
        raise error
    opened = ml_collections.ConfigDict(config).copy_and_resolve_references()  # the flag's is locked
    opened.trainer.micro_batch_size = 0
    try:
        return parse(opened, explicit=explicit)
    except ConfigError:
        raise error from None


def sized_by_memory_plan(run: RunConfig, explicit=frozenset(), deferred: ConfigError | None = None) -> RunConfig:
    """``mode=rl``, colocated on one device that reports its memory (a GPU or TPU): the keys of
    ``PLANNED_KEYS`` that neither the command line (``explicit``) nor ``--config.profile`` set
    become the memory plan's (``serving.sizing.size_colocated``: the fastest remat policy that
    costs the rollouts no KV pool, the micro-batch whose update fits beside the serving copy and
    the pool, the pool's share of what the trainer leaves), and one line says them with the
    predicted peak; ConfigError naming the flags when nothing fits. Sizes kept as given (all three,
    or both sizes where no remat policy fits beside them) are judged by the start check's
    arithmetic with the run's own pool (``check_given_sizes``). The config files' values (remat
    ``full``, 64 rows, 0.9) are for CPU and several devices, where ``run`` is kept.
    ``deferred``: the first parse's error when ``parse_sizes_open`` made ``run``; raised unless the
    plan sets the micro-batch."""
    device = sizing.device_bytes_limit() if run.mode == "rl" and jax.device_count() == 1 \
        and not run.serving.disaggregated else None
    if device is None:  # CPU (no memory statistics), several devices, no RL stage: the config's sizes
        if deferred is not None:
            raise deferred
        return run
    given = set(explicit) | set(PROFILES.get(run.profile, {}))
    if run.serving.kv_pages > 0:  # an explicit pool: the fraction is not used
        given.add("serving.kv_memory_fraction")
    planned = tuple(k for k in PLANNED_KEYS if k not in given)
    cfg = model_config(run.model)
    if not planned:  # all given: judged with the run's own pool (deferred: the micro-batch was
        check_given_sizes(run, cfg, device)  # given, so parse_sizes_open raised already)
        return run
    rl = run.rl
    choice = sizing.size_colocated(
        cfg, **plan_inputs(run), device_bytes=device,
        micro_batch=None if "trainer.micro_batch_size" in planned else run.trainer.micro_batch_size,
        kv_memory_fraction=None if "serving.kv_memory_fraction" in planned else run.serving.kv_memory_fraction,
        kv_pages=run.serving.kv_pages, remat_policy=run.model.remat_policy,
        remat_policies=sizing.REMAT_BY_SPEED if "model.remat_policy" in planned else (),
        rollouts=rl.prompts_per_step * rl.oversample)
    if choice.problems and planned == ("model.remat_policy",):  # no policy fits the sizes given: the
        check_given_sizes(run, cfg, device)  # start check's arithmetic judges them with the run's policy
        return run
    if choice.problems:
        raise ConfigError(as_flags("invalid config:\n  " + "\n  ".join(choice.problems)))
    print("rstarjax: " + sizing.describe_choice(choice, device_bytes=device, planned=planned,
                                                kv_pages=run.serving.kv_pages), flush=True)
    model = dataclasses.replace(run.model, remat_policy=choice.remat_policy)
    trainer = dataclasses.replace(run.trainer, micro_batch_size=choice.micro_batch)
    serving = run.serving if "serving.kv_memory_fraction" not in planned else dataclasses.replace(
        run.serving, kv_memory_fraction=round(choice.kv_memory_fraction, 6))
    return dataclasses.replace(run, model=model, trainer=trainer, serving=serving)


def init_from_checkpoint(init_from: str) -> tuple[int, dict]:
    """``(step, meta)`` of the newest checkpoint in ``init_from``, the policy a run that only
    samples (this filter, an evaluation) starts from, read before any model is built: one line
    (``StageError``) when it holds none, naming its checkpoints when it is a run's workdir."""
    try:
        return ckpt_lib.read_checkpoint_meta(init_from)
    except FileNotFoundError:
        hint = (ckpt_lib.checkpoint_dir_hint(init_from, "--config.checkpoint.init_from=", hf_advice=(
            f": give it as --config.model.hf_path={init_from}, without --config.checkpoint.init_from"))
                or " (did the previous stage save one?)")
        raise StageError(f"--config.checkpoint.init_from={init_from!r} holds no finished checkpoint{hint}") from None
    except Exception as e:  # noqa: BLE001 - a torn meta (JSONDecodeError, OSError): one line, not a traceback
        raise ckpt_lib.CheckpointError(f"--config.checkpoint.init_from={init_from!r}: its newest checkpoint's "
                                       f"meta does not read ({ckpt_lib._first_line(e)})") from e


def restore_policy(model, init_from: str, mesh) -> tuple[object, int]:
    """``(model, step)``: ``model`` (as built) with the policy of ``init_from``'s newest checkpoint
    in place of its weights, to sample from: a LoRA stage's adapters merged into their base, else
    its params. A checkpoint that does not fit the model (LoRA or not, another shape, another
    base) is a ``StageError`` naming it; damaged arrays an ``UnreadableCheckpoint``."""
    step, meta = init_from_checkpoint(init_from)
    holds_adapters = "lora_base" in meta
    if holds_adapters != bool(model.config.lora_rank):
        raise StageError(f"--config.checkpoint.init_from={init_from!r} holds "
                         + (f"LoRA adapters: give --config.model.lora_rank={meta.get('lora', {}).get('rank', 'R')}"
                            if holds_adapters else "full parameters: unset --config.model.lora_rank"))
    try:
        if holds_adapters:
            model, step = lora_base.restore_lora_policy(model, init_from)
            return lora.merged_model(model, mesh), step
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        shardings = jax.tree.map(lambda x: x.sharding, params)
        params, _, step = ckpt_lib.restore_params(init_from, ckpt_lib.abstract_like(params, shardings), step)
        return nnx.merge(graphdef, params, rest), step
    except ckpt_lib.UnreadableCheckpoint:
        raise
    except ValueError as e:  # a model of another shape (check_structure), a LoRA base that differs
        raise StageError(f"--config.checkpoint.init_from={init_from!r} does not fit the model of "
                         f"--config.model: {e}") from e

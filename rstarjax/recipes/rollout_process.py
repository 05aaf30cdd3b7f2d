"""A rollout process of a disaggregated multi-process RL run (``serving.placement='disaggregated'``
across processes; docs/training.md "Placement"): every process past the training ones builds
the serving engine over all its devices (one slice) and its own code pool, and answers the
training process that drives it (``processes.rollout_processes_of``; ``rl.remote.serve_remote``)
until it says stop. It reads no data and writes no checkpoint: prompts and weights come from
its trainer process, and the training processes hold the run's state.
"""
from __future__ import annotations

import dataclasses
import logging

import jax

from rstarjax import processes
from rstarjax.layout import layout_of
from rstarjax.models.sharding import make_mesh
from rstarjax.recipes import build
from rstarjax.recipes.config import RunConfig
from rstarjax.rl.remote import serve_remote

log = logging.getLogger(__name__)


def is_rollout_process(run: RunConfig) -> bool:
    """Whether this process only rolls out: any past the training processes (0 ..
    ``serving.trainer_processes`` - 1) of a disaggregated multi-process run."""
    return layout_of(run.serving).rolls_out_only


def serve_rollouts(run: RunConfig) -> int:
    """Serve rounds of rollouts to the trainer process until it stops; the rounds served."""
    tokenizer = build.tokenizer(run.model)
    mesh = make_mesh(1, -1, 1, devices=jax.local_devices())
    # the engine's structure: the plain base model (a LoRA policy's adapters arrive merged in the
    # serving copy), its weights replaced by the trainer process's before the first round
    model = build.policy(dataclasses.replace(run.model, lora_rank=0), mesh, run.seed, read_weights=False)
    executor = build.executor(run.rl.num_tool_workers, run.env.allow_unconfined)
    try:
        rollouts = build.rollouts(model, tokenizer, executor, run.agent(), run.rl.sampling(), run.rl.max_prompt_len,
                                  run.rl.chat_format, run.serving)
        del model
        # between two requests come an update, a checkpoint, maybe an evaluation
        rounds = serve_remote(rollouts, wait_s=2 * run.rl.rollout_timeout_s + 3600,
                              trainer=processes.trainer_of(jax.process_index(), run.serving.trainer_processes),
                              silence_s=run.distributed.silence_s)
        log.info("rollout process: served %d rounds", rounds)
        return rounds
    finally:
        executor.close()

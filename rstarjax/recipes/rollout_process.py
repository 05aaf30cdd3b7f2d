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
import signal
import threading

import jax

from rstarjax import processes
from rstarjax.layout import layout_of
from rstarjax.models.sharding import make_mesh
from rstarjax.recipes import build, preemption
from rstarjax.recipes.config import RunConfig
from rstarjax.rl.mailbox import Mailbox, keys_of
from rstarjax.rl.remote import RolloutProcessStopped, architecture_of, report_failure, serve_remote

log = logging.getLogger(__name__)


def is_rollout_process(run: RunConfig) -> bool:
    """Whether this process only rolls out: any past the training processes (0 ..
    ``serving.trainer_processes`` - 1) of a disaggregated multi-process run."""
    return layout_of(run.serving).rolls_out_only


def serve_rollouts(run: RunConfig) -> int:
    """Serve rounds of rollouts to the trainer process until it stops; the rounds served. A
    failure before the first round (the model, the engine, the code pool) is told to the trainer
    process, which waits on this one's start; SIGTERM / SIGINT stop it (jax.distributed's own
    handler would let SIGTERM pass unseen) and are told to the trainer process too, which saves
    its last finished step and stops."""
    replies = Mailbox(keys_of(jax.process_index())[1])
    restore = _stop_on_signals()
    try:
        try:
            return _serve_rollouts(run, replies)
        except RolloutProcessStopped as stop:
            raise preemption.Interrupted(stop.signum, 0, True, False,
                                         done="a rollout process keeps nothing; its training process saves "
                                              "the run's last finished step") from None
    finally:
        restore()


def _serve_rollouts(run: RunConfig, replies: Mailbox) -> int:
    executor = None
    try:
        tokenizer = build.tokenizer(run.model)
        mesh = make_mesh(1, -1, 1, devices=jax.local_devices())
        # the engine's structure: the plain base model (a LoRA policy's adapters arrive merged in
        # the serving copy), its weights replaced by the trainer process's before the first round
        model = build.policy(dataclasses.replace(run.model, lora_rank=0), mesh, run.seed, read_weights=False)
        executor = build.executor(run.rl.num_tool_workers, run.env.allow_unconfined)
        rollouts = build.rollouts(model, tokenizer, executor, run.agent(), run.rl.sampling(),
                                  run.rl.max_prompt_len, run.rl.chat_format, run.serving)
        architecture = architecture_of(model)
        del model
    except BaseException as exc:  # the trainer process waits on this one's start: tell it why not
        report_failure(replies, exc)
        if executor is not None:
            executor.close()
        raise
    try:
        # between two requests come an update, a checkpoint, maybe an evaluation
        rounds = serve_remote(rollouts, wait_s=2 * run.rl.rollout_timeout_s + 3600,
                              trainer=processes.trainer_of(jax.process_index(), run.serving.trainer_processes),
                              silence_s=run.distributed.silence_s, settings=rollout_settings(run),
                              architecture=architecture)
        log.info("rollout process: served %d rounds", rounds)
        return rounds
    finally:
        executor.close()


def rollout_settings(run: RunConfig) -> dict:
    """What a rollout process runs its rollouts with, which its training process must share (it
    trains on their log-probs and rewards): sampling, the episode's budgets and reward, the
    prompt's length and template. Compared at the first message (``rl.remote.RemoteRollouts``)."""
    return {"sampling": dataclasses.asdict(run.rl.sampling()), "agent": dataclasses.asdict(run.agent()),
            "max_prompt_len": run.rl.max_prompt_len, "chat_format": run.rl.chat_format}


def _stop_on_signals():
    """SIGTERM and SIGINT raise ``RolloutProcessStopped`` in the main thread; returns the undo
    (a handler installed outside Python, which signal.signal reports as None, stays replaced)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise RolloutProcessStopped(signum)
    before = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    return lambda: [signal.signal(s, h) for s, h in before.items() if h is not None]

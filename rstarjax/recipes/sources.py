"""The one place that turns an RL stage's config into its rollout source (``rl.sources``): the
only reader of ``rl.partial_rollout_tokens`` and ``rl.max_staleness`` besides the config checks.

| ``partial_rollout_tokens`` | ``max_staleness`` | source |
| --- | --- | --- |
| 0 | 0 | ``SynchronousSource``: the paper's loop |
| > 0 | 0 | ``PartialSource`` |
| any | > 0 | ``AsyncSource`` wrapping either of the above, its rounds on a rollout thread |

``with_transport`` picks the transport from the layout (``rstarjax.layout``); either serves any
mode: in-process engines (``agent_loop.ColocatedRollouts``) or
rollout processes (``remote.RemoteRollouts``). Another mode is one new file: a ``RolloutSource``
and a ``register_mode`` call (tests/toy_rollout_mode.py is one); the stage loop needs no change.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import jax
import numpy as np

from rstarjax import processes
from rstarjax.layout import Layout, layout_of
from rstarjax.recipes import preemption
from rstarjax.recipes.config import RunConfig
from rstarjax.recipes.rollout_process import rollout_settings, serve_rollouts
from rstarjax.rl.remote import RemoteRollouts
from rstarjax.rl.partial import PartialRollouts
from rstarjax.rl.sources.asynchronous import AsyncSource
from rstarjax.rl.sources.base import PausableRollouts, RolloutSource, StagedRollouts
from rstarjax.rl.sources.partial import PartialSource
from rstarjax.rl.sources.synchronous import SynchronousSource
from rstarjax.rl.staleness import AsyncRollouts, rollout_steps_left
from rstarjax.rl.trajectory import RolloutsFailed

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Mode:
    """A rollout mode beyond the built-in ones: used when ``applies(run)``; ``build`` takes
    ``make_source``'s arguments and returns its source."""

    name: str
    applies: Callable[[RunConfig], bool]
    build: Callable[..., RolloutSource]


MODES: list[Mode] = []  # asked in order, before the built-in modes


def register_mode(mode: Mode) -> Callable[[], None]:
    """Add ``mode``; returns the call that removes it again."""
    MODES.append(mode)
    return lambda: MODES.remove(mode)


def make_source(run: RunConfig, rollout_fn, on_update: Callable | None, data_iter, base_key, step: int,
                restart: list, guard: preemption.SignalGuard, version: int = 0) -> RolloutSource:
    """The rollout source of a stage at global step ``step``: ``rollout_fn`` rolls out (a
    ``trajectory.RolloutFn``; partial rollouts need a ``PausableRollouts``, asynchronous ones a
    ``StagedRollouts``), ``on_update(trainer)`` installs new weights in its engines, ``data_iter``
    draws the prompts; ``restart``: the prompts in flight at the checkpoint resumed (rolled out
    first); ``guard``: a stop signal may abandon a step's rollouts (not a rollout thread's round,
    which is never trained); ``version``: the trainer's ``policy_version``, which the engines serve."""
    def guarded(fn):  # the part of a step that a stop signal may abandon; its failure, every process's
        def call(*args, **kwargs):
            with guard.rollouts():
                return fn(*args, **kwargs)
        return failing_together(call)

    for mode in MODES:
        if mode.applies(run):
            return mode.build(run, rollout_fn, on_update, data_iter, base_key, step, restart, guard)
    rl = run.rl
    asynchronous = bool(rl.max_staleness) and step < run.total_steps
    if rl.partial_rollout_tokens:
        if not isinstance(rollout_fn, PausableRollouts):
            raise ValueError("--config.rl.partial_rollout_tokens needs a rollout function that can pause "
                             "rollouts (agent_loop.ColocatedRollouts.partial); this one cannot")
        # on the rollout thread of rl.max_staleness, no stop signal abandons a round: it is not trained
        round_fn = rollout_fn.partial if rl.max_staleness else guarded(rollout_fn.partial)
        partial = PartialRollouts(round_fn, rl.partial_rollout_tokens, prompts_per_process(run),
                                  keeps_kv=not rl.partial_reprefill)
        source = PartialSource(partial, data_iter, list(restart), on_update)
        if restart and not rl.max_staleness:  # (the rollout thread says it)
            _say_restarted(len(restart), step, "they start again from their prompts (their unfinished "
                           "rollouts were never trained)")
    else:
        # prompts in flight at a checkpoint of asynchronous or partial rollouts, resumed without
        # them (or with rl.max_staleness, whose thread takes them): the synchronous steps start them first
        resumed = [] if rl.max_staleness else list(restart)
        partial, source = None, SynchronousSource(guarded(rollout_fn), data_iter, on_update, resumed,
                                                  keeps_in_flight=processes.any_process(bool(resumed)))
        if resumed:
            _say_restarted(len(resumed), step, "the next steps start them first (their unfinished rollouts "
                           "were never trained)")
    if not asynchronous:
        return source
    thread = start_async_rollouts(run, rollout_fn, data_iter, base_key, step, restart, partial, version)
    return AsyncSource(thread, failing_together(thread.next_round), source, rollout_fn, data_iter, run.total_steps,
                       run.trainer.mini_batches)


def with_transport(run: RunConfig, rollout_fn, on_update: Callable | None, train: Callable):
    """Run this process's part of the stage in the run's layout (``rstarjax.layout``): a rollout
    process serves its trainer's rollouts (returns None); a training process of ``ROLLOUT_PROCESSES``
    calls ``train(rollout_fn, on_update)`` with ``rl.remote.RemoteRollouts`` to its rollout processes
    (unless given a ``rollout_fn``); any other with ``rollout_fn`` and ``on_update`` as given (None:
    the stage builds in-process engines)."""
    layout = layout_of(run.serving)
    if layout.rolls_out_only:  # past the training processes: it only rolls out
        serve_rollouts(run)
        return None
    if layout.kind is not Layout.ROLLOUT_PROCESSES or rollout_fn is not None:
        return train(rollout_fn, on_update)
    remote = RemoteRollouts(wait_s=round_wait_s(run), silence_s=run.distributed.silence_s,
                            processes=layout.rollout_processes(), trainers=layout.trainers,
                            settings=rollout_settings(run))
    try:  # its rollout processes stop with this one, whatever ends it
        with processes.training_processes(layout.trainers):
            return train(remote, lambda tr: remote.update_params(tr.served_model()))
    finally:
        remote.close()


def start_async_rollouts(run: RunConfig, rollout_fn, data_iter, base_key, step: int, restart: list,
                         partial: PartialRollouts | None = None, version: int = 0) -> AsyncRollouts:
    """The rollout thread of ``rl.max_staleness`` (``rl.staleness``), from global step ``step``;
    ``restart``: the prompts in flight at the checkpoint resumed (rolled out first); ``partial``:
    each round is one of its rounds (partial rollouts); ``version``: the trainer's ``policy_version``."""
    if not isinstance(rollout_fn, StagedRollouts):
        raise ValueError("--config.rl.max_staleness needs a rollout function whose weights can be staged and "
                         "installed between rounds (agent_loop.ColocatedRollouts); this one cannot")
    # the rounds' seeds: derived from the run key and the step the thread started at (a resumed
    # run samples new rounds), never equal to a synchronous step's; independent on every process
    thread_key = jax.random.fold_in(jax.random.fold_in(base_key, 2**31 - 1), step)  # no step is 2**31 - 1
    if processes.training_count() > 1:
        thread_key = jax.random.fold_in(thread_key, jax.process_index())

    def seed_of(index: int) -> int:
        return int(jax.random.randint(jax.random.fold_in(thread_key, index), (), 0, 2**31 - 1))

    if restart:
        _say_restarted(len(restart), step, "they start again from their prompts (their rollouts were "
                       "never trained)")
    return AsyncRollouts(rollout_fn, data_iter.take, rollout_fn.serve_staged, seed_of, run.rl.max_staleness,
                         prompts_per_process(run), run.rl.rollouts_per_prompt,
                         version=version,
                         remaining=rollout_steps_left(run.total_steps, step, run.trainer.mini_batches),
                         restart=list(restart),
                         wait_s=round_wait_s(run), partial=partial)


def _say_restarted(prompts: int, step: int, what: str) -> None:
    """Say (process 0 prints, as the start line) that a resumed run rolls out again the prompts
    in flight at its checkpoint: work redone, which no metric of the synchronous and asynchronous
    modes counts (partial rollouts log ``partial/restarted_groups``)."""
    message = f"resumed with {prompts} prompts whose rollouts were in flight at step {step}: {what}"
    log.info("%s", message)
    if jax.process_index() == 0:
        print(f"rstarjax: {message}", flush=True)


def prompts_per_process(run: RunConfig) -> int:
    """A step's prompts on this training process: ``rl.prompts_per_step`` split evenly over the
    training processes (each draws its own share)."""
    return run.rl.prompts_per_step // processes.training_count()


def in_flight_record(keeps_in_flight: bool, data_state, pending: list) -> dict:
    """What a checkpoint's meta keeps of the prompts in flight at its step (``pending``; the data
    position ``data_state``): nothing for a source that keeps none (``keeps_in_flight``), the
    prompts for one training process, and with several, where each draws its own prompts, every
    one's data position and prompts in flight too (``process_shares``; the meta is written by
    process 0 alone): a collective, every training process calls it. ``resumed_share`` reads it."""
    if not keeps_in_flight:
        return {}
    record = {"in_flight_records": pending}
    if processes.training_count() > 1:
        record["process_shares"] = processes.gather_json({"data_state": data_state, "in_flight_records": pending})
    return record


def resumed_share(meta: dict) -> tuple[object, list | None]:
    """This training process's data position and prompts in flight in a checkpoint's ``meta``."""
    return own_share(meta, processes.training_count(), jax.process_index())


def own_share(meta: dict, count: int, index: int) -> tuple[object, list | None]:
    """This training process's data position and prompts in flight in a checkpoint's ``meta``
    (process ``index`` of ``count``): its own entry of ``process_shares`` where the run kept one
    per process (partial or asynchronous rollouts on several processes), else the run's
    (``in_flight_records``; ``partial_records`` in earlier checkpoints)."""
    shares = meta.get("process_shares")
    if shares is None:
        return meta.get("data_state"), meta.get("in_flight_records", meta.get("partial_records"))
    if len(shares) != count:
        raise ValueError(f"the checkpoint was written by {len(shares)} training processes with partial or "
                         f"asynchronous rollouts, "
                         f"each with its own data position and prompts in flight; this run has {count}: "
                         f"resume with --config.distributed.num_processes={len(shares)}")
    return shares[index]["data_state"], shares[index]["in_flight_records"]


def round_wait_s(run: RunConfig) -> float:
    """The longest the trainer waits for one round of rollouts: twice the bound the rollouts
    themselves enforce (``rl.rollout_timeout_s``), so that bound fires first and names itself."""
    return 2 * run.rl.rollout_timeout_s + 60


def failing_together(fn: Callable) -> Callable:
    """``fn`` (a call that yields rollouts) that raises ``RolloutsFailed`` on every training
    process when it raised it on one: after each call they agree in one small gather. A process
    whose rollouts failed then never leaves the others waiting in the update's collectives, and
    all of them reach the failure handler at the same step, where they save it together."""
    if processes.training_count() == 1:
        return fn

    def call(*args, **kwargs):
        failure = None
        try:
            out = fn(*args, **kwargs)
        except RolloutsFailed as e:
            failure, out = e, None
        failed = np.flatnonzero(processes.allgather(np.asarray(failure is not None, np.int32))).tolist()
        if failure is not None:
            raise failure
        if failed:
            raise RolloutsFailed(f"the rollouts of training process{'es' if len(failed) > 1 else ''} "
                                 f"{', '.join(map(str, failed))} failed (its log says why)")
        return out
    return call

"""Bounded-staleness asynchronous rollouts (``rl.staleness``) as a rollout source: a rollout
thread (``staleness.AsyncRollouts``) runs the rounds of the source it wraps, synchronous or
partial, up to ``max_staleness`` policy versions ahead of the trainer, which takes finished
rounds in the order they started (as vLLM's ``AsyncScheduler`` wraps its scheduler)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rstarjax.processes import any_process
from rstarjax.rl.sources.base import RolloutSource, StagedRollouts, StepRound
from rstarjax.rl.staleness import AsyncRollouts, rollout_steps_left


@dataclasses.dataclass
class AsyncSource:
    """``thread``: the rollout thread, started; ``next_of``: its ``next_round`` as the training
    processes call it (failing together); ``inner``: the source whose rounds the thread runs (its
    ``settle`` books them); ``engines``: stages each update's weights for the thread to install
    between rounds; ``total_steps``: the stage's last step; ``updates_per_step``: the trainer's
    mini-batches (``total_steps`` counts optimizer updates, the thread rollout batches)."""

    thread: AsyncRollouts
    next_of: Callable
    inner: RolloutSource
    engines: StagedRollouts
    data: object
    total_steps: int
    updates_per_step: int = 1
    keeps_in_flight = True

    def __post_init__(self):
        self.waited: dict = {}

    def next_round(self) -> StepRound | None:
        rnd, self.waited = self.next_of()  # the oldest round the rollout thread finished
        # every process stops together, once one has no round left (with equal data shares all
        # run out at the same round; a round drawn but not trained is kept)
        if any_process(rnd is None):
            return None
        out = rnd.output
        # a partial round comes collected (the thread runs the partial rollouts); any other is
        # already rolled out
        if self.thread.partial is not None:
            return StepRound(rnd.records, partial=out, more_records=lambda: next(self.data), stale=True)
        return StepRound(rnd.records, lambda *_, out=out: out, more_records=lambda: next(self.data), stale=True)

    def settle(self, metrics: dict, version: int, updated: bool) -> dict | None:
        metrics.update(self.waited)
        if not updated:  # no update: the rollout thread goes on with the weights it has
            self.thread.publish(None, version, self.thread.remaining)
        return self.inner.settle(metrics, version, updated)

    def after_update(self, trainer) -> None:
        # the serving copy now (the next update overwrites the params), served between rounds
        self.thread.publish(self.engines.stage_params(trainer.served_model()), trainer.policy_version,
                            rollout_steps_left(self.total_steps, trainer.step, self.updates_per_step))

    def snapshot(self) -> tuple[object, list]:
        return self.thread.snapshot(self.data.get_state)

    def close(self) -> None:
        self.thread.close()

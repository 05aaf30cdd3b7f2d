"""The paper's synchronous loop (rStar2-Agent §4.3): each step rolls out a step's prompts with
the policy the last update made, then trains on them; the engines take the new weights before
the next step's rollouts start."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rstarjax.rl.sources.base import StepRound


@dataclasses.dataclass
class SynchronousSource:
    """``rollouts``: the rollout function (``trajectory.RolloutFn``); ``data``: the stage's prompt
    iterator (``next``, ``get_state``; ``take`` and ``batch_size`` with ``restart``);
    ``on_update(trainer)``: installs new weights in the engines (None: a rollout function that
    needs none, e.g. a scripted one). ``restart``: the prompts in flight at the checkpoint resumed
    (one of asynchronous or partial rollouts, resumed without them): the first steps take them
    before new ones, and until they are all taken a checkpoint keeps the rest
    (``keeps_in_flight``, the same on every training process)."""

    rollouts: Callable
    data: object
    on_update: Callable | None = None
    restart: list = dataclasses.field(default_factory=list)
    keeps_in_flight: bool = False

    def next_round(self) -> StepRound | None:
        if self.restart:
            size = getattr(self.data, "batch_size", None) or len(self.restart)
            records, self.restart = self.restart[:size], self.restart[size:]
            records += self.data.take(size - len(records))
            return StepRound(records, self.rollouts, more_records=lambda: next(self.data))
        try:
            records = next(self.data)
        except StopIteration:  # finite data (data.num_epochs) is used up
            return None
        # dynamic sampling refills from the same iterator, so its checkpointed state covers
        # every prompt a step consumed
        return StepRound(records, self.rollouts, more_records=lambda: next(self.data))

    def settle(self, metrics: dict, version: int, updated: bool) -> dict:
        del version, updated
        return metrics

    def after_update(self, trainer) -> None:
        if self.on_update is not None:
            self.on_update(trainer)

    def snapshot(self) -> tuple[object, list]:
        return self.data.get_state(), list(self.restart)

    def close(self) -> None:
        pass

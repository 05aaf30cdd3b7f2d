"""Partial rollouts (``rl.partial``: Kimi k1.5, arXiv 2501.12599, §2.6.2) as a rollout source:
each step starts as many new prompts as there is room for, continues the paused rollouts, and
trains the groups that completed. A round that completed none trains nothing: its work (times,
counts) is added to the step that trains it."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rstarjax.rl.partial import PartialRollouts
from rstarjax.rl.sources.base import StepRound
from rstarjax.processes import any_process

# the per-round figures that add up over the rounds of one partial-rollout step
ROUND_SUMS = ("timing/rollout_generated_tokens", "timing/rollout_decode_steps", "timing/rollout_prefill_tokens",
              "timing/rollout_decode_calls", "timing/rollout_preemptions",
              "timing/rollout_decode_kv_tokens")


def add_times(metrics: dict, times: dict) -> dict:
    """``metrics`` with the seconds (``time/*``, ``timing/*_s``) and the counts of ``ROUND_SUMS``
    of ``times`` added to its own: the rounds of one partial-rollout step are one step's work."""
    out = dict(metrics)
    for k, v in times.items():
        if k.startswith("time/") or (k.startswith("timing/") and k.endswith("_s")) or k in ROUND_SUMS:
            out[k] = out.get(k, 0.0) + float(v)
    return out


@dataclasses.dataclass
class RoundBook:
    """The rounds of partial rollouts since the last update: how many, their times, and the
    groups restarted from a checkpoint (reported with the first update)."""

    restarted: int = 0
    rounds: int = 0
    times: dict = dataclasses.field(default_factory=dict)

    def settle(self, metrics: dict, updated: bool) -> dict | None:
        self.rounds += 1
        if not updated and not metrics.get("partial/groups_trained"):
            # no group has finished all its rollouts yet: the next round goes on with them (its
            # time counts in the step that trains them)
            self.times = add_times(self.times, metrics)
            return None
        if updated:
            metrics["partial/restarted_groups"], self.restarted = float(self.restarted), 0
            metrics["partial/rounds"] = float(self.rounds)
            metrics, self.times, self.rounds = add_times(metrics, self.times), {}, 0
        return metrics


@dataclasses.dataclass
class PartialSource:
    """``partial``: the groups in flight and the paused rollouts (its ``round_fn`` rolls out);
    ``data``: the prompt iterator (``take``, ``get_state``); ``restart``: the prompts in flight at
    the checkpoint resumed (started first); ``on_update`` as ``SynchronousSource``'s."""

    partial: PartialRollouts
    data: object
    restart: list = dataclasses.field(default_factory=list)
    on_update: Callable | None = None
    keeps_in_flight = True

    def __post_init__(self):
        self.book = RoundBook(restarted=len(self.restart))

    def next_round(self) -> StepRound | None:
        # a step's new prompts, fewer while complete groups wait for an update
        room = self.partial.room
        records, self.restart = self.restart[:room], self.restart[room:]
        records += self.data.take(room - len(records))
        # every process stops together, once none has a prompt left to roll out or train
        # (one that has none joins the others' updates with padding rows)
        if not any_process(bool(records or self.partial.groups or self.partial.ready)):
            return None
        return StepRound(records, partial=self.partial, more_records=lambda: next(self.data))

    def settle(self, metrics: dict, version: int, updated: bool) -> dict | None:
        del version
        return self.book.settle(metrics, updated)

    def after_update(self, trainer) -> None:
        if self.on_update is not None:
            self.on_update(trainer)

    def snapshot(self) -> tuple[object, list]:
        return self.data.get_state(), self.partial.pending_records() + self.restart

    def close(self) -> None:
        pass

"""A toy rollout mode in one file, as a new mode would be added: a ``RolloutSource`` that rolls
out the same fixed prompts every step (a tiny overfitting set), registered with
``recipes.sources.register_mode``. Nothing in ``recipes/rl.py`` knows of it."""
from __future__ import annotations

import dataclasses

from rstarjax.recipes import sources
from rstarjax.rl.sources import StepRound


@dataclasses.dataclass
class FixedPromptsSource:
    """Every step rolls out ``prompts`` with ``rollouts``; logs what the stage loop asked of it."""

    prompts: list
    rollouts: object
    data: object
    keeps_in_flight = False

    def __post_init__(self):
        self.calls: list[str] = []

    def next_round(self) -> StepRound:
        self.calls.append("next_round")
        return StepRound(list(self.prompts), self.rollouts)

    def settle(self, metrics: dict, version: int, updated: bool) -> dict:
        self.calls.append(f"settle {version} {updated}")
        metrics["toy/rounds"] = 1.0
        return metrics

    def after_update(self, trainer) -> None:
        self.calls.append(f"after_update {trainer.step}")

    def snapshot(self) -> tuple[object, list]:
        return self.data.get_state(), []

    def close(self) -> None:
        self.calls.append("close")


def register(prompts: list) -> tuple[list, callable]:
    """Register the toy mode for every run until the returned call removes it; the list fills
    with the source it builds."""
    built = []

    def build(run, rollout_fn, on_update, data_iter, base_key, step, restart, guard):
        built.append(FixedPromptsSource(prompts, rollout_fn, data_iter))
        return built[-1]

    return built, sources.register_mode(sources.Mode("fixed-prompts", lambda run: True, build))

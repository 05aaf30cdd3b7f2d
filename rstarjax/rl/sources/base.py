"""The protocol every rollout mode implements for the stage loop (``recipes.rl``), and the
capabilities a rollout function may declare beyond ``trajectory.RolloutFn``.

A stage asks its source, once per step: ``next_round`` (the prompts and what rolls them out; None
once the data ran out on every process), runs ``rl.step.rl_step`` on it, tells the source how
it went (``settle``), hands new weights over after an update (``after_update``), and checkpoints
what ``snapshot`` returns. ``close`` stops whatever the source runs in the background.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class PausableRollouts(Protocol):
    """A rollout function that can also pause its rollouts at a token budget and continue them
    in a later round (partial rollouts; ``agent_loop.ColocatedRollouts.partial``)."""

    def partial(self, records, n_per_prompt: int, seed: int, policy_version: int, *, token_budget: int,
                carried=(), group_ids=None, keep_kv: bool = True): ...


@runtime_checkable
class StagedRollouts(Protocol):
    """A rollout function whose new weights can be staged now (the serving copy, made before the
    next update overwrites the params) and served later, between rounds (asynchronous rollouts;
    ``agent_loop.ColocatedRollouts``, ``remote.RemoteRollouts``)."""

    def stage_params(self, model_or_state) -> object: ...

    def serve_staged(self, staged) -> None: ...


@dataclasses.dataclass
class StepRound:
    """One step's work as a source hands it to ``rl_step``: the prompts it starts (or, rolled
    out already, trains) and what rolls them out: ``rollouts``, a ``RolloutFn`` called once per
    round, or with partial rollouts ``partial``, a ``partial.PartialRollouts`` (or a
    ``partial.CollectedRound`` a rollout thread ran) that collects the groups completed across
    steps; where dynamic sampling draws more prompts, and whether an older policy may have
    sampled them (``stale``: asynchronous rollouts)."""

    records: list
    rollouts: object = None
    more_records: Callable[[], list] | None = None
    stale: bool = False
    partial: object = None


class RolloutSource(Protocol):
    """One rollout mode, as the stage loop sees it."""

    # whether a checkpoint records the prompts in flight (``snapshot``'s second half): the modes
    # whose rollouts outlive a step (partial, asynchronous)
    keeps_in_flight: bool

    def next_round(self) -> StepRound | None:
        """The next step's round; None once no process has a prompt left (every process stops
        together where the mode needs it to)."""

    def settle(self, metrics: dict, version: int, updated: bool) -> dict | None:
        """``rl_step``'s ``metrics`` for the round, with the mode's own figures (``version``: the
        policy the trainer holds now; ``updated``: whether the step made it); None: the round
        trained nothing yet and its work counts in the step that trains it (partial rollouts)."""

    def after_update(self, trainer) -> None:
        """Hand the policy ``trainer`` just updated to the engines (now, or staged for later)."""

    def snapshot(self) -> tuple[object, list]:
        """What a checkpoint of the last finished step keeps: the data position, and the prompts
        in flight (rolled out again first on resume; their rollouts were never trained)."""

    def close(self) -> None:
        """Stop what runs in the background (nothing, for the synchronous modes)."""


"""Partial rollouts in the RL loop (Kimi k1.5, arXiv 2501.12599, §2.6.2; ``rl.partial_rollout_tokens``).

Each step's rollouts run with a token budget: a rollout that samples that many tokens in the
step without finishing is paused (``serving.scheduler``: its tokens, log-probs and RNG position
are kept) and continued in the next step under the weights trained since, decoding on from the
KV it kept (``keeps_kv``, the default) or re-prefilled. Long tails then stop setting the step time: the step ends when every
rollout has finished or spent its budget.

A prompt's group is trained once all its rollouts have finished, so RoC and the advantages
always see whole groups (``PartialRollouts.collect``). Each step starts a step's worth of new
prompts (as Kimi k1.5 does), so in the steady state as many groups finish as start, and trains
at most one step's groups, oldest first: the update keeps its configured shape (a step with
fewer complete groups pads, as a step with rejected groups does). Complete groups beyond that
wait for the next step, and while they do, fewer new prompts start (``room``): the queue stays
under one step's groups. A group finishes within ceil(max_response_len / budget) rounds (every
unfinished rollout samples its budget each round), which bounds the groups in flight.

Every model token keeps the policy version that sampled it (``Trajectory.version_starts``).
Its sampler log-prob is that policy's: the behaviour policy of the off-policy correction
(``loss.tis_cap``'s truncated importance weight), while the trainer's old log-probs are
recomputed at the update (``trainer.recompute_old_logprobs``). The sampler/trainer log-prob gap
alarm counts only the tokens the policy being trained sampled on a context it computed
(``fresh_token_mask``): the others differ by design.

Checkpoints: the records of groups in flight are saved with the step and start again from their
prompts on resume; their unfinished rollouts, never trained, are dropped (counted in
``partial/restarted_groups``). No rollout is trained twice.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from rstarjax.rl.trajectory import Trajectory


@dataclasses.dataclass
class GroupInFlight:
    """One prompt's rollouts while some are still decoding."""

    record: Mapping
    size: int  # rollouts per prompt
    finished: list[Trajectory] = dataclasses.field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.finished) == self.size


@dataclasses.dataclass
class PartialRollouts:
    """The rollout side of an RL stage with partial rollouts: the groups in flight and the paused
    rollouts between steps.

    ``round_fn``: ``ColocatedRollouts.partial`` (or one with its signature: records, rollouts
    per prompt, seed, policy version, keyword ``token_budget``, ``carried``, ``group_ids``,
    ``keep_kv`` -> ``agent_loop.RolloutRound``). ``groups_per_update``: this process's prompts
    per step."""

    round_fn: Callable
    token_budget: int
    groups_per_update: int
    # paused rollouts keep their KV (passed to ``round_fn`` as ``keep_kv``; False: re-prefilled):
    # a carried one then decodes on from KV older weights wrote, so no token of its is exactly the
    # current policy's, and the gap alarm leaves it out
    keeps_kv: bool = True
    groups: dict[int, GroupInFlight] = dataclasses.field(default_factory=dict)  # decoding
    ready: list[GroupInFlight] = dataclasses.field(default_factory=list)  # complete, not yet trained
    paused: list = dataclasses.field(default_factory=list)
    next_key: int = 0

    def __post_init__(self):
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if self.groups_per_update < 1:
            raise ValueError(f"groups_per_update must be >= 1, got {self.groups_per_update}")

    @property
    def room(self) -> int:
        """New prompts the next step starts: one step's, less the complete groups still waiting
        for an update."""
        return max(0, self.groups_per_update - len(self.ready))

    def pending_records(self) -> list:
        """The records of the groups not yet trained (waiting, then decoding, oldest first):
        what a checkpoint keeps (they start again from their prompts on resume)."""
        return [g.record for g in self.ready] + [self.groups[k].record for k in sorted(self.groups)]

    def collect(self, records: Sequence[Mapping], rollouts_per_prompt: int, seed: int, version: int
                ) -> tuple[list, list[Trajectory], dict[str, float]]:
        """One step's rollouts: start ``records`` (at most ``room``), continue the paused ones
        under policy ``version``, and return at most ``groups_per_update`` complete groups, first
        complete first trained (a round's own in the order they started): their records, their trajectories (``group_id`` = the position of the
        record, each group in sample order) and the round's figures. ``begin``, ``roll`` and
        ``finish`` in turn (a rollout thread runs ``roll`` outside its lock)."""
        keys = self.begin(records, rollouts_per_prompt)
        return self.finish(self.roll(records, keys, rollouts_per_prompt, seed, version), len(records))

    def begin(self, records: Sequence[Mapping], rollouts_per_prompt: int) -> list[int]:
        """Register ``records`` as groups in flight (from now on ``pending_records`` lists them);
        their keys, for ``roll``."""
        if len(records) > self.room:
            raise ValueError(f"{len(records)} new prompts but room for {self.room} "
                             f"({len(self.ready)} complete groups wait, of {self.groups_per_update} per step)")
        keys = list(range(self.next_key, self.next_key + len(records)))
        self.next_key += len(records)
        for key, record in zip(keys, records):
            self.groups[key] = GroupInFlight(record, rollouts_per_prompt)
        return keys

    def roll(self, records: Sequence[Mapping], keys: Sequence[int], rollouts_per_prompt: int, seed: int,
             version: int):
        """The round itself: ``records`` (registered as ``keys``) start, the paused rollouts go on,
        each for at most ``token_budget`` tokens under policy ``version``. Changes no state here."""
        return self.round_fn(list(records), rollouts_per_prompt, seed, version, token_budget=self.token_budget,
                             carried=self.paused, group_ids=list(keys), keep_kv=self.keeps_kv)

    def finish(self, rnd, started: int) -> tuple[list, list[Trajectory], dict[str, float]]:
        """Book round ``rnd`` (``roll``'s ``RolloutRound``, which started ``started`` new prompts)
        and return what ``collect`` does."""
        carried = len(self.paused)
        self.paused = list(rnd.paused)
        for traj in rnd.finished:
            self.groups[int(traj.group_id)].finished.append(traj)
        done = [k for k in sorted(self.groups) if self.groups[k].complete]
        self.ready += [self.groups.pop(k) for k in done]
        trained, self.ready = self.ready[:self.groups_per_update], self.ready[self.groups_per_update:]
        out_records, trajs = [], []
        for position, group in enumerate(trained):
            out_records.append(group.record)
            members = sorted(group.finished, key=lambda t: t.sample_index)
            trajs += [dataclasses.replace(t, group_id=position) for t in members]
        figures = dict(rnd.timings)
        figures.update({"partial/groups_started": float(started),
                        "partial/groups_completed": float(len(done)),
                        "partial/groups_trained": float(len(trained)),
                        "partial/groups_waiting": float(len(self.ready)),
                        "partial/groups_in_flight": float(len(self.groups)),
                        "partial/rollouts_carried": float(carried),
                        "partial/rollouts_paused": float(len(self.paused))})
        return out_records, trajs, figures

    @property
    def busy(self) -> bool:
        """Whether a group is still decoding or waiting for an update."""
        return bool(self.groups or self.ready)


@dataclasses.dataclass
class CollectedRound:
    """A round of partial rollouts that a rollout thread already ran (``rl.max_staleness`` with
    partial rollouts): what ``PartialRollouts.collect`` returned, handed to ``rl_step`` in its
    place (``collect`` gives it back)."""

    records: list
    trajectories: list[Trajectory]
    figures: dict[str, float]
    groups_per_update: int
    keeps_kv: bool

    def collect(self, records, rollouts_per_prompt, seed, version):
        del records, rollouts_per_prompt, seed, version  # rolled out already
        return self.records, self.trajectories, self.figures


def policy_lag_metrics(trajectories: Sequence[Trajectory], version: int, prefix: str = "partial/"
                       ) -> dict[str, float]:
    """How many policy versions (``Trainer.policy_version``: RL updates of a rollout batch)
    behind ``version`` (the policy being trained) the trained model tokens
    were sampled: the maximum and the token mean, and the share of tokens sampled by an older
    policy (under ``prefix``: ``partial/`` or, asynchronous rollouts, ``async/``)."""
    versions = [t.model_token_versions for t in trajectories]
    lags = version - np.concatenate(versions) if versions else np.zeros(0, np.int32)
    if not lags.size:
        lags = np.zeros(1, np.int32)
    return {f"{prefix}policy_lag_max": float(lags.max()), f"{prefix}policy_lag_mean": float(lags.mean()),
            f"{prefix}stale_token_frac": float(np.mean(lags > 0))}


def fresh_token_mask(trajectories: Sequence[Trajectory], placements: Sequence, version: int,
                     num_rows: int, seq_len: int, kept_kv: bool = True) -> np.ndarray:
    """float32[num_rows, seq_len]: 1 on the model tokens that policy ``version`` sampled on a
    context it computed, where ``batch.build_train_batch`` placed them (``placements``; a
    truncated response is cut the same way). The sampler/trainer log-prob gap is measured there
    only. ``kept_kv``: a rollout continued across an update attended to KV older weights wrote,
    so none of its tokens counts; re-prefilled, its tokens from the resume on do."""
    mask = np.zeros((num_rows, seq_len), np.float32)
    for traj, place in zip(trajectories, placements):
        prompt_len = len(traj.prompt_ids)
        fresh = (traj.token_versions == version).astype(np.float32)
        if kept_kv and (traj.policy_version != version or traj.version_starts):
            fresh[:] = 0.0
        room = place.length - prompt_len
        first = place.start + prompt_len
        mask[place.row, first:first + room] = fresh[:room]
    return mask

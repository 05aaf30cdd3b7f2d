"""The Trajectory: one multi-turn rollout, token-in/token-out, and the rollout contract.

This is the hand-off between the rollout loop (producer: ``RolloutFn``, e.g.
``agent_loop.ColocatedRollouts``) and RoC / batching / the trainer (consumers). Generated text
is never re-tokenized: the ids here are exactly what the engine sampled (model segments) or
appended (tool segments). The rollouts of one prompt share a ``group_id``; ``group_indices``
is the one place that groups them.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np


class SegmentKind(str, enum.Enum):
    MODEL = "model"  # sampled by the policy: trained on (loss mask 1)
    TOOL = "tool"  # appended by the environment / chat template: not trained on (loss mask 0)


class FinishReason(str, enum.Enum):
    """How an episode ended (``Trajectory.finish``)."""

    ANSWERED = "answered"  # the model ended a turn with an answer (no further tool call)
    NO_TOOL_CALL = "no_tool_call"  # a turn ended without a tool call and without an <answer>
    MAX_TURNS = "max_turns"
    MAX_LENGTH = "max_length"  # response budget exhausted: truncated, reward 0
    # an infrastructure failure (code environment, verifier, a wait that timed out): the episode
    # ended cleanly, and the trainer excludes it from the update (not the model's error)
    ERROR = "error"


@dataclasses.dataclass
class Segment:
    kind: SegmentKind
    ids: np.ndarray  # int32[n]
    logprobs: np.ndarray | None = None  # f32[n] for MODEL segments, as sampled

    def __post_init__(self):
        self.ids = np.asarray(self.ids, np.int32)
        if self.logprobs is not None:
            self.logprobs = np.asarray(self.logprobs, np.float32)
            if self.logprobs.shape != self.ids.shape:
                raise ValueError(f"logprobs {self.logprobs.shape} != ids {self.ids.shape}")
        elif self.kind == SegmentKind.MODEL:
            raise ValueError("a model segment needs the sampled log-probs")


@dataclasses.dataclass
class ToolErrorCounts:
    """Tool calls that failed, by kind (rStar2-Agent §2.1: parse error, execution error, timeout)."""

    parse: int = 0  # malformed JSON, unknown tool, missing arguments
    execution: int = 0  # the code raised
    timeout: int = 0

    @property
    def total(self) -> int:
        return self.parse + self.execution + self.timeout


@dataclasses.dataclass
class Trajectory:
    prompt_ids: np.ndarray  # int32[P]
    segments: list[Segment]
    turns: int = 0
    tool_calls: int = 0
    tool_errors: ToolErrorCounts = dataclasses.field(default_factory=ToolErrorCounts)
    answer_tags: int = 0  # number of <answer> blocks in the model's text
    finish: FinishReason = FinishReason.ERROR
    reward: float = 0.0
    group_id: int = 0
    sample_index: int = 0  # which of its group's rollouts (request order)
    policy_version: int = 0  # the policy that sampled its first token
    # partial rollouts (rl.partial_rollout_tokens): (model tokens sampled before, version) from
    # where a later policy sampled it on, one per resume under new weights; empty: every token
    # is ``policy_version``'s
    version_starts: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    response_text: str = ""  # decoded model + tool text, for logs
    # the text the verifier was given (the model's own text; the official reward's whole decoded
    # response), None when the rollout was not verified (cut at its length, or an error): where
    # evaluation reads each sample's answer, so a vote is the answer its reward judged
    graded_text: str | None = None
    error: str = ""  # with Finish.ERROR: which part of the infrastructure failed, and how

    @property
    def response_ids(self) -> np.ndarray:
        if not self.segments:
            return np.zeros((0,), np.int32)
        return np.concatenate([s.ids for s in self.segments])

    @property
    def loss_mask(self) -> np.ndarray:
        """1.0 on model-sampled tokens, 0.0 on tool / template tokens."""
        if not self.segments:
            return np.zeros((0,), np.float32)
        return np.concatenate(
            [np.full(len(s.ids), s.kind == SegmentKind.MODEL, np.float32) for s in self.segments]
        )

    @property
    def sampled_logprobs(self) -> np.ndarray:
        """Sampler log-probs aligned with response_ids (0 on tool tokens)."""
        if not self.segments:
            return np.zeros((0,), np.float32)
        return np.concatenate(
            [s.logprobs if s.logprobs is not None else np.zeros(len(s.ids), np.float32) for s in self.segments]
        )

    @property
    def num_model_tokens(self) -> int:
        return int(sum(len(s.ids) for s in self.segments if s.kind == SegmentKind.MODEL))

    @property
    def model_token_versions(self) -> np.ndarray:
        """int32[num_model_tokens]: the policy version that sampled each model token, in order
        (``policy_version``, then each ``version_starts`` entry from its token on)."""
        out = np.full(self.num_model_tokens, self.policy_version, np.int32)
        for first, version in self.version_starts:
            out[first:] = version
        return out

    @property
    def token_versions(self) -> np.ndarray:
        """int32 aligned with ``response_ids``: each model token's policy version, -1 on tool
        tokens."""
        out = np.full(len(self.response_ids), -1, np.int32)
        out[self.loss_mask > 0] = self.model_token_versions
        return out

    @property
    def truncated(self) -> bool:
        return self.finish == FinishReason.MAX_LENGTH

    @property
    def infra_error(self) -> bool:
        """Ended by the infrastructure, not the model: excluded from training and counted."""
        return self.finish == FinishReason.ERROR


# A rollout function: (problem records, rollouts per prompt, seed, policy version) ->
# Trajectories with ``group_id`` = the index of their record in the list, optionally with a dict
# of already-namespaced figures (timings, engine / tool statistics). ``agent_loop.ColocatedRollouts``
# is the real one; tests pass deterministic stand-ins.
RolloutFn = Callable[[list, int, int, int], Union[list, tuple[list, Mapping[str, Any]]]]


class RolloutsFailed(RuntimeError):
    """A ``RolloutFn`` could not produce its round for a reason of the infrastructure, not of the
    model (a rollout process that died or stopped answering): the RL loop saves the last step it
    finished and stops with this error."""


def trajectories_of(rollout_output) -> list:
    """The trajectories of a ``RolloutFn``'s answer (with or without its figures)."""
    return list(rollout_output[0] if isinstance(rollout_output, tuple) else rollout_output)


def group_indices(group_ids: Sequence[int], num_groups: int | None = None) -> dict[int, list[int]]:
    """Positions of each group's members, by ascending group id, each group in the given order.

    With ``num_groups`` every id in [0, num_groups) is a key (a group with no member maps to
    []), and an id outside that range raises.
    """
    groups: dict[int, list[int]] = {g: [] for g in range(num_groups)} if num_groups is not None else {}
    for i, g in enumerate(group_ids):
        g = int(g)
        if num_groups is not None and not 0 <= g < num_groups:
            raise ValueError(f"trajectory group_id={g} outside [0, {num_groups})")
        groups.setdefault(g, []).append(i)
    return dict(sorted(groups.items()))

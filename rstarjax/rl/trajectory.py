"""The Trajectory: one multi-turn rollout, token-in/token-out.

This is the hand-off between the rollout loop (producer) and RoC / batching / the trainer
(consumers). Generated text is never re-tokenized: the ids here are exactly what the engine
sampled (model segments) or appended (tool segments).
"""
from __future__ import annotations

import dataclasses
import enum

import numpy as np


class SegmentKind(str, enum.Enum):
    MODEL = "model"  # sampled by the policy: trained on (loss mask 1)
    TOOL = "tool"  # appended by the environment / chat template: not trained on (loss mask 0)


class Finish(str, enum.Enum):
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
    finish: Finish = Finish.ERROR
    reward: float = 0.0
    group_id: int = 0
    policy_version: int = 0
    response_text: str = ""  # decoded model + tool text, for logs and verification
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
    def truncated(self) -> bool:
        return self.finish == Finish.MAX_LENGTH

    @property
    def infra_error(self) -> bool:
        """Ended by the infrastructure, not the model: excluded from training and counted."""
        return self.finish == Finish.ERROR

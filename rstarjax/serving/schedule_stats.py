"""What a rollout run reports (``RolloutScheduler.run``): per decode call a ``StepRecord``, per
slice a ``SliceStats``, for the run a ``ScheduleStats`` with the rollouts it paused at their
token budget (partial rollouts) and the figures the RL loop logs as ``timing/rollout_*``.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class StepRecord:
    """One decode call of a slice."""

    t: float  # seconds since the run started
    steps: int  # decode steps the call ran
    pages_in_use: int  # after the call's steps, before the rollouts that finished in it gave pages back
    live: int  # rollouts holding pages during the call (decoding or waiting on a tool)
    decoding: int  # rollouts the call decoded
    waiting: int  # admitted, waiting on a tool
    parked: int  # preempted, waiting to resume
    queued: int  # rollouts not yet admitted (this slice's source)
    preemptions: int  # so far in this run


@dataclasses.dataclass
class SliceStats:
    busy_s: float = 0.0  # inside engine programs
    decode_s: float = 0.0  # of which in decode calls (the rest: prefill and extend feeds)
    episodes: int = 0
    decode_steps: int = 0  # steps run by decode calls (the slice's makespan in steps)
    decode_calls: int = 0
    host_syncs: int = 0
    generated_tokens: int = 0  # tokens sampled by decode steps (prefill first tokens excluded)
    # KV positions those steps attended to, summed over rows and steps: with decode_steps (one
    # weight read each) what the steps had to read, for their HBM roofline (gpu_check.py)
    decode_kv_tokens: int = 0
    tool_wait_s: float = 0.0  # summed over tool calls: dispatch -> ids ready
    tool_blocked_s: float = 0.0  # the slice had nothing to decode and waited on tool calls
    prefill_tokens: int = 0
    preemptions: int = 0
    reserve_tokens: int = 0  # the adaptive growth reserve at the run's end (0 if never raised)
    paused: list = dataclasses.field(default_factory=list)  # rollouts out of token budget
    timeline: list[StepRecord] = dataclasses.field(default_factory=list)

    @property
    def max_pages_in_use(self) -> int:
        return max((r.pages_in_use for r in self.timeline), default=0)

    @property
    def mean_live(self) -> float:
        """Rollouts holding pages, averaged over decode steps."""
        steps = sum(r.steps for r in self.timeline)
        return sum(r.live * r.steps for r in self.timeline) / steps if steps else 0.0

    @property
    def mean_live_while_queued(self) -> float:
        """Rollouts holding pages, averaged over the decode steps taken while more rollouts
        waited to be admitted: how many the slice holds at once when work is available."""
        busy = [r for r in self.timeline if r.queued]
        steps = sum(r.steps for r in busy)
        return sum(r.live * r.steps for r in busy) / steps if steps else 0.0


@dataclasses.dataclass
class ScheduleStats:
    makespan_s: float
    slices: list[SliceStats]

    @property
    def paused(self) -> list:
        """Rollouts this run paused at its token budget (each with its ``.episode`` and
        ``.n_sampled``, the tokens it sampled so far; ``.held_by`` set while its slot keeps its
        KV): pass them to the next ``run(..., carried=...)``."""
        return [r for s in self.slices for r in s.paused]

    @property
    def busy_fraction(self) -> list[float]:
        return [s.busy_s / self.makespan_s if self.makespan_s > 0 else 0.0 for s in self.slices]

    @property
    def tool_blocked_fraction(self) -> list[float]:
        """Per slice, the share of the run it could decode nothing and waited on tool calls."""
        return [s.tool_blocked_s / self.makespan_s if self.makespan_s > 0 else 0.0 for s in self.slices]

    def as_dict(self) -> dict[str, float]:
        total = lambda name: float(sum(getattr(s, name) for s in self.slices))  # noqa: E731
        return {
            "makespan_s": self.makespan_s,
            "busy_fraction_mean": float(np.mean(self.busy_fraction)),
            "decode_s": total("decode_s"),
            "prefill_s": total("busy_s") - total("decode_s"),
            "tool_wait_s": total("tool_wait_s"),
            # the decode slices' idle share of the run (no engine program running), and the part
            # of it spent with nothing to decode but tool calls to wait for
            "idle_fraction_mean": 1.0 - float(np.mean(self.busy_fraction)),
            "tool_blocked_fraction_mean": float(np.mean(self.tool_blocked_fraction)),
            "decode_steps": total("decode_steps"),
            "max_slice_steps": float(max(s.decode_steps for s in self.slices)),
            "prefill_tokens": total("prefill_tokens"),
            "decode_calls": total("decode_calls"),
            "host_syncs": total("host_syncs"),
            "generated_tokens": total("generated_tokens"),
            "decode_kv_tokens": total("decode_kv_tokens"),
            "preemptions": total("preemptions"),
            "reserve_tokens_max": float(max(s.reserve_tokens for s in self.slices)),
            "paused": float(sum(len(s.paused) for s in self.slices)),
            "max_pages_in_use": float(max(s.max_pages_in_use for s in self.slices)),
            "mean_live": float(sum(s.mean_live for s in self.slices)),
            "mean_live_while_queued": float(sum(s.mean_live_while_queued
                                                for s in self.slices)),
            "max_live": float(sum(max((r.live for r in s.timeline), default=0)
                                  for s in self.slices)),
        }

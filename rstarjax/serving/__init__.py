"""rstarjax.serving: slot engine (JetStream contract + extend), sampling, scheduler, generate."""
from rstarjax.serving.engine import DecodeState, DoneReason, Engine, Prefix, ResultTokens, SlotToken
from rstarjax.serving.generate import Completion, generate
from rstarjax.serving.sampling import SamplingParams
from rstarjax.serving.scheduler import RolloutScheduler, ScheduleStats, capacity_for

__all__ = ["Completion", "DecodeState", "DoneReason", "Engine", "Prefix", "ResultTokens",
           "RolloutScheduler", "SamplingParams", "ScheduleStats", "SlotToken", "capacity_for",
           "generate"]

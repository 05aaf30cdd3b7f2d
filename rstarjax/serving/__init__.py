"""rstarjax.serving: paged slot engine (JetStream contract + extend), page accounting, sizing,
sampling, the rollout scheduler (the one drive loop) and generate."""
from rstarjax.serving.engine import (DecodeBlock, DecodeState, DoneReason, Engine, Prefix,
                                     ResultTokens, SlotToken, StartRequest)
from rstarjax.serving.generate import Completion, generate
from rstarjax.serving.pages import OutOfPages, PagePool
from rstarjax.serving.sampling import SamplingParams
from rstarjax.serving.scheduler import RolloutScheduler, ScheduleStats, capacity_for
from rstarjax.serving.sizing import KVPlan, plan_kv
from rstarjax.serving.slices import slice_meshes

__all__ = ["Completion", "DecodeBlock", "DecodeState", "DoneReason", "Engine", "KVPlan",
           "OutOfPages", "PagePool", "Prefix", "ResultTokens", "RolloutScheduler",
           "SamplingParams", "ScheduleStats", "SlotToken", "StartRequest", "capacity_for",
           "generate", "plan_kv", "slice_meshes"]

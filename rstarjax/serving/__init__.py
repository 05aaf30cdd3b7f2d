"""rstarjax.serving: the paged slot engine (native ``start / decode / extend_many``; JetStream's
contract in ``jetstream_contract``), its device programs, page and slot accounting, placement,
the weight hand-off, sizing, sampling, the rollout scheduler (the one drive loop), serving
slices and their config, and batch completion (``generate``)."""
from rstarjax.serving.colocated import ColocatedEngines, ServingConfig
from rstarjax.serving.completions import Completion, generate
from rstarjax.serving.engine import Engine
from rstarjax.serving.programs import DecodeBlock, SlotToken
from rstarjax.serving.jetstream_contract import JetStreamContractEngine, Prefix, ResultTokens
from rstarjax.serving.pages import OutOfPages, PagePool, SlotTable
from rstarjax.serving.programs import DecodeState, DoneReason
from rstarjax.serving.sampling import SamplingParams
from rstarjax.serving.schedule_stats import ScheduleStats
from rstarjax.serving.scheduler import RolloutScheduler, capacity_for
from rstarjax.serving.sizing import KVPlan, plan_kv
from rstarjax.serving.slices import slice_meshes
from rstarjax.serving.start_plan import StartRequest

__all__ = ["ColocatedEngines", "Completion", "DecodeBlock", "DecodeState", "DoneReason", "Engine",
           "JetStreamContractEngine", "KVPlan", "OutOfPages", "PagePool", "Prefix",
           "ResultTokens", "RolloutScheduler", "SamplingParams", "ScheduleStats",
           "ServingConfig", "SlotTable", "SlotToken", "StartRequest", "capacity_for",
           "generate", "plan_kv", "slice_meshes"]

"""rstarjax.serving: slot engine (JetStream contract + extend), sampling, scheduler, generate."""
from rstarjax.serving.engine import DecodeState, DoneReason, Engine, Prefix, ResultTokens, SlotToken
from rstarjax.serving.generate import Completion, generate
from rstarjax.serving.sampling import SamplingParams

__all__ = ["Completion", "DecodeState", "DoneReason", "Engine", "Prefix", "ResultTokens",
           "SamplingParams", "SlotToken", "generate"]

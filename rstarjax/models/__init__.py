"""rstarjax.models: Flax NNX Qwen3/Qwen2.5 policy, sharding, HF I/O, tokenizer, chat template."""
from rstarjax.models.config import PRESETS, ModelConfig
from rstarjax.models.hf import load_hf, save_hf
from rstarjax.models.qwen3 import Qwen3
from rstarjax.models.tokenizer import load_tokenizer

__all__ = ["ModelConfig", "PRESETS", "Qwen3", "load_hf", "save_hf", "load_tokenizer"]

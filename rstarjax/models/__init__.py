"""rstarjax.models: Flax NNX Qwen3/Qwen2.5 policy, KV cache, sharding, HF I/O, tokenizer."""
from rstarjax.models.config import ModelConfig, PRESETS
from rstarjax.models.kv_cache import KVCache
from rstarjax.models.qwen3 import Qwen3

__all__ = ["ModelConfig", "PRESETS", "KVCache", "Qwen3", "load_hf", "save_hf", "load_tokenizer"]


def __getattr__(name):
    # Lazy: hf.py pulls in file I/O helpers, tokenizer.py (another room) pulls in tokenizers;
    # importing the model alone stays light and never fails because of either.
    if name in ("load_hf", "save_hf"):
        from rstarjax.models import hf
        return getattr(hf, name)
    if name == "load_tokenizer":
        from rstarjax.models.tokenizer import load_tokenizer
        return load_tokenizer
    raise AttributeError(f"module 'rstarjax.models' has no attribute {name!r}")

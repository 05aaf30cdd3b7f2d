"""ModelConfig: the HF Qwen3/Qwen2 config fields plus our compute options.

Field names follow HuggingFace ``config.json`` so ``from_hf_dict``/``to_hf_dict`` are a
rename-free round trip; the options below the HF block are ours (never written to HF).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# Architectures whose weights and semantics this module reproduces exactly.
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "attention", "dots_attention")
DTYPES = ("float32", "bfloat16", "float16")  # the compute dtypes a config may name
ATTENTION_IMPLEMENTATIONS = (None, "xla", "cudnn")
# Training/scoring attention over packed rows (models/attention.py).
PACKED_ATTENTION = ("auto", "dense", "blockwise", "splash", "pallas_gpu", "cudnn")
# The projections a LoRA adapter may wrap (models/lora.py); all of them by default.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# transformers' Qwen3Config default (models/qwen3/configuration_qwen3.py: head_dim = 128): what a
# Qwen3 config.json without the field means to transformers, whatever hidden_size / heads is.
QWEN3_DEFAULT_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # ---- HuggingFace fields -------------------------------------------------------------
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    attention_bias: bool = False  # q/k/v biases (Qwen2.5 has them; o_proj never has one)
    qk_norm: bool = True  # per-head RMSNorm on q and k before RoPE (Qwen3 yes, Qwen2.5 no)
    architecture: str = "Qwen3ForCausalLM"
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151645
    initializer_range: float = 0.02  # std of the normal a randomly initialised weight is drawn from
    # ---- ours ---------------------------------------------------------------------------
    dtype: Any = jnp.bfloat16  # compute dtype of activations/matmuls (logits are always f32)
    param_dtype: Any = jnp.float32  # storage dtype of parameters
    # per decoder layer: none | full | dots | dots_no_batch | attention (full, the attention
    # kernel's output and softmax statistics kept) | dots_attention (dots, likewise)
    remat_policy: str = "none"
    scan_layers: bool = True  # lax.scan over the stacked layers (fast compile) vs unrolled
    attention_impl: str | None = None  # jax.nn.dot_product_attention implementation
    # Training/scoring forward (models/attention.py): auto = splash on TPU, cuDNN on Hopper+ GPUs
    # in bf16/f16 (the Pallas flash kernel before Hopper, blockwise for float32), dense for short
    # rows else blockwise elsewhere; memory linear in T except "dense".
    packed_attention: str = "auto"
    attention_block_size: int | None = None  # tile of the fused kernels; None = theirs
    # Token log-probs (models/logprobs.py): positions projected onto the vocabulary at a time,
    # every row of the micro-batch together; never [B, T, V] for T above it.
    vocab_chunk_len: int = 1024
    # LoRA (models/lora.py; docs/lora.md): rank 0 = off (every parameter trained, as before);
    # > 0 = frozen bfloat16 base weights plus float32 adapters W + (alpha / rank) A B on
    # ``lora_targets``, the only trained parameters.
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if self.lora_rank < 0 or (self.lora_rank > 0 and self.lora_alpha <= 0):
            raise ValueError(f"lora_rank={self.lora_rank} must be >= 0 (0 = off) and "
                             f"lora_alpha={self.lora_alpha} > 0")
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if unknown or (self.lora_rank > 0 and not self.lora_targets):
            raise ValueError(f"lora_targets={self.lora_targets} must be a non-empty subset of "
                             f"{LORA_TARGETS}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={self.remat_policy!r} not in {REMAT_POLICIES}")
        if self.attention_impl not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attention_impl={self.attention_impl!r} not in {ATTENTION_IMPLEMENTATIONS}")
        if self.packed_attention not in PACKED_ATTENTION:
            raise ValueError(
                f"packed_attention={self.packed_attention!r} not in {PACKED_ATTENTION}")
        if (self.attention_block_size is not None and self.attention_block_size <= 0) \
                or self.vocab_chunk_len <= 0:
            raise ValueError(f"attention_block_size={self.attention_block_size} and "
                             f"vocab_chunk_len={self.vocab_chunk_len} must be positive")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} not in {SUPPORTED_ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def lora_scale(self) -> float:
        """alpha / rank: the factor of the adapters' product (0 without LoRA)."""
        return self.lora_alpha / self.lora_rank if self.lora_rank > 0 else 0.0

    @property
    def base_param_dtype(self):
        """Storage dtype of the non-adapter weights: bfloat16 when they are LoRA's frozen base
        (no gradient, no optimizer state: half the memory of float32), else ``param_dtype``."""
        return jnp.dtype(jnp.bfloat16) if self.lora_rank > 0 else self.param_dtype

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied), for MFU = 6*N*tokens/s."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        nq, nkv = self.num_attention_heads, self.num_key_value_heads
        attn = d * nq * h + 2 * d * nkv * h + nq * h * d
        if self.attention_bias:
            attn += nq * h + 2 * nkv * h
        norms = 2 * d + (2 * h if self.qk_norm else 0)
        per_layer = attn + 3 * d * f + norms
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + d

    def train_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of training on one token of a ``seq_len``-token row (for MFU).

        6 x the matmul parameters (LM head included, the embedding lookup is not a matmul) plus
        causal attention: per layer QK^T and PV each take 2 x heads x head_dim FLOPs per
        (query, key) pair, a query sees (seq_len + 1) / 2 keys on average, and the backward pass
        costs twice the forward: 6 x layers x heads x head_dim x (seq_len + 1). Recomputation
        (remat) is not counted (PaLM's MFU convention, Chowdhery et al. 2022, appendix B)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        nq, nkv, layers = self.num_attention_heads, self.num_key_value_heads, self.num_hidden_layers
        matmul_params = layers * (d * nq * h + 2 * d * nkv * h + nq * h * d + 3 * d * f)
        matmul_params += d * self.vocab_size
        return 6.0 * matmul_params + 6.0 * layers * nq * h * (seq_len + 1)

    # ---- presets ------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """Real HF sizes for Qwen3 0.6B..32B and Qwen2.5-32B; `tiny`/`demo` for tests."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    # ---- HuggingFace round trip ---------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict, **overrides) -> "ModelConfig":
        """Build from a HF ``config.json`` dict (transformers 4.x or 5.x layout)."""
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        arch = archs[0] if archs else {"qwen3": "Qwen3ForCausalLM",
                                        "qwen2": "Qwen2ForCausalLM"}.get(model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"config.json field 'architectures'={archs} (model_type="
                             f"{model_type!r}) is unsupported; supported: {SUPPORTED_ARCHITECTURES}")
        if hf.get("use_sliding_window"):
            raise ValueError("config.json field 'use_sliding_window'=true is unsupported")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json field 'hidden_act'={act!r} is unsupported (silu only)")
        rope = hf_rope_parameters(hf)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"config.json rope_type={rope_type!r} is unsupported (default only)")
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        if not is_qwen2 and hf.get("attention_bias"):
            raise ValueError(f"config.json field 'attention_bias'=true is unsupported for {arch}: transformers "
                             "gives it biases on q/k/v and on o_proj, which this model has no place for")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks required field(s) {missing}")
        heads = hf["num_attention_heads"]
        kw = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or default_head_dim(arch, hf["hidden_size"], heads),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            # Qwen2 always has q/k/v biases (the HF class hard-codes bias=True).
            attention_bias=True if is_qwen2 else bool(hf.get("attention_bias", False)),
            qk_norm=not is_qwen2,
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_hf_dict(self) -> dict:
        """HF ``config.json`` dict readable by transformers 4.x and 5.x."""
        is_qwen2 = self.architecture == "Qwen2ForCausalLM"
        if is_qwen2 and (self.qk_norm or not self.attention_bias):
            raise ValueError("Qwen2ForCausalLM needs qk_norm=False and attention_bias=True")
        if not is_qwen2 and not self.qk_norm:
            raise ValueError("Qwen3ForCausalLM needs qk_norm=True")
        out = {
            "architectures": [self.architecture],
            "model_type": "qwen2" if is_qwen2 else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "initializer_range": self.initializer_range,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": jnp.dtype(self.param_dtype).name,
        }
        if not is_qwen2:
            out["attention_bias"] = self.attention_bias
        return out


def hf_rope_parameters(hf: dict) -> dict:
    """The RoPE parameters transformers runs a config.json with (``PreTrainedConfig.
    convert_rope_params_to_dict``): a non-empty ``rope_scaling`` (4.x's field) replaces
    ``rope_parameters`` (5's) whole, and a theta missing from the one used comes from the
    top-level ``rope_theta``, else 10,000 (``from_hf_dict`` fills that last step)."""
    chosen = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    return dict(chosen) if isinstance(chosen, dict) else {}


def default_head_dim(architecture: str, hidden_size: int, num_attention_heads: int) -> int:
    """The head_dim transformers reads from a config.json that has none: Qwen3Config's default
    (128) for Qwen3, hidden_size // num_attention_heads for Qwen2 (whose config has no such field)."""
    if architecture == "Qwen3ForCausalLM":
        return QWEN3_DEFAULT_HEAD_DIM
    return hidden_size // num_attention_heads


_QWEN3 = dict(vocab_size=151936, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
              max_position_embeddings=40960, attention_bias=False, qk_norm=True,
              architecture="Qwen3ForCausalLM", bos_token_id=151643, eos_token_id=151645)

PRESETS: dict[str, dict] = {
    # Numbers from the Qwen/Qwen3-*/config.json files on the HF hub.
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "tie_word_embeddings": True},
    "qwen3-1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "tie_word_embeddings": True},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "tie_word_embeddings": False},
    "qwen3-14b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 17408,
                  "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
                  "tie_word_embeddings": False},
    "qwen3-32b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 25600,
                  "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
                  "tie_word_embeddings": False},
    # Qwen/Qwen2.5-32B config.json (base model).
    "qwen2.5-32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=131072, tie_word_embeddings=False,
                        attention_bias=True, qk_norm=False, architecture="Qwen2ForCausalLM",
                        bos_token_id=151643, eos_token_id=151643),
    # Small sizes for tests and CPU demos (Qwen3 vocab so the real tokenizer fits `demo`).
    "tiny": {**_QWEN3, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "tie_word_embeddings": True, "max_position_embeddings": 2048},
    "demo": {**_QWEN3, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "tie_word_embeddings": True, "max_position_embeddings": 8192},
}

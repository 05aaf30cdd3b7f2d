"""LoRA adapters on the policy's projections (docs/lora.md).

LoRA: Low-Rank Adaptation of Large Language Models (Hu et al., arXiv:2106.09685): a frozen
weight ``W [in, out]`` gains a trained low-rank update, ``y = x W + (alpha / r) (x A) B`` with
``A [in, r]``, ``B [r, out]``; ``B`` starts at zero, so the adapted model starts as the base.

The adapters are flax's own variable type, ``nnx.LoRAParam`` (a subclass of ``nnx.Param``), with
flax's ``nnx.LoRA`` initialisers (``A``: variance scaling, fan-in, uniform; ``B``: zeros). They
are stacked on the leading ``layers`` axis like every layer weight of ``models/qwen3.py``
(``A_l = lora_a[l]``), so scan over layers, remat and the logical-axis sharding rules treat
them as they treat the base weights, and ``nnx.split(model, nnx.LoRAParam, ...)`` separates
what trains (the adapters) from what does not (the bf16 base). Flax's ``nnx.LoRA`` *module*
wraps one unstacked ``nnx.Linear`` and has no ``alpha / r`` factor, and qwix intercepts
``nnx.Linear`` / einsum calls of a module tree; our layers are stacked arrays scanned by
``lax.scan``, which neither fits without a second parameter layout.

Serving never sees an adapter: ``merge_lora`` folds them into the weights on the devices
(``W + (alpha / r) A B``, computed in float32, stored in the compute dtype) and yields the plain
model's state, which the engine, its kernels and tensor-parallel slices take unchanged.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from rstarjax.models.config import ModelConfig
from rstarjax.models.sharding import state_shardings

# A projection's logical axes (models/qwen3.py, DecoderLayers): (input features, output features).
PROJECTION_AXES = {"q_proj": ("embed", "q_heads"), "k_proj": ("embed", "kv_heads"),
                   "v_proj": ("embed", "kv_heads"), "o_proj": ("q_heads", "embed"),
                   "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"),
                   "down_proj": ("mlp", "embed")}

# flax's nnx.LoRA initialiser of A (variance scaling over fan-in, uniform), per layer of the stack.
_init_a = jax.nn.initializers.variance_scaling(1.0, "fan_in", "uniform", batch_axis=(0,))


def adapter_names(target: str) -> tuple[str, str]:
    """The ``DecoderLayers`` attribute names of ``target``'s adapters (A, B)."""
    return f"{target}_lora_a", f"{target}_lora_b"


def is_adapter_name(name: str) -> bool:
    return name.endswith(("_lora_a", "_lora_b"))


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of one layer."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def init_adapters(cfg: ModelConfig, key: jax.Array) -> dict[str, nnx.LoRAParam]:
    """Fresh stacked adapters of ``cfg.lora_targets``: A ``[L, in, r]`` (flax's nnx.LoRA
    initialiser per layer), B ``[L, r, out]`` zeros, both ``cfg.param_dtype`` (float32)."""
    L, r, dtype = cfg.num_hidden_layers, cfg.lora_rank, cfg.param_dtype
    shapes = projection_shapes(cfg)
    out = {}
    for i, target in enumerate(cfg.lora_targets):
        (fan_in, fan_out), (in_axis, out_axis) = shapes[target], PROJECTION_AXES[target]
        name_a, name_b = adapter_names(target)
        a = _init_a(jax.random.fold_in(key, i), (L, fan_in, r), jnp.float32).astype(dtype)
        out[name_a] = nnx.LoRAParam(a, logical_axes=("layers", in_axis, None))
        out[name_b] = nnx.LoRAParam(jnp.zeros((L, r, fan_out), dtype),
                                    logical_axes=("layers", None, out_axis))
    return out


def lora_delta(h: jax.Array, a: jax.Array, b: jax.Array, scale: float, dtype) -> jax.Array:
    """The adapter's term of a projection, ``(alpha / r) (h A) B`` (LoRA, arXiv:2106.09685,
    eq. 3), in the compute ``dtype``: the rank-r product first, never the [in, out] matrix."""
    return ((h @ a.astype(dtype)) @ b.astype(dtype)) * jnp.asarray(scale, dtype)


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``W + (alpha / r) A B`` (LoRA, arXiv:2106.09685 §4.1: merged for inference, no added
    latency), in float32, stored in ``w``'s dtype; works on stacked ``[L, ...]`` arrays."""
    delta = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))
    return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


def merge_lora(state: nnx.State, scale: float, targets: tuple[str, ...], dtype=None) -> nnx.State:
    """Pure: the state of a LoRA ``Qwen3`` (adapters and base) -> the state of the plain model
    (``base_config``) whose ``targets`` weights are ``merged_weight``s, every weight in
    ``dtype`` (default: the base's). Jit it (``merger``): one program on the devices, no host
    round trip."""
    flat = dict(nnx.to_flat_state(state))
    out = []
    for key, var in flat.items():
        name = key[-1]
        if is_adapter_name(str(name)):
            continue
        w = var.get_value()
        if dtype is not None:
            w = w.astype(dtype)
        if key[:-1] == ("layers",) and name in targets:
            name_a, name_b = adapter_names(name)
            w = merged_weight(w, flat[("layers", name_a)].get_value(), flat[("layers", name_b)].get_value(), scale)
        out.append((key, var.replace(w)))
    return nnx.from_flat_state(out)


def base_config(cfg: ModelConfig, dtype=None) -> ModelConfig:
    """The plain model a LoRA model merges into: same architecture, no adapters, its weights
    in ``dtype`` (default: the frozen base's)."""
    return cfg.replace(lora_rank=0, param_dtype=jnp.dtype(dtype or cfg.base_param_dtype))


@functools.lru_cache(maxsize=None)
def _abstract_base(family: type, cfg: ModelConfig, dtype):
    # ``family``: the model's class (``Qwen3``), passed in: lora.py sits below qwen3.py, which imports it
    return nnx.split(nnx.eval_shape(lambda: family(base_config(cfg, dtype), rngs=nnx.Rngs(0))))


def _hashable(cfg: ModelConfig) -> ModelConfig:
    eos = cfg.eos_token_id
    return cfg.replace(eos_token_id=tuple(eos)) if isinstance(eos, list) else cfg


@functools.lru_cache(maxsize=None)
def merger(cfg: ModelConfig, mesh=None, dtype=None, family: type | None = None):
    """The jitted ``merge_lora`` for ``cfg``'s LoRA model, ``(state) -> plain state`` (built once
    per config, mesh and dtype: the hand-off of every update reuses the compiled program). With
    ``mesh`` the result lies on the base's logical-axis shardings (of ``family``, the model's
    class, which ``mesh`` needs)."""
    shardings = None if mesh is None else state_shardings(_abstract_base(family, cfg, dtype)[1], mesh)
    return jax.jit(functools.partial(merge_lora, scale=cfg.lora_scale, targets=cfg.lora_targets,
                                     dtype=dtype), out_shardings=shardings)


def merged_model(model, mesh=None, dtype=None) -> nnx.Module:
    """The plain ``Qwen3`` whose weights are ``model``'s with its adapters merged (a new copy;
    ``model`` itself when it has no adapters), in ``dtype``. Default: the model's compute dtype,
    the one the engine serves in and the trainer's forward computes in (bfloat16 on
    accelerators, as the base is held). Stored in the bfloat16 base dtype under a float32
    compute dtype, the merge rounded most of the small update ``(alpha / r) A B`` away and the
    sampler served another policy than the one trained (the CPU LoRA demo's log-prob gap: up to
    0.019 nats; float noise after this). float32 for an export that adds no rounding. With
    ``mesh`` the copy is placed on the base's logical-axis shardings."""
    cfg = model.config
    if cfg.lora_rank == 0:
        return model
    dtype = jnp.dtype(dtype or cfg.dtype)
    cfg = _hashable(cfg)
    family = type(model)
    return nnx.merge(_abstract_base(family, cfg, dtype)[0], merger(cfg, mesh, dtype, family)(nnx.state(model)))


def attach(model, rank: int, alpha: float, targets: tuple[str, ...] | None = None, seed: int = 0,
           mesh=None) -> nnx.Module:
    """A LoRA model over ``model``'s weights (a plain ``Qwen3``, e.g. a loaded HF checkpoint or
    an SFT policy): the weights cast to bfloat16 and frozen, fresh adapters (B = 0, so it
    computes what ``model`` computes with bf16 weights). With ``mesh`` everything is placed on
    its logical-axis sharding."""
    family = type(model)  # (``Qwen3``: lora.py sits below qwen3.py, which imports it)
    base = model.config
    if base.lora_rank:
        raise ValueError(f"model already has LoRA adapters (lora_rank={base.lora_rank})")
    cfg = base.replace(lora_rank=int(rank), lora_alpha=float(alpha),
                       lora_targets=tuple(targets) if targets is not None else base.lora_targets)
    if cfg.lora_rank <= 0:
        raise ValueError(f"lora_rank={rank} must be > 0 to attach adapters")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: family(cfg, rngs=nnx.Rngs(0))))
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    shardings = None if mesh is None else dict(nnx.to_flat_state(state_shardings(abstract, mesh)))
    adapters = jax.jit(lambda k: {n: v.get_value() for n, v in init_adapters(cfg, k).items()})(
        jax.random.key(seed))
    out = []
    for key, var in nnx.to_flat_state(abstract):
        if key[:-1] == ("layers",) and is_adapter_name(str(key[-1])):
            value = adapters[key[-1]]
        else:
            value = flat[key].get_value().astype(cfg.base_param_dtype)
        if shardings is not None:
            value = jax.device_put(value, shardings[key].get_value())
        out.append((key, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(out))


@jax.jit
def _leaf_checksums(leaves):
    """Per array: the sum over its elements of (bits x (2 i + 1)), modulo 2^32 (i the flat
    index); integer arithmetic, so the same on any sharding and device count."""
    out = []
    for x in leaves:
        bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
        bits = bits.reshape(-1).astype(jnp.uint32)
        weight = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
        out.append(jnp.sum(bits * weight, dtype=jnp.uint32))
    return out


def weights_fingerprint(state: nnx.State) -> str:
    """A short hash of a state's arrays (names, shapes, dtypes and every bit of every value),
    computed on the devices (one 32-bit checksum per array read back): what a LoRA checkpoint
    records of the frozen base it was trained on, so a resume onto other weights is refused."""
    import hashlib
    flat = sorted(((".".join(map(str, k)), v.get_value() if isinstance(v, nnx.Variable) else v)
                   for k, v in nnx.to_flat_state(state)), key=lambda kv: kv[0])
    sums = jax.device_get(_leaf_checksums([v for _, v in flat]))
    h = hashlib.sha256()
    for (name, v), s in zip(flat, sums):
        h.update(f"{name}:{tuple(v.shape)}:{jnp.dtype(v.dtype).name}:{int(s)};".encode())
    return h.hexdigest()[:16]

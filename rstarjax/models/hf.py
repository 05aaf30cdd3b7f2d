"""HuggingFace checkpoint I/O: ``load_hf`` / ``save_hf`` for Qwen3ForCausalLM and
Qwen2ForCausalLM safetensors directories.

Reading memory-maps each ``.safetensors`` file (a tiny header parser, so bf16 needs no torch)
and builds every parameter with ``jax.make_array_from_callback``: each device reads only its
own slice from the map, so the host never holds two full copies of the weights.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rstarjax.models import lora as lora_lib
from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.models.sharding import DEFAULT_RULES, state_shardings
from rstarjax.models.tokenizer import load_tokenizer
from rstarjax.validation import ConfigError

SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
# Tensors some exporters write that carry no information we need.
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
# The dtypes a weight may be stored in: an integer or bool tensor under a weight's name is a
# quantized or damaged checkpoint, and casting it to float would load a silently wrong model.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointDirError(ConfigError):
    """A HF model directory that cannot be loaded as it is: one line naming the file and what is
    wrong. A ``ConfigError`` so that a run prints the line (exit 2) rather than a traceback: the
    fix is another ``model.hf_path`` or a repaired directory."""


class MissingTensorError(CheckpointDirError, KeyError):
    """A tensor the config implies that no file of the directory holds (a KeyError, as before)."""

    def __str__(self):  # KeyError's str() would quote the whole message
        return str(self.args[0])


class MissingFileError(CheckpointDirError, FileNotFoundError):
    """config.json or the safetensors files are not there (a FileNotFoundError, as before)."""

    def __str__(self):  # one argument, the message: no errno prefix
        return str(self.args[0])


@dataclass(frozen=True)
class TensorSpec:
    """Where one of our parameters lives in a HF checkpoint."""
    ours: str  # attribute path in Qwen3, e.g. "layers.q_proj"
    hf: str  # HF name; "{i}" is the layer index for stacked params
    transpose: bool  # HF Linear stores [out, in]; we store [in, out]
    stacked: bool  # has a leading layers axis in our layout


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Our parameters <-> HF tensor names for this config, in HF order."""
    L = "model.layers.{i}."
    specs = [TensorSpec("embed", "model.embed_tokens.weight", False, False)]
    layer = [("input_norm", "input_layernorm.weight", False)]
    for proj in ("q", "k", "v"):
        layer.append((f"{proj}_proj", f"self_attn.{proj}_proj.weight", True))
        if cfg.attention_bias:
            layer.append((f"{proj}_bias", f"self_attn.{proj}_proj.bias", False))
    if cfg.qk_norm:
        layer += [("q_norm", "self_attn.q_norm.weight", False),
                  ("k_norm", "self_attn.k_norm.weight", False)]
    layer += [("o_proj", "self_attn.o_proj.weight", True),
              ("post_attention_norm", "post_attention_layernorm.weight", False),
              ("gate_proj", "mlp.gate_proj.weight", True),
              ("up_proj", "mlp.up_proj.weight", True),
              ("down_proj", "mlp.down_proj.weight", True)]
    specs += [TensorSpec(f"layers.{ours}", L + hf, t, True) for ours, hf, t in layer]
    specs.append(TensorSpec("final_norm", "model.norm.weight", False, False))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head", "lm_head.weight", True, False))
    return specs


# ---------------------------------------------------------------------------------------------
# safetensors, read by memory map and written by hand (bf16 without torch)
# ---------------------------------------------------------------------------------------------
class SafetensorsFile:
    """Zero-copy view of one .safetensors file: ``file[name]`` is a read-only np.memmap view."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) != 8:
                    raise CheckpointDirError(f"{path}: {size} bytes, too short for a safetensors file "
                                             "(truncated?)")
                (n,) = struct.unpack("<Q", raw)
                if n > size - 8:
                    raise CheckpointDirError(f"{path}: header length {n} exceeds the file size "
                                             "(truncated, or not a safetensors file)")
                header_bytes = f.read(n)
        except OSError as e:
            raise CheckpointDirError(f"{path}: cannot be read ({e.strerror or e})") from None
        header = parse_header(path, header_bytes)
        header.pop("__metadata__", None)
        data_bytes = size - 8 - n
        for name, info in header.items():
            problem = header_entry_problem(info, data_bytes)
            if problem:
                raise CheckpointDirError(f"{path}: tensor {name!r} {problem}")
        problem = data_layout_problem(header, data_bytes)
        if problem:
            raise CheckpointDirError(f"{path}: {problem}")
        self.header = header
        self._data_start = 8 + n
        self._map = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def keys(self):
        return self.header.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype_name(self, name: str) -> str:
        return self.header[name]["dtype"]

    def __getitem__(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        buf = self._map[self._data_start + start:self._data_start + end]
        return buf.view(dtype).reshape(info["shape"])


def parse_header(path: str, header_bytes: bytes) -> dict:
    """The JSON header of a safetensors file; one line naming the file (``path``, or the name a
    caller shows) when it is not one."""
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, ValueError):
        raise CheckpointDirError(f"{path}: its header is not JSON (a damaged or a different kind "
                                 "of file)") from None
    if not isinstance(header, dict):
        raise CheckpointDirError(f"{path}: its header is not a JSON object")
    return header


def header_entry_problem(info, data_bytes: int | None = None) -> str | None:
    """What is wrong with one tensor's header entry in a file of ``data_bytes`` bytes after the
    header (None: not checked here, the caller checks the file's size), or None. Checked on open,
    so that a truncated download is refused naming the file instead of failing later inside a
    device callback (or being read past its end)."""
    if not isinstance(info, dict):
        return f"has a malformed header entry {info!r}"
    dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
    if dtype is None:
        return (f"has dtype {info.get('dtype')!r}, which this loader does not read "
                f"(known: {sorted(SAFETENSORS_DTYPES)}; a quantized checkpoint?)")
    try:
        start, end = (int(x) for x in info["data_offsets"])
        shape = [int(d) for d in info["shape"]]
    except (KeyError, TypeError, ValueError):
        return f"has a malformed header entry {info!r}"
    if min(shape, default=0) < 0 or not 0 <= start <= end:
        return f"has a malformed header entry {info!r}"
    if end - start != math.prod(shape) * dtype.itemsize:
        return (f"of shape {shape} {info['dtype']} needs {math.prod(shape) * dtype.itemsize} bytes, "
                f"its header gives it {end - start}")
    if data_bytes is not None and end > data_bytes:
        return (f"ends at byte {end} of the data but the file holds only {data_bytes} "
                "(truncated: download it again)")
    return None


def data_layout_problem(header: dict, data_bytes: int) -> str | None:
    """What is wrong with where a file's tensors lie in its ``data_bytes`` bytes of data, or None.
    The safetensors library ("invalid offset") and so transformers refuse a file whose tensors,
    sorted by start, do not tile the data exactly; two tensors that overlap or alias the same
    bytes would otherwise load here as different weights than theirs. The entries must have
    passed ``header_entry_problem`` (offsets are ordered non-negative integers)."""
    spans = sorted((int(info["data_offsets"][0]), int(info["data_offsets"][1]), name)
                   for name, info in header.items())
    previous, expected = None, 0
    for start, end, name in spans:
        if start < expected:
            return (f"tensor {name!r} starts at byte {start} of the data, inside {previous!r} (which ends at "
                    f"{expected}): overlapping or aliased data_offsets, which the safetensors library refuses")
        if start > expected:
            before = f"the tensor before it, {previous!r}, ends at {expected}" if previous else "the data starts at 0"
            return (f"tensor {name!r} starts at byte {start} of the data, but {before}: a gap in data_offsets, "
                    "which the safetensors library refuses")
        previous, expected = name, end
    if previous is None and data_bytes:
        return f"its header names no tensor, but {data_bytes} bytes of data follow it"
    if expected != data_bytes:
        return (f"the last tensor, {previous!r}, ends at byte {expected} of the data but the file holds "
                f"{data_bytes} bytes of data: bytes past the last tensor, which the safetensors library refuses")
    return None


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Write tensors (numpy, bf16 via ml_dtypes) in the safetensors format."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be saved")
        header[name] = {"dtype": _DTYPE_NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.reshape(-1).view(np.uint8).data)


def _read_weight_map(index_path: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a safetensors index."""
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except OSError as e:
        raise CheckpointDirError(f"{index_path}: cannot be read ({e.strerror or e})") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointDirError(f"{index_path}: not a safetensors index (JSON with a "
                                 "\"weight_map\")") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointDirError(f"{index_path}: its weight_map is not tensor name -> file name")
    return weight_map


def _no_weights_message(path: str) -> str:
    """Why ``path`` has no weights we can read, naming the files it does have."""
    others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".gguf"))) \
        if os.path.isdir(path) else []
    if others:
        return (f"{path}: has no {SINGLE_FILE} or {INDEX_FILE}, only {others[:3]}: only safetensors "
                "are read; convert it (transformers: save_pretrained(dir, safe_serialization=True))")
    return f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE}"


def two_weight_sets_problem(path: str) -> str | None:
    """Why the directory ``path`` holds two sets of weights, or None. transformers loads
    ``model.safetensors`` when it is there and ignores the index beside it, so reading the index's
    shards here would run other weights than the same directory gives transformers."""
    if os.path.exists(os.path.join(path, SINGLE_FILE)) and os.path.exists(os.path.join(path, INDEX_FILE)):
        return f"holds both {SINGLE_FILE} and {INDEX_FILE}; transformers would load {SINGLE_FILE}: remove one"
    return None


def _open_checkpoint(path: str) -> dict[str, SafetensorsFile]:
    """HF tensor name -> the file holding it (single file or sharded with an index; never both).

    A shard's header is what it holds: a tensor a shard holds that the index forgot is still
    found (as transformers reads whole shards); the index may not send us to the wrong file."""
    index_path = os.path.join(path, INDEX_FILE)
    single_path = os.path.join(path, SINGLE_FILE)
    problem = two_weight_sets_problem(path)
    if problem:
        raise CheckpointDirError(f"{path}: {problem}")
    if os.path.exists(index_path):
        weight_map = _read_weight_map(index_path)
        files = {}
        for fn in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(path, fn)):
                raise CheckpointDirError(f"{index_path}: names {fn}, which is missing (an "
                                         "incomplete download?)")
            files[fn] = SafetensorsFile(os.path.join(path, fn))
        where = {}
        for fn, f in files.items():
            for name in f.keys():
                if name in where:
                    raise CheckpointDirError(f"{path}: tensor {name!r} is in both "
                                             f"{os.path.basename(where[name].path)} and {fn}")
                where[name] = f
        for name, fn in weight_map.items():
            if name not in files[fn].header:
                raise CheckpointDirError(f"{index_path}: says tensor {name!r} is in {fn}, "
                                         "but it is not there")
        return where
    if os.path.exists(single_path):
        f = SafetensorsFile(single_path)
        return {name: f for name in f.keys()}
    raise MissingFileError(_no_weights_message(path))


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
def _expected_hf_shape(spec: TensorSpec, ours_shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = ours_shape[1:] if spec.stacked else ours_shape
    return tuple(reversed(shape)) if spec.transpose else tuple(shape)


def _read_slice(where, spec: TensorSpec, index, dtype, num_layers: int) -> np.ndarray:
    """Our-layout slice ``index`` of a parameter, read straight from the memory maps."""
    def one(name, idx):
        src = where[name][name]
        if spec.transpose:  # slice in HF layout first, so only needed pages are touched
            return np.asarray(src[tuple(reversed(idx))].T, dtype=dtype)
        return np.asarray(src[idx], dtype=dtype)

    index = tuple(index) if index is not None else ()
    if not spec.stacked:
        return one(spec.hf, index)
    layer_idx = index[0] if index else slice(None)
    rest = index[1:] if index else ()
    layers = range(num_layers)[layer_idx]
    return np.stack([one(spec.hf.format(i=i), rest) for i in layers])


# config.json fields that size the model: a string or a float here would fail deep inside JAX.
_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim")


def _rope_problem(hf: dict) -> str | None:
    """Why the config's RoPE is not the plain one this model computes, or None. Both fields are
    read: transformers 5 applies a ``rope_scaling`` even next to a default ``rope_parameters``."""
    for field in ("rope_parameters", "rope_scaling"):
        value = hf.get(field)
        if value is None:
            continue
        if not isinstance(value, dict):
            return f"field {field!r}={value!r} is not an object"
        nested = sorted(str(k) for k, v in value.items() if isinstance(v, dict))
        if nested:  # per layer type (e.g. {"full_attention": {...}}): read by no Qwen2/3 model
            return (f"field {field!r} holds parameters per layer type ({nested}): only one set of "
                    "RoPE parameters for every layer is supported")
        kind = value.get("rope_type", value.get("type"))
        if kind is None and field == "rope_scaling" and value:
            return f"field 'rope_scaling'={value} has no rope_type (transformers cannot run it either)"
        if kind not in (None, "default"):
            return (f"field {field!r} has rope_type={kind!r}: only the default RoPE is supported "
                    "(remove the scaling, or use a checkpoint without it)")
    return None


def config_problem(hf) -> str | None:
    """What in a config.json dict this loader would otherwise ignore or misread, or None: the
    settings that change the model's function (RoPE scaling, sliding-window layers, quantized
    weights) and size fields of the wrong type. ``ModelConfig.from_hf_dict`` checks the rest."""
    if not isinstance(hf, dict):
        return f"is not a JSON object (got {type(hf).__name__})"
    for key in _POSITIVE_INT_FIELDS:
        value = hf.get(key)
        if value is None and key in ("num_key_value_heads", "head_dim"):
            continue  # optional: defaults from the other fields
        if key in hf and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            return f"field {key!r}={value!r} must be a positive integer"
    tie = hf.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):  # bool("false") would tie an untied model
        return f"field 'tie_word_embeddings'={tie!r} must be true or false"
    rope = _rope_problem(hf)
    if rope:
        return rope
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        other = sorted({str(t) for t in layer_types if t != "full_attention"}) \
            if isinstance(layer_types, list) else [layer_types]
        if other:
            return f"field 'layer_types' has {other} layers: only full attention is supported"
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method") \
            if isinstance(hf["quantization_config"], dict) else None
        return (f"field 'quantization_config' (quant_method={method!r}): quantized checkpoints "
                "are unsupported; use the bf16/fp32 weights")
    return None


def read_config(path: str, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of the HF model directory ``path`` (its config.json), without reading
    any weight; ``overrides``: fields the run sets itself (dtype, remat_policy, ...).
    ``CheckpointDirError`` (one line naming config.json) when it cannot be read or has a setting
    the model would silently ignore."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise MissingFileError(f"{cfg_path} not found")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
    except OSError as e:
        raise CheckpointDirError(f"{cfg_path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # JSON (or UTF-8) that does not parse
        raise CheckpointDirError(f"{cfg_path}: not JSON ({e})") from None
    problem = config_problem(hf)
    if problem:
        raise CheckpointDirError(f"{cfg_path}: {problem}")
    try:
        return ModelConfig.from_hf_dict(hf, **overrides)
    except (ValueError, TypeError, AttributeError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointDirError(f"{cfg_path}: {message.removeprefix('config.json ')}") from None


def _tied_head_differs(where, embed: str = "model.embed_tokens.weight",
                       head: str = "lm_head.weight", rows_per_chunk: int = 4096) -> bool:
    """Whether the checkpoint's lm_head holds other values than its embedding, compared a block
    of rows at a time (the memory maps: never a full copy of either)."""
    a, b = where[embed][embed], where[head][head]
    for start in range(0, a.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        if a.dtype == b.dtype:  # exact copies are what exporters write: compare the bits
            if not np.array_equal(a[rows].view(np.uint8), b[rows].view(np.uint8)):
                return True
        elif not np.array_equal(np.asarray(a[rows], np.float32), np.asarray(b[rows], np.float32)):
            return True
    return False


def _missing_tensor_message(path: str, name: str) -> str:
    if name == "lm_head.weight":  # the usual cause: a tied model whose config omits the flag
        return (f"{path}: no tensor 'lm_head.weight', but config.json says tie_word_embeddings="
                "false (or omits it: false is transformers' default); set it to true if the "
                "model ties its embeddings")
    return f"{path}: no file holds tensor {name!r}, which config.json implies"


def load_hf(path: str, dtype=jnp.bfloat16, param_dtype=jnp.float32, mesh: Mesh | None = None,
            rules=DEFAULT_RULES, read_weights: bool = True, **config_overrides) -> Qwen3:
    """Load a HF Qwen3/Qwen2 checkpoint directory into a ``Qwen3`` module.

    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype. With ``mesh`` every
    parameter is placed on its logical-axis sharding, each device reading only its slice.
    Raises naming the tensor or config field on a missing tensor, a shape mismatch, an
    unexpected tensor or an unsupported architecture.

    ``read_weights=False``: the same checks (from the headers) and the same shapes and
    shardings, but zeros instead of the tensors' data: for a run whose checkpoint replaces
    every parameter (a later stage, a resume), which need not read a 14B model first.
    """
    cfg = read_config(path, dtype=dtype, param_dtype=param_dtype, **config_overrides)
    where = _open_checkpoint(path)

    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sharding_of = {} if mesh is None else {
        p: v.get_value() for p, v in nnx.to_flat_state(state_shardings(abstract_state, mesh, rules))}
    flat = dict(nnx.to_flat_state(abstract_state))
    specs = tensor_specs(cfg)

    # Validate everything from headers before reading a byte of data.
    consumed = set()
    for spec in specs:
        var = flat[tuple(spec.ours.split("."))]
        want = _expected_hf_shape(spec, var.get_value().shape)
        names = [spec.hf.format(i=i) for i in range(cfg.num_hidden_layers)] if spec.stacked \
            else [spec.hf]
        for name in names:
            if name not in where:
                raise MissingTensorError(_missing_tensor_message(path, name))
            file = where[name].path
            got = where[name].shape(name)
            if got != want:
                raise CheckpointDirError(f"{file}: tensor {name!r} has shape {got}, config.json "
                                         f"implies {want}")
            if where[name].dtype_name(name) not in FLOAT_DTYPES:
                raise CheckpointDirError(f"{file}: tensor {name!r} is {where[name].dtype_name(name)}, "
                                         f"not a float dtype {FLOAT_DTYPES} (a quantized checkpoint?)")
            consumed.add(name)
    if cfg.tie_word_embeddings and "lm_head.weight" in where:
        # Some exporters write the tied head anyway, a copy. A head that differs is an untied model
        # under a tied config: transformers 5 would keep the head, 4.x drop it; neither is safe.
        head, embed = where["lm_head.weight"], where["model.embed_tokens.weight"]
        if head.shape("lm_head.weight") != embed.shape("model.embed_tokens.weight") or (
                read_weights and _tied_head_differs(where)):
            raise CheckpointDirError(
                f"{os.path.join(path, 'config.json')}: tie_word_embeddings=true, but the checkpoint's "
                "lm_head.weight differs from model.embed_tokens.weight; set tie_word_embeddings=false "
                "if the model was trained untied")
        consumed.add("lm_head.weight")
    unexpected = [n for n in where if n not in consumed and not n.endswith(IGNORABLE_SUFFIXES)]
    if unexpected:
        raise CheckpointDirError(f"{path}: has tensors this config does not use: "
                                 f"{sorted(unexpected)[:8]} (another architecture or size?)")

    new_flat = []
    for spec in specs:
        key = tuple(spec.ours.split("."))
        var = flat[key]
        shape, pdt = var.get_value().shape, var.get_value().dtype
        sharding = sharding_of.get(key, single)
        if not read_weights:
            new_flat.append((key, var.replace(jnp.zeros(shape, pdt, device=sharding))))
            continue
        arr = jax.make_array_from_callback(
            shape, sharding,
            lambda idx, spec=spec, pdt=pdt: _read_slice(where, spec, idx, pdt,
                                                        cfg.num_hidden_layers))
        new_flat.append((key, var.replace(arr)))
    seen = {k for k, _ in new_flat}
    missing = [k for k in flat if k not in seen]
    if missing:
        raise RuntimeError(f"internal: parameters {missing} have no HF mapping")
    return nnx.merge(graphdef, nnx.from_flat_state(new_flat))


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------
def _shard_file_name(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def default_tokenizer_for(cfg: ModelConfig):
    """The tokenizer a model's vocabulary implies, or None when it implies none.

    A vocabulary with room for all of Qwen3's tokens is Qwen3's (151,936 rows; Qwen2.5's larger
    table too): the full tokenizer. A smaller table (a demo or test model) could belong to any
    small-vocabulary variant (their tables are padded), so it names no tokenizer."""
    full = load_tokenizer()
    return full if cfg.vocab_size >= full.num_tokens else None


def peft_adapter_tensors(model: Qwen3) -> dict[str, np.ndarray]:
    """A LoRA model's adapters under HF PEFT's names and layout: ``base_model.model.<module>.
    lora_A.weight`` ``[r, in]`` = our ``A[l].T``, ``lora_B.weight`` ``[out, r]`` = our
    ``B[l].T`` (PEFT adds ``lora_B @ lora_A * alpha / r`` to the ``[out, in]`` weight), float32."""
    cfg = model.config
    if not cfg.lora_rank:
        raise ValueError("peft_adapter_tensors: the model has no LoRA adapters (lora_rank=0)")
    hf_of = {spec.ours: spec.hf for spec in tensor_specs(cfg)}
    out = {}
    for target in cfg.lora_targets:
        module = hf_of[f"layers.{target}"].removesuffix(".weight")
        name_a, name_b = lora_lib.adapter_names(target)
        a = np.asarray(jax.device_get(getattr(model.layers, name_a)[...]), np.float32)
        b = np.asarray(jax.device_get(getattr(model.layers, name_b)[...]), np.float32)
        for i in range(cfg.num_hidden_layers):
            prefix = "base_model.model." + module.format(i=i)
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return out


def save_peft_adapter(model: Qwen3, path: str, base_model_name_or_path: str = "") -> None:
    """Write a HF PEFT LoRA adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) of a LoRA model's adapters, which ``peft.PeftModel.
    from_pretrained(base, path)`` loads onto the HF export of its (bf16) base."""
    cfg = model.config
    tensors = peft_adapter_tensors(model)
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank,
              "lora_alpha": cfg.lora_alpha, "target_modules": sorted(cfg.lora_targets),
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
              "base_model_name_or_path": base_model_name_or_path or None, "inference_mode": True}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _ids(value) -> list[int]:
    """A config's token id field (an int, a list of them, or None) as a list."""
    if value is None:
        return []
    return [int(i) for i in value] if isinstance(value, (list, tuple)) else [int(value)]


def generation_config(cfg: ModelConfig, tokenizer=False) -> dict:
    """generation_config.json of a model saved with ``tokenizer`` (``False``: none known).

    With our tokenizer, the ids the engine ends a turn at (``protocol.OFFICIAL_STOP_TOKENS``:
    ``<|im_end|>``, the chat end the tokenizer_config calls eos_token, and ``<|endoftext|>``), then
    the config's own eos ids: a policy trained from a Base checkpoint inherits its config's
    ``<|endoftext|>`` eos, and ``generate()`` stopping there alone would run past every turn's end.
    The same list as Qwen3's instruct models ship ([151645, 151643]); pad is ``<|endoftext|>``."""
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": False}
    if tokenizer is False or not hasattr(tokenizer, "eos_id"):
        return gen
    eos = [tokenizer.eos_id, tokenizer.pad_id]
    eos += [i for i in _ids(cfg.eos_token_id) if i not in eos]
    return dict(gen, eos_token_id=eos, pad_token_id=tokenizer.pad_id)


def save_hf(model: Qwen3, path: str, tokenizer=None, max_shard_bytes: int = 5 * 2**30,
            dtype=None, chat_format: str = "rstar2") -> None:
    """Write a transformers-loadable directory: config.json, generation_config.json (the
    tokenizer's stop ids: ``generation_config``), ``model-0000k-of-0000n.safetensors`` shards of
    at most ``max_shard_bytes`` (a single larger tensor gets its own shard),
    model.safetensors.index.json, and the tokenizer files.
    ``dtype`` (default: the parameters' dtype) is the saved tensor dtype. ``chat_format`` (a name
    of ``chat_template.CHAT_FORMATS``: the one the model was trained with) is the Jinja chat
    template written into tokenizer_config.json.

    ``tokenizer``: the model's tokenizer (``models.load_tokenizer(...)``). ``None`` writes the
    tokenizer the vocabulary implies (Qwen3's for a full-size table) and raises when it implies
    none, since a directory without a tokenizer makes ``AutoTokenizer.from_pretrained`` quietly
    return an empty one; ``False`` writes the weights only, on purpose."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if model.config.lora_rank:  # the adapters merged into float32 weights (W + alpha/r A B)
        model = lora_lib.merged_model(model, dtype=dtype or jnp.float32)
    cfg = model.config
    if tokenizer is None:
        tokenizer = default_tokenizer_for(cfg)
        if tokenizer is None:
            raise ValueError(
                f"save_hf: a {cfg.vocab_size}-row vocabulary does not say which tokenizer the model uses; "
                "pass tokenizer=load_tokenizer(num_regular_tokens) (or tokenizer=False for weights only)")
    if tokenizer is not False and not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no save_pretrained(path)")
    if tokenizer is not False and len(tokenizer) > cfg.vocab_size:
        raise ValueError(f"save_hf: the tokenizer has {len(tokenizer)} tokens but the model only "
                         f"{cfg.vocab_size} embedding rows")
    out_dtype = np.dtype(dtype if dtype is not None else cfg.param_dtype)
    if out_dtype not in _DTYPE_NAMES:
        raise ValueError(f"cannot save dtype {out_dtype}")
    os.makedirs(path, exist_ok=True)
    flat = dict(nnx.to_flat_state(nnx.state(model)))

    # Plan: (hf name, our key, layer or None, transpose) in HF order, then greedy sharding.
    plan = []
    for spec in tensor_specs(cfg):
        key = tuple(spec.ours.split("."))
        shape = flat[key].get_value().shape
        layers = range(cfg.num_hidden_layers) if spec.stacked else [None]
        for i in layers:
            nbytes = int(np.prod(shape[1:] if spec.stacked else shape)) * out_dtype.itemsize
            plan.append((spec.hf.format(i=i), key, i, spec.transpose, nbytes))
    shards: list[list[tuple]] = [[]]
    size = 0
    for item in plan:
        if shards[-1] and size + item[-1] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[-1]

    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = _shard_file_name(k, len(shards))
        tensors = {}
        for hf_name, key, layer, transpose, nbytes in shard:
            arr = flat[key][...]
            arr = arr[layer] if layer is not None else arr  # slice on device, fetch one tensor
            host = np.asarray(jax.device_get(arr)).astype(out_dtype)
            tensors[hf_name] = host.T if transpose else host
            weight_map[hf_name] = fname
            total += nbytes
        write_safetensors(os.path.join(path, fname), tensors)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = {"bfloat16": "bfloat16", "float32": "float32",
                                               "float16": "float16"}.get(out_dtype.name, "float32")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation_config(cfg, tokenizer), f, indent=2)
    if tokenizer is not False:
        tokenizer.save_pretrained(path, chat_template=chat_format)

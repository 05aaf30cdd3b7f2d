"""What is wrong with a HF model directory, found before a run loads it (``model_dir_problems``):
``config.json`` of a supported architecture, safetensors files whose headers name the tensors of
that config at its shapes and whose sizes match their headers, and a tokenizer whose ids fit the
embedding table. Cheap: it reads ``config.json``, each file's header (its first bytes) and its
size, and ``tokenizer.json``; never a tensor, never a device (``rstarjax.check_config`` runs it on a
login node). ``models.hf.load_hf`` makes the same checks of the config and shapes when it loads.
"""
from __future__ import annotations

import json
import os
import struct

from rstarjax.models.config import ModelConfig
from rstarjax.models.hf import (IGNORABLE_SUFFIXES, CheckpointDirError, _expected_hf_shape, config_problem,
                                data_layout_problem, header_entry_problem, parse_header, tensor_specs,
                                two_weight_sets_problem)
from rstarjax.models.tokenizer import QWEN3_ADDED_TOKENS, QWEN3_NUM_REGULAR_TOKENS, saved_num_regular_tokens

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound on a header


def safetensors_header(path: str) -> dict:
    """The header of one ``.safetensors`` file (tensor name -> dtype, shape, data_offsets),
    after checking that the file's size is what the header says, that every tensor's byte
    range holds exactly its shape in its dtype and that the ranges tile the data (no overlap,
    no gap); ValueError naming the file otherwise."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{name} is {size} bytes: too short for a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{name}: its header claims {n} bytes, the file has {size - 8} after the length "
                             "(truncated, or not a safetensors file)")
        header = parse_header(name, f.read(n))
    header.pop("__metadata__", None)
    for tensor, info in header.items():  # (the file's size against the last tensor's end: below)
        problem = header_entry_problem(info)
        if problem:
            raise ValueError(f"{name}: tensor {tensor!r} {problem}")
    end = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
    if size != 8 + n + end:
        raise ValueError(f"{name} is {size} bytes but its header describes {8 + n + end} "
                         f"({'truncated' if size < 8 + n + end else 'bytes past the last tensor'})")
    problem = data_layout_problem(header, end)
    if problem:
        raise ValueError(f"{name}: {problem}")
    return header


def _tensor_files(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name -> (file, shape) over the directory's safetensors (one file, or an index
    and its shards, never both), each file checked by ``safetensors_header``; ValueError otherwise."""
    index = os.path.join(path, INDEX_FILE)
    problem = two_weight_sets_problem(path)
    if problem:
        raise CheckpointDirError(problem)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{INDEX_FILE} is not a safetensors index (no weight_map)") from None
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise ValueError(f"has neither {SINGLE_FILE} nor {INDEX_FILE}")
    where = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ValueError(f"{INDEX_FILE} names {name}, which is missing")
        if not os.access(file, os.R_OK):
            raise ValueError(f"{name} is not readable")
        for tensor, info in safetensors_header(file).items():
            where[tensor] = (name, tuple(info["shape"]))
    for tensor, name in (weight_map or {}).items():
        if where.get(tensor, (name,))[0] != name:
            raise ValueError(f"{INDEX_FILE} says tensor {tensor!r} is in {name}, but it is in {where[tensor][0]}")
        if tensor not in where:
            raise ValueError(f"{INDEX_FILE} says tensor {tensor!r} is in {name}, but it is not there")
    return where


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the shape ``cfg`` implies (``models.hf.tensor_specs``), from the model's
    abstract parameters (no array is made)."""
    from flax import nnx

    from rstarjax.models.qwen3 import Qwen3

    _, state = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))
    flat = dict(nnx.to_flat_state(state))
    shapes = {}
    for spec in tensor_specs(cfg):
        want = _expected_hf_shape(spec, flat[tuple(spec.ours.split("."))].get_value().shape)
        for name in ([spec.hf.format(i=i) for i in range(cfg.num_hidden_layers)] if spec.stacked else [spec.hf]):
            shapes[name] = want
    return shapes


def tokenizer_size(tokenizer_dir: str, num_regular_tokens: int = 0) -> int:
    """The ids the run's tokenizer can produce (``models.tokenizer.load_tokenizer_for``'s choice:
    ``num_regular_tokens``, else the ``tokenizer.json`` of ``tokenizer_dir``, else Qwen3's),
    without building it."""
    n = int(num_regular_tokens or 0) or (saved_num_regular_tokens(tokenizer_dir) if tokenizer_dir else None) \
        or QWEN3_NUM_REGULAR_TOKENS
    return n + len(QWEN3_ADDED_TOKENS)


def model_dir_problems(path: str, tokenizer_path: str = "", num_regular_tokens: int = 0) -> list[str]:
    """What is wrong with the HF model directory ``path`` (one line each, naming the file), as far
    as headers tell: [] when a run can load it. ``tokenizer_path`` / ``num_regular_tokens``: the
    run's tokenizer settings (``model.tokenizer_path``, ``model.tokenizer_num_regular_tokens``)."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
        problem = config_problem(hf)  # what the loader refuses (RoPE scaling, sliding windows, ...)
        if problem:
            return [f"config.json {problem}"]
        cfg = ModelConfig.from_hf_dict(hf)
    except OSError as e:
        return [f"config.json cannot be read: {e.strerror}"]
    except ValueError as e:  # not JSON, or an architecture / field load_hf does not support
        return [f"config.json: {str(e).removeprefix('config.json ').splitlines()[0]}"]
    except (TypeError, AttributeError, KeyError) as e:
        return [f"config.json is not a HF model config ({type(e).__name__}: {e})"]
    problems = []
    try:
        where = _tensor_files(path)
    except (OSError, ValueError) as e:
        problems.append(str(e))
    else:
        wanted = expected_shapes(cfg)
        missing = [n for n in wanted if n not in where]
        if missing:
            problems.append(f"the safetensors lack {len(missing)} tensor(s) config.json implies, e.g. {missing[0]!r}")
        for name, want in wanted.items():
            if name in where and where[name][1] != want:
                problems.append(f"{where[name][0]}: tensor {name!r} has shape {list(where[name][1])}, "
                                f"config.json implies {list(want)}")
                break
        unused = [n for n in where if n not in wanted and not n.endswith(IGNORABLE_SUFFIXES)
                  and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
        if unused:
            problems.append(f"{where[unused[0]][0]}: tensor {unused[0]!r} is not one config.json implies "
                            f"({len(unused)} such; another architecture or size?)")
    tok_dir = tokenizer_path or path
    try:
        tokens = tokenizer_size(tok_dir, num_regular_tokens)
    except (OSError, ValueError) as e:
        problems.append(f"tokenizer: {e}")
    else:
        if tokens > cfg.vocab_size:
            source = (f"tokenizer_num_regular_tokens={num_regular_tokens}" if num_regular_tokens else
                      "the tokenizer.json in " + tok_dir if os.path.isfile(os.path.join(tok_dir, "tokenizer.json"))
                      else "Qwen3's tokenizer (no tokenizer.json here)")
            problems.append(f"{source} has {tokens} tokens but config.json's vocab_size is {cfg.vocab_size}: "
                            "set model.tokenizer_num_regular_tokens (or model.tokenizer_path) "
                            "to the model's tokenizer")
    return problems

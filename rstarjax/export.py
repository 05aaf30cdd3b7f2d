"""Export a training checkpoint as a HuggingFace model directory.

    python -m rstarjax.export --checkpoint WORKDIR/checkpoints --out HF_DIR [--step N]
        [--model_config config.json | --preset qwen3-14b] [--dtype bfloat16]

The checkpoint is an Orbax directory written by ``io.checkpoint.Checkpointer`` (RL or SFT).
The architecture comes from, in order: ``--model_config`` (a HF config.json), the checkpoint's
meta ``model_config`` (SFT and the demo store it), a ``config.json`` next to the checkpoint
directory (``WORKDIR/hf``, ``WORKDIR/config.json``), or ``--preset``. A ``--model_config`` that
differs from the meta's in any field is refused, naming the fields; a config that lacks a params
array the checkpoint holds (``tie_word_embeddings=true`` for an untied run) is refused by the
restore, naming the array, rather than exported without it. Only the params are read
(never the optimizer state); ``models.save_hf`` writes config.json, safetensors shards and the
tokenizer (with the chat template of the format the run trained with, recorded in the checkpoint's
meta ``chat_format``; the rStar2 one for older checkpoints), so ``AutoModelForCausalLM.from_pretrained(HF_DIR)``
and ``AutoTokenizer.from_pretrained(HF_DIR)`` load it.

The arrays read are checked against the fingerprints their checkpoint recorded when it was saved:
without ``--step``, a damaged newest checkpoint is skipped (one warning line names it and why)
for the newest one that verifies; when none does, or ``--step`` names a damaged one, the export
stops with one line, exit status 2.

A LoRA checkpoint (meta ``lora``) holds adapters: its base is rebuilt from the meta's ``lora_base``
record (hash checked), the adapters merged into float32 weights; ``--peft_out DIR`` also writes
them as a HF PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``) for that base.

``--out`` (and ``--peft_out``) must be new, empty, or an earlier export (which it replaces whole):
the files are written into a directory beside it and renamed into place only once complete, with
``rstarjax_export.json`` (what was exported), so a failed export leaves nothing behind and a
directory never mixes two exports or an export with a model's own files (transformers would load
a stale ``model.safetensors`` there rather than the export's shards). A ``--out`` that cannot be
written, or holds other files, is one line and exit status 2 before any checkpoint is read. The
directory written into is locked while its export lives; an export removes those that killed
exports to the same ``--out`` left (``io.files.remove_abandoned_stagings``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.io import files
from rstarjax.models import ModelConfig, Qwen3, load_hf, load_tokenizer, save_hf
from rstarjax.models import lora as lora_lib
from rstarjax.models.hf import save_peft_adapter

log = logging.getLogger(__name__)


def model_config_differences(given: dict, recorded: dict) -> list[str]:
    """The fields in which two HF config dicts describe different models, each as ``field
    (given value, recorded value)``. Both are read as ``ModelConfig`` and written back, so only
    what the export uses counts: not the transformers 4 / 5 layout, nor fields it ignores
    (``transformers_version``, ``torch_dtype``)."""
    a, b = ModelConfig.from_hf_dict(given).to_hf_dict(), ModelConfig.from_hf_dict(recorded).to_hf_dict()
    return [f"{k} ({json.dumps(a.get(k))} vs {json.dumps(b.get(k))})" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


def resolve_model_config(checkpoint_dir: str, meta: dict, model_config: str | None = None,
                         preset: str | None = None):
    """The ModelConfig of the checkpoint (see the module doc for the search order). A
    ``model_config`` that differs from the one the checkpoint's meta records is refused: the
    meta's is the model that was trained, and another (a tied head, say) would export other
    weights than the run's."""
    if model_config:
        with open(model_config) as f:
            given = json.load(f)
        differences = model_config_differences(given, meta["model_config"]) if meta.get("model_config") else []
        if differences:
            raise ValueError(f"--model_config {model_config} does not match the model_config the checkpoint's "
                             f"meta records, in {'; '.join(differences)} (--model_config vs meta): drop "
                             "--model_config, the meta names the model the checkpoint was trained as")
        return ModelConfig.from_hf_dict(given), f"--model_config {model_config}"
    if meta.get("model_config"):
        return ModelConfig.from_hf_dict(meta["model_config"]), "checkpoint meta"
    parent = os.path.dirname(os.path.abspath(checkpoint_dir))
    for cand in (os.path.join(parent, "hf", "config.json"), os.path.join(parent, "config.json")):
        if os.path.exists(cand):
            with open(cand) as f:
                return ModelConfig.from_hf_dict(json.load(f)), cand
    if preset:
        return ModelConfig.preset(preset), f"--preset {preset}"
    raise ValueError(f"cannot tell the architecture of {checkpoint_dir}: its meta has no model_config; pass "
                     "--model_config path/to/config.json (the base model's) or --preset NAME")


def load_checkpoint(checkpoint_dir: str, step: int | None = None, model_config: str | None = None,
                    preset: str | None = None, tokenizer_num_regular_tokens: int | None = None):
    """The policy (float32) and tokenizer of a checkpoint's params, and what was read:
    ``(model, tokenizer, {"step", "config_source", "num_params"})``.

    Without ``step``, the newest checkpoint whose arrays read and match the fingerprints recorded
    at their save: a damaged newer one is skipped with one warning line naming it and why;
    ``CheckpointError`` when none does. A given ``step`` that is damaged raises
    ``UnreadableCheckpoint``."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir!r} does not exist")
    if step is not None:
        return _load_step(checkpoint_dir, step, model_config, preset, tokenizer_num_regular_tokens)
    steps = _finished_steps(checkpoint_dir)
    skipped = []
    for candidate in sorted(steps, reverse=True):
        try:
            out = _load_step(checkpoint_dir, candidate, model_config, preset, tokenizer_num_regular_tokens)
        except ckpt_lib.UnreadableCheckpoint as e:
            skipped.append(e)
            continue
        if skipped:
            log.warning("%s: exporting step %d", "; ".join(str(e) for e in skipped), candidate)
        return out
    raise ckpt_lib.CheckpointError(f"no checkpoint in {checkpoint_dir} restores: " + "; ".join(
        str(e) for e in skipped))


def _finished_steps(checkpoint_dir: str) -> list[int]:
    steps = ckpt_lib.finished_steps(checkpoint_dir)
    if not steps:
        hint = ckpt_lib.checkpoint_dir_hint(checkpoint_dir, "--checkpoint ", step_flag="--step ",
                                            hf_advice=": it is an export already (or a model to start from)")
        raise FileNotFoundError(f"no finished checkpoint in {checkpoint_dir}{hint}")
    return steps


def _load_step(checkpoint_dir: str, step: int, model_config: str | None, preset: str | None,
               tokenizer_num_regular_tokens: int | None):
    step_dir = os.path.join(os.path.abspath(checkpoint_dir), str(step))
    try:
        step, meta = ckpt_lib.read_checkpoint_meta(checkpoint_dir, step)
    except FileNotFoundError as e:
        if not os.path.isdir(step_dir):  # no such step: the caller's choice, not damage
            raise
        # the step is there but its meta file is gone: damaged, skipped like any other
        raise ckpt_lib.UnreadableCheckpoint(step_dir, ckpt_lib._first_line(e)) from e
    except Exception as e:  # noqa: BLE001 - a torn meta (JSONDecodeError, OSError): the checkpoint is damaged
        raise ckpt_lib.UnreadableCheckpoint(step_dir, ckpt_lib._first_line(e)) from e
    cfg, source = resolve_model_config(checkpoint_dir, meta, model_config, preset)
    cfg = cfg.replace(dtype=jnp.float32, param_dtype=jnp.float32)
    if meta.get("lora"):
        model = load_lora_policy(checkpoint_dir, step, meta, cfg)
        tokenizer = _tokenizer(meta, tokenizer_num_regular_tokens, cfg)
        return model, tokenizer, {"step": step, "config_source": source, "num_params": cfg.num_params,
                                  "chat_format": meta.get("chat_format", "rstar2"), "lora_base": meta["lora_base"]}
    abstract_model = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_params, rest = nnx.split(abstract_model, nnx.Param, ...)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_params)
    try:
        params, _, _ = ckpt_lib.restore_params(checkpoint_dir, abstract, step)
    except ckpt_lib.UnreadableCheckpoint:
        raise
    except (ValueError, KeyError) as e:
        raise ValueError(f"checkpoint {checkpoint_dir} step {step} does not match the architecture from "
                         f"{source} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab "
                         f"{cfg.vocab_size}): {e}") from e
    rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), rest)
    model = nnx.merge(graphdef, params, rest)
    tokenizer = _tokenizer(meta, tokenizer_num_regular_tokens, cfg)
    return model, tokenizer, {"step": step, "config_source": source, "num_params": cfg.num_params,
                              "chat_format": meta.get("chat_format", "rstar2")}


def _tokenizer(meta: dict, tokenizer_num_regular_tokens: int | None, cfg):
    n_regular = tokenizer_num_regular_tokens or meta.get("tokenizer_num_regular_tokens")
    tokenizer = load_tokenizer(int(n_regular) if n_regular else None)
    if tokenizer.num_tokens > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.num_tokens} tokens but the model only {cfg.vocab_size} rows; "
                         "pass --tokenizer_num_regular_tokens")
    return tokenizer


def _single_device(tree):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)


def lora_base_model(record: dict, cfg) -> Qwen3:
    """The plain float32 model a LoRA checkpoint's ``lora_base`` record names
    (``recipes.lora_base``): a HF directory, the seeded random preset of a test run, or a
    full-parameter checkpoint's params."""
    if record.get("source") == "checkpoint":
        graphdef, abstract, rest = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
        params, _, _ = ckpt_lib.restore_params(record["path"], _single_device(abstract), int(record["step"]))
        return nnx.merge(graphdef, params, rest)
    random = record.get("random_init")
    if random:
        return Qwen3(cfg, rngs=nnx.Rngs(int(random["seed"])))
    if not os.path.isdir(record.get("path", "")):
        raise FileNotFoundError(f"the LoRA base {record.get('path')!r} the checkpoint names is not a directory")
    return load_hf(record["path"], dtype=jnp.float32, param_dtype=jnp.float32)


def load_lora_policy(checkpoint_dir: str, step: int, meta: dict, cfg) -> Qwen3:
    """The LoRA model (frozen bf16 base + float32 adapters) of a LoRA checkpoint: its base
    rebuilt from the meta's ``lora_base`` record (hash checked), its adapters read from the
    checkpoint (never the optimizer state)."""
    record, spec = meta.get("lora_base"), meta["lora"]
    if not record:
        raise ValueError(f"checkpoint {checkpoint_dir} has LoRA adapters but no lora_base record of their base")
    model = lora_lib.attach(lora_base_model(record, cfg), spec["rank"], spec["alpha"], tuple(spec["targets"]))
    graphdef, adapters, frozen = nnx.split(model, nnx.LoRAParam, ...)
    got = lora_lib.weights_fingerprint(frozen)
    if record.get("hash") and got != record["hash"]:
        raise ValueError(f"the LoRA base {record.get('path')!r} hashes to {got}, not {record['hash']} as when "
                         f"{checkpoint_dir} was trained: its adapters belong to other weights")
    adapters, _, _ = ckpt_lib.restore_params(checkpoint_dir, _single_device(adapters), step)
    return nnx.merge(graphdef, adapters, frozen)


EXPORT_RECORD = "rstarjax_export.json"  # written last into every export: what a later one may replace


def out_dir_problem(out_dir: str, flag: str = "--out") -> str | None:
    """Why ``out_dir`` cannot take an export (one line), or None: it must be new, empty, or an
    earlier export (it holds ``EXPORT_RECORD``). Any other file there would sit beside the export's
    (a base model's ``model.safetensors``, which transformers prefers to the export's shards)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        return f"{flag} {out_dir!r} is a file: give a directory"
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if names and EXPORT_RECORD not in names:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        return (f"{flag} {out_dir!r} already holds files that no export wrote ({shown}): give a new or empty "
                "directory (an export there would mix its files with these)")
    return None


def staging_dir(out_dir: str, flag: str = "--out") -> files.Staging:
    """A fresh directory beside ``out_dir`` to write the export into (so its parent is known to
    be writable before any checkpoint is read), after removing what killed exports there left;
    ``ValueError`` when ``out_dir`` cannot take one."""
    problem = out_dir_problem(out_dir, flag)
    if problem:
        raise ValueError(problem)
    try:
        return files.new_staging(out_dir)
    except OSError as e:
        raise ValueError(f"{flag} {out_dir!r} cannot be written: {e.strerror or e} (give a directory this "
                         "process can create files in)") from None


def publish(staging: str, out_dir: str, record: dict) -> bool:
    """Write ``record`` as ``EXPORT_RECORD`` into the complete ``staging`` directory and rename
    it to ``out_dir``, replacing an empty directory or an earlier export there (returns whether
    one was replaced). ``out_dir`` is never half-written (``files.replace_dir``)."""
    files.write_json_atomic(os.path.join(staging, EXPORT_RECORD), record)
    return files.replace_dir(staging, out_dir)


def export_checkpoint(checkpoint_dir: str, out_dir: str, step: int | None = None, model_config: str | None = None,
                      preset: str | None = None, dtype: str | None = None, tokenizer_num_regular_tokens: int | None = None,
                      peft_dir: str | None = None) -> dict:
    """Write ``out_dir`` from the checkpoint's params (a LoRA checkpoint: its adapters merged
    into its base, float32 unless ``dtype``); with ``peft_dir`` also its adapters as a HF PEFT
    adapter (LoRA checkpoints only); returns what was exported. ``out_dir`` and ``peft_dir``
    appear complete or not at all (``publish``)."""
    if peft_dir and os.path.abspath(peft_dir) == os.path.abspath(out_dir):
        raise ValueError(f"--peft_out {peft_dir!r} is --out too: give the adapter its own directory")
    stagings = {out_dir: staging_dir(out_dir)}
    try:
        if peft_dir:
            stagings[peft_dir] = staging_dir(peft_dir, "--peft_out")
        model, tokenizer, info = load_checkpoint(checkpoint_dir, step, model_config, preset,
                                                 tokenizer_num_regular_tokens)
        if peft_dir and not model.config.lora_rank:
            raise ValueError(f"--peft_out: checkpoint {checkpoint_dir} holds full parameters, not LoRA adapters")
        save_hf(model, stagings[out_dir].path, tokenizer=tokenizer, dtype=jnp.dtype(dtype) if dtype else None,
                chat_format=info["chat_format"])
        out = {"step": info["step"], "out": out_dir, "config_source": info["config_source"],
               "num_params": info["num_params"], "chat_format": info["chat_format"]}
        if model.config.lora_rank:  # say what was written: the merged weights, not the adapters
            out["lora"] = (f"rank-{model.config.lora_rank} adapters merged into the base's weights "
                           f"({jnp.dtype(dtype or jnp.float32).name})")
        if peft_dir:
            save_peft_adapter(model, stagings[peft_dir].path, info["lora_base"].get("path", ""))
            out["peft_out"] = peft_dir
        record = {"checkpoint": os.path.abspath(checkpoint_dir), "step": info["step"],
                  "config_source": info["config_source"], "dtype": dtype or "float32"}
        for final, staged in stagings.items():
            if publish(staged.path, final, record):
                out.setdefault("replaced", []).append(final)
    finally:
        for staged in stagings.values():
            staged.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rstarjax.export", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="Orbax checkpoint directory (WORKDIR/checkpoints)")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--model_config", default=None, help="HF config.json of the architecture")
    p.add_argument("--preset", default=None, help="ModelConfig preset, when nothing else names the architecture")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="saved tensor dtype (default: float32 master weights)")
    p.add_argument("--tokenizer_num_regular_tokens", type=int, default=None,
                   help="small-vocab tokenizer size (default: from the checkpoint meta, else full Qwen3)")
    p.add_argument("--peft_out", default=None,
                   help="LoRA checkpoints: also write the adapters as a HF PEFT adapter directory here")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.step, args.model_config, args.preset, args.dtype,
                                args.tokenizer_num_regular_tokens, args.peft_out)
    except (FileNotFoundError, ValueError, ckpt_lib.CheckpointError) as e:  # one line each
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a full disk while writing: nothing was left in --out
        print(f"export failed: {e.strerror or e}{f': {e.filename}' if e.filename else ''} "
              f"({args.out!r} is unchanged)", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

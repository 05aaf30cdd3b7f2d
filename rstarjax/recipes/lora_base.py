"""Where a LoRA run's frozen base weights come from (docs/lora.md "Checkpoints").

A LoRA checkpoint holds the adapters and their optimizer state only (``TrainState.params`` are
the adapters); its meta ``lora_base`` record says which base they belong to and a hash of it
(``models.lora.weights_fingerprint`` of the bfloat16 base the trainer held):

* ``{"source": "model", "path": HF_DIR}``: the model as built (``model.hf_path``, or the seeded
  random preset of a test: path ``"random <preset> seed <seed>"``);
* ``{"source": "checkpoint", "path": CKPT_DIR, "step": N}``: a full-parameter checkpoint's
  params (an SFT run, or a full fine-tuning RL stage) at step N.

A resume, a later stage and ``rstarjax.export`` rebuild the base from the record and refuse one
whose hash differs (the adapters would be applied to other weights).
"""
from __future__ import annotations

import os

import jax

from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.models import lora as lora_lib
from rstarjax.validation import StageError


class BaseMismatch(StageError):
    """The frozen base rebuilt for a LoRA checkpoint is not the one its adapters were trained on
    (a ``StageError``: one line at the command line, exit 2)."""


def model_record(model_src, seed: int) -> dict:
    """The record of a base that is the model as built from the ``model`` section."""
    if model_src.random_init:  # tests and demos: the seeded preset (export rebuilds it from the seed)
        return {"source": "model", "path": f"random {model_src.preset} seed {int(seed)}",
                "random_init": {"preset": model_src.preset, "seed": int(seed)}}
    return {"source": "model", "path": os.path.abspath(model_src.hf_path)}


def with_hash(record: dict, frozen) -> dict:
    return dict(record, hash=lora_lib.weights_fingerprint(frozen))


def full_params_abstract(trainer):
    """What a full-parameter checkpoint's ``params`` restore onto: the frozen base's structure
    (the plain model's parameter paths), on its shardings, cast to its (bfloat16) dtype."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        trainer.frozen, trainer.frozen_sharding)


def load_checkpoint_base(trainer, path: str, step: int) -> None:
    """The frozen base := the params of the full-parameter checkpoint ``path`` at ``step``."""
    params, _, _ = ckpt_lib.restore_params(path, full_params_abstract(trainer), step=int(step))
    trainer.set_frozen(params)


def restore_base(trainer, record: dict, flag_hint: str = "--config.model.hf_path") -> dict:
    """Put the base ``record`` names into ``trainer`` (a model-sourced base is the one already
    built) and check its hash; returns the record. ``BaseMismatch`` names what to fix."""
    if record.get("source") == "checkpoint":
        load_checkpoint_base(trainer, record["path"], record["step"])
    elif record.get("source") != "model":
        raise BaseMismatch(f"unknown LoRA base record {record!r}")
    got = lora_lib.weights_fingerprint(trainer.frozen)
    if record.get("hash") and got != record["hash"]:
        where = (f"the checkpoint {record['path']} step {record['step']}" if record["source"] == "checkpoint"
                 else f"{record['path']!r}")
        hint = "" if record["source"] == "checkpoint" else f" (set {flag_hint} to the base it was trained on)"
        raise BaseMismatch(f"the LoRA adapters were trained on the base {where} with hash {record['hash']}, "
                           f"but the base built now hashes to {got}{hint}")
    return dict(record, hash=got)


def check_same_base(saved: dict, now: dict, directory: str) -> None:
    """A LoRA checkpoint holds adapters only: an SFT resume puts them onto the base they were trained on
    (``lora_base``'s hash), and only as LoRA; ``BaseMismatch`` names what differs."""
    was, is_ = saved.get("lora_base"), now.get("lora_base")
    if bool(was) != bool(is_):
        raise BaseMismatch(
            f"{directory} holds {'LoRA adapters' if was else 'full parameters'} but this run trains "
            f"{'LoRA adapters' if is_ else 'full parameters'}: "
            + ("set --config.model.lora_rank as that run did" if was else "unset --config.model.lora_rank"))
    if was and was.get("hash") != is_.get("hash"):
        raise BaseMismatch(
            f"the LoRA adapters in {directory} were trained on the base {was.get('path')!r} with hash "
            f"{was.get('hash')}, but the base built now ({is_.get('path')!r}) hashes to {is_.get('hash')} "
            "(set --config.model.hf_path to the base it was trained on)")


def lora_setting_flags(saved: dict | None, rank: int, alpha: float, targets) -> str:
    """The flags that give a run the LoRA setting of adapters saved with ``saved`` (a checkpoint's
    ``lora`` record: rank, alpha, targets), or "" when ``rank``, ``alpha`` and ``targets`` (the
    run's) are it. Another rank fails in Orbax's restore with a shape error; another alpha or
    target set would restore and silently train or sample another policy."""
    if not saved:
        return ""
    flags = []
    if int(saved.get("rank", rank)) != int(rank):
        flags.append(f"--config.model.lora_rank={saved['rank']}")
    if float(saved.get("alpha", alpha)) != float(alpha):
        flags.append(f"--config.model.lora_alpha={saved['alpha']}")
    if saved.get("targets") is not None and sorted(saved["targets"]) != sorted(targets):
        flags.append(f"--config.model.lora_targets={','.join(saved['targets'])}")
    return " ".join(flags)


def restore_lora_policy(model, directory: str):
    """A LoRA ``model`` (as built, on its mesh) with the adapters of the newest checkpoint in
    ``directory`` on the base its record names (hash checked): for a run that only samples
    from a LoRA stage's policy (the stage-3 filter). Returns (model, step)."""
    from flax import nnx

    graphdef, adapters, frozen = nnx.split(model, nnx.LoRAParam, ...)
    ckpt = ckpt_lib.Checkpointer(directory, ckpt_lib.CheckpointConfig(async_save=False))
    try:
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {directory}")
        meta = ckpt.read_meta(step)
    finally:
        ckpt.close()
    record, cfg = meta.get("lora_base"), model.config
    if not record:
        raise BaseMismatch(f"{directory} holds full parameters, not LoRA adapters: unset --config.model.lora_rank")
    flags = lora_setting_flags(meta.get("lora"), cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    if flags:
        raise BaseMismatch(f"{directory} holds adapters of another LoRA setting: give {flags}")
    shardings = jax.tree.map(lambda x: x.sharding, frozen)
    if record.get("source") == "checkpoint":
        frozen, _, _ = ckpt_lib.restore_params(record["path"], ckpt_lib.abstract_like(frozen, shardings),
                                               step=int(record["step"]))
    got = lora_lib.weights_fingerprint(frozen)
    if record.get("hash") and got != record["hash"]:
        raise BaseMismatch(f"the LoRA adapters of {directory} were trained on the base {record.get('path')!r} "
                           f"with hash {record['hash']}, but the base built now hashes to {got} "
                           "(set --config.model.hf_path to the base it was trained on)")
    adapters, _, _ = ckpt_lib.restore_params(
        directory, ckpt_lib.abstract_like(adapters, jax.tree.map(lambda x: x.sharding, adapters)), step=step)
    return nnx.merge(graphdef, adapters, frozen), step

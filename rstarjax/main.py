"""Entry point: ``python -m rstarjax.main --config=configs/stage2.py --workdir=DIR``.

A thin dispatcher on ``config.mode`` (``--config=configs/stage3.py:filter`` picks a mode through
the config argument; ``--config.rl.max_turns=15`` overrides any field). ``validate(config)``
rejects bad configurations at start with a message that says how to fix them, before any
device, model or data is touched.

Multi-host: set ``--config.distributed.num_processes=N --config.distributed.process_id=I
--config.distributed.coordinator_address=HOST:PORT`` (or leave num_processes=0 on a managed
cluster where ``jax.distributed.initialize()`` finds them itself).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

# Modes and the function running each: (config, workdir) -> None. SFT / eval / demo register here.
# Modes other than rl/filter check their own config section when they start.
MODES: dict[str, str] = {
    "rl": "rstarjax.rl.trainer:run_rl",
    "filter": "rstarjax.rl.stage3_filter:run_filter",
    "sft": "rstarjax.rl.sft:run_sft",
    "eval": "rstarjax.rl.evaluate:run_eval",
    "demo": "rstarjax.rl.demo:run_demo",
    "demo_compare": "rstarjax.rl.demo_compare:run_compare",
}

KNOWN_DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which flag to change."""


def _require_file(path: str, flag: str, what: str) -> list[str]:
    if not path:
        return [f"{flag} is empty: set {flag}=/path/to/{what}"]
    if not os.path.exists(path):
        return [f"{flag}={path!r} does not exist: point it at {what}"]
    return []


def _validate_model(config) -> list[str]:
    errs = []
    m = config.model
    if m.random_init:
        from rstarjax.models.config import PRESETS

        if m.preset not in PRESETS:
            errs.append(f"--config.model.preset={m.preset!r} is unknown; known: {sorted(PRESETS)}")
    else:
        errs += _require_file(m.hf_path, "--config.model.hf_path", "a HF model dir (config.json + *.safetensors)")
        if m.hf_path and os.path.isdir(m.hf_path) and not os.path.exists(os.path.join(m.hf_path, "config.json")):
            errs.append(f"--config.model.hf_path={m.hf_path!r} has no config.json")
    if m.dtype not in KNOWN_DTYPES:
        errs.append(f"--config.model.dtype={m.dtype!r} must be one of {KNOWN_DTYPES}")
    return errs


def _validate_mesh(config, num_devices: int | None) -> list[str]:
    sizes = [config.mesh.data, config.mesh.fsdp, config.mesh.tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        return [f"mesh (data, fsdp, tensor)={sizes}: sizes must be >= 1 with at most one -1 (= the rest)"]
    if num_devices is None:
        return []
    known = 1
    for s in sizes:
        known *= s if s != -1 else 1
    if (-1 in sizes and num_devices % known) or (-1 not in sizes and known != num_devices):
        return [f"mesh (data, fsdp, tensor)={sizes} does not fit the {num_devices} devices present: "
                f"make data*fsdp*tensor == {num_devices}, e.g. --config.mesh.fsdp=-1"]
    return []


def _validate_rl(config, num_devices: int | None, num_processes: int) -> list[str]:
    errs = []
    rl, tr = config.rl, config.trainer
    if rl.group_size < 2:
        errs.append(f"--config.rl.group_size={rl.group_size}: GRPO needs G >= 2 rollouts per prompt")
    if rl.roc and rl.oversample != 2 * rl.group_size:
        errs.append(f"--config.rl.oversample={rl.oversample} must be 2 * group_size = {2 * rl.group_size} "
                    "with RoC (rStar2-Agent §2.2.3 samples 2G and keeps G); or set --config.rl.roc=False "
                    "(the GRPO baseline samples group_size rollouts and trains on all of them)")
    if rl.roc and rl.get("roc_variant", "paper") == "topk":
        floors = rl.get("roc_min_negatives", 2) + rl.get("roc_min_positives", 2)
        if min(rl.get("roc_min_negatives", 2), rl.get("roc_min_positives", 2)) < 0 or floors > rl.group_size:
            errs.append(f"--config.rl.roc_min_negatives + roc_min_positives = {floors} must lie in [0, group_size="
                        f"{rl.group_size}] (the official code asserts the same)")
    if rl.get("max_rejected_batches", 1) < 1:
        errs.append(f"--config.rl.max_rejected_batches={rl.max_rejected_batches} must be >= 1")
    if rl.max_turns < 1:
        errs.append(f"--config.rl.max_turns={rl.max_turns} must be >= 1")
    if rl.max_prompt_len < 1 or rl.max_response_len < 1:
        errs.append("--config.rl.max_prompt_len and max_response_len must be >= 1")
    if num_devices is not None and not config.model.random_init:
        pass  # the model's max_position_embeddings is checked when the model loads
    if rl.prompts_per_step < 1 or rl.prompts_per_step % max(num_processes, 1):
        errs.append(f"--config.rl.prompts_per_step={rl.prompts_per_step} must be a positive multiple of the "
                    f"{num_processes} processes")
    if rl.temperature <= 0:
        errs.append(f"--config.rl.temperature={rl.temperature} must be > 0 for RL sampling")
    if not 0 < rl.top_p <= 1:
        errs.append(f"--config.rl.top_p={rl.top_p} must be in (0, 1]")
    rows = rl.prompts_per_step * rl.group_size
    if tr.mini_batches < 1 or rows % tr.mini_batches:
        errs.append(f"--config.trainer.mini_batches={tr.mini_batches} must divide the {rows} rows per step "
                    f"(prompts_per_step * group_size)")
    else:
        mini = rows // tr.mini_batches
        mbs = tr.micro_batch_size or mini
        if mbs < 1 or mini % mbs:
            errs.append(f"--config.trainer.micro_batch_size={tr.micro_batch_size} must divide the mini-batch of "
                        f"{mini} rows (prompts_per_step * group_size / mini_batches)")
        if num_devices is not None and not _validate_mesh(config, num_devices):
            sizes = {"data": config.mesh.data, "fsdp": config.mesh.fsdp, "tensor": config.mesh.tensor}
            known = 1
            for v in sizes.values():
                known *= v if v != -1 else 1
            for k, v in sizes.items():
                if v == -1:
                    sizes[k] = num_devices // known
            dp = sizes["data"] * sizes["fsdp"]
            if mbs % dp:
                errs.append(f"--config.trainer.micro_batch_size={mbs} must be a multiple of data*fsdp={dp} "
                            "(each device takes an equal share of every micro-batch)")
    if config.total_steps < 1:
        errs.append(f"--config.total_steps={config.total_steps} must be >= 1")
    o = config.optim
    if o.learning_rate <= 0 or o.warmup_steps < 0 or o.weight_decay < 0:
        errs.append("--config.optim: learning_rate must be > 0, warmup_steps and weight_decay >= 0")
    if config.loss.eps_low <= 0 or config.loss.eps_low >= 1 or config.loss.eps_high <= 0:
        errs.append("--config.loss: need 0 < eps_low < 1 and eps_high > 0")
    if config.loss.kl_coef < 0 or config.loss.entropy_coef < 0:
        errs.append("--config.loss.kl_coef and entropy_coef must be >= 0 (0 = off; the paper uses 0, §2.2.1)")
    rounds = config.rl.get("dynamic_sampling_max_rounds", 1)
    if not isinstance(rounds, int) or rounds < 1:
        errs.append(f"--config.rl.dynamic_sampling_max_rounds={rounds!r} must be an integer >= 1 "
                    "(rollout rounds per step, the first included; 1 = drop zero-variance groups "
                    "without refilling)")
    if config.rl.get("chat_format", "rstar2") not in ("rstar2", "compact"):
        errs.append(f"--config.rl.chat_format={config.rl.chat_format!r}: choose 'rstar2' or 'compact'")
    if config.rl.get("roc_variant", "paper") not in ("paper", "topk"):
        errs.append(f"--config.rl.roc_variant={config.rl.roc_variant!r}: choose 'paper' or 'topk'")
    if config.checkpoint.every_steps < 1 or config.checkpoint.keep < 1:
        errs.append("--config.checkpoint.every_steps and keep must be >= 1")
    if config.checkpoint.init_from and not os.path.isdir(config.checkpoint.init_from):
        errs.append(f"--config.checkpoint.init_from={config.checkpoint.init_from!r} is not a directory "
                    "(give the previous stage's WORKDIR/checkpoints)")
    if (config.checkpoint.reset_optimizer or config.checkpoint.update_reference) and not config.checkpoint.init_from:
        errs.append("stage-3 options (checkpoint.reset_optimizer / update_reference) need "
                    "--config.checkpoint.init_from=STAGE2_WORKDIR/checkpoints")
    return errs


def _validate_tools(config) -> list[str]:
    n = config.rl.get("num_tool_workers", 0) if "rl" in config else 0
    if not isinstance(n, int) or n < 0:
        return [f"--config.rl.num_tool_workers={n!r} must be an integer >= 0 (0 = one per host core)"]
    return []


def _validate_filter(config) -> list[str]:
    errs = []
    if config.filter.k < 1:
        errs.append(f"--config.filter.k={config.filter.k} must be >= 1")
    if config.filter.batch_prompts < 1:
        errs.append(f"--config.filter.batch_prompts={config.filter.batch_prompts} must be >= 1")
    if config.rl.max_turns < 1 or config.rl.max_response_len < 1:
        errs.append("--config.rl.max_turns and max_response_len must be >= 1")
    return errs


def validate(config, num_devices: int | None = None, num_processes: int = 1) -> None:
    """Raise ConfigError listing every problem (one per line) with the flag that fixes it.

    ``num_devices``: check the mesh against it (None skips the device checks).
    """
    mode = config.get("mode")
    errs: list[str] = []
    if mode not in MODES:
        raise ConfigError(f"config.mode={mode!r} is unknown; choose one of {sorted(MODES)} "
                          "(e.g. --config=configs/stage3.py:filter)")
    if "mesh" in config:
        errs += _validate_mesh(config, num_devices)
    if mode in ("rl", "filter", "eval", "demo", "demo_compare"):
        errs += _validate_tools(config)
    if mode in ("rl", "filter"):
        errs += _validate_model(config)
        errs += _require_file(config.data.train_path, "--config.data.train_path", "a jsonl/parquet of problems")
    if mode == "rl":
        errs += _validate_rl(config, num_devices, num_processes)
    if mode == "filter":
        errs += _validate_filter(config)
    if mode == "sft":
        errs += _validate_model(config)
        errs += _require_file(config.sft.data_path, "--config.sft.data_path",
                              'a jsonl/parquet of {"messages": [...]} chat records')
    if mode == "eval":
        errs += _validate_model(config)
        paths = [p for p in str(config.eval.paths).split(",") if p]
        if not paths:
            errs.append("--config.eval.paths is empty: set --config.eval.paths=aime24.jsonl,math500.parquet")
        for path in paths:
            errs += _require_file(path, "--config.eval.paths", "a benchmark jsonl/parquet")
    if errs:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errs))


def resolve(target: str) -> Callable:
    import importlib

    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def init_distributed(config) -> None:
    """jax.distributed for multi-process runs (before any other JAX call)."""
    d = config.get("distributed")
    if d is None or (d.num_processes <= 1 and not d.auto):
        return
    import jax

    if d.auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=d.coordinator_address, num_processes=d.num_processes,
                                   process_id=d.process_id, initialization_timeout=d.timeout_s)


def run(config, workdir: str) -> None:
    """Validate, set up JAX, and run the mode."""
    validate(config)  # static checks first: fail before touching devices
    init_distributed(config)
    import jax

    validate(config, num_devices=jax.device_count(), num_processes=jax.process_count())
    os.makedirs(workdir, exist_ok=True)
    resolve(MODES[config.mode])(config, workdir)


def main(argv=None) -> None:
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "configs/<preset>.py[:mode]", lock_config=True)
    flags.DEFINE_string("workdir", None, "checkpoints, logs and outputs go here "
                        "(default: runs/<mode>)")
    flags.mark_flags_as_required(["config"])

    def _main(_):
        from absl import logging

        if not flags.FLAGS["verbosity"].present:  # Orbax logs every save at INFO; --verbosity=0 shows it
            logging.set_verbosity(logging.WARNING)
        config = flags.FLAGS.config
        workdir = flags.FLAGS.workdir or os.path.join("runs", str(config.get("mode", "run")))
        print(f"rstarjax: mode={config.get('mode')} workdir={os.path.abspath(workdir)}", flush=True)
        try:
            run(config, workdir)
        except ConfigError as e:
            print(e, file=sys.stderr)
            sys.exit(2)

    app.run(_main, argv=argv)


if __name__ == "__main__":
    main()

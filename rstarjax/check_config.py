"""Check a launch command line before starting it on a cluster:
``python -m rstarjax.check_config --devices=32 --processes=8 --config=configs/stage1.py --config.a.b=...``.

The same ``--config`` arguments as ``rstarjax.main`` (parsed by the same flag library), checked by
the same rules (``recipes.config.parse``), with the device and process counts of the cluster given
instead of found: no accelerator, no ``jax.distributed`` and no model is touched, so it runs on a
laptop or a login node (the paths it names must exist where it runs). The files are checked as
far as is cheap (``recipes.config.parse``): the data file's type and first rows
(``io.data.dataset_problems``), the model directory's config, safetensors headers and sizes and
tokenizer size (``models.hf_check``). Prints one line with the resolved mesh and batch layout, or
every problem with the flag that fixes it (exit 2); a misspelled ``--config.KEY`` names the key it
most likely meant (``unknown_key_errors``).
docs/launch.md's commands are checked this way in the tests.
"""
from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from rstarjax.recipes.config import RENAMED, RunConfig, device_rules, parse, trainer_device_count
from rstarjax.validation import ConfigError


def dotted_keys(config, prefix: str = "") -> list[str]:
    """Every key of a ConfigDict, nested sections' as ``section.key``."""
    out = []
    for key, value in config.items():
        out.append(prefix + key)
        if isinstance(value, ml_collections.ConfigDict):
            out += dotted_keys(value, f"{prefix}{key}.")
    return out


def closest_key(key: str, keys: Sequence[str]) -> str | None:
    """The key of ``keys`` that ``key`` most likely misspells: the closest dotted key, else the
    key whose last part is closest to ``key``'s (in the same section first)."""
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.8)
    if close:
        return close[0]
    section, _, leaf = key.rpartition(".")
    by_leaf = {}
    for k in keys:
        by_leaf.setdefault(k.rpartition(".")[2], []).append(k)
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    if not close:
        return None
    matches = by_leaf[close[0]]
    return next((k for k in matches if k.rpartition(".")[0] == section), matches[0])


def unknown_key_errors(argv: Sequence[str], config) -> list[str]:
    """One line for each ``--config.KEY=VALUE`` of ``argv`` whose KEY ``config`` does not have,
    with the key it most likely misspells."""
    keys = dotted_keys(config)
    errors = []
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key = arg[len("--config."):].split("=", 1)[0]
        if key in keys:
            continue
        guess = closest_key(key, keys)
        errors.append(f"{arg} does not parse: the config has no key {key!r}"
                      + (f"; did you mean --config.{guess}?" if guess else
                         f" (its top-level keys: {', '.join(k for k in keys if '.' not in k)})"))
    return errors


def _load(argv: Sequence[str]):
    """The FlagValues of ``rstarjax.main``'s flags, parsed from ``argv`` (program name first),
    and what is left of ``argv``."""
    fv = flags.FlagValues()
    # sys_argv: config_flags finds the --config.KEY overrides there (by default in sys.argv)
    config_flags.DEFINE_config_file("config", None, "configs/<preset>.py[:mode]", flag_values=fv, lock_config=True,
                                    sys_argv=list(argv))
    flags.DEFINE_string("workdir", None, "ignored here", flag_values=fv)
    return fv, fv(list(argv))


def _cannot_load(e: OSError) -> ConfigError:
    return ConfigError("--config: cannot load the config file: " + str(e).strip().splitlines()[-1].strip())


def _without_overrides(argv: Sequence[str]):
    """The config of ``argv``'s ``--config=FILE[:mode]`` alone (None when it does not parse; a file
    that does not load: ``ConfigError`` saying so)."""
    try:
        fv, _ = _load([a for a in argv if not a.startswith("--config.")])
        config = fv.config
        if config is not None:
            config.get("mode")  # config_flags loads the file when the config is first used
        return config
    except OSError as e:
        raise _cannot_load(e) from e
    except Exception:  # noqa: BLE001 - the caller reports the original error
        return None


def renamed_flags(argv: Sequence[str]) -> list[str]:
    """A message for each ``--config.KEY`` override of a key that moved (the flag parser would only
    say that the key does not exist)."""
    out = []
    for arg in argv:
        key = arg[len("--config."):].split("=")[0] if arg.startswith("--config.") else ""
        if key in RENAMED:
            out.append(f"{arg}: --config.{key} was replaced: use {RENAMED[key]}")
    return out


def explicit_keys(argv: Sequence[str]) -> frozenset:
    """The dotted keys the command line sets (``--config.rl.group_size=4``: ``rl.group_size``),
    which a profile leaves as given (``recipes.config.parse``'s ``explicit``, as ``rstarjax.main``
    passes it)."""
    return frozenset(a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config."))


def config_from_argv(argv: Sequence[str]):
    """The ConfigDict that ``rstarjax.main`` would run for these arguments (``--config=FILE[:mode]``
    and ``--config.KEY=VALUE`` overrides; ``--workdir`` accepted). Unknown flags or keys raise."""
    moved = renamed_flags(argv)
    if moved:
        raise ConfigError("\n".join(moved))
    argv = ["rstarjax.main", *argv]
    try:
        fv, rest = _load(argv)
    except OSError as e:  # a config file config_flags could not load, met by an override
        raise _cannot_load(e) from e
    except (flags.Error, KeyError, AttributeError, TypeError, ValueError) as e:
        config = _without_overrides(argv)
        unknown = unknown_key_errors(argv, config) if config is not None else []
        if unknown:
            raise ConfigError("\n".join(unknown)) from None
        if "Error whilst parsing config file" in str(e):  # the preset itself raised: its last line says why
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            raise ConfigError(f"--config: the config file raised {lines[-1]}") from None
        raise ConfigError(f"the command line does not parse: {type(e).__name__}: {e} "
                          "(a --config.KEY that the config does not have, or a value of the wrong type)") from e
    if len(rest) > 1:
        raise ConfigError(f"unexpected arguments: {rest[1:]}")
    try:  # config_flags reports a config file it could not load only when the config is used
        config = fv.config
        if config is None:
            raise ConfigError("--config=configs/<preset>.py is required")
        config.get("mode")
    except OSError as e:
        raise _cannot_load(e) from e
    return config


def check(argv: Sequence[str], num_devices: int, num_processes: int | None = None) -> RunConfig:
    """The typed config of a launch command line on ``num_devices`` devices in ``num_processes``
    processes (default: ``distributed.num_processes``); ConfigError lists every problem."""
    config = config_from_argv(argv)
    explicit = explicit_keys(argv)  # as main passes them: a profile leaves these as given
    run = parse(config, explicit=explicit)  # once: its warnings (config.run_warnings) said once
    dist = run.distributed
    if num_processes is None:
        num_processes = dist.num_processes
    elif dist.num_processes > 1 and num_processes != dist.num_processes:
        raise ConfigError(f"--config.distributed.num_processes={dist.num_processes} but the cluster has "
                          f"{num_processes} processes")
    elif num_processes > 1 and dist.num_processes == 1 and not dist.auto:
        # launched as written, each host would run a single-process job of its own into one workdir
        raise ConfigError(f"the cluster has {num_processes} processes but the command starts a single-process run: "
                          f"set --config.distributed.num_processes={num_processes} (with process_id and "
                          "coordinator_address per host) or --config.distributed.auto=True")
    if num_devices < num_processes or num_devices % num_processes:
        raise ConfigError(f"{num_devices} devices do not split evenly over {num_processes} processes")
    errors = device_rules(run, num_devices, num_processes)  # what parse(config, num_devices, ...) adds
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return run


def describe(run: RunConfig, num_devices: int, num_processes: int) -> str:
    # disaggregated, the trainer's mesh spans only the devices the rollouts leave it
    trainer_devices = trainer_device_count(run.serving, num_devices, num_processes)
    mesh = run.mesh.resolved(trainer_devices)
    line = (f"ok: mode={run.mode} on {num_devices} devices in {num_processes} process(es); mesh "
            + " ".join(f"{k}={v}" for k, v in mesh.items()))
    if trainer_devices != num_devices:
        line += f" on the trainer's {trainer_devices} devices"
    if run.mode in ("rl", "demo"):
        rows = run.rl.prompts_per_step * run.rl.group_size
        micro = run.trainer.micro_batch_size or rows // run.trainer.mini_batches
        line += (f"; {rows} rows per step, micro-batches of {micro} rows "
                 f"({micro // (mesh['data'] * mesh['fsdp'])} per device)")
    return line


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    counts = {"--devices": None, "--processes": None}
    rest = []
    for arg in argv:
        name, _, value = arg.partition("=")
        if name in counts:
            if not value.isdigit() or int(value) < 1:
                print(f"check_config: {arg!r}: {name} takes a count >= 1, e.g. {name}=8", file=sys.stderr)
                return 2
            counts[name] = int(value)
        else:
            rest.append(arg)
    if counts["--devices"] is None:
        print("usage: python -m rstarjax.check_config --devices=N [--processes=P] --config=FILE "
              "[--config.KEY=VALUE ...]", file=sys.stderr)
        return 2
    try:
        run = check(rest, counts["--devices"], counts["--processes"])
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(describe(run, counts["--devices"], counts["--processes"] or run.distributed.num_processes))
    return 0


if __name__ == "__main__":
    sys.exit(main())

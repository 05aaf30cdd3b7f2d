"""Entry point: ``python -m rstarjax.main --config=configs/stage2.py --workdir=DIR``.

A thin dispatcher on ``config.mode`` (``--config=configs/stage3.py:filter`` picks a mode through
the config argument; ``--config.rl.max_turns=15`` overrides any field). The ConfigDict is parsed
once into a typed ``RunConfig`` (``recipes/config.py``), which rejects bad configurations with a
message that says how to fix them, before any device, model or data is touched; the recipe of the
mode then runs on the typed config.

Multi-host: set ``--config.distributed.num_processes=N --config.distributed.process_id=I
--config.distributed.coordinator_address=HOST:PORT`` (or ``--config.distributed.auto=True`` on a
managed cluster where ``jax.distributed.initialize()`` finds them itself).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from collections.abc import Callable

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from rstarjax.check_config import config_from_argv, renamed_flags
from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.io import compile_cache
from rstarjax.io.data import DataError
from rstarjax.io.metrics_log import MetricsWriteError
from rstarjax.layout import distributed_trainers
from rstarjax.recipes import build, demo, demo_compare, evaluate, preemption, rl, sft, stage3_filter
from rstarjax.recipes.config import MODES, DistributedConfig, RunConfig, as_flags, device_rules, parse
from rstarjax.recipes.rl import StageError
from rstarjax.rl import mailbox
from rstarjax.rl.trainer import NonFiniteTraining
from rstarjax.rl.trajectory import RolloutsFailed
from rstarjax.validation import ConfigError

# config.mode -> the recipe that runs it: (typed config, workdir) -> its result
RECIPES: dict[str, Callable[[RunConfig, str], object]] = {
    "rl": rl.run_rl,
    "filter": stage3_filter.run_filter,
    "sft": sft.run_sft,
    "eval": evaluate.run_eval,
    "demo": demo.run_demo,
    "demo_compare": demo_compare.run_compare,
}
assert set(RECIPES) == set(MODES), "every mode recipes/config.py validates has a recipe here"


def init_distributed(cfg: DistributedConfig, trainer_processes: int = 0) -> None:
    """jax.distributed for multi-process runs (before any other JAX call). ``trainer_processes``
    > 0: disaggregated placement across processes, where the processes past that many only roll
    out, so a death among them must not abort the training processes, which then save what they
    finished (``rl.remote``): the service is made recoverable, and process 0, which hosts it,
    leaves after the other training processes (``mailbox.leave_last``)."""
    if cfg.num_processes <= 1 and not cfg.auto:
        return
    if trainer_processes:
        jax.config.update("jax_enable_recoverability", True)
    if cfg.auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                                   process_id=cfg.process_id, initialization_timeout=cfg.timeout_s)
    if trainer_processes:
        mailbox.leave_last(trainer_processes)


def run(config, workdir: str, explicit=frozenset()) -> None:
    """Parse and check the config, set up JAX, and run the mode's recipe. ``explicit``: the
    dotted keys the command line set (they win over ``config.profile``'s)."""
    try:
        typed, deferred = parse(config, explicit=explicit), None  # static checks first: fail before touching devices
    except ConfigError as e:  # unless the memory plan sets the micro-batch (one GPU): judged once devices are up
        typed, deferred = build.parse_sizes_open(config, explicit, e), e
    init_distributed(typed.distributed, distributed_trainers(typed.serving))
    typed = build.sized_by_memory_plan(typed, explicit, deferred)  # one GPU: the sizes the command line left open
    errors = device_rules(typed, jax.device_count(), jax.process_count())
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    compile_cache.enable_persistent_cache(typed.compilation_cache_dir)
    with workdir_lock(workdir, take=jax.process_index() == 0):
        RECIPES[typed.mode](typed, workdir)


LOCK_NAME = ".rstarjax.lock"


@contextlib.contextmanager
def workdir_lock(workdir: str, take: bool = True):
    """The run's hold on ``workdir`` for its duration: the directory made and checked writable
    (a ``ConfigError`` naming ``--workdir`` before any work, not an ``OSError`` after it), and,
    on the process that ``take``s it, an exclusive ``flock`` on ``WORKDIR/.rstarjax.lock``. Two
    runs in one workdir would otherwise both run, each deleting the other's checkpoints. The
    lock goes with the process (a killed run leaves none behind); the file keeps its pid."""
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=workdir, prefix=".write-test-")
        probe.close()
    except OSError as e:
        raise ConfigError(f"--workdir={workdir!r} cannot be written: {e.strerror or e} "
                          "(give a directory this process can create files in)") from None
    if not take:
        yield
        return
    path = os.path.join(workdir, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(f"--workdir={workdir!r} is in use by another run (pid {holder}, lock {path}): "
                              "wait for it to end, or give this run its own --workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def run_to_exit_status(config, workdir: str, explicit=frozenset()) -> int:
    """``run`` as the command line does: the process's exit status (2: a configuration error,
    printed; 128 + the signal: stopped by SIGTERM / SIGINT after saving, recipes/preemption.py;
    1: a checkpoint or the metrics log could not be written, e.g. a full disk, or the rollouts' infrastructure
    failed, e.g. the rollout process died, after saving the last finished step, or the training
    diverged (updates not finite ``max_nonfinite_steps`` times in a row); in one line)."""
    try:
        run(config, workdir, explicit)
    except ConfigError as e:  # a lower layer's setting (serving.kv_pages) as its flag
        print(as_flags(str(e)), file=sys.stderr)
        return 2
    except preemption.Interrupted as e:
        print(e, file=sys.stderr, flush=True)
        return e.exit_status
    except ckpt_lib.CheckpointWriteError as e:  # e.g. a full disk: the cause in one line, not a traceback
        print(f"rstarjax: {e}", file=sys.stderr, flush=True)
        return 1
    except ckpt_lib.CheckpointError as e:  # no checkpoint to resume from reads and verifies: why each, one line
        print(f"rstarjax: {e}", file=sys.stderr, flush=True)
        return 2
    except (DataError, StageError) as e:  # a data file with no usable row; a stage hand-off refused
        print(f"rstarjax: {e}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteTraining as e:  # a diverged run (RL or SFT): which steps, which settings to change
        print(as_flags(f"rstarjax: {e}"), file=sys.stderr, flush=True)
        return 1
    except (RolloutsFailed, MetricsWriteError) as e:  # e.g. the rollout process died, a full disk: what
        # happened and what was saved
        print("rstarjax: " + "\n".join([str(e), *getattr(e, "__notes__", [])]), file=sys.stderr, flush=True)
        return 1
    return 0


def exit_with(status: int) -> None:
    """End the process with ``run_to_exit_status``'s status; after a stop signal, at once."""
    if status > 128:  # stopped on a signal, after saving: exit now, as a signalled process would
        exit_now(status)
    sys.exit(status)


def exit_now(status: int) -> None:
    """Flush and end the process without Python's shutdown. After a stop signal the rollout
    threads, the code pool's and XLA's may still be inside a device call: tearing the
    interpreter down under them aborted the process (exit 134, "terminate called after
    throwing ...") in most stops mid-rollout, which a scheduler reads as a crash. What the
    run must keep is on disk by now (the stage saved and closed before ``Interrupted``)."""
    import logging as std_logging

    from rstarjax.rl.mailbox import leave_service, run_exit_waits

    # process 0 hosts the coordination service: the others leave it first, and it waits for them
    leave_service()
    run_exit_waits()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    std_logging.shutdown()
    os._exit(status)


def config_args(argv) -> list[str]:
    """The ``--config`` arguments of a command line (``--config FILE`` as ``--config=FILE``)."""
    out, argv = [], list(argv)
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            out.append(f"--config={argv[i + 1]}")
        elif arg.startswith(("--config=", "--config.")):
            out.append(arg)
    return out


def main(argv=None) -> None:
    config_flags.DEFINE_config_file("config", None, "configs/<preset>.py[:mode]", lock_config=True)
    flags.DEFINE_string("workdir", None, "checkpoints, logs and outputs go here "
                        "(default: runs/<mode>)")
    flags.mark_flags_as_required(["config"])
    argv_list = list(sys.argv if argv is None else argv)
    moved = renamed_flags(argv_list)
    if moved:
        print("\n".join(moved), file=sys.stderr)
        sys.exit(2)
    try:  # a misspelled --config.KEY: one line naming the key it most likely meant, not a traceback
        config_from_argv(config_args(argv_list[1:]))
    except ConfigError as e:
        print(e, file=sys.stderr)
        sys.exit(2)

    def _main(rest):
        if len(rest) > 1:  # a stray word would otherwise be dropped without a word
            print(f"unexpected arguments: {rest[1:]}", file=sys.stderr)
            sys.exit(2)
        if not flags.FLAGS["verbosity"].present:  # Orbax logs every save at INFO; --verbosity=0 shows it
            logging.set_verbosity(logging.WARNING)
        config = flags.FLAGS.config
        workdir = flags.FLAGS.workdir or os.path.join("runs", str(config.get("mode", "run")))
        print(f"rstarjax: mode={config.get('mode')} workdir={os.path.abspath(workdir)}", flush=True)
        explicit = frozenset(config_flags.get_override_values(flags.FLAGS["config"]))
        exit_with(run_to_exit_status(config, workdir, explicit))

    app.run(_main, argv=argv)


if __name__ == "__main__":
    main()

"""Checkpoints: Orbax CheckpointManager with async saves and keep-N.

A checkpoint holds two items:
  * ``state``: the TrainState pytree (params, optimizer state, step), saved sharded and restored
    straight onto the trainer's shardings;
  * ``meta``: a JSON object with what the host loop needs to continue exactly: the RL RNG key
    data, the data iterator state (grain ``get_state()``), the policy version and free-form info.

Orbax writes to a temporary directory and renames it when complete, so a process killed with
SIGKILL mid-save leaves no checkpoint that ``restore`` would read: it resumes from the last
finished one.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from rstarjax import processes
from rstarjax.validation import require

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The ``checkpoint`` section: how often to save and keep, and where a stage starts from
    (the hand-off rules are ``recipes/rl.py:initial_state``'s; docs/training.md)."""

    every_steps: int = 10
    keep: int = 3
    async_save: bool = True
    # the previous stage's WORKDIR/checkpoints: an SFT run gives params only (step 0, a fresh
    # optimizer); an RL stage params + optimizer + global step
    init_from: str = ""
    reset_optimizer: bool = False  # stage 3: fresh optimizer state, LR warmup again (rStar2-Agent §4.3)
    update_reference: bool = False  # stage 3: KL reference := the init_from policy (§4.3; loss.kl_coef > 0)
    # from the first SIGTERM / SIGINT to the exit: the save of the last finished step and the
    # code pool's shutdown must fit (a preempted TPU VM gets about 30 s); recipes/preemption.py
    preemption_grace_s: float = 25.0

    def __post_init__(self):
        require((self.every_steps >= 1, f"every_steps={self.every_steps} must be >= 1"),
                (self.keep >= 1, f"keep={self.keep} must be >= 1"),
                (self.preemption_grace_s > 0, f"preemption_grace_s={self.preemption_grace_s} must be > 0 (seconds "
                 "from the first SIGTERM / SIGINT to the exit)"))


# what Orbax and TensorStore raise for a torn or corrupt checkpoint (ValueError covers
# json.JSONDecodeError and TensorStore's OUT_OF_RANGE / DATA_LOSS statuses)
_READ_ERRORS = (ValueError, OSError, RuntimeError)


class CheckpointError(RuntimeError):
    """No checkpoint of a directory restores (the message says why each failed)."""


def _first_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception, at most 300 characters (Orbax's messages run to
    pages of TensorStore specs)."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (the message, one line, says which, where and why)."""


def _disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` or one in its chain is ENOSPC / EDQUOT (TensorStore reports them as text:
    ``No space left on device [os_error_code='28']``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if any(s in text for s in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT),
                                   f"os_error_code='{errno.ENOSPC}'", f"os_error_code='{errno.EDQUOT}'")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _OrbaxThreadErrorsOneLine(logging.Filter):
    """Orbax logs a failed background write with its whole traceback, once per thread, before
    the save surfaces it; ``Checkpointer`` raises the failure as one line, so these records keep
    their own (first) line only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname:
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_orbax_thread_errors() -> None:
    absl_logger = logging.getLogger("absl")  # Orbax logs through absl
    if not any(isinstance(f, _OrbaxThreadErrorsOneLine) for f in absl_logger.filters):
        absl_logger.addFilter(_OrbaxThreadErrorsOneLine())


class NonFiniteState(ValueError):
    """A train state with inf or nan values was given to ``Checkpointer.save``."""


@jax.jit
def _all_finite(tree) -> jax.Array:
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def all_finite(tree) -> bool:
    """Whether every floating leaf of ``tree`` is finite: one jitted reduction, one host read
    (a replicated scalar, so every process of a multi-process run gets the same answer)."""
    return bool(jax.device_get(_all_finite(tree)))


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs (with the target shardings) for restoring onto the mesh."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def key_to_json(key: jax.Array) -> list[int]:
    """A typed PRNG key (or raw uint32 key) as a JSON list."""
    data = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return np.asarray(jax.device_get(data)).astype(np.uint32).ravel().tolist()


def key_from_json(data: list[int]) -> jax.Array:
    return jax.random.wrap_key_data(np.asarray(data, np.uint32))


class Checkpointer:
    """``save(step, state, meta)`` every ``every_steps`` steps (async), keep the last ``keep``."""

    def __init__(self, directory: str, cfg: CheckpointConfig = CheckpointConfig()):
        self.directory = os.path.abspath(directory)
        self.cfg = cfg
        # a trainer with rollout processes apart (rstarjax.processes): its barriers span it alone
        self._alone = alone = processes.training_count() < jax.process_count()
        if alone:  # orbax creates the directory only with every process at its barrier
            os.makedirs(self.directory, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            save_interval_steps=1,  # the decision is ours (should_save), orbax just writes
            enable_async_checkpointing=cfg.async_save,
            create=not alone,
            **({"multiprocessing_options": ocp.options.MultiprocessingOptions(
                primary_host=0, active_processes=set(range(processes.training_count())))} if alone else {}),
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        self._writing: int | None = None  # the step of the async save in flight
        self._failed = False  # a write error was raised: later waits on it stay quiet
        _quiet_orbax_thread_errors()

    def should_save(self, step: int, last_step: int | None = None) -> bool:
        return step % self.cfg.every_steps == 0 or (last_step is not None and step == last_step)

    def save(self, step: int, state, meta: dict[str, Any], force: bool = False) -> bool:
        """Start saving (returns at once when async). Every process must call it.

        A state with an inf or nan anywhere is refused (``NonFiniteState``): a resume could never
        recover from it, and with ``keep`` it would push the good checkpoints out."""
        if step in self._manager.all_steps():
            return False
        if not all_finite(state):
            raise NonFiniteState(f"checkpoint {step} not written to {self.directory}: the train state holds "
                                 "inf or nan values")
        if self._alone and processes.training_count() == 1:  # orbax refuses arrays of one process in a
            state = jax.device_get(state)  # multi-process run: their host copy (restored as any other)
        try:  # an async save's error surfaces here, at the next save (or in wait / close)
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))),
                force=force,
            )
        except Exception as exc:  # noqa: BLE001 - Orbax and TensorStore raise many types; named in one line
            raise self._write_error(self._writing if self._writing is not None else step, exc) from None
        self._writing = step if saved and self.cfg.async_save else None
        if saved:
            log.info("checkpoint %d -> %s (async=%s)", step, self.directory, self.cfg.async_save)
        return saved

    def _write_error(self, step: int | None, exc: BaseException) -> "CheckpointWriteError":
        """One line for a failed write: the step, the directory, the cause (a full disk said so)
        and the newest checkpoint that is complete. The Orbax / TensorStore chain (hundreds of
        lines of threads and asyncio) stays reachable as ``__context__`` but is not printed."""
        self._failed, self._writing = True, None
        complete = [s for s in self._manager.all_steps() if s != step]
        newest = f"the newest complete checkpoint is step {max(complete)}" if complete else "no checkpoint is complete"
        if _disk_full(exc):
            cause = "the disk is full (no space left on device): free space there or give --workdir a larger disk"
        else:
            cause = _first_line(exc)
        which = f"checkpoint {step}" if step is not None else "a checkpoint"
        return CheckpointWriteError(f"{which} could not be written to {self.directory}: {cause}; {newest}")

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, abstract_state, step: int | None = None):
        """(state, meta) of ``step`` (default the latest finished one) onto ``abstract_state``'s
        shapes and shardings (see ``abstract_like``)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        out = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        )
        return out["state"], dict(out["meta"] or {})

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def restore_newest(self, abstract_state, check_meta: Callable[[dict, int], None] | None = None):
        """(state, meta, step) of the newest checkpoint that restores, for a resume.

        A newer one that does not (a torn or corrupt write: Orbax's OUT_OF_RANGE / ZSTD errors,
        a JSONDecodeError for its meta) is skipped with a warning naming its directory, and once
        an older one restored it is renamed ``STEP.unreadable`` (kept for a look, but out of
        Orbax's way, so that the resumed run can save that step again). When none restores
        nothing is renamed (a model that does not fit the checkpoints looks the same) and
        ``CheckpointError`` lists why each failed. ``check_meta(meta, step)`` vets a candidate's
        meta before its arrays are read; what it raises propagates."""
        unreadable: list[tuple[int, str]] = []

        def skip(step: int, exc: BaseException) -> None:
            log.warning("checkpoint %s does not restore (%s): skipping it", self.step_dir(step), _first_line(exc))
            unreadable.append((step, _first_line(exc)))

        for step in sorted(self.all_steps(), reverse=True):
            try:
                meta = self.read_meta(step)
            except _READ_ERRORS as exc:
                skip(step, exc)
                continue
            if check_meta is not None:
                check_meta(meta, step)
            try:
                state, meta = self.restore(abstract_state, step)
            except _READ_ERRORS as exc:
                skip(step, exc)
                continue
            if unreadable:
                moved = self._set_aside([s for s, _ in unreadable])
                log.warning("resuming from step %d of %s; skipped the newer, unreadable %s", step, self.directory,
                            ", ".join(f"{self.step_dir(s)} (moved to {m})" for (s, _), m in zip(unreadable, moved)))
            return state, meta, step
        if not unreadable:
            raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        raise CheckpointError(f"no checkpoint in {self.directory} restores: " + "; ".join(
            f"step {s}: {reason}" for s, reason in unreadable))

    def _set_aside(self, steps: list[int]) -> list[str]:
        """Rename these step directories ``STEP.unreadable`` (``-N`` added when taken; process
        0 renames, every process waits for it), make Orbax list the steps again, and return
        the new paths."""
        targets = []
        for step in steps:
            target, n = self.step_dir(step) + ".unreadable", 1
            while os.path.exists(target):
                target, n = f"{self.step_dir(step)}.unreadable-{n}", n + 1
            targets.append(target)
            if jax.process_index() == 0:
                os.rename(self.step_dir(step), target)
        if processes.training_count() > 1:
            processes.barrier("rstarjax: unreadable checkpoints set aside")
        self._manager.reload()
        return targets

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The ``meta`` item of ``step`` (default the latest finished one) alone: no array is read."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"] or {})

    def wait(self) -> None:
        """Block until the pending async save is on disk (``CheckpointWriteError`` if it failed;
        once a failure was raised, the same failure is not raised again)."""
        try:
            self._manager.wait_until_finished()
        except Exception as exc:  # noqa: BLE001
            if self._failed:
                log.debug("checkpoint write error already reported: %s", _first_line(exc))
                return
            raise self._write_error(self._writing, exc) from None
        self._writing = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_checkpoint_meta(directory: str, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """``(step, meta)`` of a checkpoint directory's ``step`` (default: its latest finished one),
    no array read: what a stage hand-off, an export or a reuse of SFT weights decides on before
    restoring. ``FileNotFoundError`` when ``directory`` holds no finished checkpoint, or not
    ``step``."""
    ckpt = Checkpointer(directory, CheckpointConfig(async_save=False))
    try:
        steps = ckpt.all_steps()
        if step is None:
            step = ckpt.latest_step()
            if step is None:
                raise FileNotFoundError(f"no finished checkpoint in {directory}")
        elif step not in steps:
            raise FileNotFoundError(f"step {step} not in {directory} (have {steps})")
        return step, ckpt.read_meta(step)
    finally:
        ckpt.close()


def restore_params(directory: str, abstract_params, step: int | None = None):
    """Only the params of a (previous stage's) checkpoint: stage 2 -> 3 hand-off (§4.3).

    Reads ``state.params`` and ignores the optimizer state, so a stage can reset the optimizer.
    """
    step, meta = read_checkpoint_meta(directory, step)
    ckpt = Checkpointer(directory, CheckpointConfig(async_save=False))
    try:
        out = ckpt._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item={"params": abstract_params},
                    restore_args={"params": jax.tree.map(
                        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype),
                        abstract_params)},
                    partial_restore=True,
                ),
            ),
        )
        return out["state"]["params"], meta, step
    finally:
        ckpt._manager.close()

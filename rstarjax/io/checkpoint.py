"""Checkpoints: Orbax CheckpointManager with async saves and keep-N.

A checkpoint holds two items:
  * ``state``: the TrainState pytree (params, optimizer state, step), saved sharded and restored
    straight onto the trainer's shardings;
  * ``meta``: a JSON object with what the host loop needs to continue exactly: the RL RNG key
    data, the data iterator state (grain ``get_state()``), the policy version and free-form info.

Orbax writes to a temporary directory and renames it when complete, so a process killed with
SIGKILL mid-save leaves no checkpoint that ``restore`` would read: it resumes from the last
finished one.

A finished checkpoint can still be damaged later (a disk, a copy, a hand): its meta records a
fingerprint of every array (``array_fingerprints``: a uint32 hash of its bits, computed on the
device in the pass that checks the state is finite), and every restore checks the arrays it read
against it, so a damaged checkpoint is never restored silently (``UnreadableCheckpoint``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from rstarjax import processes
from rstarjax.io import files
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
    # the save's copy off the device: True is Orbax's default (on a GPU, through freshly allocated
    # pinned host memory, one device_put per array); False copies straight to pageable host memory
    # (copy_to_host_async), the A/B of the 22.6 s checkpoint wait on an H200 (docs/training.md)
    pinned_host_transfer: bool = True
    # with async_save and one training process: the copy off the device runs in a thread of its
    # own, behind what the loop does next (an RL step's rollouts), and only the next update, which
    # donates the arrays, waits for what is left of it (time/checkpoint_copy_wait); False: the loop
    # waits for the copy at the save, as Orbax's own async save does
    background_copy: bool = True
    # the longest the loop waits for a copy off the device before it stops with an error
    copy_timeout_s: float = 1800.0

    def __post_init__(self):
        require((self.every_steps >= 1, f"every_steps={self.every_steps} must be >= 1"),
                (self.keep >= 1, f"keep={self.keep} must be >= 1"),
                (0 < self.copy_timeout_s < float("inf"), f"copy_timeout_s={self.copy_timeout_s} must be a number of "
                 "seconds > 0"),
                (self.preemption_grace_s > 0, f"preemption_grace_s={self.preemption_grace_s} must be > 0 (seconds "
                 "from the first SIGTERM / SIGINT to the exit)"))


# what Orbax and TensorStore raise for a torn or corrupt checkpoint (ValueError covers
# json.JSONDecodeError and TensorStore's OUT_OF_RANGE / DATA_LOSS statuses)
_READ_ERRORS = (ValueError, OSError, RuntimeError)


class CheckpointError(RuntimeError):
    """No checkpoint of a directory restores (the message says why each failed)."""


class UnreadableCheckpoint(CheckpointError, ValueError):
    """One checkpoint's arrays or meta could not be read, or differ from the fingerprints
    recorded when it was saved (``reason``: why, in one line)."""

    def __init__(self, step_dir: str, reason: str):
        super().__init__(f"checkpoint {step_dir} does not restore ({reason})")
        self.step_dir, self.reason = step_dir, reason


def _first_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception, at most 300 characters (Orbax's messages run to
    pages of TensorStore specs). Orbax wraps TensorStore's read errors (OUT_OF_RANGE for a cut
    file, DATA_LOSS / ZSTD "Data corruption detected" for changed bytes) in a bare ``Exception``
    whose text is the TensorStore spec: the wrapped error is the one that says what happened."""
    while type(exc) is Exception and (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    if isinstance(exc, UnreadableCheckpoint):
        return exc.reason
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (the message, one line, says which, where and why)."""


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
    if not getattr(sys.unraisablehook, "drops_abandoned_reads", False):
        sys.unraisablehook = _dropping_abandoned_reads(sys.unraisablehook)
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedReadTasks) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_AbandonedReadTasks())


class _AbandonedReadTasks(logging.Filter):
    """asyncio's "Task / Future / _GatheringFuture exception was never retrieved" for Orbax's
    array reads: the reads a failed restore abandoned (see ``abandoned_read``), failing in turn
    once the loop is gone. Told by what the record's text names: Orbax's code, its read error, or
    TensorStore's OCDBT store."""

    SIGNS = (f"{os.sep}orbax{os.sep}checkpoint{os.sep}", "Encountered error while reading array", "OCDBT database")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("exception was never retrieved" in text and any(sign in text for sign in self.SIGNS))


def abandoned_read(unraisable) -> bool:
    """Whether an exception Python could not raise anywhere (``sys.unraisablehook``) is what a
    failed restore leaves behind. Orbax reads a checkpoint's arrays concurrently in an event loop
    of its own and closes it as soon as one read fails; the reads still in flight then end in the
    background, each as a traceback on stderr: a TensorStore callback finding the loop closed
    (``Event loop is closed`` in asyncio's ``call_soon_threadsafe``), or Orbax's read coroutine
    raising as it is closed. Dozens of them per damaged checkpoint, while the failure itself is
    already reported in one line (``UnreadableCheckpoint``)."""
    exc = unraisable.exc_value
    frames = [f.name for f in traceback.extract_tb(unraisable.exc_traceback)] if unraisable.exc_traceback else []
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and "call_soon_threadsafe" in frames:
        return True
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine of Orbax's
    return code is not None and f"{os.sep}orbax{os.sep}checkpoint{os.sep}" in code.co_filename


def _dropping_abandoned_reads(previous):
    """``sys.unraisablehook`` that drops ``abandoned_read``s (to the debug log) and passes every
    other unraisable exception to ``previous``."""
    def hook(unraisable):
        if abandoned_read(unraisable):
            log.debug("after a failed checkpoint read: %s", _first_line(unraisable.exc_value))
            return
        previous(unraisable)
    hook.drops_abandoned_reads = True
    return hook


class NonFiniteState(ValueError):
    """A train state with inf or nan values was given to ``Checkpointer.save``."""


FINGERPRINT_KEY = "array_fingerprints"  # the meta entry
FINGERPRINT_ALGORITHM = "u32-position-mix-sum-v1"


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 words: one per element of 1, 2 or 4 bytes (zero-extended), two
    per element of 8 bytes (a trailing axis)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    """A uint32 hash of an array's bits: each word mixed with its flat position (so moved or
    swapped blocks change it, not only changed bytes) by a bijection, then summed modulo 2**32.
    A sum in modular arithmetic does not depend on the order of its terms, so the value is the
    same whatever the mesh and sharding that reduce it (1 device or 8, any layout)."""
    w = _words(x)
    position = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= w.shape[axis]
    h = (w ^ (position * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return jnp.sum(h ^ (h >> 16), dtype=jnp.uint32)


@jax.jit
def _finite_and_fingerprints(tree) -> tuple[jax.Array, jax.Array]:
    """(whether every floating leaf is finite, the uint32 fingerprint of every leaf): one pass
    over the state on the device, two small results."""
    leaves = jax.tree.leaves(tree)
    flags = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    finite = jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)
    prints = jnp.stack([_leaf_fingerprint(x) for x in leaves]) if leaves else jnp.zeros((0,), jnp.uint32)
    return finite, prints


def all_finite(tree) -> bool:
    """Whether every floating leaf of ``tree`` is finite: one jitted reduction, one host read
    (a replicated scalar, so every process of a multi-process run gets the same answer)."""
    return finite_and_fingerprints(tree)[0]


def _path_key(path) -> str:
    """A leaf's place in the tree as ``params/layers/q_proj/value``: the same for the TrainState
    that was saved and the ``{"params": ...}`` a params-only restore asks for."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def finite_and_fingerprints(tree) -> tuple[bool, dict[str, int]]:
    """(whether every floating leaf of ``tree`` is finite, ``{leaf path: fingerprint}``): one
    jitted pass and one host read of a few bytes per leaf."""
    paths = [_path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    finite, prints = jax.device_get(_finite_and_fingerprints(tree))
    return bool(finite), dict(zip(paths, (int(v) for v in np.asarray(prints))))


def fingerprint_record(tree, prints: dict[str, int]) -> dict:
    """The meta entry ``array_fingerprints``: per leaf its fingerprint, dtype and shape."""
    leaves = {_path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    return {"algorithm": FINGERPRINT_ALGORITHM,
            "arrays": {k: [prints[k], str(np.dtype(leaves[k].dtype)) if not jax.dtypes.issubdtype(
                leaves[k].dtype, jax.dtypes.prng_key) else str(leaves[k].dtype), list(np.shape(leaves[k]))]
                for k in prints}}


def check_structure(abstract, record: dict | None, step_dir: str) -> None:
    """``ValueError`` naming the first leaf of ``abstract`` (what a restore asks for) that the
    checkpoint does not hold with that shape: a model that does not fit the checkpoint, told
    apart from a damaged one before any array is read. Checkpoints without a record: no check."""
    if not record:
        return
    arrays = record.get("arrays", {})
    for path, x in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        key = _path_key(path)
        if key not in arrays:
            raise ValueError(f"checkpoint {step_dir} holds no array {key}")
        if list(np.shape(x)) != list(arrays[key][2]):
            raise ValueError(f"checkpoint {step_dir} holds {key} of shape {tuple(arrays[key][2])}, not "
                             f"{tuple(np.shape(x))}")


def check_nothing_left_behind(abstract_params, record: dict | None, step_dir: str) -> None:
    """``ValueError`` naming the first ``params/...`` array the checkpoint holds that
    ``abstract_params`` (what a params restore asks for) lacks: Orbax's partial restore would drop
    it silently, e.g. a trained untied ``lm_head`` read into a model whose config says
    ``tie_word_embeddings=true``. Only the params are compared: a params-only restore leaves the
    optimizer state and the step behind on purpose (a stage hand-off, an export). A LoRA
    checkpoint's params are its adapters, so adapters onto a base fit. Checkpoints without a
    record: no check."""
    if not record:
        return
    asked = {_path_key(path) for path, _ in jax.tree_util.tree_flatten_with_path({"params": abstract_params})[0]}
    left = sorted(k for k in record.get("arrays", {}) if k.startswith("params/") and k not in asked)
    if not left:
        return
    more = f" (and {len(left) - 1} more params)" if len(left) > 1 else ""
    why = (": tie_word_embeddings=true would drop it (the checkpoint was trained untied)"
           if left[0].split("/")[1] == "lm_head" else " (a partial restore would drop it silently)")
    raise ValueError(f"checkpoint {step_dir} holds {left[0]}{more}, which the model restored onto lacks{why}")


def verify_fingerprints(tree, record: dict | None, step_dir: str) -> None:
    """``UnreadableCheckpoint`` unless every leaf of ``tree`` (restored from ``step_dir``) has the
    fingerprint recorded when it was saved. A leaf restored in another dtype than it was saved in
    (a widening cast) is cast back first. Checkpoints written before fingerprints: no check, and
    a warning saying so (its arrays restore unverified)."""
    if not record:
        log.warning("checkpoint %s records no fingerprints (written by an older version, or its meta was "
                    "edited): its arrays are restored without a check that they are the ones saved", step_dir)
        return
    if record.get("algorithm") != FINGERPRINT_ALGORITHM:
        log.warning("checkpoint %s: fingerprints of an unknown algorithm %r, not checked", step_dir,
                    record.get("algorithm"))
        return
    arrays = record["arrays"]
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    keys = [_path_key(p) for p, _ in flat]
    missing = [k for k in keys if k not in arrays]
    if missing:
        raise UnreadableCheckpoint(step_dir, f"no fingerprint recorded for {missing[0]}")
    leaves = {}
    for k, (_, x) in zip(keys, flat):
        saved_dtype = arrays[k][1]
        if str(x.dtype) == saved_dtype or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            leaves[k] = x
        elif jnp.promote_types(saved_dtype, x.dtype) == x.dtype:  # read widened: the cast back is exact
            leaves[k] = x.astype(saved_dtype)
        # read narrowed (float32 saved, bfloat16 asked for): the saved bits are gone, nothing to check
    keys = list(leaves)
    _, got = finite_and_fingerprints(leaves)
    bad = [k for k in keys if got[k] != arrays[k][0]]
    if bad:
        raise UnreadableCheckpoint(step_dir, f"{len(bad)} of {len(keys)} arrays differ from the fingerprints "
                                             f"recorded when it was saved, the first {bad[0]}: its files changed "
                                             "after the save")


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


class _StateHandler(ocp.StandardCheckpointHandler):
    """Orbax's handler of the ``state`` item with its device-to-host copy chosen: orbax-checkpoint
    0.12.8 takes ``enable_pinned_host_transfer`` only in the PyTreeCheckpointHandler that
    StandardCheckpointHandler wraps (as ``_impl``), so the wrapped one is made with it."""

    def __init__(self, multiprocessing_options, pinned_host_transfer: bool):
        super().__init__(multiprocessing_options=multiprocessing_options)
        if not isinstance(getattr(self, "_impl", None), ocp.PyTreeCheckpointHandler):
            raise RuntimeError(f"orbax-checkpoint {ocp.__version__}: StandardCheckpointHandler no longer wraps a "
                               "PyTreeCheckpointHandler as _impl; set checkpoint.pinned_host_transfer=True")
        self._impl = ocp.PyTreeCheckpointHandler(  # StandardCheckpointHandler's own defaults otherwise
            save_concurrent_gb=96, restore_concurrent_gb=96, multiprocessing_options=multiprocessing_options,
            enable_pinned_host_transfer=pinned_host_transfer)


def _registry(multiprocessing_options, pinned_host_transfer: bool):
    """The handlers of a checkpoint's two items (``state``, ``meta``) for saving and restoring."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state = _StateHandler(multiprocessing_options, pinned_host_transfer)
    meta = ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing_options)
    for item, handler, args in (("state", state, (ocp.args.StandardSave, ocp.args.StandardRestore)),
                                ("meta", meta, (ocp.args.JsonSave, ocp.args.JsonRestore))):
        for a in args:
            registry.add(item, a, handler)
    return registry


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
            # when the background write committed: ``time/checkpoint_write`` (write_seconds)
            **({"async_options": ocp.AsyncOptions(post_finalization_callback=lambda: self._write_committed())}
               if cfg.async_save else {}),
            create=not alone,
            **({"multiprocessing_options": ocp.options.MultiprocessingOptions(
                primary_host=0, active_processes=set(range(processes.training_count())))} if alone else {}),
        )
        if cfg.pinned_host_transfer:
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        else:
            self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=_registry(
                options.multiprocessing_options, pinned_host_transfer=False))
        self._writing: int | None = None  # the step of the async save in flight
        self._save_started = 0.0  # perf_counter at the start of the save in flight
        self._written: float | None = None  # seconds of the last write, until write_seconds() took it
        self.copy_seconds = 0.0  # of the last save, Orbax's synchronous part (the copy off the device)
        self._failed = False  # a write error was raised: later waits on it stay quiet
        # the copy of the last save when it runs behind the loop (``cfg.background_copy``): its
        # thread owns the manager until joined (``wait_copied``); what it raised; the seconds the
        # copy took and the loop waited for it, until ``take_timings`` took them
        self._background = cfg.async_save and cfg.background_copy and processes.training_count() == 1
        self._copy: threading.Thread | None = None
        self._copying: int | None = None  # its step
        self._copy_error: CheckpointWriteError | None = None
        self._copied: float | None = None
        self._copy_waited: float | None = None
        _quiet_orbax_thread_errors()

    def should_save(self, step: int, last_step: int | None = None, previous_step: int | None = None) -> bool:
        """Whether ``step`` is due for a checkpoint: a multiple of ``every_steps`` lies in
        (previous_step, step] (an RL step with ``trainer.mini_batches`` > 1 advances the step by
        several updates, jumping over multiples), or ``step`` reached ``last_step`` (or passed it)."""
        previous = step - 1 if previous_step is None else previous_step
        every = self.cfg.every_steps
        return step // every > previous // every or (last_step is not None and step >= last_step)

    def save(self, step: int, state, meta: dict[str, Any], force: bool = False) -> bool:
        """Start saving (returns at once when async). Every process must call it.

        A state with an inf or nan anywhere is refused (``NonFiniteState``): a resume could never
        recover from it, and with ``keep`` it would push the good checkpoints out.

        With ``background_copy`` the copy off the device runs in a thread and this returns after
        the finite check: until ``wait_copied`` the arrays of ``state`` must not change (the
        caller holds the next update for it: ``Trainer.hold_state``), and True means the save was
        started (it failed if ``wait_copied`` raises)."""
        self.wait_copied()  # one save at a time: the manager is the copy thread's while it runs
        self.copy_seconds = 0.0
        if step in self._manager.all_steps():
            return False
        finite, prints = finite_and_fingerprints(state)  # one pass on the device, a few bytes back
        if not finite:
            raise NonFiniteState(f"checkpoint {step} not written to {self.directory}: the train state holds "
                                 "inf or nan values")
        meta = {**meta, FINGERPRINT_KEY: fingerprint_record(state, prints)}
        if not self._background:
            return self._copy_and_write(step, state, meta, force)
        self._copy, self._copying = threading.Thread(
            target=self._copy_in_background, args=(step, state, meta, force),
            name=f"rstarjax-checkpoint-copy-{step}", daemon=True), step
        self._copy.start()
        return True

    def _copy_and_write(self, step: int, state, meta: dict[str, Any], force: bool) -> bool:
        """Orbax's save: the copy off the device (this much holds the calling thread), then the
        write in Orbax's background thread when async."""
        started = time.perf_counter()
        try:  # an async save's error surfaces here, at the next save (or in wait / close)
            # the previous write first (Orbax's save would wait for it too), so that its commit is
            # timed from its own start and this one's from here, before it can commit
            self._manager.wait_until_finished()
            self._save_started = time.perf_counter()
            if self._alone and processes.training_count() == 1:  # orbax refuses arrays of one process in a
                state = jax.device_get(state)  # multi-process run: their host copy (restored as any other)
            # Orbax copies the arrays off the device (that much holds the caller: the next update
            # may overwrite them) and writes in the background
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))),
                force=force,
            )
        except Exception as exc:  # noqa: BLE001 - Orbax and TensorStore raise many types; named in one line
            raise self._write_error(self._writing if self._writing is not None else step, exc) from None
        self.copy_seconds = self._copied = time.perf_counter() - started
        if saved and not self.cfg.async_save:
            self._written = self.copy_seconds
        self._writing = step if saved and self.cfg.async_save else None
        if saved:
            log.info("checkpoint %d -> %s (async=%s)", step, self.directory, self.cfg.async_save)
        return saved

    def _copy_in_background(self, step: int, state, meta: dict[str, Any], force: bool) -> None:
        """The copy thread: what it raised is raised again by ``wait_copied``."""
        started = time.perf_counter()
        try:
            self._copy_and_write(step, state, meta, force)
            self.copy_seconds = self._copied = time.perf_counter() - started  # all of the thread's part
        except CheckpointWriteError as exc:
            self._copy_error = exc
        except BaseException as exc:  # noqa: BLE001 - anything else (e.g. jax's device_get) in one line too
            self._copy_error = self._write_error(step, exc)

    def wait_copied(self) -> float:
        """Wait until the copy off the device of the save started last is done, so that its
        arrays may change (0 when it ran in the caller, or is done); the seconds waited. Raises
        ``CheckpointWriteError`` when the copy failed, or took over ``copy_timeout_s``."""
        thread = self._copy
        if thread is None:
            return 0.0
        started = time.perf_counter()
        thread.join(self.cfg.copy_timeout_s)
        waited = time.perf_counter() - started
        if thread.is_alive():  # the arrays are still being read: nothing may change them, stop here
            raise CheckpointWriteError(
                f"checkpoint {self._copying} could not be written to {self.directory}: its copy off the device "
                f"took over checkpoint.copy_timeout_s={self.cfg.copy_timeout_s:g} s")
        self._copy = None
        self._copy_waited = (self._copy_waited or 0.0) + waited
        error, self._copy_error = self._copy_error, None
        if error is not None:  # the copy thread's frames add nothing to its one line
            raise error.with_traceback(None)
        return waited

    def take_timings(self) -> dict[str, float]:
        """What became known of the saves since the last call, once, for the step's metrics log:
        ``checkpoint_copy`` (seconds of the copy off the device), ``checkpoint_copy_wait`` (what
        the loop waited for a copy running behind it), ``checkpoint_write`` (from a save's start
        to its write committed on disk)."""
        out = {}
        if self._copied is not None:
            out["checkpoint_copy"], self._copied = self._copied, None
        if self._copy_waited is not None:
            out["checkpoint_copy_wait"], self._copy_waited = self._copy_waited, None
        written = self.write_seconds()
        if written is not None:
            out["checkpoint_write"] = written
        return out

    def _write_committed(self) -> None:
        """Orbax's finalize thread, once a background write is committed."""
        self._written = time.perf_counter() - self._save_started

    def write_seconds(self) -> float | None:
        """Seconds from the start of the last save to its write committed on disk, once, when it
        has (None before, and after it was taken): the background part of an async save."""
        written, self._written = self._written, None
        return written

    def _write_error(self, step: int | None, exc: BaseException) -> "CheckpointWriteError":
        """One line for a failed write: the step, the directory, the cause (a full disk said so)
        and the newest checkpoint that is complete. The Orbax / TensorStore chain (hundreds of
        lines of threads and asyncio) stays reachable as ``__context__`` but is not printed."""
        self._failed, self._writing = True, None
        complete = [s for s in self._manager.all_steps() if s != step]
        newest = f"the newest complete checkpoint is step {max(complete)}" if complete else "no checkpoint is complete"
        if files.disk_full(exc):
            cause = "the disk is full (no space left on device): free space there or give --workdir a larger disk"
        else:
            cause = _first_line(exc)
        which = f"checkpoint {step}" if step is not None else "a checkpoint"
        return CheckpointWriteError(f"{which} could not be written to {self.directory}: {cause}; {newest}")

    def latest_step(self) -> int | None:
        self.wait_copied()  # (the manager is the copy thread's while it runs)
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        self.wait_copied()
        return list(self._manager.all_steps())

    def restore(self, abstract_state, step: int | None = None):
        """(state, meta) of ``step`` (default the latest finished one) onto ``abstract_state``'s
        shapes and shardings (see ``abstract_like``), its arrays checked against the fingerprints
        recorded at the save (``UnreadableCheckpoint`` when they differ)."""
        self.wait_copied()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        out = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        )
        meta = dict(out["meta"] or {})
        verify_fingerprints(out["state"], meta.pop(FINGERPRINT_KEY, None), self.step_dir(step))
        return out["state"], meta

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def restore_newest(self, abstract_state, check_meta: Callable[[dict, int], None] | None = None):
        """(state, meta, step) of the newest checkpoint that restores, for a resume.

        A newer one that does not (a torn or corrupt write: Orbax's OUT_OF_RANGE / ZSTD errors,
        a JSONDecodeError for its meta; arrays that differ from the fingerprints recorded at its
        save) is skipped, and once an older one restored it is renamed ``STEP.unreadable`` (kept
        for a look, but out of Orbax's way, so that the resumed run can save that step again),
        and one warning line names each skipped directory, why, and the step resumed from. When
        none restores nothing is renamed (a model that does not fit the checkpoints looks the
        same) and ``CheckpointError`` lists why each failed. ``check_meta(meta, step)`` vets a
        candidate's meta before its arrays are read; what it raises propagates."""
        unreadable: list[tuple[int, str]] = []
        for step in sorted(self.all_steps(), reverse=True):
            try:
                meta = self.read_meta(step)
            except Exception as exc:  # noqa: BLE001 - a torn meta: JSONDecodeError, OSError, ...
                unreadable.append((step, _first_line(exc)))
                continue
            if check_meta is not None:
                check_meta(meta, step)
            try:
                state, meta = self.restore(abstract_state, step)
            except Exception as exc:  # noqa: BLE001 - Orbax raises a bare Exception for a cut array file
                unreadable.append((step, _first_line(exc)))
                continue
            if unreadable:
                moved = self._set_aside([s for s, _ in unreadable])
                log.warning("%s: resuming from step %d of %s; set aside %s", _skipped(self.directory, unreadable),
                            step, self.directory, ", ".join(f"{self.step_dir(s)} (moved to {m})"
                                                            for (s, _), m in zip(unreadable, moved)))
            return state, meta, step
        if not unreadable:
            raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        raise _none_restores(self.directory, unreadable)

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
        self.wait_copied()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"] or {})

    def wait(self) -> None:
        """Block until the pending async save is on disk (``CheckpointWriteError`` if it failed;
        once a failure was raised, the same failure is not raised again)."""
        self.wait_copied()
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


def wait_reporting(ckpt: Checkpointer, report: Callable[[], None]) -> None:
    """``ckpt.wait()``; when the write failed, ``report()`` (e.g. write the step's metrics) before
    the ``CheckpointWriteError`` propagates."""
    try:
        ckpt.wait()
    except CheckpointWriteError:
        report()
        raise


def checkpoint_dir_hint(directory: str, flag: str, step_flag: str = "", hf_advice: str = "") -> str:
    """When ``directory``, given as ``flag`` (e.g. ``--checkpoint ``), holds no checkpoint but is
    something near one, the words that say what it is and where the flag should point; else "".
    A run's workdir (it has ``checkpoints/``): those. One step of a checkpoints directory
    (``DIR/N``): ``DIR``, and ``step_flag`` N where the caller takes a step (else: the newest
    finished step is used). A HuggingFace model directory (``config.json`` and safetensors):
    ``hf_advice``."""
    inner = os.path.join(directory, "checkpoints")
    if os.path.isdir(inner):
        return f": it is a run's workdir, give its checkpoints, {flag}{inner}"
    parent, name = os.path.split(os.path.normpath(os.path.abspath(directory)))
    if name.isdigit() and os.path.isdir(parent) and int(name) in finished_steps(parent):
        pick = f" {step_flag}{name}" if step_flag else " (its newest finished step is the one used)"
        return f": it is step {name} of a run's checkpoints, give that directory, {flag}{parent}{pick}"
    if os.path.isfile(os.path.join(directory, "config.json")) and any(
            f.endswith(".safetensors") for f in os.listdir(directory)):
        return f": it is a HuggingFace model directory, not a run's checkpoints{hf_advice}"
    return ""


def finished_steps(directory: str) -> list[int]:
    """The finished checkpoint steps in ``directory`` (none: []), no array read."""
    ckpt = Checkpointer(directory, CheckpointConfig(async_save=False))
    try:
        return ckpt.all_steps()
    finally:
        ckpt.close()


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


def restore_params_newest(directory: str, abstract_params, newest: int | None = None):
    """``restore_params`` of the newest checkpoint of ``directory`` (at or before ``newest``)
    whose params read and verify, for a stage hand-off: a newer damaged one is skipped with one
    warning line naming it and why (left where it is: the directory is another stage's).
    ``CheckpointError`` listing each when none restores; a model that does not fit them
    (``ValueError``) is raised at once."""
    ckpt = Checkpointer(directory, CheckpointConfig(async_save=False))
    try:
        steps = [s for s in sorted(ckpt.all_steps(), reverse=True) if newest is None or s <= newest]
    finally:
        ckpt.close()
    if not steps:
        raise FileNotFoundError(f"no finished checkpoint in {directory}")
    unreadable: list[tuple[int, str]] = []
    for step in steps:
        try:
            params, meta, step = restore_params(directory, abstract_params, step=step)
        except UnreadableCheckpoint as exc:
            unreadable.append((step, exc.reason))
            continue
        if unreadable:
            log.warning("%s: starting from step %d of %s instead", _skipped(directory, unreadable), step, directory)
        return params, meta, step
    raise _none_restores(directory, unreadable)


def _skipped(directory: str, unreadable: list[tuple[int, str]]) -> str:
    """The warning's words for the checkpoints of ``directory`` that did not restore, and why."""
    return "; ".join(f"checkpoint {os.path.join(directory, str(s))} does not restore ({why})" for s, why in unreadable)


def _none_restores(directory: str, unreadable: list[tuple[int, str]]) -> CheckpointError:
    return CheckpointError(f"no checkpoint in {directory} restores: " + "; ".join(
        f"step {s}: {reason}" for s, reason in unreadable))


def restore_params(directory: str, abstract_params, step: int | None = None):
    """Only the params of a (previous stage's) checkpoint: stage 2 -> 3 hand-off (§4.3).

    Reads ``state.params`` and ignores the optimizer state, so a stage can reset the optimizer.
    A model that does not fit the checkpoint (lacks an array of its params, or has one at
    another shape) raises ``ValueError``; arrays that cannot be read
    or differ from the fingerprints recorded at the save raise ``UnreadableCheckpoint``.
    """
    step, meta = read_checkpoint_meta(directory, step)
    ckpt = Checkpointer(directory, CheckpointConfig(async_save=False))
    step_dir = ckpt.step_dir(step)
    record = meta.get(FINGERPRINT_KEY)
    try:
        check_structure({"params": abstract_params}, record, step_dir)
        check_nothing_left_behind(abstract_params, record, step_dir)
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
        except Exception as exc:  # noqa: BLE001 - Orbax raises a bare Exception for a cut array file
            if record is None and isinstance(exc, (ValueError, KeyError)) and type(exc) is not Exception:
                raise  # no record of the shapes: a mismatch cannot be told from damage
            raise UnreadableCheckpoint(step_dir, _first_line(exc)) from exc
        params = out["state"]["params"]
        verify_fingerprints({"params": params}, record, step_dir)
        return params, {k: v for k, v in meta.items() if k != FINGERPRINT_KEY}, step
    finally:
        ckpt._manager.close()

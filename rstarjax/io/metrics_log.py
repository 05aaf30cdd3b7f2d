"""The metrics log: one JSON object per step in ``metrics.jsonl`` (its scalars mirrored to
TensorBoard and, optionally, Weights & Biases), and its reader (``rstarjax.report`` draws the
curves from it). docs/metrics.md lists every key."""
from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Mapping

import numpy as np

from rstarjax.io import files


def _jsonable(v):
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep the information as a string
    return v


# The longest the end of a run waits for W&B to upload what it has not yet sent (its default
# waits without a limit); what is past it stays in metrics.jsonl and TensorBoard.
WANDB_FINISH_TIMEOUT_S = 300.0


def _start_wandb(init_args: Mapping, logdir: str):
    """A W&B run that a restart of the same workdir continues: its id is kept in
    ``logdir/wandb_run_id`` and the run resumed with it. Its ``finish`` waits at most
    ``WANDB_FINISH_TIMEOUT_S`` (W&B says so when it gives up)."""
    try:  # lazily: an optional extra, which the base install never imports
        import wandb
    except ImportError as e:
        raise ImportError('logging.wandb=True needs the wandb package: pip install -e ".[wandb]"') from e
    id_path = os.path.join(logdir, "wandb_run_id")
    if os.path.exists(id_path):
        with open(id_path) as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits
        files.write_atomic(id_path, run_id + "\n")  # (an empty id left by a kill would start another run)
    return wandb.init(dir=logdir, id=run_id, resume="allow",
                      settings=wandb.Settings(finish_timeout=WANDB_FINISH_TIMEOUT_S), **init_args)


def drop_records_after(path: str, step: int) -> int | None:
    """Rewrite the metrics log at ``path`` without its records of steps after ``step`` (a
    resumed run logs those again) or lines that are not JSON (torn by a kill mid-write), and
    return the last step it held (None: no file or no record). The rewrite goes through a
    temporary file (``files.write_jsonl_atomic``), so a kill leaves the old or the new log."""
    if not os.path.exists(path):
        return None
    records, unreadable = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a torn line of a killed write: not a record to keep
                unreadable += 1
    records = [r for r in records if isinstance(r, dict) and isinstance(r.get("step"), int)]
    last = max((r["step"] for r in records), default=None)
    if unreadable or (last is not None and last > step):  # (a log of torn lines alone is emptied too)
        files.write_jsonl_atomic(path, [r for r in records if r["step"] <= step])
    return last


class MetricsWriteError(RuntimeError):
    """The metrics log could not be written (the message, one line, says where and why)."""


def _write_error(path: str, exc: BaseException | None, what: str = "could not be written") -> MetricsWriteError:
    if exc is None:
        cause = "it was deleted during the run (its directory removed?)"
    elif files.disk_full(exc):
        cause = "the disk is full (no space left on device): free space there or give --workdir a larger disk"
    else:
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return MetricsWriteError(f"the metrics log {path} {what}: {cause}")


def _scalars(metrics: Mapping) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.floating, np.integer))}


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors its scalars to TensorBoard
    and, given ``wandb`` (``wandb.init``'s arguments: project, name, tags, config), to a Weights &
    Biases run in ``logdir/wandb`` (``WANDB_MODE=offline`` needs no network).

    Only process 0 writes (pass ``enabled=False`` on the others). TensorBoard is optional: if
    tensorboardX is missing the JSONL file is still written.

    ``resume_step``: the step a (resumed) run starts from. The steps after it that an earlier,
    killed run logged are logged again by this one, so each is kept once: ``metrics.jsonl`` drops
    its records after ``resume_step``, TensorBoard purges its events from ``resume_step + 1``
    (``purge_step``), and the W&B run (resumed by id) skips the steps it already holds.
    """

    def __init__(self, logdir: str, enabled: bool = True, tensorboard: bool = True,
                 wandb: Mapping | None = None, resume_step: int | None = None):
        self.enabled = enabled
        self._tb = None
        self._jsonl = None
        self._wandb = None
        self._wandb_has_through = None  # the last step the resumed W&B run already holds
        self._failed = False  # a write failed and was raised: close() does not raise it again
        self.path = os.path.join(logdir, "metrics.jsonl")
        if not enabled:
            return
        os.makedirs(logdir, exist_ok=True)
        path = self.path
        files.cut_torn_tail(path)  # a record a killed run cut short: appended after, the next one is lost with it
        logged_through = drop_records_after(path, resume_step) if resume_step is not None else None
        self._jsonl = open(path, "a", buffering=1)
        if tensorboard:
            try:  # lazily: tensorboardX is heavy to import and runs without it lose nothing else
                from tensorboardX import SummaryWriter
            except ImportError:  # pragma: no cover - tensorboardX is a base dependency
                SummaryWriter = None
            if SummaryWriter is not None:
                purge = resume_step + 1 if logged_through is not None and logged_through > resume_step else None
                self._tb = SummaryWriter(os.path.join(logdir, "tb"), purge_step=purge)
        if wandb is not None:
            self._wandb = _start_wandb(wandb, logdir)
            self._wandb_has_through = logged_through

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "wall_time": time.time()}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        self._append(json.dumps(record) + "\n")
        scalars = _scalars(metrics)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, int(step))
        if self._wandb is not None and (self._wandb_has_through is None or step > self._wandb_has_through):
            self._wandb.log(scalars, step=int(step))  # W&B keeps a step's first values: it refuses older steps

    def flush(self) -> None:
        """Put what was logged so far on disk (TensorBoard buffers its events; the JSONL file is
        line-buffered). Called when a checkpoint is saved: a resume from it logs only the steps
        after it again, so the steps up to it must already be on disk if the run is killed."""
        if self._tb is not None:
            self._tb.flush()

    def _append(self, line: str) -> None:
        """One record, or ``MetricsWriteError`` in one line: a full disk, or a log deleted under
        the run (appending to the unlinked file would lose every later record without a word)."""
        try:
            if os.fstat(self._jsonl.fileno()).st_nlink == 0:
                self._failed = True
                raise _write_error(self.path, None, "is gone")
            self._jsonl.write(line)  # line-buffered: on disk (or refused) now
        except OSError as e:
            self._failed = True
            raise _write_error(self.path, e) from e

    def close(self) -> None:
        jsonl, self._jsonl = self._jsonl, None
        try:
            if jsonl is not None:
                try:
                    jsonl.close()
                except OSError as e:  # raised once: a write that failed already said why
                    if not self._failed:
                        raise _write_error(self.path, e) from e
        finally:
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            if self._wandb is not None:
                self._wandb.finish()
                self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(path: str) -> list[dict]:
    """The records of a ``metrics.jsonl``; a torn last line (a run killed mid-write) is skipped,
    any other line that is not a JSON object (a record) raises."""
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise ValueError(f"{path}: line {i + 1} is not JSON")
        if not isinstance(record, dict):
            raise ValueError(f"{path}: line {i + 1} is not a JSON object (a record)")
        records.append(record)
    return records


# A step's one-line summary (``step_line``): metric key -> (label, format), those a step has.
STEP_LINE_FIGURES = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/accuracy", "accuracy", "{:.3f}"),
    ("rollout/response_length_mean", "length", "{:.0f}"),
    ("filter/groups_trained", "groups", "{:.0f}"),
    ("train/loss", "loss", "{:.4g}"),
    ("train/grad_norm", "grad_norm", "{:.3g}"),
    ("time/step", "seconds", "{:.1f}"),
)


def step_line(step: int, total: int, metrics: Mapping[str, float]) -> str:
    """One line of a finished step's key figures (printed where no progress bar shows them):
    ``rstarjax: step 3/20 reward=0.531 accuracy=0.500 length=412 groups=2 loss=0.0123 ...``."""
    parts = [f"step {step}/{total}"]
    for key, label, fmt in STEP_LINE_FIGURES:
        value = metrics.get(key)
        if isinstance(value, (int, float, np.number)):
            parts.append(f"{label}={fmt.format(float(value))}")
    return "rstarjax: " + " ".join(parts)

"""The metrics log: one JSON object per step in ``metrics.jsonl`` (its scalars mirrored to
TensorBoard and, optionally, Weights & Biases), and its reader (``rstarjax.report`` draws the
curves from it). docs/metrics.md lists every key."""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping

import numpy as np


def _jsonable(v):
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep the information as a string
    return v


def _start_wandb(init_args: Mapping, logdir: str):
    try:  # lazily: an optional extra, which the base install never imports
        import wandb
    except ImportError as e:
        raise ImportError('logging.wandb=True needs the wandb package: pip install -e ".[wandb]"') from e
    return wandb.init(dir=logdir, **init_args)


def _scalars(metrics: Mapping) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.floating, np.integer))}


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors its scalars to TensorBoard
    and, given ``wandb`` (``wandb.init``'s arguments: project, name, tags, config), to a Weights &
    Biases run in ``logdir/wandb`` (``WANDB_MODE=offline`` needs no network).

    Only process 0 writes (pass ``enabled=False`` on the others). TensorBoard is optional: if
    tensorboardX is missing the JSONL file is still written.
    """

    def __init__(self, logdir: str, enabled: bool = True, tensorboard: bool = True,
                 wandb: Mapping | None = None):
        self.enabled = enabled
        self._tb = None
        self._jsonl = None
        self._wandb = None
        if not enabled:
            return
        os.makedirs(logdir, exist_ok=True)
        self._jsonl = open(os.path.join(logdir, "metrics.jsonl"), "a", buffering=1)
        if tensorboard:
            try:  # lazily: tensorboardX is heavy to import and runs without it lose nothing else
                from tensorboardX import SummaryWriter
            except ImportError:  # pragma: no cover - tensorboardX is a base dependency
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(os.path.join(logdir, "tb"))
        if wandb is not None:
            self._wandb = _start_wandb(wandb, logdir)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "wall_time": time.time()}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        scalars = _scalars(metrics)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, int(step))
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
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
    any other line that is not JSON raises."""
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise ValueError(f"{path}: line {i + 1} is not JSON")
    return records

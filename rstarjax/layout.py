"""The run's layout, named once: which processes train, which roll out, and on which devices
(docs/training.md "Placement"). Every other place asks ``layout_of`` instead of testing
``serving.placement`` against the process count itself (imports only jax, so every layer may
use it; the serving section is read by its field names).

| layout | processes | devices |
| --- | --- | --- |
| ``COLOCATED`` | each process trains and rolls out | the same devices take turns |
| ``DISAGGREGATED`` | one process trains and rolls out | its last ``serving.rollout_devices`` roll out, the others train |
| ``ROLLOUT_PROCESSES`` | processes 0 .. ``serving.trainer_processes`` - 1 train, the others only roll out (``rl.remote``) | each process's own |

Orthogonal to it, ``several_trainers``: more than one process trains (a colocated multi-process
run, or rollout processes with ``trainer_processes`` > 1): the trainer's collectives, data shares
and checkpoint barriers then span the training processes (``rstarjax.processes``).
"""
from __future__ import annotations

import dataclasses
import enum

import jax

from rstarjax import processes as processes_lib


class Layout(str, enum.Enum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated in one process"
    ROLLOUT_PROCESSES = "rollout processes"


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """One process's view of the run's layout."""

    kind: Layout
    processes: int  # every process of the run
    trainers: int  # the training processes: 0 .. trainers - 1
    process: int  # this one
    rollout_devices: int  # DISAGGREGATED: the local devices rollouts take
    devices: int = 1  # every device of the run

    @property
    def rolls_out_only(self) -> bool:
        """Whether this process only rolls out (a rollout process)."""
        return self.kind is Layout.ROLLOUT_PROCESSES and self.process >= self.trainers

    @property
    def several_trainers(self) -> bool:
        return self.trainers > 1

    @property
    def single_process(self) -> bool:
        return self.processes == 1

    @property
    def one_device(self) -> bool:
        """Whether training and rollouts take turns on the run's one device (the memory plan's
        start check, ``serving.sizing.update_room_problems``, is for this layout)."""
        return self.kind is Layout.COLOCATED and self.devices == 1

    @property
    def rollouts_apart(self) -> bool:
        """Whether rollouts run on devices the trainer does not use (either disaggregated layout)."""
        return self.kind is not Layout.COLOCATED

    def trainer_devices(self, devices: list) -> list | None:
        """The devices of the trainer's mesh among ``devices`` (every device of the run; None:
        all of them)."""
        if self.kind is Layout.ROLLOUT_PROCESSES:
            return [d for d in devices if d.process_index < self.trainers]
        if self.kind is Layout.DISAGGREGATED:
            return devices[:-self.rollout_devices]
        return None

    def rollout_processes(self) -> tuple[int, ...]:
        """The rollout processes this training process drives (every ``trainers``-th past the
        training processes; none in the other layouts)."""
        if self.kind is not Layout.ROLLOUT_PROCESSES:
            return ()
        return processes_lib.rollout_processes_of(self.process, self.trainers, self.processes)


def layout_of(serving, processes: int | None = None, process: int | None = None,
              devices: int | None = None) -> RunLayout:
    """The layout ``serving`` (a ``ServingConfig``: ``placement``, ``trainer_processes``,
    ``rollout_devices``) gives a run of ``processes`` processes and ``devices`` devices (default:
    this run's), seen from process ``process`` (default: this one)."""
    devices = jax.device_count() if devices is None else devices
    processes = jax.process_count() if processes is None else processes
    process = jax.process_index() if process is None else process
    if serving.placement != "disaggregated":
        kind, trainers = Layout.COLOCATED, processes
    elif processes > 1:
        kind, trainers = Layout.ROLLOUT_PROCESSES, serving.trainer_processes
    else:
        kind, trainers = Layout.DISAGGREGATED, 1
    return RunLayout(kind, processes, trainers, process, serving.rollout_devices, devices)


def distributed_trainers(serving) -> int:
    """The training processes ``jax.distributed`` is told of before it starts (0: every process
    trains), from the config alone."""
    return serving.trainer_processes if serving.placement == "disaggregated" else 0

"""SIGTERM and SIGINT (a cloud preemption, Ctrl-C) end an RL stage cleanly within a bounded time.

The first signal asks the stage to stop (``SignalGuard.request``):
  * in the rollouts of a single-process run the step is abandoned at once (``StepAbandoned`` is
    raised where the rollouts are: the train state is untouched until the update starts);
  * anywhere else (update, weight hand-off, checkpoint, start-up) the current step finishes;
then the stage saves a checkpoint of the last finished step, closes its code pool and raises
``Interrupted``; ``rstarjax.main`` exits with status 128 + the signal number (143 for SIGTERM,
130 for SIGINT), as a process killed by it would report, so a scheduler sees a preemption.
A timer armed by the first signal ends the process with that status after
``checkpoint.preemption_grace_s`` seconds whatever it is doing (a TPU VM gets about 30 s before
it is killed); a second signal ends it at once. Either way nothing half-written is ever read
back: Orbax commits a checkpoint by renaming it, and the next start resumes from the newest
complete one.

Multi-process runs never abandon a step (a process leaving its rollouts early would leave the
others waiting in the next collective): at every step boundary the processes all-gather their
stop requests and steps (``agreed_stop``), so all of them stop after the same step and save it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time

import numpy as np

from rstarjax import processes

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """The shell's status of a process ended by ``signum``, for a process that exits by itself."""
    return 128 + int(signum)


class StepAbandoned(BaseException):
    """Raised in the rollouts by the first stop signal: the step in progress is dropped.

    A BaseException, as KeyboardInterrupt is, so that no ``except Exception`` of the rollout
    layer (tool calls, the verifier) takes it for an error of its own and carries on."""


class Interrupted(Exception):
    """The stage stopped on a signal after step ``last_step``; ``saved``: that step is on disk
    (False: no step finished since the start, there was nothing to save)."""

    def __init__(self, signum: int, last_step: int, saved: bool, abandoned: bool, done: str | None = None):
        self.signum, self.last_step, self.saved = int(signum), int(last_step), bool(saved)
        name = signal.Signals(self.signum).name
        what = "abandoned the step in progress; " if abandoned else ""
        resumes = "resumes from what was saved"  # ``done``: what is kept, for a recipe whose unit is not a step
        if done is None:
            resumes = "resumes from the newest checkpoint"
            done = (f"step {last_step} is saved" if saved
                    else f"no step finished since the start (step {last_step}): nothing to save")
        elif not saved:  # a recipe that keeps nothing partial (evaluation)
            resumes = "runs it again from the start"
        super().__init__(f"rstarjax: stopped on {name}: {what}{done}; the same command {resumes} "
                         f"(exit status {exit_status(self.signum)})")

    @property
    def exit_status(self) -> int:
        return exit_status(self.signum)


@dataclasses.dataclass(frozen=True)
class StopRequest:
    signum: int
    received: float  # time.monotonic()


def agreed_stop(requests: np.ndarray) -> int:
    """The signal every process stops on (0: none), from the all-gathered ``[signum or 0, step]``
    of each process (one row each). Raises when the processes are not at the same step: a save
    would then mix states of different steps."""
    requests = np.asarray(requests, np.int64).reshape(-1, 2)
    steps = sorted(set(requests[:, 1].tolist()))
    if len(steps) > 1:
        raise RuntimeError(f"processes stop at different steps {steps}: their checkpoint would not be one state")
    return int(requests[:, 0].max())


def _say(text: str) -> None:
    """One line on stderr, safely from a signal handler (no buffered-stream re-entry)."""
    try:
        os.write(2, (text.rstrip("\n") + "\n").encode())
    except OSError:
        pass


class SignalGuard:
    """Installs the SIGTERM / SIGINT handlers of an RL stage for the ``with`` block's duration
    (the previous handlers come back after it). ``can_abandon``: whether the first signal may
    abandon rollouts in progress (single-process runs only); ``stopping``: what the first
    signal's line says the run does now."""

    def __init__(self, grace_s: float, can_abandon: bool = True,
                 stopping: str = "saving the last finished step and exiting"):
        self.grace_s = float(grace_s)
        self.can_abandon = can_abandon
        self.stopping = stopping
        self.request: StopRequest | None = None
        self.abandoned = False
        self._in_rollouts = False
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> "SignalGuard":
        if threading.current_thread() is not threading.main_thread():
            log.warning("not the main thread: SIGTERM / SIGINT keep their default handling")
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._timer is not None:  # the stage is done with its shutdown: the caller exits now
            self._timer.cancel()
            self._timer = None

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.request is not None:
            _say(f"rstarjax: second stop signal ({name}): exiting at once without saving")
            os._exit(exit_status(signum))
        self.request = StopRequest(signum, time.monotonic())
        _say(f"rstarjax: {name} received: {self.stopping} within "
             f"{self.grace_s:g} s (--config.checkpoint.preemption_grace_s); send it again to exit at once")
        self._timer = threading.Timer(self.grace_s, self._expire, args=(signum,))
        self._timer.daemon = True
        self._timer.start()
        if self._in_rollouts:
            self._in_rollouts = False
            self.abandoned = True
            raise StepAbandoned()

    def _expire(self, signum: int) -> None:
        _say(f"rstarjax: the shutdown after {signal.Signals(signum).name} did not finish within "
             f"{self.grace_s:g} s: exiting without it (the next start resumes from the newest complete checkpoint)")
        os._exit(exit_status(signum))

    @contextlib.contextmanager
    def rollouts(self):
        """The block where the first signal abandons the step (when ``can_abandon``); a stop
        already requested abandons it before it starts (no new rollouts after a signal)."""
        if not self.can_abandon:
            yield
            return
        if self.request is not None:
            self.abandoned = True
            raise StepAbandoned()
        self._in_rollouts = True
        try:
            yield
        finally:
            self._in_rollouts = False

    def stop_signal(self, step: int) -> int:
        """At a step boundary: the signal to stop on (0: go on), agreed by every training process."""
        mine = self.request.signum if self.request is not None else 0
        if processes.training_count() == 1:
            return mine
        return agreed_stop(processes.allgather(np.asarray([mine, step], np.int64)))

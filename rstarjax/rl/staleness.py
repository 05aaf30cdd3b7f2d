"""Bounded-staleness asynchronous rollouts (``rl.max_staleness`` = k > 0; docs/training.md
"Asynchronous training").

The paper's loop is synchronous: a step's rollouts start once the previous update has been
handed to the engines. With k > 0 a rollout thread generates the next steps' rollouts while the
current update runs (as AReaL, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System
for Language Reasoning", arXiv 2505.24298, does with its staleness bound), and the trainer
takes finished rounds in the order they started.

**Admission, not discarding.** A round is one step's prompts, rolled out under the one policy
version the engines serve when it starts (new weights are installed between rounds only, so no
rollout changes policy half way). It is trained at most k versions after the one that sampled
it: ``may_start`` admits round ``index`` only while ``index - consumed + busy <= k``. The proof
is in its docstring, and a property test checks the bound under random timings. Finished work
is never thrown away for being stale.

**Weights.** After each update the trainer's thread makes the serving copy at once (the hand-off
program, before the next update may overwrite its parameters) and hands it over with
``publish``; the rollout thread installs it before its next round. The engines therefore hold
two serving copies for a moment, and their KV pool stays allocated during the update
(``serving.release_during_update`` does not combine with this).

**With partial rollouts** (``rl.partial_rollout_tokens``, ``rl.partial``) each round is one
``PartialRollouts`` round: it starts as many new prompts as there is ``room``, continues the
paused rollouts under the round's version, and hands the groups it completed to the trainer.
Admission is unchanged, so the tokens a round samples are trained at most k versions later;
a paused rollout's earlier tokens are older by the rounds between: a token sampled in round j
and trained with round i is at most k + (i - j) versions old (``lag_bound``). The rounds a
group spans are at most ceil(max_response_len / partial_rollout_tokens), and the decoupled or
truncated importance weight corrects each token against its own sampler's log-prob. The lag
is reported (``async/policy_lag_max``), not capped: capping it would throw away unfinished
long rollouts, the ones partial rollouts exist to finish.

**Checkpoints.** A checkpoint records the data position after every round drawn so far and the
prompts of the rounds drawn but not trained (``snapshot``; with partial rollouts, the finished
rounds' complete groups and every group still decoding or waiting). On resume those start again
from their prompts, first; their rollouts were never trained, so none is trained twice.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from rstarjax.rl.partial import CollectedRound, PartialRollouts
from rstarjax.rl.trajectory import RolloutsFailed

log = logging.getLogger(__name__)


def may_start(index: int, consumed: int, busy: bool, max_staleness: int) -> bool:
    """Whether round ``index`` (0-based, in start order) may start now, so that it is trained at
    most ``max_staleness`` policy versions after the version that samples it.

    ``consumed``: rounds the trainer has taken; ``busy``: it is updating on the last of them and
    has not published the result yet. Proof: the round samples with the newest published
    version, V - busy, where V is the version the trainer's next update starts from once the
    running one is done (V = published + busy). Each of the ``index - consumed`` rounds before it
    adds at most one version, so it is trained from at most V + index - consumed, a lag of at
    most ``index - consumed + busy``. k = 0 is the synchronous loop: a round starts only once
    the trainer is idle and has taken every earlier round."""
    return index - consumed + int(busy) <= max_staleness


def rollout_steps_left(total_steps: int, step: int, updates_per_step: int) -> int:
    """Rollout batches still to train from optimizer step ``step`` to ``total_steps`` when each
    trains ``updates_per_step`` mini-batches: a lower bound (a batch with an empty mini-batch
    moves fewer steps), at least 1 while a step is left, so the rollout thread never starts a
    round no update takes and never stops while one is still needed (each update publishes it
    anew)."""
    return max(0, -(-(total_steps - step) // max(1, updates_per_step)))


def lag_bound(max_staleness: int, sampled_round: int, trained_round: int) -> int:
    """The most policy versions a token sampled in round ``sampled_round`` is behind the policy
    that trains it with round ``trained_round`` (>= ``sampled_round``; they differ only for a
    paused rollout's earlier tokens, with partial rollouts).

    Proof: let r(t) be the rejected rounds (no update) among the first t the trainer took, and
    the stage start at version 0. Round i is trained from version i - r(i). Round j started when
    ``may_start`` allowed it, j - consumed + busy <= k, so at least t = j - k rounds were taken
    and published, and it sampled with version t - r(t) or newer (t - r(t) never decreases in
    t). The lag is at most i - r(i) - (j - k - r(j - k)) <= k + i - j, as r never decreases.
    With i = j it is ``may_start``'s bound k."""
    if trained_round < sampled_round:
        raise ValueError(f"round {sampled_round} cannot be trained with the earlier round {trained_round}")
    return max_staleness + trained_round - sampled_round


@dataclasses.dataclass
class Round:
    """One step's prompts and their rollouts, sampled by policy ``version``."""

    index: int
    records: list
    version: int
    output: object = None  # what the rollout function returned
    done: bool = False
    ready_at: float = 0.0


@dataclasses.dataclass
class AsyncRollouts:
    """The rollout thread of a bounded-staleness stage and what the trainer's thread asks of it.

    ``rollout_fn(records, rollouts_per_prompt, seed, version)``: as in the synchronous loop (or
    ``partial``: each round is one of its rounds).
    ``draw(n)``: the next at most ``n`` prompts of the data (fewer or none at its end).
    ``install(weights)``: serve weights ``publish`` was given (between rounds, on this thread).
    ``seed_of(index)``: round ``index``'s sampling seed. ``remaining``: rollout batches still to
    train (``rollout_steps_left``: no round starts that no update would take). ``wait_s``: the longest the trainer waits for
    one round (a bound on top of the rollout function's own)."""

    rollout_fn: Callable
    draw: Callable[[int], list]
    install: Callable[[object], None]
    seed_of: Callable[[int], int]
    max_staleness: int
    prompts_per_round: int
    rollouts_per_prompt: int
    version: int  # the version the engines serve at the start
    remaining: int
    restart: list = dataclasses.field(default_factory=list)  # prompts in flight at the checkpoint
    wait_s: float = 3600.0
    # partial rollouts: each round is one of its rounds (``rollout_fn`` is then unused); a round's
    # output is a ``CollectedRound`` and its ``records`` those of the groups it completed
    partial: PartialRollouts | None = None

    def __post_init__(self):
        if self.max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 for asynchronous rollouts, got {self.max_staleness}")
        if self.prompts_per_round < 1:
            raise ValueError(f"prompts_per_round must be >= 1, got {self.prompts_per_round}")
        self.cond = threading.Condition()
        self.rounds: list[Round] = []  # started, not yet taken, in start order
        self.started = self.consumed = 0
        self.busy = self.exhausted = self.stopping = False
        self.pending_weights: tuple[object, int] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._produce, name="rollouts", daemon=True)
        self.thread.start()

    # ---- the rollout thread -----------------------------------------------------------------
    def _admissible(self) -> bool:
        ahead = self.started - self.consumed
        return (not self.exhausted and ahead < self.remaining - int(self.busy)
                and may_start(self.started, self.consumed, self.busy, self.max_staleness))

    def _next_records(self) -> list:
        n = self.prompts_per_round if self.partial is None else self.partial.room
        records, self.restart = self.restart[:n], self.restart[n:]
        return records + list(self.draw(n - len(records))) if len(records) < n else records

    def _roll_out(self, rnd: Round, records: list, keys: list | None) -> object:
        seed = self.seed_of(rnd.index)
        if self.partial is None:
            return self.rollout_fn(records, self.rollouts_per_prompt, seed, rnd.version)
        return self.partial.roll(records, keys, self.rollouts_per_prompt, seed, rnd.version)

    def _book(self, rnd: Round, out: object, started: int) -> None:
        """Under the lock: round ``rnd`` finished with ``out``."""
        if self.partial is not None:  # the groups it completed are the round's records from now on
            records, trajs, figures = self.partial.finish(out, started)
            out = CollectedRound(records, trajs, figures, self.partial.groups_per_update, self.partial.keeps_kv)
            rnd.records = records
        rnd.output, rnd.done, rnd.ready_at = out, True, time.perf_counter()

    def _produce(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.stopping and not self._admissible():
                        self.cond.wait()
                    if self.stopping:
                        return
                    if self.pending_weights is not None:  # a safe point: no round is running
                        weights, self.version = self.pending_weights
                        self.pending_weights = None
                        self.install(weights)
                    records = self._next_records()
                    if not records and not (self.partial is not None and self.partial.busy):
                        self.exhausted = True
                        self.cond.notify_all()
                        return
                    keys = None if self.partial is None else self.partial.begin(records, self.rollouts_per_prompt)
                    rnd = Round(self.started, records, self.version)
                    self.rounds.append(rnd)
                    self.started += 1
                out = self._roll_out(rnd, records, keys)
                with self.cond:
                    self._book(rnd, out, len(records))
                    self.cond.notify_all()
        except BaseException as e:  # handed to the trainer's thread, which raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()

    # ---- the trainer's thread ----------------------------------------------------------------
    def next_round(self) -> tuple[Round | None, dict[str, float]]:
        """The oldest round once its rollouts have finished (None: the data ran out and every
        round was taken), and how long the trainer waited for it. The trainer is busy with it
        until ``publish``."""
        t0 = time.perf_counter()
        with self.cond:
            while True:  # finished rounds first: a later round's failure loses none of them
                if self.rounds and self.rounds[0].done:
                    rnd = self.rounds.pop(0)
                    self.consumed += 1
                    self.busy = True
                    ready = sum(r.done for r in self.rounds)
                    self.cond.notify_all()
                    waited = time.perf_counter() - t0
                    return rnd, {"async/rollout_wait_s": waited, "async/rounds_ready": float(ready + 1),
                                 "async/rounds_in_flight": float(len(self.rounds) - ready)}
                if self.error is not None:  # the rollouts' infrastructure stays recognisable as such
                    failed = RolloutsFailed if isinstance(self.error, RolloutsFailed) else RuntimeError
                    raise failed(f"the rollout thread failed: {self.error!r}") from self.error
                if self.exhausted and not self.rounds:
                    return None, {"async/rollout_wait_s": time.perf_counter() - t0}
                if time.perf_counter() - t0 > self.wait_s:
                    raise TimeoutError(f"no round of rollouts finished within {self.wait_s:g} s")
                self.cond.wait(timeout=1.0)

    def publish(self, weights: object | None, version: int, remaining: int) -> None:
        """The trainer is done with the round it took: ``weights`` (None: no update ran) are
        policy ``version``'s serving copy, installed before the next round starts; ``remaining``
        rollout batches are still to train (``rollout_steps_left``)."""
        with self.cond:
            if weights is not None:
                self.pending_weights = (weights, version)
            self.busy = False
            self.remaining = remaining
            self.cond.notify_all()

    def snapshot(self, data_state: Callable[[], object]) -> tuple[object, list]:
        """What a checkpoint keeps, taken together while no round is drawn: ``data_state()``
        and the prompts drawn but not yet trained (rounds in start order, then those still to
        restart; with partial rollouts the finished rounds' complete groups, then every group still
        decoding or waiting)."""
        with self.cond:
            if self.partial is None:
                return data_state(), [r for rnd in self.rounds for r in rnd.records] + list(self.restart)
            done = [r for rnd in self.rounds if rnd.done for r in rnd.records]
            return data_state(), done + self.partial.pending_records() + list(self.restart)

    def close(self) -> None:
        """Stop starting rounds and wait for the running one (bounded by ``wait_s``); its
        rollouts are not trained (``snapshot`` still lists its prompts)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout=self.wait_s)
        if self.thread.is_alive():
            log.warning("the rollout thread did not stop within %g s", self.wait_s)


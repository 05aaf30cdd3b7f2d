"""Rollouts in processes apart from the trainer's (``serving.placement='disaggregated'`` in a
multi-process run; docs/training.md "Placement").

Processes 0 .. ``serving.trainer_processes`` - 1 train on their devices; every other process
rolls out on all of its own, one serving slice, with its own code pool
(``recipes.rollout_process``). Each training process drives its own rollout processes
(``processes.rollout_processes_of``) through ``RemoteRollouts``, a ``RolloutFn`` like the
colocated one that splits each of its rounds (its data share) by prompt groups over them, so
the RL loop (synchronous, with ``rl.max_staleness`` its rollout thread, or with partial
rollouts ``RemoteRollouts.partial``, each paused rollout kept in the process that started it)
is unchanged; each rollout process answers in ``serve_remote``, under its own keys
(``mailbox.keys_of``). Rewards are computed where the rollouts run.

**Messages** (a round's prompts, its trajectories, "new weights follow", "stop") go through
the coordination service's key-value store (``rl.mailbox``: the mailboxes, the heartbeats and
the order processes leave in). **Weights never do**: after
each update the training processes cast their state into the slice's layout on their own
devices (``handoff.stage_in_layout``, one program over all of them: each keeps a whole copy on
its own devices) and each runs ``handoff.copy_to_receiver`` with each of its rollout processes
in turn, one compiled program per pair in which each trainer device sends its shard to the
rollout device that holds the same shard. A rollout process installs it between rounds, where
the colocated loop does.

Every wait is bounded: a process that dies or stops answering leaves the other an error
naming what it waited for (on the trainer's side ``trajectory.RolloutsFailed``, which the RL
loop answers by saving its last finished step); a failing round comes back to the trainer as
one too, with the rollout process's traceback. The rollout process also beats a
heartbeat key every ``mailbox.HEARTBEAT_S`` from a thread of its own, so the trainer process learns of
its death within ``silence_s`` (``RolloutProcessDied``), not after a whole round's wait. The
run starts ``jax.distributed`` recoverable for this layout (``main.init_distributed``), so
that the coordination service does not abort the trainer process when the rollout process's
heartbeats stop: the trainer then saves the steps it finished (``recipes.rl``) and exits
with the error.
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import traceback

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rstarjax.models.sharding import describe_mesh, mesh_from_description
from rstarjax.rl import mailbox
from rstarjax.rl.agent_loop import RolloutRound
from rstarjax.rl.mailbox import (HEARTBEAT_S, Heartbeats, Mailbox, RolloutProcessDied, TrainerProcessDied, beat,
                                 exit_on_death, keys_of, wait_until_gone, watch)
from rstarjax.rl.trajectory import RolloutsFailed
from rstarjax.serving.handoff import copy_to_receiver, mesh_of, pair_mesh, specs_of, stage_in_layout
from rstarjax.validation import ConfigError

log = logging.getLogger(__name__)

@dataclasses.dataclass
class Peer:
    """One rollout process as the trainer process sees it: its mailboxes, its heartbeat, what it
    serves (its first message) and why it is gone ("" while it is not)."""

    process: int
    requests: Mailbox
    replies: Mailbox
    beats: Heartbeats
    layout: dict | None = None
    lost: str = ""

    @property
    def slice(self) -> Mesh:
        """Its serving slice (its devices, in the global device list)."""
        return mesh_from_description(self.layout["mesh"])


class RemoteRollouts:
    """The trainer process's ``RolloutFn`` (``trajectory.RolloutFn``): each call is one round,
    split by prompt groups over the rollout processes (``processes``: 1 .. R); new weights go
    to each with ``update_params``, or ``stage_params`` now and ``serve_staged`` between rounds
    (``rl.max_staleness``), as with colocated engines."""

    def __init__(self, wait_s: float, hello_wait_s: float = 900.0, silence_s: float = 120.0,
                 processes: tuple[int, ...] = (1,), trainers: int = 1, on_trainer_death=None,
                 settings: dict | None = None):
        """``wait_s``: the longest one round may take; ``hello_wait_s``: a rollout process's
        start (its model, engine and code pool); ``silence_s``: the longest a heartbeat may stop
        before its process counts as dead. This process beats its own (its rollout processes
        watch it); with ``trainers`` > 1 it watches the other training processes' too and calls
        ``on_trainer_death`` (default ``exit_on_death``) when one goes silent. ``settings``: what
        the rollouts are run with here (``recipes.rollout_process.rollout_settings``); a rollout
        process started with others is refused at its first message."""
        if not processes:
            raise ValueError("RemoteRollouts needs at least one rollout process")
        self.wait_s, self.hello_wait_s = float(wait_s), float(hello_wait_s)
        client = mailbox.service_client()
        self.peers = []
        for process in processes:
            requests, replies, _ = keys_of(process)
            self.peers.append(Peer(process, Mailbox(requests, client), Mailbox(replies, client),
                                   Heartbeats(silence_s, client, process=process)))
        self.client = client
        self.settings = settings
        self.closed = False
        me, self._stop_beating = jax.process_index(), threading.Event()
        beat(self._stop_beating, client, process=me)
        others = [Heartbeats(silence_s, client, process=t, role="training process", watcher="training process")
                  for t in range(trainers) if t != me]
        if others:
            watch(others, self._stop_beating, on_trainer_death or exit_on_death)

    @property
    def lost(self) -> str:
        """Why a rollout process is gone (found at a hand-off: raised at the next round), or ""."""
        return "; ".join(p.lost for p in self.peers if p.lost)

    @property
    def layout(self) -> dict:
        """What the rollout processes serve (each one's first message, read when first needed:
        the trainer loads its model meanwhile); one layout, or an error naming the difference."""
        for peer in self.peers:
            if peer.layout is None:
                kind, layout = self._receive(peer, self.hello_wait_s, "the rollout process to start")
                if kind == "error":
                    raise RolloutsFailed(f"rollout process {peer.process} failed to start:\n{layout}")
                differ = settings_differences(self.settings, layout.get("settings"))
                if differ:
                    raise ConfigError(f"rollout process {peer.process} was started with other settings than its "
                                      f"training process ({'; '.join(differ)}: here / there): start every process "
                                      "of the run with the same command line")
                peer.layout = layout
        first = self.peers[0].layout
        for peer in self.peers[1:]:
            differ = [k for k in ("specs", "dtype", "untie_head", "serving_dtype") if peer.layout[k] != first[k]]
            if differ or peer.layout["mesh"]["shape"] != first["mesh"]["shape"]:
                raise RolloutsFailed(f"rollout processes {self.peers[0].process} and {peer.process} serve different "
                                     f"layouts ({differ or 'mesh'}): give every rollout process the same devices")
        return first

    @property
    def slice(self) -> Mesh:
        """The first rollout process's serving slice (every one has its shape)."""
        return mesh_from_description(self.layout["mesh"])

    @property
    def serving_dtype(self) -> str:
        return self.layout["serving_dtype"]

    def _receive(self, peer: Peer, wait_s: float, what: str):
        try:
            return peer.replies.receive(wait_s, what, peer.beats)
        except RolloutProcessDied as e:
            peer.lost = str(e)
            raise
        except TimeoutError as e:
            raise RolloutsFailed(f"rollout process {peer.process}: {e}") from None

    def _round(self, kind: str, payloads: dict[int, object], what: str) -> dict[int, object]:
        """Send each peer (by index) its part of a round, then collect every reply."""
        if self.lost:
            raise RolloutProcessDied(self.lost)
        for k, payload in payloads.items():
            self.peers[k].requests.send(kind, payload)
        out = {}
        for k in payloads:
            got, reply = self._receive(self.peers[k], self.wait_s, what)
            if got == "error":
                raise RolloutsFailed(f"rollout process {self.peers[k].process} failed a round:\n{reply}")
            out[k] = reply
        return out

    def __call__(self, records, n_per_prompt: int, seed: int, policy_version: int):
        records = list(records)
        parts = split_evenly(len(records), len(self.peers))
        replies = self._round("rollout", {
            k: (records[a:b], int(n_per_prompt), peer_seed(seed, k), int(policy_version))
            for k, (a, b) in enumerate(parts) if b > a}, "a round of rollouts")
        trajs, figures = [], []
        for k, (trajectories, timings) in replies.items():
            offset = parts[k][0]  # group ids: positions in the chunk -> in the round
            trajs += [dataclasses.replace(t, group_id=int(t.group_id) + offset) for t in trajectories]
            figures.append(timings)
        return trajs, merge_figures(figures)

    def partial(self, records, n_per_prompt: int, seed: int, policy_version: int, *, token_budget: int,
                carried=(), group_ids=None, keep_kv: bool = True) -> RolloutRound:
        """``ColocatedRollouts.partial`` over the rollout processes: a paused rollout (its KV in
        its process's pool) stays where it started, and ``carried`` / ``RolloutRound.paused``
        here are (peer, id) pairs; the new records are split evenly over the processes."""
        records = list(records)
        group_ids = list(range(len(records))) if group_ids is None else [int(g) for g in group_ids]
        parts = split_evenly(len(records), len(self.peers))
        payloads = {}
        for k, (a, b) in enumerate(parts):
            mine = [int(i) for peer, i in carried if peer == k]
            if b > a or mine:
                payloads[k] = {"records": records[a:b], "n_per_prompt": int(n_per_prompt),
                               "seed": peer_seed(seed, k), "policy_version": int(policy_version),
                               "token_budget": int(token_budget), "carried": mine, "keep_kv": bool(keep_kv),
                               "group_ids": group_ids[a:b]}
        replies = self._round("partial", payloads, "a round of partial rollouts")
        finished, paused, figures = [], [], []
        for k, (done, ids, timings) in replies.items():
            finished += done
            paused += [(k, int(i)) for i in ids]
            figures.append(timings)
        return RolloutRound(finished, paused, merge_figures(figures))

    def stage_params(self, model: nnx.Module):
        """The serving copy of ``model`` in the slices' layout, on this process's devices."""
        if not isinstance(model, nnx.Module):
            raise TypeError("RemoteRollouts takes a model (an nnx.Module), not a state")
        there = self.layout.get("architecture")
        differ = settings_differences({"model": architecture_of(model)}, None if there is None else {"model": there})
        if differ:
            raise ConfigError(f"the rollout processes serve another model than this training process's "
                              f"({'; '.join(differ)}: here / there): give every process the same model.* settings")
        graphdef, state = nnx.split(model)
        return stage_in_layout(graphdef, state, self.layout["specs"], self.slice.size,
                               dtype=self.layout["dtype"], untie_head=self.layout["untie_head"])

    def serve_staged(self, staged) -> None:
        """Send ``stage_params``' copy to every rollout process (a collective with each, in turn)."""
        # a collective with a dead process would never end; the step that made these weights
        # is finished, so the loss is raised at the next round, after the loop recorded the step
        for peer in self.peers:
            peer.lost = peer.lost or peer.beats.silent("the weights' copy")
        if self.lost:
            return
        sender = jax.tree.leaves(staged)[0].sharding.mesh
        for peer in self.peers:
            peer.requests.send("weights", describe_mesh(sender))
            copy_to_receiver(staged, pair_mesh(sender, peer.slice))

    def update_params(self, model: nnx.Module) -> None:
        self.serve_staged(self.stage_params(model))

    def close(self, wait_s: float = 120.0) -> None:
        """Tell every rollout process to stop (once) and wait, at most ``wait_s``, until they
        have left the coordination service: process 0 hosts the service, and a recoverable one
        (``main.init_distributed``) does not hold its exit for the others (nor for the other
        training processes: ``leave_last``)."""
        if self.closed:
            return
        self.closed = True
        for peer in self.peers:
            peer.requests.send("stop")
        self._stop_beating.set()  # (done: neither its rollout processes nor the other trainers wait on it)
        # (a service that is not recoverable holds every process's exit at a barrier itself)
        if not jax.config.jax_enable_recoverability:
            return
        alive = [p for p in self.peers if not (p.lost or p.beats.silent("the stop"))]
        if len(alive) == len(self.peers):
            wait_until_gone(self.client, wait_s, [jax.process_index()] + [p.process for p in self.peers])


ARCHITECTURE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps",
                      "tie_word_embeddings", "attention_bias", "qk_norm")


def architecture_of(model) -> dict | None:
    """The fields of a model's config that shape its weights and their use (None: no config)."""
    config = getattr(model, "config", None)
    return None if config is None else {k: getattr(config, k) for k in ARCHITECTURE_FIELDS if hasattr(config, k)}


def settings_differences(here: dict | None, there: dict | None, prefix: str = "") -> list[str]:
    """"key: a / b" for every leaf where two nested settings dicts differ; [] when either side
    is None (nothing to compare: a rollout process or a caller that says nothing)."""
    if here is None or there is None:
        return []
    out = []
    for key in sorted(set(here) | set(there)):
        a, b = here.get(key), there.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += settings_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} / {b!r}")
    return out


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, stop) ranges over ``n`` items, sizes differing by at most one
    (the first ones larger): a round's prompt groups over the rollout processes."""
    size, extra = divmod(n, parts)
    bounds, start = [], 0
    for k in range(parts):
        stop = start + size + (k < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def peer_seed(seed: int, k: int) -> int:
    """The sampling seed of the ``k``-th rollout process's share of a round: the round's own for
    the first (one rollout process samples as before), distinct for the others (each numbers
    its share's prompts from 0)."""
    return int(seed) if k == 0 else (int(seed) * 1_000_003 + 7_919 * k) % (2**31 - 1)


def merge_figures(figures: list[dict]) -> dict:
    """One round's figures from each rollout process's share: seconds and maxima the largest
    (the shares ran at once), means and fractions averaged, counts summed."""
    out = {}
    for key in dict.fromkeys(k for f in figures for k in f):
        values = [float(f[key]) for f in figures if key in f and isinstance(f[key], (int, float, np.number))]
        if not values:
            continue
        if key.endswith("_s") or "max" in key:
            out[key] = max(values)
        elif "mean" in key or "fraction" in key:
            out[key] = sum(values) / len(values)
        else:
            out[key] = sum(values)
    return out


def serve_remote(rollouts, wait_s: float, trainer: int = 0, silence_s: float | None = None,
                 settings: dict | None = None, architecture: dict | None = None) -> int:
    """The rollout process's loop: answer the requests of training process ``trainer`` with
    ``rollouts`` (a ``ColocatedRollouts`` over this process's devices, one slice) until it says
    stop. Returns the rounds served. ``wait_s``: the longest to wait for the next request (an
    update, a checkpoint and an evaluation may come between two); ``silence_s``: with it, the
    wait also ends (``TrainerProcessDied``) once the trainer's heartbeat has stopped that long.
    ``settings`` and ``architecture`` (``architecture_of`` the served model) go with the first
    message, for the trainer to check against its own."""
    me = jax.process_index()
    requests, replies = (Mailbox(key) for key in keys_of(me)[:2])
    stop, failed = threading.Event(), threading.Event()
    heart = beat(stop, requests.client, process=me, failed=failed)
    trainer_beats = None if silence_s is None else Heartbeats(
        silence_s, requests.client, process=trainer, role="training process", watcher="rollout process",
        error=TrainerProcessDied)
    try:
        return _serve(rollouts, wait_s, requests, replies, trainer_beats, settings, architecture)
    except BaseException as exc:  # a signal (KeyboardInterrupt, Interrupted) too: the trainer hears at once
        failed.set()
        if not isinstance(exc, TrainerProcessDied):
            report_failure(replies, exc)
        raise
    finally:
        stop.set()
        heart.join(timeout=2 * HEARTBEAT_S)  # its last write (DONE or FAILED) before the process ends


class RolloutProcessStopped(Exception):
    """A rollout process stopped by a signal (``recipes.rollout_process`` raises it from its
    handler; ``serve_remote`` tells the trainer process in one line)."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"rollout process {jax.process_index()} stopped on {signal.Signals(self.signum).name}")


def report_failure(replies: Mailbox, exc: BaseException) -> None:
    """Tell the trainer process why this rollout process stops (an ``error`` reply, which its
    next wait on this process raises): the message of a stop it was meant to give, else the
    traceback. Never raises (the service may be gone already)."""
    said = str(exc) if isinstance(exc, (ConfigError, RolloutProcessStopped)) \
        else "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        replies.send("error", said or type(exc).__name__)
    except Exception:  # noqa: BLE001
        log.warning("could not tell the trainer process why this rollout process stops", exc_info=True)


def _serve(rollouts, wait_s: float, requests: Mailbox, replies: Mailbox, trainer_beats=None,
           settings: dict | None = None, architecture: dict | None = None) -> int:
    if len(rollouts.engines) != 1:
        raise ConfigError(f"a rollout process serves one slice over its devices, not {len(rollouts.engines)}: "
                          "set serving.tensor_parallel to 0 or to its device count")
    engine = rollouts.engines[0]
    slice_mesh = mesh_of(engine.layout.target)
    replies.send("hello", {
        "specs": specs_of(engine.layout.target),
        "dtype": engine.layout.dtype.name, "untie_head": engine.layout.untie_head,
        "serving_dtype": rollouts.serving_dtype, "mesh": describe_mesh(slice_mesh),
        "settings": settings, "architecture": architecture})
    rounds, paused = 0, PausedRollouts()
    while True:
        kind, payload = requests.receive(wait_s, "the trainer process's next request", trainer_beats)
        if kind == "stop":
            return rounds
        if kind == "weights":  # between rounds: the next one samples the new policy
            engine.serve(copy_to_receiver(engine.params, pair_mesh(mesh_from_description(payload), slice_mesh)))
            continue
        out = rollouts(*payload) if kind == "rollout" else paused.round(rollouts, **payload)  # a failure: serve_remote
        replies.send("round", out)
        rounds += 1


class PausedRollouts:
    """The rollout process's paused rollouts between partial rounds, by the ids the trainer
    process holds for them (their episodes and KV pages never leave this process)."""

    def __init__(self):
        self.by_id, self.next_id = {}, 0

    def round(self, rollouts, *, records, n_per_prompt, seed, policy_version, token_budget, carried,
              group_ids, keep_kv) -> tuple[list, list[int], dict]:
        """One ``rollouts.partial`` round continuing the paused rollouts ``carried`` names:
        (finished trajectories, the ids of the rollouts it paused, timings)."""
        unknown = [i for i in carried if i not in self.by_id]
        if unknown:
            raise KeyError(f"paused rollouts {unknown} are not in this rollout process (it was restarted?)")
        rnd = rollouts.partial(records, n_per_prompt, seed, policy_version, token_budget=token_budget,
                               carried=[self.by_id.pop(i) for i in carried], group_ids=group_ids,
                               keep_kv=keep_kv)
        ids = list(range(self.next_id, self.next_id + len(rnd.paused)))
        self.next_id += len(ids)
        self.by_id.update(zip(ids, rnd.paused))
        return rnd.finished, ids, rnd.timings

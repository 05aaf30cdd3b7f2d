"""The coordination service's key-value store as the processes of a run use it apart from
jax's own collectives (docs/training.md "Placement", "The mailbox at the paper's volume"):
ordered messages (``Mailbox``), heartbeats (``beat``, ``Heartbeats``, ``watch``) and the order
in which processes leave the service (``leave_last``, ``wait_until_gone``).

**Messages** go through the key-value store of the coordination service that
``jax.distributed`` starts, pickled, in order, each direction under its own numbered keys, in
chunks of at most ``CHUNK_BYTES`` written before the message's header (a reader never sees half
of one). Every wait is bounded, and a wait on a peer ends once the peer's heartbeat has stopped
for ``silence_s`` (a process that died or hangs with its GIL held), not after the whole wait.
Rollout processes (``rl.remote``) are this module's users; ``benchmarks/mailbox.py`` measures its
throughput.
"""
from __future__ import annotations

import atexit
import logging
import os
import pickle
import sys
import threading
import time

import jax

from rstarjax.rl.trajectory import RolloutsFailed

log = logging.getLogger(__name__)

REQUESTS = "rstarjax/rollout_process/requests"  # trainer -> rollout process (then "/PROCESS")
REPLIES = "rstarjax/rollout_process/replies"  # rollout process -> trainer (then "/PROCESS")
ALIVE = "rstarjax/rollout_process/alive"  # a process's heartbeat: a counter (then "/PROCESS")
DONE = "done"  # a heartbeat key's value once its process stopped beating on purpose
FAILED = "failed"  # ... once its process stopped on an error or a signal (its watchers need not wait)
CHUNK_BYTES = 4 << 20  # one key's value at most
HEARTBEAT_S = 2.0  # how often the rollout process beats
POLL_S = 5.0  # how long the trainer waits for a message between two looks at the heartbeat


class RolloutProcessDied(RolloutsFailed):
    """A rollout process stopped beating its heartbeat: it died, or hangs with its GIL held."""


def keys_of(process: int) -> tuple[str, str, str]:
    """Rollout process ``process``'s request and reply mailboxes and its heartbeat key."""
    return f"{REQUESTS}/{process}", f"{REPLIES}/{process}", f"{ALIVE}/{process}"


def service_client():
    """This process's client of the coordination service (jax.distributed must be up)."""
    from jax._src import distributed  # the coordination service's client (no public handle yet)

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("rollouts in another process need jax.distributed (the distributed.* settings)")
    return client


class Mailbox:
    """One direction's messages, in order: ``send(kind, payload)`` here, ``receive`` there.
    A message's chunks are written before its header, so a reader never sees half of one."""

    def __init__(self, name: str, client=None):
        self.name = name
        self.client = client if client is not None else service_client()
        self.sent = self.received = 0

    def send(self, kind: str, payload=None) -> None:
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
        n, self.sent = self.sent, self.sent + 1
        for i, chunk in enumerate(chunks):
            self.client.key_value_set_bytes(f"{self.name}/{n}/{i}", chunk)
        self.client.key_value_set(f"{self.name}/{n}", str(len(chunks)))

    def receive(self, wait_s: float, what: str, peer: Heartbeats | None = None) -> tuple[str, object]:
        """The next message, waiting at most ``wait_s`` for it (``what``: for the error); with
        ``peer``, only as long as the other process's heartbeat goes on."""
        n, deadline = self.received, time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            try:
                count = int(self.client.blocking_key_value_get(
                    f"{self.name}/{n}", max(1, int(1000 * min(left, POLL_S if peer else left)))))
                break
            except Exception as e:  # noqa: BLE001 - the client raises XlaRuntimeError(DEADLINE_EXCEEDED)
                if "DEADLINE" not in str(e).upper():
                    raise
            if time.monotonic() >= deadline:
                raise TimeoutError(f"waited {wait_s:g} s for {what} ({self.name} #{n}): the other process "
                                   "died or stopped answering") from None
            if peer is not None:
                peer.check(what)
        data = b"".join(self.client.blocking_key_value_get_bytes(f"{self.name}/{n}/{i}", 60_000)
                        for i in range(count))
        for key in [f"{self.name}/{n}/{i}" for i in range(count)] + [f"{self.name}/{n}"]:
            self.client.key_value_delete(key)
        self.received += 1
        return pickle.loads(data)


class TrainerProcessDied(RuntimeError):
    """A training process stopped beating its heartbeat (seen by a rollout process it drives)."""


class Heartbeats:
    """One process's view of process ``process``'s heartbeat (``beat`` there): the trainer's of
    a rollout process (the defaults), a rollout process's of its trainer, a trainer's of
    another (``role``: the watched one's, ``watcher``: the watching one's, for the message)."""

    def __init__(self, silence_s: float, client=None, clock=time.monotonic, process: int = 1,
                 role: str = "rollout process", watcher: str = "trainer process", error=RolloutProcessDied):
        self.silence_s, self.clock, self.process = float(silence_s), clock, process
        self.role, self.watcher, self.error = role, watcher, error
        self.key = keys_of(process)[2]
        self.client = client if client is not None else service_client()
        self.last, self.seen_at = None, clock()

    def check(self, what: str) -> None:
        """Raise ``error`` (``RolloutProcessDied``) when no beat came for ``silence_s``."""
        dead = self.silent(what)
        if dead:
            raise self.error(dead)

    def silent(self, what: str) -> str:
        """Why the process counts as dead, or "" while it beats (or has not begun to, or has
        stopped beating on purpose: ``DONE``)."""
        try:
            beat = self.client.key_value_try_get(self.key)
        except Exception:  # noqa: BLE001 - NOT_FOUND before the first beat
            beat = None
        now = self.clock()
        if (beat is None and self.last is None) or beat == DONE:
            return ""  # not started yet (the start has its own bound: ``hello_wait_s``), or done
        if beat == FAILED:
            return (f"the {self.role} (process {self.process}) stopped on an error or a signal before the "
                    f"{self.watcher} came to {what} (see its log)")
        if beat != self.last:
            self.last, self.seen_at = beat, now
        elif now - self.seen_at > self.silence_s:
            return (f"the {self.role} (process {self.process}) beat no heartbeat for {now - self.seen_at:.0f} s when the "
                    f"{self.watcher} came to {what}: it died (see its log) or hangs")
        return ""


def beat(stop: threading.Event, client=None, every_s: float = HEARTBEAT_S, process: int = 1,
         failed: threading.Event | None = None) -> threading.Thread:
    """Process ``process``'s heartbeat: a daemon thread that bumps its key (``keys_of``) every
    ``every_s`` until ``stop`` is set, then writes ``DONE`` there (a process that ends its part
    normally is not mistaken for a dead one), or ``FAILED`` when ``failed`` is set by then (its
    watchers know at once, not after ``silence_s``)."""
    client = client if client is not None else service_client()
    key = keys_of(process)[2]

    def run():
        count = 0
        while not stop.is_set():
            count += 1
            client.key_value_set(key, str(count), allow_overwrite=True)
            stop.wait(every_s)
        client.key_value_set(key, FAILED if failed is not None and failed.is_set() else DONE, allow_overwrite=True)
    thread = threading.Thread(target=run, name=f"heartbeat-{process}", daemon=True)
    thread.start()
    return thread


def watch(peers: list[Heartbeats], stop: threading.Event, on_death, every_s: float = POLL_S) -> threading.Thread:
    """A daemon thread that looks at ``peers`` every ``every_s`` until ``stop`` is set and calls
    ``on_death(why)`` once when one has gone silent."""
    def run():
        while not stop.wait(every_s):
            why = next((w for w in (p.silent("its watch") for p in peers) if w), "")
            if why:
                on_death(why)
                return
    thread = threading.Thread(target=run, name="heartbeat-watch", daemon=True)
    thread.start()
    return thread


def exit_on_death(why: str) -> None:
    """A training process whose peer training process died: it waits in a collective with it
    that nothing in Python can end, so it exits with the reason (status 1)."""
    log.error("%s; this process waits on it in a collective and exits", why)
    print(f"rstarjax: {why}; this training process waits on it in a collective and exits (status 1)",
          file=sys.stderr, flush=True)
    os._exit(1)


def leave_last(trainers: int, wait_s: float = 300.0) -> None:
    """On process 0 of a recoverable run (``main.init_distributed``), which hosts the
    coordination service: at exit, wait (``wait_s`` at most) until the other training processes
    (1 .. ``trainers`` - 1) have left it. A recoverable service does not hold their exits at its
    own shutdown barrier, and a service that ends before a process has left aborts that one.
    An exit that skips Python's shutdown runs it too (``run_exit_waits``), and there the other
    processes leave the service first (``leave_service``)."""
    if trainers > 1 and jax.process_index() == 0:
        EXIT_WAITS.append(lambda: wait_until_gone(service_client(), wait_s, list(range(trainers)), "training"))
        atexit.register(run_exit_waits)


EXIT_WAITS: list = []  # what this process must wait for before it ends (``leave_last``)


def leave_service(wait_s: float = 10.0) -> None:
    """On a process other than 0 of a multi-process run: leave the coordination service now
    (``jax.distributed.shutdown``, ``wait_s`` at most), for an exit that skips Python's shutdown
    (``main.exit_now``), which would leave process 0 waiting for the service to time this one
    out (~90 s) before it may end. Never raises."""
    from jax._src import distributed

    if jax.process_index() == 0 or distributed.global_state.client is None:
        return
    thread = threading.Thread(target=jax.distributed.shutdown, name="leave-service", daemon=True)
    thread.start()
    thread.join(wait_s)


def run_exit_waits() -> None:
    """Run (once) the waits ``leave_last`` registered: at Python's exit, or from an exit that
    skips it (``rstarjax.main.exit_now`` after a stop signal). Never raises."""
    while EXIT_WAITS:
        wait = EXIT_WAITS.pop()
        try:
            wait()
        except Exception:  # noqa: BLE001 - the service may be gone already
            log.warning("waiting for the other processes to leave failed", exc_info=True)


def wait_until_gone(client, wait_s: float, processes: list[int], who: str = "rollout") -> None:
    """Block until every other listed process has shut its coordination client down (or died),
    ``wait_s`` at most: ``get_live_nodes`` returns once every listed process called it or left."""
    thread = threading.Thread(target=lambda: client.get_live_nodes(processes), name="await-rollout-exit",
                              daemon=True)
    thread.start()
    thread.join(wait_s)
    if thread.is_alive():
        log.warning("the %s processes did not leave within %g s of the stop", who, wait_s)

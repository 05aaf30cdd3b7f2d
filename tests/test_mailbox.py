"""rl.mailbox's messages and heartbeats against an in-memory key-value store (the coordination
service's client has the same calls); its throughput through the real service is
benchmarks/mailbox.py's (tests/test_bench_mailbox.py runs it tiny); the two-process runs are
tests/test_rollout_process.py."""
import threading
import time

import pytest

from rstarjax.rl import mailbox
from rstarjax.rl.trajectory import RolloutsFailed


class FakeClient:
    """The coordination service client's key-value calls, in memory, with its timeout error."""

    def __init__(self):
        self.store, self.cond = {}, threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cond:
            assert allow_overwrite or key not in self.store, key
            self.store[key] = value
            self.cond.notify_all()

    key_value_set_bytes = key_value_set

    def key_value_try_get(self, key):
        with self.cond:
            if key not in self.store:
                raise KeyError(f"NOT_FOUND: {key}")
            return self.store[key]

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.store, timeout_ms / 1000):
                raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out")
            return self.store[key]

    blocking_key_value_get_bytes = blocking_key_value_get

    def get_live_nodes(self, ids):
        return {i: 0 for i in ids}  # (close waits only in a recoverable service)

    def key_value_delete(self, key):
        with self.cond:
            self.store.pop(key, None)


def test_messages_arrive_in_order_and_whole_across_chunks(monkeypatch):
    monkeypatch.setattr(mailbox, "CHUNK_BYTES", 7)
    client = FakeClient()
    out, into = mailbox.Mailbox("m", client), mailbox.Mailbox("m", client)
    out.send("round", list(range(50)))
    out.send("stop")
    assert into.receive(1, "a") == ("round", list(range(50)))
    assert into.receive(1, "b") == ("stop", None)
    assert client.store == {}  # every chunk and header deleted once read
    with pytest.raises(TimeoutError, match="waited 0.2 s for nothing more"):
        into.receive(0.2, "nothing more")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_heartbeat_counts_silence_only_after_it_began():
    client, clock = FakeClient(), Clock()
    peer = mailbox.Heartbeats(silence_s=30, client=client, clock=clock)
    clock.now = 1000.0
    assert peer.silent("x") == ""  # no beat yet: the start has its own bound
    for beat in range(1, 4):
        client.key_value_set(mailbox.keys_of(1)[2], str(beat), allow_overwrite=True)
        clock.now += 25
        assert peer.silent("x") == ""
    clock.now += 29
    assert peer.silent("x") == ""
    clock.now += 2  # 31 s since the last beat was first seen
    assert "beat no heartbeat for 31 s when the trainer process came to a round" in peer.silent("a round")
    with pytest.raises(mailbox.RolloutProcessDied):
        peer.check("a round")
    assert issubclass(mailbox.RolloutProcessDied, RolloutsFailed)


def test_a_wait_ends_when_the_heartbeat_stops_not_at_its_bound(monkeypatch):
    monkeypatch.setattr(mailbox, "POLL_S", 0.05)
    client = FakeClient()
    stop = threading.Event()
    thread = mailbox.beat(stop, client, every_s=0.02)
    peer = mailbox.Heartbeats(silence_s=0.3, client=client)
    inbox = mailbox.Mailbox("replies", client)
    with pytest.raises(TimeoutError):  # while it beats, the wait runs to its own bound
        inbox.receive(0.4, "a round", peer)
    stop.set()
    thread.join(1)
    client.key_value_set(mailbox.keys_of(1)[2], "killed", allow_overwrite=True)  # not DONE: never beats again
    t0 = time.monotonic()
    with pytest.raises(mailbox.RolloutProcessDied, match="while|came to a round"):
        inbox.receive(60, "a round", peer)
    assert time.monotonic() - t0 < 5


def test_a_training_process_watches_the_others_and_a_rollout_process_its_trainer(monkeypatch):
    """Several training processes: each watches the others' heartbeats (a dead one leaves it
    in a collective nothing in Python can end, so ``on_death`` exits), and a rollout process
    stops waiting for requests once its trainer's heartbeat stops; a heartbeat that ended on
    purpose (``DONE``) is not a death."""
    monkeypatch.setattr(mailbox, "POLL_S", 0.05)
    client, deaths = FakeClient(), []
    key = mailbox.keys_of(1)[2]
    client.key_value_set(key, "1", allow_overwrite=True)  # then silent: killed
    trainer = mailbox.Heartbeats(silence_s=0.3, client=client, process=1, role="training process",
                                watcher="training process")
    stop = threading.Event()
    thread = mailbox.watch([trainer], stop, deaths.append, every_s=0.05)
    thread.join(5)
    assert not thread.is_alive() and len(deaths) == 1
    assert "the training process (process 1) beat no heartbeat" in deaths[0]
    inbox = mailbox.Mailbox("requests", client)
    watched = mailbox.Heartbeats(silence_s=0.3, client=client, process=1, role="training process",
                                watcher="rollout process", error=mailbox.TrainerProcessDied)
    t0 = time.monotonic()
    with pytest.raises(mailbox.TrainerProcessDied, match="came to the next request"):
        inbox.receive(60, "the next request", watched)
    assert time.monotonic() - t0 < 5
    client.key_value_set(key, mailbox.DONE, allow_overwrite=True)  # closed: never a death
    done = mailbox.Heartbeats(silence_s=0.0, client=client, process=1)
    assert done.silent("x") == "" and done.silent("x") == ""


def test_a_stopped_heartbeat_says_done():
    client, stop = FakeClient(), threading.Event()
    thread = mailbox.beat(stop, client, every_s=0.01, process=3)
    time.sleep(0.05)
    assert int(client.store[mailbox.keys_of(3)[2]]) >= 1
    stop.set()
    thread.join(1)
    assert client.store[mailbox.keys_of(3)[2]] == mailbox.DONE


def test_process_0_waits_for_the_others_at_exit_even_after_a_stop_signal(monkeypatch):
    """``leave_last``: process 0, which hosts the coordination service, waits at its exit until
    the other training processes have left it, also on the exit after a stop signal, which skips
    Python's shutdown (``main.exit_now``; it once left at once and the others aborted with -6);
    there a process other than 0 leaves the service first (else process 0 waits for the service
    to time it out)."""
    import logging

    import jax

    from rstarjax import main

    client, asked, ended, left = FakeClient(), [], [], []
    client.get_live_nodes = lambda ids: asked.append(list(ids)) or {i: 0 for i in ids}
    monkeypatch.setattr(mailbox, "service_client", lambda: client)
    monkeypatch.setattr(mailbox, "EXIT_WAITS", [])
    monkeypatch.setattr(mailbox.atexit, "register", lambda fn: None)
    monkeypatch.setattr(jax.distributed, "shutdown", lambda: left.append(jax.process_index()))
    monkeypatch.setattr(main.os, "_exit", lambda status: ended.append((status, list(asked), list(left))))
    monkeypatch.setattr(logging, "shutdown", lambda: None)  # (pytest's own log handlers stay open)
    from jax._src import distributed
    monkeypatch.setattr(distributed.global_state, "client", client)

    monkeypatch.setattr(jax, "process_index", lambda: 1)
    mailbox.leave_last(2)
    assert mailbox.EXIT_WAITS == []
    main.exit_now(143)
    assert ended == [(143, [], [1])]  # process 1 left the service, waited for nothing

    monkeypatch.setattr(jax, "process_index", lambda: 0)
    mailbox.leave_last(2)
    main.exit_now(143)
    assert ended[-1] == (143, [[0, 1]], [1]) and mailbox.EXIT_WAITS == []  # process 0 waited, did not leave
    mailbox.EXIT_WAITS.append(lambda: 1 / 0)
    mailbox.run_exit_waits()  # a service already gone: said, never raised

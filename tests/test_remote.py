"""rl.remote's messages and heartbeat against an in-memory key-value store (the coordination
service's client has the same five calls); the two-process runs are tests/test_rollout_process.py."""
import threading
import time

import pytest

from rstarjax.rl import remote
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
    monkeypatch.setattr(remote, "CHUNK_BYTES", 7)
    client = FakeClient()
    out, into = remote.Mailbox("m", client), remote.Mailbox("m", client)
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
    peer = remote.Heartbeats(silence_s=30, client=client, clock=clock)
    clock.now = 1000.0
    assert peer.silent("x") == ""  # no beat yet: the start has its own bound
    for beat in range(1, 4):
        client.key_value_set(remote.ALIVE, str(beat), allow_overwrite=True)
        clock.now += 25
        assert peer.silent("x") == ""
    clock.now += 29
    assert peer.silent("x") == ""
    clock.now += 2  # 31 s since the last beat was first seen
    assert "beat no heartbeat for 31 s when the trainer process came to a round" in peer.silent("a round")
    with pytest.raises(remote.RolloutProcessDied):
        peer.check("a round")
    assert issubclass(remote.RolloutProcessDied, RolloutsFailed)


def test_a_wait_ends_when_the_heartbeat_stops_not_at_its_bound(monkeypatch):
    monkeypatch.setattr(remote, "POLL_S", 0.05)
    client = FakeClient()
    stop = threading.Event()
    thread = remote.beat(stop, client, every_s=0.02)
    peer = remote.Heartbeats(silence_s=0.3, client=client)
    inbox = remote.Mailbox("replies", client)
    with pytest.raises(TimeoutError):  # while it beats, the wait runs to its own bound
        inbox.receive(0.4, "a round", peer)
    stop.set()
    thread.join(1)
    t0 = time.monotonic()
    with pytest.raises(remote.RolloutProcessDied, match="while|came to a round"):
        inbox.receive(60, "a round", peer)
    assert time.monotonic() - t0 < 5


def test_a_hand_off_to_a_dead_process_is_raised_at_the_next_round(monkeypatch):
    """The step that made the weights is finished: the loop must record it (and save it) before
    the loss surfaces, so ``serve_staged`` only notes it and the next round raises it."""
    client, clock = FakeClient(), Clock()
    monkeypatch.setattr(remote, "_client", lambda: client)
    rollouts = remote.RemoteRollouts(wait_s=60, silence_s=30)
    rollouts.peer.clock = clock
    client.key_value_set(remote.ALIVE, "1", allow_overwrite=True)
    assert rollouts.peer.silent("x") == ""
    clock.now += 31
    assert rollouts.serve_staged(staged=None) is None  # nothing sent, no collective started
    assert not any(k.startswith(remote.REQUESTS) for k in client.store)
    with pytest.raises(remote.RolloutProcessDied, match="the weights' copy"):
        rollouts([{"problem": "p"}], 2, 0, 1)

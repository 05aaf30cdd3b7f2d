"""rl.remote's messages and heartbeat against an in-memory key-value store (the coordination
service's client has the same five calls); the two-process runs are tests/test_rollout_process.py."""
import threading
import time

import numpy as np
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
        client.key_value_set(remote.keys_of(1)[2], str(beat), allow_overwrite=True)
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
    client.key_value_set(remote.keys_of(1)[2], "killed", allow_overwrite=True)  # not DONE: never beats again
    t0 = time.monotonic()
    with pytest.raises(remote.RolloutProcessDied, match="while|came to a round"):
        inbox.receive(60, "a round", peer)
    assert time.monotonic() - t0 < 5


def test_a_training_process_watches_the_others_and_a_rollout_process_its_trainer(monkeypatch):
    """Several training processes: each watches the others' heartbeats (a dead one leaves it
    in a collective nothing in Python can end, so ``on_death`` exits), and a rollout process
    stops waiting for requests once its trainer's heartbeat stops; a heartbeat that ended on
    purpose (``DONE``) is not a death."""
    monkeypatch.setattr(remote, "POLL_S", 0.05)
    client, deaths = FakeClient(), []
    key = remote.keys_of(1)[2]
    client.key_value_set(key, "1", allow_overwrite=True)  # then silent: killed
    trainer = remote.Heartbeats(silence_s=0.3, client=client, process=1, role="training process",
                                watcher="training process")
    stop = threading.Event()
    thread = remote.watch([trainer], stop, deaths.append, every_s=0.05)
    thread.join(5)
    assert not thread.is_alive() and len(deaths) == 1
    assert "the training process (process 1) beat no heartbeat" in deaths[0]
    inbox = remote.Mailbox("requests", client)
    watched = remote.Heartbeats(silence_s=0.3, client=client, process=1, role="training process",
                                watcher="rollout process", error=remote.TrainerProcessDied)
    t0 = time.monotonic()
    with pytest.raises(remote.TrainerProcessDied, match="came to the next request"):
        inbox.receive(60, "the next request", watched)
    assert time.monotonic() - t0 < 5
    client.key_value_set(key, remote.DONE, allow_overwrite=True)  # closed: never a death
    done = remote.Heartbeats(silence_s=0.0, client=client, process=1)
    assert done.silent("x") == "" and done.silent("x") == ""


def test_a_stopped_heartbeat_says_done():
    client, stop = FakeClient(), threading.Event()
    thread = remote.beat(stop, client, every_s=0.01, process=3)
    time.sleep(0.05)
    assert int(client.store[remote.keys_of(3)[2]]) >= 1
    stop.set()
    thread.join(1)
    assert client.store[remote.keys_of(3)[2]] == remote.DONE


def test_a_hand_off_to_a_dead_process_is_raised_at_the_next_round(monkeypatch):
    """The step that made the weights is finished: the loop must record it (and save it) before
    the loss surfaces, so ``serve_staged`` only notes it and the next round raises it."""
    client, clock = FakeClient(), Clock()
    monkeypatch.setattr(remote, "_client", lambda: client)
    rollouts = remote.RemoteRollouts(wait_s=60, silence_s=30)
    rollouts.peers[0].beats.clock = clock
    client.key_value_set(remote.keys_of(1)[2], "1", allow_overwrite=True)
    assert rollouts.peers[0].beats.silent("x") == ""
    clock.now += 31
    assert rollouts.serve_staged(staged=None) is None  # nothing sent, no collective started
    assert not any(k.startswith(remote.REQUESTS) for k in client.store)
    with pytest.raises(remote.RolloutProcessDied, match="the weights' copy"):
        rollouts([{"problem": "p"}], 2, 0, 1)


def test_a_round_splits_evenly_over_the_rollout_processes_and_merges_back():
    assert remote.split_evenly(5, 2) == [(0, 3), (3, 5)]
    assert remote.split_evenly(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert remote.peer_seed(11, 0) == 11 and len({remote.peer_seed(11, k) for k in range(4)}) == 4
    merged = remote.merge_figures([
        {"timing/rollout_s": 2.0, "timing/rollout_generated_tokens": 10, "timing/rollout_max_live": 3,
         "timing/rollout_idle_fraction_mean": 0.2, "note": "x"},
        {"timing/rollout_s": 3.0, "timing/rollout_generated_tokens": 5, "timing/rollout_max_live": 2,
         "timing/rollout_idle_fraction_mean": 0.4}])
    assert merged == {"timing/rollout_s": 3.0, "timing/rollout_generated_tokens": 15.0,
                      "timing/rollout_max_live": 3.0, "timing/rollout_idle_fraction_mean": pytest.approx(0.3)}


def test_each_rollout_process_gets_its_share_and_group_ids_come_back_in_round_positions(monkeypatch):
    """Two rollout processes, answered in memory: the first gets groups 0-1, the second group 2;
    the trajectories come back labelled by their position in the round, and a paused rollout's
    (process, id) goes back to its own process."""
    from rstarjax.rl.trajectory import Trajectory

    client = FakeClient()
    monkeypatch.setattr(remote, "_client", lambda: client)
    rollouts = remote.RemoteRollouts(wait_s=5, silence_s=30, processes=(1, 2))
    inboxes = {p: remote.Mailbox(remote.keys_of(p)[0], client) for p in (1, 2)}
    outboxes = {p: remote.Mailbox(remote.keys_of(p)[1], client) for p in (1, 2)}
    for p in (1, 2):  # the answers, queued before the round (the mailbox keeps them in order)
        n = 2 if p == 1 else 1
        trajs = [Trajectory(prompt_ids=np.asarray([p]), segments=[], group_id=g) for g in range(n)]
        outboxes[p].send("round", (trajs, {"timing/rollout_s": float(p)}))
    records = [{"problem": str(i)} for i in range(3)]
    trajs, figures = rollouts(records, 1, 5, 0)
    assert [(int(t.prompt_ids[0]), t.group_id) for t in trajs] == [(1, 0), (1, 1), (2, 2)]
    assert figures == {"timing/rollout_s": 2.0}
    asked = {p: inboxes[p].receive(1, "a request") for p in (1, 2)}
    assert asked[1][1][0] == records[:2] and asked[2][1][0] == records[2:]
    assert asked[1][1][2] == 5 and asked[2][1][2] != 5  # distinct seeds per share

    outboxes[1].send("round", ([], [7], {}))
    outboxes[2].send("round", ([], [0, 1], {}))
    rnd = rollouts.partial(records[:2], 1, 5, 1, token_budget=4, carried=[(1, 3)], group_ids=[10, 11])
    assert rnd.paused == [(0, 7), (1, 0), (1, 1)]
    asked = {p: inboxes[p].receive(1, "a request")[1] for p in (1, 2)}
    assert asked[1]["records"] == records[:1] and asked[1]["group_ids"] == [10] and asked[1]["carried"] == []
    assert asked[2]["records"] == records[1:2] and asked[2]["group_ids"] == [11] and asked[2]["carried"] == [3]

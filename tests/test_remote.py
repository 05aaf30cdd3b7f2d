"""rl.remote's trainer side against an in-memory key-value store (``test_mailbox.FakeClient``);
the two-process runs are tests/test_rollout_process.py."""
import numpy as np
import pytest

from test_mailbox import Clock, FakeClient

from rstarjax.rl import mailbox, remote


def test_a_hand_off_to_a_dead_process_is_raised_at_the_next_round(monkeypatch):
    """The step that made the weights is finished: the loop must record it (and save it) before
    the loss surfaces, so ``serve_staged`` only notes it and the next round raises it."""
    client, clock = FakeClient(), Clock()
    monkeypatch.setattr(mailbox, "service_client", lambda: client)
    rollouts = remote.RemoteRollouts(wait_s=60, silence_s=30)
    rollouts.peers[0].beats.clock = clock
    client.key_value_set(mailbox.keys_of(1)[2], "1", allow_overwrite=True)
    assert rollouts.peers[0].beats.silent("x") == ""
    clock.now += 31
    assert rollouts.serve_staged(staged=None) is None  # nothing sent, no collective started
    assert not any(k.startswith(mailbox.REQUESTS) for k in client.store)
    with pytest.raises(mailbox.RolloutProcessDied, match="the weights' copy"):
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
    monkeypatch.setattr(mailbox, "service_client", lambda: client)
    rollouts = remote.RemoteRollouts(wait_s=5, silence_s=30, processes=(1, 2))
    inboxes = {p: mailbox.Mailbox(mailbox.keys_of(p)[0], client) for p in (1, 2)}
    outboxes = {p: mailbox.Mailbox(mailbox.keys_of(p)[1], client) for p in (1, 2)}
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


def test_a_rollout_process_stopped_by_a_signal_or_failing_to_start_tells_its_trainer_at_once(monkeypatch):
    """A rollout process that stops on a signal mid-round (``recipes.rollout_process`` turns
    SIGTERM / SIGINT into ``RolloutProcessStopped``) answers the round with one line and ends its
    heartbeat as FAILED, so the trainer raises at once (it once waited the whole round bound,
    hours by default, as for a deliberate stop); one that fails before its first message says
    why, where the trainer waits on its start (it once waited 900 s in silence)."""
    import signal
    import threading

    import jax

    client = FakeClient()
    monkeypatch.setattr(mailbox, "service_client", lambda: client)
    rollouts = remote.RemoteRollouts(wait_s=20, silence_s=600)  # the bounds are not what ends the waits
    monkeypatch.setattr(jax, "process_index", lambda: 1)  # the serving thread is rollout process 1

    def serve(engine_rollouts, wait_s, requests, replies, *rest):
        requests.receive(wait_s, "the first round")
        raise remote.RolloutProcessStopped(signal.SIGTERM)

    monkeypatch.setattr(remote, "_serve", serve)
    failed = []
    thread = threading.Thread(target=lambda: failed.append(pytest.raises(remote.RolloutProcessStopped,
                                                                         remote.serve_remote, None, 600)),
                              daemon=True)
    thread.start()
    with pytest.raises(mailbox.RolloutsFailed, match="rollout process 1 failed a round:\nrollout process 1 stopped on SIGTERM"):
        rollouts([{"problem": "p"}], 2, 0, 1)
    thread.join(10)
    assert failed and client.store[mailbox.keys_of(1)[2]] == mailbox.FAILED
    assert "stopped on an error or a signal" in rollouts.peers[0].beats.silent("the next round")

    client = FakeClient()
    monkeypatch.setattr(mailbox, "service_client", lambda: client)
    monkeypatch.setattr(jax, "process_index", lambda: 0)  # the trainer again
    starting = remote.RemoteRollouts(wait_s=20, hello_wait_s=20, silence_s=600)
    remote.report_failure(mailbox.Mailbox(mailbox.keys_of(1)[1], client), RuntimeError("the code pool did not start"))
    with pytest.raises(mailbox.RolloutsFailed, match="rollout process 1 failed to start:\n(.|\n)*the code pool did not start"):
        starting.layout


def test_a_rollout_process_started_with_other_settings_or_model_is_refused(monkeypatch):
    """The trainer trains on the rollout processes' log-probs and rewards: one started with
    another temperature or budget is refused at its first message, naming the setting (it once
    trained on with the log-prob gap alarm ringing), and one serving a model of another shape at
    the first hand-off (once a pytree traceback, or gloo aborting both processes)."""
    import types

    from flax import nnx

    from rstarjax.validation import ConfigError

    client = FakeClient()
    monkeypatch.setattr(mailbox, "service_client", lambda: client)
    here = {"sampling": {"temperature": 0.6, "top_p": 1.0}, "agent": {"max_turns": 10}, "chat_format": "rstar2"}
    there = {"sampling": {"temperature": 1.0, "top_p": 1.0}, "agent": {"max_turns": 10}, "chat_format": "rstar2"}
    rollouts = remote.RemoteRollouts(wait_s=20, hello_wait_s=20, silence_s=600, settings=here)
    hello = {"specs": {}, "dtype": "bfloat16", "untie_head": False, "serving_dtype": "bfloat16",
             "mesh": {"shape": {}}, "settings": there, "architecture": {"num_hidden_layers": 4, "hidden_size": 64}}
    mailbox.Mailbox(mailbox.keys_of(1)[1], client).send("hello", hello)
    with pytest.raises(ConfigError, match=r"rollout process 1 was started with other settings .*"
                                          r"sampling.temperature: 0.6 / 1.0: here / there"):
        rollouts.layout

    same = remote.RemoteRollouts(wait_s=20, hello_wait_s=20, silence_s=600, settings=there)
    same.peers[0].layout = hello

    class Model(nnx.Module):
        def __init__(self):
            self.config = types.SimpleNamespace(num_hidden_layers=2, hidden_size=64)

    with pytest.raises(ConfigError, match=r"another model .*model.num_hidden_layers: 2 / 4"):
        same.stage_params(Model())

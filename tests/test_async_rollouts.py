"""Bounded-staleness asynchronous rollouts (``rl.staleness``, ``rl.max_staleness``).

The admission rule against hand cases, the staleness bound under random timings (a property
test over many schedules), failures and the end of the data, and the RL stage around it: every
trained round within k versions, the gap alarm on fresh tokens only, and a checkpoint taken
with a round in flight that resumes without training any prompt twice.
"""
import json
import os
import random
import sys
import threading
import time

import numpy as np
import pytest

from rstarjax.rl.partial import CollectedRound, PartialRollouts
from rstarjax.rl.staleness import AsyncRollouts, lag_bound, may_start

sys.path.insert(0, os.path.dirname(__file__))


def test_admission_by_hand():
    # k = 0 is the synchronous loop: a round starts only when the trainer is idle and took every earlier one
    assert may_start(0, 0, False, 0)
    assert not may_start(1, 1, True, 0) and may_start(1, 1, False, 0)
    assert not may_start(2, 1, False, 0)
    # k = 1: the next round may overlap the update of the last one taken, no further
    assert may_start(1, 1, True, 1) and not may_start(2, 1, True, 1)
    assert may_start(2, 1, False, 1) and not may_start(3, 1, False, 1)
    # k = 3: up to three rounds ahead of an idle trainer
    assert may_start(4, 1, False, 3) and not may_start(4, 1, True, 3)


def test_lag_bound_by_hand():
    assert lag_bound(1, 5, 5) == 1  # a round's own tokens: the admission bound
    assert lag_bound(2, 3, 6) == 5  # a paused rollout's tokens three rounds earlier
    with pytest.raises(ValueError, match="earlier round"):
        lag_bound(1, 4, 3)


def _source(rollout_fn, data, k, remaining, **kw):
    it = iter(data)

    def draw(n):
        return [x for _, x in zip(range(n), it)]

    installed = []
    kw = {"prompts_per_round": 2, "rollouts_per_prompt": 1, **kw}
    src = AsyncRollouts(rollout_fn, draw, installed.append, seed_of=lambda i: 1000 + i, max_staleness=k,
                        version=0, remaining=remaining, **kw)
    return src, installed


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_no_round_is_trained_more_than_k_versions_after_its_sampler_under_random_timings(k, seed):
    """Random rollout and update times, random rejected rounds (no update): every round the trainer
    takes was sampled at most k versions before the version it is trained from, each prompt is
    rolled out once and in order, the rounds install the newest published weights, and no round
    starts that no update would take."""
    rng = random.Random(seed * 10 + k)
    lock = threading.Lock()
    delays = [rng.choice([0.0, 0.001, 0.004]) for _ in range(200)]

    def rollout_fn(records, n, s, version):
        with lock:
            time.sleep(delays[s % 200])
        return {"records": records, "version": version, "seed": s}

    total = 25
    src, installed = _source(rollout_fn, range(1000), k, remaining=total)
    version, lags, taken = 0, [], []
    try:
        while version < total:
            rnd, waited = src.next_round()
            assert waited["async/rollout_wait_s"] >= 0
            assert rnd.output["version"] == rnd.version and rnd.output["seed"] == 1000 + rnd.index
            lags.append(version - rnd.version)
            taken += rnd.records
            time.sleep(rng.choice([0.0, 0.002, 0.006]))  # the update
            if rng.random() < 0.25:  # every group rejected: no update
                src.publish(None, version, total - version)
            else:
                version += 1
                src.publish(f"weights v{version}", version, total - version)
        time.sleep(0.02)
        assert src.started == src.consumed  # nothing rolled out that no update takes
    finally:
        src.close()
    assert max(lags) <= k and min(lags) >= 0
    assert max(lags) >= 1  # the rounds did overlap the updates
    assert taken == list(range(len(taken)))
    versions = [int(w.rsplit("v", 1)[1]) for w in installed]
    assert versions == sorted(set(versions))  # newer weights each time, never an older one


def test_a_failing_rollout_is_raised_in_the_trainers_thread_and_the_end_of_data_ends_the_stage():
    def failing(records, n, s, version):
        raise OSError("sandbox pool died")

    src, _ = _source(failing, range(10), 1, remaining=5)
    with pytest.raises(RuntimeError, match="the rollout thread failed: OSError"):
        src.next_round()
    src.close()

    src, _ = _source(lambda r, n, s, v: r, range(3), 2, remaining=10)
    got = []
    while True:
        rnd, _ = src.next_round()
        if rnd is None:
            break
        got.append(rnd.records)
        src.publish(None, 0, 10)
    src.close()
    assert got == [[0, 1], [2]]


class RoundLoggingPauser:
    """``test_partial_rollouts.PausingRollouts`` that notes the round (from its seed, ``1000 +
    index``) each rollout started in, and sleeps a random while per round."""

    def __init__(self, rng, budget, longest=14):
        from test_partial_rollouts import PausingRollouts

        self.inner, self.rng, self.budget = PausingRollouts(longest=longest), rng, budget
        self.started_in = {}  # problem -> round index

    def partial(self, records, n, seed, version, **kw):
        assert kw["token_budget"] == self.budget
        for r in records:
            self.started_in[r["problem"]] = seed - 1000
        time.sleep(self.rng.choice([0.0, 0.001, 0.004]))
        return self.inner.partial(records, n, seed, version, **kw)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_partial_rounds_on_the_thread_train_whole_groups_once_within_the_lag_bound(k, seed):
    """Partial rollouts on the rollout thread, random timings and rejections: each group is
    trained once, whole, with the round that completed it; every token is at most
    ``lag_bound(k, round that sampled it, round that trains it)`` versions old, and the paused
    ones do get older than k; every prompt drawn is trained or kept for a checkpoint, never both."""
    rng = random.Random(seed * 10 + k)
    budget = 4
    fake = RoundLoggingPauser(rng, budget)
    partial = PartialRollouts(fake.partial, token_budget=budget, groups_per_update=2)
    records = [{"problem": f"p{i}", "answer": "1"} for i in range(1000)]
    total = 20
    src, _ = _source(None, records, k, remaining=total, partial=partial, rollouts_per_prompt=4)
    version, trained, over_k = 0, [], False
    try:
        while version < total:
            rnd, _ = src.next_round()
            out = rnd.output
            assert isinstance(out, CollectedRound) and out.groups_per_update == 2
            got_records, trajs, figures = out.collect([], 4, 0, version)
            assert got_records == rnd.records and figures["partial/groups_trained"] == len(got_records) <= 2
            for g, rec in enumerate(got_records):
                members = [t for t in trajs if t.group_id == g]
                assert [t.sample_index for t in members] == [0, 1, 2, 3]
                trained.append(rec["problem"])
                for t in members:
                    sampled_in = fake.started_in[rec["problem"]] + np.arange(t.num_model_tokens) // budget
                    lags = version - t.model_token_versions
                    bounds = [lag_bound(k, int(j), rnd.index) for j in sampled_in]
                    assert np.all(lags <= bounds) and np.all(lags >= 0)
                    over_k |= bool(lags.max() > k)
            time.sleep(rng.choice([0.0, 0.002, 0.006]))  # the update
            if not got_records or rng.random() < 0.2:  # nothing complete, or every group rejected
                src.publish(None, version, total - version)
            else:
                version += 1
                src.publish(f"weights v{version}", version, total - version)
        _, pending = src.snapshot(lambda: None)
    finally:
        src.close()
    assert len(trained) == len(set(trained)) >= 20  # no group trained twice
    assert over_k  # paused tokens lag beyond k: the bound's second term is needed
    drawn = {p for p in fake.started_in}
    assert drawn == set(trained) | {r["problem"] for r in pending}  # every drawn prompt: trained or kept
    assert not set(trained) & {r["problem"] for r in pending}


# ---- the RL stage ----------------------------------------------------------------------------
class StagedRollouts:
    """``ColocatedRollouts``' asynchronous contract without an engine: trajectories from
    test_checkpoint's deterministic stand-in, the weights staged and installed as tags; logs the
    prompts and version of every round. ``fail_at``: the round whose rollouts raise."""

    def __init__(self, trainer_ref, fail_at=None):
        self.trainer_ref, self.fail_at = trainer_ref, fail_at
        self.rounds, self.served = [], None

    def __call__(self, records, n, seed, version):
        from test_checkpoint import fake_rollout_fn

        assert self.served is None or version == self.served  # the version the thread installed
        self.rounds.append(([r["problem"] for r in records], version))
        if self.fail_at is not None and len(self.rounds) - 1 == self.fail_at:
            raise OSError("the code pool died")
        time.sleep(0.05)
        return fake_rollout_fn(records, n, seed, version)

    def stage_params(self, model):
        return self.trainer_ref[0].policy_version  # the version whose weights these are

    def serve_staged(self, version):
        self.served = version


def _async_config(workdir, total_steps):
    from test_checkpoint import in_process_config

    c = in_process_config(workdir, total_steps)
    c.rl.max_staleness = 1
    c.loss.tis_cap = 2.0
    return c


def _trainer_spy(monkeypatch, ref):
    from rstarjax.rl import trainer as trainer_lib

    init = trainer_lib.Trainer.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        ref[:] = [self]

    monkeypatch.setattr(trainer_lib.Trainer, "__init__", spy)


def test_the_stage_trains_rounds_within_k_and_resumes_without_training_a_prompt_twice(tmp_path, monkeypatch, capsys):
    import jax

    from rstarjax.io.checkpoint import read_checkpoint_meta
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl

    from test_checkpoint import write_data

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path)
    write_data(workdir, n=40)
    ref = []
    _trainer_spy(monkeypatch, ref)
    first = StagedRollouts(ref, fail_at=3)  # rounds 0-2 train steps 1-3; round 3 is in flight at step 3
    with pytest.raises(RuntimeError, match="the rollout thread failed: OSError"):
        run_rl(parse(_async_config(workdir, 6)), workdir, rollout_fn=first)
    step, meta = read_checkpoint_meta(os.path.join(workdir, "checkpoints"))
    assert step == 3
    assert [v for _, v in first.rounds] == [0, 0, 1, 2]  # each round overlapped the previous update
    pending = [r["problem"] for r in meta["in_flight_records"]]
    assert pending == first.rounds[3][0]  # drawn, never trained
    trained_a = {p for problems, _ in first.rounds[:3] for p in problems}

    second = StagedRollouts(ref)
    capsys.readouterr()
    trainer = run_rl(parse(_async_config(workdir, 6)), workdir, rollout_fn=second)
    assert trainer.step == 6
    assert second.rounds[0][0] == pending  # the prompts in flight start again, first
    # the work redone is said where the user sees it (no metric of this mode counts it)
    assert f"rstarjax: resumed with {len(pending)} prompts whose rollouts were in flight at step 3" \
        in capsys.readouterr().out
    assert not {p for problems, _ in second.rounds for p in problems} & trained_a
    assert len(second.rounds) == 3  # no round started that no update took
    with open(os.path.join(workdir, "logs", "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    lags = [m["async/policy_lag_max"] for m in logged]
    assert len(lags) == 6 and max(lags) == 1.0 and min(lags) == 0.0
    assert all(m["async/rollout_wait_s"] >= 0 for m in logged)
    assert np.isfinite([m["train/loss"] for m in logged]).all()


def test_versions_count_weight_sets_not_mini_batch_updates(tmp_path, monkeypatch):
    """With trainer.mini_batches = 2 each rollout batch moves the step by 2 but publishes one
    policy: rounds are tagged, lagged and bounded in those versions (AReaL's: one per published
    policy), so k = 1 keeps its lag at 1 (it read 2 in optimizer updates), and no round starts
    that no update takes (the thread counted updates left, not batches: 5 started for 4)."""
    import jax

    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl
    from rstarjax.rl.staleness import rollout_steps_left

    from test_checkpoint import write_data

    assert [rollout_steps_left(8, s, 2) for s in (0, 1, 2, 7, 8)] == [4, 4, 3, 1, 0]
    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path)
    write_data(workdir, n=40)
    ref = []
    _trainer_spy(monkeypatch, ref)
    rollouts = StagedRollouts(ref)
    c = _async_config(workdir, 8)
    c.trainer.mini_batches, c.trainer.micro_batch_size = 2, 2
    trainer = run_rl(parse(c), workdir, rollout_fn=rollouts)
    assert (trainer.step, trainer.policy_version) == (8, 4)
    assert [v for _, v in rollouts.rounds] == [0, 0, 1, 2]
    with open(os.path.join(workdir, "logs", "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert [m["train/step"] for m in logged] == [2, 4, 6, 8]
    assert [m["async/policy_lag_max"] for m in logged] == [0.0, 1.0, 1.0, 1.0]


def test_prompts_in_flight_at_an_async_checkpoint_start_first_when_resumed_synchronously(tmp_path, monkeypatch, capsys):
    """A checkpoint of asynchronous rollouts keeps the prompts of the round in flight; resumed
    with rl.max_staleness=0 the synchronous steps start them first (they were once dropped
    without a word, and later prompts trained in their place), and none trained twice."""
    import jax

    from rstarjax.io.checkpoint import read_checkpoint_meta
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl

    from test_checkpoint import write_data

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path)
    write_data(workdir, n=40)
    ref = []
    _trainer_spy(monkeypatch, ref)
    first = StagedRollouts(ref, fail_at=3)
    with pytest.raises(RuntimeError, match="the rollout thread failed: OSError"):
        run_rl(parse(_async_config(workdir, 6)), workdir, rollout_fn=first)
    step, meta = read_checkpoint_meta(os.path.join(workdir, "checkpoints"))
    pending = [r["problem"] for r in meta["in_flight_records"]]
    assert step == 3 and pending
    trained_a = {p for problems, _ in first.rounds[:3] for p in problems}

    second = StagedRollouts(ref)
    c = _async_config(workdir, 6)
    c.rl.max_staleness = 0
    capsys.readouterr()
    trainer = run_rl(parse(c), workdir, rollout_fn=second)
    assert trainer.step == 6
    assert f"rstarjax: resumed with {len(pending)} prompts" in capsys.readouterr().out
    assert second.rounds[0][0] == pending
    later = [p for problems, _ in second.rounds for p in problems]
    assert not set(later) & trained_a and len(later) == len(set(later))


class StagedPausingRollouts(StagedRollouts):
    """``StagedRollouts`` whose rounds are partial ones (``test_partial_rollouts.PausingRollouts``);
    logs each round's new prompts and version, and its finished (problem, sample) pairs."""

    def __init__(self, trainer_ref, fail_at=None):
        from test_partial_rollouts import PausingRollouts

        super().__init__(trainer_ref, fail_at)
        self.pauser = PausingRollouts(longest=14)

    def partial(self, records, n, seed, version, **kw):
        assert self.served is None or version == self.served
        self.rounds.append(([r["problem"] for r in records], version))
        if self.fail_at is not None and len(self.rounds) - 1 == self.fail_at:
            raise OSError("the code pool died")
        time.sleep(0.05)
        return self.pauser.partial(records, n, seed, version, **kw)


def test_partial_rollouts_on_the_thread_resume_without_training_a_group_twice(tmp_path, monkeypatch):
    import jax

    from rstarjax.io.checkpoint import read_checkpoint_meta
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl

    from test_checkpoint import write_data

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path)
    write_data(workdir, n=60)

    def config(total_steps):
        c = _async_config(workdir, total_steps)
        c.rl.max_response_len, c.rl.partial_rollout_tokens = 16, 4
        c.trainer.micro_batch_size = 0
        return c

    ref = []
    _trainer_spy(monkeypatch, ref)
    first = StagedPausingRollouts(ref, fail_at=5)
    with pytest.raises(RuntimeError, match="the rollout thread failed: OSError"):
        run_rl(parse(config(8)), workdir, rollout_fn=first)
    step, meta = read_checkpoint_meta(os.path.join(workdir, "checkpoints"))
    assert step >= 1
    pending = [r["problem"] for r in meta["in_flight_records"]]
    trained_a = {p for problems, _ in first.rounds for p in problems} - set(pending)
    assert pending and trained_a
    with open(os.path.join(workdir, "logs", "metrics.jsonl")) as f:
        logged_a = [json.loads(line) for line in f]
    assert len(logged_a) == step

    second = StagedPausingRollouts(ref)
    trainer = run_rl(parse(config(step + 3)), workdir, rollout_fn=second)
    assert trainer.step == step + 3
    started_b = [p for problems, _ in second.rounds for p in problems]
    assert started_b[:len(pending)] == pending  # the groups not trained start again, first
    assert not set(started_b) & trained_a  # no group trained before the stop is rolled out again
    with open(os.path.join(workdir, "logs", "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert [m["step"] for m in logged] == list(range(1, step + 4))
    assert logged[step]["partial/restarted_groups"] == len(pending)
    assert max(m["async/policy_lag_max"] for m in logged) >= 2  # paused tokens: older than k = 1
    assert all(m["partial/groups_trained"] >= 1 for m in logged)
    assert np.isfinite([m["train/loss"] for m in logged]).all()


def two_process_worker(workdir: str, port: int, pid: int, total_steps: int, fail_at: int):
    """Process ``pid`` of a 2-process colocated stage with ``max_staleness=1`` and partial
    rollouts (one CPU device each, gloo); round ``fail_at`` fails on both (-1: none). Writes the
    rounds its rollout function saw to ``rounds-PID-STEPS.json``; exits 3 on the failure."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl
    from rstarjax.rl import trainer as trainer_lib

    ref = []
    init = trainer_lib.Trainer.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        ref[:] = [self]

    trainer_lib.Trainer.__init__ = spy
    c = _async_config(workdir, total_steps)
    c.rl.max_response_len, c.rl.partial_rollout_tokens = 16, 4
    c.trainer.micro_batch_size = 0
    c.mesh.fsdp = -1  # over both processes' devices
    fake = StagedPausingRollouts(ref, fail_at=None if fail_at < 0 else fail_at)
    status = 0
    try:
        run_rl(parse(c), workdir, rollout_fn=fake)
    except RuntimeError as e:
        if "the rollout thread failed" not in str(e):
            raise
        status = 3
    with open(os.path.join(workdir, f"rounds-{pid}-{total_steps}.json"), "w") as f:
        json.dump(fake.rounds, f)
    sys.exit(status)


def _run_two_processes(workdir: str, total_steps: int, fail_at: int, status: int):
    from process_support import free_port, run_processes

    port = free_port()
    done = run_processes(os.path.abspath(__file__),
                         [[workdir, port, pid, total_steps, fail_at] for pid in range(2)])
    assert [code for code, _ in done] == [status, status], [out[-3000:] for _, out in done]
    rounds = []
    for pid in range(2):
        with open(os.path.join(workdir, f"rounds-{pid}-{total_steps}.json")) as f:
            rounds.append([problems for problems, _ in json.load(f)])
    return rounds


@pytest.mark.slow  # two 2-process stages, ~30 s each on 2 cores
def test_two_training_processes_roll_out_asynchronously_and_resume_their_own_rounds(tmp_path):
    """``max_staleness=1`` with partial rollouts on two training processes, each with its own
    rollout thread and data share: both fail at the same round, and the checkpoint keeps each
    process's prompts drawn but not trained; on resume each process rolls its own out again,
    first, and no process rolls out a prompt trained before the stop, or one of the other's."""
    from rstarjax.io.checkpoint import read_checkpoint_meta

    from test_checkpoint import write_data

    workdir = str(tmp_path)
    write_data(workdir, n=80)
    first = _run_two_processes(workdir, 8, fail_at=5, status=3)
    step, meta = read_checkpoint_meta(os.path.join(workdir, "checkpoints"))
    assert step >= 1
    second = _run_two_processes(workdir, step + 3, fail_at=-1, status=0)
    starts = [{p for problems in runs[pid] for p in problems} for runs in (first, second) for pid in range(2)]
    assert not (starts[0] | starts[2]) & (starts[1] | starts[3])  # each process its own prompts
    pending = [[r["problem"] for r in share["in_flight_records"]] for share in meta["process_shares"]]
    for pid in range(2):
        trained_a = {p for problems in first[pid] for p in problems} - set(pending[pid])
        started_b = [p for problems in second[pid] for p in problems]
        assert pending[pid] and started_b[:len(pending[pid])] == pending[pid]
        assert not set(started_b) & trained_a
    with open(os.path.join(workdir, "logs", "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert [m["step"] for m in logged] == list(range(1, step + 4))
    assert max(m["async/policy_lag_max"] for m in logged) >= 1
    assert np.isfinite([m["train/loss"] for m in logged]).all()


def test_config_refuses_staleness_without_a_correction_or_with_released_memory(tmp_path):
    from rstarjax.recipes.config import ConfigError, parse

    from test_checkpoint import write_data

    write_data(str(tmp_path))
    c = _async_config(str(tmp_path), 2)
    c.loss.tis_cap = None
    with pytest.raises(ConfigError, match="off-policy correction"):
        parse(c)
    c = _async_config(str(tmp_path), 2)
    c.trainer.recompute_old_logprobs = False  # TIS's weight would be exactly 1
    with pytest.raises(ConfigError, match="tis_cap=2.0 needs --config.trainer.recompute_old_logprobs=True"):
        parse(c)
    c = _async_config(str(tmp_path), 2)
    c.serving.release_during_update = True
    with pytest.raises(ConfigError, match="release_during_update"):
        parse(c)
    c = _async_config(str(tmp_path), 2)
    c.rl.dynamic_sampling = True
    with pytest.raises(ConfigError, match="max_staleness does not combine with dynamic_sampling"):
        parse(c)


if __name__ == "__main__":
    two_process_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))


def test_rollouts_that_fail_because_the_stop_reached_them_first_end_as_the_stop(tmp_path, monkeypatch):
    """Ctrl-C reaches every process of a run: a rollout process stops its round at once and the
    trainer's wait on it fails. With the trainer's own stop pending, that is the stop (the last
    finished step saved, exit 128 + signal), not an infrastructure failure (exit 1); without one,
    it is the failure."""
    import signal

    import jax

    from rstarjax.io.checkpoint import read_checkpoint_meta
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build, preemption
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl
    from rstarjax.rl.trajectory import RolloutsFailed

    from test_checkpoint import fake_rollout_fn, in_process_config, write_data

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    guards = []
    init = preemption.SignalGuard.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        guards.append(self)

    monkeypatch.setattr(preemption.SignalGuard, "__init__", spy)
    for pending, dirname in ((True, "stopped"), (False, "failed")):
        workdir = str(tmp_path / dirname)
        write_data(workdir, n=40)
        calls = []

        def rollouts(records, n, seed, version):
            calls.append(version)
            if len(calls) == 3:  # step 3's round: the rollout processes stopped on the signal first
                if pending:
                    guards[-1].request = preemption.StopRequest(signal.SIGINT, 0.0)
                raise RolloutsFailed("rollout process 1 failed a round:\nrollout process 1 stopped on SIGINT")
            return fake_rollout_fn(records, n, seed, version)

        if pending:
            with pytest.raises(preemption.Interrupted, match="stopped on SIGINT: step 2 is saved") as stop:
                run_rl(parse(in_process_config(workdir, 6)), workdir, rollout_fn=rollouts)
            assert stop.value.exit_status == 128 + signal.SIGINT
        else:
            with pytest.raises(RolloutsFailed, match="stopped on SIGINT"):
                run_rl(parse(in_process_config(workdir, 6)), workdir, rollout_fn=rollouts)
        assert read_checkpoint_meta(os.path.join(workdir, "checkpoints"))[0] == 2

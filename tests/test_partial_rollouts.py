"""Partial rollouts in the RL loop (``rl.partial``, ``rl.partial_rollout_tokens``; Kimi k1.5 §2.6.2).

The scheduler's pause and resume are token-exact (tests/test_engine.py). Here: the agent loop
across pauses (real engine, real tools, scripted policy), the bookkeeping of groups in flight
(whole groups only, each rollout once, per-token policy versions), the metrics against hand
computations, and the RL stage around it: a checkpoint with rollouts in flight resumes without
training any rollout twice.
"""
import dataclasses
import hashlib
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.rl.agent_loop import RolloutRound
from rstarjax.rl.partial import PartialRollouts, fresh_token_mask, policy_lag_metrics
from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, Trajectory



# ---- a stand-in engine that pauses: each rollout has a fixed length, sampled budget by budget -----
@dataclasses.dataclass(eq=False)
class FakePaused:
    """What the scheduler returns for a paused rollout: ``.episode`` and ``.n_sampled``."""

    episode: dict
    n_sampled: int = 0


def _length(problem: str, j: int, longest: int) -> int:
    h = int(hashlib.sha256(f"{problem}/{j}".encode()).hexdigest()[:8], 16)
    return 2 + h % (longest - 1)  # 2..longest tokens: some finish in one round, some need several


class PausingRollouts:
    """``ColocatedRollouts.partial``'s contract without an engine: rollout j of a record samples
    ``_length`` tokens, at most ``token_budget`` per round; the reward alternates with j (every
    group mixed). Logs every round's started and finished (problem, j)."""

    def __init__(self, longest: int = 12):
        self.longest, self.rounds = longest, []

    def __call__(self, records, n, seed, version):  # the synchronous contract (unused with partial)
        raise AssertionError("partial rollouts must call .partial")

    def partial(self, records, n, seed, version, *, token_budget, carried=(), group_ids=None, keep_kv=True):
        group_ids = range(len(records)) if group_ids is None else group_ids
        live = list(carried)
        for rec, gid in zip(records, group_ids):
            for j in range(n):
                live.append(FakePaused({"problem": rec["problem"], "j": j, "group_id": int(gid),
                                        "length": _length(rec["problem"], j, self.longest),
                                        "starts": [(0, version)]}))
        finished, paused = [], []
        for r in live:
            ep = r.episode
            if ep["starts"][-1][1] != version:
                ep["starts"].append((r.n_sampled, version))
            r.n_sampled = min(ep["length"], r.n_sampled + token_budget)
            if r.n_sampled < ep["length"]:
                paused.append(r)
                continue
            ids = (np.arange(ep["length"]) % 50 + 1).astype(np.int32)
            finished.append(Trajectory(
                prompt_ids=np.asarray([3, 4, 5], np.int32),
                segments=[Segment(SegmentKind.MODEL, ids, -0.5 * np.ones(len(ids)))],
                turns=1, finish=FinishReason.ANSWERED, reward=float(ep["j"] % 2 == 0),
                group_id=ep["group_id"], sample_index=ep["j"], policy_version=ep["starts"][0][1],
                version_starts=ep["starts"][1:], response_text=ep["problem"]))
        self.rounds.append({"started": [(rec["problem"], j) for rec in records for j in range(n)],
                            "finished": [(t.response_text, t.sample_index) for t in finished]})
        return RolloutRound(finished, paused, {"timing/rollout_s": 0.0})


def test_groups_are_trained_whole_once_and_carry_their_versions():
    fake = PausingRollouts(longest=12)
    partial = PartialRollouts(fake.partial, token_budget=4, groups_per_update=3)
    records = [{"problem": f"p{i}", "answer": "1"} for i in range(200)]
    next_record, trained, version, was_waiting = 0, [], 0, []
    for _ in range(20):
        new = records[next_record:next_record + partial.room]
        next_record += len(new)
        assert len(new) == 3 - len(partial.ready)  # a step's prompts, less the groups waiting
        out_records, trajs, figures = partial.collect(new, 4, seed=0, version=version)
        assert figures["partial/groups_trained"] == len(out_records) <= 3  # one step's at most
        assert len(partial.ready) < 3 + 3
        waited = [int(r["problem"][1:]) for r in out_records]
        assert waited[:len(was_waiting)] == was_waiting[:3]  # first complete, first trained
        was_waiting = [int(g.record["problem"][1:]) for g in partial.ready]
        for g, rec in enumerate(out_records):
            members = [t for t in trajs if t.group_id == g]
            assert [t.sample_index for t in members] == [0, 1, 2, 3]  # whole, in sample order
            assert all(t.response_text == rec["problem"] for t in members)
            trained.append(rec["problem"])
        for t in trajs:  # each token's version: the round (update) that sampled it
            lengths = np.arange(t.num_model_tokens)
            expect = t.policy_version + lengths // 4  # 4 tokens per round, one update per round
            np.testing.assert_array_equal(t.model_token_versions, expect)
        version += 1
    assert len(trained) == len(set(trained))  # no group trained twice
    assert len(trained) >= 40  # about a step's groups per step once the first ones finish
    assert len(partial.groups) <= 3 * 4  # a group finishes within ceil(12 / 4) + 1 rounds


def test_collect_refuses_more_prompts_than_room():
    partial = PartialRollouts(PausingRollouts().partial, token_budget=4, groups_per_update=2)
    with pytest.raises(ValueError, match="room for 2"):
        partial.collect([{"problem": str(i), "answer": "1"} for i in range(3)], 2, 0, 0)
    with pytest.raises(ValueError, match="token_budget"):
        PartialRollouts(PausingRollouts().partial, token_budget=0, groups_per_update=2)


def _traj(model_lengths, version, starts=(), tool=2):
    segs = []
    for k, n in enumerate(model_lengths):
        if k:
            segs.append(Segment(SegmentKind.TOOL, np.full(tool, 7)))
        segs.append(Segment(SegmentKind.MODEL, np.full(n, 9), -np.ones(n)))
    return Trajectory(prompt_ids=np.asarray([1, 2], np.int32), segments=segs, policy_version=version,
                      version_starts=list(starts))


def test_policy_lag_and_the_fresh_token_mask_by_hand():
    a = _traj([3, 2], 4, starts=[(2, 5), (4, 6)])  # model tokens: versions 4 4 5 5 6
    b = _traj([2], 6)
    np.testing.assert_array_equal(a.token_versions, [4, 4, 5, -1, -1, 5, 6])
    got = policy_lag_metrics([a, b], version=6)
    # lags: a 2 2 1 1 0, b 0 0 -> max 2, mean 6/7, stale 4/7
    assert got["partial/policy_lag_max"] == 2.0
    assert got["partial/policy_lag_mean"] == pytest.approx(6 / 7)
    assert got["partial/stale_token_frac"] == pytest.approx(4 / 7)
    from rstarjax.rl.batch import build_train_batch

    batch, layout = build_train_batch([a, b], [1.0, -1.0], seq_len=12, pad_id=0, num_rows=3)
    mask = fresh_token_mask([a, b], layout.placements, 6, 3, 12, kept_kv=False)
    expect = np.zeros((3, 12), np.float32)
    expect[0, 2 + 6] = 1  # a's last model token (prompt 2 + response position 6)
    expect[1, 2:4] = 1  # b's two tokens
    np.testing.assert_array_equal(mask, expect)
    assert np.all(mask <= batch.loss_mask)  # only trained tokens
    # a continued on KV that versions 4 and 5 wrote: none of its tokens is exactly version 6's
    expect[0] = 0
    np.testing.assert_array_equal(fresh_token_mask([a, b], layout.placements, 6, 3, 12), expect)


# ---- the agent loop across pauses: real engine, real tools, a scripted policy --------------------
@pytest.mark.slow  # ~40 s on 2 shared cores (compiles + sandboxed tool calls)
def test_agent_rollouts_paused_every_few_tokens_equal_uninterrupted_ones():
    """Paused rollouts keep their KV (the default) and decode on from it; the tool calls, the
    rewards and every token and log-prob are those of an uninterrupted run."""
    from rstarjax.env import CodeExecutor
    from rstarjax.models.chat_template import COMPACT, encode_prompt
    from rstarjax.models.config import ModelConfig
    from rstarjax.models.qwen3 import Qwen3
    from rstarjax.models.tokenizer import load_tokenizer
    from rstarjax.rl.agent_loop import (AgentConfig, AgentEpisode, RolloutRequest, StopIds, run_episodes,
                                        run_rollouts)
    from rstarjax.serving import Engine, SamplingParams
    from rstarjax.serving.scheduler import RolloutScheduler

    tok = load_tokenizer(486)
    model = Qwen3(ModelConfig.preset("tiny", dtype=jnp.float32, vocab_size=512), rngs=nnx.Rngs(0))
    engine = Engine(model, num_slots=4, max_len=512, buckets=(64, 256, 512), cache_dtype=jnp.float32)
    tool = "execute_python_code_with_standard_io"
    args = json.dumps({"code": "print(6*7)", "input": ""})
    turns = [f'<reason>run it</reason><tool_call>\n{{"name": "{tool}", "arguments": {args}}}\n</tool_call>',
             "<reason>done</reason><answer>\\boxed{42}</answer><|im_end|>"]
    config = AgentConfig(max_turns=3, max_response_len=400)

    def requests(scripted):
        prompt = encode_prompt(tok, "What is 6*7?", COMPACT)
        script = [i for t in turns for i in tok.encode(t)]
        return [RolloutRequest(prompt, "42", g, SamplingParams(temperature=1.0, seed=g), sample_index=g,
                               script=script if scripted and g % 2 == 0 else None) for g in range(4)]

    with CodeExecutor(num_workers=2) as executor:
        sched = RolloutScheduler([engine], max_rollout_len=512, tool_timeout_s=config.tool_wait_s)
        whole, _ = run_rollouts(sched, tok, executor, requests(True), config, fmt=COMPACT)
        stops = StopIds.from_tokenizer(tok, COMPACT)
        episodes = [AgentEpisode(r, tok, executor, config, stops, COMPACT) for r in requests(True)]
        paused, _ = run_episodes(sched, episodes, token_budget=7, keep_kv=True)
        rounds = 1
        while paused:
            for r in paused:  # a new "version" each round: recorded, weights unchanged
                r.episode.continue_under(rounds, r.n_sampled)
            paused, _ = run_episodes(sched, [], token_budget=7, carried=paused, keep_kv=True)
            rounds += 1
            assert rounds < 200
    assert rounds > 3  # the scripted turns are tens of tokens: paused many times
    for a, ep in zip(whole, episodes):
        b = ep.traj
        assert [s.ids.tolist() for s in a.segments] == [s.ids.tolist() for s in b.segments]
        for sa, sb in zip(a.segments, b.segments):
            if sa.logprobs is not None:
                np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-5)
        assert (a.finish, a.reward, a.tool_calls) == (b.finish, b.reward, b.tool_calls)
        versions = b.model_token_versions
        assert versions[0] == 0 and np.all(np.diff(versions) >= 0)
        if b.num_model_tokens > 7:
            assert versions[-1] >= 1
    assert [t.reward for t in whole[::2]] == [1.0, 1.0]  # the scripted ones answer 42 via the tool


# ---- the RL stage: a checkpoint with rollouts in flight ------------------------------------------
def _stage_config(workdir, total_steps):
    from test_checkpoint import in_process_config  # the tiny stage the SIGKILL-resume test runs

    c = in_process_config(workdir, total_steps)
    c.data.num_epochs = 1
    c.rl.max_response_len = 16
    c.rl.partial_rollout_tokens = 4
    c.trainer.micro_batch_size = 0
    return c


def test_a_checkpoint_with_rollouts_in_flight_resumes_without_training_any_twice(tmp_path, monkeypatch):
    import jax

    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl
    from rstarjax.io.checkpoint import read_checkpoint_meta

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path)
    with open(os.path.join(workdir, "train.jsonl"), "w") as f:
        for i in range(40):
            f.write(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n")
    first = PausingRollouts(longest=14)
    run_rl(parse(_stage_config(workdir, 3)), workdir, rollout_fn=first)
    step, meta = read_checkpoint_meta(os.path.join(workdir, "checkpoints"))
    assert step == 3
    completed_a = [p for r in first.rounds for p, j in r["finished"] if j == 0]  # one per group
    started_a = [p for r in first.rounds for p, j in r["started"] if j == 0]
    in_flight = [p for p in started_a if p not in completed_a]
    # samples that finished before a group did are kept in flight; the group is what counts
    groups_done_a = {p for p in started_a
                     if sum(q == p for r in first.rounds for q, _ in r["finished"]) == 4}
    pending = [r["problem"] for r in meta["in_flight_records"]]
    # the checkpoint keeps every prompt not trained: those decoding, and complete ones waiting
    assert set(p for p in started_a if p not in groups_done_a) <= set(pending) <= set(started_a)
    assert in_flight  # the lengths leave some group in flight at step 3
    trained_a = groups_done_a - set(pending)

    second = PausingRollouts(longest=14)
    trainer = run_rl(parse(_stage_config(workdir, 6)), workdir, rollout_fn=second)
    assert trainer.step == 6
    restarted = pending
    started_b = [p for r in second.rounds for p, j in r["started"] if j == 0]
    assert started_b[:len(restarted)] == restarted  # untrained prompts start again, first
    assert not set(started_b) & trained_a  # a group trained before the stop is never rolled out again
    with open(os.path.join(workdir, "logs", "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    resumed = [m for m in logged if m.get("step") == 4]
    assert resumed and resumed[-1]["partial/restarted_groups"] == float(len(restarted))
    assert all(m["partial/policy_lag_max"] >= 0 for m in logged if "partial/policy_lag_max" in m)
    assert max(m["partial/policy_lag_max"] for m in logged) >= 1  # carried across an update


def test_own_share_reads_this_processes_entry_or_the_runs():
    from rstarjax.recipes.sources import own_share

    shares = [{"data_state": {"rows": 5}, "in_flight_records": [{"problem": "a"}]},
              {"data_state": {"rows": 7}, "in_flight_records": []}]
    meta = {"data_state": {"rows": 5}, "in_flight_records": [{"problem": "a"}], "process_shares": shares}
    assert own_share(meta, 2, 1) == ({"rows": 7}, [])
    assert own_share(meta, 2, 0) == ({"rows": 5}, [{"problem": "a"}])
    with pytest.raises(ValueError, match="num_processes=2"):
        own_share(meta, 4, 1)
    assert own_share({"data_state": {"rows": 3}, "partial_records": [1]}, 4, 3) == ({"rows": 3}, [1])
    assert own_share({}, 1, 0) == (None, None)


# ---- two training processes: each keeps its own data position and prompts in flight ------------
def two_process_worker(workdir: str, port: int, pid: int, total_steps: int):
    """Process ``pid`` of a 2-process partial-rollout stage (one CPU device each, gloo); writes
    the rounds its rollout function saw to ``rounds-PID-STEPS.json``."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl

    c = _stage_config(workdir, total_steps)
    c.mesh.fsdp = -1  # over both processes' devices
    fake = PausingRollouts(longest=14)
    run_rl(parse(c), workdir, rollout_fn=fake)
    with open(os.path.join(workdir, f"rounds-{pid}-{total_steps}.json"), "w") as f:
        json.dump(fake.rounds, f)


def _run_two_processes(workdir: str, total_steps: int):
    from process_support import free_port, run_processes

    port = free_port()
    done = run_processes(os.path.abspath(__file__), [[workdir, port, pid, total_steps] for pid in range(2)])
    assert [code for code, _ in done] == [0, 0], [out[-3000:] for _, out in done]
    rounds = []
    for pid in range(2):
        with open(os.path.join(workdir, f"rounds-{pid}-{total_steps}.json")) as f:
            rounds.append(json.load(f))
    return rounds


@pytest.mark.slow  # two 2-process stages, ~30 s each on 2 cores
def test_each_training_process_resumes_its_own_prompts_in_flight(tmp_path):
    """With partial rollouts every process draws as many prompts as its complete groups leave
    room for, so data positions and prompts in flight differ between processes. The checkpoint
    (written by process 0) keeps each process's; on resume each starts its own again, first,
    and no process rolls out a group trained before the stop."""
    from rstarjax.io.checkpoint import read_checkpoint_meta

    workdir = str(tmp_path)
    with open(os.path.join(workdir, "train.jsonl"), "w") as f:
        for i in range(80):
            f.write(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n")
    first = _run_two_processes(workdir, 3)
    step, meta = read_checkpoint_meta(os.path.join(workdir, "checkpoints"))
    assert step == 3
    second = _run_two_processes(workdir, 6)
    starts = [{p for r in runs[pid] for p, j in r["started"] if j == 0} for runs in (first, second)
              for pid in range(2)]
    # each process rolls out its own prompts only, before and after the resume (with process 0's
    # prompts in flight restarted everywhere, process 1 would roll out process 0's)
    assert not (starts[0] | starts[2]) & (starts[1] | starts[3])
    shares = meta["process_shares"]
    assert len(shares) == 2
    pending = [[r["problem"] for r in share["in_flight_records"]] for share in shares]
    assert pending[0] and pending[1] and not set(pending[0]) & set(pending[1])
    for pid in range(2):
        started_a = [p for r in first[pid] for p, j in r["started"] if j == 0]
        trained_a = set(started_a) - set(pending[pid])
        started_b = [p for r in second[pid] for p, j in r["started"] if j == 0]
        assert started_b[:len(pending[pid])] == pending[pid]  # its own prompts in flight, first
        assert not set(started_b) & trained_a


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
    two_process_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))

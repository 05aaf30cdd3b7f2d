"""What reaches the update: the batch filter of rStar2-Agent §4.3 (equal-reward groups rejected),
rollouts ended by infrastructure errors excluded, the GRPO baseline's sampling and Dr. GRPO's
constant denominator, through the real ``rl_step`` (tiny model, real RoC / batch / loss)."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_trainer import tiny_model  # noqa: E402
from tiny_run import tiny_rl_config  # noqa: E402

from rstarjax.models import sharding as sharding_lib  # noqa: E402
from rstarjax.recipes import build  # noqa: E402
from rstarjax.recipes.config import parse  # noqa: E402
from rstarjax.recipes.rl import run_rl  # noqa: E402
from rstarjax.rl import optim as optim_lib  # noqa: E402
from rstarjax.rl import trainer as trainer_lib  # noqa: E402
from rstarjax.rl.loss import LossConfig  # noqa: E402
from rstarjax.rl.config import RLConfig  # noqa: E402
from rstarjax.rl.step import rl_step  # noqa: E402
from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, Trajectory  # noqa: E402

G = 2


def response_len(problem: int, j: int) -> int:
    return 2 + (problem + 3 * j) % 5  # model tokens of rollout j of a problem


def scripted(rewards_of, finish_of=lambda p, j: FinishReason.ANSWERED, calls=None):
    """A rollout function: problem p's rollout j gets ``rewards_of(p)[j]`` and ``finish_of(p, j)``."""

    def fn(records, n, seed, version):
        if calls is not None:
            calls.append(n)
        out = []
        for g, rec in enumerate(records):
            p = int(rec["problem"].split()[-1])
            rng = np.random.default_rng([p, seed])
            for j in range(n):
                k = response_len(p, j)
                finish = finish_of(p, j)
                out.append(Trajectory(
                    prompt_ids=np.array([5, 6, 7], np.int32),
                    segments=[Segment(SegmentKind.MODEL, rng.integers(1, 400, k), -rng.random(k) - 0.1)],
                    turns=1, answer_tags=1, finish=finish,
                    reward=0.0 if finish == FinishReason.ERROR else float(rewards_of(p)[j]), group_id=g,
                    policy_version=version))
        return out

    return fn


def records(*problems):
    return [{"problem": f"problem {p}", "answer": str(p)} for p in problems]


def make_trainer():
    return trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(learning_rate=1e-3), LossConfig(),
                               trainer_lib.TrainerConfig(micro_batch_size=0),
                               mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))


@pytest.fixture(scope="module")
def trainer():
    return make_trainer()


def rl_cfg(**kw):
    base = dict(prompts_per_step=4, group_size=G, oversample=2 * G, max_prompt_len=4, max_response_len=8)
    base.update(kw)
    return RLConfig(**base)


# problem 0: all correct, 1: all wrong, 2 and 3: mixed (two right, two wrong)
REWARDS = {0: [1, 1, 1, 1], 1: [0, 0, 0, 0], 2: [1, 0, 1, 0], 3: [0, 1, 0, 1]}


def test_equal_reward_groups_are_rejected_before_roc(trainer):
    fn = scripted(REWARDS.get)
    m = rl_step(trainer, fn, records(0, 1, 2, 3), rl_cfg(), LossConfig(), seed=1)
    assert m["filter/rejected_frac"] == 0.5 and m["filter/groups_trained"] == 2
    assert m["filter/rejected_all_correct_frac"] == 0.25 and m["filter/rejected_all_wrong_frac"] == 0.25
    # eq. 6's denominator holds only the mixed groups' tokens: G of each, one right and one wrong
    # (RoC keeps floor(2/2) = 1 negative and 1 positive of 2 + 2)
    assert m["train/tokens"] == pytest.approx(m["rollout/model_tokens_mean"] * 2 * G)
    assert m["rollout/accuracy"] == 0.5 and m["filter/updated"] == 1.0

    # the option to keep them: every group's G rollouts enter the batch (zero advantage for 0 and 1)
    keep = rl_step(trainer, fn, records(0, 1, 2, 3), rl_cfg(reject_equal_reward=False),
                   LossConfig(), seed=1)
    assert keep["filter/rejected_frac"] == 0.0 and keep["filter/groups_trained"] == 4
    assert keep["train/tokens"] > m["train/tokens"]


def test_no_group_left_means_no_update():
    tr = make_trainer()
    before = [np.asarray(x) for x in jax.tree.leaves(tr.state.params)]
    m = rl_step(tr, scripted(REWARDS.get), records(0, 1, 0, 1), rl_cfg(), LossConfig(), seed=2)
    assert tr.step == 0 and m["filter/updated"] == 0.0 and m["filter/rejected_frac"] == 1.0
    assert "train/loss" not in m
    for a, b in zip(jax.tree.leaves(tr.state.params), before):  # AdamW's momentum / decay did not move them
        np.testing.assert_array_equal(np.asarray(a), b)


def test_infrastructure_errors_are_excluded_from_the_update(trainer):
    """Problem 2 loses two rollouts to the infrastructure: RoC runs on the two left (= G, kept
    whole); problem 3 loses three: fewer than G left, the group is dropped and counted."""
    infra = {(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)}
    fn = scripted(REWARDS.get, lambda p, j: FinishReason.ERROR if (p, j) in infra else FinishReason.ANSWERED)
    m = rl_step(trainer, fn, records(2, 3, 0, 1), rl_cfg(), LossConfig(), seed=3)
    assert m["filter/infra_trajectories"] == 5 and m["filter/infra_short_groups"] == 1
    assert m["filter/groups_trained"] == 1 and m["filter/rejected_frac"] == 0.5  # 0 and 1: equal rewards
    assert m["train/tokens"] == response_len(2, 2) + response_len(2, 3)  # the two valid rollouts of problem 2
    assert m["rollout_all/error_finish_ratio"] == pytest.approx(5 / 16)


def test_dr_grpo_uses_its_constant_denominator(trainer):
    """Dr. GRPO divides by the configured sequences x max response length, whatever the lengths."""
    cfg = rl_cfg()
    m = rl_step(trainer, scripted(REWARDS.get), records(0, 1, 2, 3), cfg, LossConfig(advantage_estimator="dr_grpo"),
                seed=4)
    assert m["train/tokens"] == 4 * G * cfg.max_response_len
    assert m["train/token_frac"] < 1.0  # the real tokens are a fraction of it


def test_grpo_baseline_samples_and_trains_group_size_rollouts(trainer):
    calls = []
    cfg = rl_cfg(roc=False, oversample=32)
    m = rl_step(trainer, scripted(lambda p: [1, 0] * 16, calls=calls), records(2, 3, 4, 5), cfg,
                LossConfig(), seed=5)
    assert calls == [G]  # G rollouts per prompt, not oversample
    assert m["train/tokens"] == sum(response_len(p, j) for p in (2, 3, 4, 5) for j in range(G))



_log_softmax_forward = jax.jit(lambda state, ids, graphdef: jax.nn.log_softmax(
    nnx.merge(graphdef, state)(ids)[0], axis=-1), static_argnums=(2,))


def exact_sampler(trainer, rewards_of, shift_of=lambda p, j: {}):
    """A rollout function whose log-probs are the trainer's current policy's own (a float32
    sampler with nothing wrong), except that rollout j of problem p shifts the log-prob of
    response token k by ``shift_of(p, j)[k]`` (a sampler that saw another context there)."""

    def fn(records, n, seed, version):
        graphdef, state = nnx.split(trainer.model())
        out = []
        for g, rec in enumerate(records):
            p = int(rec["problem"].split()[-1])
            rng = np.random.default_rng([p, seed])
            for j in range(n):
                prompt = np.array([5, 6, 7], np.int32)
                response = rng.integers(1, 400, response_len(p, j)).astype(np.int32)
                ids = np.zeros(16, np.int32)  # one shape; causal: the padding after is never seen
                ids[: len(prompt) + len(response)] = np.concatenate([prompt, response])
                lp_all = np.asarray(_log_softmax_forward(state, jnp.asarray(ids[None]), graphdef))
                lp = lp_all[np.arange(len(response)) + len(prompt) - 1, response].copy()
                for k, delta in shift_of(p, j).items():
                    lp[k] += delta
                out.append(Trajectory(prompt_ids=prompt,
                                      segments=[Segment(SegmentKind.MODEL, response, lp)],
                                      turns=1, answer_tags=1, finish=FinishReason.ANSWERED,
                                      reward=float(rewards_of(p)[j]), group_id=g, policy_version=version))
        return out

    return fn


def _alarms(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "logprob_gap_tokens_over" in r.getMessage()]


def test_log_prob_gap_alarm_counts_the_off_tokens_and_names_their_prompts(caplog):
    """rl_step with a serving dtype: the trained tokens whose sampler log-prob is off count in
    ``train/logprob_gap_tokens_over``; a float32 run warns with the step and their prompts only."""
    shifts = {(3, 0): {0: 2.0, 1: -0.5}, (3, 1): {2: 1.5}}  # problem 3: 3 tokens off
    cfg = rl_cfg(roc=False)  # every sampled rollout is trained: the count is known
    tr = make_trainer()
    off = exact_sampler(tr, REWARDS.get, lambda p, j: shifts.get((p, j), {}))
    with caplog.at_level("WARNING", logger="rstarjax.rl.step"):
        m = rl_step(tr, off, records(2, 3), cfg, LossConfig(), seed=6, serving_dtype="float32")
    assert m["train/logprob_gap_tokens_over"] == 3.0
    [alarm] = _alarms(caplog)
    assert alarm.startswith(f"step {tr.step}: 3 trained tokens") and "'problem 3'" in alarm
    assert "'problem 2'" not in alarm

    caplog.clear()  # bf16 serving: 1 nat; the count goes on, the warning does not
    with caplog.at_level("WARNING", logger="rstarjax.rl.step"):
        m = rl_step(tr, off, records(2, 3), cfg, LossConfig(), seed=6, serving_dtype="bfloat16")
    assert m["train/logprob_gap_tokens_over"] == 2.0  # 2.0 and 1.5 nats; not 0.5
    assert not _alarms(caplog)

    with caplog.at_level("WARNING", logger="rstarjax.rl.step"):  # an exact sampler: nothing
        m = rl_step(tr, exact_sampler(tr, REWARDS.get), records(2, 3), cfg, LossConfig(), seed=6,
                    serving_dtype="float32")
    assert m["train/logprob_gap_tokens_over"] == 0.0 and m["train/logprob_gap_max"] < 1e-4
    assert not _alarms(caplog)
    m = rl_step(tr, exact_sampler(tr, REWARDS.get), records(2, 3), cfg, LossConfig(), seed=6)
    assert "train/logprob_gap_tokens_over" not in m  # no serving dtype, no threshold


def test_log_prob_gap_thresholds_by_serving_dtype():
    from rstarjax.rl.metrics import logprob_gap_threshold, trajectories_at
    from rstarjax.rl.batch import Placement

    assert logprob_gap_threshold("float32") < logprob_gap_threshold("float16") < logprob_gap_threshold("bfloat16")
    assert logprob_gap_threshold(jnp.bfloat16) == logprob_gap_threshold("bfloat16")
    with pytest.raises(ValueError, match="float64"):
        logprob_gap_threshold("float64")
    placements = [Placement(0, 0, 10, False), Placement(0, 10, 5, False), Placement(1, 0, 8, False)]
    assert trajectories_at(placements, np.array([[0, 12], [1, 7]])) == [1, 2]
    assert trajectories_at(placements, np.array([[0, 15], [2, 0]])) == []  # past every placement

def run_config(workdir, total_steps, **rl):
    return tiny_rl_config(os.path.join(workdir, "train.jsonl"), total_steps, **{
        "data.shuffle": False, "rl.group_size": G, "rl.oversample": 2 * G, "rl.max_prompt_len": 4,
        **{f"rl.{k}": v for k, v in rl.items()}, "trainer.micro_batch_size": 0})


@pytest.mark.slow  # two run_rl calls, each compiling its step: ~25 s alone, a minute on shared cores
def test_the_loop_skips_fully_rejected_batches_and_stops_when_nothing_is_left(tmp_path, monkeypatch):
    """A batch with no group left is not a step: the loop draws the next one (the official trainer
    does the same); past ``max_rejected_batches`` in a row the stage ends (the tests below)."""
    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path)
    with open(os.path.join(workdir, "train.jsonl"), "w") as f:
        for p in (0, 1, 0, 2, 1, 0, 3, 2):  # batches: {0, 1} rejected, {0, 2} trained, {1, 0}, {3, 2}
            f.write(json.dumps({"problem": f"problem {p}", "answer": str(p)}) + "\n")
    tr = run_rl(parse(run_config(workdir, 2)), workdir, rollout_fn=scripted(REWARDS.get))
    assert tr.step == 2
    recs = [json.loads(x) for x in open(os.path.join(workdir, "logs", "metrics.jsonl"))]
    assert [r["step"] for r in recs] == [1, 2]
    assert [r["filter/rejected_batches"] for r in recs] == [1, 1]


def _stuck_data(workdir):
    with open(os.path.join(workdir, "train.jsonl"), "w") as f:  # problem 0 all-correct, 1 all-wrong
        f.write("".join(json.dumps({"problem": f"problem {p}", "answer": "0"}) + "\n" for p in (0, 1)))


def test_a_streak_of_equal_reward_groups_ends_the_stage_cleanly(tmp_path, monkeypatch, capsys):
    """Batches whose groups were all-wrong or all-correct, none short of rollouts by an
    infrastructure error, are the data and the policy, not a failure (issue 47): past
    ``max_rejected_batches`` in a row the stage says which share was which and returns (the demo
    then evaluates; ``rstarjax.main`` exits 0)."""
    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path)
    _stuck_data(workdir)
    tr = run_rl(parse(run_config(workdir, 2, max_rejected_batches=3)), workdir, rollout_fn=scripted(REWARDS.get))
    assert tr.step == 0
    out = capsys.readouterr().out
    assert "nothing left to learn at step 0" in out and "in 3 batches in a row" in out
    assert "(50% all-wrong, 50% all-correct; no infrastructure error)" in out
    # nothing trained, but the policy it started from is kept for the next stage's init_from
    assert "No step was trained; the policy it started from is saved as step 0" in out
    assert [d for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()] == ["0"]
    # and the next stage starts from it (it found no checkpoint: "did the previous stage save one?")
    nxt = run_config(str(tmp_path / "next"), 2, max_rejected_batches=3)
    nxt.checkpoint.init_from = os.path.join(workdir, "checkpoints")
    os.makedirs(tmp_path / "next")
    _stuck_data(str(tmp_path / "next"))
    run_rl(parse(nxt), str(tmp_path / "next"), rollout_fn=scripted(REWARDS.get))
    assert "fresh at step 0 from step 0 of " in capsys.readouterr().out


def test_a_streak_short_of_rollouts_by_infrastructure_errors_stops_the_run(tmp_path, monkeypatch):
    """Only groups left short of rollouts by infrastructure errors point at a broken environment:
    that streak stops the run as the rollouts' infrastructure failing (``RolloutsFailed``: the
    last finished step saved, one line, exit 1), never blamed on the data or the policy."""
    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path)
    _stuck_data(workdir)
    from rstarjax.rl.trajectory import FinishReason as Finish

    broken = scripted(REWARDS.get, finish_of=lambda p, j: Finish.ERROR if p == 1 else Finish.ANSWERED)
    from rstarjax.rl.trajectory import RolloutsFailed

    with pytest.raises(RolloutsFailed, match="3 rollout batches in a row left no group to train on at step 1, "
                                             "with rollouts lost to infrastructure errors"):
        run_rl(parse(run_config(workdir, 2, max_rejected_batches=3)), workdir, rollout_fn=broken)


def test_a_policy_that_answers_every_rollout_right_ends_the_stage_cleanly(tmp_path, monkeypatch, capsys):
    """A streak of batches rejected only because every group was all-correct is a solved data set,
    not a failure: the stage saves its last step, says why it stopped, and returns (the demo then
    evaluates). One all-wrong group in the streak keeps the error (test above)."""
    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path)
    with open(os.path.join(workdir, "train.jsonl"), "w") as f:
        for p in range(2, 10):  # one trained batch {2, 3}, then only all-correct groups
            f.write(json.dumps({"problem": f"problem {p}", "answer": str(p)}) + "\n")
    cfg = parse(run_config(workdir, 5, max_rejected_batches=3))
    tr = run_rl(cfg, workdir, rollout_fn=scripted(lambda p: REWARDS.get(p, [1] * 2 * G)))
    assert tr.step == 1
    assert "answered every rollout right in 3 batches in a row at step 1" in capsys.readouterr().out
    ckpt_dir = os.path.join(workdir, "checkpoints")
    assert sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) == [1]


def test_a_bf16_trainer_beside_a_float32_engine_is_judged_at_bf16s_threshold(caplog):
    """The gap's precision is the coarser side's: a trainer computing in bf16 (model.dtype or
    trainer.compute_dtype) rounds its own matmuls, so a float32 engine's rollouts are judged at
    bf16's 1 nat and raise no "different context" warning (the tiny stage-1 run had 1 and 6
    tokens over 0.01 on rounding alone)."""
    from rstarjax.rl.metrics import gap_threshold_of

    assert gap_threshold_of("float32", ("float32",)) == 0.01
    assert gap_threshold_of("float32", ("bfloat16",)) == gap_threshold_of("float32", ("float32", "bfloat16")) == 1.0
    assert gap_threshold_of("bfloat16", ()) == 1.0
    shifts = {(3, 0): {0: 0.5}}  # 0.5 nats off: over float32's 0.01, under bf16's 1
    cfg = rl_cfg(roc=False)
    tr = make_trainer()
    tr.forward_dtypes = ("float32", "bfloat16")  # a trainer.compute_dtype=bfloat16 run's
    off = exact_sampler(tr, REWARDS.get, lambda p, j: shifts.get((p, j), {}))
    with caplog.at_level("WARNING", logger="rstarjax.rl.step"):
        m = rl_step(tr, off, records(2, 3), cfg, LossConfig(), seed=6, serving_dtype="float32")
    assert m["train/logprob_gap_tokens_over"] == 0.0 and not _alarms(caplog)
    assert make_trainer().forward_dtypes == ("float32",)  # the tiny model computes in float32

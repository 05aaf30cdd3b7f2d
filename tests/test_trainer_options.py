"""Trainer options off by default: the k3 KL term to a frozen reference policy, the stage-3
reference switch (checkpoint.update_reference), and DAPO dynamic sampling in the RL loop."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_trainer import leaves, random_batch, reference_loss, tiny_model  # noqa: E402
from tiny_run import tiny_rl_config  # noqa: E402

from rstarjax.io import checkpoint as ckpt_lib  # noqa: E402
from rstarjax.models import sharding as sharding_lib  # noqa: E402
from rstarjax.recipes import rl as rl_recipe  # noqa: E402
from rstarjax.recipes.config import RunConfig, parse  # noqa: E402
from rstarjax.rl import optim as optim_lib  # noqa: E402
from rstarjax.rl import trainer as trainer_lib  # noqa: E402
from rstarjax.rl.loss import LossConfig  # noqa: E402

KL = 0.3


def direct_logprobs(model, batch):
    logits = model(jnp.asarray(batch["tokens"]), positions=jnp.asarray(batch["positions"]),
                   segment_ids=jnp.asarray(batch["segment_ids"]))
    logp_all = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logp_all, jnp.asarray(batch["tokens"])[:, 1:, None], axis=-1)[..., 0]


def direct_kl_loss(model, ref_logp, batch):
    """eq. 6 + kl_coef * k3, the k3 estimator written out (Schulman 2020):
    KL(pi || pi_ref) ~ pi_ref/pi - log(pi_ref/pi) - 1 per sampled token, token-mean over the batch."""
    logp = direct_logprobs(model, batch)
    mask = jnp.asarray(batch["loss_mask"])[:, 1:]
    log_q_over_p = ref_logp - logp
    k3 = jnp.exp(log_q_over_p) - log_q_over_p - 1.0
    kl = jnp.sum(k3 * mask) / jnp.sum(mask)
    return reference_loss(model, batch) + KL * kl, kl


@pytest.mark.slow
def test_kl_term_loss_and_gradient_equal_a_direct_reference_forward():
    batch = random_batch(4)
    ref_model = tiny_model(seed=1)  # a reference different from the policy, so KL and its gradient are non-zero
    ref_logp = jax.lax.stop_gradient(direct_logprobs(ref_model, batch))
    graphdef, params, rest = nnx.split(tiny_model(), nnx.Param, ...)
    (want_loss, want_kl), grads = jax.jit(jax.value_and_grad(
        lambda p: direct_kl_loss(nnx.merge(graphdef, p, rest), ref_logp, batch), has_aux=True))(params)
    want_params = jax.tree.map(lambda p, g: p - g, params, grads)  # SGD, lr 1
    # the KL part of the gradient is a real contribution (the test could fail without it)
    pg_grads = jax.jit(jax.grad(lambda p: reference_loss(nnx.merge(graphdef, p, rest), batch)))(params)
    assert max(float(np.abs(a - b).max()) for a, b in zip(leaves(grads), leaves(pg_grads))) > 1e-4

    mesh = sharding_lib.make_mesh(1, 2, 1, devices=jax.devices()[:2])
    tr = trainer_lib.Trainer(tiny_model(), None, LossConfig(kl_coef=KL),
                             trainer_lib.TrainerConfig(micro_batch_size=4, recompute_old_logprobs=False),
                             mesh=mesh, optimizer=optax.sgd(1.0))
    # by default the reference is a copy of the initial policy
    for a, b in zip(leaves(tr.ref_params), leaves(params)):
        np.testing.assert_array_equal(a, b)
    _, ref_params, _ = nnx.split(ref_model, nnx.Param, ...)
    tr.set_reference(ref_params)
    m = tr.train(batch)
    assert m["train/kl_ref"] == pytest.approx(float(want_kl), rel=1e-4) and float(want_kl) > 1e-3
    assert m["train/loss"] == pytest.approx(float(want_loss), rel=1e-4, abs=1e-6)
    for got, want, g in zip(leaves(tr.state.params), leaves(want_params), leaves(grads)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * max(1.0, np.abs(g).max()))
    # the update (which donates the train state) left the frozen reference untouched
    for a, b in zip(leaves(tr.ref_params), leaves(ref_params)):
        np.testing.assert_array_equal(a, b)

    # without the KL term no reference copy is held at all
    plain = trainer_lib.Trainer(tiny_model(), None, LossConfig(), trainer_lib.TrainerConfig(), mesh=mesh,
                                optimizer=optax.sgd(1.0))
    assert plain.ref_params is None
    with pytest.raises(ValueError, match="kl_coef > 0"):
        plain.set_reference()


def _stage_config(init_from, update_reference, kl_coef=KL):
    return RunConfig(loss=LossConfig(kl_coef=kl_coef),
                     checkpoint=ckpt_lib.CheckpointConfig(init_from=init_from, reset_optimizer=True,
                                                          update_reference=update_reference))


def test_update_reference_switches_the_reference_and_is_rebuilt_on_resume(tmp_path):
    mesh = sharding_lib.make_mesh(1, 2, 1, devices=jax.devices()[:2])

    def make():
        return trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(), LossConfig(kl_coef=KL),
                                   trainer_lib.TrainerConfig(), mesh=mesh)

    prev = make()  # a "trained" stage 2 saved at step 7 (and an older step 5 with other params)
    src = str(tmp_path / "stage2")
    with ckpt_lib.Checkpointer(src) as ck:
        ck.save(5, trainer_lib.TrainState(jax.tree.map(lambda x: x - 1.0, prev.state.params),
                                          prev.state.opt_state, prev.state.step + 5), {"step": 5})
        ck.save(7, trainer_lib.TrainState(jax.tree.map(lambda x: x + 1.0, prev.state.params),
                                          prev.state.opt_state, prev.state.step + 7), {"step": 7})
    initial = leaves(prev.state.params)
    stage2 = [x + 1.0 for x in initial]

    # stage 3 with update_reference: reference := the stage-2 policy it starts from
    nxt = make()
    own = ckpt_lib.Checkpointer(str(tmp_path / "stage3"))
    meta = rl_recipe.initial_state(nxt, own, _stage_config(src, True))
    own.close()
    record = rl_recipe.setup_reference(nxt, _stage_config(src, True), meta)
    assert record == {"source": "init_from", "path": os.path.abspath(src), "step": 7}
    for a, b in zip(leaves(nxt.ref_params), stage2):
        np.testing.assert_array_equal(a, b)

    # without it the reference stays the initial (base) model, while the policy is stage 2's
    nxt = make()
    own = ckpt_lib.Checkpointer(str(tmp_path / "stage3b"))
    meta = rl_recipe.initial_state(nxt, own, _stage_config(src, False))
    own.close()
    assert rl_recipe.setup_reference(nxt, _stage_config(src, False), meta) == {"source": "initial"}
    for a, b, c in zip(leaves(nxt.ref_params), initial, leaves(nxt.state.params)):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)

    # resume (a checkpoint of this stage whose meta holds the record): the same reference is rebuilt
    # from the recorded step, even after the source gained a newer checkpoint
    with ckpt_lib.Checkpointer(src) as ck:
        ck.save(9, trainer_lib.TrainState(jax.tree.map(lambda x: x + 5.0, prev.state.params),
                                          prev.state.opt_state, prev.state.step + 9), {"step": 9})
    resumed = make()
    got = rl_recipe.setup_reference(resumed, _stage_config(src, True), {"step": 12, "reference": record})
    assert got == record
    for a, b in zip(leaves(resumed.ref_params), stage2):
        np.testing.assert_array_equal(a, b)
    # no KL: nothing to choose, nothing held
    c = _stage_config(src, True, kl_coef=0.0)
    assert rl_recipe.setup_reference(make(), c, {}) is None


# ------------------------------------------------------------------ DAPO dynamic sampling
INFORMATIVE = {1, 2, 4, 6, 7, 8, 19}  # problems whose rollouts disagree; all others are all-equal


def response_len(i):
    return 1 + (3 * i) % 7


def scripted_rollout_fn(calls):
    from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, Trajectory

    def fn(records, n, seed, version):
        ids = [int(r["problem"].split()[-1]) for r in records]
        calls.append((ids, seed, version))
        out = []
        for g, i in enumerate(ids):
            rng = np.random.default_rng([i, seed])
            for j in range(n):
                reward = float(j % 2 == 0) if i in INFORMATIVE else float(i % 2)
                k = response_len(i)
                out.append(Trajectory(
                    prompt_ids=np.array([5, 6, 7], np.int32),
                    segments=[Segment(SegmentKind.MODEL, rng.integers(1, 400, k), -rng.random(k) - 0.1)],
                    turns=1, answer_tags=1, finish=FinishReason.ANSWERED, reward=reward, group_id=g,
                    policy_version=version))
        return out

    return fn


def ds_config(workdir, total_steps):
    return tiny_rl_config(os.path.join(workdir, "train.jsonl"), total_steps, in_process=False, **{
        "data.shuffle": False, "rl.prompts_per_step": 4, "rl.max_prompt_len": 4, "rl.dynamic_sampling_max_rounds": 3,
        "rl.dynamic_sampling": True, "trainer.micro_batch_size": 8, "checkpoint.every_steps": 1,
        "checkpoint.async_save": False, "logging.tensorboard": False})


@pytest.mark.slow
def test_dynamic_sampling_drops_refills_and_stops_at_the_bound(tmp_path):
    workdir = str(tmp_path)
    with open(os.path.join(workdir, "train.jsonl"), "w") as f:
        for i in range(24):
            f.write(json.dumps({"problem": f"problem {i}", "answer": str(i)}) + "\n")
    calls = []
    config = ds_config(workdir, 2)
    run = parse(config, num_devices=jax.device_count())
    rl_recipe.run_rl(run, workdir, rollout_fn=scripted_rollout_fn(calls))

    # step 1: {0..3} gives 2 informative groups (1, 2) -> refill {4..7} gives 3 more -> quota of 4 met.
    # step 2: {8..11} -> 1, {12..15} -> 0, {16..19} -> 1: the third round is the bound, stop short.
    assert [c[0] for c in calls] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15],
                                     [16, 17, 18, 19]]
    assert calls[0][1] != calls[1][1] and calls[2][1] != calls[3][1] != calls[4][1]  # fresh samples per round
    assert [c[2] for c in calls] == [0, 0, 1, 1, 1]  # every round of a step samples the same policy
    recs = [json.loads(x) for x in open(os.path.join(workdir, "logs", "metrics.jsonl"))]
    s1, s2 = recs
    assert (s1["dynamic_sampling/rounds"], s1["dynamic_sampling/groups_dropped"],
            s1["dynamic_sampling/groups_trained"], s1["dynamic_sampling/groups_padded"],
            s1["dynamic_sampling/groups_surplus"]) == (2, 3, 4, 0, 1)  # 0, 3, 5 dropped; 7 surplus
    assert (s2["dynamic_sampling/rounds"], s2["dynamic_sampling/groups_dropped"],
            s2["dynamic_sampling/groups_trained"], s2["dynamic_sampling/groups_padded"]) == (3, 10, 2, 2)
    # the batch held exactly the kept informative groups' tokens (G rollouts each), padding none
    g = config.rl.group_size
    assert s1["train/tokens"] == g * sum(response_len(i) for i in (1, 2, 4, 6))
    assert s2["train/tokens"] == g * sum(response_len(i) for i in (8, 19))
    assert s1["train/grad_norm"] > 0 and s2["train/grad_norm"] > 0

    # resume for one more step: the data iterator continues after every prompt the refills consumed
    calls.clear()
    rl_recipe.run_rl(parse(ds_config(workdir, 3)), workdir, rollout_fn=scripted_rollout_fn(calls))
    # (the policy version counts this process's weight sets: Trainer.policy_version, from 0)
    assert calls[0][0] == [20, 21, 22, 23] and calls[0][2] == 0

"""Runs that survive what clusters do to them (issue #32): a diverging update, preemption
signals, a corrupt newest checkpoint, bad or over-long data rows, finite data running out,
values that pass the checks but break the run, leaks after a kill, the policy server's exposure.

The signal tests run a tiny stage 1 (``tests/test_stages.py``'s model, problems and sizes; the
real engine, code pool and verifier) in a subprocess: this file is also that worker
(``python tests/test_reliability.py WORKDIR OVERRIDES_JSON``).
"""
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _one_device_trainer(layers=1, **trainer_options):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.models import ModelConfig, Qwen3
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.rl import optim as optim_lib
    from rstarjax.rl import trainer as trainer_lib
    from rstarjax.rl.loss import LossConfig

    model = Qwen3(ModelConfig.preset("tiny", dtype=jnp.float32, num_hidden_layers=layers), rngs=nnx.Rngs(0))
    return trainer_lib.Trainer(model, optim_lib.OptimConfig(learning_rate=1e-3, warmup_steps=0), LossConfig(),
                               trainer_lib.TrainerConfig(**trainer_options),
                               mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ============================================================================ 1. non-finite updates
def test_a_non_finite_update_is_skipped_and_counted():
    """A nan in the batch makes the loss nan: the jitted step keeps params and optimizer state,
    advances the step and says so in its metrics; the next finite batch trains as usual."""
    from test_trainer import random_batch

    tr = _one_device_trainer(recompute_old_logprobs=False)
    params, opt = _leaves(tr.state.params), _leaves(tr.state.opt_state)
    bad = random_batch()
    bad["advantages"][0, bad["loss_mask"][0] > 0] = np.nan
    m = tr.train(bad)
    assert m["train/skipped_nonfinite"] == 1.0 and not np.isfinite(m["train/loss"]) and tr.step == 1
    for a, b in zip(_leaves(tr.state.params) + _leaves(tr.state.opt_state), params + opt):
        np.testing.assert_array_equal(a, b)
    m = tr.train(random_batch(1))
    assert m["train/skipped_nonfinite"] == 0.0 and np.isfinite(m["train/update_norm"]) and tr.step == 2
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(tr.state.params), params))


def test_a_checkpoint_of_non_finite_params_is_refused(tmp_path):
    import jax

    from rstarjax.io import checkpoint as ckpt_lib

    tr = _one_device_trainer()
    state = jax.tree.map(lambda x: x, tr.state)
    state.params = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.inf) if x.dtype.kind == "f" else x,
                                state.params)
    with ckpt_lib.Checkpointer(str(tmp_path / "c"), ckpt_lib.CheckpointConfig(async_save=False)) as ck:
        with pytest.raises(ckpt_lib.NonFiniteState, match="checkpoint 5 not written"):
            ck.save(5, state, {"step": 5})
        assert ck.all_steps() == []


def _scripted_run(tmp_path, total_steps, rows=8, **overrides):
    """``run_rl`` on the tiny preset with test_checkpoint's deterministic rollouts, in this
    process on one device: (config, workdir). ``overrides``: "section.key" -> value."""
    import base

    from test_checkpoint import write_data

    workdir = str(tmp_path / "run")
    write_data(workdir, rows)
    c = base.get_config()
    c.total_steps = total_steps
    c.model.preset, c.model.random_init, c.model.dtype, c.model.remat_policy = "tiny", True, "float32", "none"
    c.data.train_path = os.path.join(workdir, "train.jsonl")
    c.rl.prompts_per_step, c.rl.group_size, c.rl.oversample = 2, 2, 4
    c.rl.max_prompt_len, c.rl.max_response_len = 8, 8
    c.optim.learning_rate, c.optim.warmup_steps = 1e-3, 0
    c.trainer.micro_batch_size = 0
    c.checkpoint.every_steps, c.checkpoint.keep, c.checkpoint.async_save = 1, 10, False
    c.logging.progress_bar, c.logging.tensorboard = False, False
    c.mesh.fsdp = 1
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(c, section), name, value)
    return c, workdir


@pytest.fixture
def one_device(monkeypatch):
    import jax

    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build

    monkeypatch.setattr(build, "mesh", lambda c: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))


def test_a_diverging_run_stops_naming_step_and_quantity_and_saves_only_finite_params(tmp_path, one_device):
    """With a learning rate that diverges (1e12: step 1's update is finite and huge, every
    gradient after it nan), the steps after it are skipped, the run stops after
    ``trainer.max_nonfinite_steps`` of them in a row naming the steps and the quantity, and
    every checkpoint on disk holds finite parameters."""
    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.io.metrics_log import read_metrics
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import NonFiniteTraining, run_rl
    from test_checkpoint import fake_rollout_fn

    c, workdir = _scripted_run(tmp_path, 6, **{"optim.learning_rate": 1e12, "trainer.max_nonfinite_steps": 2})
    with pytest.raises(NonFiniteTraining, match=r"steps 2-3: 2 updates in a row were not finite, the last with "
                                                r"grad_norm=nan.*parameters are still those of step 1"):
        run_rl(parse(c), workdir, rollout_fn=fake_rollout_fn)
    recs = read_metrics(os.path.join(workdir, "logs", "metrics.jsonl"))
    assert [(r["step"], r["train/skipped_nonfinite"]) for r in recs] == [(1, 0.0), (2, 1.0), (3, 1.0)]
    tr = _one_device_trainer(layers=2)  # the tiny preset's shapes
    with ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints")) as ck:
        assert ck.all_steps() == [1, 2]  # step 3 stopped the run before its save
        for step in ck.all_steps():
            params, _, _ = ckpt_lib.restore_params(ck.directory, ckpt_lib.abstract_like(tr.state.params), step)
            assert all(np.isfinite(x).all() for x in _leaves(params)), step

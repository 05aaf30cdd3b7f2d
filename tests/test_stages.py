"""The recipe as users chain it: SFT -> stage 1 -> stage 2 -> filter -> stage 3 -> export -> eval.

* ``initial_state``'s hand-off rules, one by one (SFT checkpoint: params only; RL stage: params +
  optimizer + step, or a fresh optimizer with ``reset_optimizer``; a workdir of another stage is
  refused);
* a scripted chain through ``run_rl`` (fast): step counts, warmup, data order per stage and the
  rollout engine's weights before the first rollout of every stage;
* the real chain (slow) through ``rstarjax.main.run`` with the shipped configs, a tiny HF model,
  the real engine, sandbox and verifier, in a subprocess with one CPU device: this file is also
  its worker (``python tests/test_stages.py chain WORKDIR``);
* every shipped config starts (builds its code executor and rollout engine) with only the
  overrides a user must give (model, data) and sizes.
"""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from process_support import worker_env
from tiny_run import tiny_rl_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

TOKENS = 4000  # small-vocabulary Qwen BPE of the tiny models here (prompts of ~600 tokens)


# ============================================================================ hand-off rules
def _trainer(lr=1e-3, warmup=2, layers=1):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.models import ModelConfig, Qwen3
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.rl import optim as optim_lib
    from rstarjax.rl import trainer as trainer_lib
    from rstarjax.rl.loss import LossConfig

    model = Qwen3(ModelConfig.preset("tiny", dtype=jnp.float32, num_hidden_layers=layers), rngs=nnx.Rngs(0))
    return trainer_lib.Trainer(model, optim_lib.OptimConfig(learning_rate=lr, warmup_steps=warmup),
                               LossConfig(), trainer_lib.TrainerConfig(),
                               mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))


def _save_trained(tr, directory, step, meta):
    """A previous stage's checkpoint: shifted params, non-zero moments, ``step``."""
    import jax
    import jax.numpy as jnp

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.rl import trainer as trainer_lib

    state = trainer_lib.TrainState(
        jax.tree.map(lambda x: x + 0.5, tr.state.params),
        jax.tree.map(lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.floating) else x + step, tr.state.opt_state),
        tr.state.step + step)
    with ckpt_lib.Checkpointer(directory) as ck:
        ck.save(step, state, meta)
    return state


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _stage_config(init_from="", reset=False):
    from rstarjax.io.checkpoint import CheckpointConfig
    from rstarjax.recipes.config import RunConfig

    return RunConfig(checkpoint=CheckpointConfig(init_from=init_from, reset_optimizer=reset))


def test_sft_checkpoint_hands_over_params_only(tmp_path):
    """SFT -> stage 1: the SFT policy's params; step 0 and a fresh optimizer (its LR warmup runs),
    whatever step and moments the SFT run ended with."""
    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import rl as rl_recipe

    sft = _save_trained(_trainer(), str(tmp_path / "sft"), 50, {"stage": "sft", "total_steps": 50})
    tr = _trainer()
    fresh_opt = _leaves(tr.state.opt_state)
    own = ckpt_lib.Checkpointer(str(tmp_path / "stage1"))
    meta = rl_recipe.initial_state(tr, own, _stage_config(str(tmp_path / "sft")))
    own.close()
    assert tr.step == 0 and meta["stage_start_step"] == 0 and meta["init_from_stage"] == "sft"
    for a, b in zip(_leaves(tr.state.params), _leaves(sft.params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(tr.state.opt_state), fresh_opt):
        np.testing.assert_array_equal(a, b)


def test_an_sft_checkpoint_of_another_chat_format_is_refused(tmp_path):
    """SFT -> RL: the SFT run's chat format (its meta's ``chat_format``; an older checkpoint
    without it was the rStar2 format, ``build.model_meta``'s default) must be the stage's
    ``rl.chat_format``: the policy learned that format's prompts, tool name and layout. Before,
    RL with another format started silently."""
    import dataclasses

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import rl as rl_recipe
    from rstarjax.recipes.config import RLConfig
    from rstarjax.validation import StageError

    def start(sft_meta, rl_format, name):
        _save_trained(_trainer(), str(tmp_path / name / "sft"), 5, {"stage": "sft", "total_steps": 5, **sft_meta})
        run = dataclasses.replace(_stage_config(str(tmp_path / name / "sft")), rl=RLConfig(chat_format=rl_format))
        own = ckpt_lib.Checkpointer(str(tmp_path / name / "stage1"))
        try:
            return rl_recipe.initial_state(_trainer(), own, run)
        finally:
            own.close()

    with pytest.raises(StageError, match=r"is an SFT run on chat_format 'compact', and this stage has "
                                         r"--config\.rl\.chat_format='rstar2_official': run RL with "
                                         r"--config\.rl\.chat_format=compact \(or the SFT again with "
                                         r"--config\.sft\.chat_format=rstar2_official\)"):
        start({"chat_format": "compact"}, "rstar2_official", "a")
    with pytest.raises(StageError, match="an SFT run on chat_format 'rstar2'"):  # older: the rStar2 format
        start({}, "compact", "b")
    assert start({"chat_format": "compact"}, "compact", "c")["init_from_stage"] == "sft"


def test_rl_checkpoint_hands_over_params_optimizer_and_step(tmp_path):
    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import rl as rl_recipe

    s1 = _save_trained(_trainer(), str(tmp_path / "s1"), 300, {"step": 300, "stage": "rl", "init_from": ""})
    for reset in (False, True):
        tr = _trainer()
        fresh_opt = _leaves(tr.state.opt_state)
        own = ckpt_lib.Checkpointer(str(tmp_path / f"s2_{reset}"))
        meta = rl_recipe.initial_state(tr, own, _stage_config(str(tmp_path / "s1"), reset))
        own.close()
        assert tr.step == 300 and meta["stage_start_step"] == 300 and meta["init_from_stage"] == "rl"
        for a, b in zip(_leaves(tr.state.params), _leaves(s1.params)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(_leaves(tr.state.opt_state), fresh_opt if reset else _leaves(s1.opt_state)):
            np.testing.assert_array_equal(a, b)
        # a fresh optimizer restarts its schedule: the first update of stage 3 warms up again
        assert tr.learning_rate() == pytest.approx(1e-3 / 2 if reset else 1e-3)


@pytest.mark.parametrize("source", ["rl", "rl_reset", "sft"])
def test_a_handoff_past_a_damaged_newest_checkpoint_starts_from_the_newest_that_verifies(tmp_path, caplog, source):
    """The previous stage's newest checkpoint damaged (its largest array file cut): the hand-off
    (stage 1 -> 2 keeping the optimizer; stage 2 -> 3 resetting it; SFT -> stage 1) starts from
    the newest older one that verifies, with one warning naming the damaged one (docs/training.md
    "Fingerprints"). It crashed with Orbax's OUT_OF_RANGE traceback, or stopped."""
    import logging

    from test_checkpoint import damage

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import rl as rl_recipe

    stage = "sft" if source == "sft" else "rl"
    older = _save_trained(_trainer(), str(tmp_path / "prev"), 20, {"step": 20, "stage": stage, "total_steps": 30})
    _save_trained(_trainer(lr=2e-3), str(tmp_path / "prev"), 30, {"step": 30, "stage": stage, "total_steps": 30})
    damage(str(tmp_path / "prev" / "30"), "cut")
    tr = _trainer()
    own = ckpt_lib.Checkpointer(str(tmp_path / "next"))
    with caplog.at_level(logging.WARNING):
        meta = rl_recipe.initial_state(tr, own, _stage_config(str(tmp_path / "prev"), reset=source == "rl_reset"))
    own.close()
    assert meta["init_from_step"] == 20
    assert tr.step == (0 if source == "sft" else 20)
    for a, b in zip(_leaves(tr.state.params), _leaves(older.params)):
        np.testing.assert_array_equal(a, b)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and os.path.join(str(tmp_path / "prev"), "30") in warned[0], warned


def test_the_hf_weights_are_read_only_when_nothing_replaces_them(tmp_path):
    """A stage started from ``init_from`` or resuming its workdir overwrites every parameter, so
    its HF weights are not read (``build.policy(read_weights=False)``); a fresh stage, and any
    stage with a KL term (its "initial" reference is the policy as built), reads them."""
    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import rl as rl_recipe

    _save_trained(_trainer(), str(tmp_path / "resumed"), 3, {"step": 3, "stage": "rl"})
    fresh = ckpt_lib.Checkpointer(str(tmp_path / "fresh"))
    resumed = ckpt_lib.Checkpointer(str(tmp_path / "resumed"))
    try:
        assert not rl_recipe.checkpoint_replaces_weights(_stage_config(), fresh)
        assert rl_recipe.checkpoint_replaces_weights(_stage_config(str(tmp_path / "sft")), fresh)
        assert rl_recipe.checkpoint_replaces_weights(_stage_config(), resumed)
        config = _stage_config(str(tmp_path / "sft"))
        with_kl = dataclasses.replace(config, loss=dataclasses.replace(config.loss, kl_coef=0.01))
        assert not rl_recipe.checkpoint_replaces_weights(with_kl, resumed)
    finally:
        fresh.close()
        resumed.close()


def test_a_workdir_belongs_to_one_stage(tmp_path):
    """Re-running a stage in a workdir that holds another stage's checkpoints (e.g. stage 3 in
    stage 2's workdir) is refused instead of silently resuming the other stage's state."""
    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import rl as rl_recipe

    s2 = str(tmp_path / "s2" / "checkpoints")
    _save_trained(_trainer(), s2, 385, {"step": 385, "stage": "rl", "init_from": str(tmp_path / "s1")})
    with pytest.raises(rl_recipe.StageError, match="this run's own checkpoint directory"):
        own = ckpt_lib.Checkpointer(s2)
        try:
            rl_recipe.initial_state(_trainer(), own, _stage_config(s2, True))
        finally:
            own.close()
    other = str(tmp_path / "elsewhere")
    _save_trained(_trainer(), other, 385, {"step": 385, "stage": "rl"})
    own = ckpt_lib.Checkpointer(s2)
    with pytest.raises(rl_recipe.StageError, match="holds checkpoints of another run"):
        rl_recipe.initial_state(_trainer(), own, _stage_config(other, True))
    # the same stage again (same init_from): its own progress resumes
    tr = _trainer()
    meta = rl_recipe.initial_state(tr, own, _stage_config(str(tmp_path / "s1")))
    own.close()
    assert meta["resumed"] and tr.step == 385
    sft_dir = str(tmp_path / "sft")
    _save_trained(_trainer(), sft_dir, 7, {"stage": "sft"})
    own = ckpt_lib.Checkpointer(sft_dir)
    with pytest.raises(rl_recipe.StageError, match="SFT run's checkpoints"):
        rl_recipe.initial_state(_trainer(), own, _stage_config())
    own.close()


def test_each_stage_gets_its_own_data_order():
    from rstarjax.recipes.rl import stage_data_seed

    assert stage_data_seed(0, 0) == 0
    seeds = {stage_data_seed(0, s) for s in (0, 300, 385)}
    assert len(seeds) == 3 and stage_data_seed(0, 300) == stage_data_seed(0, 300)


# ============================================================================ scripted chain
def _scripted_config(workdir, total_steps, init_from="", reset=False, data="train.jsonl"):
    return tiny_rl_config(os.path.join(os.path.dirname(workdir), data), total_steps, **{
        "optim.learning_rate": 1e-3, "optim.warmup_steps": 2, "trainer.micro_batch_size": 0,
        "checkpoint.every_steps": 1, "checkpoint.init_from": init_from, "checkpoint.reset_optimizer": reset})


@pytest.mark.slow  # ~20 s alone, over a minute on 2 shared cores (three runs, each compiling its step)
def test_scripted_chain_steps_warmup_data_order_and_served_weights(tmp_path, monkeypatch):
    """SFT checkpoint -> stage 1 (2 steps) -> stage 2 (+2) -> stage 3 (+1, optimizer reset) through
    ``run_rl``: each stage trains its steps, the engine hook sees the restored weights before the
    first rollout, each stage reads its data in a new order, and warmup runs after each reset."""
    import jax

    from rstarjax.io.metrics_log import read_metrics
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl
    from test_checkpoint import fake_rollout_fn

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n")
    sft = str(tmp_path / "sft" / "checkpoints")
    sft_state = _save_trained(_trainer(layers=2), sft, 40, {"stage": "sft", "total_steps": 40})

    def run(name, total, init_from, reset=False):
        events = []  # ("update", params) when the engine hook runs, ("rollout", problems) per rollout call

        def rollout_fn(records, n, seed, version):
            events.append(("rollout", [r["problem"] for r in records], version))
            return fake_rollout_fn(records, n, seed, version)

        def on_update(tr):
            events.append(("update", _leaves(tr.state.params), tr.step))

        workdir = str(tmp_path / name)
        tr = run_rl(parse(_scripted_config(workdir, total, init_from, reset)), workdir,
                    rollout_fn=rollout_fn, on_update=on_update)
        recs = read_metrics(os.path.join(workdir, "logs", "metrics.jsonl"))
        return tr, events, recs

    def final_params(ckpt_dir):
        from rstarjax.io import checkpoint as ckpt_lib

        tr = _trainer(layers=2)
        params, _, _ = ckpt_lib.restore_params(ckpt_dir, ckpt_lib.abstract_like(tr.state.params, tr.param_sharding))
        return _leaves(params)

    previous = _leaves(sft_state.params)
    orders = []
    plan = [("s1", 2, sft, False, [1, 2]), ("s2", 4, "s1", False, [3, 4]), ("s3", 5, "s2", True, [5])]
    for name, total, init_from, reset, steps in plan:
        src = init_from if init_from == sft else str(tmp_path / init_from / "checkpoints")
        tr, events, recs = run(name, total, src, reset)
        assert [r["step"] for r in recs] == steps and tr.step == total  # the configured steps, no more
        first_update = events.index(next(e for e in events if e[0] == "update"))
        first_rollout = events.index(next(e for e in events if e[0] == "rollout"))
        assert first_update < first_rollout  # the engine got the restored weights first ...
        for a, b in zip(events[first_update][1], previous):  # ... and they are the previous stage's final ones
            np.testing.assert_array_equal(a, b)
        # the policy version: the stage's own count of published weights (Trainer.policy_version)
        assert [e[2] for e in events if e[0] == "rollout"] == list(range(len(steps)))
        # warmup (2 updates) after the SFT hand-off and after stage 3's reset; none in stage 2
        lr = [r["train/lr"] for r in recs]
        assert lr[0] == pytest.approx(1e-3 / 2 if name in ("s1", "s3") else 1e-3)
        orders.append([p for e in events if e[0] == "rollout" for p in e[1]])
        previous = final_params(str(tmp_path / name / "checkpoints"))
    assert orders[0][:4] != orders[1][:4]  # stage 2 does not replay stage 1's order
    # the RL checkpoints carry what export needs
    from rstarjax.io import checkpoint as ckpt_lib

    with ckpt_lib.Checkpointer(str(tmp_path / "s3" / "checkpoints")) as ck:
        meta = ck.read_meta()
    assert meta["model_config"]["num_hidden_layers"] == 2 and meta["stage_start_step"] == 4

    # stage 3's command in stage 2's workdir, with stage 2's own init_from (its command copied,
    # the config changed): the init_from check cannot tell, its resets and its data can
    from rstarjax.recipes.rl import StageError

    rows = open(tmp_path / "train.jsonl").readlines()
    (tmp_path / "hard.jsonl").write_text("".join(rows[:5]))  # a filtered set
    with pytest.raises(StageError, match="drew from other problems"):
        run_rl(parse(_scripted_config(str(tmp_path / "s2"), 6, str(tmp_path / "s1" / "checkpoints"), False,
                                      data="hard.jsonl")), str(tmp_path / "s2"), rollout_fn=fake_rollout_fn)
    with pytest.raises(StageError, match="checkpoint.reset_optimizer=False"):
        run_rl(parse(_scripted_config(str(tmp_path / "s2"), 6, str(tmp_path / "s1" / "checkpoints"), True)),
               str(tmp_path / "s2"), rollout_fn=fake_rollout_fn)
    # the same stage with its data moved (same problems, another file): it resumes (and, at its
    # total already, trains nothing)
    os.makedirs(tmp_path / "moved")
    (tmp_path / "moved" / "train.jsonl").write_text("".join(rows))
    tr = run_rl(parse(_scripted_config(str(tmp_path / "s2"), 4, str(tmp_path / "s1" / "checkpoints"), False,
                                       data="moved/train.jsonl")), str(tmp_path / "s2"), rollout_fn=fake_rollout_fn)
    assert tr.step == 4


# ============================================================================ the real chain
def _tiny_hf_model(path):
    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.models import ModelConfig, Qwen3, load_tokenizer, save_hf

    tok = load_tokenizer(TOKENS)
    cfg = ModelConfig.preset("tiny", vocab_size=tok.num_tokens, bos_token_id=tok.endoftext_id,
                             eos_token_id=tok.eos_id, max_position_embeddings=2048)
    save_hf(Qwen3(cfg, rngs=nnx.Rngs(0)), path, tokenizer=tok)
    return tok


def _problems(path, n):
    """"What is a + b?" with answers 1 and 2 only: the SFT policy below answers \\boxed{1} or
    \\boxed{2} at random, so every group of rollouts is mixed (rewards 0 and 1)."""
    with open(path, "w") as f:
        for i in range(n):
            a = i % 2
            f.write(json.dumps({"problem": f"What is {a} + 1? (case {i})", "answer": str(a + 1)}) + "\n")


def _sft_data(path, n):
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            guess = int(rng.integers(1, 3))
            msgs = [{"role": "user", "content": f"What is {i % 2} + 1? (case {i})"},
                    {"role": "assistant", "content": f"<answer>\\boxed{{{guess}}}</answer>"}]
            f.write(json.dumps({"messages": msgs}) + "\n")


def _load(name, arg=None):
    import importlib

    return importlib.import_module(name).get_config(arg)


CHAIN_TEMPERATURE = 0.6


def _rl_sizes(c, total_steps):
    """A tiny run of a shipped RL config: sizes, and the short (compact) prompt the tiny SFT
    policy was trained on, sampled at the evaluation temperature (0.6): the SFT policy's answer
    format holds there while its coin-flip guess keeps every group mixed."""
    c.total_steps = total_steps
    c.model.dtype = "float32"
    c.model.remat_policy = "none"
    c.rl.chat_format = "compact"
    c.rl.temperature = CHAIN_TEMPERATURE
    c.rl.prompts_per_step = 2
    c.rl.group_size = 4
    c.rl.oversample = 8
    c.rl.max_prompt_len = 160
    c.rl.max_response_len = 32
    c.trainer.micro_batch_size = 0
    c.checkpoint.async_save = False
    c.logging.progress_bar = False
    c.logging.tensorboard = False
    return c


def chain_worker(workdir):
    """Runs the README recipe at tiny size, in-process, recording each RL stage's first rollout."""
    import jax

    # the test run's shared cache (tests/conftest.py) when there is one: later stages, and the
    # other tests' runs of the same tiny model, load what an earlier one compiled
    jax.config.update("jax_compilation_cache_dir", os.environ.get("JAX_COMPILATION_CACHE_DIR")
                      or os.path.join(workdir, "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from rstarjax import export
    from rstarjax.main import run
    from rstarjax.rl import agent_loop

    first = {}
    original = agent_loop.ColocatedRollouts.__call__

    def recording(self, records, n, seed, version):
        out = original(self, records, n, seed, version)
        first.setdefault("call", (records, out[0]))
        return out

    agent_loop.ColocatedRollouts.__call__ = recording
    base = os.path.join(workdir, "base")
    _tiny_hf_model(base)
    data = os.path.join(workdir, "problems.jsonl")
    _problems(data, 8)
    _sft_data(os.path.join(workdir, "sft.jsonl"), 64)
    runs = lambda name: os.path.join(workdir, "runs", name)  # noqa: E731
    report = {"stages": {}}

    c = _load("sft")  # 0. SFT
    c.model.hf_path = base
    c.sft.data_path = os.path.join(workdir, "sft.jsonl")
    c.model.dtype = "float32"
    c.sft.chat_format = "compact"
    c.sft.epochs, c.sft.batch_size, c.sft.seq_len, c.sft.micro_batch_size = 5, 8, 256, 0
    c.sft.learning_rate = 1e-2
    c.logging.tensorboard = False
    run(c, runs("sft"))

    def stage(name, config_name, total, init_from, data_path=data):
        c = _rl_sizes(_load(config_name), total)
        c.model.hf_path = base
        c.data.train_path = data_path
        c.checkpoint.init_from = os.path.join(runs(init_from), "checkpoints")
        first.clear()
        run(c, runs(name))
        records, trajs = first["call"]
        report["stages"][name] = {
            "problems": [r["problem"] for r in records],
            "rollouts": [{"ids": np.concatenate([t.prompt_ids, t.response_ids]).tolist(), "prompt": len(t.prompt_ids),
                          "mask": t.loss_mask.tolist(), "logprobs": t.sampled_logprobs.tolist(),
                          "reward": t.reward} for t in trajs],
            "metrics": [json.loads(x) for x in open(os.path.join(runs(name), "logs", "metrics.jsonl"))],
        }

    stage("stage1", "stage1", 2, "sft")
    stage("stage2", "stage2", 3, "stage1")
    c = _rl_sizes(_load("stage3", "filter"), 0)  # 3a. the difficulty filter
    c.model.hf_path = base
    c.data.train_path = data
    c.checkpoint.init_from = os.path.join(runs("stage2"), "checkpoints")
    c.filter.k, c.filter.batch_prompts = 4, 8
    run(c, runs("filter"))
    report["filter"] = json.load(open(os.path.join(runs("filter"), "filtered.jsonl.summary.json")))
    stage("stage3", "stage3", 4, "stage2", data_path=os.path.join(runs("filter"), "filtered.jsonl"))
    hf = os.path.join(workdir, "hf")
    report["export"] = export.export_checkpoint(os.path.join(runs("stage3"), "checkpoints"), hf)
    c = _load("eval")
    c.model.hf_path = hf
    c.model.dtype = "float32"
    c.eval.paths = data
    c.eval.chat_format = "compact"
    c.eval.k, c.eval.max_prompt_len, c.eval.max_response_len, c.eval.num_slots = 2, 160, 32, 16
    run(c, runs("eval"))
    report["eval"] = json.load(open(os.path.join(runs("eval"), "eval_results.json")))
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f)


def _logprobs_under(ckpt_dir, base_dir, rollouts, temperature):
    """Log-probs of each rollout's model tokens under the params of ``ckpt_dir``'s latest
    checkpoint (None: the base model's own weights), by the plain training forward, of the
    distribution sampled at ``temperature`` (logits / T: what the sampler records)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.models import load_hf
    from rstarjax.io import checkpoint as ckpt_lib

    model = load_hf(base_dir, dtype=jnp.float32)
    if ckpt_dir is not None:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params, _, _ = ckpt_lib.restore_params(ckpt_dir, ckpt_lib.abstract_like(params))
        model = nnx.merge(graphdef, params, rest)
    out = []
    for r in rollouts:
        ids = np.asarray(r["ids"])
        logits = np.asarray(model(jnp.asarray(ids[None, :-1]))[0], np.float64) / temperature
        logp = jax.nn.log_softmax(logits, axis=-1)
        p = r["prompt"]
        out.append(np.asarray(logp)[np.arange(p - 1, len(ids) - 1), ids[p:]])
    return out


@pytest.mark.slow
def test_the_readme_recipe_chained_at_tiny_size(tmp_path):
    """SFT -> stage 1 -> stage 2 -> filter -> stage 3 -> export -> eval with the shipped configs:
    every stage trains its configured steps (global 1-2, 3, 4), and the first rollout of each RL
    stage is sampled from the previous stage's final weights (not the base model's)."""
    env = worker_env(1)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "chain", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    report = json.load(open(tmp_path / "report.json"))
    stages = report["stages"]
    assert [m["step"] for m in stages["stage1"]["metrics"]] == [1, 2]
    assert [m["step"] for m in stages["stage2"]["metrics"]] == [3]
    assert [m["step"] for m in stages["stage3"]["metrics"]] == [4]
    # warmup after the SFT hand-off and after stage 3's optimizer reset; stage 2 continues stage 1's
    lr = {k: [m["train/lr"] for m in v["metrics"]] for k, v in stages.items()}
    assert lr["stage1"][0] < lr["stage1"][1] < lr["stage2"][0] and lr["stage3"][0] == lr["stage1"][0]
    previous = {"stage1": "sft", "stage2": "stage1", "stage3": "stage2"}
    base = str(tmp_path / "base")
    for name, prev in previous.items():
        rollouts = stages[name]["rollouts"]
        sampled = [np.asarray(r["logprobs"])[np.asarray(r["mask"]) > 0] for r in rollouts]
        want = _logprobs_under(str(tmp_path / "runs" / prev / "checkpoints"), base, rollouts, CHAIN_TEMPERATURE)
        not_base = _logprobs_under(None, base, rollouts, CHAIN_TEMPERATURE)
        for s, w, b, r in zip(sampled, want, not_base, rollouts):
            m = np.asarray(r["mask"]) > 0
            np.testing.assert_allclose(s, w[m], atol=2e-4, err_msg=name)
            assert np.abs(s - b[m]).max() > 0.05, name  # the check can tell the weights apart
        assert 0 < np.mean([r["reward"] for r in rollouts]) < 1  # mixed groups: every stage trained
    assert report["export"]["step"] == 4 and report["export"]["config_source"] == "checkpoint meta"
    assert report["filter"]["total"] == 8
    assert set(report["eval"]) == {"problems"} and report["eval"]["problems"]["k"] == 2


# ============================================================================ every shipped config starts
class _Started(Exception):
    """Raised where a run would start its first rollouts: the executor and engine exist."""


@pytest.fixture(scope="module")
def user_inputs(tmp_path_factory):
    """What a user must give: a model directory and data files."""
    root = tmp_path_factory.mktemp("inputs")
    _tiny_hf_model(str(root / "model"))
    _problems(str(root / "problems.jsonl"), 8)
    _sft_data(str(root / "sft.jsonl"), 8)
    return root


SHIPPED = [("sft", None), ("base", None), ("base", "filter"), ("stage1", None), ("stage1", "filter"),
           ("stage2", None), ("stage2", "filter"), ("stage3", None), ("stage3", "filter"),
           ("eval", None), ("demo", "ci")]


@pytest.mark.parametrize("name, arg", SHIPPED, ids=[f"{n}:{a}" if a else n for n, a in SHIPPED])
def test_every_shipped_config_starts(name, arg, user_inputs, tmp_path, monkeypatch):
    """Each shipped config, with only the model, the data and sizes overridden, runs through
    ``rstarjax.main.run`` up to its first rollout: its code executor (sized from this host by
    default) runs a real call and its engine is built. SFT runs one step and exports."""
    from rstarjax.main import run
    from rstarjax.rl import agent_loop

    seen = {}

    def at_first_rollout(scheduler_or_engines, tokenizer, executor, requests, config=None, fmt=None):
        seen["executor"] = executor.run("print(6 * 7)")
        seen["engine"] = scheduler_or_engines
        raise _Started

    monkeypatch.setattr(agent_loop, "run_rollouts", at_first_rollout)
    c = _load(name, arg)
    stage2 = None
    if name != "demo":  # the demo brings its own model and data
        c.model.hf_path = str(user_inputs / "model")
        c.model.dtype = "float32"
    if name == "sft":
        c.sft.data_path = str(user_inputs / "sft.jsonl")
        c.sft.max_steps, c.sft.batch_size, c.sft.seq_len, c.sft.micro_batch_size = 1, 8, 640, 0
    elif name == "eval":
        c.eval.paths = str(user_inputs / "problems.jsonl")
        c.eval.max_prompt_len, c.eval.max_response_len, c.eval.num_slots = 640, 32, 4
    elif name == "demo":
        c.demo.num_sft_problems, c.sft.batch_size, c.demo.num_slots = 16, 16, 4
    else:
        c.data.train_path = str(user_inputs / "problems.jsonl")
        c.rl.prompts_per_step, c.rl.max_prompt_len, c.rl.max_response_len = 8, 640, 32
        c.trainer.micro_batch_size = 0
        if c.checkpoint.reset_optimizer or arg == "filter":  # stage 3 and its filter start from stage 2
            stage2 = _stage2_checkpoint(tmp_path, c)
            c.checkpoint.init_from = stage2
    if name == "sft":
        run(c, str(tmp_path / "run"))
        assert (tmp_path / "run" / "hf" / "tokenizer.json").exists()
        return
    with pytest.raises(_Started):
        run(c, str(tmp_path / "run"))
    assert seen["executor"].text == "42\n"
    assert seen["engine"] is not None
    assert c.rl.num_tool_workers == 0  # the default: one worker per host core


def _stage2_checkpoint(tmp_path, config):
    """A stage-2 checkpoint of the tiny model (what stage 3 and its filter start from)."""
    import jax

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.models import load_hf
    from rstarjax.recipes import build
    from rstarjax.recipes.config import MeshConfig
    from rstarjax.rl import optim as optim_lib
    from rstarjax.rl import trainer as trainer_lib
    from rstarjax.rl.loss import LossConfig

    model = load_hf(config.model.hf_path)
    tr = trainer_lib.Trainer(model, optim_lib.OptimConfig(), LossConfig(), trainer_lib.TrainerConfig(),
                             mesh=build.mesh(MeshConfig(**dict(config.mesh))))
    path = str(tmp_path / "stage2" / "checkpoints")
    with ckpt_lib.Checkpointer(path) as ck:
        ck.save(385, trainer_lib.TrainState(tr.state.params, tr.state.opt_state,
                                            jax.device_put(np.int32(385), tr.replicated)),
                {"step": 385, "stage": "rl", "init_from": ""})
    return path


def test_tool_pool_follows_the_host():
    from rstarjax.recipes.build import tool_workers

    assert tool_workers(0, cores=2) == 2 and tool_workers(0, cores=96) == 96 and tool_workers(5) == 5
    with pytest.raises(ValueError, match="num_tool_workers"):
        tool_workers(-1)


def test_a_large_explicit_tool_pool_builds():
    from rstarjax.env import CodeExecutor

    # 32 heavy + 32 lean workers x 4 slots = 256 sandboxes: the automatic uid range follows the pool
    with CodeExecutor(num_workers=32) as ex:
        assert ex.run("print(6 * 7)").text.strip() == "42"


if __name__ == "__main__" and sys.argv[1:2] == ["chain"]:
    chain_worker(sys.argv[2])

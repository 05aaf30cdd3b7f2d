"""LoRA policies (models/lora.py): against the plain model and a hand-written W + (alpha/r) A B."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rstarjax.models import lora as lora_lib
from rstarjax.models import sharding as sharding_lib
from rstarjax.models.config import LORA_TARGETS, ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.rl import trainer as trainer_lib
from rstarjax.rl.loss import LossConfig

from test_trainer import random_batch, reference_loss

RANK, ALPHA = 4, 8.0


def plain_model(seed=0, **overrides):
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32, num_hidden_layers=2, **overrides)
    return Qwen3(cfg, rngs=nnx.Rngs(seed))


def lora_model(seed=0, targets=LORA_TARGETS, **overrides):
    return lora_lib.attach(plain_model(seed, **overrides), RANK, ALPHA, targets, seed=seed + 1)


def randomize_b(model, seed=0, scale=0.05):
    """Non-zero B so the adapters change the model (they start at zero)."""
    key = jax.random.key(seed)
    for i, name in enumerate(model.layers.lora_names):
        var = getattr(model.layers, name)
        if name.endswith("_lora_b"):
            var[...] = scale * jax.random.normal(jax.random.fold_in(key, i), var.shape, var.dtype)
    return model


def by_hand_weights(model) -> dict:
    """Reference merge, written out: W_eff = W + (alpha / r) A @ B per layer, in float64."""
    cfg = model.config
    out = {}
    for name in cfg.lora_targets:
        w = np.asarray(getattr(model.layers, name)[...], np.float64)
        a = np.asarray(getattr(model.layers, f"{name}_lora_a")[...], np.float64)
        b = np.asarray(getattr(model.layers, f"{name}_lora_b")[...], np.float64)
        out[name] = w + (ALPHA / RANK) * np.stack([a[i] @ b[i] for i in range(len(w))])
    return out


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 512, size=(2, 12)), jnp.int32)


def test_config_rejects_bad_lora_fields():
    with pytest.raises(ValueError, match="lora_rank"):
        ModelConfig.preset("tiny", lora_rank=-1)
    with pytest.raises(ValueError, match="lora_targets"):
        ModelConfig.preset("tiny", lora_rank=4, lora_targets=("qkv",))
    with pytest.raises(ValueError, match="lora_alpha"):
        ModelConfig.preset("tiny", lora_rank=4, lora_alpha=0.0)


def test_rank_zero_is_todays_model():
    """lora_rank=0: the same parameters (names, dtypes, values) as before."""
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32)
    assert cfg.lora_rank == 0 and cfg.base_param_dtype == jnp.float32
    state = nnx.state(Qwen3(cfg, rngs=nnx.Rngs(0)))
    assert not nnx.state(Qwen3(cfg, rngs=nnx.Rngs(0)), nnx.LoRAParam)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state))


@pytest.mark.parametrize("build", ["attach", "config"])
def test_initial_adapters_give_the_base_model_exactly(build):
    """B = 0 at init: the LoRA model's logits are bit-equal to the plain model with the same
    (bfloat16) base weights, whether built by ``attach`` or from ``lora_rank`` in the config."""
    base = plain_model(param_dtype=jnp.bfloat16)
    if build == "attach":
        model = lora_lib.attach(plain_model(), RANK, ALPHA)
    else:
        model = Qwen3(base.config.replace(lora_rank=RANK, lora_alpha=ALPHA, param_dtype=jnp.float32),
                      rngs=nnx.Rngs(0))
    for name in LORA_TARGETS:  # frozen base in bf16, adapters in f32
        assert getattr(model.layers, name).dtype == jnp.bfloat16
        assert getattr(model.layers, f"{name}_lora_a").dtype == jnp.float32
    assert float(jnp.abs(model.layers.q_proj_lora_a[...]).max()) > 0  # A is random, B zero
    np.testing.assert_array_equal(np.asarray(model(TOKENS)), np.asarray(base(TOKENS)))


@pytest.mark.parametrize("scan,remat", [(True, "none"), (False, "full"), (True, "dots")])
def test_unmerged_forward_equals_by_hand_merged_weights(scan, remat):
    """The adapters applied unmerged (scan or unrolled, remat or not) == the plain model whose
    weights are W + (alpha/r) A B computed by hand; ``merged_model`` gives the same."""
    model = randomize_b(lora_model(scan_layers=scan, remat_policy=remat))
    ref_cfg = model.config.replace(lora_rank=0, param_dtype=jnp.float32)
    ref = Qwen3(ref_cfg, rngs=nnx.Rngs(0))
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if not lora_lib.is_adapter_name(str(key[-1])):
            target = ref
            for k in key[:-1]:
                target = getattr(target, k)
            getattr(target, key[-1])[...] = var.get_value().astype(jnp.float32)
    for name, w in by_hand_weights(model).items():
        getattr(ref.layers, name)[...] = jnp.asarray(w, jnp.float32)
    want = np.asarray(ref(TOKENS))
    got = np.asarray(model(TOKENS))
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    assert np.abs(got - np.asarray(randomize_b(lora_model(), scale=0.0)(TOKENS))).max() > 1e-3
    merged = lora_lib.merged_model(model)  # bf16 weights: within bf16 rounding of the reference
    assert merged.config.lora_rank == 0 and not nnx.state(merged, nnx.LoRAParam)
    np.testing.assert_allclose(np.asarray(merged(TOKENS)), want, atol=3e-2, rtol=3e-2)
    for name, w in by_hand_weights(model).items():
        np.testing.assert_allclose(np.asarray(getattr(merged.layers, name)[...], np.float64), w,
                                   rtol=2 ** -8, atol=1e-6)


def test_adapter_gradients_equal_explicit_computation():
    """d loss / d (A, B) through the unmerged forward == the gradient through the plain model
    with W_eff = W + (alpha/r) A B written out (JAX differentiates the explicit product)."""
    model = randomize_b(lora_model(targets=("q_proj", "v_proj", "down_proj")))
    batch = random_batch(0)
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    got = jax.grad(lambda p: reference_loss(nnx.merge(graphdef, p, rest), batch))(adapters)

    ref = Qwen3(model.config.replace(lora_rank=0, param_dtype=jnp.float32), rngs=nnx.Rngs(0))
    ref_graph, ref_params = nnx.split(ref)
    base = {k: v.get_value().astype(jnp.float32) for k, v in nnx.to_flat_state(rest)}
    ab = {str(k[-1]): v.get_value() for k, v in nnx.to_flat_state(adapters)}

    def explicit_loss(ab):
        flat = []
        for key, var in nnx.to_flat_state(ref_params):
            w = base[key]
            name = str(key[-1])
            if key[0] == "layers" and f"{name}_lora_a" in ab:
                w = w + (ALPHA / RANK) * jnp.einsum("lir,lro->lio", ab[f"{name}_lora_a"],
                                                    ab[f"{name}_lora_b"])
            flat.append((key, var.replace(w)))
        return reference_loss(nnx.merge(ref_graph, nnx.from_flat_state(flat)), batch)

    want = jax.grad(explicit_loss)(ab)
    got = {str(k[-1]): v.get_value() for k, v in nnx.to_flat_state(got)}
    assert set(got) == set(want) == {f"{t}_lora_{x}" for t in ("q_proj", "v_proj", "down_proj") for x in "ab"}
    for name in want:
        w, g = np.asarray(want[name]), np.asarray(got[name])
        assert np.abs(w).max() > 1e-6, name  # a real gradient
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-5 * np.abs(w).max())


def test_trainer_trains_only_adapters_on_a_sharded_mesh():
    """Trainer over a LoRA model on 4 devices (fsdp 2 x tensor 2): the state and optimizer hold
    the adapters only; an SGD step moves them by the explicit gradient and leaves the frozen
    base untouched; ``model()`` is the merged plain model (what the rollouts serve)."""
    model = randomize_b(lora_model())
    batch = random_batch(1)
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    ref_grads = jax.grad(lambda p: reference_loss(nnx.merge(graphdef, p, rest), batch))(adapters)
    frozen_before = [np.asarray(x) for x in jax.tree.leaves(rest)]

    mesh = sharding_lib.make_mesh(1, 2, 2, devices=jax.devices()[:4])
    tr = trainer_lib.Trainer(model, None, LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=4, recompute_old_logprobs=False),
                             mesh=mesh, optimizer=optax.adamw(1e-3))
    names = {str(k[-1]) for k, _ in nnx.to_flat_state(tr.state.params)}
    assert names == {f"{t}_lora_{x}" for t in LORA_TARGETS for x in "ab"}
    adapter_shapes = sorted(x.shape for x in jax.tree.leaves(tr.state.params))
    moments = [x for x in jax.tree.leaves(tr.state.opt_state) if x.ndim > 0]
    assert sorted(x.shape for x in moments) == sorted(adapter_shapes * 2)  # mu and nu, adapters only
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(tr.state.params))

    tr = trainer_lib.Trainer(model, None, LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=4, recompute_old_logprobs=False),
                             mesh=mesh, optimizer=optax.sgd(1.0))
    tr.train(batch)
    got = {str(k[-1]): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(tr.state.params)}
    ref_flat = {str(k[-1]): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(ref_grads)}
    for k, v in nnx.to_flat_state(adapters):
        name = str(k[-1])
        np.testing.assert_allclose(np.asarray(v.get_value()) - got[name], ref_flat[name], rtol=2e-3,
                                   atol=2e-5 * max(1.0, np.abs(ref_flat[name]).max()))
    for a, b in zip(frozen_before, jax.tree.leaves(tr.frozen)):
        np.testing.assert_array_equal(a, np.asarray(b))
    served = tr.model()
    assert served.config.lora_rank == 0 and not nnx.state(served, nnx.LoRAParam)
    # merged in the compute dtype (float32 here), the policy the rollouts serve is the one the
    # trainer computes, to float noise (a bfloat16 merge differed by ~1e-2)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(served, nnx.Param)))
    np.testing.assert_allclose(np.asarray(served(TOKENS)), np.asarray(tr.lora_model()(TOKENS)),
                               atol=2e-5, rtol=1e-5)
    # the merged copy sits on the base's logical-axis shardings (tensor-parallel q heads)
    assert not served.layers.q_proj[...].sharding.is_fully_replicated


# ------------------------------------------------------------------ checkpoints and export
@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    """A LoRA trainer's checkpoint (adapters + AdamW state, meta with the base record) of a
    seeded random base, the adapters moved off their initial value."""
    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.models import load_tokenizer
    from rstarjax.recipes import lora_base
    from rstarjax.recipes.build import model_meta
    from rstarjax.recipes.config import ModelSource
    from rstarjax.rl.optim import OptimConfig

    tok = load_tokenizer(1000)
    cfg = ModelConfig.preset("tiny", vocab_size=tok.num_tokens, dtype=jnp.float32,
                             bos_token_id=tok.endoftext_id, eos_token_id=tok.eos_id)
    model = randomize_b(lora_lib.attach(Qwen3(cfg, rngs=nnx.Rngs(3)), RANK, ALPHA, seed=5), seed=7)
    trainer = trainer_lib.Trainer(model, OptimConfig(), LossConfig(), trainer_lib.TrainerConfig(),
                                  mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    record = lora_base.with_hash(lora_base.model_record(ModelSource(preset="tiny", random_init=True), 3),
                                 trainer.frozen)
    root = tmp_path_factory.mktemp("lora_run")
    with ckpt_lib.Checkpointer(str(root / "checkpoints"), ckpt_lib.CheckpointConfig(async_save=False)) as c:
        c.save(7, trainer.state, dict(model_meta(model, tok), lora_base=record))
    return root, trainer, tok


def test_checkpoint_holds_adapters_and_resumes_exactly(lora_checkpoint):
    from rstarjax.io import checkpoint as ckpt_lib

    root, trainer, _ = lora_checkpoint
    with ckpt_lib.Checkpointer(str(root / "checkpoints"), ckpt_lib.CheckpointConfig(async_save=False)) as c:
        state, meta = c.restore(ckpt_lib.abstract_like(trainer.state, trainer.state_sharding))
    assert meta["lora"] == {"rank": RANK, "alpha": ALPHA, "targets": list(LORA_TARGETS)}
    assert meta["lora_base"]["hash"] == lora_lib.weights_fingerprint(trainer.frozen)
    names = {str(k[-1]) for k, _ in nnx.to_flat_state(state.params)}
    assert all(lora_lib.is_adapter_name(n) for n in names)  # no base weight in the checkpoint
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_merged_hf_export_and_peft_adapter_match_transformers(lora_checkpoint, tmp_path):
    """The export merges the adapters into a HF directory that transformers loads with our
    logits; the PEFT adapter, loaded by HF peft onto the HF export of the bf16 base, too."""
    import torch
    import transformers

    from rstarjax import export
    from rstarjax.models import save_hf

    root, trainer, tok = lora_checkpoint
    out = export.export_checkpoint(str(root / "checkpoints"), str(tmp_path / "hf"), peft_dir=str(tmp_path / "peft"))
    assert out["step"] == 7 and out["peft_out"] == str(tmp_path / "peft")
    assert "adapters merged into the base's weights (float32)" in out["lora"]  # says what it wrote
    ids = tok.encode("<|im_start|>user\nCompute 1234 * 5678.<|im_end|>")
    ours = np.asarray(trainer.lora_model()(jnp.asarray([ids], jnp.int32)))
    base_logits = np.asarray(nnx.merge(trainer.graphdef, jax.tree.map(jnp.zeros_like, trainer.state.params),
                                       trainer.frozen)(jnp.asarray([ids], jnp.int32)))
    assert np.abs(ours - base_logits).max() > 1e-2  # the adapters matter

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        merged = hf(input_ids=torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, merged, atol=1e-4, rtol=1e-4)

    peft = pytest.importorskip("peft")
    base = nnx.merge(trainer.graphdef, trainer.state.params, trainer.frozen)
    save_hf(lora_lib.merged_model(randomize_b(base, scale=0.0), dtype=jnp.float32), str(tmp_path / "base"),
            tokenizer=tok)  # B = 0: the bf16 base itself, as float32
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    with torch.no_grad():
        np.testing.assert_allclose(hf_base(input_ids=torch.tensor([ids])).logits.numpy(), base_logits,
                                   atol=1e-4, rtol=1e-4)
    adapted = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        got = adapted(input_ids=torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, got, atol=1e-4, rtol=1e-4)


def test_export_refuses_adapters_on_another_base(lora_checkpoint, tmp_path):
    import json as json_lib

    from rstarjax import export
    from rstarjax.io import checkpoint as ckpt_lib

    root, trainer, tok = lora_checkpoint
    with ckpt_lib.Checkpointer(str(root / "checkpoints"), ckpt_lib.CheckpointConfig(async_save=False)) as c:
        meta = c.read_meta(7)
    meta["lora_base"] = dict(meta["lora_base"], random_init={"preset": "tiny", "seed": 4})
    with ckpt_lib.Checkpointer(str(tmp_path / "other"), ckpt_lib.CheckpointConfig(async_save=False)) as c:
        c.save(7, trainer.state, meta)
    with pytest.raises(ValueError, match="hashes to"):
        export.export_checkpoint(str(tmp_path / "other"), str(tmp_path / "x"))
    assert json_lib.dumps(meta)  # the record is plain JSON


# ------------------------------------------------------------------ the RL recipe with LoRA
def test_rl_stage_with_lora_from_sft_checkpoint_resumes_exactly(tmp_path, monkeypatch):
    """``model.lora_rank`` through ``run_rl`` (scripted rollouts): from a full-parameter SFT
    checkpoint the SFT params become the frozen base and the engine first serves exactly them
    (B = 0); the checkpoints hold adapters only; 2 steps + a resume to 3 end with the adapters
    and optimizer state of 3 straight steps; a resume with another base, or adapters of another
    LoRA setting, is refused."""
    import dataclasses
    import json as json_lib

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import StageError, run_rl
    from test_checkpoint import fake_rollout_fn
    from test_stages import _save_trained, _scripted_config, _trainer

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(8):
            f.write(json_lib.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n")
    sft = str(tmp_path / "sft" / "checkpoints")
    sft_state = _save_trained(_trainer(layers=2), sft, 40, {"stage": "sft", "total_steps": 40})

    def config(workdir, total):
        c = _scripted_config(workdir, total, sft)
        c.model.lora_rank = RANK
        c.model.lora_alpha = ALPHA
        c.optim.learning_rate = 1e-2
        return parse(c)

    def run(name, total):
        served = []
        workdir = str(tmp_path / name)
        tr = run_rl(config(workdir, total), workdir, rollout_fn=fake_rollout_fn,
                    on_update=lambda t: served.append(t.model()))
        return tr, served

    tr, served = run("a", 2)
    first = served[0]  # what the engine got before the first rollout: the SFT policy in bf16
    assert first.config.lora_rank == 0
    want = dict(nnx.to_flat_state(sft_state.params))
    for key, var in nnx.to_flat_state(nnx.state(first)):
        np.testing.assert_array_equal(np.asarray(var.get_value()),
                                      np.asarray(want[key].get_value().astype(jnp.bfloat16)))
    assert tr.step == 2 and tr.lora
    with ckpt_lib.Checkpointer(str(tmp_path / "a" / "checkpoints")) as ck:
        meta = ck.read_meta()
    assert meta["lora_base"]["source"] == "checkpoint" and meta["lora_base"]["step"] == 40
    assert meta["lora"]["rank"] == RANK

    resumed, _ = run("a", 3)
    straight, _ = run("b", 3)
    assert resumed.step == straight.step == 3
    for a, b in zip(jax.tree.leaves((resumed.state.params, resumed.state.opt_state)),
                    jax.tree.leaves((straight.state.params, straight.state.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = [np.abs(np.asarray(x)).max() for k, x in nnx.to_flat_state(straight.state.params)
             if str(k[-1]).endswith("_lora_b")]
    assert max(moved) > 0  # the adapters trained

    # a run that only samples from the stage's policy (the stage-3 filter) gets the same one
    from rstarjax.recipes import lora_base
    run_cfg = config(str(tmp_path / "f"), 3)
    built = build.policy(run_cfg.model, build.mesh(run_cfg.mesh), run_cfg.seed)
    policy, step = lora_base.restore_lora_policy(built, str(tmp_path / "b" / "checkpoints"))
    assert step == 3
    np.testing.assert_array_equal(np.asarray(lora_lib.merged_model(policy).layers.q_proj[...]),
                                  np.asarray(straight.model().layers.q_proj[...]))

    # the base it was trained on changed under it: the resume says so
    with ckpt_lib.Checkpointer(str(tmp_path / "a" / "checkpoints")) as ck:
        step = ck.latest_step()
        state, meta = ck.restore(ckpt_lib.abstract_like(resumed.state, resumed.state_sharding), step)
    meta["lora_base"]["hash"] = "0" * 16
    with ckpt_lib.Checkpointer(str(tmp_path / "c" / "checkpoints")) as ck:
        ck.save(step, state, meta)
    with pytest.raises(ValueError, match="hashes to"):
        run("c", 4)

    # adapters of another alpha (they would restore and train another policy) or rank (Orbax's
    # shape error) are refused by name, resumed or continued by the next stage
    other_alpha = config(str(tmp_path / "a"), 4)
    other_alpha = dataclasses.replace(other_alpha, model=dataclasses.replace(other_alpha.model, lora_alpha=ALPHA / 2))
    with pytest.raises(StageError, match=f"another LoRA setting: resume with --config.model.lora_alpha={ALPHA}"):
        run_rl(other_alpha, str(tmp_path / "a"), rollout_fn=fake_rollout_fn)
    next_stage = config(str(tmp_path / "d"), 4)
    next_stage = dataclasses.replace(
        next_stage, model=dataclasses.replace(next_stage.model, lora_rank=RANK * 2),
        checkpoint=dataclasses.replace(next_stage.checkpoint, init_from=str(tmp_path / "a" / "checkpoints")))
    with pytest.raises(StageError, match=f"continue them with --config.model.lora_rank={RANK} "):
        run_rl(next_stage, str(tmp_path / "d"), rollout_fn=fake_rollout_fn)


def test_lora_setting_flags_name_what_differs():
    from rstarjax.recipes.lora_base import lora_setting_flags

    saved = {"rank": 4, "alpha": 32.0, "targets": ["q_proj", "v_proj"]}
    assert lora_setting_flags(saved, 4, 32, ("v_proj", "q_proj")) == ""  # the order of targets is no setting
    assert lora_setting_flags(None, 8, 16, ()) == ""  # full parameters: other checks say so
    assert lora_setting_flags(saved, 8, 16.0, ("q_proj",)) == (
        "--config.model.lora_rank=4 --config.model.lora_alpha=32.0 --config.model.lora_targets=q_proj,v_proj")


# ------------------------------------------------------------------ the demo's LoRA variant
def test_demo_lora_config_changes_only_the_lora_keys():
    from test_demo import CI_KEYS, _config, _flat

    full, lora, lora_ci = _flat(_config(None)), _flat(_config("lora")), _flat(_config("lora_ci"))
    assert {k for k in full if full[k] != lora[k]} == {"model.lora_rank", "optim.learning_rate"}
    assert lora["model.lora_rank"] == 16 and lora["model.lora_alpha"] == 32.0
    assert {k for k in lora if lora[k] != lora_ci[k]} <= CI_KEYS


@pytest.mark.slow
def test_demo_lora_ci_trains_adapters_from_the_sft_checkpoint(demo_ci_run, tmp_path):
    """configs/demo.py:lora_ci from the CI demo's SFT checkpoint: the RL stage runs on the real
    engine, sandbox and verifier with rank-16 adapters on the SFT policy, its checkpoint holds
    the adapters, and the merged export loads."""
    import json as json_lib
    import subprocess
    import sys

    from conftest import ROOT, host_devices_env
    from test_demo import _config

    from rstarjax.io import checkpoint as ckpt_lib

    earlier, notebook = demo_ci_run
    c = _config("lora_ci")
    workdir = earlier.parent / (earlier.name + "-lora")  # where the notebook's LoRA section ran it
    if notebook is None:  # no notebook run (nbclient absent): the same command, here
        r = subprocess.run([sys.executable, "-m", "rstarjax.main", f"--config={ROOT / 'configs' / 'demo.py'}:lora_ci",
                            f"--config.demo.sft_checkpoint={earlier / 'sft' / 'checkpoints'}",
                            f"--workdir={workdir}"], env=host_devices_env(), capture_output=True, text=True,
                           timeout=1200)
        assert r.returncode == 0, r.stderr[-5000:]
    summary = json_lib.loads((workdir / "demo_summary.json").read_text())
    assert summary["rl_steps"] == c.total_steps and not (workdir / "sft").exists()  # no second SFT
    with ckpt_lib.Checkpointer(str(workdir / "rl" / "checkpoints")) as ck:
        meta = ck.read_meta()
    assert meta["lora"]["rank"] == 16 and meta["lora_base"]["hash"]
    assert (workdir / "hf" / "config.json").exists()
    # the adapters' base is the SFT checkpoint they started from: the export rebuilds it (hash
    # checked) from the RL checkpoint alone
    base = meta["lora_base"]
    assert (base["source"], base["path"]) == ("checkpoint", str((earlier / "sft" / "checkpoints").resolve()))
    from rstarjax import export
    out = export.export_checkpoint(str(workdir / "rl" / "checkpoints"), str(tmp_path / "hf"))
    assert out["step"] == c.total_steps and (tmp_path / "hf" / "config.json").exists()
    # the sampler served the policy the trainer computed: merged in the compute dtype, the
    # sampler/trainer log-prob gap is float noise at every step (a bf16 merge gave ~1e-2)
    metrics = [json_lib.loads(l) for l in (workdir / "rl" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == c.total_steps and all(m["train/logprob_gap_max"] < 1e-3 for m in metrics)


def test_engine_serves_a_lora_policy_merged_inside_its_one_handoff_program(monkeypatch):
    """An engine serving the plain base (the SFT policy, as the demo builds it) takes the LoRA
    policy itself: its serving copy holds W + (alpha/r) A B (checked against the float64 merge by
    hand), made by the hand-off's own program (the separate merge program is never called, and
    the program compiles once for every later update), and a model of another shape is refused."""
    from rstarjax.serving import handoff
    from rstarjax.serving.engine import Engine

    base = plain_model()
    engine = Engine(base, max_len=32, num_slots=2, page_size=8, buckets=(16, 32), decode_steps=4)
    policy = randomize_b(lora_lib.attach(base, RANK, ALPHA, seed=1))
    monkeypatch.setattr(lora_lib, "merger", lambda *a, **k: pytest.fail("a separate merge program ran"))
    compiled = handoff._staging_jit.cache_info().misses
    engine.update_params(policy)
    want = by_hand_weights(policy)
    for i, layer in enumerate(engine.params.layers):
        for name, w in want.items():
            np.testing.assert_allclose(np.asarray(layer[name], np.float64), w[i], rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(engine.params.layers[0]["q_proj"]) - np.asarray(base.layers.q_proj[...][0])).max() > 1e-3
    engine.update_params(randomize_b(policy, seed=1))  # the next update: same program
    np.testing.assert_allclose(np.asarray(engine.params.layers[1]["down_proj"], np.float64),
                               by_hand_weights(policy)["down_proj"][1], rtol=1e-6, atol=1e-6)
    assert handoff._staging_jit.cache_info().misses - compiled <= 1
    with pytest.raises(ValueError, match="serving copy .* differs"):
        engine.update_params(plain_model(intermediate_size=2 * base.config.intermediate_size))

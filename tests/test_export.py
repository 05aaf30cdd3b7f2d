"""rstarjax.export: a trainer checkpoint -> HF dir that transformers loads with the same logits."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax import export
from rstarjax.models import ModelConfig, Qwen3, load_tokenizer
from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.models.sharding import make_mesh
from rstarjax.recipes.build import model_meta
from rstarjax.rl.loss import LossConfig
from rstarjax.rl.optim import OptimConfig
from rstarjax.rl.trainer import Trainer, TrainerConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny_trainer(tie_word_embeddings: bool = True):
    """The tiny model (seed 3) on one device, with its tokenizer and a fresh trainer."""
    tok = load_tokenizer(1000)
    cfg = ModelConfig.preset("tiny", vocab_size=tok.num_tokens, dtype=jnp.float32,
                             bos_token_id=tok.endoftext_id, eos_token_id=tok.eos_id,
                             tie_word_embeddings=tie_word_embeddings)
    model = Qwen3(cfg, rngs=nnx.Rngs(3))
    trainer = Trainer(model, OptimConfig(), LossConfig(), TrainerConfig(),
                      mesh=make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    return model, tok, trainer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model, tok, trainer = tiny_trainer()
    root = tmp_path_factory.mktemp("run")
    with ckpt_lib.Checkpointer(str(root / "checkpoints"), ckpt_lib.CheckpointConfig(async_save=False)) as c:
        c.save(7, trainer.state, model_meta(model, tok))
    # a run trained with the official rStar2-Agent format (profile rstar2_official, issue #27)
    with ckpt_lib.Checkpointer(str(root / "official"), ckpt_lib.CheckpointConfig(async_save=False)) as c:
        c.save(7, trainer.state, model_meta(model, tok, "rstar2_official"))
    return root, trainer.model(), tok


def test_export_matches_transformers(checkpoint, tmp_path):
    root, model, tok = checkpoint
    out = export.export_checkpoint(str(root / "checkpoints"), str(tmp_path / "hf"))
    assert out["step"] == 7 and out["config_source"] == "checkpoint meta"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "<|im_start|>user\nCompute 1234 * 5678.<|im_end|>"
    ids = tok.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits.numpy()
    ours = np.asarray(model(jnp.asarray([ids], jnp.int32)))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_export_cli_and_errors(checkpoint, tmp_path):
    root, _, _ = checkpoint
    r = subprocess.run([sys.executable, "-m", "rstarjax.export", "--checkpoint", str(root / "checkpoints"),
                        "--out", str(tmp_path / "cli"), "--dtype", "bfloat16"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["step"] == 7
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(FileNotFoundError):
        export.export_checkpoint(str(tmp_path / "nope"), str(tmp_path / "x"))
    with pytest.raises(FileNotFoundError, match="step 3"):
        export.export_checkpoint(str(root / "checkpoints"), str(tmp_path / "x"), step=3)
    # a wrong architecture is named, not a shape soup
    with pytest.raises(ValueError, match="does not match"):
        export.export_checkpoint(str(root / "checkpoints"), str(tmp_path / "x"), preset="tiny",
                                 model_config=_write_cfg(tmp_path, hidden_size=32))
    assert export.main(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "y")]) == 2


def test_export_carries_the_chat_format_the_run_trained_with(checkpoint, tmp_path):
    from rstarjax.models import chat_template as ct

    root, _, _ = checkpoint
    q = [{"role": "user", "content": "What is 2+2?"}]
    for ckpt, fmt in (("checkpoints", ct.RSTAR2), ("official", ct.RSTAR2_OFFICIAL)):
        out = export.export_checkpoint(str(root / ckpt), str(tmp_path / ckpt))
        assert out["chat_format"] == ("rstar2" if fmt is ct.RSTAR2 else "rstar2_official")
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / ckpt))
        assert hf_tok.apply_chat_template(q, tokenize=False, add_generation_prompt=True) == \
            ct.render_prompt("What is 2+2?", fmt)


def _write_cfg(tmp_path, **changes):
    cfg = ModelConfig.preset("tiny", vocab_size=1026, **changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_hf_dict()))
    return str(path)


def test_save_hf_writes_the_tokenizer_or_refuses(tmp_path):
    """Without a tokenizer, save_hf writes the one the vocabulary implies (Qwen3's for a full-size
    table) or refuses: a directory without one makes AutoTokenizer quietly return an empty one."""
    from rstarjax.models import save_hf
    from rstarjax.models.hf import default_tokenizer_for

    small = Qwen3(ModelConfig.preset("tiny", vocab_size=1026, dtype=jnp.float32), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="does not say which tokenizer"):
        save_hf(small, str(tmp_path / "refused"))
    assert not (tmp_path / "refused" / "config.json").exists()
    save_hf(small, str(tmp_path / "weights"), tokenizer=False)  # on purpose: weights only
    assert not (tmp_path / "weights" / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="1026 embedding rows"):
        save_hf(small, str(tmp_path / "x"), tokenizer=load_tokenizer(3000))
    assert default_tokenizer_for(ModelConfig.preset("qwen3-0.6b")) is load_tokenizer()
    assert default_tokenizer_for(ModelConfig.preset("tiny")) is None


@pytest.mark.parametrize("how", ["cut", "bytes@0.5", "swap"])
def test_export_skips_a_damaged_checkpoint_and_refuses_when_none_verifies(tmp_path, caplog, capsys, how):
    """Steps 6 and 7 saved, 7's array files damaged: the export takes step 6 with one warning line
    naming step 7 and why; ``--step 7`` and, with 6 damaged too, the default stop with one
    line and exit status 2 (never a model exported from damaged arrays)."""
    import os
    import shutil

    from test_checkpoint import damage

    model, tok, trainer = tiny_trainer()
    directory = str(tmp_path / "checkpoints")
    with ckpt_lib.Checkpointer(directory, ckpt_lib.CheckpointConfig(async_save=False)) as c:
        for step in (5, 6, 7):
            state = jax.tree.map(lambda x: x + step if x.dtype.kind == "f" else x, trainer.state)
            c.save(step, state, model_meta(model, tok))
    spare = str(tmp_path / "spare")
    shutil.move(os.path.join(directory, "5"), spare)
    damage(os.path.join(directory, "7"), how, spare)

    args = ["--checkpoint", directory, "--out", str(tmp_path / "hf")]
    with caplog.at_level("WARNING"):
        caplog.clear()
        assert export.main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 6
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("rstarjax")]
    assert len(warnings) == 1 and len(warnings[0].splitlines()) == 1, warnings
    assert f"checkpoint {directory}/7 does not restore (" in warnings[0] and "exporting step 6" in warnings[0]

    assert export.main(args + ["--step", "7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"export failed: checkpoint {directory}/7 does not restore ("), err

    damage(os.path.join(directory, "6"), how, spare)
    assert export.main(args + ["--out", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"export failed: no checkpoint in {directory} restores: "), err
    assert "/7 does not restore" in err[0] and "/6 does not restore" in err[0]
    assert not os.path.exists(tmp_path / "hf2" / "config.json")


def test_an_out_that_cannot_take_the_export_is_one_line_before_any_read(checkpoint, tmp_path, capsys):
    """A file, a directory of other files (a base model's, whose model.safetensors transformers
    would load instead of the export's shards) and an unwritable place: exit 2, one line, nothing
    changed there. Once the checkpoint was read a write error (a full disk) leaves no --out."""
    import errno
    import os

    root, _, _ = checkpoint
    args = ["--checkpoint", str(root / "checkpoints"), "--out"]
    (tmp_path / "file").write_text("x")
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"the base")
    for out, message in ((tmp_path / "file", "is a file"), (base, "already holds files that no export wrote"),
                         ("/proc/rstarjax-export-test/hf", "cannot be written")):
        assert export.main(args + [str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert sorted(os.listdir(base)) == ["model.safetensors"] and (tmp_path / "file").read_text() == "x"

    def full_disk(model, path, **kw):
        (tmp_path / "staged").write_text(path)
        with open(os.path.join(path, "model-00001-of-00001.safetensors"), "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    original = export.save_hf
    export.save_hf = full_disk
    try:
        assert export.main(args + [str(tmp_path / "hf")]) == 2
    finally:
        export.save_hf = original
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0], err
    assert not (tmp_path / "hf").exists() and not os.path.exists((tmp_path / "staged").read_text())


def test_an_export_replaces_an_earlier_export_whole(checkpoint, tmp_path):
    """Exporting again into an earlier export's directory replaces it: no file of the first
    (here one it never had, as a larger model's extra shard would be) is left beside the new one."""
    import os

    root, _, _ = checkpoint
    first = export.export_checkpoint(str(root / "checkpoints"), str(tmp_path / "hf"))
    assert "replaced" not in first and (tmp_path / "hf" / export.EXPORT_RECORD).exists()
    (tmp_path / "hf" / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    again = export.export_checkpoint(str(root / "checkpoints"), str(tmp_path / "hf"), dtype="bfloat16")
    assert again["replaced"] == [str(tmp_path / "hf")]
    assert not (tmp_path / "hf" / "model-00002-of-00002.safetensors").exists()
    assert json.loads((tmp_path / "hf" / export.EXPORT_RECORD).read_text())["dtype"] == "bfloat16"
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no staging directory left beside it


def test_export_skips_a_checkpoint_whose_meta_file_is_gone(tmp_path, caplog, capsys):
    """The newest checkpoint's meta file deleted: damage like any other, skipped with one warning
    for the one before (it stopped the export with exit 2)."""
    import os

    model, tok, trainer = tiny_trainer()
    directory = str(tmp_path / "checkpoints")
    with ckpt_lib.Checkpointer(directory, ckpt_lib.CheckpointConfig(async_save=False)) as c:
        for step in (6, 7):
            c.save(step, trainer.state, model_meta(model, tok))
    os.remove(os.path.join(directory, "7", "meta", "metadata"))
    with caplog.at_level("WARNING"):
        assert export.main(["--checkpoint", directory, "--out", str(tmp_path / "hf")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 6
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("rstarjax")]
    assert len(warnings) == 1 and f"checkpoint {directory}/7 does not restore (" in warnings[0], warnings


def test_a_runs_workdir_given_as_checkpoint_names_its_checkpoints(tmp_path):
    """``--checkpoint runs/stage3`` (the workdir): the refusal names ``runs/stage3/checkpoints``."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    r = subprocess.run([sys.executable, "-m", "rstarjax.export", "--checkpoint", str(tmp_path / "run"),
                        "--out", str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"give its checkpoints, --checkpoint {tmp_path / 'run' / 'checkpoints'}" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def untied_checkpoints(tmp_path_factory):
    """An untied run's step 7 (a trained lm_head), twice: with the meta's model_config, and
    without it (as an RL checkpoint of an older version: the architecture comes from outside)."""
    model, tok, trainer = tiny_trainer(tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("untied")
    meta = model_meta(model, tok)
    for name, kept in (("with_meta", meta), ("no_meta", {k: v for k, v in meta.items() if k != "model_config"})):
        with ckpt_lib.Checkpointer(str(root / name), ckpt_lib.CheckpointConfig(async_save=False)) as c:
            c.save(7, trainer.state, kept)
    untied = model.config.to_hf_dict()
    (root / "untied.json").write_text(json.dumps(untied))
    (root / "tied.json").write_text(json.dumps(dict(untied, tie_word_embeddings=True)))
    return root


def test_a_model_config_that_differs_from_the_meta_is_refused_naming_the_fields(untied_checkpoints, tmp_path,
                                                                               capsys):
    """--model_config saying tied for an untied run: exporting would drop the trained lm_head
    (transformers then ties the head to the embedding, other logits). One line naming the field,
    exit 2, nothing written; the config the meta records is accepted."""
    root = untied_checkpoints
    args = ["--checkpoint", str(root / "with_meta"), "--out", str(tmp_path / "hf"), "--model_config"]
    assert export.main(args + [str(root / "tied.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--model_config {root / 'tied.json'} does not match" in err[0], err
    assert "tie_word_embeddings (true vs false)" in err[0], err
    assert not (tmp_path / "hf").exists()
    assert export.main(args + [str(root / "untied.json")]) == 0
    assert not json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"]


def test_a_tied_config_for_an_untied_checkpoint_without_meta_config_is_refused_naming_lm_head(
        untied_checkpoints, tmp_path):
    """No model_config in the meta to compare with: the restore itself refuses to leave the
    checkpoint's lm_head behind (Orbax's partial restore read only what the tied model asked for)."""
    root = untied_checkpoints
    with pytest.raises(ValueError, match=r"holds params/lm_head/value, which the model restored onto lacks: "
                                         r"tie_word_embeddings=true would drop it"):
        export.export_checkpoint(str(root / "no_meta"), str(tmp_path / "hf"), model_config=str(root / "tied.json"))
    assert not (tmp_path / "hf").exists()
    out = export.export_checkpoint(str(root / "no_meta"), str(tmp_path / "hf"), model_config=str(root / "untied.json"))
    assert out["step"] == 7


def test_generation_stops_at_the_turn_end_the_policy_emits_for_a_base_config(tmp_path):
    """A policy built from a Base checkpoint keeps its config's eos <|endoftext|>, but ends its
    turns with <|im_end|> (the tokenizer's eos, where the engine stops): the export's
    generation_config names both, so transformers' generate() stops where our engine does."""
    from rstarjax.models import save_hf

    tok = load_tokenizer(1000)
    cfg = ModelConfig.preset("tiny", vocab_size=tok.num_tokens, dtype=jnp.float32, tie_word_embeddings=False,
                             bos_token_id=tok.endoftext_id, eos_token_id=tok.endoftext_id)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    # a model that always predicts <|im_end|>: the layers add nothing, every embedding is e0, and
    # only <|im_end|>'s row of the head reads e0
    model.layers.o_proj.set_value(jnp.zeros_like(model.layers.o_proj[...]))
    model.layers.down_proj.set_value(jnp.zeros_like(model.layers.down_proj[...]))
    e0 = jnp.zeros((cfg.hidden_size,)).at[0].set(1.0)
    model.embed.set_value(jnp.tile(e0, (cfg.vocab_size, 1)))
    model.lm_head.set_value(jnp.zeros((cfg.hidden_size, cfg.vocab_size)).at[0, tok.eos_id].set(10.0))
    save_hf(model, str(tmp_path / "hf"), tokenizer=tok)

    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_id, tok.endoftext_id] and gen["pad_token_id"] == tok.pad_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([[100, 200, 300]]), max_new_tokens=6, do_sample=False)
    assert out[0, 3:].tolist() == [tok.eos_id]
    # weights only (no tokenizer known): the config's own ids, as before
    save_hf(model, str(tmp_path / "weights"), tokenizer=False)
    gen = json.loads((tmp_path / "weights" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.endoftext_id and "pad_token_id" not in gen

"""A user's own HF model directory (``--config.model.hf_path``) that cannot be loaded as it is
gets one line naming the file and what is wrong (a ``ConfigError``: the run prints it and exits
2), never a traceback from inside JAX and never a silently different model: damaged or
incomplete safetensors, weights of the wrong kind, config.json settings the model would ignore,
a tokenizer that is not the model's."""
import json
import os
import re
import shutil
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from rstarjax.models import load_hf
from rstarjax.models.hf import SafetensorsFile, write_safetensors
from rstarjax.models.tokenizer import (QWEN3_ADDED_TOKENS, load_tokenizer, load_tokenizer_for,
                                       saved_num_regular_tokens)
from rstarjax.validation import ConfigError

N_REGULAR = 256  # the smallest tokenizer variant: 282 tokens, a 384-row table
VOCAB = 384


def _save_tiny(path, tie: bool, max_shard_size: str = "5GB"):
    """A tiny transformers Qwen3 (random weights) with our small tokenizer, as a user brings it."""
    import torch
    import transformers

    tok = load_tokenizer(N_REGULAR)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   tie_word_embeddings=tie, max_position_embeddings=256,
                                   bos_token_id=tok.endoftext_id, eos_token_id=tok.eos_id)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(str(path), max_shard_size=max_shard_size)
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_dirs")
    return {"untied": _save_tiny(root / "untied", tie=False),
            "tied": _save_tiny(root / "tied", tie=True),
            "sharded": _save_tiny(root / "sharded", tie=True, max_shard_size="20KB")}


def _copy(dirs, kind, tmp_path):
    return shutil.copytree(dirs[kind], tmp_path / kind)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _tensors(file):
    """Every tensor of a safetensors file, copied out of its memory map."""
    st = SafetensorsFile(str(file))
    return {k: np.array(st[k]) for k in st.keys()}


def _edit_tensors(path, change):
    """Rewrite model.safetensors with ``change(tensors)`` applied."""
    tensors = _tensors(path / "model.safetensors")
    change(tensors)
    write_safetensors(str(path / "model.safetensors"), tensors)


def _edit_header(file, change):
    """Rewrite a safetensors file's header with ``change(header)`` applied, the data kept."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def _refused(path, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_hf(str(path), dtype=jnp.float32)
    assert "\n" not in str(info.value)
    return str(info.value)


def _shards(path):
    return sorted(p for p in path.iterdir() if p.name.startswith("model-"))


# ---- the weights ----------------------------------------------------------------------------
def test_good_directories_load(dirs):
    for kind in dirs:
        model = load_hf(str(dirs[kind]), dtype=jnp.float32)
        assert model.config.tie_word_embeddings == (kind != "untied")


def test_a_truncated_shard_is_refused_naming_it(dirs, tmp_path):
    path = _copy(dirs, "sharded", tmp_path)
    shard = _shards(path)[2]
    with open(shard, "r+b") as f:  # cut in half, as an interrupted download leaves it
        f.truncate(os.path.getsize(shard) // 2)
    message = _refused(path, "truncated")
    assert str(shard) in message


def test_a_missing_shard_is_refused_naming_the_index(dirs, tmp_path):
    path = _copy(dirs, "sharded", tmp_path)
    shard = _shards(path)[1]
    os.remove(shard)
    _refused(path, rf"model\.safetensors\.index\.json: names {shard.name}, which is missing")


def test_a_tensor_the_index_forgot_is_read_from_its_shard(dirs, tmp_path):
    """transformers reads whole shards, and the pre-run check reads the headers: so do we."""
    path = _copy(dirs, "sharded", tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.0.mlp.gate_proj.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_hf(str(path), dtype=jnp.float32)
    ref = load_hf(str(dirs["sharded"]), dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(loaded.layers.gate_proj[...]), np.asarray(ref.layers.gate_proj[...]))


def test_a_tensor_in_two_shards_is_refused(dirs, tmp_path):
    path = _copy(dirs, "sharded", tmp_path)
    first, last = _shards(path)[0], _shards(path)[-1]
    tensors = _tensors(last)
    name, value = sorted(_tensors(first).items())[0]
    tensors[name] = value
    write_safetensors(str(last), tensors)
    _refused(path, rf"tensor '{name}' is in both {first.name} and {last.name}")


def test_a_directory_with_both_a_single_file_and_an_index_is_refused(dirs, tmp_path):
    """transformers loads model.safetensors and ignores the index beside it: reading the index's
    shards would run other weights (here another model's) than the same directory gives it."""
    from rstarjax.models.hf_check import model_dir_problems

    path = _copy(dirs, "sharded", tmp_path)
    shutil.copy(dirs["tied"] / "model.safetensors", path / "model.safetensors")
    message = "holds both model.safetensors and model.safetensors.index.json; transformers would load " \
              "model.safetensors: remove one"
    assert _refused(path, re.escape(message)).startswith(str(path))
    assert model_dir_problems(str(path), num_regular_tokens=N_REGULAR) == [message]


def _alias(header):  # layer 1's q_proj pointed at layer 0's bytes
    header["model.layers.1.self_attn.q_proj.weight"]["data_offsets"] = \
        header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"]


def _shift_back(header):  # layer 1's q_proj starts 8 bytes early: it overlaps the tensor before it
    header["model.layers.1.self_attn.q_proj.weight"]["data_offsets"] = [
        x - 8 for x in header["model.layers.1.self_attn.q_proj.weight"]["data_offsets"]]


@pytest.mark.parametrize("change, match", [
    (_alias, (r"starts at byte \d+ of the data, inside 'model\.layers\.0\.self_attn\.q_proj\.weight' "
              r"\(which ends at \d+\): overlapping or aliased data_offsets")),
    (_shift_back, r"inside '[^']+' \(which ends at \d+\): overlapping or aliased data_offsets"),
])
def test_tensors_that_share_bytes_are_refused_naming_the_file_and_tensor(dirs, tmp_path, change, match):
    """The safetensors library refuses a file whose tensors do not tile its data ("invalid
    offset"), so transformers cannot load it; we loaded one weight from another's bytes."""
    from rstarjax.models.hf_check import model_dir_problems

    path = _copy(dirs, "untied", tmp_path)
    _edit_header(path / "model.safetensors", change)
    message = _refused(path, match)
    assert message.startswith(f"{path / 'model.safetensors'}: tensor 'model.layers.1.self_attn.q_proj.weight' ")
    [problem] = model_dir_problems(str(path), num_regular_tokens=N_REGULAR)
    assert problem.startswith("model.safetensors: tensor 'model.layers.1.self_attn.q_proj.weight' ") and \
        re.search(match, problem), problem


def test_bytes_no_tensor_holds_are_refused(dirs, tmp_path):
    """Past the last tensor, or between two (the last one moved 8 bytes on): the safetensors
    library refuses both."""
    path = _copy(dirs, "untied", tmp_path)
    with open(path / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    _refused(path, r"model\.safetensors: the last tensor, '[^']+', ends at byte \d+ of the data but the file "
                   r"holds \d+ bytes of data: bytes past the last tensor")

    def move_last_on(header):
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
        header[last]["data_offsets"] = [x + 8 for x in header[last]["data_offsets"]]
    _edit_header(path / "model.safetensors", move_last_on)
    _refused(path, r"starts at byte \d+ of the data, but the tensor before it, '[^']+', ends at \d+: a gap in "
                   "data_offsets")


@pytest.mark.parametrize("dtype", [np.int8, np.bool_])
def test_a_weight_of_an_integer_dtype_is_refused(dirs, tmp_path, dtype):
    """An int8 / bool tensor under a weight's name (a quantized or damaged file) was cast to
    float and loaded: a silently wrong model."""
    path = _copy(dirs, "untied", tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    _edit_tensors(path, lambda t: t.__setitem__(name, (t[name] * 100).astype(dtype)))
    _refused(path, rf"tensor '{re.escape(name)}' is (I8|BOOL), not a float dtype")


def test_a_dtype_this_loader_cannot_read_is_refused_at_the_header(dirs, tmp_path):
    path = _copy(dirs, "untied", tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"

    def to_fp8(header):  # the same bytes per element as U8: a valid file of an unknown dtype
        header[name]["dtype"] = "F8_E4M3"
    _edit_tensors(path, lambda t: t.__setitem__(name, t[name].astype(np.uint8)))
    _edit_header(path / "model.safetensors", to_fp8)
    _refused(path, r"has dtype 'F8_E4M3', which this loader does not read")


def test_a_tied_config_with_a_different_lm_head_is_refused(dirs, tmp_path):
    """transformers 5 keeps such a head (untied), 4.x drops it: we tied it silently."""
    path = _copy(dirs, "untied", tmp_path)
    _edit_config(path, tie_word_embeddings=True)
    _refused(path, "tie_word_embeddings=true, but the checkpoint's lm_head.weight differs")


def test_a_tied_config_with_a_copy_of_the_embedding_loads(dirs, tmp_path):
    path = _copy(dirs, "untied", tmp_path)
    _edit_tensors(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].copy()))
    _edit_config(path, tie_word_embeddings=True)
    assert load_hf(str(path), dtype=jnp.float32).config.tie_word_embeddings


def test_a_missing_lm_head_names_tie_word_embeddings(dirs, tmp_path):
    path = _copy(dirs, "tied", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["tie_word_embeddings"]  # transformers' default is false: an lm_head is needed
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KeyError, match="lm_head.weight"):  # still a KeyError
        load_hf(str(path))
    _refused(path, "tie_word_embeddings=false")


def test_a_directory_with_only_pytorch_weights_names_them(dirs, tmp_path):
    path = _copy(dirs, "untied", tmp_path)
    os.remove(path / "model.safetensors")
    (path / "pytorch_model.bin").write_bytes(b"\0" * 64)
    _refused(path, r"only \['pytorch_model\.bin'\]: only safetensors are read")


# ---- config.json ----------------------------------------------------------------------------
@pytest.mark.parametrize("changes, match", [
    # transformers 5 applies a rope_scaling next to its own default rope_parameters
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
     "field 'rope_scaling' has rope_type='yarn'"),
    (dict(rope_scaling={"type": "linear", "factor": 4.0}), "rope_type='linear'"),
    (dict(rope_scaling={"factor": 4.0}), "has no rope_type"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=64),
     r"'layer_types' has \['sliding_attention'\] layers"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantized checkpoints are unsupported"),
    (dict(vocab_size=str(VOCAB)), "'vocab_size'='384' must be a positive integer"),
    (dict(tie_word_embeddings="false"), "'tie_word_embeddings'='false' must be true or false"),
    (dict(rope_parameters="default"), "'rope_parameters'='default' is not an object"),
    # per layer type (transformers' nested form): no Qwen2/3 model reads it; its theta was dropped
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     r"'rope_parameters' holds parameters per layer type \(\['full_attention'\]\)"),
])
def test_a_config_setting_the_model_would_ignore_is_refused(dirs, tmp_path, changes, match):
    path = _copy(dirs, "untied", tmp_path)
    _edit_config(path, **changes)
    message = _refused(path, match)
    assert message.startswith(str(path / "config.json"))
    from rstarjax.models.hf_check import model_dir_problems  # the start check says so too, first
    [problem] = model_dir_problems(str(path))
    assert problem.startswith("config.json ") and re.search(match, problem), problem


@pytest.mark.parametrize("text, match", [("{not json", "not JSON"), ("[]", "not a JSON object")])
def test_a_config_that_is_not_a_json_object_is_refused(dirs, tmp_path, text, match):
    path = _copy(dirs, "untied", tmp_path)
    (path / "config.json").write_text(text)
    assert _refused(path, match).startswith(str(path / "config.json"))


# ---- the tokenizer --------------------------------------------------------------------------
def _edit_tokenizer(path, change):
    data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    change(data)
    (path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")


def _swap_first_added(data):
    a = data["added_tokens"]
    a[1]["content"], a[2]["content"] = a[2]["content"], a[1]["content"]


@pytest.mark.parametrize("change, match", [
    # a token we do not know: our encoder would split it, the model learnt it as one id
    (lambda d: d["added_tokens"].append({"id": N_REGULAR + len(QWEN3_ADDED_TOKENS), "content": "<reason>"}),
     "has added token '<reason>' at id 282"),
    (_swap_first_added, "has added token '<|im_end|>' at id 257; Qwen3 has '<|im_start|>' there"),
    # another BPE of the same size
    (lambda d: d["model"].update(vocab={f"piece{i}": i for i in range(N_REGULAR)}), "another model's tokenizer"),
])
def test_a_tokenizer_that_is_not_qwens_is_refused(dirs, tmp_path, change, match):
    path = _copy(dirs, "untied", tmp_path)
    _edit_tokenizer(path, change)
    for load in (saved_num_regular_tokens, load_tokenizer_for):
        with pytest.raises(ConfigError, match=re.escape(match) if "|" in match else match):
            load(str(path))


@pytest.mark.parametrize("text", ["{", "[]"])
def test_a_tokenizer_file_that_is_not_a_json_object_names_it(dirs, tmp_path, text):
    path = _copy(dirs, "untied", tmp_path)
    (path / "tokenizer.json").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(str(path / "tokenizer.json"))):
        load_tokenizer_for(str(path))


def test_a_tokenizer_whose_ids_are_shifted_against_the_model_is_refused(dirs, tmp_path):
    """A model trained with a 512-token tokenizer (its <|endoftext|> at 512, a 640-row table)
    next to a 256-token tokenizer.json: every size check passes, every special id is wrong."""
    path = _copy(dirs, "untied", tmp_path)
    big = load_tokenizer(512)
    _edit_config(path, vocab_size=big.vocab_size, bos_token_id=big.endoftext_id, eos_token_id=big.eos_id)
    with pytest.raises(ConfigError, match="bos_token_id=512 is no special token .* not the model's"):
        load_tokenizer_for(str(path))
    assert len(load_tokenizer_for(str(path), num_regular_tokens=512)) == big.num_tokens  # the right one
    # the tokenizer kept apart (model.tokenizer_path): checked against the model's config.json too
    from rstarjax.recipes import build
    from rstarjax.recipes.config import ModelSource
    apart = tmp_path / "tokenizer"
    apart.mkdir()
    shutil.copy(path / "tokenizer.json", apart / "tokenizer.json")
    with pytest.raises(ConfigError, match="bos_token_id=512 is no special token"):
        build.tokenizer(ModelSource(hf_path=str(path), tokenizer_path=str(apart)))


def test_qwen_tokenizers_still_load(dirs, tmp_path):
    """Ours, and a Qwen2.5-style file (a prefix of Qwen3's added tokens: no <think>)."""
    path = _copy(dirs, "untied", tmp_path)
    assert load_tokenizer_for(str(path)).num_regular_tokens == N_REGULAR
    _edit_tokenizer(path, lambda d: d.update(added_tokens=d["added_tokens"][:22]))
    assert saved_num_regular_tokens(str(path)) == N_REGULAR


@pytest.mark.parametrize("fields", [
    # rope_scaling, when a non-empty object, replaces rope_parameters whole (theta included)
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_scaling={"rope_type": "default"}),
    dict(rope_theta=1e6, rope_scaling={"rope_type": "default", "rope_theta": 5e5}),
    dict(rope_theta=2e5, rope_parameters={"rope_type": "default"}),
    dict(rope_theta=3e5, rope_parameters={"rope_type": "default", "rope_theta": 7e5}),
    dict(rope_scaling=None, rope_parameters=None),
])
def test_rope_theta_is_the_one_transformers_runs(fields):
    """Which theta a config.json means, against transformers' own reading of the same fields."""
    import transformers

    from rstarjax.models.config import ModelConfig
    hf = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=VOCAB, hidden_size=64,
              intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, **{k: v for k, v in fields.items() if v is not None})
    want = transformers.Qwen3Config.from_dict(dict(hf)).rope_parameters["rope_theta"]
    assert ModelConfig.from_hf_dict(dict(hf)).rope_theta == pytest.approx(want)

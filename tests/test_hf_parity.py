"""Parity with HuggingFace transformers (PyTorch CPU fp32, random weights): load_hf of a
save_pretrained checkpoint, save_hf -> AutoModelForCausalLM.from_pretrained, packed segments,
and cached decode, all against the torch model's logits."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dense_decode import KVCache, dense_decode  # noqa: E402
from rstarjax.models import load_hf, save_hf  # noqa: E402
from rstarjax.models.hf import SafetensorsFile, write_safetensors  # noqa: E402

ATOL = 1e-4
VOCAB = 320

CONFIGS = {
    # tied embeddings, GQA ratio 2, head_dim = hidden / heads
    "qwen3_tied": (transformers.Qwen3Config, dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, tie_word_embeddings=True)),
    # untied, GQA ratio 4, head_dim (24) != hidden / heads (8)
    "qwen3_untied_gqa4": (transformers.Qwen3Config, dict(
        hidden_size=64, intermediate_size=80, num_attention_heads=8, num_key_value_heads=2,
        head_dim=24, tie_word_embeddings=False, rope_theta=5000.0)),
    # GQA ratio 1 (MHA)
    "qwen3_mha": (transformers.Qwen3Config, dict(
        hidden_size=48, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        head_dim=12, tie_word_embeddings=False)),
    # Qwen2.5: q/k/v biases, no q/k norm
    "qwen2": (transformers.Qwen2Config, dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
        tie_word_embeddings=False, rms_norm_eps=1e-5)),
}

# The two layouts most different from each other (GQA 4 + head_dim != hidden/heads; biases).
DECODE_CONFIGS = ("qwen3_untied_gqa4", "qwen2")


def _torch_model(name, seed=0):
    cls, kw = CONFIGS[name]
    cfg = cls(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=512, **kw)
    model_cls = transformers.Qwen2ForCausalLM if cls is transformers.Qwen2Config \
        else transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(cfg).eval().float()
    with torch.no_grad():  # non-trivial weights everywhere, norms away from 1, biases nonzero
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def _jit_forward(model):
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, t, p, s: nnx.merge(graphdef, st)(t, p, s))
    return lambda t, p=None, s=None: np.asarray(fwd(state, jnp.asarray(t, jnp.int32), p, s))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(torch model, our load_hf of its save_pretrained, checkpoint dir)."""
    tmodel = _torch_model(request.param)
    path = str(tmp_path_factory.mktemp(request.param))
    # Small shards so the sharded + index path is the one exercised.
    tmodel.save_pretrained(path, max_shard_size="40KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    return request.param, tmodel, load_hf(path, dtype=jnp.float32), path


def test_load_hf_logits_match_transformers(pair):
    _, tmodel, model, _ = pair
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, VOCAB, (3, 19))
    tokens[1, :] = tokens[1, 0]  # a repeated-token row
    ref, out = _torch_logits(tmodel, tokens), _jit_forward(model)(tokens)
    assert np.abs(ref).max() > 0.5  # logits are not trivially small
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0)


def test_packed_segments_match_separate_transformers_runs(pair):
    _, tmodel, model, _ = pair
    rng = np.random.RandomState(1)
    lens = [6, 9, 3]
    seqs = [rng.randint(0, VOCAB, n) for n in lens]
    packed = np.zeros((1, 20), np.int32)
    pos = np.zeros((1, 20), np.int32)
    seg = np.zeros((1, 20), np.int32)
    start = 0
    for k, s in enumerate(seqs):
        packed[0, start:start + len(s)], pos[0, start:start + len(s)] = s, np.arange(len(s))
        seg[0, start:start + len(s)] = k + 1
        start += len(s)
    out = _jit_forward(model)(packed, jnp.asarray(pos), jnp.asarray(seg))
    start = 0
    for s in seqs:
        np.testing.assert_allclose(out[0, start:start + len(s)], _torch_logits(tmodel, s[None])[0],
                                   atol=ATOL, rtol=0)
        start += len(s)


def test_save_hf_round_trips_through_transformers(pair, tmp_path):
    name, tmodel, model, _ = pair
    save_hf(model, str(tmp_path), tokenizer=False, max_shard_bytes=30_000)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1
    gen = json.load(open(tmp_path / "generation_config.json"))
    assert "eos_token_id" in gen
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                                 dtype=torch.float32).eval()
    assert type(reloaded) is type(tmodel)
    tokens = np.random.RandomState(2).randint(0, VOCAB, (2, 11))
    np.testing.assert_allclose(_torch_logits(reloaded, tokens), _torch_logits(tmodel, tokens),
                               atol=1e-6, rtol=0)
    # Every torch tensor is reproduced exactly (tied head included via the embedding).
    ref_sd, got_sd = tmodel.state_dict(), reloaded.state_dict()
    for k, v in ref_sd.items():
        np.testing.assert_array_equal(got_sd[k].numpy(), v.numpy(), err_msg=k)


def test_decode_chunked_matches_transformers(pair):
    """Prefill in chunks of 4 (mixed row lengths, junk padding) then token by token."""
    name, tmodel, model, _ = pair
    if name not in DECODE_CONFIGS:
        pytest.skip("decode parity runs on the GQA-4 and Qwen2 configs only (compile time)")
    cfg = model.config
    rng = np.random.RandomState(3)
    prompt_lens, steps, chunk = [7, 2, 5], 3, 4
    seqs = [rng.randint(0, VOCAB, n + steps) for n in prompt_lens]
    graphdef, state = nnx.split(model)
    dec = jax.jit(lambda st, t, c, n: dense_decode(nnx.merge(graphdef, st), t, c, n))
    cache = KVCache.init(cfg, batch=3, max_len=16, dtype=jnp.float32)
    got, done = [[] for _ in seqs], [0, 0, 0]
    while any(d < n for d, n in zip(done, prompt_lens)):
        tokens = rng.randint(0, VOCAB, (3, chunk))
        num_new = np.array([min(chunk, n - d) for d, n in zip(done, prompt_lens)], np.int32)
        for r in range(3):
            tokens[r, :num_new[r]] = seqs[r][done[r]:done[r] + num_new[r]]
        logits, cache = dec(state, jnp.asarray(tokens, jnp.int32), cache, jnp.asarray(num_new))
        for r in range(3):
            got[r] += list(np.asarray(logits[r, :num_new[r]]))
            done[r] += int(num_new[r])
    for s in range(steps):
        tokens = np.array([[seq[n + s]] for seq, n in zip(seqs, prompt_lens)], np.int32)
        logits, cache = dec(state, jnp.asarray(tokens), cache, jnp.ones(3, jnp.int32))
        for r in range(3):
            got[r].append(np.asarray(logits[r, 0]))
    for r in range(3):
        np.testing.assert_allclose(np.stack(got[r]), _torch_logits(tmodel, seqs[r][None])[0],
                                   atol=ATOL, rtol=0)


# ---- errors ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single_file_ckpt(tmp_path_factory):
    tmodel = _torch_model("qwen3_tied")
    path = tmp_path_factory.mktemp("single")
    tmodel.save_pretrained(str(path))
    return path


def _copy_ckpt(src, dst, drop=None, config_edit=None):
    dst.mkdir(exist_ok=True)
    st = SafetensorsFile(str(src / "model.safetensors"))
    write_safetensors(str(dst / "model.safetensors"),
                      {k: np.array(st[k]) for k in st.keys() if k != drop})
    cfg = json.load(open(src / "config.json"))
    cfg.update(config_edit or {})
    json.dump(cfg, open(dst / "config.json", "w"))


def test_single_file_checkpoint_loads(single_file_ckpt):
    model = load_hf(str(single_file_ckpt), dtype=jnp.float32)
    tmodel = transformers.AutoModelForCausalLM.from_pretrained(str(single_file_ckpt)).float()
    tokens = np.arange(10)[None] * 7 % VOCAB
    np.testing.assert_allclose(_jit_forward(model)(tokens), _torch_logits(tmodel, tokens),
                               atol=ATOL, rtol=0)


def test_structure_only_load_reads_no_tensor_but_checks_the_headers(single_file_ckpt, tmp_path,
                                                                    monkeypatch):
    """``read_weights=False`` (a run whose checkpoint replaces every parameter): the loaded
    model's shapes, dtypes and shardings, zeros for values, no tensor data read; a checkpoint
    that does not fit the config is still refused."""
    from jax.sharding import Mesh

    from rstarjax.models import hf as hf_lib

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2, 1), ("data", "fsdp", "tensor"))
    full = nnx.state(load_hf(str(single_file_ckpt), mesh=mesh), nnx.Param)

    def no_read(*args, **kwargs):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(hf_lib, "_read_slice", no_read)
    shell = nnx.state(load_hf(str(single_file_ckpt), mesh=mesh, read_weights=False), nnx.Param)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(shell), strict=True):
        assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding)
        assert not np.any(np.asarray(b))
    _copy_ckpt(single_file_ckpt, tmp_path, config_edit={"intermediate_size": 100})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight"):
        load_hf(str(tmp_path), read_weights=False)


def test_missing_tensor_is_named(single_file_ckpt, tmp_path):
    _copy_ckpt(single_file_ckpt, tmp_path, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(str(tmp_path))


def test_shape_mismatch_is_named(single_file_ckpt, tmp_path):
    _copy_ckpt(single_file_ckpt, tmp_path, config_edit={"intermediate_size": 100})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight"):
        load_hf(str(tmp_path))


def test_unsupported_architecture_is_named(single_file_ckpt, tmp_path):
    _copy_ckpt(single_file_ckpt, tmp_path, config_edit={"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="architectures"):
        load_hf(str(tmp_path))


def test_a_config_without_head_dim_means_what_it_means_to_transformers(tmp_path):
    """Qwen3Config's head_dim defaults to 128 whatever hidden_size / heads is (here 16): a Qwen3
    config.json without the field is that model, not one of hidden / heads. Qwen2Config has no such
    field: hidden / heads."""
    from rstarjax.models import ModelConfig

    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    del written["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(written))
    tmodel = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert tmodel.model.layers[0].self_attn.head_dim == transformers.Qwen3Config().head_dim == 128
    model = load_hf(str(tmp_path), dtype=jnp.float32)
    assert model.config.head_dim == 128
    tokens = np.arange(10)[None] * 7 % VOCAB
    np.testing.assert_allclose(_jit_forward(model)(tokens), _torch_logits(tmodel, tokens), atol=ATOL, rtol=0)
    qwen2 = transformers.Qwen2Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2).to_dict()
    qwen2.pop("head_dim", None)
    assert ModelConfig.from_hf_dict(dict(qwen2, architectures=["Qwen2ForCausalLM"])).head_dim == 8


def test_missing_weights_file_is_clear(tmp_path):
    json.dump({"architectures": ["Qwen3ForCausalLM"]}, open(tmp_path / "config.json", "w"))
    with pytest.raises((FileNotFoundError, ValueError)):
        load_hf(str(tmp_path))


def test_bf16_checkpoint_loads_without_torch_conversion(single_file_ckpt, tmp_path):
    tmodel = transformers.AutoModelForCausalLM.from_pretrained(str(single_file_ckpt),
                                                               dtype=torch.bfloat16)
    tmodel.save_pretrained(str(tmp_path))
    model = load_hf(str(tmp_path), dtype=jnp.float32)
    ref = tmodel.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(model.embed[...]), ref)

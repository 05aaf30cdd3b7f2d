"""Sharding on 8 simulated CPU devices (tests/conftest.py): params carry the intended specs,
sharded forward + grad equal the single-device result, load_hf places tensors on the mesh."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from rstarjax.models import ModelConfig, Qwen3, load_hf, save_hf
from rstarjax.models.sharding import batch_sharding, logical_to_spec, make_mesh, shard_model, state_shardings

CFG = ModelConfig.preset("tiny", dtype=jnp.float32, tie_word_embeddings=False)

# Hand-written expectations for a (data=2, fsdp=2, tensor=2) mesh.
EXPECTED_SPECS = {
    ("embed",): P("tensor", "fsdp"),
    ("lm_head",): P("fsdp", "tensor"),
    ("final_norm",): P(None),
    ("layers", "q_proj"): P(None, "fsdp", "tensor"),
    ("layers", "k_proj"): P(None, "fsdp", "tensor"),
    ("layers", "o_proj"): P(None, "tensor", "fsdp"),
    ("layers", "gate_proj"): P(None, "fsdp", "tensor"),
    ("layers", "down_proj"): P(None, "tensor", "fsdp"),
    ("layers", "q_norm"): P(None, None),
    ("layers", "input_norm"): P(None, None),
}


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")
    return make_mesh(data=2, fsdp=2, tensor=2)


def _specs(model):
    return {path: var[...].sharding.spec for path, var in nnx.to_flat_state(nnx.state(model))}


def _norm(spec):  # P(None, None) and P() describe the same placement
    return tuple(spec) + (None,) * 4


def test_make_mesh_shapes_and_errors():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    assert dict(make_mesh(fsdp=-1, tensor=2).shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    with pytest.raises(ValueError, match="devices"):
        make_mesh(data=3, fsdp=1, tensor=1)


def test_placed_params_carry_intended_shardings(mesh):
    model = shard_model(Qwen3(CFG, rngs=nnx.Rngs(0)), mesh)
    specs = _specs(model)
    for path, want in EXPECTED_SPECS.items():
        assert _norm(specs[path])[:4] == _norm(want)[:4], path
    # A sharded leaf really is split: each device holds 1/4 of q_proj (fsdp x tensor).
    q = model.layers.q_proj[...]
    assert q.addressable_shards[0].data.shape == (2, 32, 32)
    # Same values as building on one device with the same seed.
    ref = Qwen3(CFG, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(q), np.asarray(ref.layers.q_proj[...]), rtol=1e-6)


def test_indivisible_dims_are_replicated(mesh):
    assert logical_to_spec(("layers", "embed", "mlp"), (2, 6, 7), mesh) == P(None, "fsdp", None)
    assert logical_to_spec(("batch", "seq"), (4, 3), mesh) == P(("data", "fsdp"), None)
    assert logical_to_spec(("batch", "seq"), (2, 3), mesh) == P("data", None)
    with pytest.raises(ValueError, match="no sharding rule"):
        logical_to_spec(("nonsense",), (4,), mesh)


def test_sharded_forward_and_grad_equal_single_device(mesh):
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, CFG.vocab_size, (4, 16)), jnp.int32)
    segments = jnp.asarray(np.repeat([[1] * 10 + [2] * 6], 4, 0), jnp.int32)

    def loss_fn(model, tokens, segments):
        logits = model(tokens, segment_ids=segments)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]),
                                             tokens[:, 1:, None], -1))

    ref_model = Qwen3(CFG, rngs=nnx.Rngs(1))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(
        lambda st, t, s: loss_fn(nnx.merge(nnx.graphdef(ref_model), st), t, s)))(
        nnx.state(ref_model), tokens, segments)

    model = shard_model(Qwen3(CFG, rngs=nnx.Rngs(1)), mesh)
    graphdef, state = nnx.split(model)
    state_sh, data_sh = state_shardings(nnx.state(model), mesh), batch_sharding(mesh)
    step = jax.jit(jax.value_and_grad(lambda st, t, s: loss_fn(nnx.merge(graphdef, st), t, s)),
                   in_shardings=(state_sh, data_sh, data_sh), out_shardings=(None, state_sh))
    with jax.set_mesh(mesh):  # activates the activation sharding constraints
        loss, grads = step(state, jax.device_put(tokens, data_sh),
                           jax.device_put(segments, data_sh))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    flat_ref = dict(nnx.to_flat_state(ref_grads))
    for path, g in nnx.to_flat_state(grads):
        np.testing.assert_allclose(np.asarray(g[...]), np.asarray(flat_ref[path][...]),
                                   atol=1e-6, rtol=1e-4, err_msg=str(path))
    assert grads["layers"]["gate_proj"][...].sharding.spec == P(None, "fsdp", "tensor")


def test_load_hf_places_tensors_on_mesh(mesh, tmp_path):
    ref = Qwen3(CFG, rngs=nnx.Rngs(2))
    save_hf(ref, str(tmp_path), tokenizer=False, max_shard_bytes=50_000)
    model = load_hf(str(tmp_path), dtype=jnp.float32, mesh=mesh)
    specs = _specs(model)
    for path, want in EXPECTED_SPECS.items():
        assert _norm(specs[path])[:4] == _norm(want)[:4], path
    for path, var in nnx.to_flat_state(nnx.state(ref)):
        got = dict(nnx.to_flat_state(nnx.state(model)))[path][...]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(var[...]), err_msg=str(path))
    assert isinstance(model.embed[...].sharding, NamedSharding)


def test_every_mesh_is_built_by_device_mesh():
    """One mesh builder (issue 49): no module but models/sharding.py calls ``Mesh(...)``, and a
    mesh described for another process (a rollout process's slice) comes back as the same mesh."""
    import io
    import pathlib
    import tokenize

    from rstarjax.models.sharding import describe_mesh, device_mesh, mesh_from_description

    package = pathlib.Path(__file__).resolve().parent.parent / "rstarjax"
    callers = []
    for path in sorted(package.rglob("*.py")):
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                  if t.type in (tokenize.NAME, tokenize.OP)]
        if any(a.string == "Mesh" and b.string == "(" for a, b in zip(tokens, tokens[1:])):
            callers.append(str(path.relative_to(package)))
    assert callers == ["models/sharding.py"]
    mesh = device_mesh(np.array(jax.devices()[:4]).reshape(2, 2)[::-1], ("data", "tensor"))
    described = describe_mesh(mesh)
    assert described["devices"] == [2, 3, 0, 1] and tuple(described["shape"]) == (2, 2)
    assert mesh_from_description(described) == mesh

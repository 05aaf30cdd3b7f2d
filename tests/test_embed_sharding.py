"""The embedding lookup on data x fsdp meshes (8 simulated CPU devices, tests/conftest.py).

The table is [V, D] with D over fsdp; the activations are rows over (data, fsdp). A lookup that
goes straight for that layout makes XLA gather a whole micro-batch activation onto every
device (forward and in the table's scatter-add gradient), across hosts when data spans them.
Here: no float all-gather of a [B, T, ...] activation in the compiled forward + backward, and
the same loss and gradients (tied table included) as one device."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.models import ModelConfig, Qwen3
from rstarjax.models.sharding import batch_sharding, make_mesh, shard_model, state_shardings

CFG = ModelConfig.preset("tiny", dtype=jnp.float32)  # tied LM head: the table's second use
B, T = 8, 16  # one row per device on 8 devices


def _loss(model, tokens):
    logits = model(tokens)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))


def _tokens():
    return jnp.asarray(np.random.RandomState(0).randint(0, CFG.vocab_size, (B, T)), jnp.int32)


def _sharded_step(mesh):
    model = shard_model(Qwen3(CFG, rngs=nnx.Rngs(1)), mesh)
    graphdef, state = nnx.split(model)
    state_sh, data_sh = state_shardings(state, mesh), batch_sharding(mesh)
    step = jax.jit(jax.value_and_grad(lambda st, t: _loss(nnx.merge(graphdef, st), t)),
                   in_shardings=(state_sh, data_sh), out_shardings=(None, state_sh))
    return step, state, jax.device_put(_tokens(), data_sh)


def activation_all_gathers(hlo: str) -> list[str]:
    """Float all-gather results shaped like a whole micro-batch activation [B, T, ...]."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) all-gather(?:-start)?\(", line)
        if m:
            found += re.findall(rf"(?:f32|bf16|f16)\[{B},{T},[\d,]*\]", m.group(1))
    return found


@pytest.fixture(autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")


@pytest.mark.parametrize("shape", [(2, 4, 1), (4, 2, 1), (1, 8, 1), (1, 4, 2)])
def test_forward_backward_gathers_no_activation(shape):
    mesh = make_mesh(*shape)
    step, state, tokens = _sharded_step(mesh)
    with jax.set_mesh(mesh):
        hlo = step.lower(state, tokens).compile().as_text()
    assert activation_all_gathers(hlo) == [], shape


def test_data_by_fsdp_loss_and_grads_equal_one_device():
    ref = Qwen3(CFG, rngs=nnx.Rngs(1))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(
        lambda st, t: _loss(nnx.merge(nnx.graphdef(ref), st), t)))(nnx.state(ref), _tokens())
    mesh = make_mesh(2, 4, 1)
    step, state, tokens = _sharded_step(mesh)
    with jax.set_mesh(mesh):
        loss, grads = step(state, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    flat_ref = dict(nnx.to_flat_state(ref_grads))
    for path, g in nnx.to_flat_state(grads):
        np.testing.assert_allclose(np.asarray(g[...]), np.asarray(flat_ref[path][...]),
                                   atol=1e-6, rtol=1e-4, err_msg=str(path))

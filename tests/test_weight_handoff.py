"""The weight hand-off (docs/serving.md "Weight hand-off"): the trainer's float32 FSDP params go
into every serving slice's layout and the serving dtype once per update, device to device.

Against an outside reference: the serving copy equals numpy's cast of the gathered params (bf16
rounding is exact), each array is placed with the slice's own shardings, no jax.Array is read
back to the host on the way, and the decode program compiled for the handed-off weights
gathers and converts no weight. ``Engine.release_memory`` frees the serving copy and the KV
pool (``serving.release_during_update``) and the next hand-off makes both again, with rollouts
token-identical to an engine that never released."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax._src import array as array_lib
from jax.sharding import NamedSharding

from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3, serving_weight_specs
from rstarjax.models.sharding import make_mesh, state_shardings
from rstarjax.serving import Engine, SamplingParams, StartRequest
from rstarjax.serving import handoff
from rstarjax.serving.programs import decode_program, feed_program, insert_program, sample_program
from rstarjax.serving.slices import slice_meshes

MAX_LEN = 48
LAYOUTS = [(1, 8), (2, 4), (8, 1)]  # slices x tensor_parallel over the 8 devices


def _model(seed: int = 0) -> Qwen3:
    cfg = ModelConfig.preset("tiny", dtype=jnp.bfloat16, num_attention_heads=8,
                             num_key_value_heads=8)
    model = Qwen3(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    # f32 params as the trainer keeps them, large enough that greedy continuations vary
    leaves = [np.asarray(jax.random.normal(k, x.shape, jnp.float32)) * 0.35
              for k, x in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def _fsdp_state(model: Qwen3):
    """The model state as the trainer holds it: float32, split over all 8 devices (fsdp)."""
    _, state = nnx.split(model)
    mesh = make_mesh(1, -1, 1)
    return jax.device_put(state, state_shardings(state, mesh))


def _engines(model, slices: int, tp: int) -> list[Engine]:
    return [Engine(model, mesh=mesh, max_len=MAX_LEN, num_slots=2, page_size=8,
                   buckets=(16, 48), decode_steps=4)
            for mesh in slice_meshes(jax.devices(), tensor_parallel=tp, num_slices=slices)]


NORMS = {"input_norm", "post_attention_norm", "q_norm", "k_norm"}  # kept as stored (f32)


def _reference(model: Qwen3, untie_head: bool):
    """The serving copy computed on the host: numpy's bf16 cast of the gathered params (the
    norms as stored)."""
    w = handoff.to_serving(*nnx.split(model), jnp.float32, untie_head)  # f32: no cast
    bf16 = lambda x: np.asarray(x).astype(ml_dtypes.bfloat16)  # noqa: E731
    return dataclasses.replace(
        w, embed=bf16(w.embed), lm_head=bf16(w.lm_head), final_norm=np.asarray(w.final_norm),
        layers=tuple({n: np.asarray(x) if n in NORMS else bf16(x) for n, x in layer.items()}
                     for layer in w.layers))


@pytest.fixture(scope="module")
def model():
    return _model()


def _refuse_host_copies(monkeypatch) -> None:
    """Fail on any device-to-host copy of a jax.Array: ``np.asarray``, ``device_get`` and jax's
    own fallback for a reshard it cannot do device to device all read ``_value`` (the transfer
    guard does not see them on CPU, whose device memory is host memory)."""
    def refuse(self):
        raise AssertionError(f"host round trip of a {self.dtype}{list(self.shape)} array")
    monkeypatch.setattr(array_lib.ArrayImpl, "_value", property(refuse))


@pytest.mark.parametrize("slices, tp", LAYOUTS)
def test_handoff_from_fsdp_equals_cast_in_slice_layout_without_host_copy(model, slices, tp,
                                                                         monkeypatch):
    engines = _engines(model, slices, tp)
    new = _model(seed=5)  # the "updated" policy
    state = _fsdp_state(new)
    want = _reference(new, untie_head=True)  # CPU engines untie the head
    with monkeypatch.context() as m:
        _refuse_host_copies(m)
        handoff.update_engines(engines, state)
    for engine in engines:
        got = engine.params
        for i, layer in enumerate(got.layers):
            for name, x in layer.items():
                assert x.dtype == (jnp.float32 if name in NORMS else jnp.bfloat16), name
        for x, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert x.dtype == ref.dtype and x.shape == ref.shape
            np.testing.assert_array_equal(np.asarray(x).astype(np.float32),
                                          ref.astype(np.float32))
        # placed exactly with the slice's shardings (a decode call reshards nothing)
        specs = serving_weight_specs(model.config, got, tp)
        is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
        for x, spec in zip(jax.tree.leaves(got), jax.tree.leaves(specs, is_leaf=is_spec)):
            assert x.sharding.is_equivalent_to(NamedSharding(engine.mesh, spec), x.ndim)
            assert x.sharding.device_set == set(engine.mesh.devices.flat)


def test_handoff_keeps_no_reference_to_the_training_state(model):
    """The serving copy owns its buffers: the trainer may donate (delete) its params after the
    hand-off and the engine still serves."""
    engines = _engines(model, 2, 4)
    state = _fsdp_state(model)
    handoff.update_engines(engines, state)
    jax.tree.map(lambda x: x.delete(), state)
    for e in engines:
        assert all(not x.is_deleted() for x in jax.tree.leaves(e.params))
        jax.block_until_ready(e.params)


def _decode_lowered(engine: Engine, params):
    rows = jnp.arange(2, dtype=jnp.int32)
    width, live = engine._decode_reads([], 1, 2)
    return decode_program.lower(
        engine.cfg, params, engine._k, engine._v, engine.init_decode_state(), rows,
        jnp.asarray(engine._table[:, :width]), live, jnp.full((engine.decode_steps, 2), -1),
        jnp.int32(1), jnp.int32(3), steps=engine.decode_steps, attention=engine.decode_attention,
        vocab_limit=None, max_len=engine.max_len, kv_sharding=engine._kv_sharding)


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in re.findall(r"\d+", text))


def _converted_weights(engine: Engine, params) -> set:
    """Weight shapes our decode program converts (StableHLO, before XLA's backend passes:
    XLA:CPU itself computes bf16 dots in f32, GPUs and TPUs do not)."""
    text = _decode_lowered(engine, params).as_text()
    weights = {x.shape for x in jax.tree.leaves(params) if x.ndim == 2}
    return {_dims(m) for m in re.findall(r"stablehlo\.convert %\S+ : \(tensor<(\d+x\d+)x", text)
            } & weights


@pytest.mark.parametrize("slices, tp", [(1, 8), (2, 4)])
def test_decode_after_handoff_gathers_and_converts_no_weight(model, slices, tp):
    """Once handed off, a decode step reads each device's shard of the bf16 copy as it is: no
    all-gather of a weight (the row/column splits end in all-reduces of activations) and no
    convert of a weight (the cast happened once, in the hand-off)."""
    engine = _engines(model, slices, tp)[-1]
    handoff.update_engines([engine], _fsdp_state(model))
    hlo = _decode_lowered(engine, engine.params).compile().as_text()
    # per-device (partitioned) shapes of the weights, as the compiled program sees them
    shards = {x.addressable_shards[0].data.shape for x in jax.tree.leaves(engine.params)
              if x.ndim == 2}
    gathered = {_dims(t.split("{")[0]) for t in re.findall(r"= (\S+) all-gather(?:-start)?\(",
                                                          hlo)}
    assert re.search(r"all-reduce(?:-start)?\(", hlo)  # it is tensor parallel
    assert not gathered & shards
    assert not _converted_weights(engine, engine.params)
    # the check sees a per-step cast: serving float32 weights (the training dtype) casts them
    f32 = jax.tree.map(lambda x: x.astype(jnp.float32), engine.params)
    assert _converted_weights(engine, f32)


def _rollouts(engine: Engine) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, 11).tolist(), rng.integers(1, 500, 6).tolist()]
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    state = engine.init_decode_state()
    state, first = engine.start(engine.params, state, [
        StartRequest(slot=s, history=p, sampling=sp, prompt_len=len(p))
        for s, p in enumerate(prompts)])
    tokens = [[out.token] for out in first]
    while any(engine.is_decoding(s) for s in range(2)):
        state, block = engine.decode(engine.params, state)
        for s in range(2):
            tokens[s] += block.tokens[block.valid[:, s], s].tolist()
    for s in range(2):
        engine.free_resource(s)
    return tokens


def _engine_bytes(engine: Engine) -> int:
    """Bytes of the engine's live device arrays (serving copy and KV pool)."""
    arrays = jax.tree.leaves((engine.params, engine._k, engine._v))
    return sum(x.nbytes for x in arrays if not x.is_deleted())


ENGINE_PROGRAMS = (feed_program, sample_program, insert_program, decode_program)


@pytest.mark.parametrize("devices", [1, 8])
def test_colocated_engine_compiles_nothing_again_after_a_handoff(model, devices):
    """A colocated engine (neither a device nor a slice) serves the trainer's arrays on the
    trainer's mesh. Its pool and decode state are made in the layout its programs return
    them in, so a second round after the hand-off, as the next RL step runs it, traces and
    compiles no program again. A pool made on one device outside the mesh compiled the
    prefill a second time on step 2 (15 s for Qwen3-1.7B on an H200, 2026-11-27)."""
    mesh = make_mesh(1, -1, 1, devices=jax.devices()[:devices])
    _, state = nnx.split(model)
    trained = nnx.merge(nnx.graphdef(model), jax.device_put(state, state_shardings(state, mesh)))
    engine = Engine(trained, max_len=MAX_LEN, num_slots=2, page_size=8, buckets=(16, 48),
                    decode_steps=4)
    first = _rollouts(engine)
    compiled = [f._cache_size() for f in ENGINE_PROGRAMS]
    _, update = nnx.split(_model(seed=3))
    handoff.update_engines([engine], jax.device_put(update, state_shardings(update, mesh)))
    assert _rollouts(engine) != first  # the new weights are served
    assert [f._cache_size() for f in ENGINE_PROGRAMS] == compiled
    assert engine._k[0].sharding.mesh.devices.size == devices


def test_release_frees_serving_copy_and_pool_and_handoff_restores_them(model):
    kept, released = _engines(model, 1, 4)[0], _engines(model, 1, 4)[0]
    before = _rollouts(kept)
    assert _rollouts(released) == before
    live = sum(x.nbytes for x in jax.live_arrays())
    engine_bytes = _engine_bytes(released)
    assert engine_bytes > 0
    arrays = jax.tree.leaves((released.params, released._k, released._v))
    released.release_memory()
    assert all(x.is_deleted() for x in arrays)
    freed = live - sum(x.nbytes for x in jax.live_arrays())
    assert freed >= engine_bytes  # every byte of the serving copy and the pool
    with pytest.raises(RuntimeError, match="released"):
        released.init_decode_state()
    new = _fsdp_state(_model(seed=7))  # the update the release made room for
    handoff.update_engines([kept], new)
    handoff.update_engines([released], new)
    assert _engine_bytes(released) == engine_bytes
    after = _rollouts(kept)
    assert after != before  # the new policy is served
    assert _rollouts(released) == after


def test_release_refuses_live_requests(model):
    engine = _engines(model, 1, 8)[0]
    state = engine.init_decode_state()
    engine.start(engine.params, state, [StartRequest(slot=0, history=[1, 2, 3], prompt_len=3,
                                                     sampling=SamplingParams(max_new_tokens=4))])
    with pytest.raises(ValueError, match="slot"):
        engine.release_memory()


def test_release_during_update_is_a_checked_config_key():
    import importlib.util
    import pathlib

    from rstarjax.serving.colocated import ServingConfig
    from rstarjax.validation import ConfigError

    spec = importlib.util.spec_from_file_location(
        "base_config", pathlib.Path(__file__).parents[1] / "configs" / "base.py")
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    assert base.get_config().serving.release_during_update is False
    assert ServingConfig().release_during_update is False
    with pytest.raises(ConfigError, match="release_during_update='yes' must be True or False"):
        ServingConfig(release_during_update="yes")


@pytest.mark.slow
def test_rl_step_releases_serving_memory_during_the_update_and_samples_the_same():
    """A colocated GRPO step (2 slices of TP-4, the trainer FSDP over the same 8 devices) with
    ``serving.release_during_update`` on and off: with it on, the engines' device memory is
    freed before the update and they hold none while it runs; the rollouts before the update
    and after the hand-off that re-creates them are token-identical to the run with it off."""
    from rstarjax.env import CodeExecutor
    from rstarjax.models.chat_template import COMPACT
    from rstarjax.models.tokenizer import load_tokenizer
    from rstarjax.rl import optim as optim_lib
    from rstarjax.rl import trainer as trainer_lib
    from rstarjax.rl.agent_loop import AgentConfig, ColocatedRollouts
    from rstarjax.rl.loss import LossConfig
    from rstarjax.rl.config import RLConfig
    from rstarjax.rl.step import rl_step
    from rstarjax.serving.colocated import ServingConfig

    tok = load_tokenizer(486)
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32, vocab_size=512)
    records = [{"problem": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(4)]
    rl = RLConfig(prompts_per_step=4, group_size=2, oversample=4, max_prompt_len=256,
                  max_response_len=8, reject_equal_reward=False)

    def run(release: bool, executor):
        trainer = trainer_lib.Trainer(Qwen3(cfg, rngs=nnx.Rngs(0)),
                                      optim_lib.OptimConfig(learning_rate=1e-2), LossConfig(),
                                      trainer_lib.TrainerConfig(), mesh=make_mesh(1, -1, 1))
        rollouts = ColocatedRollouts(
            trainer.model(), tokenizer=tok, executor=executor,
            agent=AgentConfig(max_turns=1, max_response_len=8),
            sampling=SamplingParams(temperature=1.0, max_new_tokens=8), max_prompt_len=256,
            fmt=COMPACT, num_slots=8,
            serving=ServingConfig(tensor_parallel=4, slices_per_host=2,
                                  release_during_update=release))
        sampled, freed, during = [], [], []

        def rollout_fn(*args):
            trajs, extra = rollouts(*args)
            sampled.append([t.response_ids.tolist() for t in trajs])
            return trajs, extra

        def free():
            engine_bytes = sum(_engine_bytes(e) for e in rollouts.engines)
            live = sum(x.nbytes for x in jax.live_arrays())
            rollouts.release_memory()
            freed.append((live - sum(x.nbytes for x in jax.live_arrays()), engine_bytes))

        train = trainer.train

        def spy(*args, **kw):  # what the engines hold while the update runs
            during.append([_engine_bytes(e) for e in rollouts.engines])
            return train(*args, **kw)

        trainer.train = spy
        rl_step(trainer, rollout_fn, records, rl, LossConfig(), seed=0,
                before_update=free if release else None)
        assert trainer.step == 1
        rollouts.update_params(trainer.model())
        rollout_fn(records, 2, 9, 1)  # the updated policy, served by the re-created engines
        return sampled, freed, during

    with CodeExecutor(num_workers=1) as executor:
        kept_tokens, _, kept_during = run(False, executor)
        freed_tokens, freed, freed_during = run(True, executor)
    assert freed_tokens == kept_tokens and len(kept_tokens) == 2
    assert all(kept_during[0]) and freed_during == [[0, 0]]
    [(dropped, engine_bytes)] = freed
    assert engine_bytes > 0 and dropped >= engine_bytes


def test_disaggregated_rollouts_serve_on_their_own_devices_from_the_trainers_mesh(model, monkeypatch):
    """``serving.placement='disaggregated'``: the trainer's mesh takes the first devices, the
    rollout slices the last ``rollout_devices``; every serving weight and KV page lies on the
    rollout devices only, and a hand-off from the trainer's FSDP state lands there, equal to the
    host cast, without a host round trip."""
    from rstarjax.recipes import build
    from rstarjax.recipes.config import MeshConfig
    from rstarjax.serving.colocated import ColocatedEngines, ServingConfig

    serving = ServingConfig(placement="disaggregated", rollout_devices=4, tensor_parallel=2, slices_per_host=0,
                            num_slots=2, page_size=8, kv_pages=16)
    devices = jax.devices()
    trainer_mesh = build.mesh(MeshConfig(data=1, fsdp=-1, tensor=1), serving)
    assert set(trainer_mesh.devices.flat) == set(devices[:4])
    _, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, trainer_mesh))
    engines = ColocatedEngines(nnx.merge(nnx.graphdef(model), state), serving=serving, max_len=MAX_LEN,
                               vocab_limit=None, tool_timeout_s=10.0, timeout_s=60.0)
    assert len(engines.engines) == 2  # two TP-2 slices on the four rollout devices
    rollout = set(devices[4:])
    for engine in engines.engines:
        held = {d for x in jax.tree.leaves((engine.params, engine._k, engine._v)) for d in x.sharding.device_set}
        assert held <= rollout and set(engine.mesh.devices.flat) <= rollout
    new = _model(seed=5)
    new_state = jax.device_put(nnx.split(new)[1], state_shardings(state, trainer_mesh))
    want = _reference(new, untie_head=True)
    with monkeypatch.context() as m:
        _refuse_host_copies(m)
        engines.update_params(new_state)
    for engine in engines.engines:
        for x, ref in zip(jax.tree.leaves(engine.params), jax.tree.leaves(want), strict=True):
            assert x.sharding.device_set <= set(engine.mesh.devices.flat)
            np.testing.assert_array_equal(np.asarray(x).astype(np.float32), ref.astype(np.float32))

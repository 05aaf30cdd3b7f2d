"""JetStream serving: ``python -m rstarjax.serve`` under JetStream's own orchestrator and gRPC
server, driven by JetStream's own client stubs, against ``rstarjax.serving.generate``.

The server tests need the optional ``[jetstream]`` extra (google-jetstream 0.2.2, which pulls
TensorFlow) and are skipped without it; the base-install tests run everywhere."""
import importlib.util
import os
import subprocess
import sys
import threading
import time

import pytest

HAS_JETSTREAM = importlib.util.find_spec("jetstream") is not None
needs_jetstream = pytest.mark.skipif(not HAS_JETSTREAM, reason='needs pip install -e ".[jetstream]"')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = 300  # regular tokens of the tiny model's small-vocabulary Qwen BPE
MAX_LEN, NUM_SLOTS, MAX_TOKENS = 64, 2, 12
BLOCK_JETSTREAM = "import sys; sys.modules['jetstream'] = None\n"  # `import jetstream` fails


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def test_base_install_never_imports_jetstream():
    """Every base module imports with jetstream unimportable, and none pulls TensorFlow."""
    code = BLOCK_JETSTREAM + (
        "import rstarjax, rstarjax.serving, rstarjax.serve, rstarjax.main, rstarjax.export\n"
        "import rstarjax.recipes.rl, rstarjax.recipes.sft, rstarjax.recipes.evaluate\n"
        "print(sorted(m for m, mod in sys.modules.items() if mod is not None"
        "            and m.split('.')[0] in ('jetstream', 'tensorflow', 'seqio')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_serve_without_the_extra_says_how_to_install(tmp_path):
    code = BLOCK_JETSTREAM + (
        "from rstarjax.serve import main\n"
        f"sys.exit(main(['--hf_path', {str(tmp_path)!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                       timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr[-3000:])
    assert 'pip install -e ".[jetstream]"' in r.stderr


def test_serve_loads_a_training_checkpoint(tmp_path):
    """``--checkpoint`` serves the params a run saved (the export's loader), its tokenizer too."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.models import ModelConfig, Qwen3, load_tokenizer
    from rstarjax.models.sharding import make_mesh
    from rstarjax.recipes.build import model_meta
    from rstarjax.rl.loss import LossConfig
    from rstarjax.rl.optim import OptimConfig
    from rstarjax.rl.trainer import Trainer, TrainerConfig
    from rstarjax.serve import build_parser, load_policy

    tok = load_tokenizer(TOKENS)
    cfg = ModelConfig.preset("tiny", vocab_size=tok.vocab_size, dtype=jnp.float32,
                             bos_token_id=tok.endoftext_id, eos_token_id=tok.eos_id)
    trainer = Trainer(Qwen3(cfg, rngs=nnx.Rngs(5)), OptimConfig(), LossConfig(), TrainerConfig(),
                      mesh=make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    saved = trainer.model()
    with ckpt_lib.Checkpointer(str(tmp_path / "ckpt"), ckpt_lib.CheckpointConfig(async_save=False)) as c:
        c.save(4, trainer.state, model_meta(saved, tok))
    model, loaded_tok, _ = load_policy(build_parser().parse_args(["--checkpoint", str(tmp_path / "ckpt")]))
    assert loaded_tok.num_regular_tokens == TOKENS
    want, got = nnx.state(saved, nnx.Param), nnx.state(model, nnx.Param)
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _tiny_hf_model(path):
    from flax import nnx

    from rstarjax.models import ModelConfig, Qwen3, load_tokenizer, save_hf

    tok = load_tokenizer(TOKENS)
    # Untied: a tiny random model with tied embeddings greedily repeats its last input token,
    # which would hide a token shifted by one.
    cfg = ModelConfig.preset("tiny", vocab_size=tok.vocab_size, bos_token_id=tok.endoftext_id,
                             eos_token_id=tok.eos_id, max_position_embeddings=2 * MAX_LEN,
                             tie_word_embeddings=False)
    save_hf(Qwen3(cfg, rngs=nnx.Rngs(0)), path, tokenizer=tok)
    return tok


def _free_port() -> int:
    import portpicker

    return portpicker.pick_unused_port()


def _wait_healthy(stub, proc, log_path, timeout_s=240.0):
    from jetstream.core.proto import jetstream_pb2

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            if stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=5).is_live:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(1.0)
    raise AssertionError(f"server not healthy after {timeout_s}s:\n{open(log_path).read()[-4000:]}")


def _decode(stub, max_tokens, *, ids=None, text=None):
    """JetStream's client call: a streamed Decode; returns (token ids, text) of sample 0."""
    from jetstream.core.proto import jetstream_pb2

    req = jetstream_pb2.DecodeRequest(max_tokens=max_tokens)
    if ids is not None:
        req.token_content.token_ids.extend(int(t) for t in ids)
    else:
        req.text_content.text = text
    out_ids, out_text = [], []
    for resp in stub.Decode(req, timeout=180):
        for sample in resp.stream_content.samples[:1]:
            out_ids += list(sample.token_ids)
            out_text.append(sample.text)
    return out_ids, "".join(out_text)


def _client_view(completion, stop_ids):
    """What a JetStream client receives for a ``generate`` completion: the ids without the
    stop id that ended it (JetStream's detokenizer never returns stop tokens)."""
    ids = list(completion.token_ids)
    if completion.finish == "stop":
        assert ids[-1] in stop_ids
        ids = ids[:-1]
    return ids


@needs_jetstream
@pytest.mark.slow
def test_jetstream_server_greedy_matches_generate(tmp_path):
    import grpc
    import jax.numpy as jnp
    import numpy as np
    from jetstream.core.proto import jetstream_pb2_grpc

    from rstarjax.models import load_hf
    from rstarjax.serving import generate

    hf = str(tmp_path / "hf")
    tok = _tiny_hf_model(hf)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tok.num_tokens, size=n).tolist() for n in (5, 17, 9, 30, 3)]
    text = "What is 1 + 2? <|im_end|>"
    prompts.append(tok.encode(text))
    model = load_hf(hf, dtype=jnp.float32)

    # An extra stop id that greedy decoding of the first prompt emits mid-way, so the stop path
    # (engine stops, JetStream drops the stop id, the slot is reused) is exercised for sure.
    free_run = generate(model, prompts[:1], MAX_TOKENS, temperature=0.0, max_len=MAX_LEN,
                        vocab_limit=tok.num_tokens)[0].token_ids
    stops = (tok.eos_id, tok.pad_id, int(free_run[MAX_TOKENS // 2]))
    refs = generate(model, prompts, MAX_TOKENS, temperature=0.0, stop_ids=stops, max_len=MAX_LEN,
                    vocab_limit=tok.num_tokens)
    expected = [_client_view(c, stops) for c in refs]
    assert refs[0].finish == "stop" and len(expected[0]) <= MAX_TOKENS // 2
    assert sum(len(set(e)) > 3 for e in expected) >= 4, expected  # varied, not one token repeated

    port = _free_port()
    log_path = str(tmp_path / "server.log")
    cmd = [sys.executable, "-m", "rstarjax.serve", "--hf_path", hf, "--port", str(port),
           "--dtype", "float32", "--num_slots", str(NUM_SLOTS), "--max_len", str(MAX_LEN),
           "--page_size", "8", "--stop_ids", ",".join(map(str, stops))]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    try:
        channel = grpc.insecure_channel(f"localhost:{port}")
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        _wait_healthy(stub, proc, log_path)

        # A request the engine cannot run is answered with nothing, and the server lives on.
        assert _decode(stub, MAX_TOKENS, ids=[tok.vocab_size + 5]) == ([], "")

        # More requests than slots, concurrently: slots are refilled as requests finish.
        got: dict[int, list[int]] = {}

        def run(i):
            if i == len(prompts) - 1:
                got[i] = _decode(stub, MAX_TOKENS, text=text)[0]
            else:
                got[i] = _decode(stub, MAX_TOKENS, ids=prompts[i])[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert [got.get(i) for i in range(len(prompts))] == expected

        # max_tokens is the client's: shorter than the server's budget, exact.
        short = _decode(stub, 3, ids=prompts[1])[0]
        assert short == expected[1][:3]
        assert proc.poll() is None, open(log_path).read()[-4000:]
        channel.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)

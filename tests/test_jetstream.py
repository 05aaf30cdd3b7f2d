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


def _request(max_tokens, ids=None, text=None):
    from jetstream.core.proto import jetstream_pb2

    req = jetstream_pb2.DecodeRequest(max_tokens=max_tokens)
    if ids is not None:
        req.token_content.token_ids.extend(int(t) for t in ids)
    elif text is not None:
        req.text_content.text = text
    return req  # neither: a request without content


def _decode(stub, max_tokens, *, ids=None, text=None):
    """JetStream's client call: a streamed Decode; returns (token ids, text) of sample 0."""
    out_ids, out_text = [], []
    for resp in stub.Decode(_request(max_tokens, ids, text), timeout=180):
        for sample in resp.stream_content.samples[:1]:
            out_ids += list(sample.token_ids)
            out_text.append(sample.text)
    return out_ids, "".join(out_text)


def _decode_with_reason(stub, max_tokens, *, ids):
    """(token ids, the ``finish-reason`` trailing metadata) of a token-id request."""
    call = stub.Decode(_request(max_tokens, ids), timeout=180)
    out = [t for resp in call for t in resp.stream_content.samples[0].token_ids]
    return out, dict(call.trailing_metadata()).get("finish-reason")


def _start(hf, log_path, *flags, port=None):
    """``python -m rstarjax.serve`` on ``hf`` (tiny-model flags unless overridden); (process, port)."""
    port = port or _free_port()
    cmd = [sys.executable, "-m", "rstarjax.serve", "--hf_path", hf, "--port", str(port),
           "--dtype", "float32", "--num_slots", str(NUM_SLOTS), "--max_len", str(MAX_LEN),
           "--page_size", "8", *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    return proc, port


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


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

        # A request the engine cannot run fails alone (INVALID_ARGUMENT, saying why), as does
        # one with no content at all; the server lives on.
        for bad in ({"ids": [tok.vocab_size + 5]}, {"ids": []}, {}):
            with pytest.raises(grpc.RpcError) as failed:
                _decode(stub, MAX_TOKENS, **bad)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failed.value
        assert "no content" in failed.value.details()
        # a session_cache JetStream's prefill thread would pad as an array (and die on the list)
        request = _request(MAX_TOKENS, [5, 6, 7])
        request.session_cache = "earlier"
        with pytest.raises(grpc.RpcError) as failed:
            list(stub.Decode(request, timeout=60))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_cache" in failed.value.details()

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

        # --max_len bounds prompt + completion (the engine alone returns one token more), and
        # the trailing metadata says why the stream ended.
        long_ids, reason = _decode_with_reason(stub, 1000, ids=prompts[4])
        want = generate(model, prompts[4:5], 1000, temperature=0.0, stop_ids=stops, max_len=MAX_LEN,
                        vocab_limit=tok.num_tokens)[0]
        view = _client_view(want, stops)
        if want.finish == "stop" and len(prompts[4]) + len(view) < MAX_LEN:
            assert long_ids == view and reason == "stop"
        else:
            assert len(prompts[4]) + len(long_ids) == MAX_LEN and reason == "context"
            assert long_ids == want.token_ids[: len(long_ids)]
        assert _decode_with_reason(stub, 3, ids=prompts[1]) == (expected[1][:3], "max_tokens")
        assert proc.poll() is None, open(log_path).read()[-4000:]
        channel.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _bigram_hf_model(path, chain):
    """A full-vocabulary tiny model rigged so that greedy decoding follows ``chain`` (each id
    is followed by the next): attention and MLP outputs zeroed, each chain id's embedding a
    one-hot row that the head maps to its successor."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rstarjax.models import ModelConfig, Qwen3, load_tokenizer, save_hf

    tok = load_tokenizer()
    cfg = ModelConfig.preset("tiny", vocab_size=tok.vocab_size, bos_token_id=tok.endoftext_id,
                             eos_token_id=tok.eos_id, tie_word_embeddings=False,
                             max_position_embeddings=2 * MAX_LEN)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    layers = state["layers"]
    layers["o_proj"].value = jnp.zeros_like(layers["o_proj"].value)
    layers["down_proj"].value = jnp.zeros_like(layers["down_proj"].value)
    emb = np.array(state["embed"].value)
    head = np.zeros(state["lm_head"].value.shape, np.float32)
    for k, (cur, nxt) in enumerate(zip(chain, chain[1:])):
        emb[cur] = np.eye(emb.shape[1], dtype=np.float32)[k]
        head[k, nxt] = 50.0
    state["embed"].value = jnp.asarray(emb)
    state["lm_head"].value = jnp.asarray(head)
    nnx.update(model, state)
    save_hf(model, path, tokenizer=tok)
    return tok


@needs_jetstream
@pytest.mark.slow
def test_streamed_text_keeps_characters_split_across_tokens(tmp_path):
    """Qwen3 writes 🦜 as two tokens, the first three of its four bytes: a text request's
    streamed text is 🦜 (tokenizer.decode of the ids), where JetStream's per-token decode
    sent U+FFFD."""
    import grpc
    from jetstream.core.proto import jetstream_pb2_grpc

    from rstarjax.models import load_tokenizer

    tok = load_tokenizer()
    prompt = "x"
    parrot = tok.encode("🦜")
    assert parrot == [123918, 250]
    hf = str(tmp_path / "hf")
    _bigram_hf_model(hf, [tok.encode(prompt)[-1], *parrot, tok.eos_id])
    log_path = str(tmp_path / "server.log")
    proc, port = _start(hf, log_path)
    try:
        channel = grpc.insecure_channel(f"localhost:{port}")
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        _wait_healthy(stub, proc, log_path)
        ids, text = _decode(stub, 10, text=prompt)
        assert ids == parrot and text == tok.decode(ids) == "🦜"
        ids, text = _decode(stub, 1, text=prompt)  # cut inside the character: as decode() writes it
        assert ids == parrot[:1] and text == tok.decode(ids) == "\ufffd"
        assert _decode(stub, 10, ids=tok.encode(prompt)) == (parrot, "")  # ids in, ids out
        channel.close()
    finally:
        _stop(proc)


def _streams_in_flight(stub, n, max_tokens):
    """``n`` concurrent token-id streams; returns (threads, results, an Event per stream set
    at its first token). A result: ("ok", tokens) or (status code, details, tokens)."""
    import grpc

    results, started = {}, [threading.Event() for _ in range(n)]

    def run(i):
        got = 0
        try:
            for resp in stub.Decode(_request(max_tokens, [5 + i, 6, 7]), timeout=180):
                got += len(resp.stream_content.samples[0].token_ids)
                started[i].set()
            results[i] = ("ok", got)
        except grpc.RpcError as e:
            results[i] = (e.code(), e.details(), got)
        started[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results, started


@needs_jetstream
@pytest.mark.slow
def test_sigterm_drains_and_a_short_grace_cancels(tmp_path):
    """SIGTERM: running streams finish (within --shutdown_grace), new requests are refused,
    exit 0 with one line and no traceback. SIGINT with --shutdown_grace 0: the running
    streams end UNAVAILABLE at once, exit 0 likewise."""
    import json
    import signal

    import grpc
    from jetstream.core.proto import jetstream_pb2_grpc

    hf = str(tmp_path / "hf")
    _tiny_hf_model(hf)
    stop_ids = ["--stop_ids", "0"]  # a byte id greedy decoding of these prompts does not emit
    for sig, grace, max_tokens in ((signal.SIGTERM, "120", 20), (signal.SIGINT, "0", 1000)):
        log_path = str(tmp_path / f"server-{sig.name}.log")
        proc, port = _start(hf, log_path, *stop_ids, "--shutdown_grace", grace)
        try:
            channel = grpc.insecure_channel(f"localhost:{port}")
            stub = jetstream_pb2_grpc.OrchestratorStub(channel)
            _wait_healthy(stub, proc, log_path)
            threads, results, started = _streams_in_flight(stub, NUM_SLOTS, max_tokens)
            for event in started:
                assert event.wait(120)
            t0 = time.monotonic()
            proc.send_signal(sig)
            assert proc.wait(timeout=150) == 0, open(log_path).read()[-3000:]
            for t in threads:
                t.join(timeout=60)
            log = open(log_path).read()
            assert "Traceback" not in log, log[-3000:]
            stopped = json.loads(log.strip().splitlines()[-1])
            assert stopped["stopped"] == sig.name and stopped["in_flight"] == NUM_SLOTS, stopped
            if sig == signal.SIGTERM:
                assert [results[i] for i in range(NUM_SLOTS)] == [("ok", max_tokens)] * NUM_SLOTS
                assert stopped["finished"] == NUM_SLOTS and stopped["cancelled"] == 0, stopped
                with pytest.raises(grpc.RpcError) as refused:  # drained or gone: UNAVAILABLE
                    _decode(stub, 3, ids=[5, 6, 7])
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            else:
                for i in range(NUM_SLOTS):
                    code, details, got = results[i]
                    assert code == grpc.StatusCode.UNAVAILABLE and "shut down before" in details, results
                    assert 0 < got < MAX_LEN - 3
                assert stopped["cancelled"] == NUM_SLOTS and time.monotonic() - t0 < 60, stopped
            channel.close()
        finally:
            _stop(proc)


@needs_jetstream
@pytest.mark.slow
def test_a_start_that_fails_after_jetstreams_threads_started_exits(tmp_path):
    """The port taken between the check and JetStream's bind (the check stood down here):
    one line, status 2, and the process is gone (JetStream's threads would keep it alive)."""
    import socket

    hf = str(tmp_path / "hf")
    _tiny_hf_model(hf)
    busy = socket.socket(socket.AF_INET6)
    busy.bind(("::", 0))
    busy.listen()
    port = busy.getsockname()[1]
    code = ("import sys\nfrom rstarjax import serve\nserve.port_errors = lambda args: []\n"
            f"sys.exit(serve.main(['--hf_path', {hf!r}, '--port', '{port}', '--dtype', 'float32', "
            f"'--num_slots', '2', '--max_len', '{MAX_LEN}', '--page_size', '8']))\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                           cwd=REPO, timeout=240)
    finally:
        busy.close()
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2, out[-30:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert out[-1].startswith(f"serve failed: JetStream's server did not start on port {port}"), out[-5:]

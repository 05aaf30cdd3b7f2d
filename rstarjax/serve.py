"""Serve a policy with JetStream's orchestrator and gRPC server (needs the ``[jetstream]`` extra).

    python -m rstarjax.serve --hf_path HF_DIR [--port 9000] [--num_slots 8] [--max_len 4096]
    python -m rstarjax.serve --checkpoint WORKDIR/checkpoints [--step N] [--model_config config.json]

The model runs in the paged slot engine that rollouts use (``serving.engine.Engine``, with
JetStream's contract: ``serving.jetstream_contract``) behind
``serving.jetstream_engine.JetStreamEngine``, in JetStream's interleaved mode (prefill and
decode share the engine's one device and KV pool). Clients speak JetStream's
``jetstream.core.proto.jetstream_pb2_grpc.Orchestrator`` API: ``Decode`` with
``text_content`` (our tokenizer encodes it; send the chat template's text yourself) or
``token_content`` (ids in, ids out), and ``max_tokens``. Sampling is server-wide
(``--temperature``, ``--top_p``, ``--top_k``, ``--seed``; greedy by default). See
docs/serving.md, "JetStream".

Who may connect (``server_credentials``): by default only this machine, over loopback (gRPC's
local server credentials: a client on another address fails the handshake; a client here
connects as before, with an insecure channel or ``grpc.local_channel_credentials()``).
``--expose`` with ``--tls_cert`` / ``--tls_key`` (and optionally ``--tls_client_ca``, which
requires client certificates) serves other machines, over TLS only. The same holds for
JetStream's Prometheus metrics server (``--prometheus_port``, ``metrics_server_options``): on
loopback by default, over HTTPS with the same certificates with ``--expose``.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys

from rstarjax.export import load_checkpoint
from rstarjax.models import load_hf
from rstarjax.models.kv_cache import pages_for
from rstarjax.models.tokenizer import load_tokenizer_for
from rstarjax.serving.jetstream_contract import JetStreamContractEngine
from rstarjax.serving.sampling import SamplingParams

_INSTALL_HINT = ('rstarjax.serve needs google-jetstream, an optional extra that pulls TensorFlow: '
                 'pip install -e ".[jetstream]"')


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rstarjax.serve", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf_path", help="HF model directory (config.json + *.safetensors)")
    src.add_argument("--checkpoint", help="Orbax checkpoint directory of a run (WORKDIR/checkpoints)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--model_config", default=None, help="HF config.json naming the checkpoint's architecture")
    p.add_argument("--preset", default=None, help="ModelConfig preset, when nothing else names it")
    p.add_argument("--tokenizer_num_regular_tokens", type=int, default=0,
                   help="small-vocabulary tokenizer (default: the model's own, else Qwen3's)")
    p.add_argument("--port", type=int, default=9000)
    access = p.add_argument_group("who may connect (default: this machine only, over loopback)")
    access.add_argument("--expose", action="store_true",
                        help="serve other machines too, over TLS (needs --tls_cert and --tls_key)")
    access.add_argument("--tls_cert", help="with --expose: the server's PEM certificate (chain)")
    access.add_argument("--tls_key", help="with --expose: the server's PEM private key")
    access.add_argument("--tls_client_ca", help="with --expose: PEM CA certificates; clients must then "
                        "present a certificate they signed")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                   help="compute dtype of the serving weights and KV cache")
    p.add_argument("--num_slots", type=int, default=8, help="concurrent decodes")
    p.add_argument("--max_len", type=int, default=4096, help="tokens per slot (prompt + completion)")
    p.add_argument("--max_prefill_length", type=int, default=0,
                   help="longest prompt (a JetStream bucket 16..32768 below max_len; default the largest)")
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--kv_pages", type=int, default=0,
                   help="KV pool pages (default: every slot and the prefixes in flight at max_len)")
    p.add_argument("--decode_attention", default="auto")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    p.add_argument("--max_new_tokens", type=int, default=0,
                   help="cap on tokens per request besides the client's max_tokens (default: max_len)")
    p.add_argument("--stop_ids", default="",
                   help="comma-separated stop ids (default: <|im_end|>,<|endoftext|>)")
    p.add_argument("--threads", type=int, default=0, help="gRPC worker threads (default: JetStream's)")
    p.add_argument("--prometheus_port", type=int, default=0,
                   help="JetStream's metrics server (0: off); loopback only unless --expose (then HTTPS)")
    p.add_argument("--log_level", default="WARNING",
                   help="root log level (JetStream's orchestrator sets DEBUG: a line per step)")
    return p


def access_errors(args) -> list[str]:
    """What is wrong with the access flags (the parser reports it), naming the flags."""
    tls = [f"--{n}" for n in ("tls_cert", "tls_key", "tls_client_ca") if getattr(args, n)]
    errors = []
    if args.expose and not (args.tls_cert and args.tls_key):
        errors.append("--expose serves other machines over TLS: give --tls_cert and --tls_key (PEM files)")
    if tls and not args.expose:
        errors.append(f"{' '.join(tls)} only apply with --expose (without it only this machine may connect)")
    for flag in tls:
        path = getattr(args, flag[2:])
        if not os.path.isfile(path):
            errors.append(f"{flag}={path!r} is not a file")
    return errors


def server_credentials(args, grpc):
    """The gRPC server credentials ``args`` ask for (``grpc``: the module). Default: local
    credentials over TCP, which admit loopback connections only (the server still listens on
    JetStream's ``[::]``, but a peer on another address fails the handshake)."""
    if not args.expose:
        return grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)

    def read(path):
        with open(path, "rb") as f:
            return f.read()

    client_ca = read(args.tls_client_ca) if args.tls_client_ca else None
    return grpc.ssl_server_credentials([(read(args.tls_key), read(args.tls_cert))], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


LOOPBACK = "127.0.0.1"


def metrics_server_options(args) -> dict:
    """``prometheus_client.start_http_server``'s options for JetStream's metrics server (which,
    left to itself, serves plain HTTP on every interface): loopback only by default, as the gRPC
    port; with ``--expose`` every interface, over HTTPS with the gRPC port's certificate, key and
    client CA (a client certificate required when one is given)."""
    if not args.expose:
        return {"addr": LOOPBACK}
    return {"addr": "0.0.0.0", "certfile": args.tls_cert, "keyfile": args.tls_key,
            "client_cafile": args.tls_client_ca, "client_auth_required": bool(args.tls_client_ca)}


def load_policy(args):
    """(model, tokenizer, tokenizer path) from ``--hf_path`` or ``--checkpoint`` (the engine
    casts the weights to ``--dtype``)."""
    if args.hf_path:
        model = load_hf(args.hf_path)
        return model, load_tokenizer_for(args.hf_path, args.tokenizer_num_regular_tokens), args.hf_path
    model, tok, _ = load_checkpoint(args.checkpoint, args.step, args.model_config, args.preset,
                                    args.tokenizer_num_regular_tokens or None)
    return model, tok, ""


def build_engine(args, model, tokenizer, tokenizer_path: str = ""):
    """The JetStream adapter over a paged engine sized by ``args``."""
    from rstarjax.serving.jetstream_engine import PREFIXES_IN_FLIGHT, JetStreamEngine  # needs jetstream (an extra)

    kv_pages = args.kv_pages or (args.num_slots + PREFIXES_IN_FLIGHT) * pages_for(
        args.max_len, args.page_size)
    engine = JetStreamContractEngine(model, max_len=args.max_len, num_slots=args.num_slots,
                                     dtype=args.dtype, page_size=args.page_size,
                                     kv_pages=kv_pages, decode_attention=args.decode_attention,
                                     vocab_limit=tokenizer.num_tokens)
    stops = tuple(int(t) for t in args.stop_ids.split(",") if t.strip())
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              seed=args.seed, max_new_tokens=args.max_new_tokens or args.max_len,
                              stop_ids=stops)
    return JetStreamEngine(engine, tokenizer, sampling,
                           max_prefill_length=args.max_prefill_length or None,
                           tokenizer_path=tokenizer_path)


def start_server(adapter, port: int, threads: int = 0, prometheus_port: int = 0,
                 log_level: str = "WARNING", credentials=None, metrics_options: dict | None = None):
    """JetStream's gRPC server and orchestrator on ``adapter`` (interleaved mode, one device);
    returns the running ``server_lib.JetStreamServer`` (``.stop()``, ``.wait_for_termination()``).
    ``credentials``: gRPC server credentials (``server_credentials``); None = loopback only.
    ``metrics_options``: where the metrics server of ``prometheus_port`` listens
    (``metrics_server_options``); None = loopback only."""
    import grpc
    from jetstream.core import config_lib, server_lib

    if credentials is None:
        credentials = grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)

    # Importing the orchestrator set the root logger to DEBUG; put the caller's level back.
    logging.getLogger().setLevel(log_level.upper())

    from rstarjax.serving.jetstream_engine import patch_jetstream_for_current_jax

    patch_jetstream_for_current_jax()
    device = adapter.mesh.devices.flat[0]
    config = config_lib.ServerConfig(interleaved_slices=(f"{device.platform}=1",),
                                     interleaved_engine_create_fns=(lambda devices: adapter,))
    metrics = config_lib.MetricsServerConfig(port=prometheus_port) if prometheus_port else None
    if metrics is not None:  # server_lib.run calls start_http_server(port): on every interface, plain HTTP
        import prometheus_client  # a dependency of jetstream

        server_lib.start_http_server = functools.partial(prometheus_client.start_http_server,
                                                         **(metrics_options or {"addr": LOOPBACK}))
    return server_lib.run(port=port, config=config, devices=[device], credentials=credentials,
                          threads=threads or None, metrics_server_config=metrics)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    errors = access_errors(args)
    if errors:
        parser.error("; ".join(errors))
    try:
        import jetstream  # noqa: F401
    except ImportError:
        print(_INSTALL_HINT, file=sys.stderr)
        return 2
    import grpc  # a dependency of jetstream
    try:
        model, tok, tok_path = load_policy(args)
        adapter = build_engine(args, model, tok, tok_path)
    except (FileNotFoundError, ValueError) as e:
        print(f"serve failed: {e}", file=sys.stderr)
        return 2
    server = start_server(adapter, args.port, args.threads, args.prometheus_port, args.log_level,
                          credentials=server_credentials(args, grpc), metrics_options=metrics_server_options(args))
    access = "tls, any address" if args.expose else "loopback only"
    print(json.dumps({"serving": args.hf_path or args.checkpoint, "port": args.port, "access": access,
                      "num_slots": adapter.max_concurrent_decodes,
                      "max_prefill_length": adapter.max_prefill_length,
                      "max_len": adapter.engine.max_len,
                      **({"prometheus": f"{metrics_server_options(args)['addr']}:{args.prometheus_port}"}
                         if args.prometheus_port else {})}), flush=True)
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())

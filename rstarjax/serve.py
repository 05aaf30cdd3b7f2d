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

Flags are checked before anything loads (a bad one: one line, status 2), the TLS files and the
ports too; a start that fails later says so in one line and exits 2. SIGTERM or SIGINT drains:
new requests are refused, running ones get ``--shutdown_grace`` seconds to finish (those left
end with ``UNAVAILABLE``), then the server stops and exits 0 with one line.
"""
from __future__ import annotations

import argparse
import errno
import functools
import json
import logging
import math
import os
import signal
import socket
import sys
import threading

from rstarjax.export import load_checkpoint
from rstarjax.models import load_hf
from rstarjax.models.tokenizer import load_tokenizer_for
from rstarjax.serving.jetstream_contract import JetStreamContractEngine
from rstarjax.serving.programs import MAX_STOP_IDS
from rstarjax.serving.sampling import SamplingParams

_INSTALL_HINT = ('rstarjax.serve needs google-jetstream, an optional extra that pulls TensorFlow: '
                 'pip install -e ".[jetstream]"')


class _Parser(argparse.ArgumentParser):
    """Reports a bad flag in one line (no usage block), status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m rstarjax.serve", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf_path", help="HF model directory (config.json + *.safetensors)")
    src.add_argument("--checkpoint", help="Orbax checkpoint directory of a run (WORKDIR/checkpoints)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--model_config", default=None, help="HF config.json naming the checkpoint's architecture")
    p.add_argument("--preset", default=None, help="ModelConfig preset, when nothing else names it")
    p.add_argument("--tokenizer_num_regular_tokens", type=int, default=0,
                   help="small-vocabulary tokenizer (default: the model's own, else Qwen3's)")
    p.add_argument("--port", type=int, default=9000, help="gRPC port, 1-65535 (on every interface)")
    access = p.add_argument_group("who may connect (default: this machine only, over loopback)")
    access.add_argument("--expose", action="store_true",
                        help="serve other machines too, over TLS (needs --tls_cert and --tls_key)")
    access.add_argument("--tls_cert", help="with --expose: the server's PEM certificate (chain)")
    access.add_argument("--tls_key", help="with --expose: the server's PEM private key")
    access.add_argument("--tls_client_ca", help="with --expose: PEM CA certificates; clients must then "
                        "present a certificate they signed")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                   help="compute dtype of the serving weights and KV cache")
    p.add_argument("--num_slots", type=int, default=8, help="concurrent decodes (>= 1)")
    p.add_argument("--max_len", type=int, default=4096,
                   help="tokens per request, prompt + completion (at most the model's "
                        "max_position_embeddings)")
    p.add_argument("--max_prefill_length", type=int, default=0,
                   help="longest prompt (a JetStream bucket 16..32768 below max_len; default the largest)")
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--kv_pages", type=int, default=0,
                   help="KV pool pages (default and minimum: every slot at max_len and the "
                        "prompts in flight; more is allowed)")
    p.add_argument("--decode_attention", default="auto")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0,
                   help="request i samples with seed + i (a signed 32-bit integer; wraps)")
    p.add_argument("--max_new_tokens", type=int, default=0,
                   help="cap on tokens per request besides the client's max_tokens (default: max_len)")
    p.add_argument("--stop_ids", default="",
                   help=f"comma-separated stop ids, at most {MAX_STOP_IDS} "
                        "(default: <|im_end|>,<|endoftext|>)")
    p.add_argument("--threads", type=int, default=0, help="gRPC worker threads (default: JetStream's)")
    p.add_argument("--prometheus_port", type=int, default=0,
                   help="JetStream's metrics server (0: off); loopback only unless --expose (then HTTPS)")
    p.add_argument("--log_level", default="WARNING",
                   help="root log level (JetStream's orchestrator sets DEBUG: a line per step)")
    p.add_argument("--shutdown_grace", type=float, default=10.0,
                   help="seconds running requests get to finish after SIGTERM / SIGINT "
                        "(a second signal cuts it short)")
    return p


def parse_stop_ids(text: str) -> tuple[int, ...]:
    """``--stop_ids``: comma-separated integers (ValueError naming the bad one)."""
    stops = []
    for part in text.split(","):
        if part.strip():
            try:
                stops.append(int(part))
            except ValueError:
                raise ValueError(f"--stop_ids: {part.strip()!r} is not an integer") from None
    return tuple(stops)


def flag_errors(args) -> list[str]:
    """What is wrong with the numeric and sampling flags, found before anything loads."""
    errors = []
    if not 1 <= args.port <= 65535:
        errors.append(f"--port {args.port} is not a TCP port (1-65535)")
    if not 0 <= args.prometheus_port <= 65535:
        errors.append(f"--prometheus_port {args.prometheus_port} is not a TCP port (1-65535; 0: off)")
    elif args.prometheus_port and args.prometheus_port == args.port:
        errors.append(f"--prometheus_port {args.prometheus_port} is --port too")
    for flag, low in (("num_slots", 1), ("page_size", 1), ("kv_pages", 0), ("max_prefill_length", 0),
                      ("max_new_tokens", 0), ("threads", 0), ("top_k", 0)):
        if getattr(args, flag) < low:
            errors.append(f"--{flag} must be >= {low}, got {getattr(args, flag)}")
    if args.max_len < 2:
        errors.append(f"--max_len must be >= 2, got {args.max_len}")
    if not (math.isfinite(args.shutdown_grace) and args.shutdown_grace >= 0):
        errors.append(f"--shutdown_grace must be >= 0 seconds, got {args.shutdown_grace}")
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        errors.append(f"--log_level {args.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    try:
        stops = parse_stop_ids(args.stop_ids)
        if len(stops) > MAX_STOP_IDS:
            errors.append(f"--stop_ids: at most {MAX_STOP_IDS} ids (the engine checks that many "
                          f"per request on device), got {len(stops)}")
        if any(t < 0 for t in stops):
            errors.append(f"--stop_ids: ids are >= 0, got {min(stops)}")
    except ValueError as e:
        errors.append(str(e))
    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=max(args.top_k, 0),
                       seed=args.seed, max_new_tokens=max(args.max_new_tokens, 1))
    except ValueError as e:  # its messages start with the field, named as the flag
        errors.append(f"--{e}")
    return errors


def tls_errors(args) -> list[str]:
    """With ``--expose``: whether the TLS files are what gRPC needs (a PEM certificate chain
    and its unencrypted private key; PEM CA certificates), read as OpenSSL reads them."""
    if not args.expose:
        return []
    import ssl

    errors = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.tls_cert, args.tls_key, password=lambda: b"")
    except (ssl.SSLError, OSError, ValueError) as e:
        errors.append(f"--tls_cert {args.tls_cert!r} / --tls_key {args.tls_key!r}: not a PEM "
                      f"certificate chain and its matching unencrypted private key ({e})")
    if args.tls_client_ca:
        try:
            context.load_verify_locations(cafile=args.tls_client_ca)
        except (ssl.SSLError, OSError, ValueError) as e:
            errors.append(f"--tls_client_ca {args.tls_client_ca!r}: no PEM CA certificate ({e})")
    return errors


def bind_error(host: str, port: int) -> str | None:
    """Why a TCP server could not listen on ``host:port`` now (None: it can). ``"::"`` is
    every interface, IPv4 included, as gRPC binds JetStream's ``[::]``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        if family == socket.AF_INET:
            raise
        return bind_error("0.0.0.0", port)  # no IPv6 here
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "another process listens there"
            return e.strerror or str(e)
    return None


def port_errors(args) -> list[str]:
    """Whether the gRPC port and the metrics port can be listened on (checked before the
    model loads; JetStream would fail only after its threads started)."""
    errors = []
    why = bind_error("::", args.port)
    if why:
        errors.append(f"--port {args.port}: cannot listen there ({why})")
    if args.prometheus_port:
        why = bind_error(metrics_server_options(args)["addr"], args.prometheus_port)
        if why:
            errors.append(f"--prometheus_port {args.prometheus_port}: cannot listen there ({why})")
    return errors


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
    """The JetStream adapter over a paged engine sized by ``args``. ValueError, naming the
    flag, for a ``--max_len`` past the model's positions, a ``--kv_pages`` below what the
    slots need (JetStream cannot pause a request: ``jetstream_engine.pool_pages``) and stop
    ids outside the vocabulary."""
    from rstarjax.serving.jetstream_engine import (  # needs jetstream (an extra)
        PREFIXES_IN_FLIGHT, JetStreamEngine, default_max_prefill_length, pool_pages)

    positions = model.config.max_position_embeddings
    if args.max_len > positions:
        raise ValueError(f"--max_len {args.max_len} exceeds the model's max_position_embeddings "
                         f"{positions}: lower --max_len")
    stops = parse_stop_ids(args.stop_ids)
    outside = [t for t in stops if not 0 <= t < tokenizer.num_tokens]
    if outside:
        raise ValueError(f"--stop_ids: {outside[0]} is outside the tokenizer's vocabulary "
                         f"[0, {tokenizer.num_tokens})")
    prompt = args.max_prefill_length or default_max_prefill_length(args.max_len)
    need = pool_pages(args.num_slots, args.max_len, args.page_size, prompt)
    if args.kv_pages and args.kv_pages < need:
        raise ValueError(
            f"--kv_pages {args.kv_pages} is too small: {args.num_slots} slots at --max_len "
            f"{args.max_len} and {PREFIXES_IN_FLIGHT} prompts of up to {prompt} tokens in flight "
            f"need {need} pages of {args.page_size} tokens (JetStream cannot pause a request to "
            f"wait for pages); lower --num_slots or --max_len, or leave --kv_pages out")
    engine = JetStreamContractEngine(model, max_len=args.max_len, num_slots=args.num_slots,
                                     dtype=args.dtype, page_size=args.page_size,
                                     kv_pages=args.kv_pages or need,
                                     decode_attention=args.decode_attention,
                                     vocab_limit=tokenizer.num_tokens)
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


class _Stopped(BaseException):
    """A stop signal arrived before the server started (``_Signals``)."""


class _Signals:
    """SIGTERM and SIGINT. Before ``guard()`` (loading the model) they stop the start
    (``_Stopped``); after it (JetStream's threads run) the first sets ``stop`` (drain) and a
    second ``hurry`` (cut the drain short)."""

    def __init__(self):
        self.stop, self.hurry = threading.Event(), threading.Event()
        self.name = None
        self._guarded = False
        self._previous = {}

    def __call__(self, signum, frame):
        if self.stop.is_set():
            self.hurry.set()
        self.name = self.name or signal.Signals(signum).name
        self.stop.set()
        if not self._guarded:
            raise _Stopped()

    def guard(self) -> None:
        self._guarded = True
        if self.stop.is_set():  # arrived while guard() was being reached
            raise _Stopped()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _non_daemon_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon and t.is_alive()]


def _exit(code: int) -> int:
    """``code``, returned; or, where a JetStream thread that is no daemon would keep the
    process alive after ``main`` returns, the process ended now with it."""
    if _non_daemon_threads():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    errors = access_errors(args) + flag_errors(args)
    if errors:
        parser.error("; ".join(errors))
    with _Signals() as signals:
        try:
            return _serve(args, signals)
        except _Stopped:
            print(json.dumps({"stopped": signals.name, "before_serving": True}), flush=True)
            return 0


def _serve(args, signals: _Signals) -> int:
    try:
        import jetstream  # noqa: F401
    except ImportError:
        print(_INSTALL_HINT, file=sys.stderr)
        return 2
    import grpc  # a dependency of jetstream

    errors = tls_errors(args) + port_errors(args)
    if errors:
        print(f"serve failed: {'; '.join(errors)}", file=sys.stderr)
        return 2
    try:
        model, tok, tok_path = load_policy(args)
        adapter = build_engine(args, model, tok, tok_path)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"serve failed: {e}", file=sys.stderr)
        return 2
    signals.guard()
    try:
        server = start_server(adapter, args.port, args.threads, args.prometheus_port, args.log_level,
                              credentials=server_credentials(args, grpc),
                              metrics_options=metrics_server_options(args))
    except Exception as e:  # noqa: BLE001 - JetStream's threads may run: one line, then gone
        print(f"serve failed: JetStream's server did not start on port {args.port}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return _exit(2)
    access = "tls, any address" if args.expose else "loopback only"
    print(json.dumps({"serving": args.hf_path or args.checkpoint, "port": args.port, "access": access,
                      "num_slots": adapter.max_concurrent_decodes,
                      "max_prefill_length": adapter.max_prefill_length,
                      "max_len": adapter.engine.max_len,
                      **({"prometheus": f"{metrics_server_options(args)['addr']}:{args.prometheus_port}"}
                         if args.prometheus_port else {})}), flush=True)
    from rstarjax.serving.jetstream_engine import stop_server

    while not signals.stop.wait(0.5):
        pass
    summary = stop_server(server, args.shutdown_grace, signals.hurry)
    print(json.dumps({"stopped": signals.name, **summary}), flush=True)
    return _exit(0)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m rstarjax.serve --prometheus_port``: JetStream's metrics server listens where the gRPC
port does (issue 47): loopback only unless ``--expose``, and then over HTTPS with the same
certificates. JetStream itself is stood in for (it is an optional extra); the metrics server is
prometheus_client's own, bound for real."""
import socket
import sys
import types
import urllib.request

import pytest

from process_support import free_port, own_other_address, start_on_stand_in_jetstream
from rstarjax import serve


def _start_with_fake_jetstream(monkeypatch, prometheus_port, metrics_options=None):
    """``serve.start_server`` on a stand-in JetStream whose ``server_lib.run`` starts the metrics
    server as JetStream 0.2.2's does (``start_http_server(port)``); returns what it started."""
    started = {}

    def run(**kw):
        if kw["metrics_server_config"]:
            started["metrics"] = server_lib.start_http_server(kw["metrics_server_config"]["port"])
        return "server"

    server_lib = types.SimpleNamespace(run=run, start_http_server=lambda port: pytest.fail("every interface"))

    grpc = types.SimpleNamespace(local_server_credentials=lambda kind: ("local", kind),
                                 LocalConnectionType=types.SimpleNamespace(LOCAL_TCP="local_tcp"))
    assert start_on_stand_in_jetstream(monkeypatch, grpc, server_lib, prometheus_port=prometheus_port,
                                       metrics_options=metrics_options) == "server"
    return started


def test_the_metrics_port_admits_loopback_only_unless_exposed(monkeypatch, tmp_path):
    pytest.importorskip("prometheus_client")
    parse = serve.build_parser().parse_args
    assert serve.metrics_server_options(parse(["--hf_path", "m", "--prometheus_port", "9100"])) == {
        "addr": "127.0.0.1"}
    tls = ["--expose", "--tls_cert", "c.pem", "--tls_key", "k.pem", "--tls_client_ca", "ca.pem"]
    assert serve.metrics_server_options(parse(["--hf_path", "m", *tls])) == {
        "addr": "0.0.0.0", "certfile": "c.pem", "keyfile": "k.pem", "client_cafile": "ca.pem",
        "client_auth_required": True}

    port = free_port()
    started = _start_with_fake_jetstream(monkeypatch, port)
    server = started["metrics"][0] if isinstance(started["metrics"], tuple) else None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200
        other = own_other_address()
        if other is not None:  # the same port at another address of this machine: nobody listens
            with socket.socket() as s:
                s.settimeout(5)
                assert s.connect_ex((other, port)) != 0
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()

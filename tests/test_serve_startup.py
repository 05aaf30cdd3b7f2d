"""``python -m rstarjax.serve`` refuses what it cannot serve before anything loads, in one line
with status 2: flags out of range (ports, slots, pages, stop ids, seeds, log level), TLS files
that are not PEM, ports another process listens on. None of this needs JetStream (an optional
extra): the checks run before it is imported."""
import socket
import subprocess
import sys

import pytest

from process_support import ROOT, free_port, worker_env
from rstarjax import serve

parse = serve.build_parser().parse_args


def _errors(*flags):
    return serve.flag_errors(parse(["--hf_path", "m", *flags]))


def test_flags_in_range_pass():
    assert _errors() == []
    assert _errors("--port", "65535", "--prometheus_port", "1", "--seed", str(2**31 - 1),
                   "--stop_ids", "1,2,3,4,5,6,7,8", "--log_level", "info", "--shutdown_grace", "0") == []


@pytest.mark.parametrize("flags, says", [
    (["--port", "70000"], "--port 70000 is not a TCP port (1-65535)"),
    (["--port", "0"], "--port 0 is not a TCP port (1-65535)"),
    (["--prometheus_port", "65536"], "--prometheus_port 65536 is not a TCP port"),
    (["--prometheus_port", "9000"], "--prometheus_port 9000 is --port too"),
    (["--num_slots", "0"], "--num_slots must be >= 1, got 0"),
    (["--page_size", "0"], "--page_size must be >= 1, got 0"),
    (["--kv_pages", "-1"], "--kv_pages must be >= 0"),
    (["--threads", "-1"], "--threads must be >= 0"),
    (["--max_len", "1"], "--max_len must be >= 2"),
    (["--log_level", "LOUD"], "--log_level 'LOUD' is not one of DEBUG"),
    (["--stop_ids", "300,301,302,303,304,305,306,307,308"], "--stop_ids: at most 8 ids"),
    (["--stop_ids", "1,a"], "--stop_ids: 'a' is not an integer"),
    (["--stop_ids", "-3"], "--stop_ids: ids are >= 0"),
    (["--seed", str(2**31)], "--seed must fit a 32-bit signed integer"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--shutdown_grace", "-1"], "--shutdown_grace must be >= 0 seconds"),
])
def test_bad_flags_are_named(flags, says):
    assert any(says in e for e in _errors(*flags)), _errors(*flags)


def test_a_bad_flag_is_refused_in_one_line_before_anything_loads(capsys):
    """Status 2 and one line (no usage block, no traceback); the model path is never read."""
    for flags in (["--port", "70000"], ["--page_size", "0"], ["--log_level", "LOUD"],
                  ["--num_slots", "0"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit) as exit_info:
            serve.main(["--hf_path", "/nonexistent", *flags])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, err
        assert len(err.strip().splitlines()) == 1 and "error:" in err, err


def test_tls_files_that_are_not_pem_are_refused(tmp_path):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    args = parse(["--hf_path", "m", "--expose", "--tls_cert", str(garbage), "--tls_key", str(garbage),
                  "--tls_client_ca", str(garbage)])
    assert serve.access_errors(args) == []  # files, so the access check passes them
    errors = serve.tls_errors(args)
    assert len(errors) == 2, errors
    assert errors[0].startswith(f"--tls_cert {str(garbage)!r} / --tls_key {str(garbage)!r}: not a PEM")
    assert errors[1].startswith(f"--tls_client_ca {str(garbage)!r}: no PEM CA certificate")
    assert serve.tls_errors(parse(["--hf_path", "m"])) == []  # loopback: no TLS files to read


def test_a_real_certificate_passes_the_tls_check(tmp_path):
    key, cert = tmp_path / "server.key", tmp_path / "server.pem"
    r = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
                       capture_output=True, text=True, timeout=60) if _has_openssl() else None
    if r is None or r.returncode != 0:
        pytest.skip("no openssl to make a certificate")
    args = parse(["--hf_path", "m", "--expose", "--tls_cert", str(cert), "--tls_key", str(key),
                  "--tls_client_ca", str(cert)])
    assert serve.tls_errors(args) == []
    mismatched = tmp_path / "other.key"
    subprocess.run(["openssl", "genrsa", "-out", str(mismatched), "2048"], capture_output=True, check=True, timeout=60)
    errors = serve.tls_errors(parse(["--hf_path", "m", "--expose", "--tls_cert", str(cert),
                                     "--tls_key", str(mismatched)]))
    assert len(errors) == 1 and "matching unencrypted private key" in errors[0], errors


def _has_openssl() -> bool:
    import shutil

    return shutil.which("openssl") is not None


def test_ports_another_process_listens_on_are_refused():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        free = free_port()
        assert serve.port_errors(parse(["--hf_path", "m", "--port", str(free)])) == []
        # the gRPC port binds every interface, so a listener on loopback alone blocks it too
        assert serve.port_errors(parse(["--hf_path", "m", "--port", str(port)])) == [
            f"--port {port}: cannot listen there (another process listens there)"]
        assert serve.port_errors(parse(["--hf_path", "m", "--port", str(free),
                                        "--prometheus_port", str(port)])) == [
            f"--prometheus_port {port}: cannot listen there (another process listens there)"]
    finally:
        busy.close()


def test_the_cli_refuses_in_one_line_without_a_traceback():
    """The module as users run it: status 2, one line on stderr, nothing else."""
    r = subprocess.run([sys.executable, "-m", "rstarjax.serve", "--hf_path", "/nonexistent",
                        "--port", "70000"], capture_output=True, text=True, env=worker_env(1),
                       cwd=ROOT, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "python -m rstarjax.serve: error: --port 70000 is not a TCP port (1-65535) (--help lists the flags)"]

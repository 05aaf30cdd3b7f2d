"""Test support: a test file run as several jax.distributed worker processes on CPU."""
import os
import queue
import socket
import subprocess
import sys
import threading
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def own_other_address() -> str | None:
    """An address of this machine's network namespace that is not loopback (None if none): the
    source address of a route out (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def start_on_stand_in_jetstream(monkeypatch, grpc, server_lib, **start_kw):
    """``serve.start_server`` on a stand-in JetStream (an optional extra): ``server_lib`` stands
    for its ``jetstream.core.server_lib`` (at least ``run``) and ``grpc`` for the grpc module;
    returns what ``start_server`` returned."""
    import types

    from rstarjax import serve

    jetstream_core = types.SimpleNamespace(
        config_lib=types.SimpleNamespace(ServerConfig=lambda **kw: kw, MetricsServerConfig=lambda **kw: kw),
        server_lib=server_lib)
    monkeypatch.setitem(sys.modules, "grpc", grpc)
    monkeypatch.setitem(sys.modules, "jetstream", types.ModuleType("jetstream"))
    monkeypatch.setitem(sys.modules, "jetstream.core", jetstream_core)
    monkeypatch.setitem(sys.modules, "rstarjax.serving.jetstream_engine",
                        types.SimpleNamespace(patch_jetstream_for_current_jax=lambda: None))
    device = types.SimpleNamespace(platform="cpu")
    adapter = types.SimpleNamespace(mesh=types.SimpleNamespace(devices=types.SimpleNamespace(flat=[device])))
    return serve.start_server(adapter, 9000, **start_kw)


def worker_env(devices: int, **extra) -> dict:
    """The environment of a worker process: ``devices`` CPU devices, the repository and the
    tests on its path, and the test process's XLA optimisation level (tests/conftest.py):
    workers run a few steps, so compiling less saves more than it costs (a two-trainer rollout
    test: 166 -> 122 CPU s), and the runs a test compares are compiled alike."""
    level = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if f.startswith("--xla_backend_optimization_level")]
    return dict(os.environ, **extra, JAX_PLATFORMS="cpu",
                XLA_FLAGS=" ".join([f"--xla_force_host_platform_device_count={devices}", *level]),
                PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))


def output_of(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """What a process started with ``stdout=PIPE`` printed, killing it first: for a failure
    message. Bounded: a grandchild that inherited the pipe cannot hold it open forever."""
    proc.kill()
    try:
        return proc.communicate(timeout=timeout)[0] or ""
    except subprocess.TimeoutExpired:
        return f"(its output pipe was still held open {timeout:.0f} s after the kill)"


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each process's output, all of them within one ``timeout`` from now (not ``timeout`` each,
    one after another); the ones still running then are killed and TimeoutExpired raised."""
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def read_lines_until(proc: subprocess.Popen, done, timeout: float) -> list[str]:
    """Lines of ``proc``'s stdout up to and including the first for which ``done(line)``, read
    with a bound: raises TimeoutError (with what it read) if that line has not come within
    ``timeout`` s, EOFError if the output ended first. A daemon thread reads, so a child that
    stops printing cannot block the test."""
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline, got = time.monotonic() + timeout, []
    while True:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"no such line within {timeout:.0f} s:\n" + "".join(got)[-3000:]) from None
        if line is None:
            raise EOFError("the output ended first:\n" + "".join(got)[-3000:])
        got.append(line)
        if done(line):
            return got


def run_processes(script: str, argvs: list[list[str]], devices: int = 1, timeout: float = 300.0
                  ) -> list[tuple[int, str]]:
    """``script`` started once per argument list, each process with ``devices`` CPU devices and
    the repository and the tests on its path; waits for all, killing any left after
    ``timeout`` s. Each one's (return code, output)."""
    procs = [subprocess.Popen([sys.executable, script, *map(str, argv)], env=worker_env(devices), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv in argvs]
    outs = communicate_all(procs, timeout)
    return [(p.returncode, out) for p, out in zip(procs, outs)]

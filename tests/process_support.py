"""Test support: a test file run as several jax.distributed worker processes on CPU."""
import os
import socket
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def run_processes(script: str, argvs: list[list[str]], devices: int = 1, timeout: float = 300.0
                  ) -> list[tuple[int, str]]:
    """``script`` started once per argument list, each process with ``devices`` CPU devices and
    the repository and the tests on its path; waits for all, killing any left after
    ``timeout`` s. Each one's (return code, output)."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, script, *map(str, argv)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv in argvs]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out) for p, out in zip(procs, outs)]

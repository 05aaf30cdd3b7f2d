"""A program that changes its own limits: its failure is the model's, never an infrastructure error.

The sandbox is PID 1 of its namespace, so the kernel's SIGKILL at RLIMIT_CPU's hard limit is the
only way a limit ends it; a kill below the configured limit used to read as one from outside
the call (an infra error: retried, then the episode dropped from training, the model never
shown its mistake). Where seccomp is available the limit cannot be changed; where it is not, the
worker judges the kill by the limit the sandbox really had.
"""
import ctypes
import errno
import json
import os
import platform
import resource
import subprocess
import sys
import time

import pytest

from rstarjax.env import CodeExecutor, seccomp, worker

LOWERS_ITS_CPU_LIMIT = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (1, 1))\nwhile True:\n    pass"
SYSCALLS = {"x86_64": {"setrlimit": 160, "prlimit64": 302}, "aarch64": {"setrlimit": 164, "prlimit64": 261}}
MAP_PRIVATE, MAP_ANONYMOUS, MAP_FIXED_NOREPLACE = 0x02, 0x20, 0x100000
PROT_READ_WRITE = 0x3


def run_in_filtered_child(check) -> dict:
    """`check()` (-> a JSON-able dict) in a fresh interpreter under the limits filter alone. Not a
    fork of this test process: it runs XLA's and other libraries' threads, and a fork's child
    can block on a lock one of them held (dlopen's, for ctypes), which would hang the suite."""
    script = (
        "import ctypes, json, sys\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "import test_env_self_limits as t\n"
        "from rstarjax.env import seccomp\n"
        "from rstarjax.env.isolation import prctl\n"
        "assert seccomp.prepare()\n"
        "if prctl(seccomp.PR_SET_NO_NEW_PRIVS, 1) != 0:\n"
        "    raise OSError(ctypes.get_errno(), 'PR_SET_NO_NEW_PRIVS')\n"
        "seccomp.install_limits_filter()\n"
        f"print(json.dumps(t.{check.__name__}()))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def refused(fn) -> bool:
    try:
        fn()
    except (ValueError, OSError):  # Python's resource module reports EPERM as a ValueError
        return True
    return False


def raw_syscall(nr: int, *args: int) -> int:
    """-errno or the result of a raw system call (what ctypes in model code can do)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    return -ctypes.get_errno() if rc < 0 else rc


def limits_checks() -> dict:
    nr = SYSCALLS[platform.machine()]
    before = resource.getrlimit(resource.RLIMIT_CPU)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    # a new limit at an address whose low 32 bits are 0: the filter must read both halves
    aligned = libc.mmap(0x7E0000000000, 4096, PROT_READ_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
    assert aligned == 0x7E0000000000, hex(aligned or 0)
    (ctypes.c_uint64 * 2).from_address(aligned)[:] = [1, 1]
    return {
        "setrlimit_cpu": refused(lambda: resource.setrlimit(resource.RLIMIT_CPU, (1, 1))),
        "setrlimit_rttime": refused(lambda: resource.setrlimit(resource.RLIMIT_RTTIME, (1, 1))),
        "prlimit_cpu_set": refused(lambda: resource.prlimit(0, resource.RLIMIT_CPU, (1, 1))),
        "prlimit_cpu_set_aligned": raw_syscall(nr["prlimit64"], 0, resource.RLIMIT_CPU, aligned, 0),
        # the kernel reads the resource as an unsigned int: 2**32 is RLIMIT_CPU to it
        "setrlimit_cpu_high_bits": raw_syscall(nr["setrlimit"], (1 << 32) | resource.RLIMIT_CPU, aligned),
        "getrlimit_cpu": list(resource.getrlimit(resource.RLIMIT_CPU)),
        "prlimit_cpu_get": list(resource.prlimit(0, resource.RLIMIT_CPU)),
        "setrlimit_nofile": refused(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))),
        "cpu_before": list(before),
    }


@pytest.mark.skipif(seccomp.build_limits_program() is None, reason="no seccomp filter for this architecture")
def test_the_limits_filter_refuses_setting_a_locked_limit_and_allows_reading_it():
    assert seccomp.prepare()
    got = run_in_filtered_child(limits_checks)
    assert got["setrlimit_cpu"] and got["setrlimit_rttime"] and got["prlimit_cpu_set"], got
    assert got["prlimit_cpu_set_aligned"] == -errno.EPERM, got
    assert got["setrlimit_cpu_high_bits"] == -errno.EPERM, got
    # reading stays allowed, and so does setting the limits that cannot kill a PID 1
    assert got["getrlimit_cpu"] == got["prlimit_cpu_get"] == got["cpu_before"], got
    assert not got["setrlimit_nofile"], got


def run_and_serve_next(ex, code, timeout):
    t0 = time.monotonic()
    r = ex.run(code, timeout=timeout)
    assert time.monotonic() - t0 < timeout + 5, r  # a bound on a hang, not a timing
    assert ex.run("print(6 * 7)", timeout=10).text == "42\n"
    return r


def test_a_program_that_lowers_its_own_cpu_limit_gets_its_own_error_not_an_infra_error():
    with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=1) as ex:
        r = run_and_serve_next(ex, LOWERS_ITS_CPU_LIMIT, timeout=10)
        assert not r.infra_error, r
        if ex.isolation.get("seccomp"):  # refused outright: the program is told why
            assert r.kind == "error" and "resource.setrlimit(resource.RLIMIT_CPU, (1, 1))" in r.text, r
        else:  # killed at the limit it set: its timeout
            assert (r.kind, r.text) == ("timeout", "TimeoutError: CPU time limit exceeded"), r


def test_without_seccomp_a_kill_at_the_limit_the_program_set_is_its_cpu_timeout():
    """isolate=False: no seccomp, so the program can lower its limit; the kernel's SIGKILL at that
    limit is a CPU timeout, judged by the limit the sandbox really had (not 'killed by SIGKILL')."""
    with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=1, isolate=False) as ex:
        assert not ex.isolation.get("seccomp")
        r = run_and_serve_next(ex, LOWERS_ITS_CPU_LIMIT, timeout=10)
        assert (r.kind, r.text, r.infra_error) == ("timeout", "TimeoutError: CPU time limit exceeded", False), r


def test_a_sigkill_at_a_cpu_limit_the_sandbox_lowered_is_the_programs():
    """A PID 1 killed after 0.8 s of CPU (wait4's runtime: the kernel's tick-measured limit was
    1 s) under a configured limit of (6, 7): from outside, unless the sandbox itself had a hard
    limit of 1 s when it died."""
    configured = (6, 7)
    threshold = worker.cpu_kill_threshold
    assert worker.sigkill_cause(False, 0.8, threshold(configured, None), True) == worker.KILLED_FROM_OUTSIDE
    assert worker.sigkill_cause(False, 0.8, threshold(configured, 7.0), True) == worker.KILLED_FROM_OUTSIDE
    assert worker.sigkill_cause(False, 0.8, threshold(configured, 1.0), True) == worker.KILLED_BY_CPU_LIMIT
    # lowered to 5 s: a kill at 2 s of CPU is still not its limit's
    assert worker.sigkill_cause(False, 2.0, threshold(configured, 5.0), True) == worker.KILLED_FROM_OUTSIDE
    assert threshold(configured, 5.0) == 4.0


def test_the_cpu_limit_of_a_dead_child_is_read_before_it_is_reaped():
    child = subprocess.Popen([sys.executable, "-c",
                              "import resource; resource.setrlimit(resource.RLIMIT_CPU, (2, 3))"])
    try:
        deadline = time.monotonic() + 60
        # dead, not reaped (WNOWAIT), waited for with a bound (WNOHANG polls)
        while os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert worker.cpu_hard_limit_of(child.pid) == 3.0
    finally:
        child.kill()
        child.wait(timeout=10)

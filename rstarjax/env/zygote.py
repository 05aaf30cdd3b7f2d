"""The zygote: a clean, preloaded interpreter that forks workers (run as a separate script).

Process tree (executor.py starts the zygote with `python zygote.py CONFIG_JSON`):

    trainer (CodeExecutor)            root PID namespace, untouched
      zygote                          numpy/sympy/scipy/math_verify imported once ("heavy"), or
      |                               the stdlib only ("lean"); own network + mount namespace
      |  worker i                     forked on request; the event loop (worker.py)
      |    forker (one per slot)      forked by the worker before it reads anything (forker.py)
      |    sandbox (per call)         cloned by a forker as the worker's child; own PID, mount and
      |                               IPC namespace; the slot's cgroups and unprivileged uid

Why a separate interpreter rather than a fork of the trainer: the trainer has JAX threads (fork
after threads is unsafe) and its environment holds secrets. The zygote starts from a scrubbed
environment and never imports jax.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import signal
import socket
import sys
import types


def _bootstrap_package() -> None:
    """Import rstarjax.env.* without running rstarjax/__init__.py (which may import jax)."""
    env_dir = os.path.dirname(os.path.abspath(__file__))
    pkg_dir = os.path.dirname(env_dir)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != env_dir]  # no top-level "wire"
    for name, path in (("rstarjax", pkg_dir), ("rstarjax.env", env_dir)):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [path]
            sys.modules[name] = module


if __name__ == "__main__":
    _bootstrap_package()  # before the imports below: rstarjax/__init__.py must not run here

from rstarjax.env import forker, isolation, official_reward, routing, sandbox, verify, worker  # noqa: E402

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25


def collapse_heap() -> int:
    """Move the anonymous writable memory (the preloaded heap) onto transparent huge pages, in
    place (MADV_COLLAPSE, Linux >= 6.1); return how many bytes now sit on huge pages.

    Why: a sandbox is a fork of this heap, and on this kind of machine the fork and the exit
    were most of a call's CPU (copying and then unmapping one page-table entry per 4 KiB page,
    with memcg accounting each). A huge page is one entry. Pages a process writes after the fork
    are still copied 4 KiB at a time (the kernel splits the huge mapping in that process only),
    so memory use does not grow. Where the kernel refuses (older kernels, THP "never"), nothing
    changes."""
    done = 0
    try:
        with open("/proc/self/maps") as maps:
            regions = [line.split() for line in maps]
    except OSError:
        return 0
    for fields in regions:
        perms, path = fields[1], (fields[5] if len(fields) > 5 else "")
        if perms != "rw-p" or path not in ("", "[heap]"):  # anonymous, private, writable
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        lo = (lo + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        hi &= ~(HUGE_PAGE - 1)
        if hi <= lo:
            continue
        start, length = ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo)
        isolation.libc_call("madvise", start, length, MADV_HUGEPAGE)  # khugepaged's later work goes here too
        if isolation.libc_call("madvise", start, length, MADV_COLLAPSE) == 0:
            done += hi - lo
    return done


def preload(tier: str) -> None:
    """Import what model code usually imports, so a forked sandbox pays nothing for it."""
    for name in sorted(routing.LEAN_MODULES):
        importlib.import_module(name)
    if tier == routing.HEAVY:  # imported here: the lean zygote must not have them
        import numpy  # noqa: F401
        import scipy  # noqa: F401  (submodules are lazy; scipy.special alone would double fork cost)
        import sympy  # noqa: F401

        # checks its verdicts too: where math-verify cannot read LaTeX it raises, and the pool
        # refuses to start (its message on the trainer's stderr) instead of scoring every
        # non-integer answer 0
        verify.warm_up()
        official_reward.warm_up()
        warm_up_libraries()


def warm_up_libraries() -> None:
    """Exercise what math tool calls typically do, once, in the zygote: sympy and numpy import
    much lazily (printers, solvers, polys) and fill caches on first use; done here, every forked
    sandbox inherits it instead of paying ~0.2-1 s for it again."""
    import numpy as np
    import sympy

    x, y = sympy.symbols("x y")
    with contextlib.redirect_stdout(io.StringIO()):
        print(sympy.expand((x + 1) ** 5), sympy.factor(x**2 - 1), sympy.simplify(sympy.sin(x) ** 2 + sympy.cos(x) ** 2))
        print(sympy.solve(x**2 - 2, x), sympy.solve([x + y - 2, x - y], [x, y]), sympy.integrate(x**2, x))
        print(sympy.factorint(2**32 + 1), sympy.isprime(97), sympy.primerange(2, 30), sympy.binomial(10, 3))
        print(sympy.Rational(1, 3) + 1, sympy.pi.evalf(30), sympy.sqrt(8), sympy.latex(x**2), sympy.nsimplify(0.5))
        print(sympy.Matrix([[1, 2], [3, 4]]).det(), sympy.diff(sympy.exp(x) * x, x), sympy.limit(sympy.sin(x) / x, x, 0))
        print(sympy.series(sympy.exp(x), x, 0, 3), sympy.gcd(12, 18), sympy.divisors(28), sympy.totient(10))
        print(np.array([1.5, 2.0]), np.arange(6).reshape(2, 3) @ np.ones(3), np.linalg.det(np.eye(2)))


def probe_realtime() -> bool:
    """Can a worker become real-time here? (Tried in a throwaway child: the zygote stays as is.)"""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if forker.become_realtime() else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def probe_own_tmp(workdir: str, binds: tuple[str, ...], tid_offset: int | None, timeout_s: float = 10.0) -> str:
    """Can a call have its own /tmp here (``isolation.mount_call_filesystems`` with ``binds``)?
    Tried in a throwaway child in a mount namespace of its own: /tmp writable, the working
    directory and the bound-back entries in it. Returns "" where it can, else why not (calls
    then keep the zygote's /tmp). A child still running after ``timeout_s`` is killed and the
    probe tried once more, as ``forker.probe_clone_flags`` does."""
    for _ in range(2):
        read_end, write_end = os.pipe()
        try:
            pid = forker.clone(isolation.CLONE_NEWNS, tid_offset, sibling=False)
        except OSError as exc:
            os.close(read_end)
            os.close(write_end)
            return f"clone: {exc}"
        if pid == 0:
            os.close(read_end)
            try:
                isolation.mount_call_filesystems(workdir, None, 1 << 20, False, binds)
                with open("/tmp/probe", "w") as f:
                    f.write("x")
                missing = [p for p in (workdir, *binds) if not os.path.exists(p)]
                if missing:
                    raise FileNotFoundError(f"not in the call's /tmp: {missing}")
                os._exit(0)
            except BaseException as exc:  # noqa: BLE001
                os.write(write_end, f"{type(exc).__name__}: {exc}".encode()[:500])
                os._exit(1)
        os.close(write_end)
        ok = forker.exited_ok(pid, timeout_s)  # None: it hung, and was killed
        with os.fdopen(read_end, "rb") as f:
            said = f.read().decode(errors="replace")
        if ok is not None:
            return "" if ok else said or "the probe child failed"
    return f"the probe child did not exit within {timeout_s} s, twice"


def probe(config: dict, info: dict) -> dict:
    """What every sandbox can get here: namespaces per call, the uid drop."""
    isolate = bool(config.get("isolate", True))
    info["tid_offset"] = forker.probe_tid_offset()
    tid = info["tid_offset"]
    info["pidns"] = isolate and forker.probe_clone_flags(isolation.CLONE_NEWPID, tid)
    info["call_mounts"] = bool(info["mountns"]) and forker.probe_clone_flags(isolation.CLONE_NEWNS, tid)
    binds = isolation.call_tmp_binds(info, config["workdir_root"])
    refused = ("no fresh root or no mount namespace per call, or what the fresh root shows below /tmp "
               "holds the working directory") if binds is None else probe_own_tmp(
        config["workdir_root"], binds, tid)
    info["own_tmp"] = not refused
    if refused:
        info["own_tmp_refused"] = refused
    else:
        info["call_tmp_binds"] = list(binds)
    info["worker_realtime"] = bool(config.get("worker_realtime", True)) and probe_realtime()
    info["uid_drop"] = isolate and info["root"]
    if info["uid_drop"] and not isolation.probe_unprivileged_imports(int(config["uid_base"])):
        # Better a working sandbox contained by its namespaces than one that cannot import.
        info["uid_drop"] = False
        info["uid_drop_refused"] = "the sandbox uid cannot read the Python installation"
    return info


def zygote_main(argv: list[str]) -> None:
    config = json.loads(argv[1])
    control = socket.socket(fileno=int(config["control_fd"]))
    isolation.set_process_name("rj-zygote")
    if not forker.supported():
        raise RuntimeError(f"the code environment supports x86_64 and aarch64 Linux, not {os.uname().machine}")
    # The trainer's PYTHONPATH entries (the environment is scrubbed, so they come in the config):
    # packages installed there (pip --target, a cluster's module system) preload here too.
    sys.path[1:1] = [p for p in config.get("import_paths", []) if p not in sys.path]
    info = isolation.setup_zygote(config)
    preload(config.get("preload", "heavy"))
    # After the imports: the fresh root shows the rstarjax files imported, and nothing else of
    # the checkout.
    info = isolation.confine_filesystem(config, info)
    if "jax" in sys.modules:  # pragma: no cover - guarded by a test
        raise RuntimeError("the zygote must not import jax")
    info = probe(config, info)
    info["seccomp"] = sandbox.prepare_zygote() and bool(config.get("isolate", True))
    gc.collect()
    gc.freeze()  # keep the preloaded heap out of GC passes: fewer copy-on-write faults per fork
    info["huge_page_bytes"] = collapse_heap() if config.get("huge_pages", True) else 0
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped automatically
    # The control socket is SOCK_SEQPACKET: one message per send, fds ride along (SCM_RIGHTS).
    control.send(json.dumps({"op": "ready", "pid": os.getpid(), "isolation": info}).encode())
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        except OSError:
            break
        if not msg:
            break
        request = json.loads(msg)
        if request.get("op") != "spawn" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            control.close()
            worker.worker_main(fds[0], int(request["index"]), config, info)
        os.close(fds[0])
        control.send(json.dumps({"op": "spawned", "index": request["index"], "pid": pid}).encode())
    os._exit(0)


if __name__ == "__main__":
    zygote_main(sys.argv)

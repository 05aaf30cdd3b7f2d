"""Child-side execution: what happens inside one freshly forked sandbox process.

The worker (see zygote.py) forks one child per call, with the call or ahead of need (a warm
sandbox, which waits on a socket for its call). What is the same for every sandbox (signals,
the scrubbed environment, stdio streams) the zygote prepared once (prepare_zygote). The child
confines itself (its own session, parent-death signal, nice, HOME/TMPDIR and a fresh working
directory); once it has its call it sets its rlimits, drops to its unprivileged uid, runs the
model's code with `exec`, and writes ONE JSON line describing the outcome on fd 3.
Everything the model printed goes to fd 1/2, which the worker reads with a cap.

Only the standard library is imported at module level: this module is loaded by the zygote.
"""
from __future__ import annotations

import ast
import builtins
import ctypes
import dataclasses
import fcntl
import io
import json
import linecache
import os
import re
import resource
import signal
import socket
import sys
import traceback

CODE_FILENAME = "<code>"
RESULT_FD = 3
CHANNEL_FD = 4  # a warm sandbox's socket to its worker, closed before the model's code runs

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl  # resolved here, once: prepare_zygote sets its signature


@dataclasses.dataclass
class SandboxLimits:
    """Per-call resource limits (all enforced by the kernel inside the child)."""

    memory_bytes: int = 1 << 30  # RLIMIT_AS
    max_processes: int = 32  # RLIMIT_NPROC (processes + threads), per sandbox uid (one uid per slot)
    max_file_bytes: int = 64 << 20  # RLIMIT_FSIZE
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_output_bytes: int = 64 << 10  # per stream kept by the worker (head + tail)
    cpu_slack_s: int = 1  # RLIMIT_CPU = ceil(timeout) + slack (wall clock is enforced separately)
    nice: int = 10  # sandboxes yield to their worker, so a fork bomb cannot starve the kill


def libc_call(name: str, *args) -> int:
    """Call a libc function; returns 0 or the errno (never raises)."""
    rc = getattr(_libc, name)(*args)
    return 0 if rc == 0 else (ctypes.get_errno() or -1)


# --------------------------------------------------------------------------------------------
# Environment and confinement of the child.

SAFE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONHASHSEED": "0",
    # BLAS thread pools inherited through fork are broken; one thread per sandbox is also what a
    # CPU-shared pool wants.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}


def set_limits(limits: SandboxLimits, timeout_s: float) -> None:
    cpu = int(timeout_s + 0.999) + limits.cpu_slack_s
    for res, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_AS, limits.memory_bytes),
        (resource.RLIMIT_NPROC, limits.max_processes),
        (resource.RLIMIT_FSIZE, limits.max_file_bytes),
        (resource.RLIMIT_NOFILE, limits.max_open_files),
    ):
        resource.setrlimit(res, (value, value))


def drop_privileges(uid: int) -> None:
    """Become an unprivileged uid (no capabilities, no supplementary groups)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.geteuid() != uid or os.getuid() != uid:  # pragma: no cover - kernel guarantees it
        os._exit(99)


def prepare_zygote() -> None:
    """Everything a sandbox needs that depends neither on the call nor on the sandbox: done once
    in the zygote, so every fork inherits it instead of redoing it.

    Why: a forked child pays a copy-on-write page fault (about 4 us on a 2-core VM) for every
    page it writes, and touching an object writes its reference count. Redone in each child,
    resetting five signals, scrubbing `os.environ`, resolving `prctl` through ctypes and building
    three text streams touched about 200 pages: a quarter of a trivial call's sandbox CPU."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    # A non-default SIGPIPE disposition is what CPython itself sets: keep EPIPE as an exception.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # (SIGCHLD: the zygote ignores it to reap its workers; each worker resets it to SIG_DFL,
    # which its sandboxes inherit.)
    for key in [k for k in os.environ if k not in SAFE_ENV and k != "HOME"]:
        del os.environ[key]  # e.g. PYTHONDONTWRITEBYTECODE: read at startup, unneeded since
    _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _prctl.restype = ctypes.c_int
    install_stdio()


def confine_before_call(workdir: str) -> None:
    """What does not depend on the call (a warm sandbox does it before its call exists, see
    child_main). Still root: no process runs under a sandbox uid between calls, and the uid's
    limits start with the call. What does not depend on the sandbox either was done once in the
    zygote (prepare_zygote)."""
    os.setsid()  # own session and process group
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # worker dies -> we die
    os.chdir(workdir)
    os.environ["HOME"] = workdir
    os.environ["TMPDIR"] = workdir


def confine_for_call(limits: SandboxLimits, timeout_s: float, sandbox_uid: int | None) -> None:
    """The rest of the confinement, once the call (and so its timeout) is known; then the
    model's code runs. Any failure aborts the child."""
    set_limits(limits, timeout_s)
    if sandbox_uid is not None:
        drop_privileges(sandbox_uid)
    os.umask(0o077)


# --------------------------------------------------------------------------------------------
# Running the code (IPython-like: the value of a trailing expression is displayed).

_LIB_PATH = re.compile(r"(/[^\s\"':]*)?/(site|dist)-packages/")
_STDLIB_PATH = re.compile(re.escape(os.path.dirname(os.__file__)) + r"/")


def scrub_paths(text: str, workdir: str | None = None) -> str:
    """Remove host paths from messages shown to the model."""
    text = _LIB_PATH.sub("<lib>/", text)
    text = _STDLIB_PATH.sub("<stdlib>/", text)
    if workdir:
        text = text.replace(workdir + "/", "").replace(workdir, ".")
    return text


def format_exception_compact(exc: BaseException, workdir: str | None = None) -> str:
    """Traceback restricted to the model's own frames, repeated frames collapsed, no host paths."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == CODE_FILENAME]
    lines = []
    if frames:
        lines.append("Traceback (most recent call last):\n")
        lines.extend(traceback.StackSummary.from_list(frames).format())
    lines.extend(traceback.format_exception_only(type(exc), exc))
    return scrub_paths("".join(lines), workdir).rstrip("\n")


def middle_truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}\n... [{len(text) - max_chars} characters truncated] ...\n{text[-tail:]}"


OK = {"status": "ok", "text": ""}  # shared: never mutated (see write_result)
OK_LINE = (json.dumps(OK) + "\n").encode()


def run_code(code: str, workdir: str | None, max_chars: int) -> dict:
    """Execute `code` in a fresh __main__ namespace. Returns {"status": ok|display|error, "text"}.

    ok: finished, nothing to display (the worker turns it into "stdout" if anything was printed);
    display: the repr of the trailing expression; error: compact traceback.
    """
    linecache.cache[CODE_FILENAME] = (len(code), None, code.splitlines(True), CODE_FILENAME)
    namespace = {"__name__": "__main__", "__builtins__": builtins, "__file__": CODE_FILENAME}
    try:
        tree = ast.parse(code, CODE_FILENAME, "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, CODE_FILENAME, "exec"), namespace)
        value = None
        if last is not None:
            value = eval(compile(ast.Expression(last.value), CODE_FILENAME, "eval"), namespace)
        if value is None:
            return OK
        return {"status": "display", "text": middle_truncate(repr(value), max_chars)}
    except SystemExit as exc:  # sys.exit(): 0 / None is a normal end, like a script
        if exc.code in (None, 0):
            return OK
        return {"status": "error", "text": middle_truncate(f"SystemExit: {exc.code}", max_chars)}
    except BaseException as exc:  # noqa: BLE001 - everything the model raises is a result
        try:
            text = format_exception_compact(exc, workdir)
        except BaseException:  # noqa: BLE001 - e.g. MemoryError while formatting
            text = f"{type(exc).__name__}"
        return {"status": "error", "text": middle_truncate(text, max_chars)}


def install_stdio() -> None:
    """Our own text streams over fds 0-2, made in the zygote (prepare_zygote): a sandbox's fds
    0-2 are its pipes and memfd by the same numbers. The zygote and its workers never write to
    stdout, and stderr is line-buffered, so a fork inherits empty buffers."""
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
    sys.argv = [""]


def write_result(payload: dict) -> None:
    data = OK_LINE if payload is OK else (json.dumps(payload) + "\n").encode()
    view = memoryview(data)
    while view:
        n = os.write(RESULT_FD, view)
        view = view[n:]


def move_fds(targets: dict[int, int]) -> None:
    """dup2 each source fd onto its target number and close every fd above the targets, safe
    even when a source already sits on another's target number."""
    high = {target: fcntl.fcntl(source, fcntl.F_DUPFD, 64) for target, source in targets.items()}
    for target, fd in high.items():
        os.dup2(fd, target)
    os.closerange(max(targets) + 1, 1 << 16)  # nothing of the worker's reaches the model


def receive_call(channel_fd: int) -> tuple[dict, int] | None:
    """Block until the worker hands over a call: (call, stdin fd), or None when it closed the
    channel instead (the worker is going away)."""
    sock = socket.socket(fileno=channel_fd)
    try:
        _, fds, _, _ = socket.recv_fds(sock, 16, 2)
    finally:
        sock.detach()  # the fd stays open: the caller closes it
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return None
    call_fd, stdin_fd = fds
    try:
        with os.fdopen(call_fd, "rb") as f:  # the worker rewound it
            call = json.loads(f.read())
    except BaseException:
        os.close(stdin_fd)
        raise
    return call, stdin_fd


def child_main(limits: SandboxLimits, workdir: str, sandbox_uid: int | None, fds: dict, call: dict | None) -> None:
    """Entry point of a forked sandbox. Never returns.

    With `call` (a cold start) it runs that call, reading stdin from `fds["stdin"]`. Without
    (a warm sandbox, forked ahead of need) it does every step that does not depend on the call,
    then waits on `fds["channel"]` for the call and its stdin (two memfds)."""
    status = 70
    try:
        # First: until then we run at the worker's priority and would delay the worker itself.
        os.setpriority(os.PRIO_PROCESS, 0, limits.nice)
        targets = {1: fds["stdout"], 2: fds["stderr"], RESULT_FD: fds["result"]}
        if call is None:
            targets[CHANNEL_FD] = fds["channel"]
        else:
            targets[0] = fds["stdin"]
        move_fds(targets)
        confine_before_call(workdir)
        if call is None:
            received = receive_call(CHANNEL_FD)
            if received is None:
                status = 0
                return
            call, stdin_fd = received
            os.dup2(stdin_fd, 0)
            os.close(stdin_fd)
            os.close(CHANNEL_FD)  # the model gets fds 0-3 and nothing else
        confine_for_call(limits, float(call["timeout"]), sandbox_uid)
        if call["op"] == "verify":
            payload = _run_verify(call)
        else:
            payload = run_code(call["code"], workdir, limits.max_output_bytes)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001 - a closed/broken stdout is the model's business
            pass
        write_result(payload)
        status = 0
    finally:
        os._exit(status)


def _run_verify(call: dict) -> dict:
    from rstarjax.env.verify import is_correct  # preloaded by the zygote; under the pool's kill

    try:
        return {"status": "verify", "correct": bool(is_correct(call["response"], call["gold"]))}
    except BaseException as exc:  # noqa: BLE001
        return {"status": "verify", "correct": False, "error": f"{type(exc).__name__}: {exc}"[:500]}

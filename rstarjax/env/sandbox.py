"""Child-side execution: what happens inside one sandbox process.

A sandbox is cloned by its slot's forker (see forker.py) into its own PID and mount namespaces,
the slot's cgroups and the forker's seccomp filter (no new privileges); what is the same for
every sandbox (signals, the scrubbed environment, stdio streams) the zygote prepared once
(prepare_zygote). The child confines itself in two steps. Before its call exists (a warm
sandbox does this ahead of need): its own session, parent-death signal, oom_score_adj 1000, its
own /proc, working directory and /dev/shm. Once the call has arrived over its channel: rlimits
and the drop to its slot's unprivileged uid. Then it runs the model's code with `exec` and
writes ONE JSON line describing the outcome on fd 3. Everything the model printed goes to
fd 1/2, which the worker reads with a cap.

Only the standard library and rstarjax.env are imported: this module is loaded by the zygote.
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
import select
import signal
import sys
import traceback
import types

from rstarjax.env import isolation, seccomp, wire
from rstarjax.env.official_reward import score

CODE_FILENAME = "<code>"
RESULT_FD = 3
READY = b"R"  # first byte on fd 3, written once confined: what follows may come from the model
CHANNEL_FD = 4  # the sandbox's socket to its worker, closed before the model's code runs

OOM_SCORE_ADJ = b"1000"  # the kernel's first choice when memory runs out, before any trainer


@dataclasses.dataclass
class SandboxLimits:
    """Resource limits of one call (all enforced by the kernel)."""

    memory_bytes: int = 1 << 30  # RLIMIT_AS, per process
    max_processes: int = 32  # processes + threads of a call (RLIMIT_NPROC of its uid, and its cgroup)
    max_file_bytes: int = 64 << 20  # RLIMIT_FSIZE
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_output_bytes: int = 64 << 10  # per stream kept by the worker (head + tail)
    cpu_slack_s: int = 1  # RLIMIT_CPU = ceil(timeout) + slack, hard 1 s above (wall clock is enforced separately)
    nice: int = 10  # sandboxes yield to their worker, so a fork bomb cannot starve the kill
    call_memory_bytes: int = 1 << 30  # all processes of a call together, its files included (cgroup)
    call_cpus: float = 1.0  # CPU time of all processes of a call together: <= call_cpus x timeout (cgroup)
    disk_bytes: int = 256 << 20  # size of each of the call's own tmpfs: working dir, /dev/shm


@dataclasses.dataclass(frozen=True)
class Confinement:
    """What every sandbox of one slot does to itself: fixed per slot, known before any call."""

    workdir: str
    uid: int | None  # the slot's unprivileged uid; None: no uid drop here
    call_mounts: bool  # its own tmpfs for workdir and /dev/shm (it has its own mount namespace)
    own_proc: bool  # and a /proc of its own PID namespace
    drop_caps: bool = False  # no uid drop, but capabilities (a user namespace's): drop them all
    # its own writable /tmp holding workdir, these entries of the fresh root's /tmp bound back
    # (isolation.call_tmp_binds); None: the zygote's /tmp, read-only to the call
    tmp_binds: tuple[str, ...] | None = None
    # under its forker's seccomp filter: once the call's limits are set, it locks those whose
    # excess is a SIGKILL (seccomp.install_limits_filter)
    seccomp: bool = False


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
    # glibc gives each new thread a malloc arena of its own, reserving 64 MB of address space
    # each: under the call's RLIMIT_AS (1 GiB) a program with 16 threads could not allocate at
    # all. Read when a process starts: the zygote is started with this environment, so every
    # sandbox forked from it has two arenas, and so does every program a call starts.
    "MALLOC_ARENA_MAX": "2",
}


def cpu_limits(limits: SandboxLimits, timeout_s: float) -> tuple[int, int]:
    """RLIMIT_CPU (soft, hard) of a call's processes: ceil(timeout) + slack, and one second more.

    The hard limit is above the soft one so that a process gets SIGXCPU first, as any program
    does at its CPU limit (a timeout; see worker.py), and SIGKILL only if it survives that. The
    sandbox itself, PID 1 of its namespace, never gets the SIGXCPU (the kernel drops signals a
    namespace's init has no handler for): it is SIGKILLed at the hard limit, and the worker tells
    that kill from an outside one by the CPU time the process used (worker.sigkill_cause). Model
    code cannot change these limits where seccomp is available (seccomp.LOCKED_LIMITS); where it
    is not, the worker judges by the hard limit the sandbox really had when it died
    (worker.cpu_kill_threshold)."""
    soft = int(timeout_s + 0.999) + limits.cpu_slack_s
    return soft, soft + 1


def set_limits(limits: SandboxLimits, timeout_s: float) -> None:
    for res, value in (
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_CPU, cpu_limits(limits, timeout_s)),
        (resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes)),
        (resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes)),
        (resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files)),
    ):
        resource.setrlimit(res, value)


def drop_privileges(uid: int) -> None:
    """Become an unprivileged uid (no capabilities, no supplementary groups)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.geteuid() != uid or os.getuid() != uid:  # pragma: no cover - kernel guarantees it
        os._exit(99)


_CAP_HEADER = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
_NO_CAPS = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all empty


def drop_capabilities() -> None:
    """Give up every capability (those the zygote's user namespace granted: with them model code
    could mount over the fresh root). With no new privileges (seccomp.py) no exec regains any."""
    if isolation.libc_call("capset", ctypes.byref(_CAP_HEADER), ctypes.byref(_NO_CAPS)) != 0:
        os._exit(98)


def set_parent_death_signal() -> None:
    """SIGKILL when the parent dies. The kernel clears this at fork and at every uid change."""
    isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)


def worker_gone() -> bool:
    """Has the worker died (it holds the only read end of our result pipe)? Checked after the
    parent-death signal is set again, so a worker that died before is caught here and one that
    dies after sends the signal."""
    poller = select.poll()
    poller.register(RESULT_FD, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def prepare_zygote() -> bool:
    """Everything a sandbox needs that depends neither on the call nor on the sandbox: done once
    in the zygote, so every fork inherits it instead of redoing it. Returns whether the seccomp
    filter is available (forkers install it).

    Why: a forked child pays a copy-on-write page fault (about 4 us on a 2-core VM) for every
    page it writes, and touching an object writes its reference count. Redone in each child,
    resetting five signals, scrubbing `os.environ` and building three text streams touched about
    200 pages: a quarter of a trivial call's sandbox CPU."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    # A non-default SIGPIPE disposition is what CPython itself sets: keep EPIPE as an exception.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # (SIGCHLD: the zygote ignores it to reap its workers; each worker resets it to SIG_DFL,
    # which its forkers and sandboxes inherit.)
    for key in [k for k in os.environ if k not in SAFE_ENV and k != "HOME"]:
        del os.environ[key]  # e.g. PYTHONDONTWRITEBYTECODE: read at startup, unneeded since
    install_stdio()
    return seccomp.prepare()


def confine_before_call(confinement: Confinement, limits: SandboxLimits) -> None:
    """What does not depend on the call (a warm sandbox does it before its call exists). Still
    root: no process runs under a sandbox uid between calls, and the uid's limits start with the
    call."""
    os.setsid()  # own session and process group
    isolation.set_process_name("rj-sandbox")
    set_parent_death_signal()  # worker dies -> we die
    try:
        with open("/proc/self/oom_score_adj", "wb", 0) as f:
            f.write(OOM_SCORE_ADJ)  # as root: also the floor the sandbox cannot go below
    except OSError:
        pass
    if confinement.call_mounts:
        isolation.mount_call_filesystems(confinement.workdir, confinement.uid, limits.disk_bytes, confinement.own_proc,
                                         confinement.tmp_binds)
    os.chdir(confinement.workdir)
    os.environ["HOME"] = confinement.workdir
    os.environ["TMPDIR"] = confinement.workdir


def confine_for_call(confinement: Confinement, limits: SandboxLimits, timeout_s: float) -> None:
    """The rest of the confinement, once the call (and so its timeout) is known; then the
    model's code runs. Any failure aborts the child."""
    set_limits(limits, timeout_s)
    if confinement.seccomp:
        # The model's code runs in this process: it must not lower the CPU limit it is judged by
        # (a kill below the configured limit would read as one from outside the call).
        seccomp.install_limits_filter()
    if confinement.uid is not None:
        drop_privileges(confinement.uid)
        set_parent_death_signal()  # the uid change cleared it
        if worker_gone():
            os._exit(0)
    elif confinement.drop_caps:
        drop_capabilities()
    os.umask(0o077)


# --------------------------------------------------------------------------------------------
# Running the code (IPython-like: the value of a trailing expression is displayed).

_TOKEN_BOUNDARY = re.compile(r"""([\s"':]+)""")
_LIB_DIRS = ("/site-packages/", "/dist-packages/")
_STDLIB_DIR = os.path.dirname(os.__file__) + "/"


def _scrub_token(token: str) -> str:
    """`/any/path/site-packages/x` -> `<lib>/x` (from the token's first "/" to its last library
    directory)."""
    end = max((token.rfind(d) + len(d) for d in _LIB_DIRS if d in token), default=-1)
    if end < 0:
        return token
    return token[: token.index("/")] + "<lib>/" + token[end:]


def scrub_paths(text: str, workdir: str | None = None) -> str:
    """Remove host paths from messages shown to the model. Linear in the text (hostile stderr
    reaches this in the worker)."""
    if "-packages/" in text:
        text = "".join(_scrub_token(t) if "-packages/" in t else t for t in _TOKEN_BOUNDARY.split(text))
    text = text.replace(_STDLIB_DIR, "<stdlib>/")
    if workdir:
        text = text.replace(workdir + "/", "").replace(workdir, ".")
    return text


TRACEBACK_END_FRAMES = 50  # frames kept at each end of a deeper traceback


def code_frames(tb, keep: int = TRACEBACK_END_FRAMES) -> tuple[list, int]:
    """The model's own frames of a traceback, at most ``keep`` from each end, and how many were
    left out between them. Walking the chain is cheap, extracting a frame (its source line) is
    not: a RecursionError at a depth of 10**6 took longer to format than the call's time limit."""
    chain = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == CODE_FILENAME:
            chain.append(tb)
        tb = tb.tb_next
    omitted = max(0, len(chain) - 2 * keep)
    if omitted:
        chain = chain[:keep] + chain[-keep:]
    frames = traceback.StackSummary.extract(((t.tb_frame, t.tb_lineno) for t in chain), lookup_lines=True)
    return list(frames), omitted


def format_exception_compact(exc: BaseException, workdir: str | None = None) -> str:
    """Traceback restricted to the model's own frames, repeated frames collapsed, no host paths;
    of a deep one, its first and last ``TRACEBACK_END_FRAMES``."""
    frames, omitted = code_frames(exc.__traceback__)
    lines = []
    if frames:
        lines.append("Traceback (most recent call last):\n")
        if omitted:
            head = traceback.StackSummary.from_list(frames[:TRACEBACK_END_FRAMES]).format()
            tail = traceback.StackSummary.from_list(frames[TRACEBACK_END_FRAMES:]).format()
            lines += [*head, f"  [... {omitted} more frames ...]\n", *tail]
        else:
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


def fresh_main_module() -> dict:
    """A new, empty ``__main__`` module installed as ``sys.modules["__main__"]``, as a script
    or a notebook runs in; its namespace is the one returned. So what the code defines can be
    found by name (pickle, hence multiprocessing and ProcessPoolExecutor, look functions and
    classes up in ``sys.modules["__main__"]``), and ``import __main__`` is the code's own
    module, not the process's launcher."""
    module = types.ModuleType("__main__")
    module.__dict__.update(__builtins__=builtins, __file__=CODE_FILENAME)
    sys.modules["__main__"] = module
    return module.__dict__


def run_code(code: str, workdir: str | None, max_chars: int) -> dict:
    """Execute `code` in a fresh __main__ module. Returns {"status": ok|display|error, "text"}.

    ok: finished, nothing to display (the worker turns it into "stdout" if anything was printed);
    display: the repr of the trailing expression; error: compact traceback.
    """
    linecache.cache[CODE_FILENAME] = (len(code), None, code.splitlines(True), CODE_FILENAME)
    namespace = fresh_main_module()
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
        try:  # the code may be any object, its == and str() the model's own (and raising)
            if exc.code is None or (type(exc.code) in (int, bool) and exc.code == 0):
                return OK
            text = f"SystemExit: {exc.code}"
        except BaseException:  # noqa: BLE001
            text = "SystemExit"
        return {"status": "error", "text": middle_truncate(text, max_chars)}
    except BaseException as exc:  # noqa: BLE001 - everything the model raises is a result
        try:
            text = format_exception_compact(exc, workdir)
        except BaseException:  # noqa: BLE001 - e.g. MemoryError while formatting
            text = f"{type(exc).__name__}"
        return {"status": "error", "text": middle_truncate(text, max_chars)}


def _text_stream(fd: int, mode: str, **options) -> io.TextIOWrapper:
    """A text stream over ``fd`` as CPython builds ``sys.std*``: a FileIO, a buffer, the text
    layer; newlines never translated."""
    raw = io.FileIO(fd, mode, closefd=False)
    buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding="utf-8", newline="\n", **options)


def install_stdio() -> None:
    """Our own streams over fds 0-2 (also ``sys.__std*__``), made in the zygote (prepare_zygote):
    a sandbox's fds 0-2 are its stdin memfd and its stdout and stderr pipes by the same numbers.
    The zygote and its workers never write to stdout, and stderr is line-buffered, so a fork
    inherits empty buffers.

    A stream asks once, when it is made, whether its fd can seek. The zygote's own fds are
    /dev/null, which can, so streams made over them told model code that a pipe could:
    ``sys.stdout.reconfigure(...)`` or ``io.TextIOWrapper(sys.stdout.buffer)`` then failed with
    "Illegal seek". So stdout and stderr are made while fds 1 and 2 are a pipe (stdin, a memfd
    in the sandbox, can seek like /dev/null). Buffered as CPython's are (``sys.stdin.buffer.
    readline`` reads blocks, not bytes; ``peek``, ``read1`` and ``.raw`` exist)."""
    read_end, write_end = os.pipe()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    try:
        for fd in saved:
            os.dup2(write_end, fd)
        sys.stdin = _text_stream(0, "r", errors="replace")
        # Line-buffered: what the code printed before a timeout or a crash (both end it with
        # SIGKILL, which no buffer survives) is its output so far, as a terminal would have shown.
        sys.stdout = _text_stream(1, "w", errors="backslashreplace", line_buffering=True)
        sys.stderr = _text_stream(2, "w", errors="backslashreplace", line_buffering=True)
        for stream in (sys.stdin, sys.stdout, sys.stderr):
            stream.buffer.raw.seekable()  # asked now, while the fds are what a sandbox's are
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(read_end)
        os.close(write_end)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
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


def child_main(limits: SandboxLimits, confinement: Confinement, fds: dict) -> None:
    """Entry point of a sandbox, in the child of the forker's clone. Never returns.

    It does every step that does not depend on the call, then takes its call and stdin from
    `fds["channel"]` (two memfds; already waiting there for a cold start, sent later to a warm
    sandbox), finishes its confinement and runs the call."""
    status = 70
    try:
        os.setpriority(os.PRIO_PROCESS, 0, limits.nice)  # first: yield to the worker at once
        move_fds({1: fds["stdout"], 2: fds["stderr"], RESULT_FD: fds["result"], CHANNEL_FD: fds["channel"]})
        confine_before_call(confinement, limits)
        received = wire.receive_call(CHANNEL_FD)
        if received is None:  # the worker is going away
            status = 0
            return
        call, stdin_fd = received
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        os.close(CHANNEL_FD)  # the model gets fds 0-3 and nothing else
        confine_for_call(confinement, limits, float(call["timeout"]))
    except BaseException:  # noqa: BLE001 - our failure, not the model's: the worker reports it
        traceback.print_exc(file=sys.stderr)
        os._exit(status)
    try:
        # Before this byte the model has not run; without it the worker knows the sandbox failed
        # to start (an infrastructure error), and the model cannot forge that once it runs.
        os.write(RESULT_FD, READY)
        if call["op"] == "verify":
            payload = run_verify(call)
        else:
            payload = run_code(call["code"], confinement.workdir, limits.max_output_bytes)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001 - a closed/broken stdout is the model's business
            pass
        write_result(payload)
        status = 0
    finally:
        os._exit(status)


def run_verify(call: dict) -> dict:
    """The reward check (math-verify, preloaded by the heavy zygote), under the pool's kill; the
    call's "mode" picks the paper's reward or the official one (official_reward.score)."""
    try:
        return {"status": "verify", "correct": bool(score(call["response"], call["gold"], call.get("mode", "answer")))}
    except BaseException as exc:  # noqa: BLE001
        return {"status": "verify", "correct": False, "error": f"{type(exc).__name__}: {exc}"[:500]}

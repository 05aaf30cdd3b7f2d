"""Sandbox integrity: hostile one-to-three line programs that try to game the reward, break the
pool or leave state behind, run as model code through the public API only.

Each test names the property it protects; together they cover what the sandbox guarantees in
docs/code_env.md ("Threat model"). Every case also checks that the pool is back to its baseline
afterwards: the same workers, no process under a sandbox uid, nothing left on the host.
"""
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from rstarjax.env import CodeExecutor, ExecutorConfig, SandboxLimits, cgroups, format_tool_response, parse_tool_call


def sandbox_processes(ex) -> list[int]:
    """Live processes running under one of the executor's sandbox uids."""
    lo, hi = ex.uid_base, ex.uid_base + ex.num_sandbox_uids
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if lo <= uid < hi:
            pids.append(int(entry))
    return pids


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def worker_pids(ex) -> set[int]:
    return {w.pid for w in ex._workers if w is not None}


def assert_baseline(ex, workers_before: set[int]) -> None:
    """The pool serves the next call with the same workers, and no sandbox process is left."""
    r = ex.run("print(6 * 7)", timeout=10)
    assert (r.kind, r.text) == ("stdout", "42\n"), r
    assert worker_pids(ex) == workers_before
    assert ex.stats.get("worker_deaths", 0) == 0
    assert wait_until(lambda: not sandbox_processes(ex)), sandbox_processes(ex)


def require_root_isolation(ex):
    iso = ex.isolation
    if not (iso.get("uid_drop") and iso.get("pidns") and iso.get("mountns") and iso.get("netns")):
        pytest.skip(f"the full sandbox needs root with namespaces ({iso}); see docs/code_env.md")


@pytest.fixture(scope="module")
def ex():
    cfg = ExecutorConfig(num_workers=1, lean_workers=1, slots_per_worker=2, limits=SandboxLimits(max_output_bytes=8192))
    with CodeExecutor(config=cfg) as executor:
        yield executor


# ---------------------------------------------------------------- reward channel: other calls' data


# Reads every writable mapping of its own process and prints what follows each "rstarjax-" it
# finds: what an attacker does to find the gold answer or another call's code in its memory.
MEMORY_SCANNER = r"""
import ctypes, re
prefix = b"rstarjax" + b"-"
found = set()
for line in open("/proc/self/maps").read().splitlines():
    fields = line.split()
    if fields[1] != "rw-p":
        continue
    lo, hi = (int(x, 16) for x in fields[0].split("-"))
    data = ctypes.string_at(lo, hi - lo)
    for m in re.finditer(re.escape(prefix) + rb"[a-z]+-[0-9a-f]{32}", data):
        found.add(m.group().decode())
print(sorted(found))
"""


def test_model_code_cannot_read_gold_answers_or_other_calls_from_memory():
    """Sandboxes fork from an image that never held call data: neither the gold answer of a
    verification running on the same worker nor the code, stdin and output of other calls,
    finished or running, are anywhere in the sandbox's memory."""
    secrets = {what: f"rstarjax-{what}-{uuid.uuid4().hex}" for what in ("gold", "code", "stdin", "output", "own")}
    with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=2) as ex:
        assert ex.run(f"print({secrets['output']!r})").text == secrets["output"] + "\n"
        sibling = ex.submit(f"# {secrets['code']}\nimport time\ntime.sleep(1)", stdin=secrets["stdin"], timeout=20)
        # sympy never finishes this comparison: the verification runs until its timeout (4 s, under
        # math-verify's own 5 s limit, so the pool's kill ends it), and its gold answer is live in
        # the worker while the scanner starts (the "%" part is a comment)
        slow_verify = ex.submit_verify(r"<answer>\boxed{9^{9^{9^{9}}}}</answer>", rf"\frac{{1}}{{3}} % {secrets['gold']}",
                                       timeout=4)
        time.sleep(0.5)  # both slots busy: the scanner is forked when the sibling ends
        r = ex.run(f"import sys\nown = sys.stdin.read()\n{MEMORY_SCANNER}", stdin=secrets["own"], timeout=30)
        assert sibling.result(timeout=30).kind == "display"
        assert slow_verify.result(timeout=30).timed_out
    assert r.kind == "stdout", r
    assert secrets["own"] in r.text  # the scan works: it finds the call's own stdin
    leaked = [what for what in ("gold", "code", "stdin", "output") if secrets[what] in r.text]
    assert not leaked, f"model code read {leaked} of other calls: {r.text[:500]}"


# ---------------------------------------------------------------- one call must not break the pool


def test_a_deep_directory_tree_in_the_work_dir_and_dev_shm_does_not_kill_the_worker(ex):
    workers = worker_pids(ex)
    code = (
        "import os\n"
        "for base in ('.', '/dev/shm'):\n"
        "    os.chdir(base)\n"
        "    for _ in range(1500):\n"
        "        os.mkdir('d')\n"
        "        os.chdir('d')\n"
        "    open('leaf', 'w').write('x')\n"
        "print('deep')"
    )
    assert ex.run(code, timeout=20).text == "deep\n"
    for _ in range(4):  # every slot of both tiers serves again
        assert_baseline(ex, workers)


def test_deeply_nested_json_on_the_result_fd_does_not_kill_the_worker(ex):
    workers = worker_pids(ex)
    r = ex.run("import os\nos.write(3, b'[' * 200000)\nprint('x')", timeout=10)
    assert not r.infra_error, r
    assert_baseline(ex, workers)


def test_slashes_on_stderr_do_not_stall_the_worker():
    """64 KB of "/" (the default stderr cap) made the path scrubber quadratic: ~20 s in a
    real-time worker, until the watchdog killed it."""
    with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=1) as ex:
        workers = worker_pids(ex)
        t0 = time.monotonic()
        r = ex.run("import sys\nsys.stderr.write('/' * 64000)\nsys.exit(3)", timeout=5)
        assert r.kind == "error" and not r.infra_error, r
        assert time.monotonic() - t0 < 3.0
        assert_baseline(ex, workers)


# ---------------------------------------------------------------- nothing outlives the pool


SLEEPER = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(120)\ntime.sleep(120)"


def test_sandboxes_die_with_their_worker():
    with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=2) as ex:
        if not ex.isolation.get("uid_drop"):
            pytest.skip("sandbox processes are only identifiable by uid when the uid is dropped")
        futs = [ex.submit(SLEEPER, timeout=60) for _ in range(2)]
        assert wait_until(lambda: len(sandbox_processes(ex)) >= 4, 10)
        os.kill(ex._workers[0].pid, signal.SIGKILL)
        assert all(f.result(timeout=20).infra_error for f in futs)
        assert wait_until(lambda: not sandbox_processes(ex)), "sandboxes outlived their worker"
        assert ex.run("print(1)").text == "1\n"


def test_close_leaves_no_sandbox_process_alive():
    ex = CodeExecutor(num_workers=1, lean_workers=1, slots_per_worker=2).start()
    if not ex.isolation.get("uid_drop"):
        ex.close()
        pytest.skip("sandbox processes are only identifiable by uid when the uid is dropped")
    futs = [ex.submit(SLEEPER, timeout=60) for _ in range(2)] + [ex.submit("import sympy\n" + SLEEPER, timeout=60)]  # heavy tier
    assert wait_until(lambda: len(sandbox_processes(ex)) >= 6, 10)
    ex.close(drain_timeout=0.1)
    assert all(f.result(timeout=5).infra_error for f in futs)
    assert not sandbox_processes(ex), "sandbox processes outlived close()"


# ---------------------------------------------------------------- host state does not outlive the call

LIBC_IPC = (
    "import ctypes, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.shmat.restype = ctypes.c_void_p\n"
)


def host_sysv_keys(kind: str) -> set[int]:
    with open(f"/proc/sysvipc/{kind}") as f:
        return {int(line.split()[0]) for line in list(f)[1:]}


def test_sysv_shared_memory_and_message_queues_do_not_outlive_the_call():
    key = int(uuid.uuid4().hex[:7], 16)
    make = LIBC_IPC + (
        f"shm = libc.shmget({key}, 16 << 20, 0o1666)\n"  # IPC_CREAT | 0666
        "if shm >= 0:\n"
        "    ctypes.memmove(libc.shmat(shm, None, 0), b'rstarjax-left-behind', 20)\n"
        f"msq = libc.msgget({key}, 0o1666)\n"
        "print(shm >= 0, msq >= 0)"
    )
    find = LIBC_IPC + (
        f"shm = libc.shmget({key}, 0, 0)\n"
        "data = ctypes.string_at(libc.shmat(shm, None, 0), 20) if shm >= 0 else b''\n"
        f"print(shm, libc.msgget({key}, 0), data)"
    )
    shm_before, msg_before = host_sysv_keys("shm"), host_sysv_keys("msg")
    with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=2) as ex:
        require_root_isolation(ex)
        made = ex.run(make)
        assert made.kind == "stdout", made
        seen_by_next_call = [ex.run(find).text for _ in range(2)]
    with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=2) as ex:
        seen_by_next_executor = ex.run(find).text
    for text in seen_by_next_call + [seen_by_next_executor]:
        assert "rstarjax-left-behind" not in text and text.startswith("-1 -1 "), text
    assert key not in host_sysv_keys("shm") - shm_before and key not in host_sysv_keys("msg") - msg_before


def world_writable_dirs() -> list[str]:
    """World-writable directories of the host near the top of the tree (where services keep
    locks, sockets and crash dumps)."""
    found = []
    for top in ("/run", "/var", "/dev", "/tmp", "/opt", "/srv", "/mnt", "/home", "/media"):
        for root, dirs, _ in os.walk(top):
            if root.count("/") >= 3:
                dirs[:] = []
            try:
                if os.stat(root).st_mode & 0o002:
                    found.append(root)
            except OSError:
                pass
    return found


def test_no_file_is_left_in_world_writable_host_directories(ex):
    require_root_isolation(ex)
    marker = "rstarjax_left_" + uuid.uuid4().hex
    targets = sorted(set(world_writable_dirs()) | {"/run/lock", "/var/tmp", "/dev/shm", "/tmp"})
    code = (
        "import os\n"
        "done = []\n"
        f"for d in {targets!r}:\n"
        "    try:\n"
        f"        open(os.path.join(d, {marker!r}), 'w').write('x' * 1000)\n"
        "        done.append(d)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(done)"
    )
    workers = worker_pids(ex)
    ex.run(code)
    left = [d for d in targets if os.path.exists(os.path.join(d, marker))]
    for d in left:
        os.unlink(os.path.join(d, marker))
    assert not left, f"the sandbox left files in host directories {left}"
    assert_baseline(ex, workers)


KEY_SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl


def test_the_kernel_keyring_does_not_carry_data_between_calls():
    if platform.machine() not in KEY_SYSCALLS:
        pytest.skip("keyring syscall numbers known for x86_64 and aarch64 only")
    add_key, keyctl = KEY_SYSCALLS[platform.machine()]
    secret = "rstarjax-key-" + uuid.uuid4().hex
    store = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"print(libc.syscall({add_key}, b'user', b'rstarjax', {secret!r}.encode(), {len(secret)}, -4))"  # @u
    )
    # KEYCTL_SEARCH (10) in the user keyring, then KEYCTL_READ (11)
    load = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"key = libc.syscall({keyctl}, 10, -4, b'user', b'rstarjax', 0)\n"
        "buf = ctypes.create_string_buffer(200)\n"
        f"n = libc.syscall({keyctl}, 11, key, buf, 200) if key > 0 else -1\n"
        "print(key, buf.raw[:max(n, 0)])"
    )
    with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=1) as ex:
        require_root_isolation(ex)
        ex.run(store)
        r = ex.run(load)
    assert secret not in r.text, r.text


# ---------------------------------------------------------------- budgets for a call as a whole


def test_a_calls_processes_together_stay_within_its_memory_budget(ex):
    """Six children each touching 400 MB: per-process limits alone allow 2.4 GB for one call."""
    require_root_isolation(ex)
    if ex.isolation.get("call_budget", "unknown") == "rlimits":
        pytest.skip("no cgroup here: a call's processes are limited one by one (docs/code_env.md)")
    code = (
        "import os, time\n"
        "pids = []\n"
        "for _ in range(6):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = bytearray(400 << 20)\n"
        "        for i in range(0, len(block), 4096):\n"
        "            block[i] = 1\n"
        "        time.sleep(2)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print(sum(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 0 for p in pids))"
    )
    workers = worker_pids(ex)
    r = ex.run(code, timeout=30)
    assert r.kind == "stdout", r
    assert int(r.text) * 400 <= 1024, f"{r.text.strip()} children held 400 MB each at once"
    assert_baseline(ex, workers)


def test_one_call_filling_its_disk_does_not_starve_a_concurrent_call(ex):
    require_root_isolation(ex)
    fill = (
        "import os, time\n"
        "for d in ('.', '/dev/shm'):\n"
        "    for i in range(1000):\n"
        "        try:\n"
        "            with open(os.path.join(d, f'fill{i}'), 'wb') as f:\n"
        "                f.write(b'x' * (32 << 20))\n"
        "        except OSError:\n"
        "            break\n"
        "time.sleep(3)"
    )
    other = (
        "import os\n"
        "for d in ('.', '/dev/shm'):\n"
        "    with open(os.path.join(d, 'mine'), 'wb') as f:\n"
        "        f.write(b'y' * (8 << 20))\n"
        "print('wrote')"
    )
    workers = worker_pids(ex)
    filler = ex.submit(fill, timeout=30)
    time.sleep(2.0)
    r = ex.run(other, timeout=10)
    filler.result(timeout=40)
    assert (r.kind, r.text) == ("stdout", "wrote\n"), r
    assert_baseline(ex, workers)


def test_sandboxes_are_the_kernels_first_choice_when_memory_runs_out(ex):
    r = ex.run("print(open('/proc/self/oom_score_adj').read().strip())\n"
               "try:\n    open('/proc/self/oom_score_adj', 'w').write('0')\nexcept OSError as e:\n    print(type(e).__name__)")
    score, *lowered = r.text.split()
    assert score == "1000", r.text
    if ex.isolation.get("uid_drop"):
        assert lowered == ["PermissionError"], r.text  # and it cannot lower it back


def test_a_calls_processes_together_stay_within_its_cpu_time_budget():
    """Four processes spinning: each is far below its own RLIMIT_CPU, together they exceed the
    call's budget (call_cpus x timeout CPU-seconds) and the call is stopped before its wall clock."""
    cfg = ExecutorConfig(num_workers=1, lean_workers=0, slots_per_worker=1, limits=SandboxLimits(call_cpus=0.1))
    with CodeExecutor(config=cfg) as ex:
        require_root_isolation(ex)
        if ex.isolation["call_budget"] == "rlimits":
            pytest.skip("no cgroup here: CPU time is limited per process (docs/code_env.md)")
        code = "import os\nfor _ in range(3):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass"
        t0 = time.monotonic()
        r = ex.run(code, timeout=8)  # budget: 0.8 CPU-seconds
        elapsed = time.monotonic() - t0
        assert r.kind == "timeout" and "CPU time" in r.text and elapsed < 6, (r, elapsed)
        assert_baseline(ex, worker_pids(ex))


# ---------------------------------------------------------------- defence in depth


def test_no_new_privileges_and_a_syscall_filter(ex):
    r = ex.run("print([l.split()[1] for l in open('/proc/self/status') if l.startswith(('NoNewPrivs', 'Seccomp:'))])")
    assert r.text.strip() == "['1', '2']" or not ex.isolation.get("seccomp", True), r.text


def test_no_new_namespaces_from_model_code(ex):
    require_root_isolation(ex)
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "out = []\n"
        "for flag in (0x10000000, 0x10000000 | 0x40000000, 0x00020000):  # NEWUSER, NEWUSER|NEWNET, NEWNS\n"
        "    out.append('unshared' if libc.unshare(flag) == 0 else ctypes.get_errno())\n"
        "print(out)"
    )
    r = ex.run(code)
    assert "unshared" not in r.text, r.text


def test_unix_sockets_of_host_services_are_unreachable(ex):
    require_root_isolation(ex)
    directory = tempfile.mkdtemp(prefix="rstarjax-service-", dir="/run")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "service.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)  # a host service open to every local user (dbus, docker groups ...)
    server.listen(1)
    server.settimeout(3)
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    code = (
        "import socket\n"
        "try:\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        f"    s.connect({path!r})\n"
        "    s.sendall(b'hi')\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('blocked', type(e).__name__)"
    )
    try:
        r = ex.run(code)
    finally:
        t.join(timeout=30)
        server.close()
        os.unlink(path)
        os.rmdir(directory)
    assert r.text.startswith("blocked") and not accepted, r.text


def test_concurrent_sandboxes_cannot_talk_over_abstract_unix_sockets(ex):
    require_root_isolation(ex)
    name = "rstarjax-" + uuid.uuid4().hex
    listen = (
        "import socket\n"
        "try:\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        f"    s.bind('\\0{name}')\n"
        "    s.listen(1)\n"
        "    s.settimeout(3)\n"
        "    print('got', s.accept()[0].recv(10))\n"
        "except OSError as e:\n"
        "    print('no', type(e).__name__)"
    )
    connect = (
        "import socket, time\n"
        "out = 'no'\n"
        "for _ in range(20):\n"
        "    try:\n"
        "        s = socket.socket(socket.AF_UNIX)\n"
        f"        s.connect('\\0{name}')\n"
        "        s.sendall(b'hello')\n"
        "        out = 'sent'\n"
        "        break\n"
        "    except OSError as e:\n"
        "        out = 'no ' + type(e).__name__\n"
        "        time.sleep(0.1)\n"
        "print(out)"
    )
    listener = ex.submit(listen, timeout=10)
    time.sleep(0.3)
    sender = ex.run(connect, timeout=10)
    got = listener.result(timeout=20)
    assert not sender.text.startswith("sent") and not got.text.startswith("got"), (sender.text, got.text)


def test_host_processes_are_invisible(ex):
    require_root_isolation(ex)
    code = (
        "import os\n"
        "pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]\n"
        f"print(len(pids), os.path.exists('/proc/{os.getpid()}'), any(b'pytest' in open(f'/proc/{{p}}/cmdline', 'rb').read()"
        " for p in pids if os.access(f'/proc/{p}/cmdline', os.R_OK)))"
    )
    r = ex.run(code)
    count, trainer_visible, cmdline_visible = r.text.split()
    assert trainer_visible == "False" and cmdline_visible == "False" and int(count) <= 4, r.text


# ---------------------------------------------------------------- the tool layer never raises


def test_parse_tool_call_never_raises_on_deep_nesting():
    deep = "[" * 5000
    for text in (
        '<tool_call>{"name": "execute_python_code_with_standard_io", "arguments": "%s"}</tool_call>' % deep,
        '<tool_call>{"name": %s, "arguments": {"code": "1"}}</tool_call>' % ("[" * 900 + "]" * 900),
        '<tool_call>{"name": "execute_python_code_with_standard_io", "arguments": {"code": "1", "input": %s}}'
        "</tool_call>" % ("[" * 900 + "]" * 900),
    ):
        out = parse_tool_call(text)
        assert type(out).__name__ == "ToolCallError", out


def test_lone_surrogates_in_results_are_encodable(ex):
    for code in ("raise ValueError('\\ud800')", "print('a\\udcff b')", "'\\ud800'", "import sys\nsys.exit('\\udc80')"):
        r = ex.run(code)
        r.text.encode("utf-8")  # what the rollout does with it
        format_tool_response(r).encode("utf-8")


# ---------------------------------------------------------------- sizes and arguments


def test_run_batch_rejects_malformed_items_by_name(ex):
    for bad in ([("print(1)", "", "extra")], [123], [("print(1)", 5)], [None]):
        with pytest.raises(TypeError, match=r"calls\[0\]"):
            ex.run_batch(bad)
    assert [r.text for r in ex.run_batch(["print(1)", ("print(input())", "2"), ["print(3)", None]])] == ["1\n", "2\n", "3\n"]


def test_large_pools_get_an_automatic_uid_range():
    """More sandboxes than the old fixed 128-uid range, uid_base left automatic."""
    with CodeExecutor(num_workers=2, lean_workers=2, slots_per_worker=33) as big, \
            CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=2) as small:
        assert big.num_sandbox_uids == 132
        ranges = sorted([(big.uid_base, big.uid_base + big.num_sandbox_uids),
                         (small.uid_base, small.uid_base + small.num_sandbox_uids)])
        assert ranges[0][1] <= ranges[1][0] and ranges[1][1] < 2**32 - 1
        r = big.run("import os\nprint(os.getuid())")
        assert r.kind == "stdout" and (not big.isolation.get("uid_drop") or big.uid_base <= int(r.text) < ranges[1][1])


def test_a_sandbox_that_cannot_start_is_an_infra_error_not_the_models():
    """Our failures are never blamed on the model: a sandbox that fails before the model's code
    runs (here: limits the kernel refuses) answers with infra_error=True."""
    cases = [SandboxLimits(disk_bytes=-5), SandboxLimits(max_processes=0)]
    for limits in cases:
        with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=1, limits=limits) as ex:
            iso = ex.isolation
            if (limits.disk_bytes < 0 and not iso["call_mounts"]) or (limits.max_processes == 0 and iso["call_budget"] == "rlimits"):
                continue  # the host never applies this limit, so it cannot fail
            r = ex.run("print(1)")
            assert r.kind == "error" and r.infra_error and r.text.startswith("SandboxError"), r


def test_a_sandbox_killed_from_outside_is_an_infra_error_not_the_models(ex):
    """A running call SIGKILLed from outside (an operator, the host's OOM killer) failed for the
    environment's reasons: an infra error (retried, never shown to the model), not "Process killed
    by SIGKILL". Model code cannot send that kill itself: its PID 1 ignores signals from inside."""
    require_root_isolation(ex)
    workers = worker_pids(ex)
    call = ex.submit("import time\nprint('working', flush=True)\ntime.sleep(60)", timeout=60)
    assert wait_until(lambda: sandbox_processes(ex), timeout=10)
    time.sleep(0.5)  # well past the uid drop: the model's code runs
    for pid in sandbox_processes(ex):
        os.kill(pid, signal.SIGKILL)
    r = call.result(timeout=10)
    assert (r.kind, r.infra_error) == ("error", True) and "killed from outside" in r.text, r
    assert_baseline(ex, workers)


# A trainer whose own memory cgroup (a container's, a job's) has a limit below the call's budget.
# The call uses far less than its budget, but more than the cgroup above it has left.
TRAINER_IN_A_SMALL_CGROUP = r"""
import json, sys
with open(sys.argv[1] + "/cgroup.procs", "w") as f:
    f.write("0")  # all this process starts from here on is charged to the small cgroup
from rstarjax.env import CodeExecutor, SandboxLimits
with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=1, limits=SandboxLimits(memory_bytes=4 << 30)) as ex:
    r = ex.run("b = bytearray(800 << 20)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\nprint('allocated')", timeout=30)
    print(json.dumps({"kind": r.kind, "infra_error": r.infra_error, "text": r.text, "isolation": ex.isolation}))
"""


def remove_cgroup(directory: str) -> None:
    for path, _, _ in sorted(os.walk(directory), key=lambda entry: -entry[0].count("/")):  # children first
        cgroups.kill_members(path)
        for _ in range(100):
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


def test_an_oom_kill_for_a_limit_above_the_call_is_an_infra_error_not_the_models():
    """The kernel kills a sandbox first (oom_score_adj 1000) when the trainer's own cgroup runs
    out, and cgroup v1 counts that kill on the sandbox's cgroup: still not the program's fault
    when the call stayed within its own budget (here 1 GiB, of which it touched < 512 MiB)."""
    parents = cgroups._v1_parents() if cgroups._v2_parent() is None else None
    if parents is None:
        pytest.skip("needs a writable cgroup v1 memory hierarchy (a v2 host would put the trainer in a leaf)")
    small = os.path.join(parents["memory"], f"test-small-parent-{os.getpid()}")
    os.mkdir(small)
    try:
        with open(os.path.join(small, "memory.limit_in_bytes"), "w") as f:
            f.write(str(512 << 20))
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run([sys.executable, "-c", TRAINER_IN_A_SMALL_CGROUP, small], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if not result["isolation"].get("pidns"):
            pytest.skip("without a PID namespace a SIGKILL may be the program's own (docs/code_env.md)")
        assert result["isolation"]["call_budget"] == cgroups.V1, result
        assert (result["kind"], result["infra_error"]) == ("error", True), result
        assert "killed from outside" in result["text"] and "MemoryError" not in result["text"], result
    finally:
        remove_cgroup(small)


def rss_bytes(pids) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
        except (OSError, StopIteration):
            pass
    return total


def test_hostile_calls_leave_the_pool_at_its_baseline(ex):
    """After a round of hostile calls: same workers and forkers, their memory about the same, no
    sandbox process, and nothing left in the host's temporary directories."""
    def pool_pids():
        pids = set(worker_pids(ex))
        for w in list(pids):
            with open(f"/proc/{w}/task/{w}/children") as f:
                pids |= {int(p) for p in f.read().split()}
        return pids

    time.sleep(0.5)
    before_pids, tmp_before = pool_pids(), set(os.listdir(tempfile.gettempdir()))
    before_rss = rss_bytes(before_pids)
    hostile = [
        "import sys\nsys.stdout.write('x' * 50_000_000)",
        "import os\nos.write(3, b'{' * 100000)",
        "import sys\nsys.stderr.write('/' * 60000 + 'site-packages/' * 3000)\nraise SystemExit(2)",
        "print(input()[:10])",
        "import os\nfor i in range(2000):\n    open(f'f{i}', 'w').write('x' * 1000)",
        "x = [bytearray(1 << 20) for _ in range(200)]",
    ]
    for _ in range(3):
        results = ex.run_batch([(code, "s" * (8 << 20)) for code in hostile], timeout=10)
        assert not any(r.infra_error for r in results), results
    assert wait_until(lambda: not sandbox_processes(ex))
    time.sleep(0.5)  # the slots are re-warmed
    after_pids = pool_pids()
    assert worker_pids(ex) <= after_pids and len(after_pids) == len(before_pids)
    assert rss_bytes(after_pids) - before_rss < 64 << 20, (before_rss, rss_bytes(after_pids))
    assert set(os.listdir(tempfile.gettempdir())) <= tmp_before

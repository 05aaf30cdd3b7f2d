"""The sandbox's file system is default-deny (issue 47): gold answers planted wherever users keep
data (/opt, /srv, /mnt, a folder below /tmp beside the checkout, the checkout itself, $HOME)
can be neither read nor listed by model code, whatever path trick it tries; the checkout shows
only the files the workers import. Also run without root, in an unprivileged user namespace,
and the refusal where not even that is available.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid

import pytest

from rstarjax.env import CodeExecutor, ExecutorConfig
from rstarjax.env import isolation

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLD = "rstarjax-gold-" + uuid.uuid4().hex  # the planted answers' text; also in their names


def plant(directories: list[str]) -> list[str]:
    """A gold file (world-readable, as datasets are) in each directory; returns their paths."""
    paths = []
    for directory in directories:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        path = os.path.join(directory, f"{GOLD}.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"answer": GOLD}) + "\n")
        os.chmod(path, 0o644)
        paths.append(path)
    return paths


def hostile_code(paths: list[str]) -> str:
    """Every way we know to reach a host file: by name, stat, listing its directory and the
    usual roots, through /proc (/proc/1/root, the parent's root, /proc/self/cwd), a symlink from
    the working directory, and a walk of the whole tree (minus /proc, /sys, /usr and the
    interpreter's prefix: the read-only system files the sandbox exposes on purpose, ~10^5 entries
    with the test extras installed, whose walk outlasted the call's limit on a loaded 2-core CI)."""
    return textwrap.dedent(f"""
        import os
        paths = {paths!r}
        seen = []
        def attempt(what, fn):
            try:
                seen.append((what, repr(fn())))
            except BaseException as e:
                seen.append((what, type(e).__name__))
        for i, p in enumerate(paths):  # labelled by number: the output names no planted path
            attempt(f'open {{i}}', lambda: open(p).read())
            attempt(f'stat {{i}}', lambda: os.stat(p).st_size)
            attempt(f'list dir {{i}}', lambda: os.listdir(os.path.dirname(p)))
            for via in ('/proc/1/root', f'/proc/{{os.getppid()}}/root', '/proc/self/root', '/proc/self/cwd/../../..'):
                attempt(f'open {{i}} via {{via}}', lambda: open(via + p).read())
            link = f'link-{{i}}'
            attempt(f'symlink {{i}}', lambda: (os.symlink(p, link), open(link).read()))
        for d in ('/', '/opt', '/srv', '/mnt', '/tmp', '/root', '/home', '/data', '/shared', '/mnt/shared',
                  os.path.expanduser('~'), '/proc/1/root', '/proc/1/root/tmp', '/proc/1/cwd'):
            attempt('list ' + d, lambda: os.listdir(d))
        import sys
        names, skipped = [], {{'/proc', '/sys', '/usr', sys.prefix, sys.base_prefix}}
        for top, dirs, files in os.walk('/'):
            dirs[:] = [d for d in dirs if os.path.join(top, d) not in skipped]
            names.extend(os.path.join(top, n) for n in dirs + files)
        seen.append(('walk', repr([n for n in names if 'gold' in n])))
        print(seen)
    """)


@pytest.fixture
def planted():
    tag = "rj-gold-" + uuid.uuid4().hex[:8]
    beside = tempfile.mkdtemp(prefix=tag, dir="/tmp")  # a folder below /tmp, beside a checkout
    os.chmod(beside, 0o755)
    directories = [f"/opt/{tag}", f"/srv/{tag}", f"/mnt/{tag}/shared", beside, os.path.join(CHECKOUT, tag),
                   os.path.join(os.path.expanduser("~"), tag)]
    try:
        yield plant(directories)
    finally:
        for d in directories:
            shutil.rmtree(d if d != f"/mnt/{tag}/shared" else f"/mnt/{tag}", ignore_errors=True)


def require_fresh_root(ex):
    if not ex.isolation.get("fresh_root"):
        pytest.skip(f"no fresh root here: {ex.isolation.get('fresh_root_refused', ex.isolation)}")


def test_planted_gold_files_are_neither_readable_nor_listed(planted):
    with CodeExecutor(config=ExecutorConfig(num_workers=1, lean_workers=1, slots_per_worker=1)) as ex:
        require_fresh_root(ex)
        for code in (hostile_code(planted), "import numpy\n" + hostile_code(planted)):  # both tiers
            r = ex.run(code, timeout=120)
            assert r.kind == "stdout", r.text
            assert GOLD not in r.text, r.text  # neither contents nor a listed name
            # and the trainer still reads them: the files are there, the sandbox cannot see them
            assert all(open(p).read().count(GOLD) == 1 for p in planted)


def test_the_checkout_shows_only_the_files_the_workers_import():
    with CodeExecutor(config=ExecutorConfig(num_workers=1, lean_workers=0, slots_per_worker=1)) as ex:
        require_fresh_root(ex)
        code = f"import os\nprint(sorted(os.path.join(t, f) for t, _, fs in os.walk({CHECKOUT!r}) for f in fs))"
        r = ex.run(code)
    visible = eval(r.text)  # noqa: S307 - our own sandbox's repr of a list of str
    assert visible, r.text
    package = os.path.join(CHECKOUT, "rstarjax") + "/"
    for path in visible:
        assert path.startswith(package) and path.endswith(".py"), path
    assert os.path.join(package, "env", "worker.py") in visible  # what a worker runs
    assert not any(p.endswith(("main.py", "__init__.py")) for p in visible), visible  # nothing else


def test_a_checkout_below_tmp_hides_its_siblings_and_its_own_data():
    """The editable-checkout layout the old view got wrong: everything in the checkout's
    top-level /tmp folder was bound back, data and siblings included."""
    top = tempfile.mkdtemp(prefix="rj-gold-checkout-", dir="/tmp")
    try:
        os.chmod(top, 0o755)
        checkout = os.path.join(top, "src", "rstarjax-checkout")
        shutil.copytree(os.path.join(CHECKOUT, "rstarjax"), os.path.join(checkout, "rstarjax"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        paths = plant([os.path.join(top, "data"), os.path.join(top, "src"), os.path.join(checkout, "data"),
                       os.path.join(checkout, "checkpoints")])
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {checkout!r})
            from rstarjax.env import CodeExecutor
            assert CodeExecutor.__module__ and sys.modules['rstarjax'].__file__.startswith({checkout!r})
            with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=1) as ex:
                print(ex.isolation.get('fresh_root'))
                print(ex.run({hostile_code(paths)!r}, timeout=120).text)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                             cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert out.returncode == 0, out.stderr[-3000:]
        fresh, text = out.stdout.split("\n", 1)
        if fresh != "True":
            pytest.skip("no fresh root here")
        assert GOLD not in text, text
    finally:
        shutil.rmtree(top, ignore_errors=True)


UNPRIVILEGED = 65534  # nobody


def as_unprivileged(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """argv as an ordinary user (setpriv), in a mount namespace of its own where our interpreter,
    if it lives in root's closed home (pyenv), is readable: the rest of that home is covered."""
    drop = f"exec setpriv --reuid={UNPRIVILEGED} --regid={UNPRIVILEGED} --clear-groups " + " ".join(argv)
    home = os.path.expanduser("~")
    if sys.executable.startswith(home + "/.pyenv/"):
        drop = (f"set -e; mount --make-rprivate /; hold=$(mktemp -d); mount --bind {home}/.pyenv $hold; "
                f"mount -t tmpfs -o mode=755,size=1m tmpfs {home}; mkdir {home}/.pyenv; "
                f"mount --bind $hold {home}/.pyenv; " + drop)
    return subprocess.run(["unshare", "--mount", "sh", "-c", drop], capture_output=True, text=True, timeout=timeout,
                          cwd="/", env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/"})


@pytest.fixture
def readable_copy():
    """The package and a Python the unprivileged user can read (ours lives under a 0700 home)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.skip("needs root, setpriv and unshare to start an unprivileged user")
    probe = as_unprivileged(sys.executable, "-c", "'import sympy'", timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"the unprivileged user cannot run this interpreter here: {probe.stderr[-500:]}")
    top = tempfile.mkdtemp(prefix="rj-unpriv-", dir="/tmp")
    os.chmod(top, 0o755)
    shutil.copytree(os.path.join(CHECKOUT, "rstarjax"), os.path.join(top, "rstarjax"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for base, dirs, files in os.walk(top):
        for name in dirs:
            os.chmod(os.path.join(base, name), 0o755)
        for name in files:
            os.chmod(os.path.join(base, name), 0o644)
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_without_root_an_unprivileged_user_namespace_gives_the_same_default_deny_root(readable_copy, planted):
    """The trainer as an ordinary user (nobody): the zygote makes its own user namespace, as
    bubblewrap does; model code still sees none of the planted files, which that user itself can
    read, and holds no capability."""
    for path in planted:  # the unprivileged trainer can read what was planted where it may
        for parent in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
            if parent.startswith(("/opt/", "/srv/", "/mnt/", "/tmp/")) and os.path.isdir(parent):
                os.chmod(parent, 0o755)
    readable = [p for p in planted if not p.startswith((os.path.expanduser("~"), CHECKOUT))]
    script = os.path.join(readable_copy, "run.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {readable_copy!r})
            from rstarjax.env import CodeExecutor
            from rstarjax.env.isolation import confinement_gap
            assert all(open(p).read() for p in {readable!r})  # the trainer itself can read them
            with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=2) as ex:
                iso = ex.isolation
                print({{k: iso.get(k) for k in ('root', 'userns', 'fresh_root', 'pidns', 'call_mounts', 'seccomp',
                                                 'own_tmp')}})
                print(confinement_gap(iso))
                caps = "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')])"
                print(ex.run(caps).text.strip())
                print(ex.run("open('/tmp/x', 'w').write('y'); print(open('/tmp/x').read())").text.strip()[-80:])
                print(ex.run({hostile_code(planted)!r}, timeout=120).text)
        """))
    os.chmod(script, 0o644)
    out = as_unprivileged(sys.executable, script)
    assert out.returncode == 0, out.stderr[-3000:]
    iso, gap, caps, tmp, text = out.stdout.split("\n", 4)
    iso = eval(iso)  # noqa: S307 - our own repr
    if not iso["userns"]:
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {iso}")
    assert iso["fresh_root"] and not iso["root"] and gap == "None", (iso, gap)
    inheritable, permitted, effective, _, ambient = eval(caps)  # noqa: S307 (the bounding set is any user's)
    assert {inheritable, permitted, effective, ambient} == {"0000000000000000"}, caps
    assert (tmp == "y") == bool(iso["own_tmp"]), (iso, tmp)  # its own /tmp where the probe found one
    assert "open 0'" in text and GOLD not in text, text


class _UnconfinedPool:
    """A started code pool as a host without root or user namespaces reports it."""

    isolation = {"isolate": True, "root": False, "userns": False, "mountns": False, "fresh_root": False}
    closed = False

    def __init__(self, **kwargs):
        pass

    def start(self):
        return self

    def close(self):
        _UnconfinedPool.closed = True


def test_rl_refuses_an_unconfined_sandbox_unless_the_user_allows_it(monkeypatch):
    from rstarjax.recipes import build, config
    from rstarjax.validation import ConfigError

    monkeypatch.setattr(build, "CodeExecutor", _UnconfinedPool)
    with pytest.raises(ConfigError) as err:
        build.executor(1)
    message = str(err.value)
    assert "\n" not in message and "--config." + isolation.UNCONFINED_SETTING in message and "neither root" in message, message
    assert _UnconfinedPool.closed  # its processes do not outlive the refusal
    assert isinstance(build.executor(1, allow_unconfined=True), _UnconfinedPool)
    # the flag is a config key of every run: --config.env.allow_unconfined
    from configs import base
    assert base.get_config().env.allow_unconfined is False
    errors = []
    assert config._parse_section("env", {"allow_unconfined": True}, errors).allow_unconfined is True and not errors
    assert config.RunConfig().env.allow_unconfined is False


def test_a_confined_pool_passes_the_check(tmp_path):
    with CodeExecutor(config=ExecutorConfig(num_workers=1, lean_workers=0, slots_per_worker=1)) as ex:
        require_fresh_root(ex)
        assert isolation.confinement_gap(ex.isolation) is None
        isolation.require_confined(ex.isolation, allow_unconfined=False)


def test_what_a_calls_own_tmp_binds_back():
    """``isolation.call_tmp_binds``: the top-level /tmp entries of what the fresh root exposes
    below /tmp (a virtualenv, a checkout's imported files), once each; None wherever a call must
    keep the zygote's /tmp (covering it would hide the interpreter or the working directory)."""
    info = {"fresh_root": True, "call_mounts": True,
            "exposed": ["/usr", "/tmp/tmp.ab/venv", "/tmp/tmp.ab/venv/lib/python3.11/site-packages",
                        "/tmp/ci/rstarjax/env/worker.py", "/tmp/ci/rstarjax/protocol.py", "/etc/localtime"]}
    work = "/tmp/rstarjax-sandbox-x"
    assert isolation.call_tmp_binds(info, work) == ("/tmp/ci", "/tmp/tmp.ab")
    assert isolation.call_tmp_binds({**info, "exposed": ["/usr", "/root/.pyenv/versions/3.11"]}, work) == ()
    for changed in ({"fresh_root": False}, {"call_mounts": False}, {"exposed": ["/usr", "/tmp"]},
                    {"exposed": ["/tmp/rstarjax-sandbox-x/lib"]}):
        assert isolation.call_tmp_binds({**info, **changed}, work) is None, changed
    # a working directory elsewhere (TMPDIR=/scratch, or deeper in /tmp) has its place in the call's /tmp
    assert isolation.call_tmp_binds(info, "/scratch/rstarjax-sandbox-x") == ("/tmp/ci", "/tmp/tmp.ab")
    assert isolation.call_tmp_binds(info, "/tmp/gw0/rstarjax-sandbox-x") == ("/tmp/ci", "/tmp/tmp.ab")
    assert isolation.call_tmp_binds(info, "/tmp/ci/rstarjax-sandbox-x") is None  # in what is bound back
    assert isolation.call_tmp_binds(info, "/scratch/ci") is None  # its place is /tmp/ci


def test_a_refused_own_tmp_probe_says_why():
    """``zygote.probe_own_tmp`` reports the child's error (the zygote then keeps the old /tmp and
    records it as ``own_tmp_refused``). Only a failing case here: a working one would mount in a
    namespace cloned from this test's, whose mounts may propagate to the host."""
    if os.geteuid() != 0:
        pytest.skip("a mount namespace of its own needs root here")
    # in a process of its own, as in the zygote: cloned from this one, with jax's threads, the
    # child could inherit a lock held by one of them
    script = ("from rstarjax.env import forker, zygote\n"
              "print(zygote.probe_own_tmp('/nonexistent-rstarjax-dir/rstarjax-sandbox-x', (), "
              "forker.probe_tid_offset(), timeout_s=20))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=CHECKOUT)
    assert out.returncode == 0, out.stderr[-2000:]
    why = out.stdout.strip()
    assert why.startswith("FileNotFoundError") and "mount tmpfs on /nonexistent-rstarjax-dir" in why, why

"""Test setup: 8 simulated CPU devices so sharding and multi-slice serving are exercised here;
the CI-sized demo run that the demo and notebook tests share."""
import os

# Must happen before jax is imported anywhere in the test process.
# --xla_backend_optimization_level=0: the tests' programs are tiny and most run a few times, so
# optimising the generated CPU code costs more than it saves (tests/test_model.py: 58 -> 39 CPU
# seconds, same results). The same programs and assertions, only less optimised machine code.
# It slows what executes many steps in-process (test_compare_ci_end_to_end alone: 162 s at the
# default level, 288 s at level 0): subprocesses inherit it unless they set their own XLA_FLAGS.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                   "--xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _share_compiled_programs_for_this_run() -> None:
    """Opt-in (``RSTARJAX_TEST_COMPILE_CACHE=1``): jax's persistent compilation cache in one fresh
    directory for the whole test run, so a program compiled once (the tiny model's forward, a
    train step, an engine bucket) is loaded, not compiled again, by later tests, by the other
    pytest-xdist worker and by the subprocesses the end-to-end tests start (``python -m
    rstarjax.main`` inherits the variables, and main's own ``compilation_cache_dir`` yields to
    them: rstarjax/io/compile_cache.py). Every program is kept, however fast it compiled. The
    run that made the directory removes it (xdist workers find it already set); a cache the user
    chose (JAX_COMPILATION_CACHE_DIR set beforehand) is used as it is.

    Off by default: a worker crashed loading a train step from it once (a segfault in jax
    0.10.2's ``deserialize_executable``, late in a run; XLA:CPU crashed the same way compiling
    one with no cache in another run: docs/testing.md), and the few seconds it saves are not
    worth a second way to crash."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import atexit
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="rstarjax-test-xla-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


if os.environ.get("RSTARJAX_TEST_COMPILE_CACHE", "0") == "1":
    _share_compiled_programs_for_this_run()
else:  # no test process, nor anything it starts (main's own default cache too), loads a program
    os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")


def _own_temp_dir_per_xdist_worker() -> None:
    """Each pytest-xdist worker gets its own TMPDIR, inherited by what it starts. Tests that check
    the temporary directory is left as they found it (tests/test_env_integrity.py) then see
    their own worker's files only, not the scratch directory of an executor that a test on the
    other worker started meanwhile (a CI failure of that test). Removed when the worker exits."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    import atexit
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix=f"rstarjax-test-{worker}-")  # short: AF_UNIX paths fit
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path


_own_temp_dir_per_xdist_worker()


import pathlib  # noqa: E402  (after the environment setup above, which must come first)
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"


def host_devices_env() -> dict:
    """The environment of a process that runs as a user's would: the host's real devices, not
    the 8 simulated ones set above, and XLA's default optimisation level (an end-to-end run
    executes thousands of steps: it measured 1.8x faster than at level 0), this checkout first
    on the import path."""
    env = dict(os.environ)
    # What a Colab CPU runtime has: the host's real devices, not the 8 simulated ones set above.
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    # The kernel imports this checkout, and its spec ("python -m ipykernel_launcher") finds this
    # interpreter first.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))
    return env


def _execute_quickstart(workdir: pathlib.Path):
    """notebooks/quickstart.ipynb executed top to bottom, CI-sized: ``SIZE = "ci"`` and ``WORKDIR``
    injected right after its cell tagged 'parameters' (papermill's convention). Raises
    nbclient's CellExecutionError on the first failing cell."""
    import nbclient
    import nbformat

    nb = nbformat.read(str(QUICKSTART), as_version=4)
    i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    params = nbformat.v4.new_code_cell(f"SIZE = 'ci'\nWORKDIR = {str(workdir)!r}",
                                       metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(i + 1, params)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=False,
                                     resources={"metadata": {"path": str(workdir.parent)}})
    client.execute(env=host_devices_env())
    return nb


@pytest.fixture(scope="session")
def demo_ci_run(tmp_path_factory):
    """One CI-sized demo run (the README's main command with ``configs/demo.py:ci``), shared by the
    demo and notebook tests so the suite pays for it once. With the test extra installed it runs
    through notebooks/quickstart.ipynb, whose demo cell starts that command; without nbclient, the
    command itself. Returns (workdir, the executed notebook or None)."""
    workdir = tmp_path_factory.mktemp("demo_ci") / "run"
    try:
        import ipykernel  # noqa: F401
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError:
        r = subprocess.run([sys.executable, "-m", "rstarjax.main", f"--config={ROOT / 'configs' / 'demo.py'}:ci",
                            f"--workdir={workdir}"], env=host_devices_env(), capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-5000:]
        return workdir, None
    return workdir, _execute_quickstart(workdir)


def _xdist_group(item) -> str | None:
    """The pytest-xdist group (``--dist loadgroup``) that keeps ``item`` on the worker already
    paying for its shared, expensive state: the session's demo run, or a module-scoped fixture
    of its file (a model built and compiled once per module). None: any worker may run it."""
    defs = getattr(item, "_fixtureinfo", None)
    if defs is None:
        return None
    scopes = {}  # the suite's own fixtures (pytest's and plugins' shared ones are cheap)
    for name in item.fixturenames:
        for d in defs.name2fixturedefs.get(name, ()):
            if d.baseid.startswith("tests"):
                scopes[name] = d.scope
    if "demo_ci_run" in scopes:
        return "demo_ci_run"
    if any(s in ("module", "package", "session") for s in scopes.values()):
        return item.module.__name__ if getattr(item, "module", None) else None
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (xdist/remote.py)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist: tests sharing an expensive fixture stay on one worker, and the slow
    end-to-end tests that share nothing start first, so the two workers finish together instead
    of one of them starting a 3-minute test at the end. Grouped tests keep their order (xdist
    hands out the groups, largest first, before the single tests)."""
    # The hook matters in the workers, which collect (the controller only schedules their node
    # ids); there ``numprocesses`` is unset and ``workerinput`` tells them apart.
    if not (getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput")):
        return
    first = set()
    for item in items:
        group = _xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
        elif item.get_closest_marker("slow") is not None:
            first.add(item.nodeid)
    items.sort(key=lambda item: item.nodeid not in first)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test file's last test (and its fixtures' teardown), drop jax's compiled programs:
    a worker otherwise keeps thousands of loaded CPU executables for the rest of the run, and
    XLA:CPU crashed loading one more (a train step, segfault/abort) late in three runs of the
    suite, never in the same test alone."""
    result = yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        import gc

        import jax

        jax.clear_caches()
        gc.collect()
    return result


def pytest_configure(config):
    """Under pytest-xdist a crashed worker ends the run (its test named, the others' results
    kept) instead of being replaced: with ``--dist loadgroup``, xdist 3.8 re-queues a crashed
    worker's tests but never hands them out again, and the run waits forever. An explicit
    ``--max-worker-restart`` is left as given."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "maxworkerrestart", "") is None:
        config.option.maxworkerrestart = 0


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """On the controller: under ``--dist loadgroup`` xdist schedules by the ``@group`` suffix its
    workers append to a grouped test's node id. A pytest that drops the suffix (9.2 with xdist
    3.8) would spread the groups over the workers silently: the session's demo run made twice,
    module fixtures built twice. The demo test is always grouped: check it carries its group."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    demo = [i for i in ids if i.split("@")[0] == "tests/test_demo.py::test_demo_ci_end_to_end"]
    if demo and "@" not in demo[0]:
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup lost the test groups ({demo[0]} has no @group suffix): "
            f"pytest {pytest.__version__} ignores the node-id suffix xdist sets; pip install 'pytest<9.2'")

"""Test setup: 8 simulated CPU devices so sharding and multi-slice serving are exercised here;
the CI-sized demo run that the demo and notebook tests share."""
import os

# Must happen before jax is imported anywhere in the test process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pathlib  # noqa: E402  (after the environment setup above, which must come first)
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"


def _notebook_kernel_env() -> dict:
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
    client.execute(env=_notebook_kernel_env())
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
                            f"--workdir={workdir}"], env=_notebook_kernel_env(), capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-5000:]
        return workdir, None
    return workdir, _execute_quickstart(workdir)

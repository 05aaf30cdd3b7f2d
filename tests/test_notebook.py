"""notebooks/quickstart.ipynb runs top to bottom on a CPU kernel, CI-sized (SIZE = "ci", i.e.
configs/demo.py:ci, injected after its parameters cell as papermill does), and shows what it
promises: the accuracy line, the curves as images, held-out trajectories and the transformers check."""
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def _read():
    return nbformat.read(str(NOTEBOOK), as_version=4)


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def test_notebook_is_saved_clean():
    nb = _read()
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "save the notebook without outputs"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and 'SIZE = "full"' in params[0].source  # Colab runs the real demo


def _with_parameters(nb, **params):
    """papermill's convention: a cell assigning the parameters goes right after the one tagged
    'parameters'."""
    i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    src = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    nb.cells.insert(i + 1, nbformat.v4.new_code_cell(src, metadata={"tags": ["injected-parameters"]}))
    return nb


def _kernel_env() -> dict:
    env = dict(os.environ)
    # What a Colab CPU runtime has: the host's real devices, not the 8 simulated ones of conftest.
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    # The kernel imports this checkout, and its spec ("python -m ipykernel_launcher") finds this
    # interpreter first.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))
    return env


@pytest.mark.slow
def test_quickstart_runs_top_to_bottom(tmp_path):
    nb = _with_parameters(_read(), SIZE="ci", WORKDIR=str(tmp_path / "run"))
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=False,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=_kernel_env())  # CellExecutionError on the first failing cell

    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "skipping the install" in text and f"rstarjax from {ROOT}" in text  # this checkout, no pip
    assert "held-out accuracy:" in text and "after 2 GRPO-RoC steps (16 problems" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # at least the reward and SFT-loss curves
    assert text.count("problem: ") == 3 and "RL policy, greedy" in text
    assert (tmp_path / "run" / "hf_export" / "model.safetensors.index.json").exists()
    assert "logits match: max |ours - transformers|" in text and "greedy continuations agree" in text

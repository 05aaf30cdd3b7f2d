"""notebooks/quickstart.ipynb runs top to bottom on a CPU kernel, CI-sized (SIZE = "ci", i.e.
configs/demo.py:ci, injected after its parameters cell as papermill does; the run is the
``demo_ci_run`` fixture of conftest.py, shared with the demo test), and shows what it promises: the accuracy line, the curves as images, held-out trajectories and the transformers check."""
import pathlib

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


@pytest.mark.slow
def test_quickstart_runs_top_to_bottom(demo_ci_run):
    """The notebook ran top to bottom in the shared fixture (conftest.demo_ci_run); here, what it showed."""
    workdir, nb = demo_ci_run
    assert nb is not None, "nbclient is in the test extra"
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "skipping the install" in text and f"rstarjax from {ROOT}" in text  # this checkout, no pip
    assert "held-out accuracy:" in text and "after 2 GRPO-RoC steps (16 problems" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # at least the reward and SFT-loss curves
    assert text.count("problem: ") == 3 and "RL policy, greedy" in text
    assert (workdir / "hf_export" / "model.safetensors.index.json").exists()
    assert "logits match: max |ours - transformers|" in text and "greedy continuations agree" in text
    assert "LoRA RL: held-out accuracy" in text and "after 2 GRPO-RoC steps (full fine-tuning above" in text

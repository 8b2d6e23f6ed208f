"""The notebooks in notebooks/ run top to bottom (their asserts are the checks), and are committed
without outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = [
    "01_explicit_residuals.ipynb",
    "02_saved_tensor_hooks_and_offloading.ipynb",
    "03_torch_func.ipynb",
    "04_expert_mlp.ipynb",
    "05_moe_layer.ipynb",
]


def test_the_notebooks_are_there():
    assert set(EXPECTED) <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    """Execute a copy in a fresh kernel (the repo file stays output-free); the executed copy is
    left in tmp_path for a look when a cell fails."""
    # the kernel must import this checkout's functional_dw even without an editable install
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
    )
    try:
        client.execute()
    finally:
        nbformat.write(nb, tmp_path / path.name)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.execution_count is None, f"cell {i} has an execution count: clear the outputs"
            assert cell.outputs == [], f"cell {i} has outputs: clear them"
    kinds = [c.cell_type for c in nb.cells]
    assert kinds[0] == "markdown" and "What you will learn" in nb.cells[0].source
    assert kinds[-1] == "markdown" and "Summary" in nb.cells[-1].source

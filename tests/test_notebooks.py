"""The notebooks in notebooks/ run top to bottom on CPU, and are committed without outputs.

Each notebook is executed with nbclient in a fresh ``python3`` kernel whose working directory is
the repository root and whose environment forces ``JAX_PLATFORMS=cpu``; any cell error (the
notebooks assert what they demonstrate) fails the test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 1800  # seconds; the longest cell (04's training run) takes ~2 minutes on 2 idle cores


def test_notebooks_present():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_inside_a_dflash_step.ipynb",
                                          "03_kernels_and_roofline.ipynb", "04_train_a_draft.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"cell {index} has outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT, startup_timeout=CELL_TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error

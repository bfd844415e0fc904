"""The README's and the quickstart's code blocks run exactly as written (the bundled models, a
fresh chunk store), and every other page's Python block is one of a known list of fragments.

Each ``python`` block of README.md and docs/quickstart.md runs in its own interpreter, and the
``cacheblend-rag`` command lines of their ``bash`` blocks in a shell, from the repository root, with
``CACHEBLEND_RAG_HOME`` pointing at an empty folder whose ``models`` is the real converted-model
cache: the chunk store starts empty (as on a fresh machine) without converting the GGUF again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cacheblend_rag.model.loading import default_cache_dir

ROOT = Path(__file__).resolve().parents[1]
RUN = (ROOT / "README.md", ROOT / "docs" / "quickstart.md")  # pages whose blocks run as written
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)

# Python blocks of the other pages that do not run on their own, by page and first line, with why:
# a new block must run (on a page of RUN) or be added here with its reason.
FRAGMENTS = {
    ("choosing.md", "engine = CacheBlendEngine.from_pretrained()  # bundled SmolLM2-135M-Instruct"): "model paths to fill in",
    ("choosing.md", "engine.generate(question, chunks, recompute_ratio=0.3)  # per call"): "continues the quickstart's engine",
    (
        "choosing.md",
        "engine = CacheBlendEngine.from_pretrained(config=BlendConfig(guard_margin=0.5))  # every front end of this engine",
    ): ("one argument shown"),
    ("choosing.md", "# blend at 0.15; below margin 0.5 blend again at 0.3; still below 0.2: full prefill"): "one argument shown",
    ("cluster.md", "from ray import serve"): "needs a Redis server at the URL and a Ray cluster",
    ("quality.md", "from cacheblend_rag import BlendConfig, CacheBlendEngine"): "a model path and a corpus to fill in",
    ("server.md", "from openai import OpenAI"): "needs a running cacheblend-rag serve",
    ("server.md", "from langchain_openai import ChatOpenAI"): "needs a running cacheblend-rag serve and your retriever",
    ("sharing.md", "from cacheblend_rag import CacheBlendEngine"): "needs a Redis server at the URL",
    ("sharing.md", "from cacheblend_rag.store.redis_tier import RedisConfig"): "needs a Redis server at the URL",
    ("sources.md", "from cacheblend_rag import CacheBlendEngine"): "your question and chunks",
    ("storage.md", 'engine = CacheBlendEngine.from_pretrained(kv_format="int8")'): "one argument shown",
    ("storage.md", "from cacheblend_rag.store import TieredStore"): "your model, tokenizer and fingerprint",
    ("storage.md", "from cacheblend_rag.control import LoadingController"): "continues an engine",
    ("throughput.md", "from cacheblend_rag import CacheBlendEngine"): "your corpus and questions",
    ("throughput.md", "llm = CacheBlendLLM(engine=engine, max_batch=8)"): "continues the block above",
}

pytestmark = pytest.mark.slow


def _fenced(page: Path) -> list[tuple[str, str]]:
    return FENCE.findall(page.read_text(encoding="utf-8"))


def _blocks() -> list[tuple[str, str]]:
    runnable = []
    for page in RUN:
        for lang, body in _fenced(page):
            if lang == "python":
                runnable.append(("python", body))
            elif lang == "bash":
                runnable += [("bash", line) for line in body.splitlines() if line.startswith("cacheblend-rag ")]
    return runnable


BLOCKS = _blocks()


def test_the_pages_have_the_blocks_this_test_runs():
    kinds = [kind for kind, _ in BLOCKS]
    assert kinds.count("python") >= 4 and kinds.count("bash") >= 2, BLOCKS


def test_every_other_python_block_is_a_known_fragment():
    """A Python block outside the run pages is on FRAGMENTS (it cannot run as written, for the
    reason given), and every entry of FRAGMENTS is still on its page."""
    found = set()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page in RUN:
            continue
        found |= {(page.name, body.strip().splitlines()[0]) for lang, body in _fenced(page) if lang == "python"}
    assert sorted(found - set(FRAGMENTS)) == [], "Python blocks that no test runs: make them run or list them in FRAGMENTS"
    assert sorted(set(FRAGMENTS) - found) == [], "FRAGMENTS lists blocks the pages no longer have"


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

"""The documentation site builds with ``mkdocs build --strict`` and the docs hold only current, in-repository facts.

The build fails on a broken link or anchor, a page missing from the nav, an API object mkdocstrings
cannot find and a command-line section the parser does not have. Install the tools with
``pip install -e ".[docs]"`` (install.sh does).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
USER_DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")),
             *sorted((REPO / "integrations").glob("*/README.md"))]
# Development-history language and paths outside the repository have no place in user docs.
FORBIDDEN = re.compile(
    r"\bsessions? [0-9]|the issue\b|issue.s (target|prototype)|\.\./shared|/work/|/root/|/home/\w",
    re.IGNORECASE,
)


def test_mkdocs_build_strict(tmp_path):
    try:
        import mkdocs  # noqa: F401
        import mkdocs_jupyter  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the documentation tools are not installed ({exc}): pip install -e '.[docs]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), str(REPO / "integrations" / "langchain-cacheblend"),
                      str(REPO / "integrations" / "llama-index-cacheblend"), env.get("PYTHONPATH")])
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    site = tmp_path / "site"
    for page in ("index.html", "quickstart/index.html", "cli/index.html", "api/engine/index.html",
                 "tutorials/measure_your_data/index.html"):
        assert (site / page).is_file(), f"the site has no {page}"
    api = (site / "api" / "engine" / "index.html").read_text()
    assert "CacheBlendEngine" in api and "BlendConfig" in api, "the API reference lost the engine's classes"
    assert "--top-k" in (site / "cli" / "index.html").read_text(), "the CLI reference lost ask's options"


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_hold_no_history_or_outside_paths(path):
    bad = [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
           if FORBIDDEN.search(line)]
    assert not bad, "development history or a path outside the repository:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_referenced_result_file_is_committed(path):
    """Every ``docs/results/...`` or ``docs/img/...`` file a page names exists."""
    text = path.read_text()
    names = set(re.findall(r"docs/(?:results|img)/[\w.\-]+", text))
    names |= {f"docs/img/{m}" for m in re.findall(r"\(img/([\w.\-]+)\)", text)}
    missing = sorted(n for n in names if not (REPO / n).is_file())
    assert not missing, f"{path.name} names files that are not in the repository: {missing}"

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
USER_DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "integrations").glob("*/README.md"))]
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
        filter(
            None,
            [
                str(REPO),
                str(REPO / "integrations" / "langchain-cacheblend"),
                str(REPO / "integrations" / "llama-index-cacheblend"),
                env.get("PYTHONPATH"),
            ],
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    site = tmp_path / "site"
    for page in (
        "index.html",
        "quickstart/index.html",
        "cli/index.html",
        "api/engine/index.html",
        "tutorials/measure_your_data/index.html",
    ):
        assert (site / page).is_file(), f"the site has no {page}"
    api = (site / "api" / "engine" / "index.html").read_text()
    assert "CacheBlendEngine" in api and "BlendConfig" in api, "the API reference lost the engine's classes"
    assert "--top-k" in (site / "cli" / "index.html").read_text(), "the CLI reference lost ask's options"


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_hold_no_history_or_outside_paths(path):
    bad = [
        f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1) if FORBIDDEN.search(line)
    ]
    assert not bad, "development history or a path outside the repository:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_referenced_result_file_is_committed(path):
    """Every ``docs/results/...`` or ``docs/img/...`` file a page names exists."""
    text = path.read_text()
    names = set(re.findall(r"docs/(?:results|img)/[\w.\-]+", text))
    names |= {f"docs/img/{m}" for m in re.findall(r"\(img/([\w.\-]+)\)", text)}
    missing = sorted(n for n in names if not (REPO / n).is_file())
    assert not missing, f"{path.name} names files that are not in the repository: {missing}"


# ----------------------------------------------------------------------------- published numbers
# Every table and every speed-up a user page shows comes from the committed result files
# (cacheblend_bench.doc_tables); these tests hold that.

from cacheblend_bench import doc_tables  # noqa: E402

# Pages another process owns (the server page's numbers come from its own helper) or that hold
# history; every other README/docs page is checked.
EXEMPT = {"server.md", "changelog.md", "design.md"}
# Tables that hold no measured numbers, by page and header row, with the reason.
ALLOWED_TABLES = {
    ("README.md", "| file | concept |"): "a map of the source files",
    ("how-it-works.md", "| step | where |"): "where each step lives in the code",
    ("benchmarks.md", "| name | source | task / metric | context |"): "the datasets and where they come from",
    ("choosing.md", "| | models |"): "which model families load",
    ("choosing.md", "| entry point | default | turn it off |"): "which neighbour-cache default each entry point has",
    ("sources.md", "| where | what you get |"): "where the shares appear, in words",
    ("sources.md", "| mode | `chunk_attention` |"): "which modes report the shares",
    ("cluster.md", "| set-up | what it buys | what it costs |"): "the deployment steps compared in words",
    ("cli.md", "| variable | meaning |"): "environment variables",
    ("engine.md", "| mode | what is reused | what is computed |"): "what each mode does",
    ("engine.md", "| name | score | source |"): "the selection criteria",
    ("index.md", "| you want to | read |"): "a reading guide",
    ("pipeline.md", "| key | meaning |"): "stats keys",
    ("quality.md", "| strategy | what is recomputed | cost beyond the recomputed tokens |"): "the strategies",
    ("quality.md", "| column | meaning |"): "what a result column means",
    ("reliability.md", "| fault or input | what happens | test that proves it |"): "behaviour and the test that checks it",
    ("reliability.md", "| attack | what happens | test that proves it |"): "behaviour and the test that checks it",
    ("sharing.md", "| URL | meaning |"): "URL forms",
    ("sharing.md", "| situation | what happens |"): "failure behaviour",
    ("storage.md", "| option | default | |"): "options and their defaults",
    ("storage.md", "| format | a value is stored as | K's scales | V's scales |"): "what each chunk record format is",
    ("storage.md", "| model | float32 | int8 (share of float32) | int4 (share of float32) |"): (
        "record sizes, not measurements: tests/test_kv_formats.py computes them from real records and checks the table"
    ),
}
# Speed-up-like figures in prose that are arithmetic, not measurements.
ALLOWED_FACTORS = {
    ("engine.md", "costs about 1.2x an"): "the cost of a token from the model's dimensions",
    ("engine.md", "selected-token cost of ~1.15x"): "the same arithmetic for Qwen2.5-0.5B",
    ("engine.md", "Llama ~1.06x"): "the same arithmetic for a 7B Llama",
}
GENERATED = re.compile(r"<!-- table: [\w-]+ -->\n.*?<!-- /table -->|<!--n:[\w.-]+(?: \w+)?-->.*?<!--/n-->", re.S)
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
FACTOR = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x\b")


def _checked_pages() -> list[Path]:
    return [p for p in doc_tables.pages(REPO) if p.name not in EXEMPT]


def _prose(path: Path) -> str:
    """The page without its generated tables and numbers and without code blocks (commands)."""
    return FENCED.sub("", GENERATED.sub("", path.read_text(encoding="utf-8")))


def test_docs_tables_and_numbers_equal_what_the_committed_result_files_give():
    stale = doc_tables.update(REPO, write=False)
    assert not stale, (
        "tables or numbers in the docs differ from docs/results; run "
        "python -m cacheblend_bench.doc_tables and commit the pages:\n" + "\n".join(stale)
    )


def _copy_docs(tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    return tmp_path


def test_a_changed_row_changes_the_page(tmp_path):
    """One slower CacheBlend answer in the first-token benchmark's rows: its tables and every
    number quoting its speed-up go stale, and rewriting the pages changes them."""
    import json

    root = _copy_docs(tmp_path)
    rows_path = root / "docs" / "results" / "bench_smollm2.jsonl"
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    target = next(r for r in rows if r["method"] == "question@0.15" and r["dataset"] == "hotpotqa")
    target["ttft_s"] *= 5
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stale = doc_tables.update(root, write=False)
    assert "docs/benchmarks.md: table bench-headline-hotpotqa" in stale
    assert "docs/benchmarks.md: table bench-headline-pooled" in stale
    assert "docs/benchmarks.md: table bench-headline-musique" not in stale  # its rows did not change
    assert any(s.startswith("docs/choosing.md: number bench.vs_saved") for s in stale)
    before = (root / "docs" / "choosing.md").read_text()
    doc_tables.update(root)
    assert (root / "docs" / "choosing.md").read_text() != before
    assert doc_tables.update(root, write=False) == []


def test_a_changed_headline_row_changes_the_readme_results(tmp_path):
    """One slower CacheBlend answer in a row the README's results table reads: the table goes
    stale and rewriting it changes the README."""
    import json

    from cacheblend_bench import headline

    root = _copy_docs(tmp_path)
    case = headline.CASES[0]
    rows_path = root / "docs" / "results" / headline.rows_file(case)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    default = headline.pick_default({r["method"] for r in rows})
    target = next(r for r in rows if r["method"] == default)
    target["ttft_s"] *= 5
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stale = doc_tables.update(root, write=False)
    assert "README.md: table readme-results" in stale
    before = (root / "README.md").read_text()
    doc_tables.update(root)
    assert (root / "README.md").read_text() != before


def test_a_changed_result_file_of_another_kind_changes_its_table(tmp_path):
    import json

    root = _copy_docs(tmp_path)
    probe = root / "docs" / "results" / "weight_formats_probe_smollm2.json"
    data = json.loads(probe.read_text())
    data["formats"]["fp16"]["kl_mean"] *= 10
    probe.write_text(json.dumps(data))
    stale = doc_tables.update(root, write=False)
    # the probe's table, and the README's number quoting its float16 KL; nothing else
    assert [": ".join(s.split(": ")[:2]) for s in stale] == [
        "README.md: number probe.kl_fp16",
        "docs/engine.md: table format-probe-smollm2",
    ]


@pytest.mark.parametrize("path", _checked_pages(), ids=lambda p: p.name)
def test_every_table_is_generated_or_holds_no_measurements(path):
    """A `|` table outside a generated block must be on ALLOWED_TABLES (no measured numbers)."""
    lines = _prose(path).splitlines()
    heads = [
        line.strip()
        for i, line in enumerate(lines)
        if line.lstrip().startswith("|") and (i == 0 or not lines[i - 1].lstrip().startswith("|"))
    ]
    stray = [h for h in heads if (path.name, h) not in ALLOWED_TABLES]
    assert not stray, (
        f"{path.name} has tables that are neither generated from docs/results nor free of "
        f"measurements: {stray}; generate them (cacheblend_bench.published) or add the "
        "header to ALLOWED_TABLES with the reason"
    )


@pytest.mark.parametrize("path", _checked_pages(), ids=lambda p: p.name)
def test_every_speedup_in_prose_is_generated(path):
    """An 'N.Nx' figure in prose must sit in a generated <!--n:...--> marker (or be arithmetic on
    ALLOWED_FACTORS), so it cannot drift from the rows."""
    stray = []
    for line in _prose(path).splitlines():
        for m in FACTOR.finditer(line):
            if not any(page == path.name and text in line for page, text in ALLOWED_FACTORS):
                stray.append(f"{m.group()} in: {line.strip()}")
    assert not stray, f"{path.name} quotes factors that no result file backs:\n" + "\n".join(stray)


def test_every_generated_table_names_its_rows_and_engine():
    from cacheblend_bench import provenance
    from cacheblend_bench.published import registry

    renderer = doc_tables.Renderer(REPO)
    tables, values = registry()
    for name in tables:
        text = renderer.table(name)
        assert re.search(r"`docs/results/[\w.]+` \(cacheblend-rag \d[\w.]*, commits? [0-9a-f]{7}", text), (
            f"table {name} does not say which rows and engine made it:\n{text}"
        )
    for group in values.values():
        for file in group.files:
            provenance.of(REPO / "docs" / "results", file)  # raises, naming the fix, when missing


def test_a_wrong_marker_name_is_refused_naming_what_exists():
    renderer = doc_tables.Renderer(REPO)
    with pytest.raises(KeyError, match="known tables: .*bench-headline-pooled"):
        renderer.page("<!-- table: no-such-table -->\n<!-- /table -->")
    with pytest.raises(KeyError, match="'bench.vs_nothing', which bench does not have; it has e.g."):
        renderer.page("<!--n:bench.vs_nothing x1-->?<!--/n-->")
    with pytest.raises(ValueError, match="number format 'q9' is not one of"):
        renderer.page("<!--n:bench.vs_saved q9-->?<!--/n-->")


def test_notebooks_quote_the_readme_headline():
    """The tutorials point at the default's first-token speed-up in their text; it must be the
    README's (its results table, SmolLM2-135M)."""
    import json

    headline = doc_tables.Renderer(REPO).value("headline.smollm2.first_token", "x1")
    for nb in sorted((REPO / "examples").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        claims = re.findall(r"about\s+(\d+(?:\.\d+)?x)\s+(?:faster|on\s+a\s+CPU)", text)
        assert claims, f"{nb.name} no longer quotes the benchmarks' speed-up: drop this check or the notebook"
        for claim in claims:
            assert claim == headline, f"{nb.name} says {claim}, the benchmarks {headline}"

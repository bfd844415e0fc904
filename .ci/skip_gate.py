"""pytest plugin for CI: a test that skips for a reason not on the allowed list fails the run.

Loaded by ``.ci/run`` and ``.ci/llamacpp`` (``PYTHONPATH=.ci python3 -m pytest -p skip_gate``). A
skip hides a claim the suite no longer checks, so a green run must not contain one unless this
file says why it is expected. ``--allowed-skips=none`` allows no skip at all.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

# (pattern searched in "<file>:<line>: <reason>", why a CI run may skip it[, pattern the test's node
# id must match: the skip is allowed only there])
ALLOWED: list[tuple[str, ...]] = [
    (r"no CUDA device", "the CUDA tests need a GPU; the CI machines have none"),
    (
        r"langchain_tests/.*: Model does not (explicitly )?support .+\.$",
        "LangChain's standard suites skip the inputs ChatCacheBlend does not take (image/audio/PDF/Anthropic-format)",
    ),
    (
        r"langchain_tests/.*: Test requires (tool calling( support)?|tool choice|structured output|json mode support)\.$",
        "the tiny random engine's standard suite leaves tool calling and structured output to the Qwen2.5-Coder-0.5B "
        "suite (test_standard_qwen.py, run by .ci/qwen, where these skips are not allowed)",
        r"test_standard\.py::TestChatCacheBlendIntegration::",
    ),
    (
        r"langchain_tests/.*: (model_override_value not specified|init_from_env_params not specified"
        r"|Model is not serializable|VCR not set up)\.$",
        "LangChain's standard suites skip options that do not apply to a local engine: one model per "
        "engine, no API keys in the environment, an engine is not serializable, no network calls to record",
    ),
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--allowed-skips",
        choices=("ci", "none"),
        default="ci",
        help="skip_gate: 'ci' allows the reasons listed in .ci/skip_gate.py, 'none' allows no skip",
    )


class SkipGate:
    """Records every skip (collection and test) and fails the session on one it does not allow."""

    def __init__(self, allowed: list[tuple[str, ...]]) -> None:
        self.allowed = [(re.compile(p), why, re.compile(rest[0]) if rest else None) for p, why, *rest in allowed]
        self.skips: list[tuple[str, str]] = []  # (node id, "<file>:<line>: <reason>")

    def record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        longrepr = report.longrepr
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            path, line, reason = longrepr
            where = f"{path}:{line}: {str(reason).removeprefix('Skipped: ')}"
        else:
            where = str(longrepr)
        self.skips.append((report.nodeid, where))

    def why_allowed(self, where: str, node: str = "") -> str | None:
        """Why the skip at ``where`` ("<file>:<line>: <reason>") of the test ``node`` is allowed, or None."""
        return next(
            (why for pattern, why, nodes in self.allowed if pattern.search(where) and (nodes is None or nodes.search(node))), None
        )

    def refused(self) -> list[tuple[str, str]]:
        return [(node, where) for node, where in self.skips if self.why_allowed(where, node) is None]

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.record(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.record(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.refused() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        tr.section("skip gate")
        allowed = Counter(self.why_allowed(where, node) for node, where in self.skips)
        allowed.pop(None, None)
        for why, n in allowed.items():
            tr.write_line(f"{n} skipped, allowed: {why}")
        refused = self.refused()
        for node, where in refused:
            tr.write_line(f"NOT ALLOWED: {node}: {where}", red=True)
        tr.write_line(
            f"{len(self.skips)} skipped, {len(refused)} not on the allowed list (.ci/skip_gate.py)",
            red=bool(refused),
            green=not refused,
        )


def pytest_configure(config: pytest.Config) -> None:
    allowed = ALLOWED if config.getoption("allowed_skips") == "ci" else []
    config.pluginmanager.register(SkipGate(allowed), "skip_gate_session")

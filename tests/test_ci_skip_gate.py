"""``.ci/skip_gate.py``, the pytest plugin behind a green CI: a skip not on its allowed list fails
the run, naming the test and the reason; allowed skips are counted by reason."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[1] / ".ci"

SUITE = textwrap.dedent(
    """
    import pytest

    @pytest.mark.skipif(True, reason="no CUDA device: these tests run where a GPU is present")
    def test_gpu():
        pass

    def test_data():
        if WANT_DATA:
            pytest.skip("MuSiQue data not found")

    @pytest.mark.xfail(reason="a known bug, not a skip")
    def test_known_bug():
        assert False

    def test_plain():
        pass
    """
)


def run_gate(tmp_path: Path, want_data: bool, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_suite.py").write_text(SUITE.replace("WANT_DATA", str(want_data)))
    # No third-party plugins: the run only needs skip_gate, and starts in a fraction of the time.
    env = dict(
        os.environ,
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(CI), os.environ.get("PYTHONPATH")])),
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "skip_gate",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "test_suite.py",
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_allowed_skip_passes_and_is_counted_with_its_reason(tmp_path):
    done = run_gate(tmp_path, False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped, allowed: the CUDA tests need a GPU" in done.stdout
    assert "1 skipped, 0 not on the allowed list" in done.stdout


def test_a_skip_not_on_the_list_fails_the_run_and_is_named(tmp_path):
    # One test skipping at run time and one module skipping at collection, beside an allowed skip.
    (tmp_path / "test_missing.py").write_text('import pytest\npytest.importorskip("no_such_module_here")\n')
    done = run_gate(tmp_path, True, "test_missing.py")
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "NOT ALLOWED: test_suite.py::test_data: " in done.stdout and "MuSiQue data not found" in done.stdout
    assert "NOT ALLOWED: test_missing.py: " in done.stdout and "no_such_module_here" in done.stdout
    assert "3 skipped, 2 not on the allowed list" in done.stdout


def test_allowed_skips_none_refuses_every_skip(tmp_path):
    done = run_gate(tmp_path, False, "--allowed-skips=none")
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "NOT ALLOWED: test_suite.py::test_gpu: " in done.stdout


def _gate():
    sys.path.insert(0, str(CI))
    try:
        import skip_gate
    finally:
        sys.path.remove(str(CI))
    return skip_gate.SkipGate(skip_gate.ALLOWED)


def test_tool_calling_skips_are_allowed_only_in_the_tiny_engines_suite():
    """The tiny random engine's standard suite turns tool calling and structured output off (the
    Qwen suite runs them); the same skips anywhere else, the Qwen suite included, fail the run."""
    gate = _gate()
    where = "/site-packages/langchain_tests/integration_tests/chat_models.py:1671: Test requires tool calling."
    tiny = "integrations/langchain-cacheblend/tests/test_standard.py::TestChatCacheBlendIntegration::test_tool_calling"
    qwen = "integrations/langchain-cacheblend/tests/test_standard_qwen.py::TestChatCacheBlendQwen::test_tool_calling"
    assert gate.why_allowed(where, tiny) is not None
    assert gate.why_allowed(where, qwen) is None
    json_mode = where.replace("Test requires tool calling.", "Test requires json mode support.")
    assert gate.why_allowed(json_mode, tiny) is not None and gate.why_allowed(json_mode, qwen) is None
    # Inputs the model does not take stay allowed in both suites.
    image = "/site-packages/langchain_tests/integration_tests/chat_models.py:2858: Model does not support image message."
    assert gate.why_allowed(image, tiny) is not None and gate.why_allowed(image, qwen) is not None

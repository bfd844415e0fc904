"""``ask --keep-alive``: a process keeps the model loaded and answers later ``ask``s exactly as an
``ask`` that loads the model itself does; it goes when idle, on ``--keep-alive 0`` or SIGTERM; a
failure to start it leaves the answer to the ``ask``'s own process.

Each ``ask`` here is a process of its own (``python -m cacheblend_rag``) over a tiny random model
saved to disk, as a user runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cacheblend_rag.cli import warm
from cacheblend_rag.testing import make_model, make_tokenizer

PARAGRAPHS = [
    "The river Thames flows through Oxford and London.",
    "Marie Curie won two Nobel prizes, in physics and in chemistry.",
    "Apollo 11 landed on the Moon in July 1969.",
]
QUESTIONS = ["Which river flows through Oxford?", "Who won two Nobel prizes?"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    make_model("llama").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def home(tmp_path):
    """A cache home; any process kept in it is stopped at the end."""
    yield tmp_path / "home"
    for lock in (tmp_path / "home" / "warm").glob("*.lock"):
        pid = _pid(lock)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _ask(home: Path, model_dir: Path, docs: Path, question: str, *flags: str, stdin: str | None = None):
    env = {**os.environ, "CACHEBLEND_RAG_HOME": str(home), "OMP_NUM_THREADS": "1"}
    env.pop(warm.ENV, None)
    command = [sys.executable, "-m", "cacheblend_rag", "ask", question, str(docs), "--model", str(model_dir)]
    command += ["--json", "--max-new-tokens", "6", "--top-k", "0", "--no-neighbours", *flags]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, env=env, timeout=600)


def _answers(done: subprocess.CompletedProcess) -> list[tuple[str, str, int]]:
    assert done.returncode == 0, done.stderr
    decoder, text, out = json.JSONDecoder(), done.stdout.strip(), []
    while text:  # one object per question: indented for one, a line each for ``ask -``
        obj, end = decoder.raw_decode(text)
        out.append(obj)
        text = text[end:].strip()
    return [(o["question"], o["answer"], o["stats"]["chunk_hits"]) for o in out]


def _docs(tmp_path: Path) -> Path:
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(PARAGRAPHS))
    return docs


def _kept(home: Path) -> list[Path]:
    return sorted((home / "warm").glob("*.lock"))


def _pid(lock: Path) -> int:
    text = lock.read_text().strip()
    return int(text) if text else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _gone(pid: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_kept_process_answers_later_asks_as_an_ask_of_its_own_does_and_stops_on_keep_alive_0(tmp_path, home, model_dir):
    docs = _docs(tmp_path)
    first = _answers(_ask(home, model_dir, docs, QUESTIONS[0]))  # computes and stores the chunk caches
    own = _answers(_ask(home, model_dir, docs, "-", stdin="\n".join(QUESTIONS) + "\n"))
    assert [q for q, _, _ in own] == QUESTIONS and own[0][:2] == first[0][:2] and own[0][2] > 0

    started = _answers(_ask(home, model_dir, docs, QUESTIONS[0], "--keep-alive", "5m"))
    [lock] = _kept(home)
    pid = _pid(lock)
    assert _alive(pid) and lock.with_suffix(".sock").exists()
    again = _answers(_ask(home, model_dir, docs, "-", "--keep-alive", "5m", stdin="\n".join(QUESTIONS) + "\n"))
    assert started == own[:1] and again == own  # the same answers, from the same caches
    assert _kept(home) == [lock] and _pid(lock) == pid  # one process answered both
    assert lock.with_suffix(".log").read_text().count("loading") == 1

    last = _answers(_ask(home, model_dir, docs, QUESTIONS[1], "--keep-alive", "0"))
    assert last == own[1:]
    assert _gone(pid), "--keep-alive 0 stops the kept process after its answer"
    assert not lock.with_suffix(".sock").exists()
    assert lock.with_suffix(".log").read_text().rstrip().endswith("stopped")


def test_kept_process_reports_an_asks_errors_survives_a_client_that_leaves_and_stops_on_sigterm(tmp_path, home, model_dir):
    docs = _docs(tmp_path)
    want = _answers(_ask(home, model_dir, docs, QUESTIONS[0], "--keep-alive", "5m"))
    [lock] = _kept(home)
    pid = _pid(lock)

    missing = _ask(home, model_dir, tmp_path / "nowhere.txt", QUESTIONS[0], "--keep-alive", "5m")
    assert missing.returncode == 1 and missing.stdout == ""
    assert f"error: {tmp_path / 'nowhere.txt'}: no such file" in missing.stderr

    # An ask stopped while its answer streams (Ctrl-C): the connection closes under the answer.
    flags = warm.flags(_namespace(docs, model_dir))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(lock.with_suffix(".sock")))
        warm.send(conn, {"ask": {**flags, "json": False}, "keep_alive": 300})
        warm.send(conn, {"question": QUESTIONS[0]})
        assert json.loads(conn.makefile("r").readline())  # its first output, then gone

    [(question, answer, hits)] = _answers(_ask(home, model_dir, docs, QUESTIONS[0], "--keep-alive", "5m"))
    assert (question, answer) == want[0][:2] and hits == 1  # answered, from the cache the first ask made
    assert _pid(lock) == pid and _alive(pid)

    os.kill(pid, signal.SIGTERM)
    assert _gone(pid)
    assert not lock.with_suffix(".sock").exists()
    assert lock.with_suffix(".log").read_text().rstrip().endswith("stopped")


def test_two_asks_at_once_start_one_kept_process_which_stops_when_idle(tmp_path, home, model_dir):
    docs = _docs(tmp_path)
    [want] = _answers(_ask(home, model_dir, docs, QUESTIONS[1]))  # computes the chunk cache both asks read
    env = {**os.environ, "CACHEBLEND_RAG_HOME": str(home), "OMP_NUM_THREADS": "1", warm.ENV: "3s"}
    command = [sys.executable, "-m", "cacheblend_rag", "ask", QUESTIONS[1], str(docs), "--model", str(model_dir)]
    command += ["--json", "--max-new-tokens", "6", "--top-k", "0", "--no-neighbours"]  # --keep-alive from the environment
    both = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    for proc in both:
        out, err = proc.communicate(timeout=600)
        assert _answers(subprocess.CompletedProcess(command, proc.returncode, out, err)) == [(*want[:2], 1)]
        assert "warning" not in err  # neither fell back to its own process
    [lock] = _kept(home)  # the second launcher found the lock taken and waited for the first's process
    assert lock.with_suffix(".log").read_text().count("loading") == 1
    assert _gone(_pid(lock)), "idle for its keep-alive (3 s), it stops"
    assert not lock.with_suffix(".sock").exists()


def _namespace(docs: Path, model_dir: Path) -> argparse.Namespace:
    """``ask``'s parsed flags as the tests' ``_ask`` passes them."""
    from cacheblend_rag.cli.app import build_parser

    return build_parser().parse_args(
        ["ask", QUESTIONS[0], str(docs), "--model", str(model_dir), "--json", "--max-new-tokens", "6"]
        + ["--top-k", "0", "--no-neighbours", "--keep-alive", "5m"]
    )


def test_an_ask_whose_kept_process_cannot_start_answers_in_its_own_process(tmp_path, home):
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    done = _ask(home, not_a_model, _docs(tmp_path), QUESTIONS[0], "--keep-alive", "5m")
    own = _ask(home, not_a_model, _docs(tmp_path), QUESTIONS[0])
    assert "warning: could not keep the model loaded: it stopped before it listened" in done.stderr
    assert "answering in this process" in done.stderr
    # Then the ask's own process meets the same model and refuses it as an ask without --keep-alive does.
    assert done.returncode == own.returncode == 2
    assert done.stderr.splitlines()[-1] == own.stderr.splitlines()[-1]
    assert own.stderr.splitlines()[-1].startswith("error: ")


def test_the_kept_process_is_one_per_model_flags_not_per_question_or_files(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEBLEND_RAG_HOME", str(tmp_path / "home"))
    docs = _docs(tmp_path)
    (tmp_path / "model").mkdir()
    base = warm.flags(_namespace(docs, tmp_path / "model"))
    place = warm.Place.of(base).socket
    assert warm.Place.of({**base, "question": "another", "files": [], "top_k": 2}).socket == place
    for flag, value in (("kv_format", "float"), ("weights", "fp32"), ("store", "disk,redis://x:6379/0"), ("model", "other")):
        assert warm.Place.of({**base, flag: value}).socket != place, flag
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert warm.Place.of(base).socket != place  # the threads a load gets
    assert (place.parent.stat().st_mode & 0o777) == 0o700  # only the user reaches the socket


@pytest.mark.parametrize(
    ("text", "seconds"), [("300", 300.0), ("5m", 300.0), ("1.5h", 5400.0), ("30s", 30.0), ("0", 0.0), ("-1", -1.0), ("-5m", -1.0)]
)
def test_keep_alive_reads_seconds_or_a_number_with_its_unit(text, seconds):
    assert warm.duration(text) == seconds


def test_a_keep_alive_that_is_not_a_duration_is_refused_before_anything_loads(capsys, monkeypatch):
    from cacheblend_rag.cli import app

    for bad in ("5x", "soon", "nan"):
        with pytest.raises(SystemExit) as exc:
            app.main(["ask", "q", "f.txt", "--keep-alive", bad])
        assert exc.value.code == 2
        assert (
            f"argument --keep-alive: {bad!r} is not a duration: pass seconds or a number with s, m or h"
            in capsys.readouterr().err
        )
    monkeypatch.setenv(warm.ENV, "later")  # the environment's default is checked the same way
    with pytest.raises(SystemExit):
        app.main(["ask", "q", "f.txt"])
    assert "argument --keep-alive: 'later' is not a duration" in capsys.readouterr().err

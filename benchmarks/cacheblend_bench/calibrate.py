"""``cacheblend-rag calibrate``: the cheapest recompute ratio that answers like full prefill on your data.

Each sample question is answered with full prefill and with the strategy at every ratio (greedy);
agreement is the mean token F1 between the two answers. The smallest ratio that reaches
``--target`` is saved in the model's quality profile (``calibration.QualityProfile``), which
``CacheBlendEngine.from_pretrained`` uses by default from then on.

Samples: ``--sample FILE``, a JSON list of ``{"question": str, "chunks": [str, ...]}`` (your own
retrieved chunks, in prompt order), or the bundled HotpotQA questions (``--n``, ``--offset``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from cacheblend_bench import datasets as ds
from cacheblend_bench.fidelity import agreement_f1, answer_once
from cacheblend_bench.methods import parse_methods
from cacheblend_bench.runner import BenchConfig, load_engine
from cacheblend_rag.control.calibration import QualityProfile, choose_ratio, quality_profile_path

DEFAULT_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)


def read_sample(path: str) -> list[tuple[str, list[str]]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list) or not all(
        isinstance(d, dict) and isinstance(d.get("question"), str) and isinstance(d.get("chunks"), list) for d in data
    ):
        raise ValueError(f'{path}: expected a JSON list of {{"question": str, "chunks": [str, ...]}} objects')
    return [(d["question"], [str(c) for c in d["chunks"]]) for d in data]


def bundled_sample(engine, n: int, offset: int, top_k: int = 6, chunk_tokens: int = 512, hotpotqa: str | None = None):
    retriever = ds.Retriever()
    count = ds.token_counter(engine.tokenizer)
    return [
        (ex.question, ds.retrieve(ex, retriever, count, chunk_tokens, top_k))
        for ex in ds.load_dataset("hotpotqa", n, hotpotqa=hotpotqa, offset=offset)
    ]


def calibrate(
    engine, sample, strategy: str, ratios, target: float, max_new_tokens: int = 16, progress: bool = True
) -> QualityProfile:
    methods = parse_methods([f"{strategy}@{r:g}" for r in ratios])
    full = parse_methods(["full_recompute"])[0]
    scores: dict[float, list[float]] = {m.ratio: [] for m in methods}
    for question, chunks in tqdm(sample, desc="calibrate", unit="question", disable=not progress):
        engine.precompute(chunks, progress=False)
        ref = answer_once(engine, full, question, chunks, max_new_tokens)["result"].text
        for m in methods:
            got = answer_once(engine, m, question, chunks, max_new_tokens)["result"].text
            scores[m.ratio].append(agreement_f1(got, ref))
    curve = {r: sum(v) / len(v) for r, v in scores.items() if v}
    ratio, reached = choose_ratio(curve, target)
    return QualityProfile(
        strategy="hkvd" if strategy == "cacheblend" else strategy,
        recompute_ratio=ratio,
        target=target,
        reached=reached,
        n=len(sample),
        curve={f"{r:g}": a for r, a in sorted(curve.items())},
    )


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="find the cheapest recompute ratio whose answers agree with full prefill's, and make it the model's default",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", help="smollm2 (bundled), qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, or a path")
    p.add_argument("--sample", default=None, help="JSON list of {question, chunks} (default: bundled HotpotQA questions)")
    p.add_argument("--n", type=int, default=20, help="bundled questions to use (default 20)")
    p.add_argument("--offset", type=int, default=0, help="first bundled question (default 0)")
    p.add_argument(
        "--strategy", default="question", choices=["question", "chunk", "hybrid", "cacheblend"], help="default question"
    )
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in DEFAULT_RATIOS), help="comma list of ratios to try")
    p.add_argument(
        "--target", type=float, default=0.9, help="mean answer agreement (token F1 vs full prefill) to reach (default 0.9)"
    )
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", default=None, help="profile path (default: the model's quality profile in the cache home)")
    p.add_argument("--dry-run", action="store_true", help="measure and print; save nothing")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import tempfile

    from cacheblend_bench.qwen import QwenPartsMissing

    try:
        ratios = sorted({float(r) for r in args.ratios.split(",") if r.strip()})
        if not ratios or not all(0.0 <= r <= 1.0 for r in ratios):
            raise ValueError(f"--ratios {args.ratios!r}: give numbers in [0, 1], e.g. 0.1,0.15,0.3")
        if not 0.0 < args.target <= 1.0:
            raise ValueError(f"--target {args.target}: give the agreement to reach, in (0, 1]")
        with tempfile.TemporaryDirectory(prefix="cacheblend-calibrate-") as tmp:
            engine = load_engine(BenchConfig(model=args.model, out_dir=tmp, device=args.device))
            try:
                sample = read_sample(args.sample) if args.sample else bundled_sample(engine, args.n, args.offset)
                profile = calibrate(engine, sample, args.strategy, ratios, args.target, args.max_new_tokens)
                fingerprint = engine.fingerprint
            finally:
                engine.close()
    except (FileNotFoundError, ImportError, QwenPartsMissing, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r, a in profile.curve.items():
        print(f"ratio {r:>5}: agreement {a:.3f}")
    verdict = "reached" if profile.reached else "NOT reached (best ratio kept)"
    print(f"{profile.strategy}@{profile.recompute_ratio:g}: target {profile.target} {verdict}, n={profile.n}")
    if not args.dry_run:
        path = profile.save(args.out or quality_profile_path(fingerprint))
        print(f"saved {path}; CacheBlendEngine.from_pretrained uses it when no config is passed")
    return 0

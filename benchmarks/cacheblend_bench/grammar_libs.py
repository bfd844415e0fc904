"""Grammar libraries for constrained decoding, side by side: what a JSON schema costs to set up
and what each decoded token costs, on the readers' own tokenizers.

One row per library and tokenizer: the one-time tokenizer setup, the schema's compile (first and
best of ``--repeats``: a library may cache it), the answer's matcher, and per
token of a valid answer the mask computation (fill the allowed-token bitmask) and advancing the
matcher, the first token (where a library may build lazily) separately. Applying the bitmask to a
``[vocab]`` float32 logits row is the same code for all (``constraints.apply_bitmask``: the
libraries share the bitmask layout), timed once per row. The answer is the schema's example
serialised as ``json.dumps`` does and tokenized as the model would write it; a library that
refuses one of its tokens is reported, not timed.

    python3 -m cacheblend_bench.grammar_libs --lib llguidance --out docs/results/grammar_libs.jsonl

Each library is measured in its own process (``--lib``), so the import of one does not count for
another. The installed size is the sum of the files the library's distributions record (and those
of the dependencies it needs on a CPU, ``DEPS``).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cacheblend_rag.decode.constraints import JSON_FORMAT, apply_bitmask

# A with_structured_output schema of the usual shape: strings, an integer, an enum, an array.
SCHEMA: dict[str, Any] = {
    "title": "Person",
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "full name"},
        "born": {"type": "integer", "description": "year of birth"},
        "city": {"type": "string"},
        "fields": {"type": "array", "items": {"type": "string"}},
        "role": {"enum": ["physicist", "chemist", "engineer"]},
    },
    "required": ["name", "born", "city", "fields", "role"],
    "additionalProperties": False,
}
EXAMPLE = {"name": "Marie Curie", "born": 1867, "city": "Paris", "fields": ["physics", "chemistry"], "role": "physicist"}
# The distributions each library needs on a CPU (xgrammar's triton is for GPU kernels only).
DEPS = {
    "llguidance": ["llguidance"],
    "xgrammar": ["xgrammar", "apache-tvm-ffi"],
    "outlines": ["outlines", "outlines_core", "genson"],
}


class Measured:
    """One library's hooks: ``setup(tokenizer) -> state``, ``compile(state, schema) -> grammar``,
    ``matcher(state, grammar) -> [m, bitmask]``, ``fill(m)`` fills ``m[1]`` with the allowed
    tokens, ``accept(m, token) -> bool``."""

    def __init__(self, setup: Callable, compile: Callable, matcher: Callable, fill: Callable, accept: Callable):
        self.setup, self.compile, self.matcher, self.fill, self.accept = setup, compile, matcher, fill, accept


def _llguidance() -> Measured:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    def matcher(state, grammar):
        return [llguidance.LLMatcher(state, grammar), lt.allocate_token_bitmask(1, state.vocab_size)]

    def fill(m):
        lt.fill_next_token_bitmask(m[0], m[1], 0)

    return Measured(
        setup=lambda tok: llguidance.hf.from_tokenizer(tok),
        compile=lambda state, schema: llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_FORMAT),
        matcher=matcher,
        fill=fill,
        accept=lambda m, t: bool(m[0].consume_token(t)) and not m[0].is_error(),
    )


def _xgrammar() -> Measured:
    import xgrammar as xgr

    def setup(tok):
        info = xgr.TokenizerInfo.from_huggingface(tok)
        return xgr.GrammarCompiler(info), info

    def matcher(state, grammar):
        return [xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, state[1].vocab_size)]

    def fill(m):
        m[0].fill_next_token_bitmask(m[1])

    def compile(compiler, schema):
        return compiler[0].compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    return Measured(setup=setup, compile=compile, matcher=matcher, fill=fill, accept=lambda m, t: bool(m[0].accept_token(t)))


def _outlines() -> Measured:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from outlines_core.kernels.torch import allocate_token_bitmask, fill_next_token_bitmask

    def setup(tok):
        # outlines' own vocabulary conversion (backends.outlines_core): token -> its text.
        vocab: dict[str, list[int]] = {}
        for token, i in tok.get_vocab().items():
            if i != tok.eos_token_id:
                vocab.setdefault(tok.convert_tokens_to_string([token]), []).append(i)
        return Vocabulary(tok.eos_token_id, vocab), len(tok)

    def matcher(state, index):
        return [Guide(index), allocate_token_bitmask(state[1])]

    def fill(m):
        fill_next_token_bitmask(m[0], m[1])

    def accept(m, t):
        try:
            m[0].advance(t)
        except Exception:  # noqa: BLE001 - outlines raises on a token the guide refuses
            return False
        return True

    return Measured(
        setup=setup,
        compile=lambda state, schema: Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"), state[0]),
        matcher=matcher,
        fill=fill,
        accept=accept,
    )


LIBS = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines": _outlines}


def installed_bytes(dists: list[str]) -> int:
    total = 0
    for name in dists:
        for f in md.distribution(name).files or []:
            path = Path(f.locate())
            if path.is_file():
                total += path.stat().st_size
    return total


def measure(lib: str, tokenizer_dir: str, label: str, repeats: int = 3) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    t0 = time.perf_counter()
    hooks = LIBS[lib]()
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = hooks.setup(tok)
    setup_s = time.perf_counter() - t0
    compile_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        grammar = hooks.compile(state, SCHEMA)
        compile_s.append(time.perf_counter() - t0)
    text = json.dumps(EXAMPLE)
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    per_token: list[float] = []
    first_token: list[float] = []
    refused = None
    new_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = hooks.matcher(state, grammar)
        new_s.append(time.perf_counter() - t0)
        logits = torch.zeros(len(tok))
        for i, t in enumerate(tokens):
            t0 = time.perf_counter()
            hooks.fill(m)
            ok = hooks.accept(m, t)
            (per_token if i else first_token).append(time.perf_counter() - t0)
            if not ok:
                refused = f"token {i} ({tok.decode([t])!r}) of the example"
                break
        if refused:
            break
    # Applying a bitmask to the logits is the same code for every library (they share its layout).
    bitmask = m[1].reshape(-1)[: (len(tok) + 31) // 32]
    apply_s = []
    for _ in range(20 * repeats):
        t0 = time.perf_counter()
        apply_bitmask(logits, bitmask)
        apply_s.append(time.perf_counter() - t0)
    version = md.version(DEPS[lib][0])
    return {
        "library": lib,
        "version": version,
        "tokenizer": label,
        "vocab": len(tok),
        "import_s": import_s,
        "tokenizer_setup_s": setup_s,
        "compile_s_min": min(compile_s),
        "compile_s_first": compile_s[0],
        "matcher_us_first": new_s[0] * 1e6,
        "first_token_us_max": max(first_token) * 1e6 if first_token else None,
        "mask_and_advance_us_median": statistics.median(per_token) * 1e6 if per_token else None,
        "mask_and_advance_us_max": max(per_token) * 1e6 if per_token else None,
        "apply_mask_us_median": statistics.median(apply_s) * 1e6,
        "tokens": len(tokens),
        "refused": refused,
        "installed_mb": round(installed_bytes(DEPS[lib]) / 2**20, 1),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "torch_threads": torch.get_num_threads(),
        "load_1min": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", choices=sorted(LIBS), required=True)
    ap.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="a tokenizer directory to measure on (repeatable; default: the bundled SmolLM2 and Qwen2.5-Coder-0.5B)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="append the rows (JSON lines) to this file")
    args = ap.parse_args(argv)
    pairs = [t.split("=", 1) for t in args.tokenizer] or default_tokenizers()
    for label, directory in pairs:
        row = measure(args.lib, directory, label, args.repeats)
        print(json.dumps(row))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


def default_tokenizers() -> list[list[str]]:
    """The bundled SmolLM2's and Qwen2.5-Coder-0.5B's tokenizer directories (their GGUFs converted once)."""
    from cacheblend_bench.qwen import qwen_gguf_path
    from cacheblend_rag.model.loading import _converted_gguf_dir, bundled_gguf_path, default_cache_dir

    home = default_cache_dir()
    return [
        ["SmolLM2-135M", str(_converted_gguf_dir(bundled_gguf_path(), home))],
        ["Qwen2.5-Coder-0.5B", str(_converted_gguf_dir(qwen_gguf_path(), home))],
    ]


if __name__ == "__main__":
    main()

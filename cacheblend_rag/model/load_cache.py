"""What a later load of the same model does not redo, kept in the cache home under keys of
everything that decides it.

* :func:`cached_fingerprint`: a model directory's fingerprint (:func:`model_fingerprint`
  hashes every weight byte), keyed by the identity of every file in the directory (path, size,
  mtime_ns, inode), the torch and transformers versions, the dtype, device and weight format, and
  the code that computes it. A changed file, version or format hashes again.
* :class:`PassedChecks`: the load-time checks that refuse a model we cannot run exactly
  (``blend.self_test`` and ``decode.step.FastDecodeStep``'s check) are skipped only where the same
  check already *passed* for the same key: the model fingerprint, the torch and transformers
  versions, the code of the modules that run the model, the CPU (model name and flags), the
  attention implementation, device, dtype and thread count. A failure is never recorded, so a refused model is tested (and
  refused) again on every load.

A record that cannot be read, or holds another key, is ignored with a warning and recomputed; one
that cannot be written (a read-only cache home) only costs the work next time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

log = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parent.parent
# Modules whose code decides a fingerprint, and those that decide a load-time check's verdict.
_FINGERPRINT_CODE = ("model/fingerprint.py", "model/load_cache.py", "model/weights.py", "model/dtypes.py")
_CHECK_CODE = ("blend", "decode", "model", "rope.py", "config.py", "threads.py")
_HEX = re.compile(r"^[0-9a-f]{16,128}$")


def _code_digest(parts: tuple[str, ...]) -> str:
    """Digest of the source of ``parts`` (files or folders of ``.py`` files under the package)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        path = _PACKAGE / part
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            h.update(f"{f.relative_to(_PACKAGE)}\0".encode())
            try:
                h.update(f.read_bytes())
            except OSError:
                h.update(b"?")
    return h.hexdigest()


@functools.cache
def _fingerprint_code() -> str:
    return _code_digest(_FINGERPRINT_CODE)


@functools.cache
def _check_code() -> str:
    return _code_digest(_CHECK_CODE)


@functools.cache
def cpu_identity() -> str:
    """The CPU's model name and feature flags (what decides which kernels torch runs)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "flags", "Features", "CPU implementer", "CPU part") and name not in fields:
                    fields[name] = " ".join(value.split())
    except OSError:
        pass
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: "?")()
    fields["machine"] = f"{platform.machine()} {platform.processor()} {capability}"
    return json.dumps(fields, sort_keys=True)


def _digest(key: dict[str, Any]) -> str:
    return hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()


def _read(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The record at ``path`` if it is for ``key``; None if absent; a warning if unusable."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("ignoring the unreadable load cache record %s (%s)", path, exc)
        return None
    try:
        record = json.loads(text)
        if not isinstance(record, dict) or record.get("key") != key:
            raise ValueError("it holds another key")
    except ValueError as exc:
        log.warning("ignoring the damaged load cache record %s (%s); computing it again", path, exc)
        return None
    return record


def _write(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` atomically (a temporary file renamed over ``path``); failures are logged."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.info("could not keep %s (%s); it is computed again on the next load", path, exc)


def directory_identity(directory: Path) -> list[list[Any]]:
    """(name, size, mtime_ns, inode) of every file in ``directory`` (not recursive), by name."""
    out = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_file():
            st = entry.stat()
            out.append([entry.name, st.st_size, st.st_mtime_ns, st.st_ino])
    return out


def cached_fingerprint(
    cache_root: Path,
    source: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    weights: str,
    compute: Callable[[], str],
) -> str:
    """``compute()`` (the fingerprint of the model loaded from the directory ``source``), or the
    value it gave before for the same files, versions, dtype, device, weight format and code."""
    try:
        key = {
            "source": str(source.resolve()),
            "files": directory_identity(source),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "dtype": str(dtype),
            "device": str(device),
            "weights": weights,
            "code": _fingerprint_code(),
        }
    except OSError as exc:
        log.info("not caching the fingerprint of %s (%s)", source, exc)
        return compute()
    path = cache_root / "fingerprints" / f"{_digest(key)}.json"
    record = _read(path, key)
    if record is not None:
        value = record.get("fingerprint")
        if isinstance(value, str) and _HEX.match(value):
            return value
        log.warning("ignoring the damaged load cache record %s (no fingerprint); computing it again", path)
    value = compute()
    _write(path, {"key": key, "fingerprint": value})
    return value


class PassedChecks:
    """The load-time checks that already passed for this model on this machine and code.

    ``fingerprint`` must be the fingerprint of ``model`` as loaded (weights, config, tokenizer,
    dtype, weight format); the rest of the key is read here."""

    def __init__(self, cache_root: str | os.PathLike[str], fingerprint: str, model: torch.nn.Module):
        param = next(model.parameters())
        self.key = {
            "fingerprint": fingerprint,
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            # Left out of the fingerprint, but it decides the kernels a check runs.
            "attention": str(getattr(model.config, "_attn_implementation", None)),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "code": _check_code(),
            "cpu": cpu_identity(),
            "device": str(param.device),
            "dtype": str(param.dtype),
            "threads": torch.get_num_threads(),
        }
        self.directory = Path(cache_root) / "checks"

    def _path(self, check: str) -> Path:
        return self.directory / f"{check}-{_digest(self.key)}.json"

    def passed(self, check: str) -> bool:
        """Whether ``check`` passed before for this key."""
        record = _read(self._path(check), self.key)
        if record is None:
            return False
        if record.get("verdict") != "passed":
            log.warning("ignoring the damaged load cache record %s (no verdict); checking again", self._path(check))
            return False
        return True

    def record_pass(self, check: str) -> None:
        """Remember that ``check`` passed (failures are never recorded)."""
        _write(self._path(check), {"key": self.key, "verdict": "passed"})

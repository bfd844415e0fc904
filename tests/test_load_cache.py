"""What a later load does not redo (``model.fingerprint``): the fingerprint of an unchanged model
directory and the load-time checks that already passed. Each is redone where its key changes, a
damaged record is ignored with a warning, a failed check is never remembered, and the answers are
those of a load that did the work afresh."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import cacheblend_rag.engine.core as core
import cacheblend_rag.model.loading as loading
from cacheblend_rag.decode.step import FastDecodeStep
from cacheblend_rag.engine.core import CacheBlendEngine
from cacheblend_rag.errors import UnsupportedModelError
from cacheblend_rag.model.fingerprint import model_fingerprint
from cacheblend_rag.model.load_cache import PassedChecks
from cacheblend_rag.model.weights import apply_weight_format
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.testing import SAMPLE_CHUNKS, SAMPLE_QUESTION, make_model, make_tokenizer


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "llama"
    make_model("llama", layers=2).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def hashed(monkeypatch) -> list[int]:
    """Counts the fingerprints ``load_model`` computes (hashing every weight)."""
    calls: list[int] = []
    real = loading.model_fingerprint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "model_fingerprint", counting)
    return calls


def _records(home: Path, folder: str) -> list[Path]:
    return sorted((home / folder).glob("*.json"))


def test_fingerprint_is_hashed_once_per_unchanged_directory(model_dir, tmp_path, hashed):
    home = tmp_path / "home"
    first = loading.load_model(model_dir, cache_dir=home)
    assert len(hashed) == 1
    assert first.fingerprint == model_fingerprint(first.model, first.tokenizer, torch.float32)  # the real hash
    again = loading.load_model(model_dir, cache_dir=home)
    assert len(hashed) == 1 and again.fingerprint == first.fingerprint
    # Another weight format or dtype is another key.
    assert loading.load_model(model_dir, cache_dir=home, weights="fp32").fingerprint != first.fingerprint
    assert len(hashed) == 2
    assert loading.load_model(model_dir, cache_dir=home, dtype="bfloat16").fingerprint != first.fingerprint
    assert len(hashed) == 3


def test_a_changed_file_is_hashed_again(model_dir, tmp_path, hashed):
    home = tmp_path / "home"
    first = loading.load_model(model_dir, cache_dir=home).fingerprint
    # Touched only: hashed again, to the same value.
    weights = model_dir / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert loading.load_model(model_dir, cache_dir=home).fingerprint == first
    assert len(hashed) == 2
    # Other weights in the same place: hashed again, to another value.
    make_model("llama", seed=1, layers=2).save_pretrained(model_dir)
    changed = loading.load_model(model_dir, cache_dir=home)
    assert len(hashed) == 3
    assert changed.fingerprint != first
    assert changed.fingerprint == model_fingerprint(changed.model, changed.tokenizer, torch.float32)


def test_a_damaged_fingerprint_record_is_ignored_with_a_warning(model_dir, tmp_path, hashed, caplog):
    home = tmp_path / "home"
    first = loading.load_model(model_dir, cache_dir=home).fingerprint
    (record,) = _records(home, "fingerprints")
    for damage in ("{not json", '{"key": {}, "fingerprint": "00"}', ""):
        record.write_text(damage)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert loading.load_model(model_dir, cache_dir=home).fingerprint == first
        assert "ignoring the damaged load cache record" in caplog.text
    assert len(hashed) == 4
    assert loading.load_model(model_dir, cache_dir=home).fingerprint == first  # rewritten whole
    assert len(hashed) == 4


@pytest.fixture
def checked(monkeypatch) -> dict[str, int]:
    """Counts the self-tests and the fast decode step's numerical checks that run."""
    calls = {"self_test": 0, "fast_decode_step": 0}
    real_test, real_check = core.self_test, FastDecodeStep._check

    def self_test(*args, **kwargs):
        calls["self_test"] += 1
        return real_test(*args, **kwargs)

    def check(self, *args, **kwargs):
        calls["fast_decode_step"] += 1
        return real_check(self, *args, **kwargs)

    monkeypatch.setattr(core, "self_test", self_test)
    monkeypatch.setattr(FastDecodeStep, "_check", check)
    return calls


def _engine(model, home, fingerprint="f" * 40) -> CacheBlendEngine:
    return CacheBlendEngine(model, make_tokenizer(), store=KVStore(None), fingerprint=fingerprint, checks_home=home)


def _answer(engine: CacheBlendEngine) -> str:
    try:
        return engine.generate(SAMPLE_QUESTION, SAMPLE_CHUNKS, max_new_tokens=4).text
    finally:
        engine.close()


def test_passed_checks_are_not_run_again_until_their_key_changes(tmp_path, checked, monkeypatch):
    home = tmp_path / "home"
    model = apply_weight_format(make_model("llama", layers=2), "fp16")
    first = _engine(model, home)
    assert checked == {"self_test": 1, "fast_decode_step": 1}
    assert first.fast_step is not None
    want = _answer(first)
    second = _engine(model, home)
    assert checked == {"self_test": 1, "fast_decode_step": 1}
    assert second.fast_step is not None and _answer(second) == want
    # Another model, or another thread count, is another key.
    _engine(model, home, fingerprint="e" * 40).close()
    assert checked == {"self_test": 2, "fast_decode_step": 2}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)
    _engine(model, home).close()
    assert checked == {"self_test": 3, "fast_decode_step": 3}
    # Without a cache home or a fingerprint, every load checks.
    CacheBlendEngine(model, make_tokenizer(), store=KVStore(None)).close()
    _engine(model, home, fingerprint=None).close()
    assert checked == {"self_test": 5, "fast_decode_step": 5}


def test_a_failed_check_is_never_remembered(tmp_path, monkeypatch):
    home = tmp_path / "home"
    model = make_model("llama", layers=2)
    runs = []

    def refuse(backbone):
        runs.append(1)
        raise UnsupportedModelError("refused by the test")

    monkeypatch.setattr(core, "self_test", refuse)
    for _ in range(2):
        with pytest.raises(UnsupportedModelError):
            _engine(model, home)
    assert len(runs) == 2 and not _records(home, "checks")
    monkeypatch.undo()
    # A fast step that differs: decoding falls back to the forward, and is checked on every load.
    steps = []

    def differs(self, *args, **kwargs):
        steps.append(1)
        return "differs (the test)"

    monkeypatch.setattr(FastDecodeStep, "_check", differs)
    for _ in range(2):
        engine = _engine(model, home)
        assert engine.fast_step is None
        engine.close()
    assert len(steps) == 2
    assert [p.name.split("-")[0] for p in _records(home, "checks")] == ["self_test"]


def test_a_damaged_check_record_is_ignored_with_a_warning(tmp_path, checked, caplog):
    home = tmp_path / "home"
    model = make_model("llama", layers=2)
    _engine(model, home).close()
    records = _records(home, "checks")
    assert len(records) == 2
    for damage in ("\x00\x01garbage", '{"key": "another", "verdict": "passed"}'):
        for record in records:
            record.write_text(damage)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            _engine(model, home).close()
        assert "ignoring the damaged load cache record" in caplog.text
    assert checked == {"self_test": 3, "fast_decode_step": 3}
    _engine(model, home).close()
    assert checked == {"self_test": 3, "fast_decode_step": 3}


def test_the_check_key_names_what_decides_the_verdict(tmp_path):
    model = make_model("llama", layers=2)
    key = PassedChecks(tmp_path, "f" * 40, model).key
    assert {"fingerprint", "torch", "transformers", "code", "cpu", "attention", "device", "dtype", "threads"} <= set(key)
    assert key["fingerprint"] == "f" * 40 and key["threads"] == torch.get_num_threads()


def test_from_pretrained_checks_and_hashes_once(model_dir, tmp_path, checked, hashed):
    home = tmp_path / "home"
    kw = dict(cache_dir=str(home), store_dir=str(tmp_path / "kv"))
    answers = []
    for _ in range(2):
        engine = CacheBlendEngine.from_pretrained(str(model_dir), **kw)
        answers.append(_answer(engine))
    assert answers[0] == answers[1]
    assert checked == {"self_test": 1, "fast_decode_step": 1} and len(hashed) == 1

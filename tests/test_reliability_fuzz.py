"""Property tests (hypothesis) extending tests/test_kv_record_fuzz.py:

* a stateful test of KVStore (put / get_layer / contains / discard / reopen, plus outside damage:
  corrupted, garbage, pickled and deleted records) against a plain dict model;
* the chunk meta record rejects every damaged byte;
* the text-to-chunk matching of the framework drop-ins (cacheblend_rag.chat.matching) equals a
  brute-force reference of its documented rules, and never loses or invents prompt text.
"""

from __future__ import annotations

import shutil
import tempfile

import diskcache
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cacheblend_rag.chat.matching import ChunkRegistry
from cacheblend_rag.store.disk import KVStore
from cacheblend_rag.store.keys import chunk_key
from cacheblend_rag.store.meta import ChunkMeta, decode_meta, encode_meta
from cacheblend_rag.store.record import CorruptRecordError

FP = "fuzz-fingerprint"
KEYS = [chunk_key(FP, [], [i]) for i in range(4)]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _layers(n: int, tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, tokens, 4, generator=g), torch.randn(2, tokens, 4, generator=g)) for _ in range(n)]


class _Pickled:
    def __reduce__(self):  # never executed: SafeDisk refuses pickles (see test_reliability_no_code)
        return (str, ("pickled",))


class StoreMachine(RuleBasedStateMachine):
    """The store behaves like a dict of published chunks; outside damage only ever turns into a
    miss (and drops the chunk), never into wrong tensors or an exception."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kv-fuzz-")
        self.store = KVStore(self.dir, fingerprint=FP)
        self.model: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.bad: dict[str, set[str]] = {}  # key -> damaged record names ("meta" or layer index)
        self.corrupt = 0  # expected store.stats.corrupt

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _drop(self, key: str) -> None:
        self.model.pop(key, None)
        self.bad.pop(key, None)

    @rule(key=st.sampled_from(KEYS), n=st.integers(1, 3), tokens=st.integers(0, 3), seed=st.integers(0, 9))
    def put(self, key, n, tokens, seed) -> None:
        layers = _layers(n, tokens, seed)
        if "meta" in self.bad.get(key, ()):
            # put() first checks contains(): that read finds the damaged meta and drops the chunk.
            self.corrupt += 1
            self._drop(key)
        assert self.store.put(key, layers) is True
        self.model.setdefault(key, layers)  # a present chunk is left untouched

    @rule(key=st.sampled_from(KEYS), layer=st.integers(0, 2))
    def get_layer(self, key, layer) -> None:
        want = self.model.get(key)
        bad = self.bad.get(key, set())
        if want is not None and "meta" not in bad and layer >= len(want):
            with pytest.raises(IndexError):
                self.store.get_layer(key, layer)
            return
        got = self.store.get_layer(key, layer)
        if want is None:
            assert got is None
        elif "meta" in bad or str(layer) in bad:  # damaged: a counted corruption, chunk dropped
            assert got is None
            self.corrupt += 1
            self._drop(key)
        elif f"gone{layer}" in bad:  # deleted (like an evicted record): a plain miss, chunk dropped
            assert got is None
            self._drop(key)
        else:
            assert got is not None
            assert torch.equal(got[0], want[layer][0]) and torch.equal(got[1], want[layer][1])

    @rule(key=st.sampled_from(KEYS))
    def contains(self, key) -> None:
        present = self.store.contains(key)
        if "meta" in self.bad.get(key, ()):
            assert not present
            self.corrupt += 1
            self._drop(key)
        else:
            assert present == (key in self.model)

    @rule(key=st.sampled_from(KEYS))
    def discard(self, key) -> None:
        if "meta" in self.bad.get(key, ()):
            self.corrupt += 1  # discard reads the meta first: the damage is found and counted
        self.store.discard(key)
        self._drop(key)
        assert not self.store.contains(key)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), how=st.sampled_from(["flip", "garbage", "str", "pickle", "delete", "truncate"]))
    def damage(self, data, how) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        n = len(self.model[key])
        which = data.draw(st.sampled_from(["meta", *map(str, range(n))]))
        name = f"{key}/{which}"
        if which in self.bad.get(key, ()):
            return  # damage once: a second flip of the same byte would repair the record
        with diskcache.Cache(self.dir) as raw:
            blob = raw.get(name)
            if not isinstance(blob, bytes):  # absent, or already replaced by a str/pickle
                return
            if how == "delete":
                raw.delete(name)
            else:
                bad = {
                    "flip": lambda: bytes(b ^ (0x41 if i == len(blob) // 2 else 0) for i, b in enumerate(blob)),
                    "garbage": lambda: b"\x00" * len(blob),
                    "str": lambda: "not bytes",
                    "pickle": lambda: _Pickled(),
                    "truncate": lambda: blob[: len(blob) - 1],
                }[how]()
                raw.set(name, bad, tag=key)
        if how == "delete" and which != "meta":
            self.bad.setdefault(key, set()).add(f"gone{which}")
        elif how == "delete":
            self._drop(key)  # no meta: the chunk is simply absent
        else:
            self.bad.setdefault(key, set()).add(which)

    @rule()
    def reopen(self) -> None:
        # Another handle (a restarted process) sees the same contents; stats start from zero.
        seen = self.store.stats.corrupt
        self.store.close()
        self.store = KVStore(self.dir, fingerprint=FP)
        self.corrupt -= seen

    @invariant()
    def corruption_is_counted(self) -> None:
        assert self.store.stats.corrupt == self.corrupt
        assert self.store.stats.write_errors == 0


StoreMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVStoreAgainstDictModel = StoreMachine.TestCase


# ------------------------------------------------------------------ meta record


@FAST
@given(
    tokens=st.integers(0, 2**32 - 1),
    layers=st.integers(1, 2**32 - 1),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    data=st.data(),
)
def test_meta_round_trips_and_rejects_every_damaged_byte(tokens, layers, dtype, data) -> None:
    meta = ChunkMeta(num_tokens=tokens, num_layers=layers, dtype=dtype)
    blob = encode_meta(meta)
    assert decode_meta(blob) == meta
    i = data.draw(st.integers(0, len(blob) - 1))
    x = data.draw(st.integers(1, 255))
    bad = bytearray(blob)
    bad[i] ^= x
    with pytest.raises(CorruptRecordError):
        decode_meta(bytes(bad))
    with pytest.raises(CorruptRecordError):
        decode_meta(blob[: data.draw(st.integers(0, len(blob) - 1))])


@FAST
@given(st.one_of(st.binary(max_size=64), st.text(max_size=20), st.integers(), st.none()))
def test_meta_decoder_only_raises_corrupt_record_error(junk) -> None:
    try:
        decode_meta(junk)
    except CorruptRecordError:
        pass


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kv=st.integers(0, 9), other=st.text(min_size=1, max_size=10))
def test_a_valid_record_of_another_fingerprint_is_refused_by_the_store(tmp_path_factory, kv, other) -> None:
    assume(other != FP)
    d = tmp_path_factory.mktemp("fp")
    key = KEYS[0]
    with KVStore(d, fingerprint=other) as theirs:
        assert theirs.put(key, _layers(1, 2, kv))
    with KVStore(d, fingerprint=FP) as ours:
        assert ours.get_layer(key, 0) is None and ours.stats.corrupt == 1
        assert not ours.contains(key)


# ------------------------------------------------------------------ text-to-chunk matching

# A tiny alphabet makes chunks collide, nest and touch word boundaries often.
WORDS = st.text(alphabet="ab -\n.", min_size=1, max_size=8)


def reference_find(prompt: str, chunks: list[str]) -> list[tuple[int, int, str]]:
    """The documented rules, brute force: stripped keys, leftmost, longest at a position, no
    overlap, no span that starts or ends inside a word."""
    keys = sorted({c.strip() for c in chunks if c.strip()}, key=len, reverse=True)
    out, i = [], 0
    while i < len(prompt):
        hit = None
        if not (i > 0 and prompt[i].isalnum() and prompt[i - 1].isalnum()):
            for k in keys:
                end = i + len(k)
                if prompt.startswith(k, i) and (end >= len(prompt) or not (k[-1].isalnum() and prompt[end].isalnum())):
                    hit = k
                    break
        if hit is None:
            i += 1
        else:
            out.append((i, i + len(hit), hit))
            i += len(hit)
    return out


@FAST
@given(chunks=st.lists(WORDS, max_size=6), prompt=st.text(alphabet="ab -\n.x", max_size=60), k=st.integers(1, 6))
def test_find_equals_the_brute_force_reference(chunks, prompt, k) -> None:
    reg = ChunkRegistry(chunks, prefix_chars=k)
    spans = reg.find(prompt)
    assert [(s.start, s.end, s.key) for s in spans] == reference_find(prompt, chunks)
    for s in spans:
        assert prompt[s.start : s.end] == s.key and s.text.strip() == s.key and s.text in chunks


@FAST
@given(chunks=st.lists(WORDS, max_size=6), prompt=st.text(max_size=80))
def test_match_never_loses_or_invents_text(chunks, prompt) -> None:
    m = ChunkRegistry(chunks).match(prompt + " ".join(chunks))
    text = prompt + " ".join(chunks)
    rebuilt = m.outside[0] + "".join(s.key + out for s, out in zip(m.spans, m.outside[1:]))
    assert rebuilt == text
    assert len(m.outside) == len(m.spans) + 1


@FAST
@given(
    chunks=st.lists(st.text(alphabet="abcdefgh .,", min_size=1, max_size=40), min_size=1, max_size=5, unique=True),
    head=st.sampled_from(["", "Context:\n", "Use these documents.\n\n"]),
    sep=st.sampled_from(["\n\n", "\n", "\n---\n"]),
    tail=st.sampled_from(["", "\n\nQuestion: who?", "\nAnswer:"]),
)
def test_chunks_joined_by_a_template_are_found_again_in_order(chunks, head, sep, tail) -> None:
    keys = [c.strip() for c in chunks]
    prompt = head + sep.join(keys) + tail
    # Only unambiguous prompts: each chunk occurs exactly once (not inside another or the template).
    assume(all(k and prompt.count(k) == 1 for k in keys) and len(set(keys)) == len(keys))
    assert ChunkRegistry(chunks).match(prompt).chunks == chunks

"""Reliability round three (issue 38): a server that one request cannot stall, memory that bad input
cannot grow, stores that planted data cannot turn into wrong answers. One test (or more) per attack;
docs/reliability.md maps each attack to its test here."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheblend_rag.config import SamplingParams
from cacheblend_rag.generation import Decoder


# ------------------------------------------------------------------ 1. stop strings
def _reference_stop(text: str, stops: tuple[str, ...]) -> tuple[int, int]:
    """The documented rule, brute force: the earliest start of any stop in ``text``, and the
    longest end of ``text`` that is a proper prefix of a stop (1 for a trailing U+FFFD)."""
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return cut, hold


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="ab\ufffd", min_size=1, max_size=5), min_size=1, max_size=5),
    pieces=st.lists(st.text(alphabet="abc\ufffd", max_size=4), min_size=1, max_size=12),
    rewrite=st.integers(min_value=0, max_value=3),
)
def test_stop_matcher_equals_the_brute_force_rule(stops, pieces, rewrite):
    """The automaton finds the same stop and holds back the same text as checking every stop
    against the whole text, also when the detokenized text changes before its end."""
    from cacheblend_rag.generation import StopMatcher

    matcher, text = StopMatcher(tuple(stops)), ""
    for i, piece in enumerate(pieces):
        if rewrite and i % 3 == 2 and text:
            text = text[: max(0, len(text) - rewrite)] + "c"  # a rewritten tail
        text += piece
        want, got = _reference_stop(text, tuple(stops)), matcher.feed(text)
        if want[0] >= 0:  # a stop: the answer ends there, nothing is held back
            assert got[0] == want[0], (text, stops)
            break
        assert got == want, (text, stops)


class _CharTokenizer:
    """One token per character of a fixed alphabet; decode joins them (what the Decoder needs)."""

    alphabet = "abcdefgh xyz."

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i] for i in ids)


def _calls_per_token(stops: list[str], tokens: list[int]) -> float:
    """Python and C function calls made by the Decoder per accepted token (after it is built)."""
    dec = Decoder(_CharTokenizer(), set(), SamplingParams(max_new_tokens=len(tokens) + 1, stop=stops))
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        for t in tokens:
            dec.accept(t)
    finally:
        sys.setprofile(None)
    assert not dec.done
    return calls / len(tokens)


def test_stop_check_cost_per_token_does_not_grow_with_the_stops():
    """Attack 1: many long stop strings made every token cost (stops x length); one request held
    the only worker for 101 s. The work per token must not grow with the stops' number or length."""
    tokens = [0, 1, 2, 8, 3, 4, 5, 8] * 8  # "abc defg " repeated: never a stop
    few = ["xyz" + "a" * 60 for _ in range(4)]
    many = ["xyz" + chr(0x4E00 + i) + "b" * 600 for i in range(400)]  # 100x the stops' total length
    per_token_few, per_token_many = _calls_per_token(few, tokens), _calls_per_token(many, tokens)
    assert per_token_many <= per_token_few + 2, (per_token_few, per_token_many)


def test_decoder_still_stops_and_streams_like_before():
    """The stop string is cut off, text that could grow into one is held back, not lost."""
    tok = _CharTokenizer()
    ids = [tok.alphabet.index(c) for c in "ab xyz. a"]
    dec = Decoder(tok, set(), SamplingParams(max_new_tokens=50, stop=["z.", "zz"]))
    out = []
    for t in ids:
        out.append(dec.accept(t))
        if dec.done:
            break
    assert "".join(out) == "ab xy" and dec.text == "ab xy" and dec.finish_reason == "stop"
    assert out[:6] == ["a", "b", " ", "x", "y", ""]  # "z" is held back: it could grow into "z." or "zz"

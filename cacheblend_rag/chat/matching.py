"""Find known chunks inside an already formatted prompt.

Framework integrations receive prompts that a template has already flattened into one string
(``"\\n\\n".join(doc.page_content for doc in docs)`` inside ``"Context: {context} Question: ..."``).
To reuse per-chunk KV caches we need the chunks back: :class:`ChunkRegistry` remembers the texts
a retriever returned (or that were precomputed) and :meth:`ChunkRegistry.find` locates them in a
prompt, without any separator convention.

Matching rules:

* chunks are matched on their ``.strip()``-ped text, because templates and ``format_docs``
  helpers commonly strip or re-join surrounding whitespace;
* the scan is leftmost first, and at one position the longest known chunk wins, so a chunk that
  is a substring of another never splits it; spans never overlap;
* a match must not cut through a word: if the text just before (after) a span and the chunk's
  first (last) character are both alphanumeric, it is not a match ("Paris" inside "Parisian");
* the same chunk may match several times; every occurrence is reported.

Size: a registry holds at most ``max_chunks`` texts (100,000 by default) and evicts the least
recently used one beyond that; registering a text again or finding it in a prompt counts as a use.
An evicted chunk is simply not found any more (its KV stays in the engine's store): wrappers that
register what they retrieve make it known again the next time it is retrieved.

Cost: chunks are indexed by their first ``prefix_chars`` characters (shorter chunks by their full
text, grouped by length), so a scan costs one dict lookup per prompt position and short-chunk
length, plus one ``startswith`` per candidate, independent of how many chunks are registered.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_PREFIX_CHARS = 32
DEFAULT_MAX_CHUNKS = 100_000


@dataclass(frozen=True)
class ChunkSpan:
    """One occurrence of a known chunk: ``prompt[start:end] == key``.

    ``text`` is the chunk as it was registered (possibly with surrounding whitespace); pass that
    to the engine so the cache key matches what was precomputed.
    """

    start: int
    end: int
    key: str
    text: str


@dataclass(frozen=True)
class PromptMatch:
    """A prompt split into its known chunks and the text around them."""

    spans: tuple[ChunkSpan, ...]
    outside: tuple[str, ...]  # len(spans) + 1 pieces: before the first chunk, between, after the last

    @property
    def chunks(self) -> list[str]:
        """The matched chunks, in prompt order (registered text; repeats kept)."""
        return [s.text for s in self.spans]

    def remainder(self, joiner: str = "\n\n") -> str:
        """The prompt with the chunk texts removed: non-blank outside pieces, stripped, joined."""
        return joiner.join(p.strip() for p in self.outside if p.strip())


class ChunkRegistry:
    """A thread-safe set of known chunk texts with a fast in-prompt finder.

    ``ChunkRegistry.for_engine(engine)`` returns one registry per engine, so a retriever wrapper
    of one framework and a model wrapper of another see the same chunks.
    """

    _per_engine: weakref.WeakKeyDictionary[object, ChunkRegistry] = weakref.WeakKeyDictionary()
    _per_engine_lock = threading.Lock()

    def __init__(
        self, texts: Iterable[str] = (), *, prefix_chars: int = DEFAULT_PREFIX_CHARS, max_chunks: int | None = DEFAULT_MAX_CHUNKS
    ):
        if prefix_chars < 1:
            raise ValueError(f"prefix_chars={prefix_chars} must be >= 1")
        if max_chunks is not None and (not isinstance(max_chunks, int) or max_chunks < 1):
            raise ValueError(f"max_chunks={max_chunks!r} must be an int >= 1, or None for no bound")
        self.prefix_chars = prefix_chars
        self.max_chunks = max_chunks
        self.evicted = 0  # texts dropped so far to stay within max_chunks
        # stripped key -> registered text (first wins); ordered from least to most recently used.
        # A plain dict, not cachetools: its eviction must also update the two indexes below, and
        # texts() reports recency order, which cachetools' LRUCache does not iterate in.
        self._texts: dict[str, str] = {}
        self._long: dict[str, list[str]] = {}  # first prefix_chars chars -> keys, longest first
        self._short: dict[int, set[str]] = {}  # length (< prefix_chars) -> keys
        self._lock = threading.Lock()
        self.add(texts)

    @classmethod
    def for_engine(cls, engine: object) -> ChunkRegistry:
        """The registry shared by everything that uses ``engine`` (created on first use)."""
        with cls._per_engine_lock:
            reg = cls._per_engine.get(engine)
            if reg is None:
                reg = cls._per_engine[engine] = cls()
            return reg

    def add(self, texts: Iterable[str]) -> int:
        """Register chunk texts (blank ones are ignored). Returns how many were new.

        A text already known counts as recently used; beyond ``max_chunks`` the least recently
        used texts are evicted.
        """
        if isinstance(texts, str):
            raise TypeError("add takes a list of chunk texts, got a single str; wrap it as [text]")
        new = 0
        with self._lock:
            for text in texts:
                if not isinstance(text, str):
                    raise TypeError(f"chunk texts must be str, got {type(text).__name__}")
                key = text.strip()
                if not key:
                    continue
                if key in self._texts:
                    self._texts[key] = self._texts.pop(key)  # most recently used
                    continue
                self._texts[key] = text
                new += 1
                if len(key) >= self.prefix_chars:
                    bucket = self._long.setdefault(key[: self.prefix_chars], [])
                    bucket.append(key)
                    bucket.sort(key=len, reverse=True)
                else:
                    self._short.setdefault(len(key), set()).add(key)
                if self.max_chunks is not None and len(self._texts) > self.max_chunks:
                    self._evict(next(iter(self._texts)))
        return new

    def _evict(self, key: str) -> None:
        del self._texts[key]
        self.evicted += 1
        if len(key) >= self.prefix_chars:
            bucket = self._long[key[: self.prefix_chars]]
            bucket.remove(key)
            if not bucket:
                del self._long[key[: self.prefix_chars]]
        else:
            group = self._short[len(key)]
            group.discard(key)
            if not group:
                del self._short[len(key)]

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and text.strip() in self._texts

    def __len__(self) -> int:
        return len(self._texts)

    def texts(self) -> list[str]:
        """Registered texts, least recently used first."""
        with self._lock:
            return list(self._texts.values())

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()
            self._long.clear()
            self._short.clear()

    # ------------------------------------------------------------------ finding
    def find(self, prompt: str) -> list[ChunkSpan]:
        """Ordered, non-overlapping spans of known chunks in ``prompt`` (leftmost, then longest)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        with self._lock:
            if not self._texts:
                return []
            long_index, texts, k = self._long, self._texts, self.prefix_chars
            short_lengths = sorted(self._short, reverse=True)  # longest first
            short = {n: frozenset(self._short[n]) for n in short_lengths}
            spans: list[ChunkSpan] = []
            i, n = 0, len(prompt)
            while i < n:
                key = self._match_at(prompt, i, long_index, k, short_lengths, short)
                if key is None:
                    i += 1
                    continue
                spans.append(ChunkSpan(i, i + len(key), key, texts[key]))
                i += len(key)
            for span in spans:  # found chunks are the most recently used
                texts[span.key] = texts.pop(span.key)
            return spans

    @staticmethod
    def _match_at(prompt, i, long_index, k, short_lengths, short) -> str | None:
        # A chunk starting with a word character cannot start in the middle of a word.
        if i > 0 and prompt[i].isalnum() and prompt[i - 1].isalnum():
            return None
        for key in long_index.get(prompt[i : i + k], ()):
            if prompt.startswith(key, i) and _ends_cleanly(prompt, i + len(key), key):
                return key
        for length in short_lengths:
            piece = prompt[i : i + length]
            if len(piece) == length and piece in short[length] and _ends_cleanly(prompt, i + length, piece):
                return piece
        return None

    def match(self, prompt: str) -> PromptMatch:
        """Split ``prompt`` into known chunks and the text around them."""
        spans = self.find(prompt)
        outside, pos = [], 0
        for s in spans:
            outside.append(prompt[pos : s.start])
            pos = s.end
        outside.append(prompt[pos:])
        return PromptMatch(tuple(spans), tuple(outside))


def _ends_cleanly(prompt: str, end: int, key: str) -> bool:
    return end >= len(prompt) or not (key[-1].isalnum() and prompt[end].isalnum())

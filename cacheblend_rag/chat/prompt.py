"""Prompt layout: the instruction prefix, the chunks and the question as separately tokenized segments.

Every mode tokenizes the same segments the same way, so full prefill, prefix caching, full reuse and
CacheBlend are compared on identical token ids. A chunk's tokens never depend on its neighbours,
which is what lets its KV be cached once and reused anywhere.

Chunks and the question are untrusted text (a retrieved web page can contain anything), so they are
tokenized with ``split_special_tokens=True``: a literal ``<|im_end|>`` or ``<|im_start|>system`` in a
document becomes the ordinary tokens of those characters and can never close the user turn or open
a forged system turn. Only the chat template and the engine's instruction (trusted, set by the
application) are tokenized with their special tokens.
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from cachetools import LRUCache

from cacheblend_rag.chat.template_text import Marks, control_tokens
from cacheblend_rag.chat.tools import ToolsUnsupported, check_turns, normalize_tools, render, require_tool_support, tools_key

DEFAULT_INSTRUCTION = (
    "You are a helpful assistant. Answer the question using the documents the user gives. "
    "Reply with a short answer of a few words, without explanation."
)
# An optional line after the question (``answer_hint``) that restates the instruction's answer format.
# The instruction sits thousands of tokens earlier, behind the chunks, and small readers ignore it
# there: Qwen2.5-Coder-0.5B answered many HotpotQA questions with a 16-token sentence echoing the
# question until this hint followed the question. Off by default: on the dev questions measured it
# shortened the answers without raising their F1, and every published measurement is without it
# (docs/quality.md).
SHORT_ANSWER_HINT = "Answer with the answer only, no other words."
CHUNK_SEPARATOR = "\n\n"
_SENTINEL = "\x00CACHEBLEND_USER_CONTENT\x00"
MAX_TOOL_SETS = 16  # tool sets whose prompt builders one engine keeps


def _turn_marker(i: int) -> str:
    return f"\x00CACHEBLEND_TURN_{i}\x00"


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens. ``reusable`` segments are chunks whose KV may come from the store."""

    text: str
    token_ids: tuple[int, ...]
    reusable: bool

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class PromptLayout:
    segments: tuple[Segment, ...]

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def __len__(self) -> int:
        return sum(len(s) for s in self.segments)

    def offsets(self) -> list[int]:
        out, pos = [], 0
        for s in self.segments:
            out.append(pos)
            pos += len(s)
        return out

    @property
    def num_context_tokens(self) -> int:
        return sum(len(s) for s in self.segments if s.reusable)

    @property
    def prefix_ids(self) -> tuple[int, ...]:
        """The instruction prefix the chunks are cached behind: the first segment's tokens (the
        template's head, with the tools a request renders into it); none when it is a chunk."""
        first = self.segments[0] if self.segments else None
        return () if first is None or first.reusable else first.token_ids


def validate_question(question: object) -> str:
    if not isinstance(question, str):
        raise TypeError(f"question must be a str, got {type(question).__name__}")
    if not question.strip():
        raise ValueError("question is empty: pass the user's question as a non-empty string")
    return question


def normalize_chunks(chunks: object) -> list[str]:
    """Validate retrieved chunks; exact duplicates are dropped (first occurrence kept).

    A duplicated chunk adds no information and would only double its tokens' attention mass.
    """
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Sequence):
        raise TypeError(
            "chunks must be a list of strings (the retrieved passages), got "
            f"{type(chunks).__name__}; wrap a single passage as [text]"
        )
    if len(chunks) == 0:
        raise ValueError("no chunks given: CacheBlend answers over retrieved chunks; pass at least one")
    seen: dict[str, None] = {}
    for i, c in enumerate(chunks):
        if not isinstance(c, str):
            raise TypeError(f"chunk {i} is a {type(c).__name__}, not a str: pass the passage text")
        if not c.strip():
            raise ValueError(f"chunk {i} is empty or whitespace: drop it before asking")
        seen.setdefault(c, None)
    return list(seen)


def check_texts(texts: object, what: str = "chunk") -> list[str]:
    """The chunk texts given to ``precompute`` (``what="corpus"``: its ``corpus=``): a list of
    non-empty, valid Unicode strings."""
    takes = "precompute" if what == "chunk" else f"precompute's {what}="
    if isinstance(texts, (str, bytes)):
        raise TypeError(f"{takes} takes a list of chunk texts, got a single {type(texts).__name__}; wrap it as [text]")
    # A dict would silently iterate its keys; a non-iterable would fail with a bare Python message.
    if isinstance(texts, Mapping) or not isinstance(texts, Iterable):
        raise TypeError(f"{takes} takes a list of chunk texts (str), got {type(texts).__name__}")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise TypeError(f"{what} {i} is a {type(t).__name__}, not a str: pass the passage text")
        if not t.strip():
            raise ValueError(f"{what} {i} is empty or whitespace: drop it before precomputing")
    check_unicode(named_chunks(out, what))
    return out


def named_chunks(chunks: Sequence[object], what: str = "chunk") -> Iterator[tuple[str, object]]:
    return ((f"{what} {i}", c) for i, c in enumerate(chunks))


def check_unicode(texts: Iterable[tuple[str, object]]) -> None:
    """Reject lone surrogates (e.g. bytes decoded with errors="surrogateescape"): the tokenizer
    cannot encode them and would fail deep inside its Rust binding with an opaque message."""
    for what, text in texts:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"{what} is not valid Unicode text ({exc.reason} at character {exc.start}): "
                    "decode documents with errors='replace' (or strip lone surrogates) first"
                ) from None


class TokenCache:
    """Least-recently-used chunk text -> token ids, bounded by the bytes it holds.

    Chunk texts come from requests, and a request may be refused after its chunks are tokenized
    (a chunk longer than the context window). Bounded by entries alone (65,536 of them, each as
    long as a client likes), 60 refused 1 MB documents grew a server by 1.1 GB. Here the whole
    cache holds at most ``max_bytes`` (text and ids, estimated), and an entry larger than
    ``max_bytes // 64`` is never kept: a chunk that long is refused or rare, and re-tokenizing it
    costs little next to its prefill.
    """

    def __init__(self, max_bytes: int = 64 * 2**20):
        self.max_bytes = max_bytes
        # cachetools' byte-bounded LRU: text -> (ids, bytes); not thread-safe by itself.
        self._entries: LRUCache[str, tuple[tuple[int, ...], int]] = LRUCache(max_bytes, getsizeof=lambda entry: entry[1])
        self._lock = threading.Lock()  # requests tokenize from several threads

    @staticmethod
    def entry_bytes(text: str, ids: tuple[int, ...]) -> int:
        # The str, the tuple and one int object per id (small ints are shared; counting them
        # anyway errs on the side of a smaller cache).
        return sys.getsizeof(text) + sys.getsizeof(ids) + 32 * len(ids)

    @property
    def bytes(self) -> int:
        return int(self._entries.currsize)

    def get(self, text: str) -> tuple[int, ...] | None:
        with self._lock:
            hit = self._entries.get(text)  # a hit counts as a use
            return None if hit is None else hit[0]

    def put(self, text: str, ids: tuple[int, ...]) -> None:
        size = self.entry_bytes(text, ids)
        if size > self.max_bytes // 64:
            return
        with self._lock:
            if text not in self._entries:
                self._entries[text] = (ids, size)  # evicts the least recently used to fit

    def __len__(self) -> int:
        return len(self._entries)


def _text_only(tokenizer):
    """A private copy of ``tokenizer`` that reads special-token strings as plain text.

    transformers implements ``split_special_tokens=True`` by setting a flag on the Rust tokenizer
    it shares with every other call, and the next call without it sets it back: two threads (one
    tokenizing a document, one the template) would each get the other's setting. A copy whose
    default is split never changes the shared tokenizer.
    """
    tok = copy.deepcopy(tokenizer)
    tok.split_special_tokens = True
    return tok


class PromptBuilder:
    """Splits the model's chat template around the user content.

    Layout: [system + user header] [chunk 1] ... [chunk n] [question + assistant header].
    Chunks are cached behind the exact same header (``prefix_ids``), so the first chunk's cached
    KV equals what a full prefill computes.

    With ``tools`` (:meth:`for_tools`) the template renders them where it puts them (Qwen2.5: in
    the system turn), so the header, and with it the key of every chunk cached behind it, is that
    tool set's own. A request's ``turns`` (messages after the question's turn: the assistant's tool
    calls and the tools' results) are rendered by the template after the question.
    """

    def __init__(
        self,
        tokenizer,
        instruction: str = DEFAULT_INSTRUCTION,
        separator: str = CHUNK_SEPARATOR,
        answer_hint: str = "",
        tools: Sequence[Mapping[str, object]] = (),
    ):
        self.tokenizer = tokenizer
        self._text_tokenizer = _text_only(tokenizer)
        self.instruction = instruction
        if not isinstance(answer_hint, str):
            raise TypeError(f'answer_hint must be a str ("" for none), got {type(answer_hint).__name__}')
        self.answer_hint = answer_hint.strip()
        self.separator = separator
        self.token_cache = TokenCache()
        self._variants: LRUCache[str, PromptBuilder] = LRUCache(MAX_TOOL_SETS)  # tool set -> its builder
        self._variants_lock = threading.Lock()
        self._set_tools(normalize_tools(tools))

    def _set_tools(self, tools: tuple[dict, ...]) -> None:
        if tools:
            require_tool_support(self.tokenizer, "rendering tools")
        self.tools = tools
        head, tail = self._split_template()
        self._head = head
        self.prefix_text = head + "Documents:\n"
        self.tail_text = tail
        self.prefix_ids: tuple[int, ...] = self._prefix_ids(tools)

    def _prefix_ids(self, tools: tuple[dict, ...]) -> tuple[int, ...]:
        """The prefix's tokens, the tools' strings that hold a control-token string as text
        (``template_text.py``); without such strings, the prefix tokenized whole, as always."""
        marks = Marks(control_tokens(self.tokenizer))
        marks.check_keys(tools, "the tools")
        marked = marks.strings(tools)
        if not marks.structured:
            return self.encode(self.prefix_text)
        head, tail = self._split_template(marked)
        parts = marks.split(head + "Documents:\n", self.prefix_text)
        if parts is None or marks.found(tail):
            raise marks.refusal("the tools' names, descriptions or parameters")
        return self._encode_parts(parts)

    def _encode_parts(self, parts: Sequence[tuple[str, bool]]) -> tuple[int, ...]:
        """(text, is_request_text) parts tokenized: the template's with its control tokens, the request's as text."""
        return tuple(t for p, is_text in parts for t in (self.encode_text(p) if is_text else self.encode(p)))

    def for_tools(self, tools: Sequence[Mapping[str, object]] | None) -> PromptBuilder:
        """This builder with ``tools`` rendered into the template (itself when they are its own).
        Shares the tokenizers and the chunk token cache (a chunk's tokens do not depend on the
        tools); the last ``MAX_TOOL_SETS`` tool sets' builders are kept."""
        tools = normalize_tools(tools)
        if tools == self.tools:
            return self
        key = tools_key(tools)
        with self._variants_lock:
            builder = self._variants.get(key)
            if builder is None:
                builder = copy.copy(self)
                builder._variants, builder._variants_lock = LRUCache(MAX_TOOL_SETS), threading.Lock()
                builder._set_tools(tools)
                self._variants[key] = builder
            return builder

    def _messages(self, content: str, turns: Sequence[Mapping[str, object]] = ()) -> list[list[dict]]:
        """The conversations to render, in order of preference: the instruction as a system turn,
        or inside the user turn for templates without a system role."""
        return [
            [{"role": "system", "content": self.instruction}, {"role": "user", "content": content}, *turns],
            [{"role": "user", "content": self.instruction + "\n\n" + content}, *turns],
        ]

    def _split_template(self, tools: Sequence[Mapping[str, object]] | None = None) -> tuple[str, str]:
        """The template's text before and after the user content, with ``tools`` (default: this
        builder's) rendered."""
        tok = self.tokenizer
        tools = self.tools if tools is None else tools
        if getattr(tok, "chat_template", None):
            for messages in self._messages(_SENTINEL):
                try:
                    text = render(tok, messages, tools)
                except Exception:  # noqa: BLE001 - a template that rejects the system role
                    continue
                if isinstance(text, str) and text.count(_SENTINEL) == 1:
                    head, tail = text.split(_SENTINEL)
                    return head, tail
        if self.tools:
            raise ToolsUnsupported("the chat template did not render the instruction and the tools around the user turn")
        return self.instruction + "\n\n", "\nAnswer:"

    def _turns_tail(self, turns: Sequence[Mapping[str, object]]) -> list[tuple[str, bool]]:
        """The text after the question for a conversation that goes on with ``turns``, as (text,
        is_message_text) parts: the template's own text tokenized with its control tokens, the
        turns' contents (a tool's result is untrusted text) as text."""
        turns = [dict(t) for t in turns]
        check_turns(turns)
        marks = Marks(control_tokens(self.tokenizer))
        calls = [dict(t, tool_calls=marks.strings(t["tool_calls"])) if t.get("tool_calls") else t for t in turns]
        for i, t in enumerate(turns):
            marks.check_keys(t.get("tool_calls") or (), f"turn {i}'s tool calls")
        if marks.structured:
            return self._marked_turns_tail(turns, calls, marks)
        marked = [dict(t, content=_turn_marker(i)) if t.get("content") else t for i, t in enumerate(turns)]
        for text, real in self._render_turns(turns, marked):
            if not isinstance(text, str) or text.count(_SENTINEL) != 1:
                continue
            tail = self._tail_of(text)
            parts: list[tuple[str, bool]] = []
            for i, t in enumerate(turns):
                if not t.get("content"):
                    continue
                before, sep, tail = tail.partition(_turn_marker(i))
                if not sep or _turn_marker(i) in tail:
                    break
                parts += [(before, False), (str(t["content"]), True)]
            else:
                parts.append((tail, False))
                if real.split(_SENTINEL)[1] == "".join(p for p, _ in parts):
                    return [(p, c) for p, c in parts if p]
            # The template changes the turns' text: keep its rendering, tokenized as template text.
            return [(real.split(_SENTINEL)[1], False)]
        raise ValueError("the chat template cannot render the conversation's later turns")

    def _marked_turns_tail(self, turns: list[dict], calls: list[dict], marks: Marks) -> list[tuple[str, bool]]:
        """``_turns_tail`` for turns whose tool calls hold control-token strings: the contents and
        those strings as text, or refused where the template changes them."""
        marked = [dict(t, content=marks.text(str(t["content"]))) if t.get("content") else t for t in calls]
        for text, real in self._render_turns(turns, marked):
            if not isinstance(text, str) or not isinstance(real, str) or text.count(_SENTINEL) != 1 or real.count(_SENTINEL) != 1:
                continue
            parts = marks.split(self._tail_of(text), real.split(_SENTINEL)[1])
            if parts is None:
                raise marks.refusal("the tool calls' names or arguments")
            return parts
        raise ValueError("the chat template cannot render the conversation's later turns")

    def _render_turns(self, turns: list[dict], marked: list[dict]) -> Iterator[tuple[object, object]]:
        """(conversation with ``marked`` turns, conversation with ``turns``) as the template renders
        them, for each way ``_messages`` places the instruction that the template accepts."""
        for plain, with_markers in zip(self._messages(_SENTINEL, turns), self._messages(_SENTINEL, marked)):
            try:
                text = render(self.tokenizer, with_markers, self.tools)
                real = render(self.tokenizer, plain, self.tools)
            except Exception:  # noqa: BLE001 - a template that rejects the system role
                continue
            yield text, real

    def _tail_of(self, text: str) -> str:
        """What a rendered conversation holds after the question; refused where its start is not
        the one the chunks were cached behind."""
        head, tail = text.split(_SENTINEL)
        if head != self._head:
            raise ValueError(
                "the chat template renders the conversation's start differently when turns follow: "
                "pass the conversation without chunks (a plain chat)"
            )
        return tail

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of trusted prompt text (template, instruction): special tokens allowed."""
        # The template renders a request's tools and tool calls into this text: check it too.
        check_unicode([("the prompt (its template text: tools, tool calls)", text)])
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_text(self, text: str) -> tuple[int, ...]:
        """Token ids of untrusted text (chunks, question, messages): special-token strings stay text."""
        # Chunks and questions are checked with their names before; a plain chat's messages are not.
        check_unicode([("the prompt (a message's text)", text)])
        return tuple(self._text_tokenizer(text, add_special_tokens=False)["input_ids"])

    def _chunk_ids(self, text: str) -> tuple[int, ...]:
        ids = self.token_cache.get(text)
        if ids is None:
            ids = self.encode_text(text + self.separator)
            self.token_cache.put(text, ids)
        return ids

    def chunk_segment(self, text: str) -> Segment:
        return Segment(text, self._chunk_ids(text), reusable=True)

    def _question_body(self, question: str) -> str:
        body = f"Question: {question.strip()}"
        return f"{body}\n{self.answer_hint}" if self.answer_hint else body

    def question_text(self, question: str) -> str:
        return self._question_body(question) + self.tail_text

    def question_segment(self, question: str, turns: Sequence[Mapping[str, object]] = ()) -> Segment:
        # The user's words as text, the template tail (which closes the turn) with its specials.
        body = self._question_body(question)
        if not turns:
            return Segment(body + self.tail_text, self.encode_text(body) + self.encode(self.tail_text), reusable=False)
        parts = self._turns_tail(turns)
        ids = self.encode_text(body) + tuple(t for p, text in parts for t in (self.encode_text(p) if text else self.encode(p)))
        return Segment(body + "".join(p for p, _ in parts), ids, reusable=False)

    def build(self, question: str, chunks: Sequence[str], turns: Sequence[Mapping[str, object]] = ()) -> PromptLayout:
        """The layout of ``question`` over ``chunks``; ``turns`` (chat messages after the question's
        turn) are rendered by the template after it."""
        question = validate_question(question)
        chunks = normalize_chunks(chunks)
        return PromptLayout(
            (Segment(self.prefix_text, self.prefix_ids, reusable=False),)
            + tuple(self.chunk_segment(c) for c in chunks)
            + (self.question_segment(question, turns),)
        )

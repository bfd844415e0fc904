"""Constrained decoding: the tokens a grammar allows next, applied to the logits before a token is chosen.

A :class:`Grammar` (a JSON schema, a Lark grammar or a regex; frozen, so it can sit in
``SamplingParams``) is compiled lazily by `llguidance <https://github.com/guidance-ai/llguidance>`_
for the tokenizer that decodes with it; each answer gets its own :class:`Matcher`, which masks the
next-token logits to the tokens that keep the output inside the grammar and advances on each
accepted token. Where the grammar is complete only end-of-sequence is allowed, so a constrained
answer that ends by itself always parses (one cut by ``max_new_tokens`` or a stop string does not).

llguidance was chosen over xgrammar and outlines-core by measurement (docs/results/grammar_libs.jsonl,
``python3 -m cacheblend_bench.grammar_libs``): no compile step worth the name for a JSON schema,
tens of microseconds per token on a 151k vocabulary, one 8 MB wheel with no dependencies, and Lark
grammars that embed JSON schemas (a tool call is ``<tool_call>`` + the call's JSON + ``</tool_call>``).
It is an optional extra: ``pip install 'cacheblend-rag[structured]'``.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cacheblend_rag.bounds import check_json

INSTALL_HINT = "pip install 'cacheblend-rag[structured]' (or: pip install llguidance)"
KINDS = ("json_schema", "lark", "regex")
# One line, json.dumps's separators: what models write, and no whitespace runs (a small model left
# free to add whitespace can fill its token budget with newlines).
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A token's additive bias: 0 where allowed, -inf where not (indexed by the token's bit).
# Shown after the question of a request constrained to a schema (schema_constraint).
SCHEMA_HINT = "Answer with a JSON object that matches this JSON schema:\n{schema}"
_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    """The ``[vocab]`` 0/1 (uint8) array of a token bitmask: int32 words, token ``32 * w + i`` is
    bit ``i`` of word ``w``, the layout llguidance, xgrammar and outlines-core share. Tokens past
    the bitmask's end (a model whose logits are wider than its tokenizer) are not allowed."""
    words = np.ascontiguousarray(bitmask.detach().cpu().numpy().astype(np.int32, copy=False).reshape(-1))
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")  # int32 words are little-endian here
    if bits.size < vocab:
        bits = np.concatenate([bits, np.zeros(vocab - bits.size, np.uint8)])
    return bits[:vocab]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` ([..., vocab] float32) with every token the bitmask does not allow at -inf, in place.

    On a CPU in numpy, branch-free (a lookup and an add): a boolean ``masked_fill`` over a 151k
    vocabulary took over a millisecond on a random mask and several with torch's two threads
    competing with the decode step's (docs/results/grammar_libs.jsonl has the numbers this takes)."""
    bias = _BIAS[allowed_tokens(bitmask, logits.shape[-1])]
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        out = logits.numpy()
        np.add(out, bias, out=out)
        return logits
    return logits.add_(torch.from_numpy(bias).to(device=logits.device, dtype=logits.dtype))


def closed_objects(schema: Any) -> Any:
    """A copy of the JSON schema ``schema`` in which every object with ``properties`` and no
    ``additionalProperties`` allows no other keys (OpenAI's strict mode does the same). JSON Schema
    allows extra keys by default, and a constrained small model may then add keys without end.

    Each value is visited once: ``properties`` is closed as a map of schemas only, never first as
    a schema too (that doubled the work at every nesting level: 53 s at depth 22)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    props = schema.get("properties")
    out = {
        k: v
        if k in ("const", "enum", "default", "examples") or (k == "properties" and isinstance(v, Mapping))
        else closed_objects(v)
        for k, v in schema.items()
    }
    if isinstance(props, Mapping):
        out["properties"] = {k: closed_objects(v) for k, v in props.items()}
        out.setdefault("additionalProperties", False)
    return out


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:
        raise ImportError(f"constrained decoding needs llguidance, which is not installed: {INSTALL_HINT}") from exc
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What an answer must match: ``kind`` is "json_schema" (``source`` the schema as JSON text),
    "lark" (a Lark grammar; ``%json {...}`` embeds a JSON schema) or "regex".

    Build one with :meth:`json_schema`, :meth:`lark` or :meth:`regex`; pass it as
    ``SamplingParams(constraint=...)`` or ``engine.generate(..., constraint=...)``.
    """

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Grammar kind={self.kind!r}: choose one of {', '.join(KINDS)}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("Grammar source must be a non-empty string")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        """Any JSON value matching ``schema`` (a dict or its JSON text; ``{}``: any JSON object)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's and LangChain's "json_mode")."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        return cls("lark", grammar)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    def llguidance_grammar(self) -> str:
        """The grammar as llguidance takes it (checked: a bad schema or grammar raises ValueError)."""
        llg = _llguidance()
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            text = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
        elif self.kind == "lark":
            text = llg.LLMatcher.grammar_from_lark(self.source)
        else:
            text = llg.LLMatcher.grammar_from_regex(self.source)
        ok, warnings = _validate(llg, text)
        if not ok:
            raise ValueError(f"the {self.kind.replace('_', ' ')} grammar is not valid: {warnings}")
        return text

    def start(self, tokenizer: Any, eos: Iterable[int]) -> Matcher:
        """A fresh matcher for one answer decoded by ``tokenizer`` (``eos``: the ids that end it)."""
        return Matcher(self, tokenizer_for(tokenizer, eos))


def schema_constraint(schema: Mapping[str, Any]) -> tuple[Grammar, str]:
    """The constraint for answers matching the JSON ``schema`` (its objects closed to other keys,
    :func:`closed_objects`) and the hint that shows the schema after the question: a small model
    constrained to a schema it was not shown fills it with guesses. A schema past a limit of
    ``bounds.check_json`` is refused (``ValueError`` naming the limit) before any work on it."""
    check_json(schema, "the JSON schema")
    shown = {k: v for k, v in schema.items() if k != "title"}
    return Grammar.json_schema(closed_objects(schema)), SCHEMA_HINT.format(schema=json.dumps(shown))


def check_response_format(fmt: Any) -> Mapping[str, Any] | None:
    """The JSON schema of an OpenAI-style ``response_format`` (None for ``{"type": "json_object"}``),
    checked for its shape only: constant work, whatever the schema holds."""
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "json_object":
        return None
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, Mapping) else None
        if not isinstance(schema, Mapping):
            raise ValueError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
        return schema
    shown = repr(fmt) if len(repr(fmt)) <= 80 else repr(fmt)[:77] + "..."
    raise ValueError(
        f"response_format={shown}: give {{'type': 'json_schema', 'json_schema': {{'schema': ...}}}} or {{'type': 'json_object'}}"
    )


def response_format_constraint(fmt: Mapping[str, Any]) -> tuple[Grammar, str]:
    """The constraint and the prompt hint ("" for none) of an OpenAI-style ``response_format``:
    ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` or ``{"type": "json_object"}``."""
    schema = check_response_format(fmt)
    return (Grammar.json_object(), "") if schema is None else schema_constraint(schema)


def _validate(llg, text: str) -> tuple[bool, str]:
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text)
    return not failed, "; ".join(messages)


_tokenizers: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def tokenizer_for(tokenizer: Any, eos: Iterable[int]) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer, built once per tokenizer and EOS set
    (about a second for a 151k vocabulary)."""
    llg = _llguidance()
    ends = tuple(sorted(set(eos))) or (tokenizer.eos_token_id,)
    with _tokenizers_lock:
        per = _tokenizers.setdefault(tokenizer, {})
        if ends not in per:
            per[ends] = llg.hf.from_tokenizer(tokenizer, eos_token=list(ends))
        return per[ends]


def _out_of_limits(error: str) -> bool:
    """Whether llguidance's error says it ran out of its limits (fuel, lexer states, expressions)."""
    first = error.splitlines()[0] if error else ""
    return "lexer error" in first or "limit" in first or "fuel" in first


def grammar_error(error: str) -> str:
    """llguidance's error as the message a client gets: its first line (the rest is the parser's
    state dump), and for a lexer that ran out of its limits, what to change."""
    first = error.splitlines()[0] if error else "unknown error"
    if _out_of_limits(first):
        return (
            f"constrained decoding failed: {first}: the grammar is too complex to decode within the "
            "matcher's limits; simplify its regular expressions (a schema's pattern, a regex)"
        )
    return f"constrained decoding failed: {first}"


class Matcher:
    """One answer's place in its grammar: :meth:`greedy` or :meth:`mask` before a token is chosen,
    :meth:`advance` on the token chosen."""

    def __init__(self, grammar: Grammar, lltokenizer: Any):
        import llguidance.torch as lt

        llg = _llguidance()
        self.grammar = grammar
        self._m = llg.LLMatcher(lltokenizer, grammar.llguidance_grammar())
        self._fill = lt.fill_next_token_bitmask
        self._bitmask = lt.allocate_token_bitmask(1, lltokenizer.vocab_size)
        self._check()

    def _check(self) -> None:
        if self._m.is_error():
            raise ValueError(grammar_error(self._m.get_error()))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more than end-of-sequence."""
        return self._m.is_stopped()

    def _allowed(self) -> torch.Tensor:
        """The next token's bitmask ([words] int32)."""
        self._fill(self._m, self._bitmask, 0)
        self._check()
        return self._bitmask[0]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ([1, vocab] float32) with the tokens the grammar refuses at -inf, in place."""
        return apply_bitmask(logits, self._allowed())

    def greedy(self, logits: torch.Tensor) -> int:
        """The allowed token with the highest logit (``logits`` [1, vocab] float32, left unchanged).

        The unconstrained choice is tried first: when the grammar allows it, it is the answer (the
        first highest logit is also the first highest among the allowed), and masking the whole
        vocabulary is skipped. That is most tokens of a model that knows the format."""
        words = self._allowed()
        top = int(logits.argmax(-1)[0])
        if top < words.numel() * 32 and (int(words[top >> 5]) >> (top & 31)) & 1:
            return top
        return int(apply_bitmask(logits.clone(), words).argmax(-1)[0])

    def advance(self, token: int) -> None:
        """Move past ``token`` (one the mask allowed); a token the grammar refuses raises ValueError."""
        if self._m.is_stopped():
            raise ValueError(f"constrained decoding: token {token} is not allowed by the grammar: it is complete")
        if not self._m.consume_token(token):
            # A token the mask allowed is refused when the matcher ran out of its limits on the
            # way (a pathological regex): its own error says so, the token's number does not.
            error = self._m.get_error() if self._m.is_error() else ""
            if _out_of_limits(error):
                raise ValueError(grammar_error(error))
            raise ValueError(f"constrained decoding: token {token} is not allowed by the grammar")

"""Tool calling through the model's own chat template: tool definitions in, tool calls out.

Tools are function definitions in OpenAI's format (``{"type": "function", "function": {"name",
"description", "parameters"}}``, what LangChain's ``convert_to_openai_tool`` gives). The chat
template renders them (Qwen2.5's puts them in the system turn, inside ``<tools></tools>``) and the
model answers a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, which
:func:`parse_tool_calls` turns back into calls. A template that ignores ``tools`` cannot call
any: :func:`require_tool_support` refuses it by name.

Forcing a call (LangChain's ``tool_choice="any"`` or a tool's name) is constrained decoding with
:func:`tool_call_grammar`: the answer is one or more well-formed calls to the given tools, each
``arguments`` matching its tool's parameter schema.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cacheblend_rag.bounds import check_json
from cacheblend_rag.decode.constraints import JSON_FORMAT, Grammar, closed_objects

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_MODEL_HINT = (
    "a model whose chat template renders tools, such as Qwen2.5-Coder-0.5B-Instruct "
    "(CacheBlendEngine.from_pretrained(str(cacheblend_bench.qwen.qwen_gguf_path())), "
    "or any Qwen2.5 instruct model directory)"
)
# tool_choice values besides a tool's name: "auto" (the model decides), "none" (an answer, no
# call), "any" (a call, to any of the tools). "required" is OpenAI's name for "any".
CHOICES = ("auto", "none", "any", "required")
# tool_choice="none": an answer that starts like no call, with or without the tags (a small model
# writes a call as bare JSON or a code fence too). Special tokens (<tool_call> in Qwen2.5) are never
# text, so the grammar cannot produce them.
NO_CALL = r"(?s:[^\s{\[`<].*)"
_PROBE = {
    "type": "function",
    "function": {
        "name": "cacheblend_probe_tool_7f3a",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


class ToolsUnsupported(ValueError):
    """The model's chat template does not render tools."""


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> tuple[dict[str, Any], ...]:
    """Tools as OpenAI function definitions, checked: each a dict with ``type: function`` and a
    ``function`` holding a ``name`` and a JSON-schema ``parameters`` object (``{}`` when missing).
    A bare function definition (``{"name", "parameters"}``) is wrapped."""
    if not tools:
        return ()
    if isinstance(tools, Mapping) or isinstance(tools, (str, bytes)):
        raise TypeError("tools must be a list of tool definitions, e.g. [convert_to_openai_tool(fn)]")
    # Before any other work on them: closing, compiling and rendering schemas grow with their size,
    # and json.dumps recurses. The limits hold for a request's tools together.
    check_json(list(tools), "the tools (their names, descriptions and parameters)")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TypeError(
                f"tool {i} is a {type(tool).__name__}: pass OpenAI-format dicts "
                "({'type': 'function', 'function': {'name': ..., 'parameters': {...}}})"
            )
        fn = tool.get("function") if tool.get("type") == "function" else tool if "name" in tool else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tool {i} is not a function definition with a name: {dict(tool)!r}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise ValueError(f"tool {fn['name']!r}: parameters must be a JSON schema object, got {type(params).__name__}")
        clean = {"name": fn["name"], "description": fn.get("description", ""), "parameters": dict(params)}
        try:
            json.dumps(clean)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tool {fn['name']!r} is not JSON-serialisable: {exc}") from None
        out.append({"type": "function", "function": clean})
    return tuple(out)


def tools_key(tools: Sequence[Mapping[str, Any]]) -> str:
    """A stable text for a tool set (the same definitions give the same key)."""
    return json.dumps(list(tools), sort_keys=True, separators=(",", ":"))


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def render(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] = (),
    *,
    add_generation_prompt: bool = True,
) -> str:
    """``messages`` through the tokenizer's chat template with ``tools`` (none: rendered without)."""
    kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


def supports_tools(tokenizer) -> bool:
    """Whether the chat template renders tool definitions (a probe tool's name appears)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    try:
        text = render(tokenizer, [{"role": "user", "content": "hi"}], [_PROBE])
    except Exception:  # noqa: BLE001 - a template that fails on tools does not support them
        return False
    return isinstance(text, str) and _PROBE["function"]["name"] in text


def require_tool_support(tokenizer, what: str = "tool calling") -> None:
    """Raise :class:`ToolsUnsupported` naming a model that supports tools, unless this one does."""
    if not supports_tools(tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or "this model"
        raise ToolsUnsupported(
            f"{what} needs a chat template that renders tools, and the template of {name} does not "
            f"(the bundled SmolLM2-135M's has no tool support): use {TOOL_MODEL_HINT}"
        )


def check_choice(choice: str | None, tools: Sequence[Mapping[str, Any]]) -> str:
    """``tool_choice`` normalised to "auto", "none", "any" or a tool's name."""
    if choice is None or choice is True:
        return "auto" if choice is None else "any"
    if isinstance(choice, Mapping):  # OpenAI's {"type": "function", "function": {"name": ...}}
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        name = name or choice.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"tool_choice={_short(choice)} names no function: give "
                "{'type': 'function', 'function': {'name': ...}} or one of auto, none, required"
            )
        choice = name
    if not isinstance(choice, str):
        raise TypeError(f"tool_choice must be a str (auto, none, any or a tool name), got {_short(choice)}")
    asked = choice
    choice = "any" if choice == "required" else choice
    names = tool_names(tools)
    if choice not in CHOICES and choice not in names:
        raise ValueError(
            f"tool_choice={_short(choice)} is none of {', '.join(CHOICES)} nor a bound tool ({', '.join(names) or 'none bound'})"
        )
    if choice == "any" and not tools:
        raise ValueError(f"tool_choice={asked!r} needs at least one tool: pass tools (bind tools first)")
    return choice


def _short(value: Any) -> str:
    """``repr(value)`` cut to 80 characters: an error message names a client's value, not all of it."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


TURN_ROLES = ("user", "assistant", "tool", "system")


def check_turns(turns: Sequence[Mapping[str, Any]]) -> None:
    """Chat messages after the question's turn, in the template's format: a ``role`` (user,
    assistant, tool or system), a string ``content``, and on assistant turns optional
    ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments": {...}}}]``), the
    arguments within ``bounds.check_json``'s limits. A control-token string in a call's name or
    arguments is kept as text where the prompt is built (``template_text.py``)."""
    for i, turn in enumerate(turns):
        role = turn.get("role")
        if role not in TURN_ROLES:
            raise ValueError(f"turn {i} has role {role!r}: use one of {', '.join(TURN_ROLES)}")
        if not isinstance(turn.get("content", ""), str):
            raise TypeError(f"turn {i} ({role}) content must be a str, got {type(turn.get('content')).__name__}")
        for call in turn.get("tool_calls") or ():
            fn = call.get("function", call) if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), Mapping):
                raise ValueError(
                    f"turn {i} has a tool call that is not {{'function': {{'name': str, 'arguments': dict}}}}: {call!r}"
                )
            check_json(fn["arguments"], f"turn {i}: the arguments of tool call {fn['name'][:64]!r}")


# ----------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class InvalidToolCall:
    text: str  # what stood between the tags
    error: str
    name: str | None = None
    arguments: str | None = None
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class ParsedAnswer:
    content: str  # the answer's text outside the tool calls
    calls: tuple[ToolCall, ...] = ()
    invalid: tuple[InvalidToolCall, ...] = ()


_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.S)


def _call(body: str, closed: bool = True) -> ToolCall | InvalidToolCall:
    """One call from its JSON text (what stood between the tags)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', body)
        return InvalidToolCall(
            body,
            f"not valid JSON ({exc.msg} at {exc.pos})" + ("" if closed else "; the answer ended before </tool_call>"),
            name.group(1) if name else None,
            body,
        )
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return InvalidToolCall(body, 'the call has no string "name"', None, body)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return InvalidToolCall(body, '"arguments" is not a JSON object', obj["name"], json.dumps(args))
    return ToolCall(obj["name"], args)


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _bare_calls(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """The answer read as calls written without the tags: the whole answer (in a Markdown code
    fence or not) one JSON object, or a list of them, each naming a bound tool and holding its
    arguments. Small models often answer a call this way (Qwen2.5-Coder-0.5B does)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    body = fenced.group(1) if fenced else body
    if not body.startswith(("{", "[")):
        return None
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    objs = obj if isinstance(obj, list) else [obj]
    if not objs or not all(
        isinstance(o, dict) and o.get("name") in names and ("arguments" in o or "parameters" in o) for o in objs
    ):
        return None
    calls = [_call(json.dumps(o)) for o in objs]
    return calls if all(isinstance(c, ToolCall) for c in calls) else None  # type: ignore[return-value]


def parse_tool_calls(text: str, names: Collection[str] = ()) -> ParsedAnswer:
    """Split an answer into its text and its ``<tool_call>{json}</tool_call>`` blocks. A block
    whose JSON does not parse, lacks a string ``name`` or has non-object ``arguments`` (or that is
    cut off before its closing tag) is an :class:`InvalidToolCall` with the reason.

    With ``names`` (the bound tools), an answer without tags that is nothing but a call's JSON
    naming one of them (or a list of such calls, fenced as Markdown code or not) is read as calls."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for m in _CALL.finditer(text):
        call = _call(m.group(1).strip(), m.group(0).endswith(CLOSE))
        (calls if isinstance(call, ToolCall) else invalid).append(call)  # type: ignore[arg-type]
    if not calls and not invalid and names:
        bare = _bare_calls(text, names)
        if bare:
            return ParsedAnswer("", tuple(bare))
    content = _CALL.sub("", text).strip() if (calls or invalid) else text
    return ParsedAnswer(content, tuple(calls), tuple(invalid))


class CallStream:
    """An answer's text deltas split as they arrive: :meth:`feed` returns the text that is surely
    outside a tool call (holding back what may still grow into ``<tool_call>``, and trailing
    whitespace), nothing once a call has begun; :meth:`finish` parses the whole answer and returns
    the content still to stream (text after the calls). With ``names`` (the bound tools), an answer
    that begins like JSON or a code fence may be a call without tags: it is held to the end."""

    def __init__(self, names: Collection[str] = ()) -> None:
        self.names = tuple(names)
        self._pending, self.streamed, self._in_call = "", "", False
        self._started = False
        self.parsed = ParsedAnswer("")

    def feed(self, delta: str) -> str:
        if self._in_call:
            return ""  # the calls are parsed once the answer is complete
        self._pending += delta
        if self.names and not self._started:
            head = self._pending.lstrip()
            if not head:
                return ""
            self._started = True
            if head[0] in "{[`":
                self._in_call = True
                return ""
        at = self._pending.find(OPEN)
        if at >= 0:
            ready, self._pending, self._in_call = self._pending[:at].rstrip(), "", True
        else:
            pending = self._pending
            keep = next((n for n in range(min(len(OPEN) - 1, len(pending)), 0, -1) if OPEN.startswith(pending[-n:])), 0)
            ready = pending[: len(pending) - keep].rstrip()
            self._pending = pending[len(ready) :]
        self.streamed += ready
        return ready

    def finish(self, text: str) -> str:
        """Parse ``text`` (the whole answer) into :attr:`parsed`; the content not streamed yet."""
        self.parsed = parse_tool_calls(text, self.names)
        content = self.parsed.content
        if content.startswith(self.streamed) and len(content) > len(self.streamed):
            return content[len(self.streamed) :]
        return ""


@dataclass(frozen=True)
class ToolPlan:
    """How a request with tools is answered: the tools to render, the constraint, the stop
    strings to add and whether the answer is parsed for calls."""

    tools: tuple[dict[str, Any], ...] = ()
    constraint: Grammar | None = None
    stops: tuple[str, ...] = ()
    parse: bool = False


def plan_tools(tools: Sequence[Mapping[str, Any]] | None, choice: Any, tokenizer, parallel: bool = False) -> ToolPlan:
    """The :class:`ToolPlan` of ``tools`` (checked) under ``tool_choice``.

    The tools are rendered for every choice, "none" included, so the prompt's prefix (and the chunk
    caches behind it) is the same at every step of a conversation: "auto" leaves the choice to the
    model (its answer ends after the first call unless ``parallel``), "none" constrains the answer
    to text that is no call (:data:`NO_CALL`), "any" or a tool's name to a call (several for "any"
    with ``parallel``)."""
    tools = normalize_tools(tools)
    choice = check_choice(choice, tools)
    if not tools:
        return ToolPlan()
    require_tool_support(tokenizer, "tool calling")
    if choice == "none":
        return ToolPlan(tools, Grammar.regex(NO_CALL))
    if choice == "auto":
        return ToolPlan(tools, None, single_call_stop(parallel), True)
    return ToolPlan(tools, tool_call_grammar(tools, tokenizer, choice, parallel), (), True)


def single_call_stop(parallel: bool) -> tuple[str, ...]:
    """The stop strings that end an unconstrained answer after its first call, unless ``parallel``
    calls are allowed: a small model, once it has called a tool, may call it again and again until
    the token budget runs out. The call cut at its closing tag still parses."""
    return () if parallel else (CLOSE,)


# ----------------------------------------------------------------------------- forcing a call
def _tag(tokenizer, text: str) -> str:
    """A Lark terminal for ``text``: the special-token syntax where the tokenizer has it as one
    added token (Qwen2.5's ``<tool_call>``, which the model writes as that token), else the string."""
    ids = tokenizer.convert_tokens_to_ids([text])
    added = getattr(tokenizer, "get_added_vocab", lambda: {})()
    if ids and ids[0] is not None and text in added:
        return f"<[{int(ids[0])}]>"
    return json.dumps(text)


def call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call to ``tool``: its name, then arguments matching its parameters."""
    fn = tool["function"]
    args = closed_objects(fn["parameters"])  # only the parameters the tool declares
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": args},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_FORMAT,
    }


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], tokenizer, choice: str = "any", parallel: bool = False) -> Grammar:
    """The answer as tool calls in the template's format: one call to the tool named ``choice``, or
    for "any" one call to any of ``tools`` (``parallel``: one or more)."""
    chosen = [t for t in tools if choice == "any" or t["function"]["name"] == choice]
    if not chosen:
        raise ValueError(f"tool_choice={choice!r} names no bound tool ({', '.join(tool_names(tools))})")
    bodies = " | ".join(f"%json {json.dumps(call_schema(t))}" for t in chosen)
    call = f'{_tag(tokenizer, OPEN)} "\\n" ({bodies}) "\\n" {_tag(tokenizer, CLOSE)}'
    start = 'call ("\\n" call)*' if parallel and choice == "any" else "call"
    return Grammar.lark(f"start: {start}\ncall: {call}\n")

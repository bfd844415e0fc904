"""One answer to a request with tools or a constraint: the tool_choice plan applied, the calls parsed.

Both integrations answer ``bind_tools`` / ``with_structured_output`` (LangChain) and function
calling / ``structured_predict`` (LlamaIndex) with :func:`start`: ``tools.plan_tools`` turns the
tools and ``tool_choice`` into the tools the chat template renders, the constraint and the stop
strings; the request gets those (``Request.with_tools``, ``request_settings``'s ``constraint``) and
a :class:`ToolRun` streams the text outside the calls and parses the calls once the answer ends.
The request's chunks stay chunks: they are cached behind the prefix the tools are rendered into.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cacheblend_rag.chat.tools import CallStream, ParsedAnswer, plan_tools, tool_names
from cacheblend_rag.decode.constraints import Grammar
from cacheblend_rag.serving.request import Request
from cacheblend_rag.serving.run import Run

if TYPE_CHECKING:
    from cacheblend_rag.chat.prompt import PromptLayout
    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.engine.stream import GenerationResult
    from cacheblend_rag.serving.batcher import Batcher


class ToolRun:
    """A :class:`~.run.Run` whose answer may hold tool calls (``parse``): iterating yields the
    text outside them (``tools.CallStream``); once it ends ``result.text`` is that text, its stats
    count the calls and :attr:`parsed` holds them. Otherwise it is the run itself (``request``,
    ``layout``, ``cancel``)."""

    def __init__(self, run: Run, *, parse: bool, names: Sequence[str] = ()):
        self.run, self.parse, self.names = run, parse, tuple(names)
        self.request = run.request
        self.result: GenerationResult | None = None
        self.parsed = ParsedAnswer("")

    @property
    def layout(self) -> PromptLayout:
        return self.run.layout

    @property
    def cancelled(self) -> bool:
        return self.run.cancelled

    def cancel(self) -> None:
        self.run.cancel()

    def __iter__(self) -> Iterator[str]:
        calls = CallStream(self.names) if self.parse else None
        for delta in self.run:
            ready = calls.feed(delta) if calls is not None else delta
            if ready:
                yield ready
        res = self.run.result
        if res is None or calls is None:  # cancelled, or an answer not read for calls
            self.result = res
            return
        rest = calls.finish(res.text)
        if rest:
            yield rest
        self.parsed = calls.parsed
        stats = dict(res.stats, tool_calls=len(self.parsed.calls), invalid_tool_calls=len(self.parsed.invalid))
        self.result = dataclasses.replace(res, text=self.parsed.content, stats=stats)


def start(
    engine: CacheBlendEngine,
    request: Request,
    settings: Mapping[str, Any],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel: bool = False,
    constraint: Grammar | None = None,
    hint: str = "",
    turns: Sequence[Mapping[str, Any]] = (),
    batcher: Batcher | None = None,
) -> ToolRun:
    """Answer ``request`` with ``settings`` (``request_settings``'s names) offering ``tools`` under
    ``tool_choice`` (``tools.plan_tools``; ``parallel``: several calls in one answer), the
    conversation going on with ``turns`` after the question.

    ``constraint`` (structured output) is the answer's grammar, and ``hint`` (the schema shown)
    goes after the question; a forced tool call is a constraint too, so the two cannot be combined.
    """
    plan = plan_tools(tools, tool_choice, engine.tokenizer, parallel)
    if constraint is not None and plan.parse and plan.constraint is not None:
        raise ValueError("a forced tool call and a structured-output constraint cannot be combined: choose one")
    stop = settings.get("stop")
    stops = [*([stop] if isinstance(stop, str) else (stop or ())), *plan.stops]
    settings = dict(settings, stop=stops, constraint=constraint if constraint is not None else plan.constraint)
    request = request.with_tools(plan.tools, [dict(t) for t in turns]).with_hint(hint).with_settings(**settings)
    return ToolRun(Run(engine, request, batcher=batcher), parse=plan.parse, names=tool_names(plan.tools))

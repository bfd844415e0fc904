"""How a request is answered, whichever front end it came through.

* :mod:`.request`: :class:`Request`, what the engine is asked (a question over chunks, or a plain
  chat) and how (mode, ratio, one ``SamplingParams`` built by ``cacheblend_rag.decode.sampling``), with
  :func:`request_settings`, which turns the settings' user-facing names into those fields, and
  :func:`open_stream`, the engine's stream for a request;
* :mod:`.run`: :class:`Run`, one answer: text deltas, then the result with the engine's stats;
* :mod:`.batcher`: :class:`Batcher`, continuous batching as a step loop (admission, prefill,
  decode), over :mod:`.decode_batch`'s :class:`DecodeBatch` (one forward per token for every answer);
* :mod:`.tool_run`: :class:`ToolRun`, a run with tools or a constraint: ``tool_choice`` planned
  (``tools.plan_tools``), the answer's tool calls parsed; both integrations start one with
  :func:`.tool_run.start`.

The LangChain and LlamaIndex integrations and the HTTP server (``cacheblend_rag.server``) are
adapters: they turn their framework's input into a ``Request`` and a ``Run``'s output back.

May import: ``engine`` and every folder below it; never ``server``, ``cluster`` or ``cli``.
"""

from cacheblend_rag.serving.batcher import Batcher, Ticket
from cacheblend_rag.serving.decode_batch import DecodeBatch
from cacheblend_rag.serving.request import SETTINGS, Request, open_stream, request_settings
from cacheblend_rag.serving.run import Run
from cacheblend_rag.serving.tool_run import ToolRun

__all__ = ["Batcher", "DecodeBatch", "Request", "Run", "SETTINGS", "Ticket", "ToolRun", "open_stream", "request_settings"]

"""The prompt as the chat template lays it out: chunks, question, messages and tools.

* ``prompt``: the instruction prefix, the chunks and the question in the model's chat template,
  and the checks of the texts given.
* ``messages``: chat messages that carry chunks; ``matching``: registered chunks found inside an
  already formatted prompt (how the integrations and the server recognise them).
* ``tools``: tools through the chat template (support check, ``tool_choice`` plans, parsing,
  the forced-call grammar); ``template_text``: a request's strings kept as text inside it.

May import: the top-level modules, ``store``, ``model`` and ``decode`` (a grammar for tool calls).
"""

"""Tiny random RoPE models with an offline tokenizer, for tests and examples (built in milliseconds).

Nothing here downloads: the tokenizer is a byte-level BPE trained on a few sentences, the models are
random transformers configs. Use them to exercise the engine's mechanics, never for answer quality.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

CORPUS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "Marie Curie won two Nobel prizes, in physics and in chemistry.",
    "The river Thames flows through London and Oxford.",
    "Alice was born in 1980 and Bob is thirteen years older than Alice.",
    "Question: Answer: Documents: who what where when why how many years old",
    "You are a helpful assistant. Answer the question using the documents.",
]
# A question whose answer needs two facts of one chunk, over chunks that share no prefix: the
# fixture the engine and pipeline tests compare modes on.
SAMPLE_CHUNKS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "Marie Curie won two Nobel prizes, in physics and in chemistry.",
    "The river Thames flows through London and Oxford.",
    "Alice was born in 1980 and Bob is thirteen years older than Alice.",
]
SAMPLE_QUESTION = "How many years older is Bob than Alice?"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2.5's chat template (Apache-2.0), which renders tools into the system turn and tool calls as
# <tool_call>{json}</tool_call>: the tiny tokenizer's with tools=True, so tool calling is tested offline.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def make_tokenizer(tools: bool = False):
    """The tiny byte-level BPE tokenizer. ``tools=True``: with Qwen2.5's tool-calling chat template
    and ``<tool_call>``/``</tool_call>`` as single added (non-special) tokens, as in Qwen2.5."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tags = ["<tool_call>", "</tool_call>"] if tools else []
    trainer = trainers.BpeTrainer(
        vocab_size=400 - len(tags),  # the models' vocabulary holds the added tags too
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    if tools:
        from tokenizers import AddedToken

        fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    fast.chat_template = TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    return fast


def make_model(arch: str = "llama", seed: int = 0, layers: int = 4, **overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch](**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


def make_engine(arch: str = "llama", seed: int = 0, store_dir=None, *, tools: bool = False, **engine_kwargs):
    """A ``CacheBlendEngine`` over a tiny random model (store in ``store_dir`` or a temp dir);
    ``tools=True``: the tokenizer with a tool-calling chat template (``make_tokenizer``)."""
    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.store.disk import KVStore

    # The tool template's system turn alone is hundreds of the tiny tokenizer's tokens: room for it.
    model = make_model(arch, seed, max_position_embeddings=4096) if tools else make_model(arch, seed)
    return CacheBlendEngine(model, make_tokenizer(tools), store=KVStore(store_dir), **engine_kwargs)


@contextmanager
def sample_engine(store_dir, arch: str = "llama", seed: int = 0, *, tools: bool = False, **engine_kwargs) -> Iterator:
    """:func:`make_engine` with :data:`SAMPLE_CHUNKS` cached, closed on exit: a test module's engine.
    Loading runs on the calling thread unless ``pipelined=True`` is passed (a test's timing and
    failures stay on one thread)."""
    engine_kwargs.setdefault("pipelined", False)
    eng = make_engine(arch, seed, store_dir, tools=tools, **engine_kwargs)
    try:
        eng.precompute(SAMPLE_CHUNKS, progress=False)
        yield eng
    finally:
        eng.close()


def make_store_engine(store, *, memory_bytes: int = 2**26, arch: str = "llama", seed: int = 0, store_dir=None, **engine_kwargs):
    """A ``CacheBlendEngine`` over a tiny random model and the tiers ``store`` names (``store.spec``:
    ``"disk"``, a Redis URL, a list of them), with a memory tier of ``memory_bytes`` in front: the
    engine a test's cluster replica builds (``cluster.EngineSpec(factory=...)``)."""
    import os
    import tempfile

    from cacheblend_rag.engine.core import CacheBlendEngine
    from cacheblend_rag.model.fingerprint import model_fingerprint
    from cacheblend_rag.store.spec import open_store

    model, tok = make_model(arch, seed), make_tokenizer()
    fingerprint = model_fingerprint(model, tok, torch.float32)
    directory = store_dir or os.path.join(tempfile.gettempdir(), f"cbrag-kv-{os.getpid()}")  # used by a "disk" tier only
    opened = open_store(store, directory=str(directory), size_limit=2**30, fingerprint=fingerprint, memory_bytes=memory_bytes)
    return CacheBlendEngine(model, tok, store=opened, fingerprint=fingerprint, **engine_kwargs)

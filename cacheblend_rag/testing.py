"""Tiny random RoPE models with an offline tokenizer, for tests and examples (built in milliseconds).

Nothing here downloads: the tokenizer is a byte-level BPE trained on a few sentences, the models are
random transformers configs. Use them to exercise the engine's mechanics, never for answer quality.
"""

from __future__ import annotations

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


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
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


def make_engine(arch: str = "llama", seed: int = 0, store_dir=None, **engine_kwargs):
    """A ``CacheBlendEngine`` over a tiny random model (store in ``store_dir`` or a temp dir)."""
    from .engine import CacheBlendEngine
    from .store.disk import KVStore

    return CacheBlendEngine(make_model(arch, seed), make_tokenizer(), store=KVStore(store_dir), **engine_kwargs)


def make_store_engine(store, *, memory_bytes: int = 2**26, arch: str = "llama", seed: int = 0, store_dir=None, **engine_kwargs):
    """A ``CacheBlendEngine`` over a tiny random model and the tiers ``store`` names (``store.spec``:
    ``"disk"``, a Redis URL, a list of them), with a memory tier of ``memory_bytes`` in front: the
    engine a test's cluster replica builds (``cluster.EngineSpec(factory=...)``)."""
    import os
    import tempfile

    from .engine import CacheBlendEngine
    from .models import model_fingerprint
    from .store.spec import open_store

    model, tok = make_model(arch, seed), make_tokenizer()
    fingerprint = model_fingerprint(model, tok, torch.float32)
    directory = store_dir or os.path.join(tempfile.gettempdir(), f"cbrag-kv-{os.getpid()}")  # used by a "disk" tier only
    opened = open_store(store, directory=str(directory), size_limit=2**30, fingerprint=fingerprint, memory_bytes=memory_bytes)
    return CacheBlendEngine(model, tok, store=opened, fingerprint=fingerprint, **engine_kwargs)

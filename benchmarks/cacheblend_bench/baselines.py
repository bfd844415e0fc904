"""Baselines outside the engine: transformers' ``model.generate()`` and llama.cpp on the same GGUF.

Both answer the exact prompt the engine builds (``engine.build_layout``: instruction, chunks,
question, in the model's chat template) with greedy decoding and the same stop tokens, so their
answers and first-token logits compare with full prefill's.

* ``generate``: ``engine.model.generate(...)`` over the prompt's token ids, fp32 like the engine;
  TTFT is the time until the streamer receives the first new token.
* ``llama_cpp[:QUANT]``: llama.cpp through ``llama-cpp-python`` (an optional install, see
  :data:`LLAMA_CPP_HINT`) on the model's GGUF, or on a copy requantised once with llama.cpp's
  own quantiser (``f16``, ``q8_0``, ``q4_0``, ...; no suffix: the file as shipped). Same number
  of threads as torch. TTFT is the prompt's evaluation plus choosing the first token.
* ``llama_cpp_prefix[:QUANT]``: llama.cpp's own prefix reuse, as llama-server's prompt cache does
  it: the context already holds the instruction and the first chunk (evaluated untimed, the same
  prefix the engine's ``prefix_caching`` finds cached), and only the rest is evaluated.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from cacheblend_rag.decode.generation import eos_token_ids

LLAMA_CPP_HINT = "pip install llama-cpp-python==0.3.36  # builds llama.cpp from source: about 15 minutes on 2 cores"
# The GGUF tensor types llama.cpp's quantiser can write for these comparisons (llama.h's
# LLAMA_FTYPE_MOSTLY_*); requantising a quantised file goes through fp32, so the result is what
# llama.cpp would make from the shipped weights.
QUANTS = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q4_k_m": 15, "q6_k": 18}
KINDS = ("generate", "llama_cpp", "llama_cpp_prefix")


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError(f"the llama_cpp baselines need llama-cpp-python ({e}): {LLAMA_CPP_HINT}") from e
    return llama_cpp


def gguf_for(model: str) -> Path:
    """The GGUF file behind a bench ``--model`` name (llama.cpp runs GGUF files only)."""
    from cacheblend_bench.qwen import MODELS, qwen_gguf_path
    from cacheblend_rag.model.loading import bundled_gguf_path

    if model in ("smollm2", "default", ""):
        return bundled_gguf_path()
    if model in MODELS:
        return qwen_gguf_path(model=MODELS[model])
    if model.lower().endswith(".gguf") and Path(model).is_file():
        return Path(model)
    raise ValueError(
        f"the llama_cpp baselines run a GGUF file; --model {model!r} is none: use smollm2, a Qwen name or a .gguf path"
    )


def quantized(gguf: Path, quant: str, cache_dir: Path) -> Path:
    """``gguf`` requantised to ``quant`` by llama.cpp (once; kept under ``cache_dir``)."""
    if quant not in QUANTS:
        raise ValueError(f"llama_cpp quantisation {quant!r} unknown; choose from {', '.join(QUANTS)}")
    target = cache_dir / f"{gguf.stem}.{quant}.gguf"
    if target.is_file():
        return target
    lib = _llama_cpp()
    target.parent.mkdir(parents=True, exist_ok=True)
    params = lib.llama_model_quantize_default_params()
    params.ftype = QUANTS[quant]
    params.allow_requantize = True
    params.nthread = torch.get_num_threads()
    tmp = target.with_suffix(".tmp")
    if lib.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not requantise {gguf} to {quant}")
    os.replace(tmp, target)
    return target


@dataclass
class Answer:
    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    generated_tokens: int
    logits: torch.Tensor  # [vocab] the first answer token's logits (for KL to full prefill)
    token_times_s: list[float] = field(default_factory=list)  # from the start to each token's choice


class _FirstTokenTimer(BaseStreamer):
    """Records when ``generate`` hands over its first new token (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.first = 0, float("nan")

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class GenerateBaseline:
    """``model.generate()`` on the engine's own model and prompt."""

    def __init__(self, engine):
        self.eos = sorted(eos_token_ids(engine.model, engine.tokenizer))

    def answer(self, engine, question: str, chunks: Sequence[str], max_new_tokens: int) -> Answer:
        ids = engine.build_layout(question, chunks).token_ids
        timer = _FirstTokenTimer()
        model = engine.model
        x = torch.tensor([ids], device=model.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=self.eos,
                pad_token_id=self.eos[0],
                streamer=timer,
                output_scores=True,
                return_dict_in_generate=True,
            )
        total = time.perf_counter() - t0
        new = out.sequences[0, len(ids) :].tolist()
        new = new[: next((i for i, t in enumerate(new) if t in self.eos), len(new))]
        text = engine.tokenizer.decode(new, skip_special_tokens=True)
        return Answer(text.strip(), timer.first - t0, total, len(ids), len(new), out.scores[0][0].float().cpu())

    def close(self) -> None:
        pass


class LlamaCppBaseline:
    """llama.cpp on the model's GGUF (optionally requantised); greedy, same prompt tokens.

    The GGUF carries the same vocabulary as the converted model the engine runs, so the engine's
    token ids are fed as they are and the answer is decoded with the engine's tokenizer.
    """

    def __init__(self, engine, gguf: Path, quant: str | None, prefix: bool):
        from cacheblend_rag.model.loading import default_cache_dir

        self.lib = lib = _llama_cpp()
        path = quantized(gguf, quant, default_cache_dir() / "models" / "llama_cpp") if quant else gguf
        threads = torch.get_num_threads()
        self.llm = lib.Llama(
            model_path=str(path),
            n_ctx=engine.context_window,
            n_threads=threads,
            n_threads_batch=threads,
            n_gpu_layers=0,
            verbose=False,
        )
        self.prefix = prefix
        self.eos = set(eos_token_ids(engine.model, engine.tokenizer)) | {self.llm.token_eos()}

    def _last_logits(self) -> torch.Tensor:
        """[vocab] logits of the last evaluated token (llama.cpp keeps only those without logits_all)."""
        import numpy as np

        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).copy())

    def answer(self, engine, question: str, chunks: Sequence[str], max_new_tokens: int, ignore_eos: bool = False) -> Answer:
        """Greedy answer; ``ignore_eos`` decodes past end-of-sequence to ``max_new_tokens``."""
        layout = engine.build_layout(question, chunks)
        ids = layout.token_ids
        llm = self.llm
        llm.reset()  # forget the previous prompt: llama.cpp would otherwise reuse its common prefix
        start = 0
        if self.prefix:
            start = layout.offsets()[2] if len(layout.segments) > 2 else 0  # instruction + first chunk
            if start:
                llm.eval(ids[:start])
        t0 = time.perf_counter()
        llm.eval(ids[start:])
        logits = self._last_logits()
        token = int(logits.argmax())
        times = [time.perf_counter() - t0]
        ttft = times[0]
        eos = set() if ignore_eos else self.eos
        new: list[int] = []
        while token not in eos and len(new) < max_new_tokens:
            new.append(token)
            if len(new) == max_new_tokens:
                break
            llm.eval([token])
            token = int(self._last_logits().argmax())
            times.append(time.perf_counter() - t0)
        total = time.perf_counter() - t0
        text = engine.tokenizer.decode(new, skip_special_tokens=True)
        return Answer(text.strip(), ttft, total, len(ids), len(new), logits, times[: len(new)])

    def close(self) -> None:
        self.llm.close()


def make_baseline(kind: str, quant: str | None, engine, model: str) -> Any:
    if kind == "generate":
        return GenerateBaseline(engine)
    if kind in ("llama_cpp", "llama_cpp_prefix"):
        return LlamaCppBaseline(engine, gguf_for(model), quant, prefix=kind == "llama_cpp_prefix")
    raise ValueError(f"unknown baseline {kind!r}; choose from {', '.join(KINDS)}")

"""Prompts without chunks: the engine's full prefill of the text as written (both integrations use it)."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.decode.sampling import SamplingParams
from cacheblend_rag.engine.plain import chat_text, plain_stream
from cacheblend_rag.testing import make_engine

N = 6


@pytest.fixture
def eng(tmp_path):
    e = make_engine("llama", store_dir=tmp_path / "kv", pipelined=False)
    yield e
    e.close()


def test_plain_stream_is_the_models_own_greedy_answer(eng):
    text = chat_text(eng.tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}])
    assert text == eng.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    stream = plain_stream(eng, text, SamplingParams(max_new_tokens=N))
    deltas = list(stream)
    ids = eng.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ref = eng.model.generate(
            ids,
            max_new_tokens=N,
            do_sample=False,
            eos_token_id=eng.tokenizer.eos_token_id,
            pad_token_id=eng.tokenizer.pad_token_id,
        )
    ref_ids = [t for t in ref[0, ids.shape[1] :].tolist() if t != eng.tokenizer.eos_token_id]
    res = stream.result
    assert res.token_ids == ref_ids and "".join(deltas) == res.text
    s = res.stats
    assert (s["mode"], s["chunks"], s["context_tokens"], s["prompt_tokens"]) == ("full_recompute", 0, 0, ids.shape[1])
    assert s["recompute_fraction"] == 1.0


def test_chat_text_folds_system_text_for_templates_without_a_system_role(eng):
    tok = eng.tokenizer
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    text = chat_text(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nBe brief.\n\nHi<|im_end|>\n<|im_start|>assistant"  # jinja drops the final newline
    tok.chat_template = None
    assert chat_text(tok, [{"role": "user", "content": "A"}, {"role": "user", "content": "B"}]) == "A\n\nB\n"


def test_plain_stream_errors(eng):
    with pytest.raises(ValueError, match="the prompt is empty"):
        plain_stream(eng, "  ", SamplingParams())
    with pytest.raises(
        ValueError, match=r"plus 8 to generate, more than the model's context window of 1024 tokens: shorten the prompt"
    ):
        plain_stream(eng, "Paris " * 1100, SamplingParams(max_new_tokens=8))


def test_a_plain_run_takes_one_stop_string_as_one_sequence(eng):
    from cacheblend_rag.serving import Request, Run

    def answer(stop):
        request = Request.plain_chat([{"role": "user", "content": "Where is Paris?"}], "q")
        run = Run(eng, request.with_settings(max_new_tokens=24, stop=stop))
        return "".join(run)

    full = answer(None)
    # A stop string whose first character shows up earlier than the whole string: read as a set
    # of one-character stops, it would cut the answer at that first character.
    cut = next(((i, full[i : i + 2]) for i in range(1, len(full) - 1) if full[i] in full[:i]), None)
    assert cut is not None, f"the tiny model's answer {full!r} has no repeated character to test with"
    i, stop = cut
    assert answer(stop) == answer([stop]) == full[: full.index(stop)]

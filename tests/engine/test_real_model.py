"""The bundled SmolLM2-135M-Instruct GGUF: our greedy tokens == transformers' on the same file."""
from __future__ import annotations

import os

import pytest
import torch

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about paged attention.",
    "List three prime numbers greater than 100 and explain why they are prime.",
]


def _long_prompt() -> str:
    para = ("Large language models process long scientific documents by first encoding the whole input, "
            "which is compute bound, and then generating a short answer token by token, which is bound by "
            "memory bandwidth. Section {i} discusses how the key-value cache grows with the context. ")
    text = "".join(para.format(i=i) for i in range(40))
    return text + "\n\nSummarize the text above in one sentence."


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    from dlbatch import LLM
    from dlbatch.engine.loader import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    llm = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=4096)
    return hf, llm


def test_real_model_greedy_matches_transformers(models):
    from dlbatch import SamplingParams

    hf, llm = models
    prompts = PROMPTS + [_long_prompt()]
    ids = [llm.encode(p) for p in prompts]
    assert len(ids[-1]) > 1500
    n = 24
    outs = llm.generate(ids, SamplingParams(max_tokens=n))
    for p, o in zip(ids, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == ref[:len(o.token_ids)], (o.text, llm.tokenizer.decode(ref))
        assert len(o.token_ids) == len(ref)
    assert "Paris" in outs[0].text


def test_tokenizer_matches_transformers_gguf_tokenizer():
    from transformers import AutoTokenizer

    from dlbatch.engine.loader import load_model, resolve_model

    path = resolve_model("smollm2-135m-instruct")
    htok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok = load_model("smollm2-135m-instruct").tokenizer
    for text in ["Hello world!", "Numbers 12345 and 3.14159, dates 2026-12-02.", "  spaces\n\nnewlines\ttabs",
                 "Ünïcödé — “quotes” ﬁ ligature", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text, add_special_tokens=False) == htok.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_chat_template_from_gguf():
    from dlbatch.engine.loader import load_model

    tok = load_model("smollm2-135m-instruct").tokenizer
    s = tok.apply_chat_template("hi")
    assert s.startswith("<|im_start|>system\n") and s.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nhi<|im_end|>" in s

"""Tiny random models of every architecture we claim, made on the fly with transformers
(test-only oracle) and saved as safetensors + tokenizer.json."""
from __future__ import annotations

import json
import os

ARCHS = {
    # name: (config class, extra kwargs)
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama3_rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                    "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"sliding_window": 24, "tie_word_embeddings": False}),
    "smollm": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
}
# architectures our engine does not run; vLLM does (tests/test_backend_vllm.py)
OTHER_ARCHS = {
    # its sliding window past the context: the local layers attend as the global ones
    "gemma2": ("Gemma2Config", {"head_dim": 32, "tie_word_embeddings": True, "sliding_window": 1024,
                                "query_pre_attn_scalar": 32}),
}

VOCAB = 384


def make_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    i = 3
    for c in range(32, 127):
        vocab[chr(c)] = i
        i += 1
    while i < vocab_size:
        vocab[f"w{i}"] = i
        i += 1
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return tk.to_str()


def make_tiny_model(arch: str, path: str, seed: int = 0, overrides: dict | None = None):
    """Create and save a tiny random model; returns the transformers model (fp32, eval).
    ``overrides``: config keys on top of the arch's (e.g. rope_scaling)."""
    import torch
    import transformers

    cls_name, extra = {**ARCHS, **OTHER_ARCHS}[arch]
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(extra)
    kw.update(overrides or {})
    config = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():  # norms and biases are constant at init; make them random too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(make_tokenizer_json(VOCAB))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>",
                   "chat_template": "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"}, f)
    return model

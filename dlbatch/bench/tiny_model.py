"""A tiny random llama-like model (SmolLM's shape family: tied embeddings, one KV head, 2 layers)
written on the fly as config.json + model.safetensors + tokenizer.json, for benchmarks that
time everything but the model (`dlbatch bench scale`).

The tokenizer is word-level over whitespace: words ``w3`` .. ``w{vocab-1}`` are one token each,
so a document of N such words is N tokens. `random_words` draws seeded text from that vocabulary.
"""
from __future__ import annotations

import json
import os

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 1, "vocab_size": 4096, "max_position_embeddings": 1024}


def make_tiny_model(path: str, seed: int = 0, **shape) -> str:
    """Write the model under `path` (created); returns `path`. `shape` overrides SHAPE keys."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    s = {**SHAPE, **shape}
    h, n_layers, nh, nkv = s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"], s["num_key_value_heads"]
    inter, vocab, hd = s["intermediate_size"], s["vocab_size"], s["hidden_size"] // s["num_attention_heads"]
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
           "num_hidden_layers": n_layers, "num_attention_heads": nh, "num_key_value_heads": nkv,
           "intermediate_size": inter, "vocab_size": vocab, "head_dim": hd, "tie_word_embeddings": True,
           "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": s["max_position_embeddings"],
           "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "bos_token_id": 1,
           "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    g = torch.Generator().manual_seed(seed)

    def rnd(*dims, std=0.3):
        return torch.randn(*dims, generator=g) * std

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    w = {"model.embed_tokens.weight": rnd(vocab, h), "model.norm.weight": norm(h)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
                  p + "self_attn.q_proj.weight": rnd(nh * hd, h), p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
                  p + "self_attn.v_proj.weight": rnd(nkv * hd, h), p + "self_attn.o_proj.weight": rnd(h, nh * hd),
                  p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                  p + "mlp.down_proj.weight": rnd(h, inter)})
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    vocab_map = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab_map.update({f"w{i}": i for i in range(3, vocab)})
    tk = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>"}, f)
    return path


def random_words(rng, n: int, vocab_size: int = SHAPE["vocab_size"]) -> str:
    """`n` words of the tiny model's vocabulary (one token each), drawn with `rng` (random.Random)."""
    return " ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(n))

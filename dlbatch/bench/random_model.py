"""Random Llama-family checkpoints written on the fly (config.json, model.safetensors, a
word-level tokenizer.json), for benchmarks that must not depend on downloaded weights: the
engine bench's Llama-3.2-1B shape (`RANDOM_MODELS`) and the tiny model of
dlbatch/bench/tiny_model.py."""
from __future__ import annotations

import json
import os

RANDOM_MODELS = {"llama-1b-random": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                         num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                         head_dim=64, tie_word_embeddings=True)}


def make_random_llama(path: str, seed: int = 0, dtype: str = "bfloat16", **shape) -> str:
    """Write an HF Llama directory with random weights (config.json, model.safetensors,
    tokenizer.json) under `path`; shape defaults to Llama-3.2-1B. Returns `path`."""
    import torch
    from safetensors.torch import save_file

    s = dict(RANDOM_MODELS["llama-1b-random"])
    s.update(shape)
    h, L, nh, nkv, inter, vocab = (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"],
                                   s["num_key_value_heads"], s["intermediate_size"], s["vocab_size"])
    hd = s.get("head_dim") or h // nh
    tied = bool(s.get("tie_word_embeddings", True))
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "num_hidden_layers": L,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "intermediate_size": inter, "vocab_size": vocab,
           "head_dim": hd, "tie_word_embeddings": tied, "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "max_position_embeddings": s.get("max_position_embeddings", 131072), "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
           "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": dtype, "dtype": dtype}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)

    def rnd(*shape_, std=0.02):
        return (torch.randn(*shape_, generator=g) * std).to(dt)

    w = {"model.embed_tokens.weight": rnd(vocab, h), "model.norm.weight": torch.ones(h, dtype=dt)}
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=dt)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dt)
        w[p + "self_attn.q_proj.weight"] = rnd(nh * hd, h)
        w[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, nh * hd)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
    if not tied:
        w["lm_head.weight"] = rnd(vocab, h)
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_map = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab_map.update({f"t{i}": i for i in range(3, vocab)})
    tk = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    return path

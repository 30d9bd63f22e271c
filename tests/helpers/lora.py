"""Random LoRA adapters for a tiny model, made by hand in PEFT's file layout
(``adapter_config.json`` + ``adapter_model.safetensors``), so no peft is needed."""
from __future__ import annotations

import json
import os


def make_lora_adapter(base: str, out: str, seed: int, rank: int = 8, targets=("q_proj", "v_proj"),
                      scale: float = 0.5) -> str:
    """A random LoRA of ``rank`` on ``targets`` of every layer of the model in folder ``base``
    (its config.json gives the shapes), written to ``out``; returns ``out``."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config") or cfg
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (cfg["num_key_value_heads"] * head_dim, hidden),
              "v_proj": (cfg["num_key_value_heads"] * head_dim, hidden), "o_proj": (hidden, heads * head_dim)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj in targets:
            rows, cols = shapes[proj]
            pre = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[pre + ".lora_A.weight"] = torch.randn(rank, cols, generator=g) * scale
            tensors[pre + ".lora_B.weight"] = torch.randn(rows, rank, generator=g) * scale
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
                   "base_model_name_or_path": base, "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0},
                  f)
    return out

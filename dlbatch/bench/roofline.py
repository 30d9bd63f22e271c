"""What a model's work costs at the limit: FLOPs of a prefill, bytes read by a decode step,
from the counts of a loaded engine (`model_counts`). The engine and paper-workload benches
divide by the machine's measured peak (`limits`) to print the roofline."""
from __future__ import annotations


def model_counts(llm) -> dict:
    m = llm.engine.model
    c = m.config
    linear = sum(L.qkv_w.numel() + L.o_w.numel() + L.gate_up_w.numel() + L.down_w.numel() for L in m.layers)
    el = m.embed.element_size()
    kv_tok = 2 * c.num_layers * c.num_kv_heads * c.head_dim * llm.engine.runner.kv_cache.element_size()
    return {"layers": c.num_layers, "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "hidden": c.hidden_size, "vocab": c.vocab_size, "linear_params": linear, "lm_head_params": m.lm_head.numel(),
            "weight_bytes": m.weight_bytes(), "kv_bytes_per_token": kv_tok, "elem_bytes": el}


def prefill_flops(cnt: dict, tokens: int) -> float:
    """2·(linear params)·tokens + the LM head for the last token + causal attention
    (QKᵀ and PV: 4·layers·heads·head_dim·tokens²/2)."""
    return (2.0 * cnt["linear_params"] * tokens + 2.0 * cnt["lm_head_params"]
            + 4.0 * cnt["layers"] * cnt["heads"] * cnt["head_dim"] * tokens * tokens / 2)


def decode_bytes(cnt: dict, batch: int, ctx: float) -> float:
    """Bytes one decode step must read: every weight once (the LM head included) + each
    sequence's KV over its context."""
    return cnt["weight_bytes"] + batch * ctx * cnt["kv_bytes_per_token"]

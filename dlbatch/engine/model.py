"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, SmolLM) over the op interface.

Weights are fused at load: q/k/v into one matrix, gate/up into one, so a layer is four
matmuls. The model runs one flattened step: prefill chunks first, then decode tokens.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dlbatch.engine.config import ModelConfig
from dlbatch.engine.ops import Ops

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def rope_inv_freq(config: ModelConfig, max_len: int | None = None) -> torch.Tensor:
    """Inverse rotary frequencies, as transformers computes them for each rope type.

    ``dynamic`` (NTK): transformers recomputes the base from the current sequence length
    (largest position + 1) whenever it exceeds ``max_position_embeddings``. Our cos/sin
    table is shared by every sequence and keys are cached rotated, so the base is fixed
    once, for a sequence of ``max_len`` (the engine's max_model_len): equal to
    transformers for a sequence of exactly that length and for any sequence when
    ``max_len <= max_position_embeddings``; in between it differs (docs/long_documents.md).
    """
    rope = config.rope
    d = config.head_dim
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, d)
    theta = rope.theta
    if rope.kind == "dynamic" and max_len is not None and max_len > config.max_position_embeddings:
        ratio = rope.factor * max_len / config.max_position_embeddings - (rope.factor - 1)
        theta = theta * ratio ** (d / (d - 2))
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths divided by `factor`,
        # short ones kept, a smooth blend in between.
        old = rope.original_max_position
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, blended, scaled)
    return inv


def _yarn_inv_freq(rope, d: int) -> torch.Tensor:
    """YaRN: interpolate (divide by ``factor``) the long wavelengths, keep the short ones,
    blend linearly between the dimensions where ``beta_fast`` / ``beta_slow`` rotations fit
    into the original context."""
    def correction_dim(rotations: float) -> float:
        return d * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    pos_freqs = rope.theta ** (torch.arange(0, d, 2).float() / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def rope_attention_factor(config: ModelConfig) -> float:
    """The scale transformers applies to cos and sin (YaRN's mscale); 1 for other kinds."""
    rope = config.rope
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim)
    return get_mscale(rope.factor)


class Layer:
    __slots__ = ("in_norm", "qkv_w", "qkv_b", "o_w", "o_b", "q_norm", "k_norm", "post_norm", "gate_up_w", "down_w")


class Transformer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops,
                 dtype: torch.dtype, device: torch.device, max_len: int):
        self.config = config
        self.ops = ops
        self.dtype = dtype
        self.device = device

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weights are missing tensor {name!r}")
            return weights[name].to(device=device, dtype=dtype).contiguous()

        c = config
        self.embed = w("model.embed_tokens.weight")
        if self.embed.shape != (c.vocab_size, c.hidden_size):
            raise ValueError(f"embed_tokens shape {tuple(self.embed.shape)} != ({c.vocab_size}, {c.hidden_size})")
        self.layers: list[Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            L = Layer()
            L.in_norm = w(p + "input_layernorm.weight")
            L.post_norm = w(p + "post_attention_layernorm.weight")
            L.qkv_w = ops.pack_linear(torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                                                 w(p + "self_attn.v_proj.weight")], 0).contiguous())
            L.qkv_b = (torch.cat([w(p + "self_attn.q_proj.bias"), w(p + "self_attn.k_proj.bias"),
                                  w(p + "self_attn.v_proj.bias")], 0) if c.qkv_bias else None)
            L.o_w = ops.pack_linear(w(p + "self_attn.o_proj.weight"))
            L.o_b = w(p + "self_attn.o_proj.bias") if c.o_bias else None
            L.q_norm = w(p + "self_attn.q_norm.weight") if c.qk_norm else None
            L.k_norm = w(p + "self_attn.k_norm.weight") if c.qk_norm else None
            L.gate_up_w = ops.pack_linear(
                torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], 0).contiguous())
            L.down_w = ops.pack_linear(w(p + "mlp.down_proj.weight"))
            self.layers.append(L)
        self.norm = w("model.norm.weight")
        tied = c.tie_word_embeddings or "lm_head.weight" not in weights
        # a packed LM head is a second copy of a tied embedding (the lookup needs the plain one)
        self.tied = tied
        self.lm_head = ops.pack_linear(self.embed if tied else w("lm_head.weight"))
        inv = rope_inv_freq(c, max_len)
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = rope_attention_factor(c)
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scale).to(device=device, dtype=dtype)

    def weight_bytes(self) -> int:
        tensors = [self.lm_head, self.norm] + ([] if self.tied else [self.embed])
        for L in self.layers:
            tensors += [t for t in (L.in_norm, L.post_norm, L.qkv_w, L.qkv_b, L.o_w, L.o_b, L.q_norm, L.k_norm,
                                    L.gate_up_w, L.down_w) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions (T,); kv_cache (2, layers, blocks, block_size, Hkv, D).
        Returns float32 logits for the rows in `logits_indices`."""
        c, ops = self.config, self.ops
        T = input_ids.shape[0]
        tp = meta.num_prefill_tokens
        h = F.embedding(input_ids, self.embed)
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        qs, ks = c.q_size, c.kv_size
        delta = None  # the previous layer's MLP output, added to h by the fused norm below
        for li, L in enumerate(self.layers):
            if delta is None:
                x = ops.rms_norm(h, L.in_norm, c.rms_norm_eps)
            else:
                x, h = ops.add_rms_norm(delta, h, L.in_norm, c.rms_norm_eps)
            qkv = ops.linear(x, L.qkv_w, L.qkv_b)
            q = qkv[:, :qs].view(T, c.num_heads, c.head_dim)
            k = qkv[:, qs:qs + ks].view(T, c.num_kv_heads, c.head_dim)
            v = qkv[:, qs + ks:].view(T, c.num_kv_heads, c.head_dim)
            if L.q_norm is not None:
                q = ops.rms_norm(q, L.q_norm, c.rms_norm_eps)
                k = ops.rms_norm(k, L.k_norm, c.rms_norm_eps)
            k_cache, v_cache = kv_cache[0, li], kv_cache[1, li]
            q, k = ops.rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slots)
            if meta.on_layer is not None:  # layer-wise KV streaming (prefill-only sequences)
                meta.on_layer(li)
            if tp == T:
                attn = ops.prefill_attention(q, k, v, k_cache, v_cache, meta)
            elif tp == 0:
                attn = ops.paged_decode_attention(q, k_cache, v_cache, meta)
            else:
                attn = torch.cat([ops.prefill_attention(q[:tp], k[:tp], v[:tp], k_cache, v_cache, meta),
                                  ops.paged_decode_attention(q[tp:], k_cache, v_cache, meta)], 0)
            x, h = ops.add_rms_norm(ops.linear(attn.reshape(T, qs), L.o_w, L.o_b), h, L.post_norm, c.rms_norm_eps)
            delta = ops.linear(ops.silu_and_mul(ops.linear(x, L.gate_up_w)), L.down_w)
        if delta is not None:
            h = h + delta
        h = h.index_select(0, logits_indices)
        h = ops.rms_norm(h, self.norm, c.rms_norm_eps)
        return ops.linear(h, self.lm_head).float()

"""Reference op implementations in plain torch: correct on any torch device.

Shapes: tokens are flattened across sequences, T = total tokens in the step.
q: (T, Hq, D), k/v: (T, Hkv, D). A layer's KV cache is (num_blocks, block_size, Hkv, D)
for K and for V; a slot is block * block_size + offset.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dlbatch.engine.ops.registry import register_op


@register_op("pack_linear")
def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) weight in the layout the device's ``linear`` reads fastest; done once at
    load. The reference keeps the plain tensor."""
    return weight


@register_op("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, ``weight`` as returned by ``pack_linear``."""
    return F.linear(x, weight, bias)


@register_op("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


@register_op("add_rms_norm")
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """h = x + residual; returns (rms_norm(h), h). Fused on devices that register it."""
    h = residual + x
    return rms_norm(h, weight, eps), h


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@register_op("rotary")
def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q (T, Hq, D), k (T, Hkv, D); cos/sin (T, D) for the tokens' positions (in q's dtype)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@register_op("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@register_op("store_kv")
def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    hk, d = k_cache.shape[-2:]
    k_cache.view(-1, hk, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, hk, d).index_copy_(0, slots, v.to(v_cache.dtype))


@register_op("rotary_store_kv")
def rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots):
    """rotary on q and k, then k and v into the cache at `slots`; returns (q, k). Fused
    (in place, one kernel) on devices that register it."""
    q, k = rotary(q, k, cos, sin)
    store_kv(k_cache, v_cache, k, v, slots)
    return q, k


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window is not None:
        allowed &= (q_pos.unsqueeze(1) - k_pos.unsqueeze(0)) < window
    return allowed


@register_op("prefill_attention")
def prefill_attention(q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
    """Causal attention for each prefill chunk. `meta.prefill` lists, per sequence,
    (q_start, n_new, ctx_start, gather) where gather indexes the cache slots of the whole
    context [0, ctx_start + n_new) when ctx_start > 0 (prefix hit or chunked prefill)."""
    out = torch.empty_like(q)
    hk, d = k_cache.shape[-2:]
    kc = k_cache.view(-1, hk, d)
    vc = v_cache.view(-1, hk, d)
    for (qs, n, ctx, gather) in meta.prefill:
        out[qs:qs + n] = prefill_one(q, k, v, kc, vc, qs, n, ctx, gather, meta.sliding_window)
    return out


def prefill_one(q, k, v, kc, vc, qs: int, n: int, ctx: int, gather, window) -> torch.Tensor:
    """(n, Hq, D) attention output of one sequence's chunk: queries q[qs:qs+n] at positions
    [ctx, ctx + n); kc, vc: the caches as (slots, Hkv, D)."""
    qi = q[qs:qs + n].transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
    if ctx == 0:
        ki = k[qs:qs + n].transpose(0, 1).unsqueeze(0)
        vi = v[qs:qs + n].transpose(0, 1).unsqueeze(0)
        if window is None or n <= window:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
        else:
            pos = torch.arange(n, device=q.device)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=_window_mask(pos, pos, window), enable_gqa=True)
    else:
        ki = kc.index_select(0, gather).to(q.dtype).transpose(0, 1).unsqueeze(0)
        vi = vc.index_select(0, gather).to(q.dtype).transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(ctx, ctx + n, device=q.device)
        k_pos = torch.arange(ctx + n, device=q.device)
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=_window_mask(q_pos, k_pos, window), enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


@register_op("paged_decode_attention")
def paged_decode_attention(q, k_cache, v_cache, meta) -> torch.Tensor:
    """One new token per sequence. q: (B, Hq, D). meta.decode_gather: (B, Lmax) cache slots
    (padded), meta.decode_mask: (B, 1, 1, Lmax) bool, True where a key is visible."""
    hk, d = k_cache.shape[-2:]
    b, lmax = meta.decode_gather.shape
    idx = meta.decode_gather.reshape(-1)
    ki = k_cache.view(-1, hk, d).index_select(0, idx).to(q.dtype).view(b, lmax, hk, d).transpose(1, 2)
    vi = v_cache.view(-1, hk, d).index_select(0, idx).to(q.dtype).view(b, lmax, hk, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), ki, vi, attn_mask=meta.decode_mask, enable_gqa=True)
    return o.squeeze(2)


@register_op("sample")
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           generators: list, all_greedy: bool) -> torch.Tensor:
    """logits (N, V) float32 -> token ids (N,). Greedy rows (temperature 0) take the argmax;
    others sample with temperature / top-k / top-p by the exponential-race (Gumbel) trick,
    each row with its own generator so a seeded request reproduces whatever its batch."""
    greedy_tokens = logits.argmax(dim=-1)
    if all_greedy:
        return greedy_tokens
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    x = logits / t.unsqueeze(1)
    vocab = x.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if bool((k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=x.device).unsqueeze(0)
        drop = ranks >= k.unsqueeze(1)
        probs = sorted_x.softmax(dim=-1)
        cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        drop |= cum >= top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    probs = x.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, g in enumerate(generators):
        noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, sampled)

"""Reference op implementations in plain torch: correct on any torch device.

Shapes: tokens are flattened across sequences, T = total tokens in the step.
q: (T, Hq, D), k/v: (T, Hkv, D). A layer's KV cache is (num_blocks, block_size, Hkv, D)
for K and for V; a slot is block * block_size + offset.
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class SampleExtras:
    """The per-request extras of one sampling step (absent: the op samples as it always did).

    ``min_p``: (N,) float, 0 = off. Penalties on the rows ``penalty_rows`` (M,) only:
    ``counts`` (M, V) float32, each token's count in the row's output; ``prompt_mask`` (M, V)
    bool, the tokens of its prompt; ``repetition``/``presence``/``frequency`` (M,).
    ``num_logprobs``: None, or k >= 0: the op also returns the log-probabilities of the
    sampled tokens and the top k of every row, from the logits as they came in (vLLM's
    default ``raw_logprobs``: before penalties, temperature and the top-k/top-p/min-p filters)."""
    min_p: torch.Tensor | None = None
    penalty_rows: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    num_logprobs: int | None = None


def apply_penalties(x: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Penalized (M, V) logits, vLLM's order: the repetition penalty on every token seen in the
    prompt or the output (a positive logit divided by it, a negative one multiplied: HF's
    definition), then OpenAI's over the output: logit -= frequency x count + presence x [count > 0]."""
    seen = prompt_mask | (counts > 0)
    rep = repetition.unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency.unsqueeze(1) * counts
    return x - presence.unsqueeze(1) * (counts > 0).to(x.dtype)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """(N, V) logits (temperature applied) with every token whose probability is below
    min_p x the row's top probability set to -inf (vLLM's min-p); rows with min_p 0 as they were."""
    probs = x.softmax(dim=-1)
    drop = probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return x.masked_fill(drop, float("-inf"))


def top_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, k: int):
    """-> (logprob of each row's token (N,), top-k token ids (N, k), their logprobs (N, k)),
    the top k sorted by logprob, highest first."""
    chosen = logprobs.gather(1, tokens.view(-1, 1)).squeeze(1)
    top_lp, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return chosen, top_ids, top_lp


@register_op("sample")
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           generators: list, all_greedy: bool, extras: SampleExtras | None = None):
    """logits (N, V) float32 -> token ids (N,). Greedy rows (temperature 0) take the argmax;
    others sample with temperature / top-k / top-p by the exponential-race (Gumbel) trick,
    each row with its own generator so a seeded request reproduces whatever its batch.

    With ``extras`` (`SampleExtras`) -> (token ids, logprobs or None), in vLLM's order:
    logprobs of the raw logits, penalties, then (sampled rows) temperature, min-p, top-k/top-p."""
    if extras is None:
        return _sample(logits, temperature, top_p, top_k, generators, all_greedy)
    lp = logits.log_softmax(dim=-1) if extras.num_logprobs is not None else None
    if extras.penalty_rows is not None and extras.penalty_rows.numel():
        rows = extras.penalty_rows
        logits = logits.clone()
        logits[rows] = apply_penalties(logits[rows], extras.counts, extras.prompt_mask, extras.repetition,
                                       extras.presence, extras.frequency)
    tokens = _sample(logits, temperature, top_p, top_k, generators, all_greedy, extras.min_p)
    return tokens, (top_logprobs(lp, tokens, extras.num_logprobs) if lp is not None else None)


def _sample(logits, temperature, top_p, top_k, generators, all_greedy, min_p=None) -> torch.Tensor:
    greedy_tokens = logits.argmax(dim=-1)
    if all_greedy:
        return greedy_tokens
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    x = logits / t.unsqueeze(1)
    if min_p is not None and bool((min_p > 0).any()):
        rows = (min_p > 0).nonzero().squeeze(1)
        x[rows] = apply_min_p(x[rows], min_p[rows])
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

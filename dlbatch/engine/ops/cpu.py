"""CPU implementations that beat the reference on CPUs.

paged_decode_attention: the reference gathers every sequence's KV into a padded batch
(one copy of the whole context per layer per step, then a masked SDPA over the padding).
Here each sequence attends straight to its cache memory: its block table is split into
runs of consecutive blocks (usually one or two: a shared prefix and its own tail), each
run is a zero-copy view of the cache, scores of all runs are concatenated, one softmax,
then the weighted sum run by run. No copy of the KV, no padding, exact same math.

When the C kernel of dlbatch/engine/ops/native.py is available, the whole batch goes
through it in one call per layer, reading the block tables directly: each token's K and
V rows (all heads) are read once, in order, with no per-sequence op dispatch, from a
float32, float16 or bfloat16 cache. The torch loop below is the fallback.

linear: ``F.linear`` goes to MKL, whose GEMM for the skinny shapes of a decode step
(M = batch, 8 to 64 rows) stays well below the fp32 peak. oneDNN with the weight
reordered once at load into its blocked layout is faster at those shapes and never slower
at prefill sizes (figures: docs/benchmarks.md).
``pack_linear`` reorders float32 weights when oneDNN is built in (``DLBATCH_ONEDNN=0``
keeps the plain tensor), and bfloat16 weights on a CPU with AVX512_BF16 but no AMX, where
oneDNN's packed bf16 GEMM is 1.1-1.8x ``F.linear``'s at every row count a step has (on AMX
``F.linear`` stays: the packed path was not measured there); ``linear`` takes either kind.
A row's result must not depend on how many rows share the call (a resumed sampling job
batches differently and must draw the same tokens): oneDNN's packed GEMM gives every row
the same bits for any M >= 2, but a different kernel for M = 1 on AVX-512 CPUs (the
1536-wide down projection differed in the last bits), so a single row goes through as the
first of two.

rms_norm, add_rms_norm, silu_and_mul, rotary_store_kv: one pass of a C kernel per row
(``_fused.c``) instead of a chain of torch ops, each with a pass and a tensor of its own
(a decode step would dispatch some twenty small ops per layer for them). Rotary goes in
place, into q and k (views of the QKV projection's output), as the CUDA kernels do. Inputs
the kernel does not take (a dtype it has no path for, rows not contiguous) go to the
reference.

prefill_attention: float32 queries on a CPU with AVX-512 go to the C kernel
(``_prefill_attn.c``): one call per layer for every chunk of the step, each token over its
sequence's keys read from the paged cache, flash style, with the grouped query heads of a
KV head sharing each key row; a chunk over a cached prefix costs only its own rows' work,
and a row's result does not depend on how its sequence was chunked. bf16 queries go there too
on a CPU with AVX512_BF16 but no AMX (faster than bf16 SDPA there: docs/benchmarks.md): over
a bf16 cache as they are (scores by `vdpbf16ps`, exact products; the probabilities rounded
to bf16 for the weighted values, as torch's bf16 SDPA rounds them), over a cache of another
dtype widened to float32; the output is rounded back to bf16. Elsewhere (bf16 on AMX,
AVX2, head sizes it does not take) torch's SDPA: a chunk whose context starts in the cache
(chunked prefill, prefix hit) needs a causal mask offset by the cached length, which SDPA
only takes as an explicit mask: then it computes every (query, key) pair, twice the work of
the causal square, and builds the mask. So a long chunk is two SDPA calls, the chunk
against the cached keys (no mask) and against its own keys (``is_causal``), merged by their
log-sum-exps. Short chunks (a prefix hit's task suffix) and sliding windows keep the
reference path.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dlbatch.engine.device import cpu_flags
from dlbatch.engine.ops import native, reference
from dlbatch.engine.ops.registry import register_op

# the batch size oneDNN lays the weights out for: a decode step's rows (any M works)
_PACK_ROWS = 32


def _onednn() -> bool:
    return (os.environ.get("DLBATCH_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _bf16_without_amx() -> bool:
    flags = cpu_flags()
    return "avx512_bf16" in flags and "amx_bf16" not in flags


@register_op("pack_linear", "cpu")
def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2 or not _onednn() or not (weight.dtype == torch.float32 or
                                                  (weight.dtype == torch.bfloat16 and _bf16_without_amx())):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS)


@register_op("linear", "cpu")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    if x.shape[0] == 1:  # one row: as the first of two (see the module docstring)
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), weight, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


@register_op("rms_norm", "cpu")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = native.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps) if out is None else out


@register_op("add_rms_norm", "cpu")
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    out = native.rms_norm(x, weight, eps, residual)
    return reference.add_rms_norm(x, residual, weight, eps) if out is None else out


@register_op("silu_and_mul", "cpu")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = native.silu_and_mul(x)
    return reference.silu_and_mul(x) if out is None else out


@register_op("rotary_store_kv", "cpu")
def rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots):
    out = native.rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    return reference.rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots) if out is None else out


def _runs(table: list[int], lo: int, length: int, bs: int) -> list[tuple[int, int]]:
    """Positions [lo, length) of a sequence as runs (first slot, count) of consecutive slots."""
    runs: list[tuple[int, int]] = []
    p = lo
    while p < length:
        start = table[p // bs] * bs + p % bs
        n = min(bs - p % bs, length - p)
        p += n
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((start, n))
    return runs


SPLIT_MIN_TOKENS = 256  # chunks shorter than this gain nothing from the split (docs/benchmarks.md)


@register_op("prefill_attention", "cpu")
def prefill_attention(q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
    if getattr(meta, "use_native", True) and getattr(meta, "prefill_cu_q", None) is not None:
        qf = q
        if q.dtype == torch.bfloat16:
            if not _bf16_without_amx():
                qf = None  # AMX: SDPA's bf16 matmuls (the kernel is not measured there)
            elif not (k_cache.dtype == torch.bfloat16 and native.prefill_bf16_queries()):
                qf = q.float()  # (a cache of another dtype: the kernel computes in float32)
        out = None if qf is None else native.prefill_attention(
            qf, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_q, meta.prefill_ctx, meta.sliding_window)
        if out is not None:
            return out.to(q.dtype)
    out = torch.empty_like(q)
    hk, d = k_cache.shape[-2:]
    kc = k_cache.view(-1, hk, d)
    vc = v_cache.view(-1, hk, d)
    window = meta.sliding_window
    g = q.shape[1] // hk
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # also returns the log-sum-exp
    for (qs, n, ctx, gather) in meta.prefill:
        if ctx == 0 or window is not None or n < SPLIT_MIN_TOKENS:
            out[qs:qs + n] = reference.prefill_one(q, k, v, kc, vc, qs, n, ctx, gather, window)
            continue
        qi = q[qs:qs + n].transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
        cached = gather[:ctx]
        kp = kc.index_select(0, cached).to(q.dtype).repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)
        vp = vc.index_select(0, cached).to(q.dtype).repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)
        kn = k[qs:qs + n].repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)
        vn = v[qs:qs + n].repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)
        o_p, lse_p = flash(qi, kp, vp, 0.0, False)[:2]
        o_n, lse_n = flash(qi, kn, vn, 0.0, True)[:2]
        m = torch.maximum(lse_p, lse_n)
        w_p, w_n = torch.exp(lse_p - m), torch.exp(lse_n - m)
        # merged in float32 (the log-sum-exps are float32 whatever q's dtype), rounded once
        o = (o_p.float() * w_p.unsqueeze(-1) + o_n.float() * w_n.unsqueeze(-1)) / (w_p + w_n).unsqueeze(-1)
        out[qs:qs + n] = o.squeeze(0).transpose(0, 1).to(q.dtype)
    return out


@register_op("paged_decode_attention", "cpu")
def paged_decode_attention(q, k_cache, v_cache, meta) -> torch.Tensor:
    if getattr(meta, "use_native", True):
        out = native.paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, meta.sliding_window)
        if out is not None:
            return out
    hk, d = k_cache.shape[-2:]
    bs = k_cache.shape[1]
    kc = k_cache.view(-1, hk, d)
    vc = v_cache.view(-1, hk, d)
    b, hq, _ = q.shape
    g = hq // hk
    scale = d ** -0.5
    out = torch.empty_like(q)
    qg = (q * scale).view(b, hk, g, d)
    window = meta.sliding_window
    for i, (table, length) in enumerate(zip(meta.decode_block_tables.tolist(), meta.decode_lens.tolist())):
        runs = _runs(table, 0 if window is None else max(0, length - window), length, bs)
        qi = qg[i]  # (hk, g, d)
        if len(runs) == 1:
            s, n = runs[0]
            k = kc[s:s + n].to(q.dtype).permute(1, 2, 0)  # (hk, d, n)
            v = vc[s:s + n].to(q.dtype).transpose(0, 1)  # (hk, n, d)
            p = torch.matmul(qi, k).softmax(dim=-1)
            out[i] = torch.matmul(p, v).view(hq, d)
            continue
        scores = torch.cat([torch.matmul(qi, kc[s:s + n].to(q.dtype).permute(1, 2, 0)) for s, n in runs], dim=-1)
        p = scores.softmax(dim=-1)
        acc = None
        off = 0
        for s, n in runs:
            part = torch.matmul(p[..., off:off + n], vc[s:s + n].to(q.dtype).transpose(0, 1))
            acc = part if acc is None else acc + part
            off += n
        out[i] = acc.view(hq, d)
    return out

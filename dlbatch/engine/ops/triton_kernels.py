"""Triton kernels of the CUDA ops (dlbatch/engine/ops/cuda.py wraps them as registry ops).

Layout shared with the reference ops: q (T, Hq, D); a layer's cache (blocks, block_size,
Hkv, D) for K and for V; a sequence's block table lists its cache blocks in position
order, so position p lives in slot ``table[p // block_size] * block_size + p % block_size``.

- ``paged_decode``: one query token per sequence, split-K ("flash decoding"): program
  (seq, kv head, partition) walks ``PART`` blocks of the block table with an online
  softmax for the ``Hq / Hkv`` query heads that share the KV head (each K/V row is read
  once for the whole group), writes (max, sum, acc); a second kernel merges partitions.
  The grid depends only on (batch, table width), so a CUDA graph can replay it for any
  lengths; a sequence of length 0 (padding of a graph bucket) writes zeros.
- ``paged_prefill``: varlen causal attention of each sequence's new tokens over its whole
  context, read from the paged cache through the block table (the new tokens' KV is
  stored before attention runs), so prefix hits and chunked prefill need no gather.
- ``add_rms_norm``: ``h = x + residual`` then rms_norm(h), one pass.
- ``rotary_store_kv``: rotary on q and k in place, then k and v written to their slots
  (a negative slot, padding, is skipped).

Sliding window: key positions ``> pos - window`` only (window 0: none). Every dot
product accumulates in fp32; ``IEEE`` makes fp32 inputs use exact fp32 (no TF32).
The kernels run unchanged in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU
tensors, which is how CI checks them against the reference ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_part_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr,
                        scale, window, num_parts, table_w,
                        sq_t, sq_h, sk_b, sk_t, sk_h, st_b,
                        HQ: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BS: tl.constexpr,
                        D: tl.constexpr, D_PAD: tl.constexpr, PART: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    lo = n * 0
    if window > 0:
        lo = tl.maximum(n - window, 0)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    t = tl.arange(0, BS)
    gmask = g < G
    dmask = d < D
    heads = kvh * G + g
    q = tl.load(q_ptr + b * sq_t + heads[:, None] * sq_h + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * scale
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)
    first = part * PART
    for j in range(PART):
        blk_i = first + j
        start = blk_i * BS
        if (start < n) & (start + BS > lo) & (blk_i < table_w):
            blk = tl.load(tables_ptr + b * st_b + blk_i).to(tl.int64)
            pos = start + t
            tmask = (pos < n) & (pos >= lo)
            off = blk * sk_b + t[:, None] * sk_t + kvh * sk_h + d[None, :]
            kv_mask = tmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + off, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + off, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (G_PAD, BS)
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
    base = (b * HQ + heads) * num_parts + part
    tl.store(m_ptr + base, m_i, mask=gmask)
    tl.store(l_ptr + base, l_i, mask=gmask)
    tl.store(acc_ptr + base[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _decode_merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, num_parts, so_t, so_h,
                         HQ: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, P_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.arange(0, P_PAD)
    d = tl.arange(0, D_PAD)
    pmask = p < num_parts
    base = (b * HQ + h) * num_parts
    m = tl.load(m_ptr + base + p, mask=pmask, other=float("-inf"))
    l = tl.load(l_ptr + base + p, mask=pmask, other=0.0)
    acc = tl.load(acc_ptr + (base + p)[:, None] * D + d[None, :], mask=pmask[:, None] & (d < D)[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
    total = tl.sum(l * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + b * so_t + h * so_h + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


def decode_partitions(table_width: int, part: int) -> int:
    return max(1, triton.cdiv(table_width, part))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, window: int | None, part: int = 16, out: torch.Tensor | None = None,
                 scratch: tuple | None = None) -> torch.Tensor:
    """q (B, Hq, D); block_tables (B, W) int32; seq_lens (B,) keys visible to each query
    (its position + 1). ``scratch``: (m, l, acc) float32 buffers of shapes (B*Hq*P,),
    (B*Hq*P,), (B*Hq*P, D) for P = decode_partitions(W, part), reused by CUDA graphs."""
    b, hq, d = q.shape
    _, bs, hk, _ = k_cache.shape
    g = hq // hk
    w = block_tables.shape[1]
    parts = decode_partitions(w, part)
    if scratch is None:
        m = torch.empty(b * hq * parts, dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
        acc = torch.empty(b * hq * parts, d, dtype=torch.float32, device=q.device)
    else:
        m, lsum, acc = (x[:b * hq * parts] for x in scratch)
    if out is None:
        out = torch.empty_like(q)
    d_pad = triton.next_power_of_2(d)
    _decode_part_kernel[(b, hk, parts)](
        q, k_cache, v_cache, block_tables, seq_lens, m, lsum, acc,
        float(d) ** -0.5, int(window or 0), parts, w,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        HQ=hq, G=g, G_PAD=max(2, triton.next_power_of_2(g)), BS=bs, D=d, D_PAD=d_pad, PART=part)
    _decode_merge_kernel[(b, hq)](m, lsum, acc, out, parts, out.stride(0), out.stride(1),
                                  HQ=hq, D=d, D_PAD=d_pad, P_PAD=max(2, triton.next_power_of_2(parts)))
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, cu_q_ptr, ctx_ptr, scale, window,
                    sq_t, sq_h, sk_b, sk_t, sk_h, st_b, so_t, so_h,
                    G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    s_i = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q0 = tl.load(cu_q_ptr + s_i)
    n_new = tl.load(cu_q_ptr + s_i + 1) - q0
    if mb * BLOCK_M < n_new:
        ctx = tl.load(ctx_ptr + s_i)
        kvh = h // G
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < n_new
        d = tl.arange(0, D_PAD)
        dmask = d < D
        q = tl.load(q_ptr + (q0 + rows)[:, None] * sq_t + h * sq_h + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        q_pos = ctx + rows
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
        hi = ctx + tl.minimum(n_new, (mb + 1) * BLOCK_M)
        lo = ctx * 0
        if window > 0:
            lo = tl.maximum(ctx + mb * BLOCK_M - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        cols = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            k_pos = start + cols
            kmask = k_pos < hi
            blk = tl.load(tables_ptr + s_i * st_b + k_pos // BS, mask=kmask, other=0).to(tl.int64)
            off = blk[:, None] * sk_b + (k_pos % BS)[:, None] * sk_t + kvh * sk_h + d[None, :]
            # a cache stored in another dtype than the model's (kv_cache_dtype) is read as q's
            # dtype: tl.dot takes operands of one dtype
            k = tl.load(k_ptr + off, mask=kmask[:, None] & dmask[None, :], other=0.0).to(q.dtype)
            v = tl.load(v_ptr + off, mask=kmask[:, None] & dmask[None, :], other=0.0).to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            ok = (k_pos[None, :] <= q_pos[:, None]) & kmask[None, :]
            if window > 0:
                ok = ok & (q_pos[:, None] - k_pos[None, :] < window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q0 + rows)[:, None] * so_t + h * so_h + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & dmask[None, :])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_q: torch.Tensor, ctx: torch.Tensor, max_new: int, window: int | None,
                  block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """q (T, Hq, D) of the new tokens of S sequences, sequence i's rows at
    [cu_q[i], cu_q[i+1]) and its first new token at position ctx[i]; block_tables (S, W)
    int32 cover each sequence's context [0, ctx + n) whose KV is already in the cache."""
    t, hq, d = q.shape
    _, bs, hk, _ = k_cache.shape
    s = block_tables.shape[0]
    out = torch.empty_like(q)
    if s == 0 or t == 0:
        return out
    grid = (s, hq, triton.cdiv(max(1, max_new), block_m))
    _prefill_kernel[grid](q, k_cache, v_cache, out, block_tables, cu_q, ctx, float(d) ** -0.5, int(window or 0),
                          q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          block_tables.stride(0), out.stride(0), out.stride(1),
                          G=hq // hk, BS=bs, D=d, D_PAD=max(16, triton.next_power_of_2(d)),
                          BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32)
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, n_cols, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n_cols
    x = tl.load(x_ptr + row * n_cols + c, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * n_cols + c, mask=mask, other=0.0)
        tl.store(h_ptr + row * n_cols + c, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + c, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + c, w * y, mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """rms_norm over the last dim; with ``residual``: returns (rms_norm(x + residual), x + residual)."""
    n = x.shape[-1]
    x2 = x.contiguous().view(-1, n)
    out = torch.empty_like(x2)
    rows = x2.shape[0]
    h = torch.empty_like(x2) if residual is not None else out
    res = residual.contiguous().view(-1, n) if residual is not None else x2
    if rows:
        _add_rms_norm_kernel[(rows,)](x2, res, weight, out, h, n, float(eps), HAS_RES=residual is not None,
                                      BLOCK=triton.next_power_of_2(n))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), h.view(x.shape)


@triton.jit
def _rotary_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, kc_ptr, vc_ptr,
                         sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_slot, sc_h,
                         HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    m = i < HALF
    c1 = tl.load(cos_ptr + t * 2 * HALF + i, mask=m, other=0.0)
    c2 = tl.load(cos_ptr + t * 2 * HALF + HALF + i, mask=m, other=0.0)
    s1 = tl.load(sin_ptr + t * 2 * HALF + i, mask=m, other=0.0)
    s2 = tl.load(sin_ptr + t * 2 * HALF + HALF + i, mask=m, other=0.0)
    for h in range(HQ):
        p = q_ptr + t * sq_t + h * sq_h
        a = tl.load(p + i, mask=m, other=0.0)
        b = tl.load(p + HALF + i, mask=m, other=0.0)
        tl.store(p + i, a * c1 - b * s1, mask=m)
        tl.store(p + HALF + i, b * c2 + a * s2, mask=m)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    for h in range(HK):
        p = k_ptr + t * sk_t + h * sk_h
        a = tl.load(p + i, mask=m, other=0.0)
        b = tl.load(p + HALF + i, mask=m, other=0.0)
        ka = a * c1 - b * s1
        kb = b * c2 + a * s2
        tl.store(p + i, ka, mask=m)
        tl.store(p + HALF + i, kb, mask=m)
        if slot >= 0:
            pv = v_ptr + t * sv_t + h * sv_h
            dst = slot * sc_slot + h * sc_h
            tl.store(kc_ptr + dst + i, ka.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(kc_ptr + dst + HALF + i, kb.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(vc_ptr + dst + i, tl.load(pv + i, mask=m, other=0.0).to(vc_ptr.dtype.element_ty), mask=m)
            tl.store(vc_ptr + dst + HALF + i, tl.load(pv + HALF + i, mask=m, other=0.0).to(vc_ptr.dtype.element_ty),
                     mask=m)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """Rotary on q (T, Hq, D) and k (T, Hkv, D) in place (their last dim contiguous), then
    k and v (T, Hkv, D) into the caches at ``slots`` (T,); returns (q, k)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("rotary_store_kv needs q, k, v with a contiguous last dimension")
    cos = cos.contiguous()
    sin = sin.contiguous()
    if t:
        kc = k_cache.view(-1, hk, d)
        vc = v_cache.view(-1, hk, d)
        _rotary_store_kernel[(t,)](q, k, v, cos, sin, slots, kc, vc, q.stride(0), q.stride(1), k.stride(0),
                                   k.stride(1), v.stride(0), v.stride(1), kc.stride(0), kc.stride(1),
                                   HQ=hq, HK=hk, HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2))
    return q, k

"""The CUDA ops against the reference ops on one device, with shapes of the caller's choice:
tests/gpu/test_gpu.py runs them on a CUDA device with the full shapes (PARITY),
tests/engine/test_triton_ops.py on CPU tensors in Triton's interpreter with small ones, so
that a change of the metadata the ops read shows without a GPU. `kernels` is the pair
(dlbatch.engine.ops.cuda, dlbatch.engine.ops.reference)."""
from __future__ import annotations

import torch


def _tables(lens, bs, seed):
    need = [-(-n // bs) for n in lens]
    perm = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(seed)).tolist()
    out, i = [], 0
    for k in need:
        out.append(perm[i:i + k])
        i += k
    return out, sum(need) + 3


def _slots(table, bs, lo, hi):
    return [table[p // bs] * bs + p % bs for p in range(lo, hi)]


# shapes of the op-parity checks on a GPU (tests/engine/test_triton_ops.py runs them with small ones,
# on CPU tensors in Triton's interpreter, so that a change of the metadata shows in CI)
PARITY = dict(hq=32, hk=8, d=64, lens=[1, 17, 300, 1000, 2049], specs=[(0, 700), (1000, 64), (16, 300)],
              window=100)


def decode_and_prefill_parity(kernels, dtype, tol, windowed, dev="cuda", shapes=PARITY):
    """Paged decode attention and prefill attention (fresh, prefix hit, chunk), optionally
    with a sliding window: the CUDA op equals the reference op within `tol`."""
    from dlbatch.engine.model_runner import AttnMeta

    cuda, ref = kernels
    bs, hq, hk, d = 16, shapes["hq"], shapes["hk"], shapes["d"]
    window = shapes["window"] if windowed else None
    lens = shapes["lens"]
    tables, nb = _tables(lens, bs, 0)
    kc = torch.randn(nb, bs, hk, d, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    q = torch.randn(len(lens), hq, d, device=dev, dtype=dtype)
    lmax = max(lens)
    dl = torch.tensor(lens, device=dev)
    kpos = torch.arange(lmax, device=dev)[None]
    mask = kpos < dl[:, None]
    if window:
        mask &= kpos > dl[:, None] - 1 - window
    width = max(len(t) for t in tables)
    meta = AttnMeta(slots=torch.zeros(0, dtype=torch.long, device=dev), num_prefill_tokens=0, decode_lens=dl,
                    decode_gather=torch.tensor([_slots(t, bs, 0, n) + [0] * (lmax - n) for t, n in zip(tables, lens)],
                                               device=dev),
                    decode_mask=mask[:, None, None], sliding_window=window,
                    # as dlbatch/engine/step_meta.py keeps them: int64, rows padded with valid ids
                    decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev))
    torch.testing.assert_close(cuda.paged_decode_attention(q, kc, vc, meta).float(),
                               ref.paged_decode_attention(q, kc, vc, meta).float(), atol=tol, rtol=tol)
    # prefill: fresh, prefix hit, chunk
    specs = shapes["specs"]
    tables, nb = _tables([c + n for c, n in specs], bs, 1)
    kc = torch.randn(nb, bs, hk, d, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    t = sum(n for _, n in specs)
    q = torch.randn(t, hq, d, device=dev, dtype=dtype)
    k = torch.empty(t, hk, d, device=dev, dtype=dtype)
    v = torch.empty_like(k)
    prefill, slots, qs = [], [], 0
    for (c, n), tb in zip(specs, tables):
        new = torch.tensor(_slots(tb, bs, c, c + n), device=dev)
        k[qs:qs + n], v[qs:qs + n] = kc.view(-1, hk, d)[new], vc.view(-1, hk, d)[new]
        prefill.append((qs, n, c, torch.tensor(_slots(tb, bs, 0, c + n), device=dev) if c else None))
        slots += new.tolist()
        qs += n
    pm = AttnMeta(slots=torch.tensor(slots, device=dev), num_prefill_tokens=t, prefill=prefill, sliding_window=window)
    torch.testing.assert_close(cuda.prefill_attention(q, k, v, kc, vc, pm).float(),
                               ref.prefill_attention(q, k, v, kc, vc, pm).float(), atol=tol, rtol=tol)


def norm_and_rotary_parity(kernels, dtype, tol, dev="cuda"):
    """add_rms_norm and rotary_store_kv: the CUDA op equals the reference op within `tol`."""
    cuda, ref = kernels
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(37, 2048, device=dev, dtype=dtype, generator=g)
    r = torch.randn_like(x)
    w = torch.randn(2048, device=dev, dtype=dtype, generator=g)
    for got, want in zip(cuda.add_rms_norm(x, r, w, 1e-5), ref.add_rms_norm(x, r, w, 1e-5)):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    t, hq, hk, d = 37, 32, 8, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=dtype, generator=g)
    q, k, v = (qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d),
               qkv[:, (hq + hk) * d:].view(t, hk, d))
    ang = torch.randn(t, d // 2, device=dev, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    slots = torch.randperm(64 * 16, device=dev)[:t]
    kc_r = torch.zeros(64, 16, hk, d, device=dev, dtype=dtype)
    vc_r = torch.zeros_like(kc_r)
    wq, wk = ref.rotary_store_kv(q.clone(), k.clone(), v, cos, sin, kc_r, vc_r, slots)
    kc, vc = torch.zeros_like(kc_r), torch.zeros_like(vc_r)
    gq, gk = cuda.rotary_store_kv(q, k, v, cos, sin, kc, vc, slots)
    for got, want in ((gq, wq), (gk, wk), (kc, kc_r), (vc, vc_r)):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)

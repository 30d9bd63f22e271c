"""The CPU prefill attention (chunk against cached keys + causal square, merged by
log-sum-exp) against the reference's masked SDPA, chunk by chunk."""
import pytest
import torch

from dlbatch.engine.ops import cpu, reference


class Meta:
    sliding_window = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d,bs", [(9, 3, 64, 16), (4, 4, 32, 32)])
def test_split_prefill_attention_matches_reference(hq, hk, d, bs, dtype):
    """float32 to 1e-5; bfloat16 (a model computing in bf16 on an AMX CPU) against the
    reference in float32 over the same rounded inputs, to bf16's precision."""
    g = torch.Generator().manual_seed(0)
    chunks = [(0, 300), (40, 300), (512, 700), (2000, 10), (33, cpu.SPLIT_MIN_TOKENS), (100, cpu.SPLIT_MIN_TOKENS - 1)]
    nblocks = sum((c + n + bs - 1) // bs for c, n in chunks) + 3
    kc = torch.randn(nblocks, bs, hk, d, generator=g)
    vc = torch.randn(nblocks, bs, hk, d, generator=g)
    perm = torch.randperm(nblocks, generator=g)
    prefill, qs, used = [], 0, 0
    for ctx, n in chunks:  # each sequence on blocks of its own, scattered
        nb = (ctx + n + bs - 1) // bs
        table = perm[used:used + nb]
        used += nb
        prefill.append((qs, n, ctx, (table.view(-1, 1) * bs + torch.arange(bs)).view(-1)[:ctx + n]))
        qs += n
    q = torch.randn(qs, hq, d, generator=g)
    k = torch.randn(qs, hk, d, generator=g)
    v = torch.randn(qs, hk, d, generator=g)
    for s, n, ctx, gather in prefill:  # the chunk's own keys are in the cache too (stored before attention)
        kc.view(-1, hk, d)[gather[ctx:]] = k[s:s + n]
        vc.view(-1, hk, d)[gather[ctx:]] = v[s:s + n]
    meta = Meta()
    meta.prefill = prefill
    q, k, v, kc, vc = (t.to(dtype) for t in (q, k, v, kc, vc))
    got = cpu.prefill_attention(q, k, v, kc, vc, meta)
    assert got.dtype == dtype
    if dtype != torch.float32:
        exact = reference.prefill_attention(*(t.float() for t in (q, k, v, kc, vc)), meta)
        torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)
        return
    want = reference.prefill_attention(q, k, v, kc, vc, meta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for s, n, ctx, _ in prefill:  # the paths it does not split are the reference, bit for bit
        if ctx == 0 or n < cpu.SPLIT_MIN_TOKENS:
            assert torch.equal(got[s:s + n], want[s:s + n])

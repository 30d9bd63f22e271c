"""The native CPU prefill attention (dlbatch/engine/ops/_prefill_attn.c) against the torch
reference, chunk by chunk: fresh prompts and chunks over cached keys, grouped-query heads,
sliding windows, half-precision caches, and a row's result independent of how its
sequence was chunked."""
import pytest
import torch

from dlbatch.engine.ops import native, reference

pytestmark = pytest.mark.skipif(not native.prefill_available(64),
                                reason="native prefill kernel not built here (needs AVX-512 and OpenMP)")


class Meta:
    sliding_window = None


def _case(chunks, hq, hk, d, bs=16, seed=0, qkv_view=False):
    """Sequences of (ctx, n) chunks on scattered blocks of their own; every chunk's keys
    are in the cache (stored before attention, as the model does). Returns q, k, v, the
    caches, the reference's meta and the kernel's (tables, cu_q, ctx)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum((c + n + bs - 1) // bs for c, n in chunks) + 3
    kc = torch.randn(nblocks, bs, hk, d, generator=g)
    vc = torch.randn(nblocks, bs, hk, d, generator=g)
    perm = torch.randperm(nblocks, generator=g)
    prefill, tables, qs, used = [], [], 0, 0
    width = max((c + n + bs - 1) // bs for c, n in chunks)
    for ctx, n in chunks:
        nb = (ctx + n + bs - 1) // bs
        table = perm[used:used + nb]
        used += nb
        tables.append(torch.cat([table, table.new_full((width - nb,), int(perm[-1]))]))
        prefill.append((qs, n, ctx, (table.view(-1, 1) * bs + torch.arange(bs)).view(-1)[:ctx + n]))
        qs += n
    if qkv_view:  # q as the model passes it: a view of the fused QKV projection's output
        q = torch.randn(qs, (hq + 2 * hk) * d, generator=g)[:, :hq * d].view(qs, hq, d)
    else:
        q = torch.randn(qs, hq, d, generator=g)
    k = torch.randn(qs, hk, d, generator=g)
    v = torch.randn(qs, hk, d, generator=g)
    for s, n, ctx, gather in prefill:
        kc.view(-1, hk, d)[gather[ctx:]] = k[s:s + n]
        vc.view(-1, hk, d)[gather[ctx:]] = v[s:s + n]
    meta = Meta()
    meta.prefill = prefill
    cu = torch.tensor([0] + [s + n for s, n, _, _ in prefill], dtype=torch.int64)
    ctx = torch.tensor([c for _, _, c, _ in prefill], dtype=torch.int64)
    return q, k, v, kc, vc, meta, (torch.stack(tables).to(torch.int64), cu, ctx)


CHUNKS = [(0, 1), (0, 65), (0, 300), (40, 300), (512, 130), (2000, 10), (63, 1), (64, 64)]


@pytest.mark.parametrize("hq,hk,d,bs", [(9, 3, 64, 16), (4, 4, 32, 32), (8, 1, 16, 16), (16, 2, 128, 16)])
def test_matches_reference(hq, hk, d, bs):
    q, k, v, kc, vc, meta, (tables, cu, ctx) = _case(CHUNKS, hq, hk, d, bs, qkv_view=True)
    got = native.prefill_attention(q, kc, vc, tables, cu, ctx)
    assert got is not None and got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, reference.prefill_attention(q, k, v, kc, vc, meta), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window", [1, 24, 64, 100])
def test_sliding_window(window):
    q, k, v, kc, vc, meta, (tables, cu, ctx) = _case([(0, 300), (150, 90), (70, 1)], 6, 2, 32)
    meta.sliding_window = window
    got = native.prefill_attention(q, kc, vc, tables, cu, ctx, window)
    torch.testing.assert_close(got, reference.prefill_attention(q, k, v, kc, vc, meta), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_cache(dtype):
    """The kernel widens the cache's rows: the same result as the reference over the same
    rounded keys and values, in float32."""
    q, k, v, kc, vc, meta, (tables, cu, ctx) = _case(CHUNKS, 9, 3, 64)
    kh, vh = kc.to(dtype), vc.to(dtype)
    got = native.prefill_attention(q, kh, vh, tables, cu, ctx)
    # the reference reads fresh chunks' keys from k and v: give it the cache's rounded copies
    want = reference.prefill_attention(q, k.to(dtype).float(), v.to(dtype).float(), kh.float(), vh.float(), meta)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_a_rows_result_does_not_depend_on_the_chunking():
    """One 700-token sequence as one chunk, and cut into chunks at other points (as chunked
    prefill and prefix-cache hits cut it): every row bit for bit the same."""
    q, k, v, kc, vc, meta, (tables, cu, ctx) = _case([(0, 700)], 9, 3, 64)
    whole = native.prefill_attention(q, kc, vc, tables, cu, ctx)
    for cuts in ([0, 1, 700], [0, 64, 128, 700], [0, 100, 333, 650, 700], [0, 699, 700]):
        cu2 = torch.tensor(cuts, dtype=torch.int64)
        parts = native.prefill_attention(q, kc, vc, tables.expand(len(cuts) - 1, -1), cu2, cu2[:-1])
        assert torch.equal(parts, whole), cuts


def test_declines_what_it_does_not_take():
    q, k, v, kc, vc, meta, (tables, cu, ctx) = _case([(0, 20)], 4, 2, 24)  # head size not a multiple of 16
    assert native.prefill_attention(q, kc, vc, tables, cu, ctx) is None
    q, k, v, kc, vc, meta, (tables, cu, ctx) = _case([(0, 20)], 4, 2, 32)
    assert native.prefill_attention(q.bfloat16(), kc, vc, tables, cu, ctx) is None  # bf16 compute keeps SDPA


bf16_queries = pytest.mark.skipif(not native.prefill_bf16_queries(),
                                  reason="bf16 queries need a kernel built with AVX512_BF16")


@bf16_queries
@pytest.mark.parametrize("hq,hk,d,bs", [(9, 3, 64, 16), (4, 4, 32, 32), (8, 1, 16, 16), (16, 2, 128, 16)])
@pytest.mark.parametrize("window", [None, 24, 100])
def test_bf16_queries_over_a_bf16_cache_give_the_widened_queries_result(hq, hk, d, bs, window):
    """bf16 queries taken as they are (scores from vdpbf16ps on the bf16 operands, whose
    products are exact in float32; the probabilities rounded to bf16 for the weighted sum of
    the bf16 values, as torch's bf16 SDPA rounds them) against the same queries widened to
    float32 and against the float32 reference: within the probabilities' rounding (2^-9
    relative per key, well under a bf16 output's own rounding), for every head size the
    kernel takes (16 is the half-width transpose), grouped heads and sliding windows."""
    q, k, v, kc, vc, meta, (tables, cu, ctx) = _case(CHUNKS, hq, hk, d, bs, qkv_view=True)
    q = q.bfloat16()  # a view of the QKV projection's rows, as the model passes it
    kch, vch = kc.bfloat16(), vc.bfloat16()
    got = native.prefill_attention(q, kch, vch, tables, cu, ctx, window)
    assert got is not None and got.dtype == torch.float32 and got.shape == q.shape
    widened = native.prefill_attention(q.float(), kch, vch, tables, cu, ctx, window)
    torch.testing.assert_close(got, widened, rtol=1e-2, atol=1e-2)
    assert (got - widened).norm() / widened.norm() < 2e-3  # the rounding's size, not a looser bound's
    meta.sliding_window = window
    exact = reference.prefill_attention(q.float(), k.bfloat16().float(), v.bfloat16().float(), kch.float(),
                                        vch.float(), meta)
    torch.testing.assert_close(got, exact, rtol=1e-2, atol=1e-2)


@bf16_queries
def test_bf16_queries_result_does_not_depend_on_the_chunking():
    q, k, v, kc, vc, meta, (tables, cu, ctx) = _case([(0, 700)], 9, 3, 64)
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    whole = native.prefill_attention(q, kc, vc, tables, cu, ctx)
    for cuts in ([0, 1, 700], [0, 100, 333, 650, 700]):
        cu2 = torch.tensor(cuts, dtype=torch.int64)
        parts = native.prefill_attention(q, kc, vc, tables.expand(len(cuts) - 1, -1), cu2, cu2[:-1])
        assert torch.equal(parts, whole), cuts


def test_bf16_queries_over_another_cache_dtype_are_declined():
    q, k, v, kc, vc, meta, (tables, cu, ctx) = _case([(0, 20)], 4, 2, 32)
    assert native.prefill_attention(q.bfloat16(), kc.half(), vc.half(), tables, cu, ctx) is None


def test_bf16_queries_on_a_bf16_cpu_without_amx(monkeypatch):
    """A model computing in bf16 on a CPU with AVX512_BF16 and no AMX: the CPU op gives the
    kernel its bf16 queries (as they are over a bf16 cache where the kernel takes them,
    else widened) and rounds its output back; with AMX the queries stay bf16 and take SDPA."""
    from dlbatch.engine.ops import cpu

    q, k, v, kc, vc, meta, (tables, cu, ctx) = _case(CHUNKS, 9, 3, 64, qkv_view=True)
    qh, kh, vh, kch, vch = (t.bfloat16() for t in (q, k, v, kc, vc))
    meta.use_native, meta.prefill_block_tables, meta.prefill_cu_q, meta.prefill_ctx = True, tables, cu, ctx
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    got = cpu.prefill_attention(qh, kh, vh, kch, vch, meta)
    assert got.dtype == torch.bfloat16
    direct = qh if native.prefill_bf16_queries() else qh.float()
    assert torch.equal(got, native.prefill_attention(direct, kch, vch, tables, cu, ctx).bfloat16())
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    monkeypatch.setattr(native, "prefill_attention", lambda *a: pytest.fail("AMX: SDPA, not the kernel"))
    sdpa = cpu.prefill_attention(qh, kh, vh, kch, vch, meta)
    exact = reference.prefill_attention(*(t.float() for t in (qh, kh, vh, kch, vch)), meta)
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(sdpa.float(), exact, rtol=2e-2, atol=2e-2)

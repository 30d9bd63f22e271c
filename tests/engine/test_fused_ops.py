"""The fused CPU elementwise ops (dlbatch/engine/ops/_fused.c) against the reference ops:
rms_norm (+ residual), silu_and_mul, rotary + KV store; ragged widths, float32/16/bf16
caches, skipped slots, row results independent of the batch, both thread builds."""
import pytest
import torch

from dlbatch.engine.ops import cpu, native, reference

pytestmark = pytest.mark.skipif(native.FUSED.get() is None,
                                reason="native kernels unavailable (no C compiler, or DLBATCH_NATIVE=0): the torch path is used")

TOL = dict(rtol=2e-6, atol=2e-6)


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,n", [(1, 576), (7, 13), (300, 960), (64, 2048)])
def test_rms_norm_and_add_rms_norm_match_the_reference(rows, n):
    g = _g(rows)
    x, res = torch.randn(rows, n, generator=g) * 3, torch.randn(rows, n, generator=g)
    w = torch.rand(n, generator=g) + 0.5
    out = native.rms_norm(x, w, 1e-5)
    assert out is not None
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-5), **TOL)
    got, h = native.rms_norm(x, w, 1e-6, res)
    want, want_h = reference.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(h, want_h)  # one addition: the same bits
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(x, x.clone()) and h.data_ptr() != res.data_ptr()  # inputs are not written


def test_rms_norm_takes_strided_rows_and_declines_what_it_cannot():
    g = _g(1)
    qkv = torch.randn(9, 96, generator=g)
    x = qkv[:, 16:80]  # rows 96 floats apart
    w = torch.rand(64, generator=g)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), **TOL)
    heads = qkv[:, :64].view(9, 4, 16)  # per-head norm (qk_norm): not rows of one stride
    assert native.rms_norm(heads, w[:16], 1e-6) is None
    torch.testing.assert_close(cpu.rms_norm(heads, w[:16], 1e-6), reference.rms_norm(heads, w[:16], 1e-6), **TOL)
    assert native.rms_norm(x.half(), w.half(), 1e-6) is None  # float16 rows: the reference
    assert native.rms_norm(x.bfloat16(), w, 1e-6) is None  # a weight of another dtype
    assert native.rms_norm(x, w[:10], 1e-6) is None


@pytest.mark.parametrize("rows,n", [(1, 1536), (5, 11), (200, 1536)])
def test_silu_and_mul_matches_the_reference(rows, n):
    g = _g(n)
    x = torch.randn(rows, 2 * n, generator=g) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, -87.5, 89.0])  # exp's clamps: silu -> -0, x; no inf/nan
    got = native.silu_and_mul(x)
    assert got is not None and torch.isfinite(got).all()
    torch.testing.assert_close(got, reference.silu_and_mul(x), rtol=4e-6, atol=1e-6)
    assert native.silu_and_mul(x[:, :-1]) is None  # odd width


def test_rows_do_not_depend_on_the_batch():
    """A row computed alone gives the bits it gives inside a big, multi-threaded call."""
    g = _g(2)
    x, res = torch.randn(400, 576, generator=g), torch.randn(400, 576, generator=g)
    w = torch.rand(576, generator=g)
    big, big_h = native.rms_norm(x, w, 1e-5, res)
    up = torch.randn(400, 3072, generator=g)
    act = native.silu_and_mul(up)
    for i in (0, 17, 399):
        one, one_h = native.rms_norm(x[i:i + 1], w, 1e-5, res[i:i + 1])
        assert torch.equal(one, big[i:i + 1]) and torch.equal(one_h, big_h[i:i + 1])
        assert torch.equal(native.silu_and_mul(up[i:i + 1]), act[i:i + 1])


def _rotary_case(t: int, hq: int, hk: int, d: int, blocks: int = 12, bs: int = 16, seed: int = 0):
    blocks = max(blocks, t // bs + 2)
    g = _g(seed)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    ang = torch.rand(t, d // 2, generator=g) * 50
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    slots = torch.randperm(blocks * bs, generator=g)[:t]
    return q, k, v, cos, sin, slots, (blocks, bs, hk, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,hq,hk,d", [(1, 9, 3, 64), (37, 4, 2, 80), (300, 8, 8, 20)])
def test_rotary_store_matches_the_reference(dtype, t, hq, hk, d):
    q, k, v, cos, sin, slots, shape = _rotary_case(t, hq, hk, d)
    kc_ref, vc_ref = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    want_q, want_k = reference.rotary_store_kv(q.clone(), k.clone(), v.clone(), cos, sin, kc_ref, vc_ref, slots)
    kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    v_before = v.clone()
    got = native.rotary_store_kv(q, k, v, cos, sin, kc, vc, slots)
    assert got is not None and got[0] is q and got[1] is k  # in place, into the projection's output
    torch.testing.assert_close(q, want_q, **TOL)
    torch.testing.assert_close(k, want_k, **TOL)
    assert torch.equal(v, v_before)
    assert torch.equal(vc, vc_ref)  # v is only converted: the same rounding as torch's .to()
    if dtype == torch.float32:
        torch.testing.assert_close(kc, kc_ref, **TOL)
    else:  # k from (nearly) the same floats, rounded once
        assert torch.equal(kc, k.to(dtype).new_zeros(shape).view(-1, hk, d).index_copy_(0, slots, k.to(dtype)).view(shape))
        torch.testing.assert_close(kc.float(), kc_ref.float(), rtol=1e-2, atol=1e-2)


def test_rotary_store_skips_negative_slots_and_rounds_bf16_as_torch():
    q, k, v, cos, sin, slots, shape = _rotary_case(6, 2, 2, 16)
    slots[2] = -1
    v[0, 0, :4] = torch.tensor([float("nan"), 1.00390625, 1.01171875, -3.0e38])  # ties to even, NaN
    kc, vc = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    native.rotary_store_kv(q, k, v, cos, sin, kc, vc, slots)
    flat = vc.view(-1, 2, 16)
    keep = slots >= 0
    want = v[keep].to(torch.bfloat16)
    got = flat[slots[keep]]
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0), want.nan_to_num(0))
    assert int(vc.float().nan_to_num(1.0).view(vc.shape[0] * vc.shape[1], -1).ne(0).any(-1).sum()) == int(keep.sum())  # none for slot -1


def test_rotary_store_declines_what_it_cannot_and_leaves_it_untouched():
    q, k, v, cos, sin, slots, shape = _rotary_case(4, 2, 1, 16)
    kc, vc = torch.zeros(shape), torch.zeros(shape)
    q0 = q.clone()
    assert native.rotary_store_kv(q.double(), k.double(), v.double(), cos.double(), sin.double(),
                                  kc, vc, slots) is None
    assert native.rotary_store_kv(q, k, v, cos.bfloat16(), sin.bfloat16(), kc, vc, slots) is None
    assert native.rotary_store_kv(q, k, v, cos[:3], sin[:3], kc, vc, slots) is None
    assert torch.equal(q, q0) and not kc.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rotary_rounds_where_the_reference_rounds(dtype):
    """A model computing in bf16 (AMX CPUs) or fp16: widened to float32, each product and sum
    rounded where the reference's chain of half-precision ops rounds: the same bits."""
    q, k, v, cos, sin, slots, shape = _rotary_case(50, 9, 3, 64)
    q, k, v, cos, sin = (t.to(dtype) for t in (q, k, v, cos, sin))
    kc_ref, vc_ref = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    want_q, want_k = reference.rotary_store_kv(q.clone(), k.clone(), v.clone(), cos, sin, kc_ref, vc_ref, slots)
    kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    assert native.rotary_store_kv(q, k, v, cos, sin, kc, vc, slots) is not None
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    kf, vf = torch.zeros(shape), torch.zeros(shape)  # a float32 cache under a half-precision model: widened exactly
    native.rotary_store_kv(want_q.clone(), k.clone(), v, cos, sin, kf, vf, slots)
    assert torch.equal(vf, vc_ref.float())


def test_bf16_rows_round_where_the_reference_rounds():
    """rms_norm (+ residual) of a bf16 model: widened, each result rounded where the
    reference's bf16 chain rounds. The squares summed in another order may move a result by a
    unit or two in the last place (a rounded product of a value one unit off); nearly all are
    the same bits, and the residual sum always is."""
    def same_but_last_bits(got, want):
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-6)
        assert (got == want).float().mean().item() >= 0.99

    g = _g(5)
    x = (torch.randn(300, 963, generator=g) * 3).bfloat16()  # a width that is no multiple of 8
    res = torch.randn(300, 963, generator=g).bfloat16()
    w = (torch.rand(963, generator=g) + 0.5).bfloat16()
    same_but_last_bits(native.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    got, h = native.rms_norm(x, w, 1e-5, res)
    want, want_h = reference.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(h, want_h)
    same_but_last_bits(got, want)
    if not native.FUSED.get().dl_fused_bf16_width():  # bf16 on the 8-wide path: torch's is faster
        assert native.silu_and_mul(torch.randn(4, 64).bfloat16()) is None
    x[5, 3] = float("nan")
    assert native.rms_norm(x, w, 1e-5)[5].isnan().all() and not native.rms_norm(x, w, 1e-5)[6].isnan().any()
    one = native.rms_norm(x[7:8], w, 1e-5, res[7:8])  # a row alone: the bits it has in the batch
    assert torch.equal(one[0], native.rms_norm(x, w, 1e-5, res)[0][7:8])
    x16 = torch.randn(4, 64).half()
    assert native.rms_norm(x16, torch.ones(64).half(), 1e-6) is None and native.silu_and_mul(x16) is None


@pytest.mark.skipif(native.FUSED.get() is None or not native.FUSED.get().dl_fused_bf16_width(),
                    reason="bf16 silu_and_mul runs in C only on AVX-512 (elsewhere torch's)")
@pytest.mark.parametrize("rows,n", [(1, 1536), (9, 19), (300, 1536)])
def test_bf16_silu_and_mul_gives_the_references_bits(rows, n):
    """silu rounded to bf16 as torch's bf16 silu stores it, then the product rounded: the
    reference's bits, exp's clamps included (silu -> -0 far below zero, x far above), for
    widths with a tail and for a row computed alone."""
    g = _g(n)
    x = (torch.randn(rows, 2 * n, generator=g) * 4).bfloat16()
    x[0, :5] = torch.tensor([-100.0, 100.0, -87.5, 89.0, -3.0e38])
    got = native.silu_and_mul(x)
    want = reference.silu_and_mul(x)
    assert got is not None and got.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    assert torch.equal(native.silu_and_mul(x[-1:]), got[-1:])


def test_posix_build_gives_the_openmp_bits(monkeypatch):
    from dlbatch.cbuild import load

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    g = _g(4)
    x, res, w = torch.randn(300, 576, generator=g), torch.randn(300, 576, generator=g), torch.rand(576, generator=g)
    up = torch.randn(300, 3072, generator=g)
    q, k, v, cos, sin, slots, shape = _rotary_case(300, 9, 3, 64, blocks=40)
    omp = [*native.rms_norm(x, w, 1e-5, res), native.silu_and_mul(up)]
    kc, vc = torch.zeros(shape), torch.zeros(shape)
    omp += [*native.rotary_store_kv(q.clone(), k.clone(), v, cos, sin, kc, vc, slots), kc, vc]
    posix = native.bind_fused(load(native.FUSED.src, native.POSIX_FLAGS))
    assert posix._name != native.FUSED.get()._name
    monkeypatch.setattr(native.FUSED, "lib", posix)
    got = [*native.rms_norm(x, w, 1e-5, res), native.silu_and_mul(up)]
    kc2, vc2 = torch.zeros(shape), torch.zeros(shape)
    got += [*native.rotary_store_kv(q.clone(), k.clone(), v, cos, sin, kc2, vc2, slots), kc2, vc2]
    assert all(torch.equal(a, b) for a, b in zip(omp, got))


def test_cpu_ops_choose_the_fused_kernels():
    from dlbatch.engine.ops.resolve import get_ops

    chosen = get_ops("cpu").chosen
    assert {chosen[n] for n in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_store_kv")} == {"cpu"}

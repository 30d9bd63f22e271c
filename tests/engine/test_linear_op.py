"""The CPU linear op: weights packed once for oneDNN give F.linear's result at every batch
size a step can have (decode rows, prefill chunks), with and without bias."""
import pytest
import torch
import torch.nn.functional as F

from dlbatch.engine.device import cpu_flags as real_flags
from dlbatch.engine.ops import cpu, get_ops


@pytest.mark.parametrize("rows", [1, 7, 24, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows, with_bias):
    ops = get_ops("cpu")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 64, generator=g)
    packed = ops.pack_linear(w)
    if torch.backends.mkldnn.is_available():
        assert packed.is_mkldnn
    torch.testing.assert_close(ops.linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    x3 = x.view(1, rows, 64)
    assert ops.linear(x3, packed, b).shape == (1, rows, 96)


def test_packed_linear_row_is_the_same_whatever_the_batch():
    """A row's result has the same bits alone and among others (a resumed sampling job
    batches differently and must draw the same tokens). The shape is SmolLM2-135M's down
    projection, where oneDNN's one-row kernel differed in the last bits on an AVX-512 CPU."""
    ops = get_ops("cpu")
    g = torch.Generator().manual_seed(0)
    packed = ops.pack_linear(torch.randn(576, 1536, generator=g) * 0.02)
    x = torch.randn(300, 1536, generator=g)
    first = ops.linear(x[:2], packed)[:1]
    for rows in (1, 3, 24, 300):
        assert torch.equal(ops.linear(x[:rows], packed)[:1], first), rows


@pytest.mark.parametrize("rows", [1, 2, 8, 24, 300])
def test_packed_bf16_linear_matches_f_linear_and_is_the_same_whatever_the_batch(monkeypatch, rows):
    """On a CPU with AVX512_BF16 and no AMX bf16 weights are packed too (oneDNN's bf16 GEMM,
    float32 accumulation): F.linear's result within bf16 rounding, and each row's bits the
    same alone and among others."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN is not built into this torch")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    ops = get_ops("cpu")
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(576, 1536, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(300, 1536, generator=g).to(torch.bfloat16)
    packed = ops.pack_linear(w)
    assert packed.is_mkldnn
    torch.testing.assert_close(ops.linear(x[:rows], packed), F.linear(x[:rows], w), rtol=2e-2, atol=2e-2)
    if "amx_bf16" in real_flags():  # oneDNN takes its AMX kernels whatever we pretend; bf16 is not packed there
        return
    first = ops.linear(x[:2], packed)
    assert torch.equal(ops.linear(x[:rows], packed)[:min(rows, 2)], first[:min(rows, 2)])


def test_pack_linear_keeps_plain_weights_when_disabled_or_not_float32(monkeypatch):
    ops = get_ops("cpu")
    w16 = torch.randn(8, 4).to(torch.bfloat16)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    assert ops.pack_linear(w16) is w16  # AMX: F.linear's bf16 path (the packed one was not measured there)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2"}))
    assert ops.pack_linear(w16) is w16
    monkeypatch.setenv("DLBATCH_ONEDNN", "0")
    w = torch.randn(8, 4)
    assert ops.pack_linear(w) is w
    x = torch.randn(3, 4)
    torch.testing.assert_close(ops.linear(x, w), F.linear(x, w))

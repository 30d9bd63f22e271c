"""The compute dtype per CPU kind (dlbatch/engine/device.py): decided from the CPU's flags
by the measured table, never by a constant."""
from __future__ import annotations

import logging

import pytest

from dlbatch.engine import device
from dlbatch.engine.device import compute_dtype, cpu_compute_dtype, cpu_kind

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}


def test_kind_is_the_most_capable_flag_present():
    assert cpu_kind(AMX) == "amx"
    assert cpu_kind(AVX512_BF16) == "avx512_bf16"
    assert cpu_kind(AVX2 | {"avx512f"}) == "avx2"  # AVX-512 without BF16: no native bf16 at all
    assert cpu_kind(AVX2) == "avx2"
    assert cpu_kind(frozenset({"sse2"})) == "other"


@pytest.mark.parametrize("flags, bf16, fp16", [
    (AMX, "bfloat16", "float32"),  # AMX-BF16 without AMX-FP16: fp16 runs at the fp32 rate, unfused
    (AMX | {"amx_fp16"}, "bfloat16", "float16"),
    (AVX512_BF16, "float32", "float32"),  # bf16 matmuls at half the fp32 rate without AMX
    (AVX2, "float32", "float32"),
    (frozenset(), "float32", "float32"),
])
def test_half_dtypes_per_kind(flags, bf16, fp16):
    assert cpu_compute_dtype("bfloat16", flags) == bf16
    assert cpu_compute_dtype("float16", flags) == fp16
    assert cpu_compute_dtype("float32", flags) == "float32"


def test_compute_dtype_reads_this_machines_flags_and_logs_an_upcast(monkeypatch, caplog):
    monkeypatch.setattr(device, "cpu_flags", lambda: AVX512_BF16)
    with caplog.at_level(logging.INFO, logger="dlbatch.engine"):
        assert compute_dtype("bfloat16", "cpu") == "float32"
    assert "avx512_bf16" in caplog.text and "bfloat16" in caplog.text
    assert compute_dtype("bfloat16", "cpu", allow_upcast=False) == "bfloat16"
    assert compute_dtype("bfloat16", "cuda") == "bfloat16"  # the table is for CPUs
    monkeypatch.setattr(device, "cpu_flags", lambda: AMX)
    assert compute_dtype("bfloat16", "cpu") == "bfloat16"


def test_an_upcast_needs_the_float32_weights_to_fit(monkeypatch):
    """A bf16 model whose float32 copy would take more than half the free memory runs in
    bf16 (slower, but it fits); one that fits is upcast."""
    monkeypatch.setattr(device, "cpu_flags", lambda: AVX512_BF16)
    gib = 1 << 30
    assert compute_dtype("bfloat16", "cpu", params=8 * 10**9, available=24 * gib) == "bfloat16"
    assert compute_dtype("bfloat16", "cpu", params=135 * 10**6, available=24 * gib) == "float32"
    assert compute_dtype("float16", "cpu", params=3 * gib, available=24 * gib) == "float32"  # 12 GiB of 24: fits
    assert compute_dtype("float16", "cpu", params=3 * gib + 1, available=24 * gib) == "float16"

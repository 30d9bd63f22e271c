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


ZEN4 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}  # no AVX512-FP16
INTEL, AMD = "GenuineIntel", "AuthenticAMD"


@pytest.fixture
def intel(monkeypatch):
    monkeypatch.setattr(device, "cpu_vendor", lambda: INTEL)


def test_kind_is_the_most_capable_flag_present():
    assert cpu_kind(AMX, INTEL) == "amx"
    assert cpu_kind(AVX512_BF16, INTEL) == "avx512_bf16"
    assert cpu_kind(ZEN4, AMD) == "avx512_bf16_amd"
    assert cpu_kind(ZEN4, INTEL) == "avx512_bf16"  # e.g. Cooper Lake: Intel's two 512-bit FMA ports
    assert cpu_kind(AVX2 | {"avx512f"}, AMD) == "avx2"  # AVX-512 without BF16 (Zen 3 has none): no native bf16
    assert cpu_kind(AVX2, INTEL) == "avx2"
    assert cpu_kind(frozenset({"sse2"}), "") == "other"


@pytest.mark.parametrize("flags, vendor, bf16, fp16", [
    (AMX, INTEL, "bfloat16", "float32"),  # AMX-BF16 without AMX-FP16: fp16 runs at the fp32 rate, unfused
    (AMX | {"amx_fp16"}, INTEL, "bfloat16", "float16"),
    (AVX512_BF16, INTEL, "float32", "float32"),  # bf16 matmuls at half the fp32 rate without AMX
    (ZEN4, AMD, "bfloat16", "float32"),  # bf16 dot products at twice Zen 4's fp32 FMA rate
    (AVX2, AMD, "float32", "float32"),
    (frozenset(), "", "float32", "float32"),
])
def test_half_dtypes_per_kind(flags, vendor, bf16, fp16):
    assert cpu_compute_dtype("bfloat16", flags, vendor) == bf16
    assert cpu_compute_dtype("float16", flags, vendor) == fp16
    assert cpu_compute_dtype("float32", flags, vendor) == "float32"


def test_compute_dtype_reads_this_machines_flags_and_logs_an_upcast(monkeypatch, caplog, intel):
    monkeypatch.setattr(device, "cpu_flags", lambda: AVX512_BF16)
    with caplog.at_level(logging.INFO, logger="dlbatch.engine"):
        assert compute_dtype("bfloat16", "cpu") == "float32"
    assert "avx512_bf16" in caplog.text and "bfloat16" in caplog.text
    assert compute_dtype("bfloat16", "cpu", allow_upcast=False) == "bfloat16"
    assert compute_dtype("bfloat16", "cuda") == "bfloat16"  # the table is for CPUs
    monkeypatch.setattr(device, "cpu_flags", lambda: AMX)
    assert compute_dtype("bfloat16", "cpu") == "bfloat16"
    monkeypatch.setattr(device, "cpu_flags", lambda: ZEN4)
    monkeypatch.setattr(device, "cpu_vendor", lambda: AMD)
    assert compute_dtype("bfloat16", "cpu") == "bfloat16"


def test_an_upcast_needs_the_float32_weights_to_fit(monkeypatch, intel):
    """A bf16 model whose float32 copy would take more than half the free memory runs in
    bf16 (slower, but it fits); one that fits is upcast."""
    monkeypatch.setattr(device, "cpu_flags", lambda: AVX512_BF16)
    gib = 1 << 30
    assert compute_dtype("bfloat16", "cpu", params=8 * 10**9, available=24 * gib) == "bfloat16"
    assert compute_dtype("bfloat16", "cpu", params=135 * 10**6, available=24 * gib) == "float32"
    assert compute_dtype("float16", "cpu", params=3 * gib, available=24 * gib) == "float32"  # 12 GiB of 24: fits
    assert compute_dtype("float16", "cpu", params=3 * gib + 1, available=24 * gib) == "float16"

"""What the device can compute fast: on CPUs without native bf16/fp16 matrix instructions
(AVX512-BF16, AMX, AVX512-FP16) torch emulates half-precision matmuls, several times
slower than fp32 — on this project's AVX2 CI machines we measured bf16 at 7 GFLOP/s vs
fp32 at 50 GFLOP/s on one core. There the engine stores and computes in fp32 and says so."""
from __future__ import annotations

import functools
import logging

log = logging.getLogger("dlbatch.engine")


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_native_half(dtype_name: str) -> bool:
    flags = cpu_flags()
    if dtype_name == "bfloat16":
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    if dtype_name == "float16":
        return bool({"avx512_fp16", "amx_fp16"} & flags)
    return True


def compute_dtype(dtype_name: str, device_type: str, allow_upcast: bool = True) -> str:
    """The dtype the engine actually runs in for a requested `dtype_name`."""
    if device_type == "cpu" and allow_upcast and not cpu_native_half(dtype_name):
        log.info("CPU has no native %s matmul: computing in float32 (faster here, and at least as exact)",
                 dtype_name)
        return "float32"
    return dtype_name

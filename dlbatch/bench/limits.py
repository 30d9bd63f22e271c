"""The machine's physical limits, measured on the spot: peak matmul FLOP/s per dtype
(large square matmuls) and memory copy bandwidth (a large tensor copy).

Copy bandwidth is reported STREAM-style, counting bytes read + bytes written
(`2 * nbytes / t`): that is the memory traffic the copy moved, the figure to hold a
read-bound decode step against. `copy_GBps_one_way` (`nbytes / t`) is kept in the JSON.
Limits are the best of their repeats (what the machine can do; on a shared machine the
median is dragged down by other jobs), and the medians are in the JSON too.
"""
from __future__ import annotations

import time

from dlbatch.bench.common import median, sync

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def torch_dtype(name: str):
    import torch

    return getattr(torch, _DTYPES.get(name, name))


def matmul_peak(dtype: str, device: str = "cpu", repeats: int = 3, max_n: int | None = None,
                target_s: float = 0.15) -> dict:
    """Peak (best of `repeats`; the median is kept too) FLOP/s of an n x n @ n x n matmul; n grows (powers of two) until one call
    takes `target_s` or n reaches `max_n` (CPU 2048, CUDA 8192), so slow dtypes stay cheap."""
    import torch

    dt = torch_dtype(dtype)
    cuda = str(device).startswith("cuda")
    max_n = max_n or (8192 if cuda else 2048)
    n = 512 if not cuda else 4096
    while True:
        a = torch.randn(n, n, device=device).to(dt)
        b = torch.randn(n, n, device=device).to(dt)
        torch.mm(a, b)
        sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        one = time.perf_counter() - t0
        if one >= target_s or n >= max_n:
            break
        n *= 2
    inner = 1 if one >= target_s or not cuda else max(1, int(target_s / max(one, 1e-6)))
    ts = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        sync(device)
        ts.append((time.perf_counter() - t0) / inner)
    t = min(ts)
    return {"dtype": _DTYPES.get(dtype, dtype), "n": n, "seconds": t, "flops": 2.0 * n ** 3 / t,
            "median_flops": 2.0 * n ** 3 / median(ts), "repeats": repeats}


def copy_bandwidth(device: str = "cpu", nbytes: int = 256 << 20, repeats: int = 5) -> dict:
    """Best-of-`repeats` bandwidth (a limit; the median is kept too) of `dst.copy_(src)` over an `nbytes` tensor (far larger than any
    cache by default)."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    ts = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        ts.append(time.perf_counter() - t0)
    t = min(ts)
    return {"bytes": nbytes, "seconds": t, "median_copy_GBps": 2 * nbytes / median(ts) / 1e9, "copy_GBps": 2 * nbytes / t / 1e9, "copy_GBps_one_way": nbytes / t / 1e9,
            "repeats": repeats}


def measure(dtypes, device: str = "cpu", quick: bool = False) -> dict:
    """Peak matmul FLOP/s for each dtype in `dtypes` (fp32 always included) and copy bandwidth."""
    out = {"matmul": {}, "device": device}
    names = []
    for d in list(dtypes) + ["float32"]:
        d = _DTYPES.get(d, d)
        if d not in names:
            names.append(d)
    cuda = str(device).startswith("cuda")
    for d in names:
        out["matmul"][d] = matmul_peak(d, device, repeats=3, max_n=(1024 if quick and not cuda else None),
                                       target_s=(0.05 if quick else 0.15))
    out["copy"] = copy_bandwidth(device, nbytes=(64 << 20) if quick else ((1 << 30) if cuda else (256 << 20)),
                                 repeats=3 if quick else 5)
    return out



def merge_best(a: dict, b: dict) -> dict:
    """Limits measured twice (before and after the workload): keep the best of each, so a
    burst of load from other jobs during one measurement does not lower the roofline."""
    out = {"matmul": {}, "device": a.get("device"), "measurements": 2}
    for d in a["matmul"]:
        x, y = a["matmul"][d], b["matmul"].get(d, a["matmul"][d])
        out["matmul"][d] = x if x["flops"] >= y["flops"] else y
    out["copy"] = a["copy"] if a["copy"]["copy_GBps"] >= b["copy"]["copy_GBps"] else b["copy"]
    return out

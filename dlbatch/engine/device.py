"""What the device computes fast. On a CPU the engine computes a half-precision request
(``model.dtype: bfloat16`` or ``float16``) in the dtype that is fastest on that CPU kind,
chosen from the CPU's flags at run time by a table of measured figures (``CPU_KINDS``
below; the figures, on 2 vCPUs with torch 2.13: docs/benchmarks.md, "Which dtype the
engine computes in, per CPU kind"). The first kind whose flag the CPU has applies:

- ``amx`` (``amx_bf16``): bf16 stays bf16 (AMX: bf16 matmul 2,098 GFLOP/s against 354 in
  fp32; the paper workload 11.8 s against 25.8 s).
- ``avx512_bf16_amd`` (an AMD CPU with AVX512_BF16, Zen 4 and later; no AMX): bf16 stays
  bf16. Zen 4 runs AVX-512 on 256-bit units, so an fp32 FMA does half the work per cycle of
  Intel's two 512-bit ports, while ``vdpbf16ps`` does twice the fp32 FMA's multiply-adds: a
  model's layer linears at 8 to 2,048 rows run at 272-425 GFLOP/s in bf16 (oneDNN packed)
  against 163-215 in fp32; a 2K-token prefill 1,020 tokens/s against 686; a 32-sequence
  decode step 1.6x faster.
- ``avx512_bf16`` (any other CPU with AVX-512 + AVX512_BF16 and no AMX; measured on Intel
  Xeon): fp32. ``vdpbf16ps`` does as many
  multiply-adds per cycle as the two fp32 FMA ports, and every bf16 op converts on the
  way: a model's layer linears at 24 to 2,048 rows (decode batches of a batch job, prefill
  chunks) run at 122-156 GFLOP/s in bf16 against 181-264 in fp32; a 2K-token prefill 430
  tokens/s in bf16 against 865 in fp32; the paper workload 42.4 s against 30.3 s. bf16
  is faster only at one row (level at eight) through oneDNN's packed bf16 path (a step
  there reads the weights, and bf16 reads half the bytes), which the engine does not take.
- ``avx2`` and anything else: fp32 (torch emulates bf16: 1.1-1.3 GFLOP/s against 91.5).

fp16 stays fp16 only with AMX-FP16 (``amx_fp16``): AVX512-FP16 matmuls run at the fp32
rate inside oneDNN (374-398 GFLOP/s) while the engine's fp16 elementwise ops are torch's
unfused ones (a 2K-token prefill: 221 tokens/s against 865 in fp32, on the avx512_bf16
kind, whose AVX512-FP16 is the one AMX-BF16 CPUs have).

An upcast needs the float32 weights to fit (``compute_dtype``'s memory check); the KV
cache follows the compute dtype unless ``kv_cache_dtype`` says otherwise (on the
avx512_bf16 kind a bf16 cache under fp32 compute saves ~9 ms of a ~150 ms paper-workload
decode step, within that workload's run-to-run spread). An upcast is logged;
``allow_upcast=False`` keeps the requested dtype."""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

log = logging.getLogger("dlbatch.engine")


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (``GenuineIntel``, ``AuthenticAMD``), or "" when unknown."""
    return _cpuinfo().get("vendor_id", "")


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


# (kind, the flag that defines it, the vendor it needs or None, {requested half dtype: the dtype
# computed; fp32 if absent}), most capable first; the first kind that matches applies (the module
# docstring)
CPU_KINDS = (
    ("amx", "amx_bf16", None, {"bfloat16": "bfloat16"}),
    ("avx512_bf16_amd", "avx512_bf16", "AuthenticAMD", {"bfloat16": "bfloat16"}),
    ("avx512_bf16", "avx512_bf16", None, {}),
    ("avx2", "avx2", None, {}),
)
FP16_FLAG = "amx_fp16"  # fp16 is kept only where AMX multiplies it


def cpu_kind(flags: frozenset[str] | None = None, vendor: str | None = None) -> str:
    """The CPU kind of the table above for ``flags`` and ``vendor`` (this machine's when None):
    ``amx``, ``avx512_bf16_amd``, ``avx512_bf16``, ``avx2`` or ``other``."""
    flags = cpu_flags() if flags is None else flags
    vendor = cpu_vendor() if vendor is None else vendor
    return next((kind for kind, flag, who, _ in CPU_KINDS if flag in flags and who in (None, vendor)), "other")


def cpu_compute_dtype(dtype_name: str, flags: frozenset[str] | None = None, vendor: str | None = None) -> str:
    """The dtype a CPU with ``flags`` and ``vendor`` (this machine's when None) computes a
    ``dtype_name`` model in fastest: float32 stays float32; a half dtype stays only where the
    table says."""
    if dtype_name == "float32":
        return "float32"
    flags = cpu_flags() if flags is None else flags
    if dtype_name == "float16":
        return "float16" if FP16_FLAG in flags else "float32"
    kind = cpu_kind(flags, vendor)
    table = next((t for k, _, _, t in CPU_KINDS if k == kind), {})
    return table.get(dtype_name, "float32")


UPCAST_MEMORY_SHARE = 0.5  # an upcast model's float32 weights may take at most this share of the free memory


def compute_dtype(dtype_name: str, device_type: str, allow_upcast: bool = True, params: int | None = None,
                  available: int | None = None) -> str:
    """The dtype the engine actually runs in for a requested `dtype_name`. With ``params``
    (the model's parameter count) and ``available`` (free host bytes), an upcast to float32
    happens only when the float32 weights take at most UPCAST_MEMORY_SHARE of the free
    memory: a half-precision model that fits only in half precision runs as asked (slower
    on these CPUs, but it runs)."""
    if device_type != "cpu" or not allow_upcast:
        return dtype_name
    chosen = cpu_compute_dtype(dtype_name)
    if chosen == dtype_name:
        return chosen
    if params is not None and available is not None and 4 * params > UPCAST_MEMORY_SHARE * available:
        log.info("CPU kind %s: %s matmuls are slower than float32 here, but %.1f GiB of float32 weights would "
                 "take more than %.0f%% of the %.1f GiB free: computing in %s", cpu_kind(), dtype_name,
                 4 * params / 2**30, 100 * UPCAST_MEMORY_SHARE, available / 2**30, dtype_name)
        return dtype_name
    log.info("CPU kind %s: %s matmuls are slower than float32 here (dlbatch/engine/device.py, "
             "docs/benchmarks.md): computing in float32", cpu_kind(), dtype_name)
    return chosen


# glibc malloc settings for an engine on the CPU (keep_freed_memory)
MALLOC_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
MALLOC_TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks of up to 32 MiB in the process instead of
    handing them back to the OS. Every step of the engine allocates its activations afresh
    (megabytes per op at prefill sizes), and by default glibc serves such blocks from fresh
    mappings and returns them on free, so each step touches new pages and page-faults on
    every one of them, which is slow in a virtual machine. Called once per process by an
    engine on the CPU; True when the settings took. ``DLBATCH_MALLOPT=0`` leaves malloc alone
    (measurements: docs/benchmarks.md)."""
    if os.environ.get("DLBATCH_MALLOPT", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return (mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD) == 1)


# KV cache size on CUDA when none is asked for: this share of the device's memory (times
# the worker's share of the device), less what the worker already holds (its weights).
DEFAULT_CUDA_KV_FRACTION = 0.85


def kv_cache_bytes(setting: int | float | None, free: int, total: int, own: int = 0,
                   share: float = 1.0) -> int | None:
    """Bytes of KV cache for a worker. ``setting``: int bytes, float in (0, 1] a fraction
    of the ``free`` memory (device or host) seen at start, None the device default: the
    worker's ``share`` of the device (a pool's ``num_gpus`` below 1: two workers at 0.5
    each fit) times DEFAULT_CUDA_KV_FRACTION of ``total``, less ``own`` (what this engine
    holds itself: its weights and its start-up forward's activation peak, engine/profile.py;
    not what other engines of the process hold), never more than 95 % of ``free``."""
    if setting is None:
        share = min(1.0, share) if share > 0 else 1.0
        return max(0, min(int(free * 0.95), int(total * DEFAULT_CUDA_KV_FRACTION * share) - own))
    if isinstance(setting, float):
        if not 0.0 < setting <= 1.0:
            raise ValueError(f"kv_cache_memory fraction must be in (0, 1], got {setting!r}")
        return int(free * setting)
    return int(setting)


def resolve_device(device: str, visible: str | None, count: int) -> str:
    """The device string to use inside this process. Ray gives an actor with ``num_gpus``
    its GPUs by setting CUDA_VISIBLE_DEVICES, so inside it they are ``cuda:0..count-1``
    whatever their physical ids: ``cuda`` is ``cuda:0``; ``cuda:N`` beyond ``count`` that
    names a visible physical id maps to its local index; anything else is an error naming
    the value."""
    if not device.startswith("cuda"):
        return device
    if count == 0:
        raise ValueError(f"device {device!r}: no CUDA device is visible in this process "
                         f"(CUDA_VISIBLE_DEVICES={visible!r}); give the pool num_gpus > 0")
    if device == "cuda":
        return "cuda:0"
    idx_s = device.partition(":")[2]
    if not idx_s.isdigit():
        raise ValueError(f"device {device!r} is not 'cuda' or 'cuda:N'")
    idx = int(idx_s)
    if idx < count:
        return device
    ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if idx_s in ids and ids.index(idx_s) < count:
        return f"cuda:{ids.index(idx_s)}"
    raise ValueError(f"device {device!r}: this process sees {count} CUDA device(s) (cuda:0..cuda:{count - 1}, "
                     f"CUDA_VISIBLE_DEVICES={visible!r}); under Ray a worker's GPUs are renumbered from 0, so use "
                     "'cuda' (or 'cuda:K' for K < num_gpus)")

"""CPU ops backed by small C kernels (``_paged_attn.c``, ``_argmax.c``), compiled on first use by
:mod:`dlbatch.native`. Unavailable (no compiler, ``DLBATCH_NATIVE=0``, a shape or dtype
it does not take) -> ``None`` and the caller uses its torch path."""
from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

log = logging.getLogger("dlbatch.engine")

_SRC = Path(__file__).with_name("_paged_attn.c")
_LOCK = threading.Lock()
_LIB = None
_TRIED = False
_ARGMAX_SRC = Path(__file__).with_name("_argmax.c")
_ARGMAX = None
_ARGMAX_TRIED = False
_P = ctypes.c_void_p
_I = ctypes.c_int
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


OPENMP_FLAGS = ("-O3", "-march=native", "-fopenmp")
POSIX_FLAGS = ("-O3", "-march=native", "-pthread")


def _load(src: Path):
    """Built with OpenMP when the compiler has it, else with POSIX threads. With OpenMP the
    kernels' parallel regions run on torch's own worker threads (the process has one
    libgomp, torch's, which our library's libgomp.so.1 resolves to). Those workers spin for
    a while after each of torch's parallel regions, so threads of our own started then would
    compete with them for the cores (docs/benchmarks.md)."""
    from dlbatch.native import load

    try:
        return load(src, OPENMP_FLAGS)
    except OSError as e:
        log.info("building %s with OpenMP failed (%s); using POSIX threads", src.name, e)
        return load(src, POSIX_FLAGS)


def bind_decode(L):
    """Declare dl_paged_decode's C signature on a loaded library; returns it."""
    L.dl_paged_decode.restype = _I
    L.dl_paged_decode.argtypes = [_P] * 6 + [_I] * 7 + [ctypes.c_float, _I, _I]
    L.dl_paged_decode_width.restype = _I  # floats per vector used for a head size (8, or 16 with AVX-512)
    L.dl_paged_decode_width.argtypes = [_I]
    return L


def bind_argmax(L):
    """Declare dl_argmax_rows's C signature on a loaded library; returns it."""
    L.dl_argmax_rows.restype = None
    L.dl_argmax_rows.argtypes = [_P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _P, _I]
    return L


def lib():
    global _LIB, _TRIED
    if _TRIED:
        return _LIB
    with _LOCK:
        if not _TRIED:
            try:
                _LIB = bind_decode(_load(_SRC))
            except OSError as e:
                log.info("native CPU paged attention unavailable (%s); using the torch implementation", e)
            _TRIED = True
    return _LIB


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 lens: torch.Tensor, window: int | None = None) -> torch.Tensor | None:
    """q (B, Hq, D) float32; caches (blocks, block_size, Hkv, D) contiguous, float32,
    float16 or bfloat16; block_tables (B, nb) int64; lens (B,) int64 context lengths.
    None when the kernel cannot take these inputs."""
    L = lib()
    kind = KV_KINDS.get(k_cache.dtype)
    if L is None or kind is None or q.dtype != torch.float32 or q.device.type != "cpu":
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.dtype != k_cache.dtype:
        return None
    q = q.contiguous()
    bt = block_tables.to(torch.int64)
    bt = bt if bt.stride(1) == 1 else bt.contiguous()
    lens = lens.to(torch.int64).contiguous()
    b, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    rc = L.dl_paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), bt.data_ptr(),
                           lens.data_ptr(), b, bt.stride(0), bs, int(window or 0), hq, hk, d, float(d) ** -0.5,
                           kind, torch.get_num_threads())
    if rc == -2:
        return None
    if rc != 0:
        raise MemoryError("native paged attention could not allocate its work buffers or threads")
    return out


def _argmax_lib():
    global _ARGMAX, _ARGMAX_TRIED
    if _ARGMAX_TRIED:
        return _ARGMAX
    with _LOCK:
        if not _ARGMAX_TRIED:
            try:
                _ARGMAX = bind_argmax(_load(_ARGMAX_SRC))
            except OSError as e:
                log.info("native CPU argmax unavailable (%s); using torch.argmax", e)
            _ARGMAX_TRIED = True
    return _ARGMAX


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a 2-D tensor; float32 rows on the CPU go through the C
    kernel (several times faster over a vocabulary: torch's argmax is not vectorised)."""
    L = _argmax_lib() if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 else None
    if L is None or x.shape[0] == 0 or x.shape[1] == 0 or x.stride(1) != 1:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    L.dl_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out

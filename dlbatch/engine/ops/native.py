"""CPU ops backed by small C kernels (``_paged_attn.c``), compiled on first use by
:mod:`dlbatch.native`. Unavailable (no compiler, ``DLBATCH_NATIVE=0``, another dtype) ->
``None`` and the caller uses its torch path."""
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
_P = ctypes.c_void_p


def lib():
    global _LIB, _TRIED
    if _TRIED:
        return _LIB
    with _LOCK:
        if not _TRIED:
            try:
                from dlbatch.native import load

                L = load(_SRC, ("-O3", "-march=native", "-pthread"))
                L.dl_paged_decode_f32.restype = ctypes.c_int
                L.dl_paged_decode_f32.argtypes = [_P] * 8 + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int]
                _LIB = L
            except OSError as e:
                log.info("native CPU paged attention unavailable (%s); using the torch implementation", e)
            _TRIED = True
    return _LIB


class Runs:
    """A decode batch's runs of consecutive cache slots as flat int64 tensors (built once
    per step, shared by every layer)."""

    __slots__ = ("start", "length", "offsets", "seq_len")

    def __init__(self, runs_all: list[list[tuple[int, int]]]):
        flat = [r for runs in runs_all for r in runs]
        self.start = torch.tensor([s for s, _ in flat], dtype=torch.int64)
        self.length = torch.tensor([n for _, n in flat], dtype=torch.int64)
        offs = [0]
        for runs in runs_all:
            offs.append(offs[-1] + len(runs))
        self.offsets = torch.tensor(offs, dtype=torch.int64)
        self.seq_len = torch.tensor([sum(n for _, n in runs) for runs in runs_all], dtype=torch.int64)


def paged_decode_f32(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: Runs) -> torch.Tensor | None:
    """q (B, Hq, D) float32; caches (blocks, block_size, Hkv, D) float32 contiguous. None
    when the kernel cannot take these inputs."""
    L = lib()
    if L is None or q.dtype != torch.float32 or k_cache.dtype != torch.float32 or q.device.type != "cpu":
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    q = q.contiguous()
    b, hq, d = q.shape
    hk = k_cache.shape[-2]
    out = torch.empty_like(q)
    rc = L.dl_paged_decode_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                               runs.start.data_ptr(), runs.length.data_ptr(), runs.offsets.data_ptr(),
                               runs.seq_len.data_ptr(), b, hq, hk, d, float(d) ** -0.5, torch.get_num_threads())
    if rc == -2:
        return None
    if rc != 0:
        raise MemoryError("native paged attention could not allocate its work buffers or threads")
    return out

"""Optional native fused copy + ``sum64`` for KV transfers (``_fastcopy.c`` via ctypes).

On first use the C file next to this module is compiled and loaded by
:mod:`dlbatch.cbuild` (system C compiler, cached). ctypes releases the GIL for the call,
so a copy on a background thread runs beside Python compute. Without a compiler (or with
``DLBATCH_FASTCOPY=0`` / ``DLBATCH_NATIVE=0``) nothing is
compiled and :func:`available` is False; callers fall back to numpy (slower: see
docs/transfer.md). The result is the same bytes and the same checksum either way.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("_fastcopy.c")
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
_REASON = ""


def _build() -> ctypes.CDLL:
    from dlbatch.cbuild import load

    lib = load(_SRC, ("-O2",), env_switch="DLBATCH_FASTCOPY")
    lib.dlkv_copy_sum64.restype = ctypes.c_uint64
    lib.dlkv_copy_sum64.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.dlkv_sum64.restype = ctypes.c_uint64
    lib.dlkv_sum64.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


def lib() -> ctypes.CDLL | None:
    """The loaded library, building it on first call; None when unavailable."""
    global _LIB, _TRIED, _REASON
    if _TRIED:
        return _LIB
    with _LOCK:
        if _TRIED:
            return _LIB
        if os.environ.get("DLBATCH_FASTCOPY", "1") == "0":
            _REASON = "disabled by DLBATCH_FASTCOPY=0"
        elif sys.byteorder != "little":
            _REASON = "big-endian host"
        else:
            try:
                _LIB = _build()
            except Exception as e:  # no compiler, read-only home, ...: numpy fallback
                _REASON = f"could not build {_SRC.name}: {e}"
                log.warning("dlbatch fast KV copy unavailable, using numpy (slower): %s", _REASON)
        _TRIED = True
        return _LIB


def available() -> bool:
    return lib() is not None


def unavailable_reason() -> str:
    lib()
    return _REASON


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def copy_sum64(dst: np.ndarray, src: np.ndarray, want_sum: bool = True) -> int | None:
    """Copy ``src`` bytes into ``dst`` (both C-contiguous uint8, same size, writable dst).

    Returns the ``sum64`` checksum of the bytes (or None without ``want_sum``).
    Requires :func:`available`.
    """
    total = _LIB.dlkv_copy_sum64(_addr(dst), _addr(src), src.size, 1 if want_sum else 0)
    return int(total) if want_sum else None


def sum64(src: np.ndarray) -> int:
    """``sum64`` of a C-contiguous uint8 array. Requires :func:`available`."""
    return int(_LIB.dlkv_sum64(_addr(src), src.size))

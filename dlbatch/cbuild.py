"""Small C kernels, compiled on first use with the system C compiler and loaded with ctypes.

A kernel is one C file in the package (with the headers next to it that it includes).
`load()` compiles it once into the per-user cache
(``dlbatch.cache.user_cache_dir("native")``: ``$DLBATCH_CACHE``, else ``~/.cache/dlbatch``,
created 0700 and refused when another user owns it), the file named by a hash of the source and its local headers, the flags, the Python build and this CPU's instruction-set flags (so
a home directory shared by different machines never loads code built for another CPU),
then loads it — only a regular file of ours that nobody else can write (any other file
at that name is compiled over). ctypes releases the GIL for each call. Without a compiler, or with
``DLBATCH_NATIVE=0``, `load()` raises OSError and callers use their torch/numpy path —
the same results, only slower.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import subprocess
import sys
import threading
from pathlib import Path

from dlbatch.cache import safe_file

_LOCK = threading.Lock()


def _cache_dirs() -> list[Path]:
    from dlbatch.cache import user_cache_dir

    return [user_cache_dir("native")]


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as fh:
            for line in fh:
                if line.startswith((b"flags", b"Features")):
                    return line
    except OSError:
        pass
    return platform.processor().encode()


def load(src: Path, flags: tuple[str, ...] = ("-O2",), env_switch: str | None = None) -> ctypes.CDLL:
    """Compile (once) and load the C file `src`; raises OSError when that is not possible."""
    if os.environ.get("DLBATCH_NATIVE", "1") == "0" or (env_switch and os.environ.get(env_switch, "1") == "0"):
        raise OSError(f"disabled by DLBATCH_NATIVE=0{' or ' + env_switch + '=0' if env_switch else ''}")
    if sys.byteorder != "little":
        raise OSError("big-endian host")
    code = src.read_bytes()
    for name in sorted(set(re.findall(rb'#include "([^"]+)"', code))):  # local headers are part of the build
        header = src.with_name(name.decode())
        if header != src and header.is_file():
            code += header.read_bytes()
    tag = hashlib.sha256(code + " ".join(flags).encode() + platform.machine().encode() + sys.version.encode()
                         + _cpu_flags()).hexdigest()[:16]
    errors = []
    with _LOCK:
        try:
            dirs = _cache_dirs()
        except OSError as e:
            raise OSError(f"no safe directory to compile {src.name} into: {e}") from None
        for d in dirs:
            so = d / f"{src.stem.lstrip('_')}-{tag}.so"
            if not safe_file(so):  # missing, or not ours alone: (re)compile over it
                try:
                    tmp = d / f".{so.stem}-{os.getpid()}-{threading.get_ident()}.so"
                    cc = os.environ.get("CC", "cc")
                    proc = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", str(tmp), str(src)],
                                          capture_output=True, text=True, timeout=120)
                    if proc.returncode != 0:
                        errors.append(f"{cc} failed: {proc.stderr.strip()[:300]}")
                        continue
                    os.chmod(tmp, 0o700)
                    os.replace(tmp, so)  # atomic: concurrent builders each write their own tmp
                except (OSError, subprocess.SubprocessError) as e:
                    errors.append(f"{d}: {e}")
                    continue
            try:
                return ctypes.CDLL(str(so))
            except OSError as e:
                errors.append(f"loading {so}: {e}")
    raise OSError("; ".join(errors) or "no cache directory usable")

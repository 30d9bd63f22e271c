"""CPU ops backed by small C kernels (``_paged_attn.c``, ``_prefill_attn.c``, ``_argmax.c``, ``_fused.c``), compiled
on first use by
:mod:`dlbatch.cbuild`. Unavailable (no compiler, ``DLBATCH_NATIVE=0``, a shape or dtype
it does not take) -> ``None`` and the caller uses its torch path."""
from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

log = logging.getLogger("dlbatch.engine")

_LOCK = threading.Lock()
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
    from dlbatch.cbuild import load

    try:
        return load(src, OPENMP_FLAGS)
    except OSError as e:
        log.info("building %s with OpenMP failed (%s); using POSIX threads", src.name, e)
        return load(src, POSIX_FLAGS)


def bind_decode(L):
    """Declare dl_paged_decode's C signature on a loaded library; returns it."""
    L.dl_paged_decode.restype = _I
    L.dl_paged_decode.argtypes = [_P] * 6 + [_I] * 7 + [ctypes.c_float, _I, _I, _I]
    L.dl_paged_decode_width.restype = _I  # floats per vector used for a head size (8, or 16 with AVX-512)
    L.dl_paged_decode_width.argtypes = [_I]
    L.dl_paged_decode_bf16.restype = _I  # 1: bf16 queries over a bf16 cache taken as they are (AVX512_BF16)
    L.dl_paged_decode_bf16.argtypes = [_I]
    L.bf16_heads = frozenset(d for d in range(32, 257, 32) if L.dl_paged_decode_bf16(d))  # asked once, not per call
    return L


def bind_prefill(L):
    """Declare dl_prefill_attn's C signature on a loaded library; returns it."""
    L64 = ctypes.c_int64
    L.dl_prefill_attn.restype = _I
    L.dl_prefill_attn.argtypes = [_P, L64, L64, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float,
                                  _I, _I, _I]
    L.dl_prefill_attn_width.restype = _I  # 16 for head sizes it takes (AVX-512 + OpenMP builds), else 0
    L.dl_prefill_attn_width.argtypes = [_I]
    L.dl_prefill_attn_bf16.restype = _I
    L.dl_prefill_attn_bf16.argtypes = []
    L.bf16_queries = bool(L.dl_prefill_attn_bf16())  # bf16 queries over a bf16 cache (AVX512_BF16), asked once
    return L


def bind_argmax(L):
    """Declare dl_argmax_rows's C signature on a loaded library; returns it."""
    L.dl_argmax_rows.restype = None
    L.dl_argmax_rows.argtypes = [_P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _P, _I]
    return L


def bind_fused(L):
    """Declare the C signatures of _fused.c's functions on a loaded library; returns it."""
    L64 = ctypes.c_int64
    L.dl_rms_norm.restype = None
    L.dl_rms_norm.argtypes = [_P, L64, _P, L64, _P, L64, _P, L64, _P, L64, L64, ctypes.c_float, _I, _I]
    L.dl_silu_and_mul.restype = None
    L.dl_silu_and_mul.argtypes = [_P, L64, _P, L64, L64, L64, _I, _I]
    L.dl_fused_bf16_width.restype = _I  # 16: bf16 rows on AVX-512 vectors (silu_and_mul takes them), else 0
    L.dl_fused_bf16_width.argtypes = []
    L.bf16_width = L.dl_fused_bf16_width()  # asked once, not per call
    L.dl_rotary_store.restype = None
    L.dl_rotary_store.argtypes = [_P, L64, L64, _P, L64, L64, _P, L64, L64, _P, _P, _P, _P, _P, _I, L64, _I, _I,
                                  L64, _I, _I]
    return L


class Kernel:
    """One C file of this package, compiled and bound on first use (by the first thread to
    ask; the others wait). ``get()`` is the bound library, or None when it cannot be built
    (logged once): callers then take their torch path."""

    def __init__(self, name: str, bind, what: str):
        self.src = Path(__file__).with_name(name)
        self.bind = bind
        self.what = what
        self.lib = None
        self.tried = False

    def get(self):
        if self.tried:
            return self.lib
        with _LOCK:
            if not self.tried:
                try:
                    self.lib = self.bind(_load(self.src))
                except OSError as e:
                    log.info("%s unavailable (%s); using the torch implementation", self.what, e)
                self.tried = True
        return self.lib


DECODE = Kernel("_paged_attn.c", bind_decode, "native CPU paged attention")
PREFILL = Kernel("_prefill_attn.c", bind_prefill, "native CPU prefill attention")
ARGMAX = Kernel("_argmax.c", bind_argmax, "native CPU argmax")
FUSED = Kernel("_fused.c", bind_fused, "native CPU fused elementwise ops")


def lib():
    """The paged decode attention library, or None."""
    return DECODE.get()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 lens: torch.Tensor, window: int | None = None) -> torch.Tensor | None:
    """q (B, Hq, D) float32, float16 or bfloat16; caches (blocks, block_size, Hkv, D)
    contiguous, float32, float16 or bfloat16; block_tables (B, nb) int64; lens (B,) int64
    context lengths. The kernel computes in float32, but for bf16 queries over a bf16 cache
    where the CPU has AVX512_BF16 (scores by vdpbf16ps on the operands as they are, whose
    products are exact); other half-precision queries are widened. The output is rounded
    back to the queries' dtype. None when the kernel cannot take these inputs."""
    L = lib()
    kind = KV_KINDS.get(k_cache.dtype)
    if L is None or kind is None or q.dtype not in KV_KINDS or q.device.type != "cpu":
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.dtype != k_cache.dtype:
        return None
    as_is = q.dtype == torch.bfloat16 and kind == KV_KINDS[torch.bfloat16] and q.shape[-1] in L.bf16_heads
    if q.dtype != torch.float32 and not as_is:
        out = paged_decode(q.float(), k_cache, v_cache, block_tables, lens, window)
        return None if out is None else out.to(q.dtype)
    q = q.contiguous()
    bt = block_tables.to(torch.int64)
    bt = bt if bt.stride(1) == 1 else bt.contiguous()
    lens = lens.to(torch.int64).contiguous()
    b, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    rc = L.dl_paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), bt.data_ptr(),
                           lens.data_ptr(), b, bt.stride(0), bs, int(window or 0), hq, hk, d, float(d) ** -0.5,
                           kind, torch.get_num_threads(), KV_KINDS[q.dtype])
    if rc == -2:
        return None
    if rc != 0:
        raise MemoryError("native paged attention could not allocate its work buffers or threads")
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def prefill_available(head_dim: int) -> bool:
    """Whether prefill_attention's kernel runs here for this head size: built for AVX-512
    with OpenMP (elsewhere torch's SDPA stays, measured or not: docs/benchmarks.md)."""
    L = PREFILL.get()
    return L is not None and L.dl_prefill_attn_width(head_dim) > 0


def prefill_bf16_queries() -> bool:
    """Whether prefill_attention takes bf16 queries over a bf16 cache as they are (AVX512_BF16
    dot products: the scores from the bf16 operands, exact products; the weighted values
    from the probabilities rounded to bf16)."""
    L = PREFILL.get()
    return L is not None and L.bf16_queries


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_q: torch.Tensor, ctx: torch.Tensor, window: int | None = None) -> torch.Tensor | None:
    """Causal attention of every prefill chunk of a step over its sequence's keys in the
    paged cache (the chunk's own keys stored there first). q (T, Hq, D) float32 with
    contiguous rows (a view of the QKV projection is fine), or bfloat16 over a bfloat16
    cache where ``prefill_bf16_queries()``; caches (blocks, block_size, Hkv, D) contiguous,
    float32, float16 or bfloat16; block_tables (P, nb) int64; cu_q (P + 1,) chunk
    boundaries in q; ctx (P,) cached tokens before each chunk. Returns (T, Hq, D) float32,
    or None when the kernel cannot take these inputs."""
    L = PREFILL.get()
    kind = KV_KINDS.get(k_cache.dtype)
    q_ok = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
                                        and L is not None and L.bf16_queries)
    if (L is None or kind is None or not q_ok or q.device.type != "cpu" or q.dim() != 3
            or q.stride(2) != 1 or v_cache.dtype != k_cache.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return None
    t, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    if L.dl_prefill_attn_width(d) == 0 or tuple(k_cache.shape[-2:]) != (hk, d):
        return None
    bt = block_tables.to(torch.int64)
    bt = bt if bt.stride(1) == 1 else bt.contiguous()
    cu = cu_q.to(torch.int64).contiguous()
    cx = ctx.to(torch.int64).contiguous()
    out = torch.empty((t, hq, d), dtype=torch.float32)
    rc = L.dl_prefill_attn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                           out.data_ptr(), bt.data_ptr(), bt.stride(0), cu.data_ptr(), cx.data_ptr(), cx.numel(), bs,
                           int(window or 0), hq, hk, d, float(d) ** -0.5, kind, torch.get_num_threads(),
                           KV_KINDS[q.dtype])
    if rc == -2:
        return None
    if rc != 0:
        raise MemoryError("native prefill attention could not allocate its work buffers")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a 2-D tensor; float32 rows on the CPU go through the C
    kernel (several times faster over a vocabulary: torch's argmax is not vectorised)."""
    L = ARGMAX.get() if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 else None
    if L is None or x.shape[0] == 0 or x.shape[1] == 0 or x.stride(1) != 1:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    L.dl_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as a 2-D float32 or bfloat16 CPU tensor of rows with contiguous elements (a view), or
    None (float16 rows: the reference)."""
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu or x.dim() < 2 or x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """rms_norm over the last dim (reference: ops/reference.py); with ``residual``: returns
    (rms_norm(x + residual), x + residual). None when the kernel cannot take these inputs."""
    L = FUSED.get()
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else None
    n = x.shape[-1]
    if (L is None or x2 is None or (residual is not None and (r2 is None or r2.shape != x2.shape
                                                                or r2.dtype != x.dtype))
            or weight.dtype != x.dtype or weight.shape != (n,) or not weight.is_contiguous()):
        return None
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype)
    h = torch.empty(rows, n, dtype=x.dtype) if residual is not None else None
    res_ptr, res_stride, h_ptr = (r2.data_ptr(), r2.stride(0), h.data_ptr()) if h is not None else (None, 0, None)
    L.dl_rms_norm(x2.data_ptr(), x2.stride(0), res_ptr, res_stride, h_ptr, n, out.data_ptr(), n, weight.data_ptr(),
                  rows, n, float(eps), KV_KINDS[x.dtype], torch.get_num_threads())
    if x.dim() != 2:  # (a view costs microseconds: rows of a step are 2-D already)
        out, h = out.view(x.shape), None if h is None else h.view(x.shape)
    return out if h is None else (out, h)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[..., :n]) * x[..., n:] for x (..., 2n); None when the kernel cannot take x."""
    L = FUSED.get()
    if L is None or x.shape[-1] % 2:
        return None
    # bf16 only on the 16-float path: the 8-wide one is slower than torch's (docs/benchmarks.md)
    x2 = _rows(x) if x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and L.bf16_width) else None
    if x2 is None:
        return None
    rows, n = x2.shape[0], x.shape[-1] // 2
    out = torch.empty(rows, n, dtype=x.dtype)
    L.dl_silu_and_mul(x2.data_ptr(), x2.stride(0), out.data_ptr(), n, rows, n, KV_KINDS[x.dtype],
                      torch.get_num_threads())
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots) -> tuple | None:
    """Rotary on q (T, Hq, D) and k (T, Hkv, D) in place (float32, float16 or bfloat16, with
    cos and sin of the same dtype), then k and v into the caches
    (blocks, block_size, Hkv, D) at ``slots`` (T,); returns (q, k), or None when the kernel
    cannot take these inputs (nothing is changed then)."""
    L = FUSED.get()
    kind = KV_KINDS.get(k_cache.dtype)
    if L is None or kind is None or v_cache.dtype != k_cache.dtype or q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return None
    t, hq, d = q.shape
    hk = k.shape[1]
    if (q.dtype not in KV_KINDS
            or any(a.dtype != q.dtype or a.device.type != "cpu" for a in (k, v, cos, sin))
            or any(a.stride(-1) != 1 for a in (q, k, v))
            or k.shape != (t, hk, d) or v.shape != (t, hk, d) or d % 2 or tuple(k_cache.shape[-2:]) != (hk, d)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or cos.shape != (t, d) or sin.shape != (t, d) or slots.shape != (t,)):
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slots.to(torch.int64).contiguous()
    if t:
        L.dl_rotary_store(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                          v.data_ptr(), v.stride(0), v.stride(1), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                          k_cache.data_ptr(), v_cache.data_ptr(), kind, t, hq, hk, d, KV_KINDS[q.dtype],
                          torch.get_num_threads())
    return q, k

"""CUDA ops: the Triton kernels of dlbatch/engine/ops/triton_kernels.py as registry ops.

Registered only when Triton is installed (``pip install dlbatch[gpu]``); without it a CUDA
engine runs the reference ops. Triton is not imported here until an op first runs, so a
CPU engine never pays for it.

Attention metadata. The kernels read the paged cache through block tables, never a
gathered copy. They take tensors, looked up on the step's ``AttnMeta``:

- decode: ``decode_block_tables`` (B, W) and ``decode_lens`` (B,) keys visible to each
  sequence's new token (its position + 1);
- prefill: ``prefill_block_tables`` (S, W), ``prefill_cu_q`` (S+1,) (row offsets of each
  sequence's new tokens in q), ``prefill_ctx`` (S,) (position of its first new token) and
  ``prefill_max_new`` (int).

Integer tensors may be int32 or int64 (the kernels widen what they load).

The step (dlbatch/engine/step_meta.py) keeps them as persistent tensors (int64 block
tables). Metadata built by hand without the prefill tensors (tests) falls back to the
prefill slot lists in :func:`prefill_tables`: one small op per sequence, never per token.
"""
from __future__ import annotations

import importlib.util

import torch

from dlbatch.engine.ops.registry import register_op

AVAILABLE = importlib.util.find_spec("triton") is not None


def _kernels():
    from dlbatch.engine.ops import triton_kernels

    return triton_kernels


def _pad_rows(rows: list[torch.Tensor], device) -> torch.Tensor:
    width = max((r.numel() for r in rows), default=0)
    out = torch.zeros((len(rows), max(1, width)), dtype=torch.int32, device=device)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
    return out


def decode_tables(meta, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_tables (B, W), seq_lens (B,) int32) of a decode step: the step's persistent
    block tables (dlbatch/engine/step_meta.py), read by the kernel directly."""
    return meta.decode_block_tables, meta.decode_lens.to(torch.int32)


def prefill_tables(meta, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(block_tables (S, W) int32, cu_q (S+1,) int32, ctx (S,) int32, max_new) of the
    prefill chunks of a step."""
    tables = getattr(meta, "prefill_block_tables", None)
    if tables is not None:
        return tables, meta.prefill_cu_q, meta.prefill_ctx, int(meta.prefill_max_new)
    dev = meta.slots.device
    rows, cu, ctx = [], [0], []
    for (qs, n, c, gather) in meta.prefill:
        slots = gather if gather is not None else meta.slots[qs:qs + n]  # gather: the whole context
        rows.append((slots[::block_size] // block_size).to(torch.int32))
        cu.append(qs + n)
        ctx.append(c)
    max_new = max((n for _, n, _, _ in meta.prefill), default=0)
    return (_pad_rows(rows, dev), torch.tensor(cu, dtype=torch.int32, device=dev),
            torch.tensor(ctx, dtype=torch.int32, device=dev), max_new)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _kernels().add_rms_norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    return _kernels().add_rms_norm(x, residual, weight, eps)


def rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots):
    return _kernels().rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)


def prefill_attention(q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
    tables, cu_q, ctx, max_new = prefill_tables(meta, k_cache.shape[1])
    return _kernels().paged_prefill(q, k_cache, v_cache, tables, cu_q, ctx, max_new, meta.sliding_window)


def paged_decode_attention(q, k_cache, v_cache, meta) -> torch.Tensor:
    tables, lens = decode_tables(meta, k_cache.shape[1])
    scratch = getattr(meta, "decode_scratch", None)
    return _kernels().paged_decode(q, k_cache, v_cache, tables, lens, meta.sliding_window, scratch=scratch)


IMPLS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotary_store_kv": rotary_store_kv,
         "prefill_attention": prefill_attention, "paged_decode_attention": paged_decode_attention}

if AVAILABLE:
    for _name, _fn in IMPLS.items():
        register_op(_name, "cuda")(_fn)

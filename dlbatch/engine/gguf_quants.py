"""Fast dequantisation of the common GGUF block formats with torch (vectorised over all
blocks). Other formats fall back to the `gguf` package's numpy implementation.

Formats (ggml's public block layouts, 32 weights per block):
  Q8_0: f16 scale d, 32 x int8 q          -> d * q
  Q4_0: f16 d, 16 bytes of nibbles        -> d * (q - 8)
  Q4_1: f16 d, f16 min m, 16 bytes        -> d * q + m
low nibbles hold weights 0..15 of the block, high nibbles weights 16..31.
"""
from __future__ import annotations

import numpy as np
import torch


def dequantize(data: np.ndarray, qtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy())
    if qtype_name == "Q8_0":
        blocks = raw.view(-1, 34)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(shape)
    if qtype_name in ("Q4_0", "Q4_1"):
        hdr = 2 if qtype_name == "Q4_0" else 4
        blocks = raw.view(-1, hdr + 16)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        qs = blocks[:, hdr:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()
        if qtype_name == "Q4_0":
            return (d * (q - 8)).reshape(shape)
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        return (d * q + m).reshape(shape)
    if qtype_name in ("F32", "F16", "BF16"):
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype_name]
        return raw.view(dt).float().reshape(shape)
    raise KeyError(qtype_name)

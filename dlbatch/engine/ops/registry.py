"""The table of op implementations, keyed by (op name, device type): `register_op` fills
it (the reference module for "any", device modules for their device); `resolve.get_ops`
reads it. This module imports none of the implementations, so each of them can import it."""
from __future__ import annotations

from typing import Callable

OP_NAMES = (
    "pack_linear",
    "linear",
    "rms_norm",
    "add_rms_norm",
    "rotary",
    "rotary_store_kv",
    "silu_and_mul",
    "store_kv",
    "prefill_attention",
    "paged_decode_attention",
    "sample",
)

# (name, device_type) -> implementation. device_type "any" is the reference.
_IMPLS: dict[tuple[str, str], Callable] = {}


def register_op(name: str, device_type: str = "any"):
    """Decorator: register `fn` as op `name` for `device_type` ("any", "cpu", "cuda", ...)."""
    if name not in OP_NAMES:
        raise ValueError(f"unknown op {name!r}; ops are {', '.join(OP_NAMES)}")

    def deco(fn: Callable) -> Callable:
        _IMPLS[(name, device_type)] = fn
        return fn

    return deco

"""Registry of op implementations keyed by (op name, device type)."""
from __future__ import annotations

from dataclasses import dataclass
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
_LOADED = False


def register_op(name: str, device_type: str = "any"):
    """Decorator: register `fn` as op `name` for `device_type` ("any", "cpu", "cuda", ...)."""
    if name not in OP_NAMES:
        raise ValueError(f"unknown op {name!r}; ops are {', '.join(OP_NAMES)}")

    def deco(fn: Callable) -> Callable:
        _IMPLS[(name, device_type)] = fn
        return fn

    return deco


def _load_builtin() -> None:
    global _LOADED
    if _LOADED:
        return
    import importlib

    from dlbatch.engine.ops import reference  # noqa: F401  (registers "any")

    for mod in ("cpu", "cuda"):
        try:  # device modules register what they speed up; each is optional
            importlib.import_module(f"dlbatch.engine.ops.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"dlbatch.engine.ops.{mod}":
                raise
    _LOADED = True


@dataclass(frozen=True)
class Ops:
    device_type: str
    pack_linear: Callable
    linear: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    rotary: Callable
    rotary_store_kv: Callable
    silu_and_mul: Callable
    store_kv: Callable
    prefill_attention: Callable
    paged_decode_attention: Callable
    sample: Callable
    chosen: dict

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.chosen.items())


def get_ops(device, overrides: dict[str, str] | None = None) -> Ops:
    """Resolve every op once for `device`: the device-specific implementation when one is
    registered, else the reference. `overrides` maps op name -> "reference" to force it."""
    import torch

    _load_builtin()
    dev_type = torch.device(device).type
    impls, chosen = {}, {}
    for name in OP_NAMES:
        force_ref = (overrides or {}).get(name) == "reference"
        fn = None if force_ref else _IMPLS.get((name, dev_type))
        if fn is None:
            fn = _IMPLS[(name, "any")]
            chosen[name] = "reference"
        else:
            chosen[name] = dev_type
        impls[name] = fn
    return Ops(device_type=dev_type, chosen=chosen, **impls)

"""Resolving the ops of one engine: load the built-in implementations once (the reference,
then each device module that imports), and pick per op the device's implementation when one
is registered, else the reference."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dlbatch.engine.ops.registry import _IMPLS, OP_NAMES

_LOADED = False


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


class OpFailed(RuntimeError):
    """A device op raised (a kernel that does not compile or launch here); ``op`` names it.
    The engine's start-up forward (engine/profile.py) then runs the reference op instead."""

    def __init__(self, op: str, cause: BaseException):
        super().__init__(f"op {op} failed: {type(cause).__name__}: {cause}")
        self.op = op


def guarded(name: str, fn: Callable) -> Callable:
    """``fn`` raising `OpFailed` (naming op ``name``) for any error but running out of memory."""
    import torch

    def op(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except torch.cuda.OutOfMemoryError:
            raise
        except OpFailed:
            raise
        except Exception as e:
            raise OpFailed(name, e) from e

    op.__wrapped__ = fn
    op.__name__ = getattr(fn, "__name__", name)
    return op


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
    registered, else the reference. `overrides` maps op name -> "reference" to force it.
    CUDA ops are `guarded`: a failure names its op, so the engine can fall back from it."""
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
            if dev_type == "cuda":
                fn = guarded(name, fn)
        impls[name] = fn
    return Ops(device_type=dev_type, chosen=chosen, **impls)

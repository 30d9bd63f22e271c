"""KV transfer with Ray Direct Transport (RDT, alpha in Ray 2.60).

RDT keeps the tensors an actor method returns in that actor (on its device) and
moves them straight to the actor task that consumes the ObjectRef, over a
collective backend: ``nccl`` between CUDA devices, ``gloo`` between CPU processes
(``torch.distributed``). What Ray 2.60 requires, and so what this module does:

* both actors are declared ``@ray.remote(enable_tensor_transport=True)``;
* they belong to one collective group per backend (``create_group``); an actor
  can be in only one group per backend, so make one group holding every prefill
  and decode worker of a node set;
* the sender's method is called with ``.options(tensor_transport=backend)``
  (``export``); it returns ``pack(meta, tensors)``;
* the ObjectRef is passed as a *top-level argument* of the receiver's method
  (``deliver``); a ref nested in another object cannot be fetched in 2.60;
  inside, ``unpack(obj, expected_fingerprint)`` checks and returns the tensors.

The sender/receiver stream interface of the other transports does not apply: the
data path is between actor methods, driven by the caller that holds both handles.
No checksums: the tensors never leave device memory on the way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dlbatch.transfer.base import Deadline, Transport
from dlbatch.transfer.errors import LayoutMismatch, SenderDied, TransferError, TruncatedPayload, brief
from dlbatch.transfer.payload import KVMeta, dtype_name, validate  # noqa: F401

log = logging.getLogger(__name__)


def backend_for(device: str) -> str:
    if not isinstance(device, str) or not device:
        raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0', got {device!r}")
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return "gloo"
    if kind == "cuda":
        return "nccl"
    raise ValueError(f"no Ray direct tensor transport for device {device!r}: RDT supports 'cpu' (gloo) and 'cuda' (nccl)")


def unavailable_reason(device: str = "cpu") -> str | None:
    """Why RDT cannot run for ``device`` here, or None when it can."""
    try:
        backend = backend_for(device)
    except ValueError as e:
        return str(e)
    try:
        import ray  # noqa: F401
        from ray.experimental.collective import create_collective_group  # noqa: F401
    except ImportError as e:
        return f"ray.experimental.collective is not importable ({e})"
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return f"torch.distributed is not importable ({e})"
    if backend == "gloo":
        if not dist.is_available() or not dist.is_gloo_available():
            return "torch was built without the gloo backend of torch.distributed"
        return None
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    if not dist.is_nccl_available():
        return "torch was built without NCCL"
    return None


def is_available(device: str = "cpu") -> bool:
    return unavailable_reason(device) is None


def create_group(actors: list, device: str = "cpu", name: str | None = None):
    """One collective group over ``actors`` (every KV sender and receiver) for ``device``'s backend."""
    reason = unavailable_reason(device)
    if reason:
        from dlbatch.transfer.errors import TransportUnavailable

        raise TransportUnavailable(f"Ray direct tensor transport unavailable for {device!r}: {reason}")
    from ray.experimental.collective import create_collective_group

    return create_collective_group(list(actors), backend=backend_for(device), name=name)


def destroy_group(group) -> None:
    from ray.experimental.collective import destroy_collective_group

    destroy_collective_group(group)


def _reset_default_group(actor_self) -> bool:
    """Runs inside a member (``__ray_call__``): drop its torch.distributed default group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        return True
    return False


def reform_group(group, actors: list, device: str = "cpu", timeout: float = 60.0):
    """A new group over ``actors`` after one of them was restarted (a new process outside
    ``group``): destroy ``group`` (a member that is gone or never joined is tolerated), drop
    every member's torch.distributed default group -- Ray's gloo groups are subgroups of it
    and its store lived in the old rank 0's process, so without this the next group fails
    to form ("Broken pipe") -- and create the group again. Raises when the create fails
    (e.g. a member died meanwhile); the caller retries."""
    import ray

    if group is not None:
        try:
            destroy_group(group)
        except Exception as e:  # the group is dropped from Ray's registry either way
            log.warning("destroying the RDT group: %s", brief(e))
    try:
        ray.get([a.__ray_call__.remote(_reset_default_group) for a in actors], timeout=timeout)
    except Exception as e:  # a member died meanwhile: the create below fails and is retried
        log.warning("resetting the RDT members: %s", brief(e))
    return create_group(actors, device=device)


def pack(meta: KVMeta, tensors: list) -> dict:
    """What the sender's RDT method returns: the meta (JSON) and the per-layer tensors."""
    meta = meta.without_checksums()
    if len(tensors) != meta.num_layers:
        raise TruncatedPayload(f"pack got {len(tensors)} tensors for {meta.num_layers} layers")
    for i, t in enumerate(tensors):
        _check_tensor(meta, i, t)
    return {"meta": meta.to_json(), "layers": list(tensors)}


def _check_tensor(meta: KVMeta, i: int, t) -> None:
    if tuple(t.shape) != meta.layer_shape:
        raise LayoutMismatch(f"layer {i} tensor has shape {tuple(t.shape)}, expected {meta.layer_shape}")
    if dtype_name(t.dtype) != meta.dtype:
        raise LayoutMismatch(f"layer {i} tensor has dtype {t.dtype}, meta says {meta.dtype}")


def unpack(obj: Any, expected_fingerprint: str | None = None, expected_shape=None) -> tuple[KVMeta, list]:
    """Receiver side: check what arrived and return ``(meta, tensors)`` (on the receiver's device)."""
    if not isinstance(obj, dict) or "meta" not in obj or "layers" not in obj:
        raise LayoutMismatch(f"RDT KV object must be the dict made by rdt.pack, got {type(obj).__name__}")
    meta = KVMeta.from_json(obj["meta"])
    layers = obj["layers"]
    if expected_fingerprint is not None and meta.fingerprint != expected_fingerprint:
        from dlbatch.transfer.errors import FingerprintMismatch

        raise FingerprintMismatch(expected_fingerprint, meta.fingerprint)
    if expected_shape is not None and (meta.kv_heads, meta.head_dim, meta.num_layers) != tuple(expected_shape):
        raise LayoutMismatch(
            f"KV payload has (kv_heads, head_dim, num_layers)={(meta.kv_heads, meta.head_dim, meta.num_layers)}, "
            f"engine expects {tuple(expected_shape)}"
        )
    if len(layers) != meta.num_layers:
        raise TruncatedPayload(f"RDT KV object has {len(layers)} of {meta.num_layers} layers")
    for i, t in enumerate(layers):
        _check_tensor(meta, i, t)
    return meta, layers


@dataclass(frozen=True)
class RDTHandle:
    ref: Any  # ObjectRef of the sender method's result (pass it top-level to the receiver)
    backend: str


class RDTTransport(Transport):
    name = "rdt"

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.backend = backend_for(device)

    def export(self, method, *args, **kwargs) -> RDTHandle:
        """Driver side: call the sender actor's ``method`` (returning ``pack(...)``) with RDT."""
        return RDTHandle(method.options(tensor_transport=self.backend).remote(*args, **kwargs), self.backend)

    def deliver(self, method, handle: RDTHandle, *args, **kwargs):
        """Driver side: call the receiver actor's ``method(obj, *args)``; the tensors move sender -> receiver."""
        if not isinstance(handle, RDTHandle):
            raise TypeError(f"deliver needs an RDTHandle, got {type(handle).__name__}")
        return method.remote(handle.ref, *args, **kwargs)

    def wait(self, ref, timeout: float, what: str = "the RDT KV transfer"):
        """``ray.get`` with a timeout and transfer-specific errors."""
        import ray
        from ray.exceptions import ActorDiedError, GetTimeoutError, OwnerDiedError, RayTaskError

        deadline = Deadline(timeout, what)
        try:
            return ray.get(ref, timeout=deadline.remaining())
        except GetTimeoutError:
            raise deadline.error() from None
        except (ActorDiedError, OwnerDiedError) as e:
            raise SenderDied(f"an actor in {what} died: {e}") from e
        except RayTaskError as e:
            if isinstance(e.cause, (ActorDiedError, OwnerDiedError)):
                raise SenderDied(f"an actor in {what} died: {e.cause}") from e
            raise

    def open_sender(self, meta, *, verify=None):
        raise TransferError(
            "the 'rdt' transport moves tensors between actor methods: return rdt.pack(meta, tensors) from "
            "the sender method, call RDTTransport.export(actor.method, ...) then deliver(receiver.method, handle)"
        )

    open_receiver = open_sender

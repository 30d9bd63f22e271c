"""Which KV transport a job uses: ``get_transport`` builds one by name, ``choose_transport``
decides ``kv_transport: auto`` (and checks an explicit choice) for a pair of pools.

This is the one place that knows every transport, so the transports themselves import only
``base`` (the interface), ``payload`` (the format) and ``errors``: no import circle.

``auto`` is decided from what the workers will see, not from the driver (which may have no
GPU): ``rdt`` when both pools hold device tensors of one device kind and every worker can run
Ray's direct tensor transport there (``auto_from_workers``), else ``object_store``, which
works on any Ray cluster. CPU pools never ask their workers: the answer is ``object_store``.
"""
from __future__ import annotations

from typing import Callable

from dlbatch.transfer.base import Transport
from dlbatch.transfer.errors import TransportUnavailable

TRANSPORT_NAMES = ("auto", "object_store", "shm", "rdt", "dlslime")


def get_transport(name: str = "auto", *, same_node: bool = False, device: str = "cpu",
                  peer_device: str | None = None, ray_handles: bool = True) -> Transport:
    """Build a transport by name.

    ``auto``: ``rdt`` when both sides hold device tensors (``device`` and ``peer_device``
    not cpu) and RDT is available; ``shm`` when ``same_node`` and no Ray handle is needed
    (``ray_handles=False``); else ``object_store``. Raises ValueError for an unknown name,
    TransportUnavailable when the named transport cannot run here (naming what is missing).
    """
    if name not in TRANSPORT_NAMES:
        raise ValueError(f"unknown KV transport {name!r}; expected one of {TRANSPORT_NAMES}")
    if not isinstance(device, str) or not device:
        raise ValueError(f"device must be a device string such as 'cpu' or 'cuda:0', got {device!r}")
    if name == "auto":
        from dlbatch.transfer import rdt

        peer = peer_device if peer_device is not None else device
        if not device.startswith("cpu") and not peer.startswith("cpu") and rdt.is_available(device):
            name = "rdt"
        elif same_node and not ray_handles:
            name = "shm"
        else:
            name = "object_store"
    if name == "object_store":
        from dlbatch.transfer.object_store import ObjectStoreTransport

        return ObjectStoreTransport()
    if name == "shm":
        if not same_node:
            raise TransportUnavailable("the 'shm' KV transport needs both workers on the same node (same_node=False)")
        from dlbatch.transfer.shm import ShmTransport

        return ShmTransport()
    if name == "rdt":
        from dlbatch.transfer import rdt

        reason = rdt.unavailable_reason(device)
        if reason:
            raise TransportUnavailable(f"the 'rdt' KV transport is unavailable for device {device!r}: {reason}")
        return rdt.RDTTransport(device)
    from dlbatch.transfer import dlslime_transport

    reason = dlslime_transport.unavailable_reason()
    if reason:
        raise TransportUnavailable(f"the 'dlslime' KV transport is unavailable: {reason}")
    return dlslime_transport.DLSlimeTransport()


def auto_from_workers(infos: list[dict]) -> tuple[str, str]:
    """``auto`` from what the workers of both pools report (``device``, ``cuda``, and ``rdt``:
    why RDT cannot run there, empty when it can): ``rdt`` when every worker holds device
    tensors of one device kind and can run RDT; else ``object_store``. Returns (name, why)."""
    if not infos:
        return "object_store", "no workers reported"
    kinds = {str(i.get("device", "cpu")).split(":")[0] for i in infos}
    blocked = [i for i in infos if i.get("rdt")]
    if "cpu" in kinds:
        return "object_store", "a worker holds its KV on the CPU"
    if len(kinds) > 1:
        return "object_store", f"workers on different device kinds {sorted(kinds)}"
    if blocked:
        return "object_store", f"RDT unavailable on a {blocked[0].get('device')} worker: {blocked[0]['rdt']}"
    return "rdt", f"every worker holds {kinds.pop()} tensors and can run RDT"


def choose_transport(requested: str, prefill_device: str, decode_device: str,
                     probe: Callable[[], list[dict]] | None = None) -> tuple[str, str]:
    """The transport of a prefill pool on ``prefill_device`` and a decode pool on
    ``decode_device``: (name, why). ``requested`` is the job's ``cluster.kv_transport``.

    ``auto`` on two device pools calls ``probe()`` for the workers' reports (see
    ``auto_from_workers``); on CPU pools it is ``object_store``. An explicit choice is checked
    here so a job fails before any work starts, naming what is missing (ValueError); ``rdt``
    between device pools is checked by the workers themselves when the group forms."""
    if requested not in TRANSPORT_NAMES:
        raise ValueError(f"unknown KV transport {requested!r}; expected one of {TRANSPORT_NAMES}")
    on_devices = not prefill_device.startswith("cpu") and not decode_device.startswith("cpu")
    if requested == "auto":
        if on_devices and probe is not None:
            return auto_from_workers(probe())
        return "object_store", "CPU pools" if not on_devices else "no device probe"
    if requested == "rdt" and prefill_device.split(":")[0] != decode_device.split(":")[0]:
        raise ValueError(f"cluster.kv_transport='rdt' needs the prefill and decode pools on the same kind of device "
                         f"(one collective backend), got {prefill_device!r} and {decode_device!r}; use object_store")
    if requested in ("rdt", "dlslime", "shm") and not (requested == "rdt" and on_devices):
        try:
            get_transport(requested, same_node=True, device=prefill_device, peer_device=decode_device)
        except Exception as e:
            raise ValueError(f"cluster.kv_transport={requested!r} cannot run here: {e}") from None
    return requested, "asked for by the job"

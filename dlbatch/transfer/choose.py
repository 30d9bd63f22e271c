"""Which KV transport a job uses: ``get_transport`` builds one by name, ``choose_transport``
decides ``kv_transport: auto`` (and checks an explicit choice) for a pair of pools.

This is the one place that knows every transport, so the transports themselves import only
``base`` (the interface), ``payload`` (the format) and ``errors``: no import circle.

``auto`` is decided from what the workers will see, not from the driver (which may have no
GPU): ``rdt`` when both pools hold device tensors of one device kind and every worker can run
Ray's direct tensor transport there (``auto_from_workers``), else ``object_store``, which
works on any Ray cluster. CPU pools never ask their workers: the answer is ``object_store``.

``dlslime`` is never chosen by ``auto``. Its endpoints serve their process's memory to anyone
who connects, so they listen on loopback unless the job sets ``cluster.dlslime_allow_network``
(``dlslime_allow_network`` here); without it the prefill and decode workers must share a node
(``one_node_reason``), and a non-loopback ``DLBATCH_DLSLIME_IP`` is refused at start.
"""
from __future__ import annotations

from typing import Callable

from dlbatch.transfer.base import Transport
from dlbatch.transfer.errors import TransportUnavailable

TRANSPORT_NAMES = ("auto", "object_store", "shm", "rdt", "dlslime")


def get_transport(name: str = "auto", *, same_node: bool = False, device: str = "cpu",
                  peer_device: str | None = None, ray_handles: bool = True,
                  dlslime_allow_network: bool | None = None) -> Transport:
    """Build a transport by name.

    ``auto``: ``rdt`` when both sides hold device tensors (``device`` and ``peer_device``
    not cpu) and RDT is available; ``shm`` when ``same_node`` and no Ray handle is needed
    (``ray_handles=False``); else ``object_store``. Raises ValueError for an unknown name
    or a dlslime address off loopback without ``dlslime_allow_network`` (None: this process's
    ``DLBATCH_DLSLIME_ALLOW_NETWORK``), TransportUnavailable when the named transport cannot
    run here (naming what is missing).
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

    return dlslime_transport.DLSlimeTransport(allow_network=dlslime_allow_network)


def one_node_reason(kv_via: str, dlslime_allow_network: bool = False) -> str | None:
    """Why transport ``kv_via`` needs every prefill and decode worker on one node, and what
    to do instead; None when it crosses nodes."""
    if kv_via == "shm":
        return "shared memory does not cross machines; use kv_transport: object_store (or rdt/dlslime)"
    if kv_via == "dlslime" and not dlslime_allow_network:
        return ("DLSlime endpoints listen on loopback, since whoever reaches one can read and write the worker's "
                "memory; use kv_transport: object_store or rdt, or set cluster.dlslime_allow_network: true and "
                "DLBATCH_DLSLIME_IP on each node (docs/transfer.md says what that exposes)")
    return None


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
                     probe: Callable[[], list[dict]] | None = None,
                     dlslime_allow_network: bool = False) -> tuple[str, str]:
    """The transport of a prefill pool on ``prefill_device`` and a decode pool on
    ``decode_device``: (name, why). ``requested`` is the job's ``cluster.kv_transport``.

    ``auto`` on two device pools calls ``probe()`` for the workers' reports (see
    ``auto_from_workers``); on CPU pools it is ``object_store``. An explicit choice is checked
    here so a job fails before any work starts, naming what is missing (ValueError); ``rdt``
    between device pools is checked by the workers themselves when the group forms; ``dlslime``
    with ``DLBATCH_DLSLIME_IP`` off loopback needs ``dlslime_allow_network``."""
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
            get_transport(requested, same_node=True, device=prefill_device, peer_device=decode_device,
                          dlslime_allow_network=dlslime_allow_network)
        except Exception as e:
            raise ValueError(f"cluster.kv_transport={requested!r} cannot run here: {e}") from None
    return requested, "asked for by the job"

"""Optional KV transport over DLSlime's TCP endpoint (``pip install dlslime``).

Uses the one-sided read of ``dlslime.TcpEndpoint`` (API as in DLSlime 0.1.23:
``TcpEndpoint(ip=, port=0)``, ``register_memory_region(name, ptr, offset, length)``,
``endpoint_info()`` -> ``{"host", "port", "mr_info"}``,
``register_remote_memory_region(name, info)``, ``connect(info)``,
``async_read([(local, remote, local_off, remote_off, length)]).wait_for(s)``).

The sender lays the payload out like ``payload.to_buffer`` in one registered host
buffer; the handle carries its endpoint info. The receiver connects, reads the
layer table until layer i is marked ready, then reads layer i into its own
registered buffer, so layer-wise streaming works as with shm. DLSlime's own
examples connect both endpoints to each other; ``DLSlimeSender.connect_peer`` does
the sender's half when the receiver's ``endpoint_info`` can be sent back.

Not exercised in this repository's tests when ``dlslime`` is not installed (they
skip, naming the reason); RDMA / NVLink endpoints are not wired here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from dlbatch.transfer.base import Deadline, KVReceiver, KVSender, Transport
from dlbatch.transfer.errors import CorruptPayload, TransferError
from dlbatch.transfer.payload import (
    ENTRY_SIZE,
    KVMeta,
    buffer_layout,
    check_layer,
    checksum,
    layer_state,
    layer_view,
    write_header,
    write_layer,
)

_MR = "dlkv"


def unavailable_reason() -> str | None:
    try:
        import dlslime
    except ImportError as e:
        return f"the 'dlslime' package is not installed ({e}); pip install dlslime"
    if not hasattr(dlslime, "TcpEndpoint"):
        return "this dlslime build has no TcpEndpoint (built without TCP support)"
    return None


def is_available() -> bool:
    return unavailable_reason() is None


def _check(status, what: str) -> None:
    if status is None:
        raise TransferError(f"dlslime {what} did not complete in time")
    if status != 0:
        raise TransferError(f"dlslime {what} failed with status {status}")


@dataclass(frozen=True)
class DLSlimeHandle:
    endpoint_info: dict
    meta: KVMeta
    size: int


class DLSlimeSender(KVSender):
    def __init__(self, meta: KVMeta, verify: bool = True, ip: str = "127.0.0.1"):
        import dlslime

        self.meta = meta.without_checksums()
        self.verify = verify
        self._layout = buffer_layout(self.meta)
        self._buf = np.zeros(self._layout.total_size, dtype=np.uint8)
        write_header(self._buf, self.meta)
        self._ep = dlslime.TcpEndpoint(ip=ip, port=0)
        h = self._ep.register_memory_region(_MR, self._buf.ctypes.data, 0, self._buf.nbytes)
        if h is None or h < 0:
            raise TransferError(f"dlslime could not register the {self._buf.nbytes}-byte KV buffer (status {h})")
        self._handle = DLSlimeHandle(self._ep.endpoint_info(), self.meta, self._layout.total_size)

    @property
    def handle(self) -> DLSlimeHandle:
        return self._handle

    def connect_peer(self, receiver_info: dict) -> None:
        self._ep.connect(receiver_info)

    def send_layer(self, i: int, array: np.ndarray) -> None:
        array = check_layer(self.meta, i, array)
        write_layer(self._buf, self._layout, self.meta, i, array, self._checksum(array))

    def close(self, timeout: float = 60.0) -> DLSlimeHandle:
        # the buffer must stay registered until the receiver has read it: keep the endpoint
        return self._handle

    def abort(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        ep, self._ep = self._ep, None
        if ep is not None:
            ep.shutdown()


class DLSlimeReceiver(KVReceiver):
    def __init__(self, handle: DLSlimeHandle, verify: bool = True, ip: str = "127.0.0.1"):
        import dlslime

        self.handle = handle
        self.meta = handle.meta
        self.verify = verify
        self._layout = buffer_layout(self.meta)
        self._buf = np.zeros(handle.size, dtype=np.uint8)
        self._ep = dlslime.TcpEndpoint(ip=ip, port=0)
        self._local = self._ep.register_memory_region(_MR, self._buf.ctypes.data, 0, self._buf.nbytes)
        remote_mr = handle.endpoint_info.get("mr_info", {}).get(_MR)
        if remote_mr is None:
            raise TransferError(f"dlslime sender endpoint {handle.endpoint_info.get('host')} exposes no {_MR!r} region")
        self._remote = self._ep.register_remote_memory_region("src", remote_mr)
        self._ep.connect(handle.endpoint_info)
        self.endpoint_info = self._ep.endpoint_info()

    def _read(self, offset: int, length: int, deadline: Deadline, what: str) -> None:
        fut = self._ep.async_read([(self._local, self._remote, offset, offset, length)])
        status = fut.wait_for(max(deadline.remaining(), 1e-3))
        if status is None:
            raise deadline.error(f"{what} read not finished")
        _check(status, f"read of {what}")

    def receive_layers(self, timeout: float) -> Iterator[tuple[int, np.ndarray]]:
        host = self.handle.endpoint_info.get("host")
        deadline = Deadline(timeout, f"KV layers from dlslime endpoint {host}:{self.handle.endpoint_info.get('port')}")
        table = self._layout.table_offset
        n = self.meta.num_layers
        for i in range(n):
            sleep = 1e-4
            while True:
                self._read(table + i * ENTRY_SIZE, ENTRY_SIZE, deadline, f"layer {i} table entry")
                ready, csum = layer_state(self._buf, self._layout, i)
                if ready:
                    break
                if deadline.expired():
                    raise deadline.error(f"layer {i} not ready; {i} of {n} layers arrived")
                time.sleep(min(sleep, deadline.remaining()))
                sleep = min(2 * sleep, 0.005)
            self._read(self._layout.layer_offsets[i], self.meta.layer_nbytes, deadline, f"layer {i}")
            view = layer_view(self._buf, self._layout, self.meta, i)
            if self.verify and csum is not None:
                got = checksum(view, self.meta.checksum_algo)
                if got != csum:
                    raise CorruptPayload(i, csum, got, self.meta.checksum_algo)
            yield i, view

    def release(self) -> None:
        ep, self._ep = getattr(self, "_ep", None), None
        if ep is not None:
            ep.shutdown()


class DLSlimeTransport(Transport):
    name = "dlslime"

    def __init__(self, ip: str = "127.0.0.1"):
        reason = unavailable_reason()
        if reason:
            from dlbatch.transfer.errors import TransportUnavailable

            raise TransportUnavailable(reason)
        self.ip = ip

    def open_sender(self, meta: KVMeta, *, verify: bool | None = None) -> DLSlimeSender:
        return DLSlimeSender(meta, True if verify is None else verify, self.ip)

    def open_receiver(self, handle: DLSlimeHandle, *, verify: bool | None = None) -> DLSlimeReceiver:
        return DLSlimeReceiver(handle, True if verify is None else verify, self.ip)

"""The transport interface: senders, receivers and the deadline they share (`choose.py` picks a transport).

A transfer has two ends:

* the sender: ``sender = transport.open_sender(meta)``; ``sender.handle`` is a small
  picklable object to pass to the receiver (over a pipe, a Ray call, ...);
  ``sender.send_layer(i, array)`` as each layer finishes; ``sender.close(timeout)``.
* the receiver: ``rx = transport.open_receiver(handle)``; ``for i, arr in
  rx.receive_layers(timeout)`` yields each layer as soon as it is there (zero-copy
  views where the transport allows, valid until ``rx.release()``);
  ``rx.receive(timeout)`` collects a whole :class:`KVPayload` of owned arrays.

``transport.send(payload)`` / ``transport.receive(handle, timeout)`` are the
one-shot forms. When a handle is complete only after ``close`` (object store)
the sender says so with ``handle_ready_before_close = False``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Iterator

import numpy as np

from dlbatch.transfer.errors import TransferTimeout
from dlbatch.transfer.payload import KVMeta, KVPayload, checksum, validate



class Deadline:
    """A timeout turned into an absolute deadline; ``remaining()`` never goes below 0."""

    def __init__(self, timeout: float | None, what: str):
        if timeout is None or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout for {what} must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.what = what
        self.end = time.monotonic() + self.timeout

    def remaining(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def error(self, detail: str = "") -> TransferTimeout:
        return TransferTimeout(f"timed out after {self.timeout:g}s waiting for {self.what}" + (f": {detail}" if detail else ""))


class KVSender(ABC):
    meta: KVMeta
    verify: bool

    @property
    @abstractmethod
    def handle(self) -> Any:
        """Picklable description the receiver needs."""

    handle_ready_before_close: bool = True

    @abstractmethod
    def send_layer(self, i: int, array: np.ndarray) -> None:
        """Hand over layer ``i`` (shape ``meta.layer_shape``, dtype ``meta.storage_dtype``)."""

    @abstractmethod
    def close(self, timeout: float = 60.0) -> Any:
        """Finish: waits for outstanding work; returns the final handle."""

    @abstractmethod
    def abort(self) -> None:
        """Give up and free what the transfer holds."""

    def _checksum(self, array: np.ndarray) -> int | None:
        return checksum(array, self.meta.checksum_algo) if self.verify else None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()


class KVReceiver(ABC):
    meta: KVMeta

    @abstractmethod
    def receive_layers(self, timeout: float) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(i, layer)`` in order as layers arrive; raise TransferTimeout past ``timeout``."""

    @abstractmethod
    def release(self) -> None:
        """Free the transfer's resources (views from receive_layers become invalid)."""

    def _take_layer(self, i: int, src: np.ndarray, csum: int | None, out) -> np.ndarray:
        """Layer ``i`` as received: copied into ``out(i)`` when a destination is given (the
        checksum computed in the same pass), verified against ``csum`` when the receiver
        verifies and the sender sent one. Returns the array holding the layer."""
        from dlbatch.transfer.errors import CorruptPayload
        from dlbatch.transfer.payload import copy_checksum

        check = getattr(self, "verify", True) and csum is not None
        algo = self.meta.checksum_algo if check else None
        if out is not None:
            dst = out(i)
            got = copy_checksum(dst, src, algo)
            src = dst
        elif check:
            got = checksum(src, algo)
        if check and got != csum:
            raise CorruptPayload(i, csum, got, self.meta.checksum_algo)
        return src

    def receive(self, timeout: float, *, copy: bool = True) -> KVPayload:
        """All layers as a payload (owned copies unless ``copy=False``), then release."""
        layers = []
        try:
            for _, arr in self.receive_layers(timeout):
                layers.append(arr.copy() if copy else arr)
        finally:
            if copy:
                self.release()
        return KVPayload(self.meta, layers)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class Transport(ABC):
    name: str = "?"

    @abstractmethod
    def open_sender(self, meta: KVMeta, *, verify: bool | None = None) -> KVSender: ...

    @abstractmethod
    def open_receiver(self, handle: Any, *, verify: bool | None = None) -> KVReceiver: ...

    def send(self, payload: KVPayload, *, verify: bool | None = None, timeout: float = 60.0) -> Any:
        """Send a complete payload; returns the handle for the receiver."""
        validate(payload, verify=False)
        meta = payload.meta.without_checksums()
        sender = self.open_sender(meta, verify=verify)
        try:
            for i, arr in enumerate(payload.layers):
                sender.send_layer(i, arr)
            return sender.close(timeout)
        except BaseException:
            sender.abort()
            raise

    def receive(
        self,
        handle: Any,
        timeout: float,
        *,
        expected_fingerprint: str | None = None,
        verify: bool | None = None,
    ) -> KVPayload:
        rx = self.open_receiver(handle, verify=verify)
        payload = rx.receive(timeout)
        return validate(payload, expected_fingerprint, verify=False)

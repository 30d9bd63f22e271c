"""KV transfer through the Ray object store (default; works across nodes).

The sender ``ray.put``s each layer (a numpy array) as it finishes, on a background
thread, so the copy into the store overlaps the compute of the next layer.
``close`` waits for the puts and returns an :class:`ObjectStoreHandle`: the meta,
one ObjectRef per layer and the per-layer checksums. The handle is small and
picklable; passing it (inside a Ray call) lends the refs to the receiver.

Overlap model: the store copy (the expensive part on one node) happens while later
layers compute; across nodes Ray pulls the objects when the receiver asks, layer by
layer in ``receive_layers``, so import of layer i overlaps the pull of layer i+1.
To start *pulling* before the sender has finished, the sender can ship
``sender.partial_handle()`` (refs put so far) and the rest later; the receiver
accepts any handle whose refs list covers all layers.

On the receiving node ``ray.get`` of a numpy array is zero-copy: the arrays are
read-only views of the shared store, pinned while referenced. The engine copies
once into its paged cache and drops them.

The objects are owned by the sender's process: if it dies before the receiver got
them, ``ray.get`` fails and :class:`SenderDied` names the layer.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from dlbatch.transfer.base import Deadline, KVReceiver, KVSender, Transport
from dlbatch.transfer.errors import CorruptPayload, SenderDied, TransferError, TruncatedPayload
from dlbatch.transfer.payload import KVMeta, check_layer, checksum, copy_checksum


@dataclass(frozen=True)
class ObjectStoreHandle:
    meta: KVMeta
    refs: tuple = field(default_factory=tuple)
    checksums: tuple = field(default_factory=tuple)  # per layer: int or None

    @property
    def complete(self) -> bool:
        return len(self.refs) == self.meta.num_layers


class ObjectStoreSender(KVSender):
    handle_ready_before_close = False

    def __init__(self, meta: KVMeta, verify: bool = True, background: bool = True):
        import ray

        if not ray.is_initialized():
            raise TransferError("the 'object_store' KV transport needs Ray: call ray.init() first")
        self._ray = ray
        self.meta = meta.without_checksums()
        self.verify = verify
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-put") if background else None
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()

    def _put(self, array: np.ndarray) -> tuple[Any, int | None]:
        csum = self._checksum(array)
        return self._ray.put(array), csum

    def send_layer(self, i: int, array: np.ndarray) -> None:
        """Queue layer ``i``. Do not modify ``array`` until ``close`` returns."""
        array = check_layer(self.meta, i, array)
        with self._lock:
            if i in self._futures:
                raise ValueError(f"layer {i} was already sent")
            if self._pool is None:
                fut: Future = Future()
                fut.set_result(self._put(array))
            else:
                fut = self._pool.submit(self._put, array)
            self._futures[i] = fut

    def partial_handle(self) -> ObjectStoreHandle:
        """Handle with the refs of the consecutive layers put so far (no waiting)."""
        refs, sums = [], []
        for i in range(self.meta.num_layers):
            fut = self._futures.get(i)
            if fut is None or not fut.done() or fut.exception() is not None:
                break
            ref, csum = fut.result()
            refs.append(ref)
            sums.append(csum)
        return ObjectStoreHandle(self.meta, tuple(refs), tuple(sums))

    @property
    def handle(self) -> ObjectStoreHandle:
        return self.partial_handle()

    def close(self, timeout: float = 60.0) -> ObjectStoreHandle:
        deadline = Deadline(timeout, f"ray.put of {self.meta.num_layers} KV layers")
        missing = sorted(set(range(self.meta.num_layers)) - set(self._futures))
        if missing:
            raise TruncatedPayload(f"object-store sender closed with layers {missing} never sent")
        refs, sums = [], []
        try:
            for i in range(self.meta.num_layers):
                try:
                    ref, csum = self._futures[i].result(timeout=deadline.remaining())
                except FutureTimeout:
                    raise deadline.error(f"layer {i} still being put") from None
                refs.append(ref)
                sums.append(csum)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
        return ObjectStoreHandle(self.meta, tuple(refs), tuple(sums))

    def abort(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._futures.clear()  # dropping the refs frees the objects


class ObjectStoreReceiver(KVReceiver):
    def __init__(self, handle: ObjectStoreHandle, verify: bool = True):
        if not isinstance(handle, ObjectStoreHandle):
            raise TypeError(f"ObjectStoreReceiver needs an ObjectStoreHandle, got {type(handle).__name__}")
        if not handle.complete:
            raise TruncatedPayload(
                f"object-store handle lists {len(handle.refs)} of {handle.meta.num_layers} layer refs"
            )
        import ray

        self._ray = ray
        self.handle = handle
        self.meta = handle.meta
        self.verify = verify
        self._held: list = []

    def receive_layers(self, timeout: float, out=None) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(i, layer)``: read-only zero-copy views of the store, verified first.

        ``out``: optional ``out(i) -> ndarray`` destination for layer i (the import copy);
        the layer is copied there with its checksum computed on the way, and the
        destination is yielded (saves the separate checksum read of the store).
        """
        ray = self._ray
        from ray.exceptions import GetTimeoutError, ObjectLostError, OwnerDiedError, RayError

        deadline = Deadline(timeout, f"{self.meta.num_layers} KV layers from the Ray object store")
        for i, ref in enumerate(self.handle.refs):
            try:
                arr = ray.get(ref, timeout=max(deadline.remaining(), 1e-3))
            except GetTimeoutError:
                raise deadline.error(f"layer {i} (object {ref.hex()}) not available; {i} layers received") from None
            except OwnerDiedError as e:
                raise SenderDied(
                    f"the sender that owned KV layer {i} of {self.meta.num_layers} (object {ref.hex()}) died "
                    f"before the receiver fetched it"
                ) from e
            except ObjectLostError as e:
                raise SenderDied(f"KV layer {i} (object {ref.hex()}) was lost from the object store: {e}") from e
            except RayError as e:
                raise TransferError(f"fetching KV layer {i} (object {ref.hex()}) failed: {e}") from e
            arr = check_layer(self.meta, i, arr)
            csum = self.handle.checksums[i] if i < len(self.handle.checksums) else None
            check = self.verify and csum is not None
            if out is not None:
                dst = out(i)
                got = copy_checksum(dst, arr, self.meta.checksum_algo if check else None)
                arr = dst
            elif check:
                got = checksum(arr, self.meta.checksum_algo)
            if check and got != csum:
                raise CorruptPayload(i, csum, got, self.meta.checksum_algo)
            self._held.append(arr)
            yield i, arr

    def receive(self, timeout: float, *, copy: bool = False):
        """Whole payload; arrays are read-only zero-copy views of the store unless ``copy``."""
        return super().receive(timeout, copy=copy)

    def release(self) -> None:
        self._held.clear()


class ObjectStoreTransport(Transport):
    name = "object_store"

    def open_sender(self, meta: KVMeta, *, verify: bool | None = None, background: bool = True) -> ObjectStoreSender:
        return ObjectStoreSender(meta, True if verify is None else verify, background)

    def open_receiver(self, handle: ObjectStoreHandle, *, verify: bool | None = None) -> ObjectStoreReceiver:
        return ObjectStoreReceiver(handle, True if verify is None else verify)

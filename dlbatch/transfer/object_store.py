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
from dlbatch.transfer.errors import SenderDied, TransferError, TruncatedPayload
from dlbatch.transfer.payload import KVMeta, check_layer


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

    def __init__(self, meta: KVMeta, verify: bool = True, background: bool = True, on_layer=None):
        """``on_layer(i, ref, checksum)``: called on the put thread as soon as layer ``i``
        is in the store, in layer order -- e.g. to forward the ref to a receiver that is
        already waiting (:meth:`ObjectStoreReceiver.streaming`), so its get and import
        copy of layer i overlap the put of layer i+1."""
        import ray

        if not ray.is_initialized():
            raise TransferError("the 'object_store' KV transport needs Ray: call ray.init() first")
        self._ray = ray
        self.meta = meta.without_checksums()
        self.verify = verify
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-put") if background else None
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._on_layer = on_layer

    def _put(self, i: int, array: np.ndarray) -> tuple[Any, int | None]:
        csum = self._checksum(array)  # first: the put then reads the layer from cache
        ref = self._ray.put(array)  # a numpy array: pickled out-of-band, one copy into the store
        if self._on_layer is not None:
            self._on_layer(i, ref, csum)
        return ref, csum

    def send_layer(self, i: int, array: np.ndarray) -> None:
        """Queue layer ``i``. Do not modify ``array`` until ``close`` returns."""
        array = check_layer(self.meta, i, array)
        with self._lock:
            if i in self._futures:
                raise ValueError(f"layer {i} was already sent")
            if self._pool is None:
                fut: Future = Future()
                fut.set_result(self._put(i, array))
            else:
                fut = self._pool.submit(self._put, i, array)
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
    def __init__(self, handle: ObjectStoreHandle, verify: bool = True, *, _streaming: bool = False):
        if not isinstance(handle, ObjectStoreHandle):
            raise TypeError(f"ObjectStoreReceiver needs an ObjectStoreHandle, got {type(handle).__name__}")
        if not handle.complete and not _streaming:
            raise TruncatedPayload(
                f"object-store handle lists {len(handle.refs)} of {handle.meta.num_layers} layer refs"
            )
        import ray

        self._ray = ray
        self.handle = handle
        self.meta = handle.meta
        self.verify = verify
        self._held: list = []
        self._next = 0

    @classmethod
    def streaming(cls, meta: KVMeta, verify: bool = True) -> "ObjectStoreReceiver":
        """A receiver fed layer by layer with :meth:`receive_layer` (refs forwarded by the
        sender's ``on_layer``), instead of a complete handle."""
        return cls(ObjectStoreHandle(meta.without_checksums()), verify, _streaming=True)

    def _fetch(self, i: int, ref, deadline: Deadline) -> np.ndarray:
        from ray.exceptions import GetTimeoutError, ObjectLostError, OwnerDiedError, RayError

        try:
            return self._ray.get(ref, timeout=max(deadline.remaining(), 1e-3))
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

    def _accept(self, i: int, arr, csum: int | None, out) -> np.ndarray:
        arr = self._take_layer(i, check_layer(self.meta, i, arr), csum, out)
        self._held.append(arr)
        return arr

    def receive_layers(self, timeout: float, out=None) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(i, layer)``: read-only zero-copy views of the store, verified first.

        ``out``: optional ``out(i) -> ndarray`` destination for layer i (the import copy);
        the layer is copied there with its checksum computed on the way, and the
        destination is yielded (saves the separate checksum read of the store).
        """
        deadline = Deadline(timeout, f"{self.meta.num_layers} KV layers from the Ray object store")
        for i, ref in enumerate(self.handle.refs):
            arr = self._fetch(i, ref, deadline)
            csum = self.handle.checksums[i] if i < len(self.handle.checksums) else None
            yield i, self._accept(i, arr, csum, out)

    def receive_layer(self, i: int, ref, csum: int | None, timeout: float, out=None) -> np.ndarray:
        """Streaming form: fetch, verify and (with ``out``) import layer ``i`` from ``ref``.

        Layers must come in order 0, 1, ...; returns the layer (the destination with
        ``out``). Checksums are all-or-none (the sender's ``verify``): a stream that
        mixes layers with and without one is refused.
        """
        if i != self._next:
            raise TruncatedPayload(f"object-store stream got layer {i}, expected layer {self._next}")
        if i == 0:
            self._stream_sums = csum is not None
        elif (csum is not None) != self._stream_sums:
            raise TransferError(
                f"object-store stream layer {i} {'has' if csum is not None else 'lacks'} a checksum, layer 0 "
                f"{'had' if self._stream_sums else 'had none'}: the sender must checksum all layers or none"
            )
        deadline = Deadline(timeout, f"KV layer {i} from the Ray object store")
        arr = self._accept(i, self._fetch(i, ref, deadline), csum, out)
        self._next = i + 1
        return arr

    @property
    def stream_complete(self) -> bool:
        return self._next == self.meta.num_layers

    def receive(self, timeout: float, *, copy: bool = False):
        """Whole payload; arrays are read-only zero-copy views of the store unless ``copy``."""
        return super().receive(timeout, copy=copy)

    def release(self) -> None:
        self._held.clear()


class ObjectStoreTransport(Transport):
    name = "object_store"

    def open_sender(
        self, meta: KVMeta, *, verify: bool | None = None, background: bool = True, on_layer=None
    ) -> ObjectStoreSender:
        return ObjectStoreSender(meta, True if verify is None else verify, background, on_layer)

    def open_receiver(self, handle: ObjectStoreHandle, *, verify: bool | None = None) -> ObjectStoreReceiver:
        return ObjectStoreReceiver(handle, True if verify is None else verify)

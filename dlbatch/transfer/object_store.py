"""KV transfer through the Ray object store (default; works across nodes).

The sender ``ray.put``s the layers as they finish, on a background thread, so the copy
into the store overlaps the compute of the next layers. Consecutive layers are
*coalesced* into one object of at least ``min_object_bytes`` (default 64 MiB, env
``DLBATCH_KV_OBJECT_BYTES``): a ``ray.put`` costs about 1 ms of fixed work (create and
seal round trips to the plasma store, ownership bookkeeping) on top of its copy, which
at 16 MiB objects held puts to ~7 GB/s here against ~10 GB/s at 64 MiB. A coalesced
object is a list of the layers' numpy arrays, pickled out-of-band: no extra copy on
either side. ``close`` waits for the puts and returns an :class:`ObjectStoreHandle`:
the meta, one ObjectRef per object, how many layers each holds and the per-layer
checksums. The handle is small and picklable; passing it (inside a Ray call) lends the
refs to the receiver.

Overlap model: the store copy (the expensive part on one node) happens while later
layers compute; across nodes Ray pulls the objects when the receiver asks, in order in
``receive_layers``, so the import of one object overlaps the pull of the next. A
receiver that should start before the sender has finished gets each object as it lands
(``open_sender(meta, on_object=cb)`` -> ``cb(first_layer, ref, checksums)``, fed to
:meth:`ObjectStoreReceiver.streaming`'s ``receive_object``).

On the receiving node ``ray.get`` of numpy arrays is zero-copy: the arrays are
read-only views of the shared store, pinned while referenced. The engine copies once
into its paged cache (checksum verified on the same pass) and drops them.

First touch. Each process maps the store's shared memory and pays a page fault for
every 4 KiB page the first time it writes (puts) or reads (gets) it: ~40 ms instead of
~2.5 ms for a 16 MiB put here (the kernel zeroes and maps the page). A long-running
worker reaches the steady state by itself once its puts have cycled through the store;
:func:`prewarm` gets there at start-up (it puts and frees zero objects covering the
store) and :func:`touch` does the same for a reader.

The objects are owned by the sender's process: if it dies before the receiver got
them, ``ray.get`` fails and :class:`SenderDied` names the layers.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from dlbatch.transfer.base import Deadline, KVReceiver, KVSender, Transport
from dlbatch.transfer.errors import SenderDied, TransferError, TruncatedPayload
from dlbatch.transfer.payload import KVMeta, check_layer

DEFAULT_MIN_OBJECT_BYTES = 64 << 20
PREWARM_CHUNK = 64 << 20  # size of the zero objects prewarm() puts


def default_min_object_bytes() -> int:
    raw = os.environ.get("DLBATCH_KV_OBJECT_BYTES")
    if raw is None:
        return DEFAULT_MIN_OBJECT_BYTES
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"DLBATCH_KV_OBJECT_BYTES must be a number of bytes >= 0, got {raw!r}")
    return n


@dataclass(frozen=True)
class ObjectStoreHandle:
    meta: KVMeta
    refs: tuple = field(default_factory=tuple)  # one ObjectRef per stored object (a list of layers)
    checksums: tuple = field(default_factory=tuple)  # per layer: int or None
    layers_per_ref: tuple = field(default_factory=tuple)  # consecutive layers in each object

    @property
    def num_layers_stored(self) -> int:
        return sum(self.layers_per_ref)

    @property
    def complete(self) -> bool:
        return len(self.layers_per_ref) == len(self.refs) and self.num_layers_stored == self.meta.num_layers


class ObjectStoreSender(KVSender):
    handle_ready_before_close = False

    def __init__(self, meta: KVMeta, verify: bool = True, background: bool = True, on_object=None,
                 min_object_bytes: int | None = None):
        """``on_object(first_layer, ref, checksums)``: called on the put thread as soon as an
        object is in the store, in order -- e.g. to forward the ref to a receiver that is
        already waiting (:meth:`ObjectStoreReceiver.streaming`), so its get and import copy
        overlap the put of the next object."""
        import ray

        if not ray.is_initialized():
            raise TransferError("the 'object_store' KV transport needs Ray: call ray.init() first")
        self._ray = ray
        self.meta = meta.without_checksums()
        self.verify = verify
        self.min_object_bytes = default_min_object_bytes() if min_object_bytes is None else int(min_object_bytes)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-put") if background else None
        self._futures: list[Future] = []  # one per object, in order
        self._group: list[np.ndarray] = []
        self._group_sums: list = []
        self._group_first = 0
        self._next = 0
        self._lock = threading.Lock()
        self._on_object = on_object

    def _put(self, first: int, arrays: list, sums: tuple) -> tuple[Any, int, tuple]:
        ref = self._ray.put(arrays)  # numpy arrays pickled out-of-band: one copy into the store
        if self._on_object is not None:
            self._on_object(first, ref, sums)
        return ref, len(arrays), sums

    def send_layer(self, i: int, array: np.ndarray) -> None:
        """Queue layer ``i`` (layers come in order 0, 1, ...). Do not modify ``array`` until
        ``close`` returns. The checksum is computed here, on the caller's thread, so that it
        overlaps the put of the previous object."""
        with self._lock:
            if i != self._next:
                raise ValueError(f"object-store sender got layer {i}, expected layer {self._next} (send in order)")
            array = check_layer(self.meta, i, array)
            last = i == self.meta.num_layers - 1
            if last and self._group:
                self._flush()  # the last layer goes alone: what is left after the compute is one layer's put
            self._group.append(array)
            self._group_sums.append(self._checksum(array))
            self._next = i + 1
            if last or len(self._group) * self.meta.layer_nbytes >= self.min_object_bytes:
                self._flush()

    def _flush(self) -> None:
        group, sums, first = self._group, tuple(self._group_sums), self._group_first
        self._group, self._group_sums, self._group_first = [], [], self._next
        if self._pool is None:
            fut: Future = Future()
            fut.set_result(self._put(first, group, sums))
        else:
            fut = self._pool.submit(self._put, first, group, sums)
        self._futures.append(fut)

    def partial_handle(self) -> ObjectStoreHandle:
        """Handle with the objects put so far (no waiting)."""
        refs, counts, sums = [], [], []
        for fut in self._futures:
            if not fut.done() or fut.exception() is not None:
                break
            ref, n, s = fut.result()
            refs.append(ref)
            counts.append(n)
            sums.extend(s)
        return ObjectStoreHandle(self.meta, tuple(refs), tuple(sums), tuple(counts))

    @property
    def handle(self) -> ObjectStoreHandle:
        return self.partial_handle()

    def close(self, timeout: float = 60.0) -> ObjectStoreHandle:
        deadline = Deadline(timeout, f"ray.put of {self.meta.num_layers} KV layers")
        if self._next != self.meta.num_layers:
            missing = list(range(self._next, self.meta.num_layers))
            raise TruncatedPayload(f"object-store sender closed with layers {missing} never sent")
        refs, counts, sums = [], [], []
        try:
            for k, fut in enumerate(self._futures):
                try:
                    ref, n, s = fut.result(timeout=deadline.remaining())
                except FutureTimeout:
                    raise deadline.error(f"object {k} (from layer {sum(counts)}) still being put") from None
                refs.append(ref)
                counts.append(n)
                sums.extend(s)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
        return ObjectStoreHandle(self.meta, tuple(refs), tuple(sums), tuple(counts))

    def abort(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._futures.clear()  # dropping the refs frees the objects
        self._group.clear()


class ObjectStoreReceiver(KVReceiver):
    def __init__(self, handle: ObjectStoreHandle, verify: bool = True, *, _streaming: bool = False):
        if not isinstance(handle, ObjectStoreHandle):
            raise TypeError(f"ObjectStoreReceiver needs an ObjectStoreHandle, got {type(handle).__name__}")
        if not handle.complete and not _streaming:
            raise TruncatedPayload(
                f"object-store handle lists {handle.num_layers_stored} of {handle.meta.num_layers} layers "
                f"({len(handle.refs)} refs)"
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
        """A receiver fed object by object with :meth:`receive_object` (refs forwarded by the
        sender's ``on_object``), instead of a complete handle."""
        return cls(ObjectStoreHandle(meta.without_checksums()), verify, _streaming=True)

    def _fetch(self, first: int, n: int, ref, deadline: Deadline) -> list:
        from ray.exceptions import GetTimeoutError, ObjectLostError, OwnerDiedError, RayError

        what = f"KV layer {first}" if n == 1 else f"KV layers {first}-{first + n - 1}"
        try:
            got = self._ray.get(ref, timeout=max(deadline.remaining(), 1e-3))
        except GetTimeoutError:
            raise deadline.error(f"{what} (object {ref.hex()}) not available; {first} layers received") from None
        except OwnerDiedError as e:
            raise SenderDied(
                f"the sender that owned {what} of {self.meta.num_layers} (object {ref.hex()}) died "
                f"before the receiver fetched it"
            ) from e
        except ObjectLostError as e:
            raise SenderDied(f"{what} (object {ref.hex()}) was lost from the object store: {e}") from e
        except RayError as e:
            raise TransferError(f"fetching {what} (object {ref.hex()}) failed: {e}") from e
        if not isinstance(got, list) or len(got) != n:
            raise TruncatedPayload(f"object {ref.hex()} should hold {n} KV layers from layer {first}, "
                                   f"holds {len(got) if isinstance(got, list) else type(got).__name__}")
        return got

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
        h = self.handle
        counts = h.layers_per_ref
        i = 0
        for ref, n in zip(h.refs, counts):
            for arr in self._fetch(i, n, ref, deadline):
                csum = h.checksums[i] if i < len(h.checksums) else None
                yield i, self._accept(i, arr, csum, out)
                i += 1

    def receive_object(self, first: int, ref, checksums: tuple, timeout: float, out=None) -> list:
        """Streaming form: fetch, verify and (with ``out``) import the layers of one object.

        Objects must come in order; returns the layers (the destinations with ``out``).
        Checksums are all-or-none (the sender's ``verify``): a stream that mixes layers
        with and without one is refused.
        """
        if first != self._next:
            raise TruncatedPayload(f"object-store stream got an object from layer {first}, expected layer {self._next}")
        checksums = tuple(checksums)
        if not checksums:
            raise ValueError(f"receive_object needs the object's per-layer checksums (None for none), got {checksums!r}")
        has = [c is not None for c in checksums]
        if first == 0 and has:
            self._stream_sums = has[0]
        if any(h != self._stream_sums for h in has):
            raise TransferError(
                f"object-store stream layers {first}-{first + len(checksums) - 1}: checksums on some layers and not "
                f"others (layer 0 {'had one' if self._stream_sums else 'had none'}): the sender must checksum all "
                f"layers or none"
            )
        deadline = Deadline(timeout, f"KV layers from {first} from the Ray object store")
        arrs = self._fetch(first, len(checksums), ref, deadline)
        got = [self._accept(first + k, a, c, out) for k, (a, c) in enumerate(zip(arrs, checksums))]
        self._next = first + len(checksums)
        return got

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
        self, meta: KVMeta, *, verify: bool | None = None, background: bool = True, on_object=None,
        min_object_bytes: int | None = None,
    ) -> ObjectStoreSender:
        return ObjectStoreSender(meta, True if verify is None else verify, background, on_object, min_object_bytes)

    def open_receiver(self, handle: ObjectStoreHandle, *, verify: bool | None = None) -> ObjectStoreReceiver:
        return ObjectStoreReceiver(handle, True if verify is None else verify)


# ------------------------------------------------------------------------ first touch
def store_capacity() -> int:
    """Bytes of object store on this node (as Ray reports it)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n.get("NodeID") == node:
            return int(n.get("Resources", {}).get("object_store_memory", 0))
    return int(ray.cluster_resources().get("object_store_memory", 0))


def prewarm(nbytes: int | None = None, chunk: int = PREWARM_CHUNK, keep: bool = False) -> list:
    """Fault this process's mapping of the object store in: put zero objects covering
    ``nbytes`` (default: 70% of this node's store: Ray starts spilling objects to disk at
    80% full, and a spill running in the background slowed every later copy 20x here),
    held at once so they land on distinct pages, then free them (or return their refs with ``keep=True``, e.g. for a reader to
    :func:`touch`). Costs the first-touch time once (~1 GB/s here) instead of on the first
    gigabytes of KV; returns the refs kept ([] otherwise)."""
    import ray

    if nbytes is None:
        nbytes = int(store_capacity() * 0.7)
    if nbytes < 0 or chunk <= 0:
        raise ValueError(f"prewarm needs nbytes >= 0 and chunk > 0, got nbytes={nbytes!r} chunk={chunk!r}")
    zeros = np.zeros(chunk, dtype=np.uint8)
    refs = [ray.put(zeros) for _ in range(nbytes // chunk)]
    if keep:
        return refs
    del refs
    return []


def touch(refs: list) -> int:
    """Read one byte of every page of these objects (a reader's first-touch faults, paid now)."""
    import ray

    total = 0
    for ref in refs:
        arr = ray.get(ref)
        total += int(arr[::4096].sum())
    return total

"""Same-node KV transfer through POSIX shared memory, without Ray.

One segment per payload, named ``dlkv_<creator pid>_<random hex>`` (never a fixed
name), laid out exactly like :func:`payload.to_buffer`. The sender creates it with
every layer marked pending and hands over :class:`ShmHandle` (name, size, meta,
pid) through any channel; ``send_layer`` writes the layer's bytes, its checksum,
then its ready byte, so the receiver consumes layer i while i+1 is being written.

Segment pool: writing into a fresh segment pays a page fault per 4 KiB page (on
the dev VM 0.1-0.4 GB/s, against 1.5-2.4 GB/s into an already-touched one), so each
sender process keeps a small pool of segments in size classes (powers of two split
in four steps, at least 1 MiB) and reuses them. A pooled segment carries a control
block after the payload (``generation`` u64, ``done`` u8, ``sender_gone`` u8, at
``handle.ctrl_offset``). Life cycle:

* ``open_sender`` reclaims segments whose receiver set ``done`` (and whose sender
  closed), else creates one; the new generation goes into the block and the handle.
* the receiver checks the generation on open; on a successful ``release`` it sets
  ``done`` instead of unlinking, so the sender can reuse the already-faulted pages.
  On an error, a timeout or a dead sender it unlinks, as before.
* the pool keeps at most ``POOL_MAX_SEGMENTS`` idle segments and ``POOL_MAX_BYTES``
  idle bytes (env ``DLBATCH_SHM_POOL_SEGMENTS`` / ``DLBATCH_SHM_POOL_BYTES``); the
  oldest beyond that are unlinked. ``drain_pool()`` unlinks all idle ones.
* at process exit (a ``multiprocessing.util.Finalize``, which also runs in
  multiprocessing children) the sender unlinks its idle and done segments; for one
  whose receiver has not finished it sets ``sender_gone`` and leaves it to the
  receiver, which unlinks it on ``release``. Both ends take ``flock`` on the segment
  for this handshake, so exactly one of them unlinks.

A receiver must not use views after ``release`` (the pages are reused), and a
handle is for one receiver. ``abort`` on the sender unlinks the segment.
``sweep_stale_segments`` removes segments whose creator process is gone (a killed
sender's pool, or both sides crashed).

Python 3.11's ``SharedMemory`` registers every mapping with the multiprocessing
resource tracker, which unlinks it when *that* process exits; the tracker would
destroy a segment the moment a short-lived sender exits, so both ends unregister
and manage the lifetime explicitly as above.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import multiprocessing.util
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import _posixshmem
from typing import Iterator

import numpy as np

from dlbatch.transfer.base import Deadline, KVReceiver, KVSender, Transport
from dlbatch.transfer.buffer_pool import BufferPool, PerProcess
from dlbatch.transfer.buffer_pool import size_class as _size_class
from dlbatch.transfer.errors import (
    FingerprintMismatch,
    SenderDied,
    TransferError,
)
from dlbatch.transfer.payload import (
    _ENTRY,
    ENTRY_SIZE,
    checksum,
    copy_checksum,
    KVMeta,
    _align,
    buffer_layout,
    check_layer,
    layer_state,
    layer_view,
    read_header,
    write_header,
)

PREFIX = "dlkv_"
SHM_DIR = "/dev/shm"
log = logging.getLogger(__name__)


def _untrack(shm: shared_memory.SharedMemory) -> None:
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 (see module doc)
    except Exception:  # pragma: no cover - tracker not running
        pass


def _unlink(shm: shared_memory.SharedMemory) -> None:
    """Remove the name (SharedMemory.unlink would also unregister it from the tracker again)."""
    try:
        _posixshmem.shm_unlink(shm._name)  # noqa: SLF001
    except FileNotFoundError:
        pass


def _close_quietly(shm: shared_memory.SharedMemory) -> None:
    """Close our mapping; if views of it are still alive, leave it to them (no __del__ retry)."""
    try:
        shm.close()
    except BufferError:
        # numpy views handed out still reference the mmap; it is unmapped when they go
        shm._buf = None  # noqa: SLF001
        shm._mmap = None  # noqa: SLF001


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class ShmHandle:
    name: str
    size: int
    meta: KVMeta
    sender_pid: int
    generation: int = 0
    ctrl_offset: int = -1  # -1: not pooled, the receiver unlinks on release


# ---------------------------------------------------------------- segment pool
_CTRL = struct.Struct("<QBB6x")  # generation, done, sender_gone
CTRL_SIZE = _CTRL.size
MIN_CLASS = 1 << 20
POOL_MAX_SEGMENTS = int(os.environ.get("DLBATCH_SHM_POOL_SEGMENTS", "8"))
POOL_MAX_BYTES = int(os.environ.get("DLBATCH_SHM_POOL_BYTES", str(3 << 30)))
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MAP_CACHE_MAX_SEGMENTS = int(os.environ.get("DLBATCH_SHM_MAP_CACHE_SEGMENTS", "8"))
MAP_CACHE_MAX_BYTES = int(os.environ.get("DLBATCH_SHM_MAP_CACHE_BYTES", str(3 << 30)))


def size_class(nbytes: int) -> int:
    """Segment size for ``nbytes`` (payload + control block): 2^k * {1, 1.25, 1.5, 1.75}, >= 1 MiB."""
    return _size_class(nbytes, MIN_CLASS)


class _Segment:
    __slots__ = ("shm", "size", "busy", "generation", "ctrl_offset")

    def __init__(self, shm: shared_memory.SharedMemory, size: int):
        self.shm = shm
        self.size = size
        self.busy = True  # held by a sender object (not closed)
        self.generation = 0
        self.ctrl_offset = -1

    @property
    def name(self) -> str:
        return self.shm.name

    def ctrl(self) -> tuple[int, int, int]:
        return _CTRL.unpack_from(self.shm.buf, self.ctrl_offset)

    def unlinked(self) -> bool:
        try:
            return os.fstat(self.shm._fd).st_nlink == 0  # noqa: SLF001 (a receiver unlinked it)
        except OSError:
            return True


class _Pool(BufferPool[_Segment]):
    """Per-process segment pool (dlbatch/transfer/buffer_pool.py): a segment is back once
    its receiver set ``done``; one a receiver unlinked is forgotten."""

    def __init__(self):
        super().__init__(POOL_MAX_SEGMENTS, POOL_MAX_BYTES)
        multiprocessing.util.Finalize(self, _Pool.shutdown, args=(self,), exitpriority=10)

    def _create(self, size: int) -> _Segment:
        name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        _untrack(shm)
        return _Segment(shm, size)

    def _returned(self, seg: _Segment) -> str | None:
        if seg.unlinked():
            return "drop"
        return "idle" if seg.ctrl()[1] else None

    def _forget(self, seg: _Segment) -> None:
        _close_quietly(seg.shm)

    def _dispose(self, seg: _Segment) -> None:
        _unlink(seg.shm)
        _close_quietly(seg.shm)

    def _usable(self, seg: _Segment) -> bool:
        return not seg.unlinked()

    def acquire(self, nbytes: int, prefault: bool = False) -> _Segment:
        seg = super().acquire(size_class(nbytes))
        if prefault:
            _prefault(seg.shm)
        return seg

    def discard(self, seg: _Segment) -> None:
        with self.lock:
            if seg in self.out:
                self.out.remove(seg)
        _unlink(seg.shm)
        _close_quietly(seg.shm)

    def shutdown(self) -> None:
        """At exit: unlink idle and received segments; leave unreceived ones to their receiver."""
        if os.getpid() != self.pid:
            return
        with self.lock:
            self.reclaim_locked()
            self.trim_locked(0, 0)
            for seg in self.out:
                if seg.busy or seg.unlinked():
                    if seg.busy:  # a sender never closed: nobody will complete it
                        _unlink(seg.shm)
                    continue
                with _flocked(seg.shm):
                    gen, done, _ = seg.ctrl()
                    if done:
                        _unlink(seg.shm)
                    else:
                        _CTRL.pack_into(seg.shm.buf, seg.ctrl_offset, gen, 0, 1)
            self.out = []


_POOL = PerProcess(_Pool)


def _pool() -> _Pool:
    return _POOL.get()


def pool_stats() -> dict:
    """Idle/outstanding segments and how many were created or reused in this process."""
    return _pool().stats()


def drain_pool() -> list[str]:
    """Unlink this process's idle segments (received ones included); returns their names."""
    return [seg.name for seg in _pool().drain()]


def close_pool() -> None:
    """A graceful stop (``ray.kill`` skips the exit finaliser): what the pool does at exit,
    now — unlink idle and received segments, leave unreceived ones to their receiver."""
    pool = _POOL.peek()
    if pool is not None:
        pool.shutdown()


def cleanup(close: bool = False) -> list[str]:
    """Sweep this node's segments of dead processes; with ``close``, also end this process's
    pool and mappings (a worker about to stop). Returns the names swept."""
    removed = sweep_stale_segments()
    if close:
        close_pool()
        drop_receiver_mappings()
    return removed


def prewarm(meta: KVMeta, count: int = 1) -> None:
    """Create ``count`` idle, pre-faulted segments for payloads shaped like ``meta``.

    Moves the page-fault cost of the first transfers to start-up (it is not cheaper:
    the kernel still zeroes every page)."""
    pool = _pool()
    need = _align(buffer_layout(meta).total_size) + CTRL_SIZE
    pool.release_idle([pool.acquire(need, prefault=True) for _ in range(count)])


def _prefault(shm: shared_memory.SharedMemory) -> None:
    try:
        shm._mmap.madvise(_MADV_POPULATE_WRITE)  # noqa: SLF001
    except (OSError, AttributeError, ValueError):
        buf = np.frombuffer(shm.buf, dtype=np.uint8)
        buf[::_PAGE] = 0
        del buf


class _flocked:
    def __init__(self, shm: shared_memory.SharedMemory):
        self.fd = shm._fd  # noqa: SLF001

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)


class _MapCache:
    """Receiver side: mappings of segments kept across transfers (per process).

    A pooled segment comes back under the same name for the next payload; mapping it
    afresh would pay a page-table fault per 4 KiB page on the receiver's first read
    (~65k per 256 MiB). The cache keeps the mapping while the segment lives and is
    keyed by name and checked by inode, so a different file under a reused name is
    never confused with it. Entries whose segment was unlinked (the sender trimmed its
    pool or exited) are dropped at the next open, as are the least recently used ones
    beyond ``MAP_CACHE_MAX_SEGMENTS`` / ``MAP_CACHE_MAX_BYTES``.
    """

    def __init__(self):
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.entries: dict[str, list] = {}  # name -> [shm, (st_dev, st_ino), size, users]

    def _sweep(self) -> None:
        for name, (shm, _, _, users) in list(self.entries.items()):
            if users == 0 and _nlink(shm) == 0:
                del self.entries[name]
                _close_quietly(shm)
        idle = [n for n, e in self.entries.items() if e[3] == 0]  # insertion order = LRU order
        while idle and (
            len(self.entries) > MAP_CACHE_MAX_SEGMENTS or sum(e[2] for e in self.entries.values()) > MAP_CACHE_MAX_BYTES
        ):
            shm = self.entries.pop(idle.pop(0))[0]
            _close_quietly(shm)

    def open(self, name: str) -> shared_memory.SharedMemory:
        """Map ``name`` (FileNotFoundError if it does not exist); call ``done`` when finished."""
        with self.lock:
            if self.pid != os.getpid():
                self.entries, self.pid = {}, os.getpid()
            self._sweep()
            entry = self.entries.get(name)
            if entry is not None:
                fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
                try:
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                if (st.st_dev, st.st_ino) == entry[1] and st.st_size == entry[2]:
                    entry[3] += 1
                    self.entries[name] = self.entries.pop(name)  # most recently used last
                    return entry[0]
                if entry[3] == 0:
                    del self.entries[name]
                    _close_quietly(entry[0])
            shm = shared_memory.SharedMemory(name=name, create=False)
            _untrack(shm)
            try:
                shm._mmap.madvise(_MADV_POPULATE_READ)  # noqa: SLF001 (one call instead of a fault per page)
            except (OSError, AttributeError, ValueError):
                pass
            st = os.fstat(shm._fd)  # noqa: SLF001
            if name not in self.entries:
                self.entries[name] = [shm, (st.st_dev, st.st_ino), shm.size, 1]
            return shm

    def done(self, shm: shared_memory.SharedMemory, keep: bool) -> None:
        """A receiver finished with ``shm``; ``keep=False``: it was unlinked, unmap it."""
        with self.lock:
            entry = self.entries.get(shm.name)
            cached = entry is not None and entry[0] is shm
            if cached:
                entry[3] -= 1
                if keep:
                    return
                if entry[3] > 0:
                    return
                del self.entries[shm.name]
        _close_quietly(shm)

    def clear(self) -> None:
        with self.lock:
            entries, self.entries = self.entries, {}
        for shm, _, _, _ in entries.values():
            _close_quietly(shm)


def _nlink(shm: shared_memory.SharedMemory) -> int:
    try:
        return os.fstat(shm._fd).st_nlink  # noqa: SLF001
    except (OSError, TypeError):
        return 0


_MAPS = _MapCache()


def drop_receiver_mappings() -> None:
    """Unmap every segment this process keeps mapped as a receiver (see ``_MapCache``)."""
    _MAPS.clear()


class ShmSender(KVSender):
    def __init__(self, meta: KVMeta, verify: bool = True, pooled: bool = True):
        self.meta = meta.without_checksums()
        self.verify = verify
        self._layout = buffer_layout(self.meta)
        ctrl_offset = _align(self._layout.total_size)
        if pooled:
            self._seg = _pool().acquire(ctrl_offset + CTRL_SIZE)
            self._shm = self._seg.shm
        else:
            self._seg = None
            name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=ctrl_offset + CTRL_SIZE)
            _untrack(self._shm)
        try:
            generation = secrets.randbits(63) | 1
            _CTRL.pack_into(self._shm.buf, ctrl_offset, generation, 0, 0)
            write_header(self._shm.buf, self.meta)
        except BaseException:
            self._unlink()
            raise
        if self._seg is not None:
            self._seg.generation, self._seg.ctrl_offset = generation, ctrl_offset
        self._handle = ShmHandle(
            self._shm.name, self._layout.total_size, self.meta, os.getpid(), generation,
            ctrl_offset if self._seg is not None else -1,
        )
        self._sent: set[int] = set()

    @property
    def handle(self) -> ShmHandle:
        return self._handle

    def layer_buffer(self, i: int) -> np.ndarray:
        """Layer ``i``'s place in the segment, writable, shape ``meta.layer_shape``: a producer
        that writes the layer there itself (the engine's export gather) and then calls
        ``send_layer(i, that_view)`` saves the copy into the segment."""
        if self._shm is None:
            raise TransferError(f"shm sender for segment {self._handle.name} is closed; no buffer for layer {i}")
        if not 0 <= i < self.meta.num_layers:
            raise ValueError(f"layer {i} out of range [0, {self.meta.num_layers})")
        return np.frombuffer(self._shm.buf, dtype=self.meta.storage_dtype, count=self.meta.layer_nbytes
                             // self.meta.storage_dtype.itemsize,
                             offset=self._layout.layer_offsets[i]).reshape(self.meta.layer_shape)

    def send_layer(self, i: int, array: np.ndarray) -> None:
        if self._shm is None:
            raise TransferError(f"shm sender for segment {self._handle.name} is closed; cannot send layer {i}")
        if i in self._sent:
            raise ValueError(f"layer {i} was already sent on segment {self._handle.name}")
        array = check_layer(self.meta, i, array)
        buf = self._shm.buf
        dst = np.frombuffer(buf, dtype=np.uint8, count=self.meta.layer_nbytes, offset=self._layout.layer_offsets[i])
        algo = self.meta.checksum_algo if self.verify else None
        if array.ctypes.data == dst.ctypes.data:  # written in place through layer_buffer(i)
            csum = checksum(dst, algo) if algo else None
        else:  # one pass: copy into the segment and checksum the copied bytes while in cache
            csum = copy_checksum(dst, array, algo)
        del dst
        entry = self._layout.table_offset + i * ENTRY_SIZE
        _ENTRY.pack_into(buf, entry, csum or 0, 0, csum is not None)
        buf[entry + 8] = 1  # ready flag written last
        self._sent.add(i)

    def close(self, timeout: float = 60.0) -> ShmHandle:
        missing = sorted(set(range(self.meta.num_layers)) - self._sent)
        if missing:
            raise TransferError(f"shm sender closed with layers {missing} never sent (segment {self._handle.name})")
        if self._shm is not None:
            if self._seg is not None:
                self._seg.busy = False  # the pool reclaims it once the receiver sets done
            else:
                _close_quietly(self._shm)  # the segment stays; the receiver unlinks it
            self._shm = None
        return self._handle

    def abort(self) -> None:
        self._unlink()

    def _unlink(self) -> None:
        if self._shm is not None:
            if self._seg is not None:
                _pool().discard(self._seg)
            else:
                _close_quietly(self._shm)
                _unlink(self._shm)
            self._shm = None


class ShmReceiver(KVReceiver):
    """Maps the sender's segment. Yielded layers are views into it, valid until ``release``."""

    def __init__(self, handle: ShmHandle, verify: bool = True, poll_max_s: float = 0.002):
        if not isinstance(handle, ShmHandle):
            raise TypeError(f"ShmReceiver needs a ShmHandle, got {type(handle).__name__}")
        self.handle = handle
        self.meta = handle.meta
        self.verify = verify
        self.poll_max_s = poll_max_s
        self._ok = False
        try:
            self._shm = _MAPS.open(handle.name)
        except FileNotFoundError as e:
            raise TransferError(
                f"shared-memory segment {handle.name!r} does not exist: the sender aborted, "
                f"or another receiver already took it"
            ) from e
        try:
            if handle.ctrl_offset >= 0:
                gen = _CTRL.unpack_from(self._shm.buf, handle.ctrl_offset)[0]
                if gen != handle.generation:
                    shm, self._shm = self._shm, None
                    _MAPS.done(shm, keep=True)  # the segment now carries another payload: not ours to unlink
                    raise TransferError(
                        f"shared-memory segment {handle.name!r} was already received and reused by its "
                        f"sender (generation {gen:#x}, handle has {handle.generation:#x})"
                    )
            meta, self._layout = read_header(self._shm.buf[: handle.size])
            if meta.fingerprint != handle.meta.fingerprint:
                raise FingerprintMismatch(handle.meta.fingerprint, meta.fingerprint)
        except BaseException:
            self.release()
            raise
        self._done = 0

    def _wait_ready(self, i: int, deadline: Deadline) -> int | None:
        sleep = 2e-5
        checks = 0
        while True:
            ready, csum = layer_state(self._shm.buf, self._layout, i)
            if ready:
                return csum
            checks += 1
            if checks % 64 == 0 and not _pid_alive(self.handle.sender_pid):
                ready, csum = layer_state(self._shm.buf, self._layout, i)
                if ready:
                    return csum
                raise SenderDied(
                    f"sender process {self.handle.sender_pid} died after writing {i} of "
                    f"{self.meta.num_layers} layers to segment {self.handle.name!r}"
                )
            if deadline.expired():
                raise deadline.error(f"layer {i} not ready; {i} of {self.meta.num_layers} layers arrived")
            time.sleep(min(sleep, deadline.remaining()))
            sleep = min(sleep * 2, self.poll_max_s)

    def receive_layers(self, timeout: float, out=None) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(i, layer)`` as layers become ready.

        ``out``: optional ``out(i) -> ndarray`` giving layer i's destination (the import
        copy, C-contiguous, ``meta.layer_nbytes`` bytes); the layer is copied there with
        the checksum computed on the way, and the destination is yielded. Without it the
        yielded layer is a view of the segment, verified first (one extra read pass).
        """
        deadline = Deadline(
            timeout, f"KV layers in shared-memory segment {self.handle.name!r} from pid {self.handle.sender_pid}"
        )
        if self._shm is None:
            raise TransferError(f"shm receiver for segment {self.handle.name!r} was released")
        try:
            for i in range(self._done, self.meta.num_layers):
                csum = self._wait_ready(i, deadline)
                view = self._take_layer(i, layer_view(self._shm.buf, self._layout, self.meta, i), csum, out)
                self._done = i + 1
                if self._done == self.meta.num_layers:
                    self._ok = True
                yield i, view
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give the segment back: to the sender's pool after a full receive, else unlink it."""
        shm, self._shm = getattr(self, "_shm", None), None
        if shm is None:
            return
        h = self.handle
        if self._ok and h.ctrl_offset >= 0 and _pid_alive(h.sender_pid):
            with _flocked(shm):
                gen, _, sender_gone = _CTRL.unpack_from(shm.buf, h.ctrl_offset)
                returned = gen == h.generation and not sender_gone
                if returned:
                    _CTRL.pack_into(shm.buf, h.ctrl_offset, gen, 1, 0)  # done: the sender reuses it
            if returned:
                _MAPS.done(shm, keep=True)  # stays mapped: the sender sends its next payload here
                return
        _unlink(shm)
        _MAPS.done(shm, keep=False)


class ShmTransport(Transport):
    name = "shm"

    def open_sender(self, meta: KVMeta, *, verify: bool | None = None, pooled: bool = True) -> ShmSender:
        """``pooled=False``: a fresh segment the receiver unlinks (no reuse)."""
        return ShmSender(meta, True if verify is None else verify, pooled)

    def open_receiver(self, handle: ShmHandle, *, verify: bool | None = None) -> ShmReceiver:
        return ShmReceiver(handle, True if verify is None else verify)


def list_segments() -> list[str]:
    """Names of dlkv segments present on this node."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return []


def sweep_stale_segments() -> list[str]:
    """Unlink this user's dlkv segments whose creator pid no longer exists; returns their
    names. Another user's segments are never touched (one cannot unlink them from the
    sticky /dev/shm anyway, and a file planted there must not fail a job); a segment that
    vanishes or cannot be removed is skipped with a log line, never raised."""
    removed, uid = [], os.getuid()
    for name in list_segments():
        try:
            pid = int(name[len(PREFIX) :].split("_", 1)[0])
        except ValueError:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != uid or _pid_alive(pid):
                continue
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("shm sweep: left %s (%s)", path, e)
    return removed

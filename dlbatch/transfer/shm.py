"""Same-node KV transfer through POSIX shared memory, without Ray.

One segment per payload, named ``dlkv_<creator pid>_<random hex>`` (never a fixed
name), laid out exactly like :func:`payload.to_buffer`. The sender creates it with
every layer marked pending and hands over :class:`ShmHandle` (name, size, meta,
pid) through any channel; ``send_layer`` writes the layer's bytes, its checksum,
then its ready byte, so the receiver consumes layer i while i+1 is being written.

Ownership: after ``close`` the segment belongs to the receiver, which unlinks it on
``release`` (after a full receive, an error or a timeout). ``abort`` on the sender
unlinks it too. ``sweep_stale_segments`` removes segments whose creator process
is gone and nobody received (e.g. both sides crashed).

Python 3.11's ``SharedMemory`` registers every mapping with the multiprocessing
resource tracker, which unlinks it when *that* process exits; the tracker would
destroy a segment the moment a short-lived sender exits, so both ends unregister
and manage the lifetime explicitly as above.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import _posixshmem
from typing import Iterator

import numpy as np

from dlbatch.transfer.base import Deadline, KVReceiver, KVSender, Transport
from dlbatch.transfer.errors import (
    CorruptPayload,
    FingerprintMismatch,
    SenderDied,
    TransferError,
)
from dlbatch.transfer.payload import (
    KVMeta,
    buffer_layout,
    check_layer,
    checksum,
    layer_state,
    layer_view,
    read_header,
    write_header,
    write_layer,
)

PREFIX = "dlkv_"
SHM_DIR = "/dev/shm"


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


class ShmSender(KVSender):
    def __init__(self, meta: KVMeta, verify: bool = True):
        self.meta = meta.without_checksums()
        self.verify = verify
        self._layout = buffer_layout(self.meta)
        name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=self._layout.total_size)
        _untrack(self._shm)
        try:
            write_header(self._shm.buf, self.meta)
        except BaseException:
            self._unlink()
            raise
        self._handle = ShmHandle(self._shm.name, self._layout.total_size, self.meta, os.getpid())
        self._sent: set[int] = set()

    @property
    def handle(self) -> ShmHandle:
        return self._handle

    def send_layer(self, i: int, array: np.ndarray) -> None:
        if self._shm is None:
            raise TransferError(f"shm sender for segment {self._handle.name} is closed; cannot send layer {i}")
        if i in self._sent:
            raise ValueError(f"layer {i} was already sent on segment {self._handle.name}")
        array = check_layer(self.meta, i, array)
        write_layer(self._shm.buf, self._layout, self.meta, i, array, self._checksum(array))
        self._sent.add(i)

    def close(self, timeout: float = 60.0) -> ShmHandle:
        missing = sorted(set(range(self.meta.num_layers)) - self._sent)
        if missing:
            raise TransferError(f"shm sender closed with layers {missing} never sent (segment {self._handle.name})")
        if self._shm is not None:
            _close_quietly(self._shm)  # the segment stays; the receiver unlinks it
            self._shm = None
        return self._handle

    def abort(self) -> None:
        self._unlink()

    def _unlink(self) -> None:
        if self._shm is not None:
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
        try:
            self._shm = shared_memory.SharedMemory(name=handle.name, create=False)
        except FileNotFoundError as e:
            raise TransferError(
                f"shared-memory segment {handle.name!r} does not exist: the sender aborted, "
                f"or another receiver already took it"
            ) from e
        _untrack(self._shm)
        try:
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

    def receive_layers(self, timeout: float) -> Iterator[tuple[int, np.ndarray]]:
        deadline = Deadline(
            timeout, f"KV layers in shared-memory segment {self.handle.name!r} from pid {self.handle.sender_pid}"
        )
        if self._shm is None:
            raise TransferError(f"shm receiver for segment {self.handle.name!r} was released")
        try:
            for i in range(self._done, self.meta.num_layers):
                csum = self._wait_ready(i, deadline)
                view = layer_view(self._shm.buf, self._layout, self.meta, i)
                if self.verify and csum is not None:
                    got = checksum(view, self.meta.checksum_algo)
                    if got != csum:
                        raise CorruptPayload(i, csum, got, self.meta.checksum_algo)
                self._done = i + 1
                yield i, view
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        shm, self._shm = getattr(self, "_shm", None), None
        if shm is None:
            return
        _unlink(shm)
        _close_quietly(shm)


class ShmTransport(Transport):
    name = "shm"

    def open_sender(self, meta: KVMeta, *, verify: bool | None = None) -> ShmSender:
        return ShmSender(meta, True if verify is None else verify)

    def open_receiver(self, handle: ShmHandle, *, verify: bool | None = None) -> ShmReceiver:
        return ShmReceiver(handle, True if verify is None else verify)


def list_segments() -> list[str]:
    """Names of dlkv segments present on this node."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return []


def sweep_stale_segments() -> list[str]:
    """Unlink dlkv segments whose creator pid no longer exists; returns their names."""
    removed = []
    for name in list_segments():
        try:
            pid = int(name[len(PREFIX) :].split("_", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed

"""One per-process pool of transfer buffers, shared by the shm segments
(dlbatch/transfer/shm.py) and the dlslime sender buffers (dlslime_transport.py).

A sender takes a buffer per payload; it is ``out`` while a sender holds it (``busy``)
and until the transport sees that its receiver is finished with it, then ``idle``,
ready for the next payload of the same size class: reusing pages that are already
faulted in is what makes the second transfer fast. Idle buffers beyond
``max_items`` / ``max_bytes`` are disposed of, oldest first.

The transport says what its buffers are through four hooks of a subclass:

- ``_create(size)``: a new buffer of ``size`` bytes (called without the lock held);
- ``_returned(item)``: for an ``out`` buffer no sender holds any more: ``"idle"`` (its
  receiver is done: reuse it), ``"drop"`` (it is gone: forget it, via ``_forget``) or
  ``None`` (still in use);
- ``_dispose(item)``: free an idle buffer trimmed from the pool;
- ``_usable(item)``: whether an idle buffer can still be handed out.

An item needs ``size`` (bytes) and ``busy`` (held by a sender) attributes. Methods whose
name ends in ``_locked`` expect ``self.lock`` held, so a transport can do its own
bookkeeping (control slots, ...) in the same critical section. The pool belongs to
the process that made it: `PerProcess` hands a forked child a new one.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


def size_class(nbytes: int, min_class: int = 1 << 20) -> int:
    """Buffer size for ``nbytes``: 2^k * {1, 1.25, 1.5, 1.75}, at least ``min_class``."""
    if nbytes <= min_class:
        return min_class
    top = 1 << (nbytes - 1).bit_length()  # next power of two
    step = top // 8  # classes between top/2 and top in steps of top/8
    return -(-nbytes // step) * step


class BufferPool(Generic[T]):
    def __init__(self, max_items: int, max_bytes: int):
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.idle: list[T] = []  # oldest first
        self.out: list[T] = []
        self.created = 0
        self.reused = 0

    # ---- hooks
    def _create(self, size: int) -> T:
        raise TypeError(f"{type(self).__name__} must define _create")

    def _returned(self, item: T) -> str | None:
        return None

    def _dispose(self, item: T) -> None:
        pass

    def _forget(self, item: T) -> None:
        pass

    def _usable(self, item: T) -> bool:
        return True

    # ---- with self.lock held
    def reclaim_locked(self) -> None:
        keep = []
        for item in self.out:
            verdict = None if item.busy else self._returned(item)
            if verdict == "idle":
                self.idle.append(item)
            elif verdict == "drop":
                self._forget(item)
            else:
                keep.append(item)
        self.out = keep

    def trim_locked(self, max_items: int, max_bytes: int) -> None:
        while self.idle and (len(self.idle) > max_items or sum(i.size for i in self.idle) > max_bytes):
            self._dispose(self.idle.pop(0))

    def take_idle_locked(self, size: int) -> T | None:
        """An idle buffer of exactly ``size`` bytes (moved to ``out``, busy), or None after
        making room for a new one of that size."""
        for k, item in enumerate(self.idle):
            if item.size == size and self._usable(item):
                self.idle.pop(k)
                item.busy = True
                self.reused += 1
                self.out.append(item)
                return item
        self.trim_locked(self.max_items, max(0, self.max_bytes - size))
        return None

    def stats_locked(self) -> dict:
        return {"idle": len(self.idle), "idle_bytes": sum(i.size for i in self.idle), "outstanding": len(self.out),
                "created": self.created, "reused": self.reused}

    # ---- public
    def acquire(self, size: int) -> T:
        """A busy buffer of ``size`` bytes (a size class), reused when one is idle."""
        with self.lock:
            self.reclaim_locked()
            item = self.take_idle_locked(size)
        if item is not None:
            return item
        item = self._create(size)
        with self.lock:
            self.created += 1
            self.out.append(item)
        return item

    def release_idle(self, items: list[T]) -> None:
        """Put busy ``out`` buffers straight back as idle (pre-warmed, never handed out)."""
        with self.lock:
            for item in items:
                item.busy = False
                self.out.remove(item)
                self.idle.append(item)

    def stats(self) -> dict:
        with self.lock:
            self.reclaim_locked()
            return self.stats_locked()

    def drain(self) -> list[T]:
        """Dispose of every idle buffer (after reclaiming returned ones); returns them."""
        with self.lock:
            self.reclaim_locked()
            items = list(self.idle)
            self.trim_locked(0, 0)
        return items


class PerProcess(Generic[T]):
    """The one ``factory()`` object of the current process: a forked child that calls
    `get` gets its own, never its parent's (whose buffers and threads it does not own)."""

    def __init__(self, factory: Callable[[], T]):
        self.factory = factory
        self.lock = threading.Lock()
        self.obj: T | None = None

    def get(self) -> T:
        with self.lock:
            if self.obj is None or self.obj.pid != os.getpid():
                self.obj = self.factory()
            return self.obj

    def peek(self) -> T | None:
        """The current process's object if it has one (never creates)."""
        obj = self.obj
        return obj if obj is not None and obj.pid == os.getpid() else None

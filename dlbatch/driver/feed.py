"""The input side of the driver loop: the Ray Data stream of request rows, pulled ahead.

`BatchPrefetcher` pulls the stream (parse, render, tokenize) on a background thread into a
bounded queue, so documents are parsed while the workers load the model and the loop never
blocks on a slow source while results wait to be collected. `InputFeed` moves rows from it
into the dispatcher while there is room, and knows how long the driver has been idle
waiting for input (the input watchdog's clock).
"""
from __future__ import annotations

import queue
import threading
import time

from dlbatch.records import prompt_length


class BatchPrefetcher:
    """Pulls the Ray Data stream (parse, render, tokenize) on a background thread into a
    bounded queue, so that documents are parsed while the workers load the model, and the
    driving loop never blocks on a slow source while results wait to be collected."""

    _END = object()

    def __init__(self, ds, depth: int = 8):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._ds = ds
        self.first_batch_at: float | None = None  # wall time the first batch came out (start-up breakdown)
        self._thread = threading.Thread(target=self._run, name="dlbatch-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for batch in self._ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                self.first_batch_at = self.first_batch_at or time.time()
                while not self._stop.is_set():
                    try:
                        self._q.put(batch, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            item = self._END
        except BaseException as e:  # handed to the driving loop, which raises it
            item = e
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def get(self, timeout: float = 0.0):
        """The next batch; None when nothing is ready within `timeout`; raises StopIteration
        at the end of the stream, or the stream's own error."""
        try:
            item = self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return None
        if item is self._END:
            self._q.put(item)  # stays at the end for any later call
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()


class InputFeed:
    """Request rows from the prefetcher into the dispatcher. Knows how long the driver has
    been idle (nothing in flight, no document open) waiting for the input pipeline.

    Order: with a `dlbatch.router.order.PrefixOrder` (``order``), blocks from the stream are
    held in it (up to its byte cap) and documents leave in prefix order, so requests that
    share a prompt prefix anywhere in what is held reach the router together; without one,
    in input order. Either way rows leave only while the dispatcher has room, a document's
    rows together.

    Gathering: with an order whose documents share prefixes in groups (`PrefixOrder.
    shares_partly`: a few-shot preamble per group of rows, not one chat-template head for all),
    nothing leaves for ``GATHER_S`` after the first block is held, unless the stream ends or
    the order fills first. Idle workers would otherwise take the whole first block at once
    (the dispatcher has room for hundreds of rows), and in a shuffled input that block holds
    a few rows of nearly every group: each prefix would be computed for them and again for
    its other rows, which arrive in the next blocks after the KV cache has evicted it (the
    shared-prefix benchmark computed 1.9x the ideal prefill in runs where the workers were
    ready before the second of its two blocks, 1.04x otherwise). An input of a few blocks is
    then sorted whole; a larger one costs the first token at most ``GATHER_S``, and an input
    without such groups (papers, passages) nothing.

    Memory: without an order, a block from the stream (one input file's documents, when they
    are few files) is held as its Arrow table and handed over ``SLICE_ROWS`` rows at a time,
    cut at a document boundary; with one, the order's cap bounds what is held. Only what is
    handed over becomes Python rows, so the driver's Python objects grow with what is in
    flight, not with the input's size."""

    SLICE_ROWS = 512
    GATHER_S = 2.0

    def __init__(self, prefetch: BatchPrefetcher, prepare=lambda row: row, order=None, clock=time.time):
        self.prefetch = prefetch
        self.prepare = prepare  # an input row -> the request row the dispatcher takes
        self.order = order  # a PrefixOrder, or None: input order
        self.clock = clock
        self.held_since: float | None = None  # when the order got its first block (gathering)
        self.ended = False  # the stream has no more blocks
        self.idle_since: float | None = None
        self.docs_seen = self.tokens_seen = 0  # documents tokenized this run and their tokens: the ETA of the others
        self._last_doc = None
        self._block = None  # input order: the rest of the current block (Arrow), not yet handed over

    @property
    def exhausted(self) -> bool:
        """Every row of the stream has been handed to the dispatcher."""
        return self.ended and self._block is None and not (self.order is not None and len(self.order))

    def pull(self, d, room, idle: bool) -> None:
        """Add rows while `room()`; wait a little for input only when nothing else can progress."""
        now = self.clock()
        self.idle_since = (self.idle_since or now) if idle and not self.exhausted else None
        self._fill(idle)
        if self.gathering():
            return
        while room():
            batch = self._next_rows()
            if batch is None:
                return
            self.idle_since = None
            for r in batch.to_pylist():
                if d.add_row(self.prepare(r)) and r.get("prompt_ids"):
                    self.docs_seen += r["doc_id"] != self._last_doc  # a document's rows come together
                    self._last_doc = r["doc_id"]
                    self.tokens_seen += prompt_length(r) + int(r["max_tokens"])

    def gathering(self) -> bool:
        """The order's first blocks are still being gathered (see the class docstring)."""
        o = self.order
        return (o is not None and self.held_since is not None and not self.ended and not o.full()
                and o.shares_partly and self.clock() - self.held_since < self.GATHER_S)

    def _get(self, timeout: float):
        """The next block of the stream, None when none is ready; marks the end of the stream."""
        if self.ended:
            return None
        try:
            return self.prefetch.get(timeout=timeout)
        except StopIteration:
            self.ended = True
            return None

    def _fill(self, idle: bool) -> None:
        """Blocks from the stream: into the order while it has room (a short wait only when
        the driver is idle and nothing is held), or the next block in input order."""
        if self.order is None:
            if self._block is None:
                self._block = self._get(0.2 if idle else 0.0)
            return
        wait = 0.2 if idle and not len(self.order) else 0.0
        while not self.order.full():
            block = self._get(wait)
            if block is None:
                return
            self.order.add(block)
            if self.held_since is None:
                self.held_since = self.clock()
            wait = 0.0

    def _next_rows(self):
        if self.order is not None:
            return self.order.take(self.SLICE_ROWS)
        if self._block is None:
            self._fill(False)
            if self._block is None:
                return None
        return self._next_slice()

    def _next_slice(self):
        """The next SLICE_ROWS rows of the block, and the rest of the last document's rows."""
        block = self._block
        n = min(self.SLICE_ROWS, block.num_rows)
        if n < block.num_rows:
            ids = block.column("doc_id")
            last = ids[n - 1].as_py()
            while n < block.num_rows and ids[n].as_py() == last:
                n += 1
        self._block = block.slice(n) if n < block.num_rows else None
        return block.slice(0, n)

    def idle_for(self, now: float) -> float:
        return 0.0 if self.idle_since is None else now - self.idle_since

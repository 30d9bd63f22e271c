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

    Memory: a block from the stream (one input file's documents, when they are few files) is
    held as its Arrow table and handed over ``SLICE_ROWS`` rows at a time, cut at a document
    boundary, while the dispatcher has room; only what is handed over becomes Python rows. So
    the driver's Python objects grow with what is in flight, not with the input's size, and a
    document's rows always reach the dispatcher together."""

    SLICE_ROWS = 512

    def __init__(self, prefetch: BatchPrefetcher, prepare=lambda row: row):
        self.prefetch = prefetch
        self.prepare = prepare  # an input row -> the request row the dispatcher takes
        self.exhausted = False
        self.idle_since: float | None = None
        self.docs_seen = self.tokens_seen = 0  # documents tokenized this run and their tokens: the ETA of the others
        self._last_doc = None
        self._block = None  # the rest of the current block (Arrow), not yet handed over

    def pull(self, d, room, idle: bool) -> None:
        """Add rows while `room()`; wait a little for input only when nothing else can progress."""
        now = time.time()
        self.idle_since = (self.idle_since or now) if idle and not self.exhausted else None
        while not self.exhausted and room():
            if self._block is None:
                try:
                    self._block = self.prefetch.get(timeout=0.2 if idle else 0.0)
                except StopIteration:
                    self.exhausted = True
                    return
                if self._block is None:
                    return
            self.idle_since, idle = None, False
            batch = self._next_slice()
            for r in batch.to_pylist():
                if d.add_row(self.prepare(r)) and r.get("prompt_ids"):
                    self.docs_seen += r["doc_id"] != self._last_doc  # a document's rows come together
                    self._last_doc = r["doc_id"]
                    self.tokens_seen += len(r["prompt_ids"]) + int(r["max_tokens"])

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

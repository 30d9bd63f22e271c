"""Requests on their way to the workers (`dlbatch.driver.dispatch`): the fresh-request queue,
the router's lists packed into batches, and the table of batches in flight.

- `WorkQueue`: fresh request rows in input order; the router takes windows of whole documents.
- `pack_routing`: the router's per-worker lists -> batches under ``max_batch_tokens``,
  interleaved across workers; `live_entries` drops rows that no longer need to run.
- `Batch`: the rows sent in one call, the exact duplicates riding on them, its workers and
  its failure site (the incarnations of the workers that run it).
- `InflightTable`: batch id -> `Batch`, and how many batches each worker holds.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Iterable

from dlbatch.records import prompt_length, request_id

WorkerKey = tuple  # (role, index)


class WorkQueue:
    """Fresh request rows in input order. `take_window` keeps a document's rows together."""

    def __init__(self):
        self._rows: collections.deque = collections.deque()

    def __len__(self) -> int:
        return len(self._rows)

    def push(self, rows: Iterable[dict]) -> None:
        self._rows.extend(rows)

    def push_front(self, rows: list[dict]) -> None:
        self._rows.extendleft(reversed(rows))

    def take_window(self, n: int) -> list[dict]:
        out = []
        while self._rows and len(out) < n:
            out.append(self._rows.popleft())
        while self._rows and out and self._rows[0]["doc_id"] == out[-1]["doc_id"]:
            out.append(self._rows.popleft())
        return out


@dataclass
class Batch:
    id: int
    rows: list  # request rows sent to the worker, one item each
    riders: dict  # request id -> rows of exact duplicates that take its result
    front: WorkerKey
    decode: WorkerKey | None
    site: frozenset  # {(role, index, epoch)} of every worker it runs on
    load: int  # decode load (prompt + max new tokens)
    solo: str | None = None  # the suspect document run alone, if any

    @property
    def workers(self) -> list:
        return [self.front] + ([self.decode] if self.decode is not None else [])

    def all_rows(self) -> list[dict]:
        return [x for r in self.rows for x in [r, *self.riders.get(request_id(r), [])]]


class InflightTable:
    """Batch id -> Batch, and how many batches each worker holds."""

    def __init__(self):
        self.batches: dict[int, Batch] = {}
        self._per_worker: collections.Counter = collections.Counter()
        self._next = 0

    def __len__(self) -> int:
        return len(self.batches)

    def new_id(self) -> int:
        self._next += 1
        return self._next

    @property
    def last_id(self) -> int:
        return self._next

    def add(self, b: Batch) -> None:
        self.batches[b.id] = b
        for k in b.workers:
            self._per_worker[k] += 1

    def pop(self, batch_id: int) -> Batch:
        b = self.batches.pop(batch_id)
        for k in b.workers:
            self._per_worker[k] -= 1
        return b

    def count(self, key: WorkerKey) -> int:
        return self._per_worker[key]


def pack_routing(routing, by_id: dict[str, dict], max_batch_tokens: int) -> list[tuple[list, int]]:
    """The router's per-worker request lists -> batches of at most ``max_batch_tokens``
    prompt tokens, each ``([(row, duplicate rows)], worker index)``, the workers' batches
    interleaved so that every worker gets work as slots free up."""
    fanout = getattr(routing, "fanout", {})
    per_worker = []
    for w, lst in enumerate(routing):
        batches, batch, tokens = [], [], 0
        for req in lst:
            r = by_id[req.request_id]
            if batch and tokens + prompt_length(r) > max_batch_tokens:
                batches.append((batch, w))
                batch, tokens = [], 0
            batch.append((r, [by_id[d] for d in fanout.get(req.request_id, [])]))
            tokens += prompt_length(r)
        if batch:
            batches.append((batch, w))
        per_worker.append(batches)
    return [b[i] for i in range(max((len(b) for b in per_worker), default=0)) for b in per_worker if i < len(b)]


def live_entries(entries: list, is_live: Callable[[dict], bool]) -> list:
    """Drops rows of finished or suspect documents; a dropped row's duplicates take its place."""
    live = []
    for row, dups in entries:
        group = [r for r in [row, *dups] if is_live(r)]
        if group:
            live.append((group[0], group[1:]))
    return live

"""Complete documents waiting to be committed, and when to commit them.

Rows of a document enter together (`add_document`), so a part never holds part of a
document. `due()` says a part should be written: `flush_docs` documents are waiting, or
`flush_seconds` passed since the last commit. The owner writes what `take()` returns.
"""
from __future__ import annotations

import time


class CommitBuffer:
    def __init__(self, flush_docs: int = 16, flush_seconds: float = 5.0, clock=time.time):
        self.flush_docs = flush_docs
        self.flush_seconds = flush_seconds
        self.clock = clock
        self.rows: list[dict] = []
        self.errors: list[dict] = []
        self.docs = 0
        self.last = clock()

    def add_document(self, rows: list[dict]) -> None:
        self.rows.extend(rows)
        self.docs += 1

    def add_errors(self, rows: list[dict]) -> None:
        self.errors.extend(rows)

    def due(self, force: bool = False) -> bool:
        return force or self.docs >= self.flush_docs or self.clock() - self.last >= self.flush_seconds

    def take(self) -> tuple[list[dict], list[dict]]:
        """(result rows, dead-letter rows) to commit now; the buffer starts over."""
        rows, errors = self.rows, self.errors
        self.rows, self.errors, self.docs, self.last = [], [], 0, self.clock()
        return rows, errors

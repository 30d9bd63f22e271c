"""What the dispatcher hands the commit buffer (`dlbatch.driver.dispatch`): completed
documents, dead letters, the error rows of (document, task)s that failed alone, and the
``DuplicateId`` dead letters of a document id read from a second source.
"""
from __future__ import annotations

import logging

from connectors.ids import content_id
from dlbatch.driver.document import Document

log = logging.getLogger("dlbatch.run")


class Outcomes:
    """What the commit buffer takes: completed documents, dead letters, and error rows of
    (document, task)s that failed alone. Each `take` hands a list over and starts a new one."""

    def __init__(self):
        self.completed: list[Document] = []
        self.dead: list[dict] = []
        self.task_errors: list[dict] = []

    def dead_letter(self, doc: Document, stage: str, etype: str, msg: str) -> None:
        self.dead.append({"doc_id": doc.doc_id, "source": doc.source, "stage": stage, "error_type": etype,
                          "error": msg[:1000]})
        log.warning("dead-lettered document %s (%s: %s)", doc.doc_id, etype, msg[:200])

    def task_error(self, doc: Document, task: str, stage: str, etype: str, msg: str) -> None:
        """An error row naming the task; it counts as that task's outcome, so the document's
        other tasks still commit."""
        doc.results[task] = {"error": msg, "stage": stage, "error_type": etype}
        self.task_errors.append({"doc_id": doc.doc_id, "source": doc.source, "task": task, "stage": stage,
                                 "error_type": etype, "error": msg[:1000]})
        log.warning("task %s of document %s failed alone (%s: %s)", task, doc.doc_id, etype, msg[:200])

    def take(self, name: str) -> list:
        out = getattr(self, name)
        setattr(self, name, [])
        return out


class Duplicates:
    """One document id from two sources (the same ``input.id_field`` value in two input files,
    or two files of the same text when ids are the text's hash). The first source to reach the
    driver is the document; each other source is a ``DuplicateId`` dead letter (stage "read")
    naming the id and both sources. Its own doc_id is the hash of its source and the id, so it
    never stands for the document, and it is the same on every run.

    A dead letter for a document still open is held until that document's outcome and handed
    over with it (`release`), so both land in one commit: a crash can never leave the dead
    letter committed without the document, where a rerun would run the other copy and name
    the document the duplicate. A rerun skips both (the document's id is committed). Holds the
    first source of every id of the run (finished documents too) and the dead letters' ids."""

    def __init__(self):
        self.first: dict[str, str] = {}  # doc id -> the source of its document
        self.given: set[str] = set()  # dead letters' ids: the duplicate's other rows are ignored
        self.held: dict[str, list[dict]] = {}  # open doc id -> dead letters waiting for its outcome

    def check(self, row: dict, is_open: bool, ready: list) -> bool:
        """Whether ``row`` is a duplicate's (then handled: its dead letter held, or put in
        ``ready`` when the document is finished). A row of the document's own source is not."""
        d_id, source = row["doc_id"], row.get("source") or ""
        first = self.first.setdefault(d_id, source)
        if first == source:
            return False
        dup_id = content_id(f"{source}\n{d_id}")
        if dup_id not in self.given:
            self.given.add(dup_id)
            letter = {"doc_id": dup_id, "source": source, "stage": "read", "error_type": "DuplicateId",
                      "error": f"duplicate document id {d_id!r}: {source} repeats the id of {first}, which is "
                               f"the document; this copy is not run"[:1000]}
            (self.held.setdefault(d_id, []) if is_open else ready).append(letter)
            log.warning("input %s repeats the document id %r of %s: a DuplicateId dead letter", source, d_id, first)
        return True

    def release(self, d_id: str) -> list[dict]:
        """The dead letters held for document ``d_id``, now that it has its outcome."""
        return self.held.pop(d_id, [])

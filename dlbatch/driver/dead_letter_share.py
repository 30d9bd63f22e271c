"""A run whose documents mostly fail stops instead of finishing "complete".

`DeadLetterShare` counts this run's finished documents (committed, or dead-lettered whole)
and the error types of its dead letters. Once ``MIN_DOCS`` documents have finished, and at
the end whatever their number, a dead-letter share above the job's
``max_dead_letter_fraction`` raises `TooManyDeadLetters`: the run exits non-zero with one
line naming the share, the commonest error type and an example, and the output is not
marked complete (the runner records the stop as ``halted`` in the manifest).

What a rerun of such an output does (`dlbatch.driver.checks.restart_reason`,
`RETRIED_ON_RESUME`): an output that holds no result row starts over (any fix of the job is
accepted); otherwise the rerun resumes, and the documents that failed whole with an error a
fix of the job's fields or of the input rows addresses are read again.
"""
from __future__ import annotations

import collections

from dlbatch.workers.pools import JobFailed

MIN_DOCS = 20  # documents finished in this run before the share is judged mid-run
# dead letters a resume retries: a field the job names that the row lacks, holds in another
# type, or leaves empty; fixed by the job's input.text_field / id_field or by the input row
RETRIED_ON_RESUME = frozenset({"MissingField", "BadFieldType", "EmptyDocument"})


class TooManyDeadLetters(JobFailed):
    """This run's dead-letter share passed ``max_dead_letter_fraction``; ``brief`` is the
    short form the manifest records."""

    def __init__(self, message: str, brief: str):
        super().__init__(message)
        self.brief = brief


class DeadLetterShare:
    def __init__(self, limit: float, min_docs: int = MIN_DOCS):
        self.limit, self.min_docs = limit, min_docs
        self.ok = self.failed = 0
        self.types: collections.Counter = collections.Counter()
        self.example: dict[str, str] = {}  # error type -> its first message

    def note(self, ok: int = 0, dead: list[dict] = ()) -> None:
        """``ok`` documents committed; ``dead``: dead-letter rows of documents that failed whole."""
        self.ok += ok
        self.failed += len(dead)
        for d in dead:
            t = d.get("error_type") or "Error"
            self.types[t] += 1
            self.example.setdefault(t, str(d.get("error") or ""))

    def check(self, final: bool = False) -> None:
        """Raise `TooManyDeadLetters` when the share is over the limit (judged from MIN_DOCS
        finished documents on, and at the end: ``final``)."""
        n = self.ok + self.failed
        if n == 0 or (n < self.min_docs and not final) or self.failed / n <= self.limit:
            return
        top, count = self.types.most_common(1)[0]
        brief = f"{self.failed} of {n} documents dead-lettered, {count} {top}"
        example = " ".join(self.example[top].split())[:200]
        retried = (f"its {top} dead letters are read again by the rerun" if top in RETRIED_ON_RESUME
                   else f"{top} dead letters stay failed on a rerun (--fresh starts over)")
        raise TooManyDeadLetters(
            f"{self.failed} of the {n} documents this run finished were dead-lettered ({100 * self.failed / n:.0f}%, "
            f"over max_dead_letter_fraction {self.limit:g}); the commonest, {count} x {top}: {example}; the output is "
            f"not marked complete: fix the job or the input and rerun ({retried})", brief)

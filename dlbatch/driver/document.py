"""One document's requests and results, and the evidence against it (`dlbatch.driver.dispatch`).

A `Document` owns its requests (request name -> row: `dlbatch.records.RequestKey.name`) and
their results; it is complete when every request has a result and the dispatcher's
``more_requests`` hook adds no further ones. A request is in exactly one place: a queue
(fresh, retry or routed), one in-flight batch, or done. Its result rows are built with
`dlbatch.records.result_row`: one per task, sample 0's with every sample in ``samples``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from dlbatch.records import RequestKey, result_row


@dataclass
class Document:
    """One document's requests and results, and the evidence against it."""

    doc_id: str
    rows: dict = field(default_factory=dict)  # task -> request row, in arrival order
    results: dict = field(default_factory=dict)  # task -> result dict
    inflight: set = field(default_factory=set)  # tasks in a batch now
    sites: set = field(default_factory=set)  # failure sites of the batches it was lost in
    failed_on: set = field(default_factory=set)  # worker keys of those batches
    solo_failed_on: set = field(default_factory=set)
    # only batches submitted after its last failure add evidence: the batches of one
    # document lost together (a node loss taking two workers) are one piece of evidence
    evidence_after: int = 0
    suspect: bool = False
    attempts: int = 0  # charged failures: only solo runs of a suspect
    last_error: str = ""

    @property
    def source(self) -> str:
        return next(iter(self.rows.values())).get("source", "") if self.rows else ""

    def add_request(self, row: dict) -> bool:
        """Adds a request row; False when this task is already there (input duplicate)."""
        if row["task"] in self.rows:
            return False
        self.rows[row["task"]] = row
        return True

    def waiting(self) -> list[dict]:
        """Rows neither done nor in flight."""
        return [r for t, r in self.rows.items() if t not in self.results and t not in self.inflight]

    def all_done(self) -> bool:
        return not self.inflight and len(self.results) == len(self.rows)

    def output_rows(self, model: str, extra: Callable[[str, dict], dict] | None = None) -> list[dict]:
        """One result row per task; a task that failed alone (its result holds "error") has
        its error row already and no result row. ``extra(task, result)``: more fields."""
        out = []
        samples: dict[str, list] = {}  # request name -> results of its samples 1..n-1 (dlbatch/prompts/sampling.py)
        for t, res in self.results.items():
            key = RequestKey.parse(self.doc_id, t)
            if key.sample and "error" not in res:
                samples.setdefault(key.with_sample(0).name, []).append((key.sample, res))
        for r in self.rows.values():
            if RequestKey.of(r).sample:
                continue
            res = self.results[r["task"]]
            if "error" in res:
                continue
            if r["task"] in samples:  # n samples: the row is sample 0's, every one in `samples`
                res = {**res, "samples": [res] + [x for _, x in sorted(samples[r["task"]], key=lambda p: p[0])]}
            out.append(result_row(r, res, model, extra=extra))
        return out

"""What a lost batch says of its documents (`dlbatch.driver.dispatch`), and the suspects run alone.

`Blame` (the `RetryPolicy` decides): a lost batch's rows go back to the front of the retry
queue, to run on other workers, and the failure is the worker's. A document lost at enough
different failure sites is a suspect: `Isolations` reserves drained workers for it, so it
runs alone while the other workers keep running normal batches; only its solo failures are
charged against ``max_attempts``, and the last one is its dead letter. Suspects hold at most
all but one live front worker.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from dlbatch.driver.batches import Batch, WorkerKey
from dlbatch.driver.document import Document
from dlbatch.driver.retry_policy import RetryPolicy
from dlbatch.driver.worker_table import WorkerTable

log = logging.getLogger("dlbatch.run")


@dataclass
class _Isolation:
    front: WorkerKey
    decode: WorkerKey | None

    @property
    def workers(self) -> list:
        return [self.front] + ([self.decode] if self.decode is not None else [])


class Isolations:
    """Suspect documents waiting to run alone (in order), and the workers reserved for each.
    Suspects hold at most all but one live front worker, so the rest keep working; a
    reservation whose worker failed is given up and made again elsewhere."""

    def __init__(self, workers: WorkerTable, front_role: str, pd: bool, policy: RetryPolicy):
        self.workers, self.front_role, self.pd, self.policy = workers, front_role, pd, policy
        self.waiting: collections.OrderedDict = collections.OrderedDict()  # doc id -> None
        self.reserved: dict[str, _Isolation] = {}  # suspect doc id -> workers reserved for it

    def wait(self, d_id: str) -> None:
        self.waiting.setdefault(d_id)

    def forget(self, d_id: str) -> None:
        """The document is finished: not waiting, nothing reserved."""
        self.waiting.pop(d_id, None)
        self.release(d_id)

    def release(self, d_id: str) -> None:
        iso = self.reserved.pop(d_id, None)
        for k in iso.workers if iso else ():
            if self.workers[k].reserved_for == d_id:
                self.workers[k].reserved_for = None

    def claim(self, doc: Document, now: float) -> _Isolation | None:
        """The workers reserved for ``doc``, reserving them if there is room; None: not now."""
        iso = self.reserved.get(doc.doc_id)
        if iso is not None and any(self.workers[k].state != "ok" for k in iso.workers):
            self.release(doc.doc_id)  # a reserved worker failed meanwhile: reserve others
            iso = None
        if iso is None and len(self.reserved) < max(1, len(self.workers.live(self.front_role)) - 1):
            iso = self._reserve(doc, now)
        return iso

    def _reserve(self, doc: Document, now: float) -> _Isolation | None:
        def candidates(role):
            ws = [w for w in self.workers.of(role) if w.state == "ok" and w.reserved_for is None]
            return sorted(ws, key=lambda w: (w.key in doc.solo_failed_on, w.streak > 0, w.hold_until > now,
                                             self.workers.inflight.count(w.key), w.key[1]))

        fronts = candidates(self.front_role)
        decs = candidates("decode") if self.pd else [None]
        if not fronts or not decs:
            return None
        iso = _Isolation(fronts[0].key, decs[0].key if decs[0] is not None else None)
        for k in iso.workers:
            self.workers[k].reserved_for = doc.doc_id
        self.reserved[doc.doc_id] = iso
        log.warning("retrying document %s alone on %s: a suspect (in batches lost at %d failure sites; %d of %d "
                    "attempts charged)", doc.doc_id, " + ".join(f"{r} worker {i}" for r, i in iso.workers),
                    len(doc.sites), doc.attempts, self.policy.max_attempts)
        return iso


class Blame:
    """What a lost batch means for each of its documents (`RetryPolicy` decides): its rows go
    back to the front of the retry queue, to run on other workers; a document lost at
    enough different sites becomes a suspect that runs alone (`Isolations`); a suspect's
    own solo failures are charged against ``max_attempts`` and end in a dead letter."""

    def __init__(self, workers: WorkerTable, policy: RetryPolicy, isolation: Isolations, stats: collections.Counter):
        self.workers, self.policy, self.isolation, self.stats = workers, policy, isolation, stats
        self.retry: collections.OrderedDict = collections.OrderedDict()  # doc id -> rows, front first

    def lost(self, docs: dict[str, Document], b: Batch, rows: list[dict], reason: str,
             etype: str) -> list[tuple[Document, str]]:
        """Rows of batch ``b`` came back without results; -> documents to dead-letter, with why."""
        by_doc: dict[str, list] = {}
        for r in rows:
            doc = docs.get(r["doc_id"])
            if doc is not None:
                doc.inflight.discard(r["task"])
                by_doc.setdefault(r["doc_id"], []).append(r)
        dead = []
        for d_id, drows in by_doc.items():
            doc = docs[d_id]
            doc.last_error = reason
            if b.solo == d_id:
                why = self._charge(doc, b, reason, etype)
                dead += [(doc, why)] if why else []
                continue
            doc.failed_on.update(b.workers)
            if b.id > doc.evidence_after:  # not a batch lost together with an earlier one
                self.stats["requeued"] += 1
                # an engine error leaves the worker up (same epoch): each such batch is its own site
                doc.sites.add(b.site if etype != "EngineError" else b.site | {("batch", b.id, 0)})
                doc.evidence_after = self.workers.inflight.last_id
            others = all(len(self.workers.live(k[0])) > 1 for k in b.workers)  # a retry can avoid each
            if not doc.suspect and self.policy.is_suspect(len(doc.sites), other_workers=others):
                doc.suspect = True
                self.stats["suspects"] += 1
            if doc.suspect:
                self.isolation.wait(d_id)
                continue
            log.warning("retrying document %s on another worker (%s on %s): %s", d_id, etype,
                        " + ".join(f"{r} worker {i}" for r, i in b.workers), reason[:200])
            self.retry[d_id] = self.retry.get(d_id, []) + drows
            self.retry.move_to_end(d_id, last=False)
        return dead

    def _charge(self, doc: Document, b: Batch, reason: str, etype: str) -> str | None:
        """A suspect's solo run failed: one attempt charged; -> the dead letter's message when
        none are left, else None (it waits to run alone again)."""
        doc.attempts += 1
        doc.solo_failed_on.add(b.front)
        self.stats["attempts_charged"] += 1
        mx = self.policy.max_attempts
        if self.policy.dead(doc.attempts):
            return (f"failed on all {doc.attempts} attempts run alone (retries.max_attempts={mx}; after "
                    f"failing in batches on {len(doc.sites)} different workers; a document that keeps "
                    f"crashing its worker is a poison pill); last error: {reason}")
        log.warning("retrying document %s alone (attempt %d/%d) after %s", doc.doc_id, doc.attempts + 1, mx,
                    reason[:200])
        self.isolation.wait(doc.doc_id)
        return None

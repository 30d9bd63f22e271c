"""The driver's decisions as plain objects: which requests run where, and what a failure means.

No Ray and no model here: `Dispatcher` is driven by whoever owns the workers (the runner
with Ray actors, tests with fake workers) through a small loop:

    d.add_row(row)                        # request rows from the input, grouped by document
    for batch in d.next_batches(): ...    # submit batch.rows to batch.front (and batch.decode)
    d.batch_done(batch.id, results)       # the call returned (results may carry "error")
    d.batch_failed(batch.id, reason)      # the call failed: the worker crashed or was lost
    d.unhealthy() / d.worker_back(key) / d.worker_dead(key)   # the owner's health probes
    d.take_completed(), d.take_dead_letters()                 # to the commit buffer

Objects and their invariants, one file each:

- `Document` (document.py) owns its requests (request name -> row) and their results; it is
  complete when every request has a result and the `more_requests` hook (given to the
  Dispatcher) adds no further ones. A request is in exactly one place: a queue (fresh,
  retry or routed), one in-flight batch, or done.
- batches.py: `WorkQueue`, fresh rows in input order (the router takes windows of whole
  documents); `InflightTable`, batch id -> `Batch` (rows, the duplicates riding on them,
  workers, the failure site, whether it is a suspect's solo run).
- `WorkerTable` (worker_table.py): per (role, index) worker: ok / unhealthy / dead, its epoch
  (moves on when it comes back after a failure), failure streak, hold-back, reservation for
  a suspect; which worker takes a batch now (`pick`) and what a failed batch says of its
  workers (`blame`).
- blame.py: `Blame`, what a lost batch says of its documents (the retry queue, suspects,
  charged attempts); `Isolations`, suspects waiting to run alone and the workers reserved
  for them.
- outcomes.py: `Outcomes`, completed documents, dead letters and task error rows until the
  owner takes them; `Duplicates`, a document id read from a second source.
- `RetryPolicy` (retry_policy.py): blame. A failed batch's requests go back to the
  front of the queue, on another worker when there is one; the failure is the worker's.
  A document in failures at two different sites is a suspect: it is run alone on a
  drained worker while the other workers keep running normal batches, and only its solo
  failures are charged against `max_attempts`.
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Hashable

from dlbatch.driver.batches import Batch, InflightTable, WorkerKey, WorkQueue, live_entries, pack_routing
from dlbatch.driver.blame import Blame, Isolations
from dlbatch.driver.document import Document
from dlbatch.driver.outcomes import Duplicates, Outcomes
from dlbatch.driver.retry_policy import RetryPolicy
from dlbatch.driver.worker_table import WorkerState, WorkerTable
from dlbatch.records import prompt_length, request_id


class Dispatcher:
    """Queue -> router -> batches on workers; results -> documents; failures -> blame.

    counts: workers per role, {"colocated": n} or {"prefill": n, "decode": m}.
    router: a `dlbatch.router.Router` over the front workers (prefix-aware windows).
    request_key(row): the router's sampling key of a row (None: greedy, may be folded).
    more_requests(doc): called when every request of `doc` is done; rows it returns are
    added to the document (new tasks) and queued, and the document completes only when it
    returns none. The default adds nothing.
    is_fatal(error): an engine error that retrying cannot mend (e.g. a constraint that does
    not compile): the request's task fails alone with an error row (`take_task_errors`).
    """

    def __init__(self, counts: dict[str, int], router, policy: RetryPolicy | None = None, *,
                 max_batch_tokens: int = 8192, inflight_cap: int = 16, window: int = 256,
                 request_key: Callable[[dict], Hashable | None] = lambda r: None,
                 more_requests: Callable[[Document], list[dict]] | None = None,
                 is_fatal: Callable[[str | None], bool] = lambda err: False, clock=time.monotonic):
        self.pd = "prefill" in counts
        self.front_role = "prefill" if self.pd else "colocated"
        self.inflight = InflightTable()
        self.workers = WorkerTable(counts, self.inflight)
        self.router = router
        self.policy = policy or RetryPolicy()
        self.isolation = Isolations(self.workers, self.front_role, self.pd, self.policy)
        self.outcomes = Outcomes()
        self.max_batch_tokens = max_batch_tokens
        self.inflight_cap = inflight_cap
        self.window = window
        self.request_key = request_key
        self.more_requests = more_requests
        self.is_fatal = is_fatal
        self.clock = clock
        self.docs: dict[str, Document] = {}
        self.finished_ids: set[str] = set()  # completed or dead-lettered: later input rows ignored
        self.duplicates = Duplicates()  # the same id from another source: a DuplicateId dead letter
        self.queue = WorkQueue()
        self.routed: collections.deque = collections.deque()  # ([(row, dup rows)], front index)
        self.paused = False  # the owner stops submissions (e.g. re-forming a collective group)
        self.stats = collections.Counter()  # requeued, attempts_charged, suspects, solo_batches, ...
        self.blame = Blame(self.workers, self.policy, self.isolation, self.stats)

    # ------------------------------------------------------------------ input
    def add_row(self, row: dict) -> bool:
        """One request row (or an input error row, with "error"); False when ignored or a
        duplicate's (`Duplicates`)."""
        d_id = row["doc_id"]
        if self.duplicates.check(row, d_id in self.docs, self.outcomes.dead) or d_id in self.finished_ids:
            return False
        if row.get("error") and row.get("task"):  # one task's prompt failed for this document
            doc = self.docs.setdefault(d_id, Document(d_id))
            if doc.add_request(row):
                self.task_error(doc, row["task"], row.get("stage") or "prompt", row.get("error_type") or "Error",
                                row["error"])
            return True
        if row.get("error"):
            doc = self.docs.get(d_id) or Document(d_id, rows={row.get("task") or "_input": row})
            self._dead_letter(doc, row.get("stage") or "parse", row.get("error_type") or "Error", row["error"])
            return True
        doc = self.docs.setdefault(d_id, Document(d_id))
        if not doc.add_request(row):
            return False  # the same document twice in the input: computed once
        self.queue.push([row])
        return True

    @property
    def retry(self) -> collections.OrderedDict:
        """Rows of lost batches by document, front first (`Blame`)."""
        return self.blame.retry

    @property
    def queued(self) -> int:
        return len(self.queue)

    def pause(self) -> None:
        """Submit nothing until `resume` (the owner re-forms a collective group meanwhile)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def finished(self) -> bool:
        """Every document added so far is committed or dead-lettered."""
        return not self.docs and not len(self.inflight)

    # ------------------------------------------------------------------ scheduling
    def next_batches(self) -> list[Batch]:
        """Batches to submit now, already entered in the in-flight table."""
        if self.paused:
            return []
        now = self.clock()
        out: list[Batch] = []
        self._run_suspects(out, now)
        self._submit_retries(out, now)
        self._submit_routed(out, now)
        for b in out:
            for k in b.workers:
                self.workers[k].submitted += 1
            self.stats["batches"] += 1
            self.stats["solo_batches"] += b.solo is not None
        return out

    def _new_batch(self, entries: list, front: WorkerKey, decode: WorkerKey | None, solo: str | None = None) -> Batch:
        rows = [e[0] for e in entries]
        riders = {request_id(e[0]): list(e[1]) for e in entries if e[1]}
        site = frozenset((k[0], k[1], self.workers[k].epoch) for k in [front] + ([decode] if decode else []))
        load = sum(prompt_length(r) + int(r["max_tokens"]) for r in rows)
        b = Batch(self.inflight.new_id(), rows, riders, front, decode, site, load, solo)
        for r in b.all_rows():
            self.docs[r["doc_id"]].inflight.add(r["task"])
        if decode is not None:
            self.workers[decode].load += load
        self.inflight.add(b)
        return b

    def _live_row(self, row: dict) -> bool:
        """A queued row still to run in a normal batch (its document neither finished nor a suspect)."""
        doc = self.docs.get(row["doc_id"])
        return (doc is not None and not doc.suspect and row["task"] not in doc.results
                and row["task"] not in doc.inflight)

    def _run_suspects(self, out: list, now: float) -> None:
        for d_id in list(self.isolation.waiting):
            doc = self.docs.get(d_id)
            if doc is None:
                self.isolation.waiting.pop(d_id)
                continue
            iso = self.isolation.claim(doc, now)
            if iso is None:
                continue
            if doc.inflight or any(self.inflight.count(k) for k in iso.workers) or now < max(
                    self.workers[k].hold_until for k in iso.workers):
                continue  # draining the reserved workers
            rows = doc.waiting()
            self.isolation.waiting.pop(d_id)
            if not rows:
                self.isolation.release(d_id)
                self._check_done(doc)
                continue
            out.append(self._new_batch([(r, []) for r in rows], iso.front, iso.decode, solo=d_id))

    def _submit_retries(self, out: list, now: float) -> None:
        """Requests of lost batches, one document per batch, on a worker it did not fail on."""
        while self.retry and len(self.inflight) < self.inflight_cap:
            d_id, rows = next(iter(self.retry.items()))
            rows = [r for r in rows if self._live_row(r)]
            if not rows:
                self.retry.pop(d_id)
                continue
            doc = self.docs[d_id]
            front = self.workers.pick(self.front_role, now, avoid=doc.failed_on)
            ok, decode = self.workers.pick_decode(now, avoid=doc.failed_on)
            if front is None or not ok:
                return
            self.retry.pop(d_id)
            out.append(self._new_batch([(r, []) for r in rows], front, decode))

    def _submit_routed(self, out: list, now: float) -> None:
        while len(self.inflight) < self.inflight_cap:
            if not self.routed:
                if not len(self.queue) or self.workers.pick(self.front_role, now) is None:
                    return
                self._route_window()
                continue
            entries, w = self.routed[0]
            entries = live_entries(entries, self._live_row)
            if not entries:
                self.routed.popleft()
                continue
            front = self.workers.pick(self.front_role, now, prefer=w)
            ok, decode = self.workers.pick_decode(now)
            if front is None or not ok:
                return
            self.routed.popleft()
            out.append(self._new_batch(entries, front, decode))

    def _route_window(self) -> None:
        """Route one window of fresh rows (whole documents) into per-worker batches."""
        from dlbatch.router import Request

        rows = [r for r in self.queue.take_window(self.window) if self._live_row(r)]
        by_id = {request_id(r): r for r in rows}
        reqs = [Request(rid, tuple(r["prompt_ids"]), int(r["max_tokens"]), self.request_key(r),
                        salt=r.get("prefix_salt"))  # adapter and images: no prefix shared across them
                for rid, r in by_id.items()]
        routing = self.router.route(reqs) if reqs else []
        self.routed.extend(pack_routing(routing, by_id, self.max_batch_tokens))

    # ------------------------------------------------------------------ outcomes
    def batch_done(self, batch_id: int, results: list[dict]) -> None:
        """The call returned: record results; requests with an "error" (or none) failed."""
        b = self._pop(batch_id)
        self.workers.succeeded(b)
        by_id = {r.get("request_id"): r for r in results}
        lost, reason = [], ""
        for row in b.rows:
            res = by_id.get(request_id(row))
            group = [row, *b.riders.get(request_id(row), [])]
            if res is not None and self.is_fatal(res.get("error")):  # fails its (document, task) alone
                for r in group:
                    doc = self.docs.get(r["doc_id"])
                    if doc is not None:
                        doc.inflight.discard(r["task"])
                        self.task_error(doc, r["task"], "generate", res["error"].split(":", 1)[0], res["error"])
                continue
            if res is None or "error" in res:
                lost.extend(group)
                reason = reason or (res or {}).get("error") or "the worker returned no result for the request"
                continue
            for r in group:
                doc = self.docs.get(r["doc_id"])
                if doc is not None:
                    doc.inflight.discard(r["task"])
                    doc.results[r["task"]] = res
        if lost:
            self._lost(b, lost, reason, "EngineError")
        self._after(b)

    def batch_failed(self, batch_id: int, reason: str, etype: str = "WorkerCrash") -> None:
        """The call failed (worker died, node lost, KV lost): blame its workers; requeue."""
        b = self._pop(batch_id)
        self.workers.blame(b, self.clock())
        self._lost(b, b.all_rows(), reason, etype)
        self._after(b)

    def _pop(self, batch_id: int) -> Batch:
        b = self.inflight.pop(batch_id)
        if b.decode is not None:
            self.workers[b.decode].load -= b.load
        return b

    def _lost(self, b: Batch, rows: list[dict], reason: str, etype: str) -> None:
        for doc, why in self.blame.lost(self.docs, b, rows, reason, etype):
            self._dead_letter(doc, "generate", etype, why)

    def _after(self, b: Batch) -> None:
        if b.solo is not None:
            self.isolation.release(b.solo)
        for d_id in dict.fromkeys(r["doc_id"] for r in b.all_rows()):
            doc = self.docs.get(d_id)
            if doc is not None:
                self._check_done(doc)

    def _check_done(self, doc: Document) -> None:
        if not doc.all_done() or doc.doc_id not in self.docs:
            return
        more = self.more_requests(doc) if self.more_requests else []
        added = [r for r in more or [] if doc.add_request(r)]
        if added:
            if doc.suspect:
                self.isolation.wait(doc.doc_id)
            else:
                self.queue.push_front(added)
            return
        self._finish(doc)
        self.outcomes.completed.append(doc)

    def _dead_letter(self, doc: Document, stage: str, etype: str, msg: str) -> None:
        self.outcomes.dead_letter(doc, stage, etype, msg)
        self._finish(doc)

    def _finish(self, doc: Document) -> None:
        """Committed or dead-lettered: later input rows of the document are ignored."""
        self.docs.pop(doc.doc_id, None)
        self.finished_ids.add(doc.doc_id)
        self.outcomes.dead.extend(self.duplicates.release(doc.doc_id))  # in the document's commit
        self.isolation.forget(doc.doc_id)

    def take_completed(self) -> list[Document]:
        return self.outcomes.take("completed")

    def task_error(self, doc: Document, task: str, stage: str, etype: str, msg: str) -> None:
        """One (document, task) failed alone (`Outcomes.task_error`). Completion is checked
        where a batch ends (`_after`), never here: an input row's document may not have all
        its rows yet."""
        self.outcomes.task_error(doc, task, stage, etype, msg)

    def take_task_errors(self) -> list[dict]:
        return self.outcomes.take("task_errors")

    def take_dead_letters(self) -> list[dict]:
        return self.outcomes.take("dead")

    # ------------------------------------------------------------------ worker health
    def unhealthy(self) -> list[WorkerState]:
        return self.workers.unhealthy()

    def worker_back(self, key: WorkerKey) -> None:
        self.workers.back(key, self.clock(), self.policy)

    def worker_dead(self, key: WorkerKey) -> None:
        w = self.workers[key]
        w.state = "dead"
        if w.reserved_for is not None:
            self.isolation.release(w.reserved_for)

    def dead_role(self) -> str | None:
        """A role whose every worker is dead while documents remain: the job cannot go on."""
        return self.workers.dead_role() if self.docs else None

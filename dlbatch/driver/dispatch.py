"""The driver's decisions as plain objects: which requests run where, and what a failure means.

No Ray and no model here: `Dispatcher` is driven by whoever owns the workers (the runner
with Ray actors, tests with fake workers) through a small loop:

    d.add_row(row)                        # request rows from the input, grouped by document
    for batch in d.next_batches(): ...    # submit batch.rows to batch.front (and batch.decode)
    d.batch_done(batch.id, results)       # the call returned (results may carry "error")
    d.batch_failed(batch.id, reason)      # the call failed: the worker crashed or was lost
    d.unhealthy() / d.worker_back(key) / d.worker_dead(key)   # the owner's health probes
    d.take_completed(), d.take_dead_letters()                 # to the commit buffer

Objects and their invariants:

- `Document` owns its requests (task -> row) and their results; it is complete when every
  request has a result and the `more_requests` hook (given to the Dispatcher) adds no
  further ones. A request is in exactly one place: a queue (fresh, retry or routed), one
  in-flight batch, or done.
- `WorkQueue`: fresh rows in input order; the router takes windows of whole documents.
- `InflightTable`: batch id -> `Batch` (rows, the duplicates riding on them, workers,
  the failure site, whether it is a suspect's solo run).
- `Workers`: per (role, index) worker: ok / unhealthy / dead, its epoch (moves on when it
  comes back after a failure), failure streak, hold-back, reservation for a suspect; which
  worker takes a batch now (`pick`) and what a failed batch says of its workers (`blame`).
- `Blame`: what a lost batch says of its documents: the retry queue, suspects, charged
  attempts. `Isolations`: suspects waiting to run alone and the workers reserved for them.
- `Outcomes`: completed documents, dead letters and task error rows, until the owner takes them.
- `RetryPolicy` (dlbatch.driver.retry_policy): blame. A failed batch's requests go back to the
  front of the queue, on another worker when there is one; the failure is the worker's.
  A document in failures at two different sites is a suspect: it is run alone on a
  drained worker while the other workers keep running normal batches, and only its solo
  failures are charged against `max_attempts`.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable

from connectors.ids import content_id
from dlbatch.driver.retry_policy import RetryPolicy
from dlbatch.records import RequestKey, request_id, result_row

log = logging.getLogger("dlbatch.run")

WorkerKey = tuple  # (role, index)


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


@dataclass
class WorkerState:
    key: WorkerKey
    state: str = "ok"  # ok | unhealthy | dead
    epoch: int = 0  # moves on each time the worker comes back after a failure
    streak: int = 0  # failure sites in a row without a successful batch
    failed_epoch: int = -1
    since: float = 0.0  # unhealthy since
    hold_until: float = 0.0
    probation: bool = False  # one batch at a time until one succeeds
    reserved_for: str | None = None  # a suspect document waiting to run alone here
    load: int = 0  # decode load in flight
    submitted: int = 0
    failures: int = 0


class Workers:
    """Health, load and reservations of every worker, by (role, index): which worker may
    take a batch now, and what a failed or returned batch says about its workers."""

    def __init__(self, counts: dict[str, int], inflight: InflightTable):
        self.by_key = {(role, i): WorkerState((role, i)) for role, n in counts.items() for i in range(n)}
        self.counts = dict(counts)
        self.inflight = inflight

    def __getitem__(self, key) -> WorkerState:
        return self.by_key[key]

    def of(self, role: str) -> list[WorkerState]:
        return [self.by_key[(role, i)] for i in range(self.counts.get(role, 0))]

    def live(self, role: str) -> list[WorkerState]:
        return [w for w in self.of(role) if w.state != "dead"]

    def usable(self, key: WorkerKey, now: float) -> bool:
        w = self.by_key[key]
        return (w.state == "ok" and w.reserved_for is None and now >= w.hold_until
                and not (w.probation and self.inflight.count(key) > 0))

    def pick(self, role: str, now: float, avoid=(), prefer: int | None = None) -> WorkerKey | None:
        """A usable worker of `role`: `prefer` if usable, else one not in `avoid`, least busy."""
        usable = [w.key for w in self.of(role) if self.usable(w.key, now)]
        if not usable:
            return None
        if prefer is not None and (role, prefer) in usable and (role, prefer) not in avoid:
            return (role, prefer)
        load = (lambda k: self.by_key[k].load) if role == "decode" else self.inflight.count
        return min(usable, key=lambda k: (k in avoid, load(k), k[1]))

    def pick_decode(self, now: float, avoid=()) -> tuple[bool, WorkerKey | None]:
        """(whether a batch can go now, its decode worker): (True, None) without a decode pool."""
        if "prefill" not in self.counts:
            return True, None
        d = self.pick("decode", now, avoid)
        return d is not None, d

    def succeeded(self, b: Batch) -> None:
        """A batch returned: its workers' incarnations that ran it are off their streak."""
        for k in b.workers:
            w = self.by_key[k]
            if w.epoch == next(e for r, i, e in b.site if (r, i) == k):
                w.streak, w.probation = 0, False

    def blame(self, b: Batch, now: float) -> None:
        """A batch's call failed: each of its workers (in the incarnation that ran it) is
        unhealthy, and its streak grows once per failure site."""
        for role, i, epoch in b.site:
            w = self.by_key[(role, i)]
            if w.state == "dead" or w.epoch != epoch:
                continue  # a late failure of an earlier incarnation: already counted
            if w.failed_epoch != epoch:
                w.failed_epoch, w.streak = epoch, w.streak + 1
                w.failures += 1
            if w.state == "ok":
                w.state, w.since = "unhealthy", now

    def back(self, key: WorkerKey, now: float, policy: RetryPolicy) -> None:
        """The worker answers again (restarted or not): a new epoch; held back if it keeps failing."""
        w = self.by_key[key]
        if w.state != "unhealthy":
            return
        w.state, w.epoch = "ok", w.epoch + 1
        w.hold_until = now + policy.hold_s(w.streak)
        w.probation = policy.on_probation(w.streak)

    def unhealthy(self) -> list[WorkerState]:
        return [w for w in self.by_key.values() if w.state == "unhealthy"]

    def dead_role(self) -> str | None:
        """A role whose every worker is dead."""
        return next((role for role in self.counts if not self.live(role)), None)


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

    def __init__(self, workers: Workers, front_role: str, pd: bool, policy: RetryPolicy):
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

    def __init__(self, workers: Workers, policy: RetryPolicy, isolation: Isolations, stats: collections.Counter):
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
            if batch and tokens + len(r["prompt_ids"]) > max_batch_tokens:
                batches.append((batch, w))
                batch, tokens = [], 0
            batch.append((r, [by_id[d] for d in fanout.get(req.request_id, [])]))
            tokens += len(r["prompt_ids"])
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
        self.workers = Workers(counts, self.inflight)
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
        load = sum(len(r["prompt_ids"]) + int(r["max_tokens"]) for r in rows)
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
        reqs = [Request(rid, tuple(r["prompt_ids"]), int(r["max_tokens"]), self.request_key(r))
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

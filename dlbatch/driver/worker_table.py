"""The dispatcher's table of its workers (`dlbatch.driver.dispatch`): health, load and
reservations of every worker by (role, index).

A worker is ok, unhealthy (a batch it ran failed; the owner probes it) or dead (Ray will not
restart it). Its epoch moves on each time it comes back after a failure, so a late failure
of an earlier incarnation is not counted twice; its streak counts failure sites in a row, and
the retry policy holds back a worker that keeps failing and puts it on probation (one batch
at a time). `WorkerTable.pick` chooses the worker that takes a batch now; `blame` and
`succeeded` record what a returned or failed batch says about its workers. The actors
themselves are `dlbatch.workers` (`WorkerCalls`); this table only decides.
"""
from __future__ import annotations

from dataclasses import dataclass

from dlbatch.driver.batches import Batch, InflightTable, WorkerKey
from dlbatch.driver.retry_policy import RetryPolicy


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


class WorkerTable:
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

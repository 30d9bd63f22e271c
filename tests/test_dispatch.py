"""The dispatch objects (dlbatch.driver.dispatch) driven without Ray or a model: fake workers that
crash, lose a node, or return engine errors. Counts are exact where the scenario fixes them."""
from __future__ import annotations

import zlib

import pytest

from dlbatch.driver.commit_buffer import CommitBuffer
from dlbatch.driver.dispatch import Dispatcher
from dlbatch.driver.retry_policy import RetryPolicy
from dlbatch.records import request_id
from dlbatch.router import Router, RouterConfig

TASKS = ("summary", "keywords", "question")


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def rows_of(doc: str, n_tokens: int = 20, text_id: int | None = None):
    base = (text_id if text_id is not None else zlib.crc32(doc.encode()) % 1_000_000) * 50 + 10
    out = []
    for j, t in enumerate(TASKS):
        out.append({"doc_id": doc, "task": t, "source": f"{doc}.txt", "prompt_ids": [base + k for k in range(n_tokens)]
                    + [3 + j], "max_tokens": 4, "seed": 0, "truncated": False})
    return out


def make(counts, clock, max_batch_tokens=70, inflight_cap=6, window=12, max_attempts=3, more=None):
    n_front = counts.get("prefill") or counts["colocated"]
    return Dispatcher(counts, Router(n_front, RouterConfig(window=window)), RetryPolicy(max_attempts=max_attempts),
                      max_batch_tokens=max_batch_tokens, inflight_cap=inflight_cap, window=window, clock=clock,
                      more_requests=more)


def ok_results(b):
    return [{"request_id": request_id(r), "output": f"out:{request_id(r)}", "output_tokens": 4,
             "finish_reason": "length"} for r in b.rows]


class Sim:
    """Fake workers. `crashes(b)` says a batch crashes its front worker: every batch in flight
    on that worker fails with it (the process died), and the worker answers a ping again
    `restart_steps` steps later. Each step every in-flight batch ends."""

    def __init__(self, d, clock, crashes=lambda b: False, restart_steps=1, victim=lambda b: b.front):
        self.d, self.clock, self.crashes, self.restart_steps = d, clock, crashes, restart_steps
        self.victim = victim  # the worker a crashing batch kills
        self.inflight = {}
        self.down: dict = {}  # key -> step it answers again
        self.step_no = 0
        self.submitted = []  # (step, batch) in submission order
        self.completed, self.dead = [], []

    def submit(self):
        for b in self.d.next_batches():
            self.inflight[b.id] = b
            self.submitted.append((self.step_no, b))

    def end_all(self):
        crashed = set()
        for b in list(self.inflight.values()):
            if b.id in self.inflight and self.crashes(b):
                crashed.add(self.victim(b))
        for b in list(self.inflight.values()):
            self.inflight.pop(b.id)
            if set(b.workers) & crashed:
                self.d.batch_failed(b.id, f"ActorDiedError: {self.victim(b)} died", "WorkerCrash")
            else:
                self.d.batch_done(b.id, ok_results(b))
        for k in crashed:
            self.down[k] = self.step_no + self.restart_steps

    def probe(self):
        for w in self.d.unhealthy():
            if self.step_no >= self.down.get(w.key, 0):
                self.d.worker_back(w.key)

    def step(self):
        self.step_no += 1
        self.clock.t += 1.0
        self.probe()
        self.submit()
        self.end_all()
        self.completed += self.d.take_completed()
        self.dead += self.d.take_dead_letters()

    def run(self, max_steps=500):
        while not self.d.finished() and self.step_no < max_steps:
            self.step()
        assert self.d.finished(), f"not finished after {max_steps} steps: {len(self.d.docs)} documents open"


def add_docs(d, names):
    for n in names:
        for r in rows_of(n):
            assert d.add_row(r)


# ------------------------------------------------------------------------------ (a)
def test_worker_failing_every_batch_costs_no_document_an_attempt():
    clock = Clock()
    d = make({"colocated": 3}, clock)
    names = [f"d{i:02d}" for i in range(30)]
    add_docs(d, names)
    bad = ("colocated", 0)
    sim = Sim(d, clock, crashes=lambda b: b.front == bad)
    sim.run()
    assert sorted(doc.doc_id for doc in sim.completed) == names
    assert all(doc.attempts == 0 for doc in sim.completed)
    assert sim.dead == [] and d.stats["attempts_charged"] == 0 and d.stats["suspects"] == 0
    on_bad = [b for _, b in sim.submitted if b.front == bad]
    # every document lost on the bad worker was rerun elsewhere, and never sent there again
    lost = {r["doc_id"] for b in on_bad for r in b.rows}
    assert d.stats["requeued"] == len(lost) > 0
    for doc in sim.completed:
        if doc.doc_id in lost:
            assert doc.failed_on == {bad} and len(doc.sites) == 1
    # the bad worker is held back: after its second failure in a row, one batch at a time, with back-off
    w = d.workers[bad]
    assert w.streak == w.failures >= 2 and w.probation
    steps_on_bad = [s for s, b in sim.submitted if b.front == bad]
    second = sorted(set(steps_on_bad))[1]
    later = [s for s in steps_on_bad if s > second]
    assert len(later) == len(set(later))  # probation: at most one batch per step
    assert len(on_bad) < len(sim.submitted) / 3


# ------------------------------------------------------------------------------ (b)
def test_poison_document_dead_lettered_after_solo_attempts_while_others_keep_running():
    clock = Clock()
    d = make({"colocated": 3}, clock)
    names = [f"d{i:02d}" for i in range(40)]
    names.insert(2, "poison")
    add_docs(d, names)
    sim = Sim(d, clock, crashes=lambda b: any(r["doc_id"] == "poison" for r in b.rows))
    sim.run()
    assert [(e["doc_id"], e["stage"], e["error_type"]) for e in sim.dead] == [("poison", "generate", "WorkerCrash")]
    err = sim.dead[0]["error"]
    assert "failed on all 3 attempts" in err and "max_attempts=3" in err and "ActorDiedError" in err
    assert d.stats["attempts_charged"] == 3 and d.stats["solo_batches"] >= 3
    assert sorted(doc.doc_id for doc in sim.completed) == sorted(n for n in names if n != "poison")
    assert all(doc.attempts == 0 for doc in sim.completed)  # healthy documents: never charged
    solo = [b for _, b in sim.submitted if b.solo == "poison"]
    assert len(solo) == 3 and all(len(b.rows) == 3 and {r["doc_id"] for r in b.rows} == {"poison"} for b in solo)
    assert len({b.front for b in solo}) >= 2  # rerun alone on different workers
    # throughput continues: while poison runs alone, the other workers get normal batches
    solo_steps = {s: b.front for s, b in sim.submitted if b.solo == "poison"}
    during = [b for s, b in sim.submitted if b.solo is None and s in solo_steps and b.front != solo_steps[s]]
    assert len(during) >= 2 * len(solo_steps)
    assert not [b for s, b in sim.submitted if s in solo_steps and b.solo is None and b.front == solo_steps[s]]
    # poison became a suspect after failing on two different workers, not after one
    assert d.stats["suspects"] >= 1


# ------------------------------------------------------------------------------ (c)
def test_node_loss_with_many_batches_in_flight_charges_nobody():
    clock = Clock()
    d = make({"colocated": 3}, clock, inflight_cap=12)
    names = [f"d{i:02d}" for i in range(30)]
    add_docs(d, names)
    sim = Sim(d, clock)
    sim.submit()
    on_lost = [b for b in sim.inflight.values() if b.front[1] in (0, 1)]
    assert len(on_lost) >= 6  # many batches in flight on the two workers of the lost node
    lost_docs = {r["doc_id"] for b in on_lost for r in b.all_rows()}
    for b in on_lost:  # the node goes: every batch on workers 0 and 1 fails at once
        sim.inflight.pop(b.id)
        d.batch_failed(b.id, "ActorDiedError: node lost", "WorkerCrash")
    sim.down = {("colocated", 0): 4, ("colocated", 1): 4}
    assert {w.key for w in d.unhealthy()} == {("colocated", 0), ("colocated", 1)}
    sim.end_all()
    sim.completed += d.take_completed()
    sim.run()
    assert sorted(doc.doc_id for doc in sim.completed) == names and sim.dead == []
    assert d.stats["attempts_charged"] == 0 and d.stats["suspects"] == 0
    assert d.stats["requeued"] == len(lost_docs), (d.stats, len(lost_docs), sorted(lost_docs))
    assert all(doc.attempts == 0 for doc in sim.completed)
    # while the node was down, the surviving worker ran the requeued documents
    during = [b for s, b in sim.submitted if 1 <= s < 4]
    assert during and all(b.front == ("colocated", 2) for b in during)
    rerun = {r["doc_id"] for b in during for r in b.rows}
    assert lost_docs & rerun


# ------------------------------------------------------------------------------ (d)
def test_exact_duplicates_fan_out_and_fail_together():
    clock = Clock()
    d = make({"colocated": 2}, clock, max_batch_tokens=1000)
    for r in rows_of("a", text_id=7) + rows_of("b", text_id=7) + rows_of("c", text_id=9):
        d.add_row(r)
    first = d.next_batches()
    sent = [request_id(r) for b in first for r in b.rows]
    assert len(sent) == 6 and d.router.stats.duplicates_folded == 3  # b's 3 requests ride on a's
    riders = [r["doc_id"] for b in first for lst in b.riders.values() for r in lst]
    assert sorted(riders) == ["b", "b", "b"]
    # the batch carrying a (and b riding on it) is lost: both documents go back, once each
    b_ab = next(b for b in first if b.riders)
    d.batch_failed(b_ab.id, "ActorDiedError", "WorkerCrash")
    assert d.stats["requeued"] == 2 and set(d.retry) == {"a", "b"}
    for b in first:
        if b is not b_ab:
            d.batch_done(b.id, ok_results(b))
    d.worker_back(b_ab.front)
    again = d.next_batches()
    assert sorted(r["doc_id"] for b in again for r in b.rows) == ["a"] * 3 + ["b"] * 3
    assert all(b.front != b_ab.front for b in again)  # rerun on the worker they did not fail on
    for b in again:
        d.batch_done(b.id, ok_results(b))
    done = {doc.doc_id: doc for doc in d.take_completed()}
    assert set(done) == {"a", "b", "c"} and d.finished()
    assert done["b"].results["summary"]["output"] == "out:b::summary"  # the retry ran it on its own
    # without a failure, the duplicate takes the result of the request it rides on
    d2 = make({"colocated": 2}, clock, max_batch_tokens=1000)
    for r in rows_of("a", text_id=7) + rows_of("b", text_id=7):
        d2.add_row(r)
    for b in d2.next_batches():
        d2.batch_done(b.id, ok_results(b))
    done = {doc.doc_id: doc for doc in d2.take_completed()}
    assert done["b"].results["summary"]["output"] == "out:a::summary" and d2.finished()


def test_pd_pairs_a_decode_worker_by_load_and_avoids_the_failed_one():
    clock = Clock()
    d = make({"prefill": 2, "decode": 2}, clock, max_batch_tokens=70)
    add_docs(d, [f"d{i}" for i in range(6)])
    first = d.next_batches()
    assert len(first) == 6 and all(b.decode is not None for b in first)
    per_dec = [sum(b.load for b in first if b.decode == ("decode", i)) for i in range(2)]
    assert per_dec[0] == per_dec[1] == 3 * first[0].load  # equal batches spread by load
    assert d.workers[("decode", 0)].load == per_dec[0]
    lost = [b for b in first if b.decode == ("decode", 0)]
    for b in first:
        if b in lost:
            d.batch_failed(b.id, "ActorDiedError: decode worker died", "WorkerCrash")
        else:
            d.batch_done(b.id, ok_results(b))
    assert d.workers[("decode", 0)].load == 0 and d.workers[("decode", 0)].state == "unhealthy"
    again = d.next_batches()  # decode 0 not back yet: everything goes to decode 1
    assert len(again) == 3 and all(b.decode == ("decode", 1) for b in again)
    for b in again:
        d.batch_done(b.id, ok_results(b))
    assert len(d.take_completed()) == 6 and d.finished() and d.stats["attempts_charged"] == 0


# ------------------------------------------------------------------------------ more
def test_engine_errors_requeue_only_failed_requests_then_dead_letter_a_repeat_offender():
    clock = Clock()
    d = make({"colocated": 2}, clock, max_batch_tokens=1000, max_attempts=2)
    add_docs(d, ["good", "bad"])
    runs = 0
    while not d.finished() and runs < 20:
        runs += 1
        for b in d.next_batches():
            res = [{"request_id": request_id(r), "error": "ValueError: bad token"} if r["doc_id"] == "bad"
                   and r["task"] == "question" else x for r, x in zip(b.rows, ok_results(b))]
            d.batch_done(b.id, res)
    done, dead = d.take_completed(), d.take_dead_letters()
    assert [x.doc_id for x in done] == ["good"]
    assert [(e["doc_id"], e["error_type"]) for e in dead] == [("bad", "EngineError")]
    assert "failed on all 2 attempts" in dead[0]["error"] and "bad token" in dead[0]["error"]
    # two errors in normal batches made it a suspect, then two solo runs of its one failing request
    assert d.stats["requeued"] == 2 and d.stats["attempts_charged"] == 2
    assert all(w.state == "ok" and w.streak == 0 for w in d.workers.by_key.values())  # workers were not blamed


def test_more_requests_hook_adds_a_followup_before_the_document_completes():
    """The shape issue 16's map -> reduce uses: a request created from the document's outputs."""
    clock = Clock()

    def reduce_after_map(doc):
        if "reduce" in doc.rows:
            return []
        joined = [x for t in TASKS for x in doc.results[t]["output"].encode()]
        return [{**doc.rows["summary"], "task": "reduce", "prompt_ids": joined}]

    d = make({"colocated": 2}, clock, max_batch_tokens=1000, more=reduce_after_map)
    add_docs(d, ["x", "y"])
    rounds = []
    while not d.finished():
        bs = d.next_batches()
        rounds.append(sorted(r["task"] for b in bs for r in b.rows))
        for b in bs:
            d.batch_done(b.id, ok_results(b))
    assert rounds[1] == ["reduce", "reduce"] and len(rounds) == 2
    done = d.take_completed()
    assert sorted(x.doc_id for x in done) == ["x", "y"] and all(set(x.results) == {*TASKS, "reduce"} for x in done)
    assert len(done[0].output_rows("m")) == 4


def test_dead_pool_is_reported_and_input_duplicates_and_errors_handled():
    clock = Clock()
    d = make({"colocated": 2}, clock)
    add_docs(d, ["a"])
    assert not d.add_row(rows_of("a")[0])  # the same (document, task) twice in the input
    assert d.add_row({"doc_id": "broken", "source": "b.pdf", "error": "not a PDF", "error_type": "ParseError",
                      "stage": "parse"})
    assert [e["error_type"] for e in d.take_dead_letters()] == ["ParseError"]
    assert not d.add_row({**rows_of("broken")[0]})  # a dead-lettered document is not reopened
    assert d.dead_role() is None
    d.worker_dead(("colocated", 0))
    d.worker_dead(("colocated", 1))
    assert d.dead_role() == "colocated"


def test_commit_buffer_due_by_count_or_time():
    clock = Clock()
    buf = CommitBuffer(flush_docs=2, flush_seconds=5.0, clock=clock)
    buf.add_document([{"doc_id": "a"}])
    assert not buf.due()
    buf.add_document([{"doc_id": "b"}, {"doc_id": "b"}])
    assert buf.due()
    rows, errs = buf.take()
    assert len(rows) == 3 and errs == [] and not buf.due()
    clock.t = 5.0
    assert buf.due()


def test_retry_policy_validates_and_backs_off():
    p = RetryPolicy(max_attempts=3)
    assert [p.hold_s(s) for s in range(5)] == [0.0, 0.0, 1.0, 2.0, 4.0]
    assert not p.is_suspect(1) and p.is_suspect(2) and p.dead(3) and not p.dead(2)
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


def test_hung_input_source_fails_naming_what_it_waited_for(tmp_path):
    """The driver idles on an input pipeline that yields nothing: bounded by input_timeout_s."""
    import time

    from dlbatch.driver.config import RunConfig
    from dlbatch.driver.loop import DispatchLoop
    from dlbatch.output.parquet_store import ParquetStore
    from dlbatch.workers.pools import JobFailed, WorkerPools
    from dlbatch.jobspec import load_job
    from dlbatch.report.metrics import JobMetrics
    from dlbatch.report.progress import Progress
    from dlbatch.report.run import RunReport, Tally

    class HungStream:  # a BatchPrefetcher whose Ray Data stream never produces a batch
        def get(self, timeout=0.0):
            time.sleep(timeout)
            return None

    out = str(tmp_path / "out")
    spec = load_job("jobs/papers_jsonl.yaml", [f"output.path={out}"])
    pools = WorkerPools(RunConfig.resolve(spec))  # not started: one colocated worker that is never called
    pools.workers = {"colocated": [None]}
    t0 = time.time()
    tally = Tally(metrics=JobMetrics(spec.name), progress=Progress(spec.name, tty=False))
    loop = DispatchLoop(spec, ParquetStore(out), pools, HungStream(), RunReport(spec, None, t0), tally,
                        input_timeout_s=1.0)
    with pytest.raises(JobFailed, match=r"no document came from the input pipeline \(list/parse/tokenize") as e:
        loop.run()
    assert "input_timeout 1 s" in str(e.value) and "Ray Data stages may be waiting for CPUs" in str(e.value)
    assert "intact" in str(e.value) and time.time() - t0 < 10


def test_single_worker_pool_poison_costs_one_crash_before_its_charged_attempts():
    """One worker: no second worker can tell poison from a worker fault, so the documents of
    the first lost batch run alone at once; poison crashes the worker 1 + max_attempts times
    (within Ray's max_restarts=4), the others complete uncharged."""
    clock = Clock()
    d = make({"prefill": 1, "decode": 1}, clock, max_batch_tokens=1000)
    names = ["a", "poison", "b", "c"]
    add_docs(d, names)
    sim = Sim(d, clock, crashes=lambda b: any(r["doc_id"] == "poison" for r in b.rows))
    sim.run()
    assert [e["doc_id"] for e in sim.dead] == ["poison"] and "failed on all 3 attempts" in sim.dead[0]["error"]
    assert sorted(x.doc_id for x in sim.completed) == ["a", "b", "c"] and all(x.attempts == 0 for x in sim.completed)
    assert d.workers[("prefill", 0)].failures == 4 and d.stats["attempts_charged"] == 3
    solo = [b for _, b in sim.submitted if b.solo]
    assert all(b.decode == ("decode", 0) for b in solo) and len([b for b in solo if b.solo == "poison"]) == 3


def test_poison_that_kills_the_only_decode_worker_is_isolated_at_once():
    """Two prefill workers, one decode worker: a retry cannot reach another decode worker,
    so one lost batch makes its documents suspects, and the poison is dead-lettered after
    1 + max_attempts crashes of the decode worker (within Ray's max_restarts=4)."""
    clock = Clock()
    d = make({"prefill": 2, "decode": 1}, clock, max_batch_tokens=1000)
    add_docs(d, ["a", "poison", "b", "c"])
    sim = Sim(d, clock, crashes=lambda b: any(r["doc_id"] == "poison" for r in b.rows), victim=lambda b: b.decode)
    sim.run()
    assert [e["doc_id"] for e in sim.dead] == ["poison"]
    assert sorted(x.doc_id for x in sim.completed) == ["a", "b", "c"]
    assert d.workers[("decode", 0)].failures == 4 and d.stats["attempts_charged"] == 3

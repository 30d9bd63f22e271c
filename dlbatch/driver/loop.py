"""The driver loop: schedule -> submit -> wait -> results / failures -> commit, until every
document is committed or dead-lettered.

`DispatchLoop` owns one run's moving parts and nothing else: the `Dispatcher` (which
request runs where, what a failure means: `dlbatch.driver.dispatch`), the actor calls
(`WorkerCalls`), the input feed, the commit buffer and the tally. Decisions live in those
plain objects; the loop only moves rows between them and keeps every wait bounded
(`_watchdog`), and stops a run whose documents mostly fail (`DeadLetterShare`). Invariants:
a document is committed whole, in one part, or not at all; on any failure every document
already complete is committed before the error propagates.
"""
from __future__ import annotations

import logging
import time

from dlbatch.workers.pools import MAX_RESTARTS, JobFailed
from dlbatch.prompts import multimodal, sampling, structured
from dlbatch.records import base_task, prompt_length, request_id, request_inputs

log = logging.getLogger("dlbatch.run")


class DispatchLoop:
    def __init__(self, spec, store, pools, batches, report, tally, *, docs_total_hint: int | None = None,
                 flush_docs: int = 16, flush_seconds: float = 5.0, stall_timeout_s: float = 1800.0,
                 input_timeout_s: float = 600.0, postprocess=None, postprocess_fields=()):
        from dlbatch.driver.commit_buffer import CommitBuffer
        from dlbatch.driver.dead_letter_share import DeadLetterShare
        from dlbatch.driver.feed import InputFeed
        from dlbatch.workers.calls import WorkerCalls
        from dlbatch.prompts.map_reduce import MapReduce

        self.spec, self.store, self.pools, self.report, self.tally = spec, store, pools, report, tally
        self.docs_total_hint = docs_total_hint  # documents of the input when known (files), for the ETA
        self.stall_timeout_s = stall_timeout_s  # no batch returned for this long while some are in flight
        self.input_timeout_s = input_timeout_s  # no input for this long while every worker was idle
        self.constraints = structured.task_constraints(spec)  # task -> engine constraint (its `output:`)
        self.result_fields = (structured.result_fields(spec) + sampling.result_fields(spec)  # typed extra columns
                              + list(postprocess_fields) + multimodal.result_fields(spec))
        self.postprocess = postprocess  # the pipeline's hook on each result row (pipelines/__init__.py), or None
        self.map_reduce = self._make_map_reduce()
        self.d = self._dispatcher(pools.workers)
        self.calls = WorkerCalls(pools, self.d, self._items_for)
        self.feed = InputFeed(batches, prepare=MapReduce.request_row, order=self._order())
        self.buf = CommitBuffer(flush_docs, flush_seconds)
        self.share = DeadLetterShare(spec.max_dead_letter_fraction)  # stops a run whose documents mostly fail
        self._last_check = 0.0
        self._missing_since: float | None = None

    @property
    def inflight(self) -> int:
        """Batches in flight now."""
        return len(self.calls.refs)

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        d, calls, feed = self.d, self.calls, self.feed
        try:
            while True:
                self._watchdog()
                feed.pull(d, room=lambda: len(calls.refs) < d.inflight_cap and d.queued < 2 * self.spec.router.window,
                          idle=not calls.refs and not d.docs)
                calls.probe()
                calls.reform_rdt_group()
                role = d.dead_role()
                if role is not None:
                    raise JobFailed(self._all_dead_message(role))
                for b in d.next_batches():
                    calls.submit(b)
                if feed.exhausted and d.finished():
                    break
                if not calls.refs:
                    time.sleep(0.05)  # input, a worker coming back, a held-back worker, a regroup
                for b, outcome in calls.wait(0.5):
                    if not isinstance(outcome, BaseException):  # when the tokens were made
                        self.report.note_results(outcome, time.time())
                    calls.handle(b, outcome)
                self._collect()
                self._commit()
                self.share.check()
                self.tally.show(len(calls.refs), self._remaining_tokens())
        except BaseException:
            try:  # commit every document that is complete before giving up; never a partial one
                self._collect()
                self._commit(force=True)
            except Exception as e:  # the original error is the one to report
                log.error("could not commit finished documents while failing: %s", e)
            raise
        self._collect()
        self._commit(force=True)
        self.tally.progress.close()
        self.share.check(final=True)

    def _collect(self) -> None:
        """Complete documents and dead letters from the dispatcher into the commit buffer."""
        spec, d = self.spec, self.d
        extra = lambda task, res: {**structured.row_fields(spec, task, res), **sampling.row_fields(res)}  # noqa: E731
        for doc in d.take_completed():
            rows = (self.map_reduce.output_rows(doc, spec.model.name, extra) if self.map_reduce
                    else doc.output_rows(spec.model.name, extra))
            if spec.output.samples == "rows":
                rows = sampling.sample_rows(rows, lambda task, s: structured.row_fields(spec, task, s))
            rows, dead = self._postprocess(rows)
            if dead:  # the hook failed on this document: its dead letter, the job goes on
                self.buf.add_errors(dead)
                self.tally.docs_failed(dead)
                continue
            self.buf.add_document(rows)
            self.tally.doc_ok(rows)
            self.share.note(ok=1)
        task_errors = d.take_task_errors()  # (document, task)s that failed alone: the document goes on
        if task_errors:
            self.buf.add_errors(task_errors)
        dead = d.take_dead_letters()
        if dead:
            self.buf.add_errors(dead)
            self.tally.docs_failed(dead)
            self.share.note(dead=dead)

    def _postprocess(self, rows: list[dict]) -> tuple[list[dict], list[dict]]:
        """(rows after the pipeline's postprocess hook, []), or ([], the document's dead letter)
        when the hook raises or returns no mapping for one of its rows."""
        if self.postprocess is None or not rows:
            return rows, []
        try:
            out = [self.postprocess(dict(r)) for r in rows]
            bad = next((type(o).__name__ for o in out if not isinstance(o, dict)), None)
            if bad is not None:
                raise TypeError(f"postprocess returned {bad}, not the row (a dict)")
            return out, []
        except Exception as e:  # noqa: BLE001 - a hook's failure is its document's, not the job's
            r = rows[0]
            return [], [{"doc_id": r["doc_id"], "source": r["source"], "task": None, "stage": "postprocess",
                         "error_type": type(e).__name__, "error": f"postprocess failed: {e}"[:500]}]

    def _commit(self, force: bool = False) -> None:
        if not self.buf.due(force):
            return
        rows, errors = self.buf.take()
        if rows or errors:  # one commit: a document's result rows and dead letters land together
            self.store.commit(rows, errors, self.spec.output.include_text, self.result_fields)
            self.tally.rows_written += len(rows)
        self.report.note_commit(self.tally)

    # ---- bounded waits -----------------------------------------------------------------------------
    def _watchdog(self) -> None:
        """Every wait of the loop is bounded, and says what it waited for when it fires."""
        now = time.time()
        if now - self._last_check < 2.0:
            return
        self._last_check = now
        pools, d = self.pools, self.d
        missing = pools.missing_resources()
        self._missing_since = (self._missing_since or now) if missing else None
        if missing:
            log.warning("waiting for a node that provides %s (%.0f s of %.0f s)", ", ".join(missing),
                        now - self._missing_since, pools.resource_timeout_s)
            if now - self._missing_since > pools.resource_timeout_s:
                raise JobFailed(pools.no_resource_message(missing))
        for w in d.unhealthy():
            if d.clock() - w.since > self.stall_timeout_s:
                raise JobFailed(f"{w.key[0]} worker {w.key[1]} has not answered a ping for {d.clock() - w.since:.0f} "
                                f"s after a failed batch (stall_timeout {self.stall_timeout_s:.0f} s); committed "
                                f"output is intact: rerun to resume")
        calls = self.calls
        calls.expire(self.spec.batching.batch_timeout_s)  # one hung batch among healthy ones
        if calls.refs and now - calls.last_progress > self.stall_timeout_s:
            on = sorted({f"{k[0]} {k[1]}" for b in calls.refs.values() for k in b.workers})
            raise JobFailed(f"no batch finished or failed for {now - calls.last_progress:.0f} s with "
                            f"{len(calls.refs)} in flight on workers {', '.join(on)} (stall_timeout "
                            f"{self.stall_timeout_s:.0f} s); committed output is intact: rerun to resume")
        if self.feed.idle_for(now) > self.input_timeout_s:
            raise JobFailed(self._no_input_message(self.feed.idle_for(now)))

    def _no_input_message(self, waited: float) -> str:
        try:
            import ray

            cpus = f"{ray.available_resources().get('CPU', 0):g} of {ray.cluster_resources().get('CPU', 0):g} CPUs free"
        except Exception:  # the message must not fail
            cpus = "CPUs unknown"
        return (f"no document came from the input pipeline (list/parse/tokenize stages over {self.spec.input.path}) "
                f"for {waited:.0f} s while every worker was idle (input_timeout {self.input_timeout_s:.0f} s); Ray "
                f"Data stages may be waiting for CPUs the worker pools hold ({cpus}), or the source hangs. "
                f"Committed output is intact: rerun to resume (raise --input-timeout for a slow source)")

    def _all_dead_message(self, role: str) -> str:
        return (f"every {role} worker is dead and Ray will not restart it again (max_restarts={MAX_RESTARTS} used "
                f"up, e.g. by a document that kills its worker more often than that, or by lost nodes); "
                f"{self.tally.new_ok} documents were committed in this run and committed output is intact: rerun "
                f"to resume")

    # ---- what the loop hands the dispatcher --------------------------------------------------------
    def _dispatcher(self, workers: dict):
        from dlbatch.driver.dispatch import Dispatcher
        from dlbatch.driver.retry_policy import RetryPolicy
        from dlbatch.router import Router, RouterConfig
        from dlbatch.router.grouping import make_sampling_key

        spec = self.spec
        n_front = len(workers.get("prefill") or workers["colocated"])
        folds = structured.fold_keys(spec)  # a constrained task is never folded onto another task's request

        def key(r):  # requests fold only when they would sample alike: same sampling, constraint, stop, extras
            smp = sampling.request_sampling(spec, r)
            task = base_task(r["task"])
            extra = {"constraint": folds[task]} if task in folds else {}
            extra.update({k: tuple(v) if isinstance(v, list) else v for k, v in smp.items()
                          if k not in ("temperature", "top_p", "top_k", "seed") and not isinstance(v, dict)})
            if r.get("sampling"):  # a row's own sampling (an OpenAI batch line) never folds onto another's
                extra["row"] = request_id(r)
            if r.get("adapter"):  # another adapter is another model: never folded onto the base's request
                extra["adapter"] = r["adapter"]
            if smp["temperature"] == 0 and not extra:
                return None
            return make_sampling_key(request_id(r), smp["temperature"], smp["top_p"], smp["top_k"],
                                     int(r["seed"]), **extra)

        return Dispatcher({role: len(ws) for role, ws in workers.items()},
                          Router(n_front, RouterConfig(policy=spec.router.policy, window=spec.router.window)),
                          RetryPolicy(max_attempts=spec.retries.max_attempts),
                          max_batch_tokens=spec.batching.max_batch_tokens, window=spec.router.window,
                          inflight_cap=spec.batching.max_inflight_batches * max(len(ws) for ws in workers.values()),
                          request_key=key, is_fatal=lambda err: str(err or "").startswith("ConstraintError"),
                          more_requests=self.map_reduce.more_requests if self.map_reduce else None)

    def _order(self):
        """Documents in prefix order across what the feed holds (``router.order: prefix``), or
        in input order (``input``): `dlbatch.router.order`."""
        if self.spec.router.order != "prefix":
            return None
        from dlbatch.router import RouterConfig
        from dlbatch.router.order import PrefixOrder

        return PrefixOrder(block_size=RouterConfig().block_size)

    def _items_for(self, rows: list[dict]) -> list[dict]:
        """Request rows -> the items a worker takes. The map and reduce requests of a chunked
        task ("<task>#<key>") write free-text notes: a constrained task's constraint applies
        to its final row's parse, not to its notes."""
        items = []
        for r in rows:  # the job's sampling, the task's own over it, the row's own over that
            smp = sampling.request_sampling(self.spec, r)
            constraint = smp.pop("constraint", None) or self.constraints.get(base_task(r["task"]))
            items.append({"request_id": request_id(r), "token_ids": list(r["prompt_ids"]),
                          "max_tokens": int(r["max_tokens"]), **smp,
                          **({"constraint": constraint} if constraint is not None else {}),
                          **request_inputs(r)})
        return items

    def _make_map_reduce(self):
        """The map -> reduce driver of `long_inputs: chunk` (dlbatch.prompts.map_reduce), when a task uses it."""
        spec = self.spec
        if "chunk" not in {spec.long_inputs, *(t.long_inputs for t in spec.tasks)}:
            return None
        from dlbatch.engine.loader import load_tokenizer
        from dlbatch.prompts.map_reduce import MapReduce

        return MapReduce(spec, load_tokenizer(spec.model.ref))

    # ---- figures for the progress line and the report ----------------------------------------------
    def _remaining_tokens(self) -> int | None:
        """Tokens left: open requests exactly, documents not tokenized yet at the mean so far."""
        from dlbatch.report.progress import remaining_tokens

        feed, open_docs = self.feed, list(self.d.docs.values())
        open_rows = [(prompt_length(r), int(r["max_tokens"])) for d in open_docs for t, r in d.rows.items()
                     if t not in d.results and r.get("prompt_ids") is not None]
        if not feed.docs_seen:
            return None
        if self.docs_total_hint is None:  # a table input: only what is tokenized is known
            return sum(p + m for p, m in open_rows)
        unseen = self.docs_total_hint - self.tally.already - self.tally.finished - len(open_docs)
        return remaining_tokens(open_rows, unseen, feed.tokens_seen / feed.docs_seen)

    def long_inputs_report(self) -> dict:
        """This run's documents by long-input policy, and the token lengths of the chunks of
        the documents that were map-reduced."""
        sizes = self.map_reduce.chunk_tokens if self.map_reduce else []
        return {"documents": {k: v for k, v in self.tally.policies.items() if v},
                "chunk_tokens": {"chunks": len(sizes), "min": min(sizes, default=0), "max": max(sizes, default=0),
                                 "mean": round(sum(sizes) / len(sizes), 1) if sizes else 0}}

    def dispatch_stats(self) -> dict:
        s = self.d.stats
        return {k: s[k] for k in ("batches", "requeued", "suspects", "solo_batches", "attempts_charged")}

    def worker_retries(self) -> int:
        return self.d.stats["requeued"] + self.d.stats["attempts_charged"]

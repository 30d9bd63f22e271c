"""`dlbatch run`: one job from the job file to committed output.

`JobRunner` composes the run: it resolves the run's configuration once (`RunConfig`: the
backend, the context length, the pools and their workers' specs; the same values reach the
prompt stage and every worker), reads what the output already holds (the manifest, the
committed documents), lists the inputs, and when there is work it starts the compute plane
(`WorkerPools`: Ray, worker actors, KV transport), the data plane (the job's Ray Data
pipeline, prefetched by `BatchPrefetcher`), and runs the `DispatchLoop` until every
document is committed or dead-lettered; `RunReport` writes the report at the end.

Invariants: a rerun with other output-determining settings is refused (the manifest's
fingerprint); documents already committed are never redone unless their one-document
input file (pdf, text) changed content (connectors.versions: then its old rows are
superseded first); a job whose inputs are unchanged since it completed is a no-op.
``output.format: openai_batch``: results.jsonl / errors.jsonl are written from the committed
rows (`openai_export.export`) at the end of every run that completes, before the manifest
says complete; a no-op rerun writes them only when they are missing.
"""
from __future__ import annotations

import logging
import sys
import time

from dlbatch.output import openai_export
from dlbatch.driver.early_start import starts_early
from dlbatch.output.compaction import COMPACT_MIN_PARTS
from dlbatch.report.timeline import StartupClock
from dlbatch.workers.pools import MAX_RESTARTS, JobFailed, WorkerPools
from dlbatch.transfer.errors import brief

__all__ = ["JobFailed", "JobRunner", "MAX_RESTARTS"]

log = logging.getLogger("dlbatch.run")


class JobRunner:
    def __init__(self, spec, fresh: bool = False, plan: dict | None = None, progress: bool | None = None,
                 flush_docs: int = 16, flush_seconds: float = 5.0, resource_timeout_s: float = 120.0,
                 stall_timeout_s: float = 1800.0, input_timeout_s: float = 600.0,
                 compact_min_parts: int | None = COMPACT_MIN_PARTS, dataset=None):
        from pipelines import get_pipeline

        self.spec = spec
        self.fresh = fresh
        self.plan = plan
        try:
            self.pipeline = get_pipeline(spec.pipeline)  # its build, and its Python hooks when it has them
        except ValueError as e:  # as `check_job` words it
            from dlbatch.driver.checks import JobInvalid

            raise JobInvalid(f"pipeline: {e}") from None
        self.dataset = dataset  # a ray.data.Dataset as the input (input.format dataset), else None: the files
        if (dataset is None) != (spec.input.format != "dataset"):
            raise ValueError("input.format 'dataset' reads the ray.data.Dataset given to dlbatch.run(job, dataset=...)"
                             if dataset is None else f"a dataset was given, but the job's input.format is "
                             f"{spec.input.format!r}; set input.format: dataset")
        self.compact_min_parts = compact_min_parts  # merge small parts at job end when more exist; None/-1: never
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.flush_docs, self.flush_seconds = flush_docs, flush_seconds
        self.resource_timeout_s = resource_timeout_s  # a chip resource the pools need may be absent this long
        self.stall_timeout_s = stall_timeout_s  # no batch returned (result or error) while batches are in flight
        self.input_timeout_s = input_timeout_s  # no document from the input pipeline while every worker was idle
        self.pools: WorkerPools | None = None  # while the run holds workers
        self.loop = None  # the DispatchLoop while it runs

    @property
    def inflight(self) -> int:
        """Batches in flight now (0 before the loop starts)."""
        return self.loop.inflight if self.loop is not None else 0

    @property
    def workers(self) -> dict:
        """role -> worker actor handles of the running pools."""
        return self.pools.workers if self.pools is not None else {}

    # ------------------------------------------------------------------------------------
    def run(self) -> dict:
        from connectors.io_retry import retry_count
        from dlbatch.driver.checks import check_job
        from dlbatch.output import open_store

        spec = self.spec
        t_start = time.time()
        io_retries_start = retry_count()
        self._startup = StartupClock(t_start)
        try:
            # before anything is written, what `dlbatch validate` checks (JobInvalid: exit 2): the backend,
            # context, layout, inputs, fields, output and resume; a remote input's workers start first
            checked = check_job(spec, self.plan, fresh=self.fresh, on_config=self._start_early)
            self._t_checked = time.time()
            store = open_store(spec.output)  # Parquet parts or a Delta table: the format that wrote the output
            store.files.take_lease(spec.name, "run --fresh" if self.fresh else "run")  # one writer per output
            try:
                return self._run_leased(store, checked, t_start, io_retries_start)
            finally:
                store.files.release_lease()
        finally:
            if self.pools is not None:  # started early; the run ended before it used them
                self.pools.stop()
                self.pools = None

    def _start_early(self, config) -> None:
        """Workers loading while the inputs are listed, where that is network I/O (`early_start`)."""
        if self.dataset is None and config.layout is not None and starts_early(self.spec, self.fresh):
            self.pools = WorkerPools(config, self.resource_timeout_s)
            self.pools.start(self._startup)

    def _run_leased(self, store, checked, t_start: float, io_retries_start: int) -> dict:
        from connectors.io_retry import retry_count
        import pyarrow as pa

        from dlbatch.driver.dead_letter_share import RETRIED_ON_RESUME, TooManyDeadLetters
        from dlbatch.prompts.skip import SkipSet
        from dlbatch.jobspec import content_fields, fingerprint_fields, job_fingerprint
        from dlbatch.report.run import RunReport

        spec, config, files = self.spec, checked.config, checked.files
        content = content_fields(spec)
        store, manifest = self._writer(store, content)
        if self.dataset is not None:
            return self._run_dataset(store, config, content, t_start, io_retries_start)
        report = RunReport(spec, self.plan, t_start, startup=self._startup)
        report.startup.span("checks", t_start, self._t_checked)  # the configuration, inputs listed, fields read
        listed = set(files)
        from dlbatch.driver.edits import supersede_changed

        files, sig, by_file = supersede_changed(store, spec, files, report, getattr(self.pipeline, "preprocess", None))
        task_names = {t.name for t in spec.tasks}
        if manifest and not (manifest.get("complete") and manifest.get("inputs") == sig):  # a resume
            n = store.retry_dead_letters(set(RETRIED_ON_RESUME))
            if n:
                log.warning("resuming: %d documents dead-lettered with %s are read again", n,
                            "/".join(sorted(RETRIED_ON_RESUME)))
        prog = store.progress(tasks=task_names)  # from the parts' index files, not their text
        report.inputs_deleted = sorted(prog["sources"] - listed)
        if report.inputs_deleted:
            log.warning("%d inputs with committed rows are gone from %s (their rows stay; --fresh starts over): %s",
                        len(report.inputs_deleted), spec.input.path, ", ".join(report.inputs_deleted[:5]))
        if manifest and manifest.get("complete") and manifest.get("inputs") == sig:
            if openai_export.wanted(spec) and openai_export.missing(store):
                openai_export.export(spec, store)  # the files of a completed job, when they are missing
            print(f"job {spec.name!r} is already complete in {spec.output.path}: {prog['n_done']} documents done, "
                  f"{prog['n_failed']} failed; nothing to do (use --fresh to start over)", file=sys.stderr)
            return {"noop": True, "docs_ok": prog["n_done"], "docs_failed": prog["n_failed"],
                    "rows_written": prog["rows"]}
        store.files.write_json("_manifest.json", {"name": spec.name, "fingerprint": job_fingerprint(spec, content),
                                                  "fields": {**fingerprint_fields(spec), **content}, "inputs": sig,
                                                  "limit": spec.input.limit, "complete": False,
                                                  "started": t_start})
        todo = [f for f in files if f not in prog["sources_done"]] if by_file else files
        report.already_done, report.already_failed = prog["n_done"], prog["n_failed"]
        if manifest and not manifest.get("complete") and prog["n_done"]:
            _warn_if_not_reproducible(config, prog["n_done"])
        if not todo:
            report = report.finish(store, compaction=self._compact_output(store), orphans=self._orphans(store))
            if openai_export.wanted(spec):
                openai_export.export(spec, store)
            store.files.write_json("_manifest.json", {**store.files.read_json("_manifest.json"), "complete": True})
            print(f"job {spec.name!r}: every input is already processed; nothing to do", file=sys.stderr)
            return report
        skip = SkipSet(pa.concat_arrays([prog["done_ids"], prog["failed_ids"]]))  # 8 bytes per document
        try:
            out = self._run_pools(store, config, todo, skip, report,
                                  docs_total_hint=len(files) if by_file else None)
        except TooManyDeadLetters as e:  # not complete; the next run knows why (checks.restart_reason)
            store.files.write_json("_manifest.json", {**(store.files.read_json("_manifest.json") or {}),
                                                      "halted": e.brief})
            raise
        out = out.finish(store, retries={"worker": out.retries, "io": retry_count() - io_retries_start})
        if openai_export.wanted(spec):  # from the committed rows, before the job is marked complete
            openai_export.export(spec, store)
        store.files.write_json("_manifest.json", {**(store.files.read_json("_manifest.json") or {}), "complete": True,
                                                  "inputs": sig})
        return out

    def _run_dataset(self, store, config, content: dict, t_start: float, io_retries_start: int) -> dict:
        """A ray.data.Dataset as the input: its columns checked, every committed or
        dead-lettered id skipped (exactly once and resume key on the ids, as for files). A
        dataset has no version to compare, so a rerun reads it again and finds nothing to do."""
        import pyarrow as pa

        from connectors.io_retry import retry_count
        from dlbatch.jobspec import fingerprint_fields, job_fingerprint
        from dlbatch.prompts.columns import missing_columns
        from dlbatch.prompts.skip import SkipSet
        from dlbatch.report.run import RunReport

        spec = self.spec
        problems = missing_columns(spec, set(self.dataset.schema().names))
        if problems:
            raise ValueError("the dataset: " + "; ".join(problems))
        prog = store.progress(tasks={t.name for t in spec.tasks})
        store.files.write_json("_manifest.json", {"name": spec.name, "fingerprint": job_fingerprint(spec, content),
                                                  "fields": {**fingerprint_fields(spec), **content}, "inputs": None,
                                                  "limit": spec.input.limit, "complete": False, "started": t_start})
        report = RunReport(spec, self.plan, t_start, already_done=prog["n_done"], already_failed=prog["n_failed"],
                           startup=self._startup)
        skip = SkipSet(pa.concat_arrays([prog["done_ids"], prog["failed_ids"]]))
        out = self._run_pools(store, config, [], skip, report, docs_total_hint=None)
        out = out.finish(store, retries={"worker": out.retries, "io": retry_count() - io_retries_start})
        store.files.write_json("_manifest.json", {**(store.files.read_json("_manifest.json") or {}), "complete": True})
        return out

    def _writer(self, store, content: dict):
        """-> (the store this run commits with, the output's manifest). The store is
        `run_store`'s: the job's format; a job asking another format than the one that wrote
        the output is refused. --fresh: ``store``, the format that wrote the output, deletes
        its files first; otherwise what a crashed (or taken-over) holder left half done is
        finished before progress is read. The manifest is checked against this job: a resume
        must have the same output-determining settings, unless its last run stopped on its
        dead-letter share without a result row (`restart_reason`): then it starts over."""
        from dlbatch.driver.checks import restart_reason
        from dlbatch.jobspec import check_resume_compatible
        from dlbatch.output import run_store

        spec = self.spec
        restart = None if self.fresh else restart_reason(store, store.files.read_json("_manifest.json"))
        if restart:
            log.warning("%s: %s", spec.output.path, restart)
        if self.fresh or restart:
            n = store.clear()
            log.info("%s: removed %d files of a previous run under %s", "--fresh" if self.fresh else "start over", n,
                     spec.output.path)
            if openai_export.wanted(spec):
                openai_export.clear(store)
        store = run_store(store, spec.output, cleared=bool(self.fresh or restart))
        if not self.fresh:
            rec = store.recover()  # what a crashed (or taken-over) holder left half done
            if store.files.lease.taken_over or any(rec.values()):
                log.warning("resuming after an interrupted run: %s", rec)
        manifest = store.files.read_json("_manifest.json")
        if manifest is not None:
            check_resume_compatible(manifest.get("fields", {}), spec, output=spec.output.path, content=content)
        return store, manifest

    def _run_pools(self, store, config, files: list[str], skip_docs, report, docs_total_hint: int | None):
        """Workers up, input flowing, the loop run: what the report needs to finish."""
        from dlbatch.driver.feed import BatchPrefetcher

        spec = self.spec
        early = self.pools is not None  # started by `_start_early`
        if not early and config.layout is None:  # cluster: auto on an attached cluster: its chips decide
            config = self._cluster_layout(config, report)
        report.layout = config.layout
        pools = self.pools = self.pools or WorkerPools(config, self.resource_timeout_s)
        prefetch = None
        try:
            if not early:
                pools.start(report.startup)
            t_data = time.time()  # documents are parsed and tokenized while the workers load the model
            prefetch = BatchPrefetcher(self.pipeline.build(spec, files, skip_docs, max_model_len=config.max_model_len,
                                                           dataset=self.dataset,
                                                           preprocess=getattr(self.pipeline, "preprocess", None)))
            report.startup.span("data_plan", t_data, time.time())
            pools.wait_ready(report.startup, report)
            return self._drive(store, prefetch, pools, report, docs_total_hint)
        finally:
            if prefetch is not None:
                report.first_batch_at = prefetch.first_batch_at
                prefetch.close()
            pools.stop()
            self.pools = None

    def _cluster_layout(self, config, report):
        """The solver's layout on the attached cluster's ``chip:`` resources (Ray attached first)."""
        import ray

        from dlbatch.driver.chips import cluster_chips
        from dlbatch.workers.session import start_ray

        report.startup.start("layout")
        start_ray(self.spec.cluster.address, {})
        config = config.with_chips(cluster_chips(ray.cluster_resources()))
        report.startup.end("layout")
        log.info("layout: %s", config.layout.reason)
        return config

    def _drive(self, store, batches, pools, report, docs_total_hint: int | None):
        """Run the DispatchLoop; returns the finishing step of the report (`_Finish`)."""
        from dlbatch.driver.loop import DispatchLoop
        from dlbatch.prompts.hooks import postprocess_fields
        from dlbatch.report.metrics import JobMetrics
        from dlbatch.report.progress import Progress
        from dlbatch.report.run import Tally

        spec = self.spec
        already = report.already_done + report.already_failed
        tally = Tally(metrics=JobMetrics(spec.name), already=already,
                      progress=Progress(spec.name, total_docs=docs_total_hint, initial_docs=already, tty=self.progress))
        loop = self.loop = DispatchLoop(spec, store, pools, batches, report, tally, docs_total_hint=docs_total_hint,
                                        flush_docs=self.flush_docs, flush_seconds=self.flush_seconds,
                                        stall_timeout_s=self.stall_timeout_s, input_timeout_s=self.input_timeout_s,
                                        postprocess=getattr(self.pipeline, "postprocess", None),
                                        postprocess_fields=postprocess_fields(self.pipeline))
        try:
            loop.run()
        finally:
            self.loop = None
        stats = pools.stats()
        wall = max(1e-9, time.time() - report.t_start)
        for role, sts in stats.items():
            for i, st in enumerate(sts):
                tally.metrics.worker_busy(role, i, st.get("busy_s", 0.0) / wall)
        return _Finish(self, report, tally, stats, loop, pools)

    @staticmethod
    def _orphans(store) -> dict:
        """At the end of the run: parts a process committed after it lost this output's lease,
        moved aside to ``_orphans/`` (`Store.orphans`); the report names them."""
        try:
            moved = store.orphans()
        except OSError as e:
            log.warning("could not look for orphan parts in %s: %s", store.files.url, brief(e))
            return {"error": brief(e)}
        if moved:
            log.warning("%d parts committed by a process after it lost the lease of %s were moved aside to "
                        "_orphans/ (their documents were redone): %s", len(moved), store.files.url,
                        ", ".join(moved[:5]))
        return {"count": len(moved), "parts": moved[:100]}

    def _compact_output(self, store) -> dict:
        """At job end: merge the small committed parts when more than compact_min_parts
        exist (`Store.compact`); a failure leaves the parts as they are and never fails
        the job."""
        min_parts = self.compact_min_parts
        if min_parts is None or min_parts < 0:
            return {}
        try:
            return store.compact(min_parts=min_parts)
        except Exception as e:
            log.warning("compaction of %s skipped: %s", store.files.url, brief(e))
            return {"error": brief(e)}


def _warn_if_not_reproducible(config, n_done: int) -> None:
    """A resumed run generates its documents in other batches than an uninterrupted run would:
    in a half-precision dtype the same prompt can give other tokens in another batch (greedy
    included), so say so when any pool computes in one (float32 reproduces them)."""
    from dlbatch.engine.device import compute_dtype

    dtypes = sorted({compute_dtype(p.worker.engine.dtype, p.device.split(":")[0], allow_upcast=True)
                     for p in config.pools.values()} - {"float32"})
    if dtypes:
        log.warning("resuming: %d documents were committed by an earlier run; this run computes in %s, where a "
                    "prompt batched differently can give other tokens (greedy included), so the rows it adds may "
                    "differ from an uninterrupted run's; model.dtype float32 reproduces them (docs/reliability.md)",
                    n_done, "/".join(dtypes))


class _Finish:
    """What a finished loop leaves for the report, taken before the pools are stopped."""

    def __init__(self, runner: JobRunner, report, tally, stats: dict, loop, pools):
        self.runner, self.report, self.tally, self.stats = runner, report, tally, stats
        self.router, self.dispatch = loop.d.router.stats.to_dict(), loop.dispatch_stats()
        self.retries, self.long_inputs = loop.worker_retries(), loop.long_inputs_report()
        self.kv_transport, self.rdt_regroups = pools.kv_via, pools.rdt_regroups

    def finish(self, store, retries: dict) -> dict:
        return self.report.finish(store, self.tally, stats=self.stats, router=self.router, dispatch=self.dispatch,
                                  retries=retries, compaction=self.runner._compact_output(store),
                                  long_inputs=self.long_inputs, kv_transport=self.kv_transport,
                                  rdt_regroups=self.rdt_regroups, orphans=self.runner._orphans(store))

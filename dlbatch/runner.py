"""`dlbatch run`: drive one job from the job file to committed Parquet.

The data plane (list -> parse -> prompts/tokenize) is a Ray Data dataset consumed in a
streaming fashion; the compute plane is the worker pools of the plan (colocated, or
prefill -> decode with KV moving between actors through the object store). The driver
routes windows of requests (prefix-aware), keeps several batches in flight per worker,
retries requests whose worker died, dead-letters poison documents after a bounded number
of attempts, and commits complete documents atomically (see `dlbatch.checkpoint`).
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

from dlbatch.checkpoint import COMPACT_MIN_PARTS
from dlbatch import structured
from dlbatch.transfer.errors import brief

log = logging.getLogger("dlbatch.run")


class JobFailed(RuntimeError):
    """The job cannot go on (no worker or node can serve it); committed output is intact."""


MAX_RESTARTS = 4  # per worker actor; Ray restarts a dead worker this many times


class BatchPrefetcher:
    """Pulls the Ray Data stream (parse, render, tokenize) on a background thread into a
    bounded queue, so that documents are parsed while the workers load the model, and the
    driving loop never blocks on a slow source while results wait to be collected."""

    _END = object()

    def __init__(self, ds, depth: int = 8):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._ds = ds
        self.first_batch_at: float | None = None  # wall time the first batch came out (start-up breakdown)
        self._thread = threading.Thread(target=self._run, name="dlbatch-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for batch in self._ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                self.first_batch_at = self.first_batch_at or time.time()
                while not self._stop.is_set():
                    try:
                        self._q.put(batch, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            item = self._END
        except BaseException as e:  # handed to the driving loop, which raises it
            item = e
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def get(self, timeout: float = 0.0):
        """The next batch; None when nothing is ready within `timeout`; raises StopIteration
        at the end of the stream, or the stream's own error."""
        try:
            item = self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return None
        if item is self._END:
            self._q.put(item)  # stays at the end for any later call
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()


class _InputFeed:
    """Request rows from the prefetcher into the dispatcher. Knows how long the driver has
    been idle (nothing in flight, no document open) waiting for the input pipeline."""

    def __init__(self, prefetch: BatchPrefetcher, prepare=lambda row: row):
        self.prefetch = prefetch
        self.prepare = prepare  # an input row -> the request row the dispatcher takes
        self.exhausted = False
        self.idle_since: float | None = None
        self.docs_seen = self.tokens_seen = 0  # documents tokenized this run and their tokens: the ETA of the others
        self._last_doc = None

    def pull(self, d, room, idle: bool) -> None:
        """Add rows while `room()`; wait a little for input only when nothing else can progress."""
        now = time.time()
        self.idle_since = (self.idle_since or now) if idle and not self.exhausted else None
        while not self.exhausted and room():
            try:
                batch = self.prefetch.get(timeout=0.2 if idle else 0.0)
            except StopIteration:
                self.exhausted = True
                return
            if batch is None:
                return
            self.idle_since, idle = None, False
            for r in batch.to_pylist():
                if d.add_row(self.prepare(r)) and r.get("prompt_ids"):
                    self.docs_seen += r["doc_id"] != self._last_doc  # a document's rows come together
                    self._last_doc = r["doc_id"]
                    self.tokens_seen += len(r["prompt_ids"]) + int(r["max_tokens"])

    def idle_for(self, now: float) -> float:
        return 0.0 if self.idle_since is None else now - self.idle_since


@dataclass
class _Tally:
    """What this run committed, for the report, the metrics and the progress line."""

    metrics: object
    progress: object  # dlbatch.progress.Progress: the bar on a terminal, else a log line every 30 s
    new_ok: int = 0
    new_failed: int = 0
    rows_written: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    prompt_hist: list = field(default_factory=list)
    output_hist: list = field(default_factory=list)
    # documents by the long-input policy applied to them ("fit": none was needed; "skip": dead-lettered)
    policies: collections.Counter = field(default_factory=collections.Counter)
    last_log: float = field(default_factory=time.time)

    def doc_ok(self, rows: list[dict]) -> None:
        p = [r["prompt_tokens"] for r in rows]
        o = [r["output_tokens"] for r in rows]
        self.prompt_tokens += sum(p)
        self.output_tokens += sum(o)
        self.prompt_hist += p
        self.output_hist += o
        self.new_ok += 1
        for policy in sorted({r.get("long_input_policy") for r in rows} - {None}) or ["fit"]:
            self.policies[policy] += 1
        self.metrics.docs(ok=1)
        self.metrics.tokens(prompt=sum(p), output=sum(o))

    def show(self, runner, d, feed, inflight: int) -> None:
        self.metrics.inflight(inflight)
        finished = self.new_ok + self.new_failed
        self.progress.update(docs_done=runner.already_done + runner.already_failed + finished,
                             tokens=self.prompt_tokens + self.output_tokens,
                             remaining_tokens=runner._remaining_tokens(d.docs, finished, feed.docs_seen,
                                                                       feed.tokens_seen))


def inputs_signature(files: list[str], storage_options: dict | None = None, limit: int | None = None) -> str:
    """Names, sizes and versions (mtime / ETag) of the inputs, and input.limit: the "nothing
    to do" check of a complete job compares it (connectors.listing.inputs_fingerprint)."""
    from connectors.listing import inputs_fingerprint

    return inputs_fingerprint(files, storage_options, limit)


class JobRunner:
    compact_min_parts: int | None = COMPACT_MIN_PARTS  # merge small parts at job end when more exist; None/-1: never

    def __init__(self, spec, fresh: bool = False, plan: dict | None = None, progress: bool | None = None,
                 worker_options: dict | None = None, flush_docs: int = 16, flush_seconds: float = 5.0,
                 resource_timeout_s: float = 120.0, stall_timeout_s: float = 1800.0,
                 input_timeout_s: float = 600.0):
        self.spec = spec
        self._constraints = structured.task_constraints(spec)  # task -> engine constraint (its `output:`)
        self._map_reduce = None  # set per run when a task chunks long documents
        self.long_inputs: dict = {}  # the report's documents by long-input policy, chunk sizes
        self.fresh = fresh
        self.plan = plan
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.worker_options = dict(worker_options or {})  # tests: fault injection
        self.flush_docs = flush_docs
        self.flush_seconds = flush_seconds
        # a chip resource the pools need may be absent this long (node lost, none came back)
        self.resource_timeout_s = resource_timeout_s
        # no batch returned (result or error) for this long while batches are in flight
        self.stall_timeout_s = stall_timeout_s
        # no document came from the input pipeline for this long while every worker was idle
        self.input_timeout_s = input_timeout_s
        self._last_check = 0.0
        self._missing_since: float | None = None
        self.needed_resources: dict = {}  # chip resource -> the pool (role) that needs it
        self.dispatch_stats: dict = {}  # batches, requeued, suspects, solo_batches, attempts_charged
        self.retries = 0
        self.timeline: list[dict] = []
        self.workers: dict[str, list] = {}  # role -> actor handles (tests: ping() gives pids)
        self.kv_via = "object_store"  # how prefill workers hand KV to decode workers (set per run)
        self.rdt_backend = None
        self.rdt_group = None  # the collective group over every PD worker (kv_transport=rdt)
        self.rdt_device = None
        self.rdt_regroups = 0  # times the group was re-formed after a worker restart
        self.worker_pids: dict = {}  # (role, idx) -> pid of the worker's process, from its pings
        self.inflight = 0  # batches in flight now (tests: kill a worker mid-batch)
        self.io_retries_start = 0
        self.prefetch = None  # the running BatchPrefetcher (its first batch time goes to the report)
        self.startup = None  # StartupClock of the run: where the time before the first token went
        self.docs_total_hint: int | None = None  # documents of the input when known (files), for the ETA
        self.already_done = self.already_failed = 0  # committed before this run
        self.gen = None  # GenerationTimeline: tokens by the time workers generated them

    # ------------------------------------------------------------------------------------
    def run(self) -> dict:
        from connectors import list_inputs
        from dlbatch.checkpoint import OutputStore
        from dlbatch.jobspec import check_resume_compatible, fingerprint_fields, job_fingerprint

        from connectors.io_retry import retry_count

        from dlbatch.gentimeline import GenerationTimeline, StartupClock

        spec = self.spec
        t_start = time.time()
        self.startup, self.gen = StartupClock(t_start), GenerationTimeline(t_start)
        self._note_process_start(t_start)
        self.io_retries_start = retry_count()
        store = OutputStore(spec.output.path, dict(spec.output.storage_options))
        if self.fresh:
            n = store.clear()
            log.info("--fresh: removed %d files of a previous run under %s", n, spec.output.path)
        manifest = store.read_json("_manifest.json")
        if manifest is not None:
            check_resume_compatible(manifest.get("fields", {}), spec, output=spec.output.path)
        self.startup.start("list_inputs")
        files = list_inputs(spec.input.path, spec.input.format, dict(spec.input.storage_options))
        self.startup.end("list_inputs")
        if spec.input.limit is not None and spec.input.format in ("pdf", "text"):
            files = files[:spec.input.limit]
        sig = inputs_signature(files, dict(spec.input.storage_options), spec.input.limit)
        task_names = {t.name for t in spec.tasks}
        prog = store.progress(tasks=task_names)  # from the parts' index files, not their text
        done_ok = {d for d, ts in prog["tasks_by_doc"].items() if ts >= task_names}
        skip_docs = done_ok | prog["docs_failed"]
        if manifest and manifest.get("complete") and manifest.get("inputs") == sig:
            print(f"job {spec.name!r} is already complete in {spec.output.path}: {len(done_ok)} documents done, "
                  f"{len(prog['docs_failed'])} failed; nothing to do (use --fresh to start over)", file=sys.stderr)
            return {"noop": True, "docs_ok": len(done_ok), "docs_failed": len(prog["docs_failed"]),
                    "rows_written": prog["rows"]}
        store.write_json("_manifest.json", {"name": spec.name, "fingerprint": job_fingerprint(spec),
                                            "fields": fingerprint_fields(spec), "inputs": sig, "complete": False,
                                            "started": t_start})
        todo = files
        if spec.input.format in ("pdf", "text"):  # a source is done when all its documents are
            todo = [f for f in files if f not in prog["sources_done"]]
        self.docs_total_hint = len(files) if spec.input.format in ("pdf", "text") else None
        self.already_done = len(done_ok)
        self.already_failed = len(prog["docs_failed"])
        if not todo:
            report = self._finish(store, t_start, stats={}, new_ok=0, new_failed=0, rows=0, noop_docs=True)
            store.write_json("_manifest.json", {**store.read_json("_manifest.json"), "complete": True})
            print(f"job {spec.name!r}: every input is already processed; nothing to do", file=sys.stderr)
            return report
        return self._run_pools(store, todo, skip_docs, t_start, sig)

    # ------------------------------------------------------------------------------------
    def _pools(self):
        c = self.spec.cluster
        pools = c.pools()
        if self.plan is not None:
            from dlbatch.jobspec import PoolSpec

            pools = {}
            for p in self.plan.get("pools", []):
                role = p["role"]
                base = c.pools().get(role) or c.prefill
                pools[role] = PoolSpec(chip=p.get("chip_resource") or base.chip, replicas=int(p["replicas"]),
                                       device=base.device, num_cpus=base.num_cpus, num_gpus=base.num_gpus,
                                       kv_cache_memory=base.kv_cache_memory)
            if "colocated" in pools and ("prefill" in pools or "decode" in pools):
                raise JobFailed("plans that mix colocated and PD pools are run as PD only on this version: "
                                f"{self.plan.get('pools')}")
        return pools

    def _missing_resources(self) -> list[str]:
        if not self.needed_resources:
            return []
        import ray

        have = ray.cluster_resources()
        return [r for r in self.needed_resources if have.get(r, 0) < 1]

    def _wait_for_resources(self, since: float) -> None:
        """Wait (bounded) until some node provides every chip resource the pools ask for."""
        while True:
            missing = self._missing_resources()
            if not missing:
                return
            if time.time() - since > self.resource_timeout_s:
                raise JobFailed(self._no_resource_message(missing))
            time.sleep(1.0)

    def _no_resource_message(self, missing: list[str]) -> str:
        import ray

        pools = ", ".join(f"{self.needed_resources[r]} pool needs {r}" for r in missing)
        return (f"no node of the Ray cluster provides {', '.join(missing)} ({pools}) and none came back within "
                f"{self.resource_timeout_s:.0f} s; cluster resources: "
                f"{ {k: v for k, v in ray.cluster_resources().items() if k.startswith('chip:')} }. "
                f"Committed output is intact: rerun the job once such a node is up.")

    def _wait_workers_up(self, workers: dict) -> None:
        """Every worker answers ping (placed, model loaded); bounded, and says which did not."""
        import ray

        keys = [(role, i) for role, ws in workers.items() for i in range(len(ws))]
        refs = [workers[role][i].ping.remote() for role, i in keys]
        limit = max(600.0, self.resource_timeout_s)
        deadline = time.time() + limit
        pending = list(refs)
        missing_since = None
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            missing = self._missing_resources()
            missing_since = (missing_since or time.time()) if missing else None
            if missing_since and time.time() - missing_since > self.resource_timeout_s:
                raise JobFailed(self._no_resource_message(missing))
            if time.time() > deadline:
                late = [f"{role} worker {i}" for (role, i), r in zip(keys, refs) if r in pending]
                raise JobFailed(f"{', '.join(late)} did not answer ping within {limit:.0f} s of being started (placed "
                                f"on a node with its chip resource, then loading {self.spec.model.name!r}); "
                                f"committed output is intact")
        infos = []
        for (role, i), r in zip(keys, refs):
            try:
                infos.append(ray.get(r, timeout=60))  # done: returns at once, or raises
            except Exception as e:
                raise JobFailed(f"{role} worker {i} failed to start (loading {self.spec.model.name!r}): "
                                f"{type(e).__name__}: {brief(e, 500)}") from e
        self.worker_pids = {k: info.get("pid") for k, info in zip(keys, infos)}
        self._note_worker_startup(infos)

    def _check_shm_same_node(self, workers: dict) -> None:
        """kv_transport=shm moves KV through this node's /dev/shm: every prefill and decode
        worker must be on one node. Checked once the workers are up, so a placement across
        nodes fails the job at start, naming the nodes, not every document later."""
        if self.kv_via != "shm" or "prefill" not in workers:
            return
        import ray

        nodes: dict[str, set] = {}
        for role in ("prefill", "decode"):
            infos = ray.get([w.ping.remote() for w in workers.get(role, [])], timeout=60)
            for i, info in enumerate(infos):
                nodes.setdefault(info.get("node_id") or "?", set()).add(f"{role}[{i}]")
        if len(nodes) > 1:
            where = "; ".join(f"node {n[:12]}: {', '.join(sorted(ws))}" for n, ws in sorted(nodes.items()))
            raise JobFailed(f"cluster.kv_transport='shm' needs every prefill and decode worker on one node (shared "
                            f"memory does not cross machines), but they were placed on {len(nodes)} nodes ({where}); "
                            f"use kv_transport: object_store (or rdt/dlslime), or pools on one node")
        self._shm_cleanup(workers, close=False)  # segments of processes killed in an earlier run

    def _shm_cleanup(self, workers: dict, close: bool) -> None:
        """kv_transport=shm: sweep stale segments on the workers' nodes (and this one); with
        ``close``, the workers also unlink their pooled segments (ray.kill skips their exit
        handlers). Best effort, bounded: a dead worker's segments are swept next time."""
        if self.kv_via != "shm" or "prefill" not in workers:
            return
        from dlbatch.transfer import shm

        swept = list(shm.sweep_stale_segments())
        try:
            import ray

            refs = [w.shm_cleanup.remote(close) for ws in workers.values() for w in ws]
            for r in ray.get(refs, timeout=10):
                swept += r
        except Exception as e:  # a worker already gone: nothing of its own left to close
            log.info("shm cleanup on the workers incomplete: %s", brief(e))
        if swept:
            log.info("swept %d stale shared-memory segments", len(set(swept)))

    def _run_pools(self, store, files, skip_docs, t_start, sig) -> dict:
        import ray

        from dlbatch.session import chip_resource, shutdown_ray, start_ray
        from dlbatch.workers import WorkerSpec, make_worker_class

        spec = self.spec
        pools = self._pools()
        chips: dict[str, int] = collections.Counter()
        for p in pools.values():
            chips[p.chip] += p.replicas
        from dlbatch.engine.loader import model_dir

        from dlbatch.transfer.base import get_transport

        via = spec.cluster.kv_transport
        # auto on device pools: rdt or not is decided from what a task with each pool's resources
        # reports (the driver may have no GPU; _decide_auto_transport); CPU pools: the object store
        ask_workers = (via == "auto" and "prefill" in pools
                       and not pools["prefill"].device.startswith("cpu") and not pools["decode"].device.startswith("cpu"))
        if via == "auto":
            via = "object_store"
        if "prefill" in pools and via in ("rdt", "dlslime", "shm"):
            if via == "rdt" and pools["prefill"].device.split(":")[0] != pools["decode"].device.split(":")[0]:
                raise JobFailed(f"cluster.kv_transport='rdt' needs the prefill and decode pools on the same kind of "
                                f"device (one collective backend), got {pools['prefill'].device!r} and "
                                f"{pools['decode'].device!r}; use object_store")
            # fail before any work starts, naming what is missing; rdt on device pools is the
            # workers' business (the driver may have no GPU): create_group fails clearly there
            if not (via == "rdt" and not pools["prefill"].device.startswith("cpu")):
                try:
                    get_transport(via, same_node=True, device=pools["prefill"].device,
                                  peer_device=pools["decode"].device)
                except Exception as e:
                    raise JobFailed(f"cluster.kv_transport={via!r} cannot run here: {e}") from None
        self.kv_via = via
        self.startup.start("model_cache")
        model_dir(spec.model.name)  # convert a GGUF once, before workers race for it
        self.startup.end("model_cache")
        self.startup.start("ray_start")
        started = start_ray(spec.cluster.address, dict(chips))
        self.startup.end("ray_start")
        workers: dict[str, list] = {}
        prefetch = None
        self.workers = workers
        self.needed_resources = {chip_resource(p.chip): role for role, p in pools.items()}
        try:
            self._wait_for_resources(time.time())
            if ask_workers:
                self._decide_auto_transport(pools)
            use_rdt = "prefill" in pools and self.kv_via == "rdt"
            self.startup.start("workers_ready")
            for role, pool in pools.items():
                cls = make_worker_class(role, tensor_transport=use_rdt)
                threads = max(1, int(round(pool.num_cpus))) if pool.device == "cpu" else 1
                if pool.device == "cpu" and len(pools) == 1:
                    threads = max(threads, min(2, os.cpu_count() or 1))
                wspec = WorkerSpec(model=spec.model.name, dtype=spec.model.dtype, device=pool.device,
                                   max_model_len=spec.model.max_model_len, chat=spec.model.chat, num_threads=threads,
                                   max_num_batched_tokens=max(512, min(spec.batching.max_batch_tokens, 4096)),
                                   kv_transport=self.kv_via,
                                   kv_cache_memory=pool.kv_cache_memory,
                                   device_share=pool.num_gpus if 0 < pool.num_gpus < 1 else 1.0)
                opts = dict(num_cpus=pool.num_cpus, num_gpus=pool.num_gpus, resources={chip_resource(pool.chip): 1},
                            max_restarts=MAX_RESTARTS, max_task_retries=0)
                workers[role] = [cls.options(**opts).remote(wspec, **self.worker_options) for _ in range(pool.replicas)]
            from pipelines import get_pipeline

            # documents are parsed and tokenized while the workers load the model
            t_data = time.time()
            prefetch = BatchPrefetcher(get_pipeline(spec.pipeline).build(spec, files, skip_docs))
            self.prefetch = prefetch
            self.startup.span("data_plan", t_data, time.time())
            self._wait_workers_up(workers)
            self.startup.end("workers_ready")
            self._check_shm_same_node(workers)
            if use_rdt:  # one collective group over every prefill and decode worker
                from dlbatch.transfer import rdt

                self.rdt_device = pools["prefill"].device
                self.rdt_group = rdt.create_group(workers["prefill"] + workers["decode"], device=self.rdt_device)
                self.rdt_backend = rdt.backend_for(self.rdt_device)
            return self._drive(store, prefetch, workers, t_start, sig)
        finally:
            if prefetch is not None:
                prefetch.close()
            self._shm_cleanup(workers, close=True)
            for ws in workers.values():
                for w in ws:
                    try:
                        ray.kill(w)
                    except Exception:  # already gone
                        pass
            shutdown_ray(started)

    def _decide_auto_transport(self, pools) -> None:
        """kv_transport=auto on device pools: one Ray task per PD pool, with the pool's own
        resources, reports what its workers will see (device after Ray's renumbering, CUDA,
        whether RDT runs there); rdt when all can (transfer/base.py auto_from_workers). The
        driver's own devices do not matter. Decided before the workers exist, so a worker
        Ray restarts gets the same transport from its spec."""
        import ray

        from dlbatch.session import chip_resource
        from dlbatch.transfer.base import auto_from_workers
        from dlbatch.workers import probe_device

        probe = ray.remote(probe_device)
        refs = [probe.options(num_cpus=pools[r].num_cpus, num_gpus=pools[r].num_gpus,
                              resources={chip_resource(pools[r].chip): 1}).remote(pools[r].device)
                for r in ("prefill", "decode")]
        try:
            infos = ray.get(refs, timeout=300)
        except ray.exceptions.GetTimeoutError:
            raise JobFailed("kv_transport=auto: the prefill/decode pools' resources did not come up within 300 s "
                            "to probe their devices; set cluster.kv_transport explicitly") from None
        self.kv_via, why = auto_from_workers(infos)
        log.info("kv_transport auto -> %s (%s)", self.kv_via, why)

    # ------------------------------------------------------------------------------------
    def _dispatcher(self, workers: dict):
        from dlbatch.dispatch import Dispatcher
        from dlbatch.retry_policy import RetryPolicy
        from dlbatch.router import Router, RouterConfig
        from dlbatch.router.grouping import make_sampling_key

        spec, smp = self.spec, self.spec.sampling
        n_front = len(workers.get("prefill") or workers["colocated"])
        folds = structured.fold_keys(spec)  # a constrained task is never folded onto another task's request

        def key(r):
            if smp.temperature == 0 and r["task"] not in folds:
                return None
            extra = {"constraint": folds[r["task"]]} if r["task"] in folds else {}
            return make_sampling_key(f"{r['doc_id']}::{r['task']}", smp.temperature, smp.top_p, smp.top_k,
                                     int(r["seed"]), **extra)

        return Dispatcher({role: len(ws) for role, ws in workers.items()},
                          Router(n_front, RouterConfig(policy=spec.router.policy, window=spec.router.window)),
                          RetryPolicy(max_attempts=spec.retries.max_attempts),
                          max_batch_tokens=spec.batching.max_batch_tokens, window=spec.router.window,
                          inflight_cap=spec.batching.max_inflight_batches * max(len(ws) for ws in workers.values()),
                          request_key=key, is_fatal=lambda err: str(err or "").startswith("ConstraintError"),
                          more_requests=self._map_reduce.more_requests if self._map_reduce else None)

    def _long_inputs_report(self, tally) -> dict:
        """This run's documents by long-input policy, and the token lengths of the chunks of
        the documents that were map-reduced."""
        sizes = self._map_reduce.chunk_tokens if self._map_reduce else []
        return {"documents": {k: v for k, v in tally.policies.items() if v},
                "chunk_tokens": {"chunks": len(sizes), "min": min(sizes, default=0), "max": max(sizes, default=0),
                                 "mean": round(sum(sizes) / len(sizes), 1) if sizes else 0}}

    def _make_map_reduce(self):
        """The map -> reduce driver of `long_inputs: chunk` (dlbatch.map_reduce), when a task uses it."""
        spec = self.spec
        if "chunk" not in {spec.long_inputs, *(t.long_inputs for t in spec.tasks)}:
            return None
        from dlbatch.engine.loader import load_tokenizer
        from dlbatch.map_reduce import MapReduce

        return MapReduce(spec, load_tokenizer(spec.model.name))

    def _items_for(self, rows: list[dict]) -> list[dict]:
        smp = self.spec.sampling
        constraints = self._constraints
        return [{"request_id": f"{r['doc_id']}::{r['task']}", "token_ids": list(r["prompt_ids"]),
                 "max_tokens": int(r["max_tokens"]), "temperature": smp.temperature, "top_p": smp.top_p,
                 "top_k": smp.top_k, "seed": int(r["seed"]) if smp.temperature > 0 else None,
                 **({"constraint": constraints[r["task"]]} if r["task"] in constraints else {})} for r in rows]
        # (the map and reduce requests of a chunked task, "<task>#<key>", write free-text notes:
        # a constrained task's constraint applies to its final row's parse, not to its notes)

    def _drive(self, store, batches: BatchPrefetcher, workers, t_start, sig) -> dict:
        """schedule -> submit -> wait -> results / failures -> commit, until every document is
        committed or dead-lettered. Decisions are the Dispatcher's (dlbatch.dispatch)."""
        import ray

        from dlbatch.commit_buffer import CommitBuffer
        from dlbatch.map_reduce import MapReduce
        from dlbatch.metrics import JobMetrics
        from dlbatch.ray_dispatch import RayWorkers

        self._map_reduce = self._make_map_reduce()
        d = self._dispatcher(workers)
        pools = RayWorkers(self, workers, d, self._items_for)
        feed = _InputFeed(batches, prepare=MapReduce.request_row)
        buf = CommitBuffer(self.flush_docs, self.flush_seconds)
        tally = _Tally(metrics=JobMetrics(self.spec.name), progress=self._progress())
        try:
            while True:
                self._watchdog(d, pools, feed)
                feed.pull(d, room=lambda: len(pools.refs) < d.inflight_cap and d.queued < 2 * self.spec.router.window,
                          idle=not pools.refs and not d.docs)
                pools.probe()
                pools.reform_rdt_group()
                role = d.dead_role()
                if role is not None:
                    raise JobFailed(self._all_dead_message(role, tally.new_ok))
                for b in d.next_batches():
                    pools.submit(b)
                if feed.exhausted and d.finished():
                    break
                if not pools.refs:
                    time.sleep(0.05)  # input, a worker coming back, a held-back worker, a regroup
                for b, outcome in pools.wait(0.5):
                    if self.gen is not None and not isinstance(outcome, BaseException):  # when tokens were made
                        for res in outcome:
                            self.gen.add(res, time.time())
                    pools.handle(b, outcome)
                self._collect(d, buf, tally)
                self._commit(store, buf, tally, t_start)
                tally.show(self, d, feed, len(pools.refs))
        except BaseException:
            # commit every document that is complete before giving up; never a partial one
            try:
                self._collect(d, buf, tally)
                self._commit(store, buf, tally, t_start, force=True)
            except Exception as e2:  # the original error is the one to report
                log.error("could not commit finished documents while failing: %s", e2)
            raise
        finally:
            self.retries = d.stats["requeued"] + d.stats["attempts_charged"]
            self.dispatch_stats = {k: d.stats[k] for k in ("batches", "requeued", "suspects", "solo_batches",
                                                         "attempts_charged")}
        self._collect(d, buf, tally)
        self._commit(store, buf, tally, t_start, force=True)
        tally.progress.close()
        self.long_inputs = self._long_inputs_report(tally)
        stats = {}
        try:
            stats = {role: ray.get([w.stats.remote() for w in ws], timeout=60) for role, ws in workers.items()}
        except Exception as e:  # the report must not fail a finished job
            log.warning("could not collect worker stats (waited 60 s for every worker's stats()): %s", brief(e))
        wall_now = max(1e-9, time.time() - t_start)
        for role, sts in stats.items():
            for i, st in enumerate(sts):
                tally.metrics.worker_busy(role, i, st.get("busy_s", 0.0) / wall_now)
        report = self._finish(store, t_start, stats, tally.new_ok, tally.new_failed, tally.rows_written,
                              prompt_tokens=tally.prompt_tokens, output_tokens=tally.output_tokens,
                              prompt_hist=tally.prompt_hist, output_hist=tally.output_hist,
                              router=d.router.stats.to_dict())
        store.write_json("_manifest.json", {**(store.read_json("_manifest.json") or {}), "complete": True,
                                            "inputs": sig})
        return report

    def _collect(self, d, buf, tally) -> None:
        """Complete documents and dead letters from the dispatcher into the commit buffer."""
        spec = self.spec
        extra = lambda task, res: structured.row_fields(spec, task, res)  # noqa: E731
        for doc in d.take_completed():
            rows = (self._map_reduce.output_rows(doc, spec.model.name, extra) if self._map_reduce
                    else doc.output_rows(spec.model.name, extra))
            buf.add_document(rows)
            tally.doc_ok(rows)
        task_errors = d.take_task_errors()  # (document, task)s that failed alone: the document goes on
        if task_errors:
            buf.add_errors(task_errors)
        dead = d.take_dead_letters()
        tally.policies["skip"] += sum(e.get("error_type") == "LongInput" for e in dead)
        if dead:
            buf.add_errors(dead)
            tally.new_failed += len(dead)
            tally.metrics.docs(failed=len(dead))

    def _commit(self, store, buf, tally, t_start, force: bool = False) -> None:
        if not buf.due(force):
            return
        rows, errors = buf.take()
        if rows:
            store.commit_results(rows, self.spec.output.include_text, structured.result_fields(self.spec))
            tally.rows_written += len(rows)
        if errors:
            store.commit_errors(errors)
        self.timeline.append({"t": round(time.time() - t_start, 3), "docs_done": tally.new_ok + tally.new_failed,
                              "tokens_done": tally.prompt_tokens + tally.output_tokens})

    def _all_dead_message(self, role: str, new_ok: int) -> str:
        return (f"every {role} worker is dead and Ray will not restart it again (max_restarts={MAX_RESTARTS} used "
                f"up, e.g. by a document that kills its worker more often than that, or by lost nodes); {new_ok} "
                f"documents were committed in this run and committed output is intact: rerun to resume")

    def _watchdog(self, d, pools, feed) -> None:
        """Every wait of the loop is bounded, and says what it waited for when it fires."""
        now = time.time()
        if now - self._last_check < 2.0:
            return
        self._last_check = now
        missing = self._missing_resources()
        self._missing_since = (self._missing_since or now) if missing else None
        if missing:
            log.warning("waiting for a node that provides %s (%.0f s of %.0f s)", ", ".join(missing),
                        now - self._missing_since, self.resource_timeout_s)
            if now - self._missing_since > self.resource_timeout_s:
                raise JobFailed(self._no_resource_message(missing))
        for w in d.unhealthy():
            if d.clock() - w.since > self.stall_timeout_s:
                raise JobFailed(f"{w.key[0]} worker {w.key[1]} has not answered a ping for {d.clock() - w.since:.0f} "
                                f"s after a failed batch (stall_timeout {self.stall_timeout_s:.0f} s); committed "
                                f"output is intact: rerun to resume")
        if pools.refs and now - pools.last_progress > self.stall_timeout_s:
            on = sorted({f"{k[0]} {k[1]}" for b in pools.refs.values() for k in b.workers})
            raise JobFailed(f"no batch finished or failed for {now - pools.last_progress:.0f} s with "
                            f"{len(pools.refs)} in flight on workers {', '.join(on)} (stall_timeout "
                            f"{self.stall_timeout_s:.0f} s); committed output is intact: rerun to resume")
        if feed.idle_for(now) > self.input_timeout_s:
            raise JobFailed(self._no_input_message(feed.idle_for(now)))

    def _no_input_message(self, waited: float) -> str:
        import ray

        try:
            cpus = f"{ray.available_resources().get('CPU', 0):g} of {ray.cluster_resources().get('CPU', 0):g} CPUs free"
        except Exception:  # the message must not fail
            cpus = "CPUs unknown"
        return (f"no document came from the input pipeline (list/parse/tokenize stages over {self.spec.input.path}) "
                f"for {waited:.0f} s while every worker was idle (input_timeout {self.input_timeout_s:.0f} s); Ray "
                f"Data stages may be waiting for CPUs the worker pools hold ({cpus}), or the source hangs. "
                f"Committed output is intact: rerun to resume (raise --input-timeout for a slow source)")

    # ------------------------------------------------------------------------------------
    def _progress(self):
        from dlbatch.progress import Progress

        return Progress(self.spec.name, total_docs=self.docs_total_hint,
                        initial_docs=self.already_done + self.already_failed, tty=self.progress)

    def _remaining_tokens(self, docs: dict, finished: int, docs_seen: int, tokens_seen: int) -> int | None:
        """Tokens left: open requests exactly, documents not tokenized yet at the mean so far."""
        from dlbatch.progress import remaining_tokens

        open_docs = list(docs.values())
        open_rows = [(len(r["prompt_ids"]), int(r["max_tokens"])) for d in open_docs for t, r in d.rows.items()
                     if t not in d.results and r.get("prompt_ids") is not None]
        if not docs_seen:
            return None
        if self.docs_total_hint is None:  # a table input: only what is tokenized is known
            return sum(p + m for p, m in open_rows)
        unseen = self.docs_total_hint - self.already_done - self.already_failed - finished - len(open_docs)
        return remaining_tokens(open_rows, unseen, tokens_seen / docs_seen)

    def _compact_output(self, store) -> dict:
        """At job end: merge the small committed parts when more than compact_min_parts
        exist (dlbatch.checkpoint.OutputStore.compact); a failure leaves the parts as they
        are and never fails the job."""
        min_parts = getattr(self, "compact_min_parts", None)
        if min_parts is None or min_parts < 0:
            return {}
        try:
            return store.compact(min_parts=min_parts)
        except Exception as e:
            log.warning("compaction of %s skipped: %s", store.url, brief(e))
            return {"error": brief(e)}

    def _finish(self, store, t_start, stats, new_ok, new_failed, rows, prompt_tokens=0, output_tokens=0,
                prompt_hist=(), output_hist=(), router=None, noop_docs=False) -> dict:
        from connectors.io_retry import retry_count

        compaction = self._compact_output(store)
        t_finish = time.time()
        wall = t_finish - t_start
        pools = {}
        prefill_computed = 0
        cached = 0
        for role, sts in stats.items():
            busy = [s.get("busy_s", 0.0) / max(wall, 1e-9) for s in sts]
            pool = self.spec.cluster.pools().get(role)
            pools[role] = {"replicas": len(sts), "chip": pool.chip if pool else None,
                           "busy_fraction": round(sum(busy) / max(1, len(busy)), 4),
                           "per_worker_busy": [round(b, 4) for b in busy]}
            if role in ("prefill", "colocated"):
                prefill_computed += sum(s.get("prefill_tokens_computed", 0) for s in sts)
                cached += sum(s.get("prefix_hit_tokens", 0) for s in sts)
        tokens = prompt_tokens + output_tokens
        report = {
            "job": self.spec.name, "docs_total": self.already_done + self.already_failed + new_ok + new_failed,
            "docs_ok": self.already_done + new_ok, "docs_failed": self.already_failed + new_failed,
            "docs_this_run": new_ok + new_failed, "rows_written": rows, "prompt_tokens": prompt_tokens,
            "prefill_tokens_computed": prefill_computed, "prefix_cache_hit_tokens": cached,
            "output_tokens": output_tokens, "wall_s": round(wall, 3),
            "docs_per_s": round((new_ok + new_failed) / wall, 4) if wall > 0 else 0.0,
            "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "plan": self.plan or {"pools": [{"role": r, "chip": p.chip, "replicas": p.replicas}
                                            for r, p in self.spec.cluster.pools().items()]},
            "pools": pools, "kv_transport": self.kv_via if "prefill" in pools else None,
            "rdt_regroups": self.rdt_regroups, "router": router or {},
            "retries": {"worker": self.retries, "io": retry_count() - self.io_retries_start},
            "dispatch": self.dispatch_stats,
            "timeline": self.timeline, "prompt_token_hist": list(prompt_hist), "output_token_hist": list(output_hist),
            "compaction": compaction, "long_inputs": self.long_inputs,
        }
        report.update(self._startup_report())
        if self.plan and self.plan.get("usd_per_hour"):
            usd_h = float(self.plan["usd_per_hour"])
            report["cost"] = {"usd_per_hour": usd_h, "usd_total": round(usd_h * wall / 3600, 6),
                              "usd_per_million_tokens": round(usd_h * wall / 3600 / max(tokens, 1) * 1e6, 6)}
        store.write_json("_report.json", report)
        t_render = time.time()
        try:
            from dlbatch.report_html import render_report

            render_report(report, store.url, store.storage_options)
        except Exception as e:  # pragma: no cover - a report figure must not fail the job
            log.warning("could not render the HTML report: %s", e)
        if self.startup is not None:
            log.info("start-up: %s; report written in %.1f s (job stats %.1f s)", self._startup_line(report),
                     time.time() - t_render, t_render - t_finish)
        return report

    # ------------------------------------------------------------------------------------
    def _note_process_start(self, t_start: float) -> None:
        """The driver process's own start-up (interpreter, imports, job file) before run()."""
        try:
            import psutil

            self.startup.span("driver_process", psutil.Process().create_time(), t_start)
        except Exception:  # psutil missing or /proc unreadable: the breakdown does without
            pass

    def _note_worker_startup(self, infos: list[dict]) -> None:
        """Worker processes' start (Ray starts a Python process, imports) and model load."""
        procs = [i["t_process"] for i in infos if i.get("t_process")]
        inits = [i["t_init"] for i in infos if i.get("t_init")]
        readies = [i["t_ready"] for i in infos if i.get("t_ready")]
        if procs and inits:
            self.startup.span("worker_process", min(procs), max(inits))
        if inits and readies:
            self.startup.span("model_load", min(inits), max(readies))

    def _startup_report(self) -> dict:
        """`startup` (intervals before the first token) and `generation` (tokens by the time
        workers generated them) sections of the report."""
        if self.startup is None or self.gen is None:
            return {}
        pf = getattr(self, "prefetch", None)
        if pf is not None and pf.first_batch_at is not None and "data_plan" in self.startup.intervals:
            self.startup.span("data_first_batch", self.startup.t0 + self.startup.intervals["data_plan"][0],
                              pf.first_batch_at)
        if self.gen.first_token is not None:
            self.startup.span("generation", self.gen.first_token, self.gen.last_done)
        return {"startup": self.startup.to_dict(self.gen.first_token), "generation": self.gen.to_dict()}

    @staticmethod
    def _startup_line(report: dict) -> str:
        st = report.get("startup") or {}
        parts = [f"{k} {v:.1f} s" for k, v in (st.get("phases_s") or {}).items()]
        if st.get("to_first_token_s") is not None:
            parts.append(f"first token {st['to_first_token_s']:.1f} s after the process started")
        return ", ".join(parts) or "no timings"

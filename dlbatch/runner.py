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
import hashlib
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

from dlbatch.transfer.errors import brief

log = logging.getLogger("dlbatch.run")


class JobFailed(RuntimeError):
    """The job cannot go on (no worker or node can serve it); committed output is intact."""


MAX_RESTARTS = 4  # per worker actor; Ray restarts a dead worker this many times


def _actor_state(actor) -> str | None:
    """ALIVE / RESTARTING / DEAD / PENDING_CREATION ... from the GCS actor table (no dashboard
    needed); None when it cannot be read."""
    try:
        from ray._private import state as ray_state

        info = ray_state.actors(actor_id=actor._actor_id.hex())
        return info.get("State") if isinstance(info, dict) else None
    except Exception:  # internal API moved: the stall timeout still bounds every wait
        return None


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


@dataclass
class DocState:
    doc_id: str
    rows: list = field(default_factory=list)  # request rows (one per task)
    results: dict = field(default_factory=dict)  # task -> result dict
    attempts: int = 0
    isolate: bool = False
    failed: bool = False


def inputs_signature(files: list[str]) -> str:
    return hashlib.sha256("\n".join(files).encode()).hexdigest()[:16]


class JobRunner:
    def __init__(self, spec, fresh: bool = False, plan: dict | None = None, progress: bool | None = None,
                 worker_options: dict | None = None, flush_docs: int = 16, flush_seconds: float = 5.0,
                 resource_timeout_s: float = 120.0, stall_timeout_s: float = 1800.0):
        self.spec = spec
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
        sig = inputs_signature(files)
        prog = store.progress()
        task_names = {t.name for t in spec.tasks}
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
        if spec.input.format in ("pdf", "text"):
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
                                       device=base.device, num_cpus=base.num_cpus, num_gpus=base.num_gpus)
            if "colocated" in pools and ("prefill" in pools or "decode" in pools):
                raise JobFailed("plans that mix colocated and PD pools are run as PD only on this version: "
                                f"{self.plan.get('pools')}")
        return pools

    def _missing_resources(self) -> list[str]:
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
        """Every worker answers ping (model loaded); bounded by the stall timeout."""
        import ray

        keys = [(role, i) for role, ws in workers.items() for i in range(len(ws))]
        refs = [workers[role][i].ping.remote() for role, i in keys]
        deadline = time.time() + max(600.0, self.resource_timeout_s)
        pending = list(refs)
        missing_since = None
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            missing = self._missing_resources()
            missing_since = (missing_since or time.time()) if missing else None
            if missing_since and time.time() - missing_since > self.resource_timeout_s:
                raise JobFailed(self._no_resource_message(missing))
            if time.time() > deadline:
                raise JobFailed(f"{len(pending)} workers did not start within {max(600.0, self.resource_timeout_s):.0f} s")
        infos = ray.get(refs, timeout=60)  # raises if a worker failed to start
        self.worker_pids = {k: info.get("pid") for k, info in zip(keys, infos)}
        self._note_worker_startup(infos)

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
        if via == "auto":  # rdt when both pools hold device tensors, else the object store
            via = (get_transport("auto", device=pools["prefill"].device, peer_device=pools["decode"].device).name
                   if "prefill" in pools else "object_store")
        if "prefill" in pools and via in ("rdt", "dlslime", "shm"):
            if via == "rdt" and pools["prefill"].device.split(":")[0] != pools["decode"].device.split(":")[0]:
                raise JobFailed(f"cluster.kv_transport='rdt' needs the prefill and decode pools on the same kind of "
                                f"device (one collective backend), got {pools['prefill'].device!r} and "
                                f"{pools['decode'].device!r}; use object_store")
            try:  # fail before any work starts, naming what is missing
                get_transport(via, same_node=True, device=pools["prefill"].device, peer_device=pools["decode"].device)
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
                                   kv_transport=self.kv_via)
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
            if use_rdt:  # one collective group over every prefill and decode worker
                from dlbatch.transfer import rdt

                self.rdt_device = pools["prefill"].device
                self.rdt_group = rdt.create_group(workers["prefill"] + workers["decode"], device=self.rdt_device)
                self.rdt_backend = rdt.backend_for(self.rdt_device)
            return self._drive(store, prefetch, workers, t_start, sig)
        finally:
            if prefetch is not None:
                prefetch.close()
            for ws in workers.values():
                for w in ws:
                    try:
                        ray.kill(w)
                    except Exception:  # already gone
                        pass
            shutdown_ray(started)

    # ------------------------------------------------------------------------------------
    def _drive(self, store, batches: BatchPrefetcher, workers, t_start, sig) -> dict:
        import ray

        from dlbatch.router import Request, Router, RouterConfig
        from dlbatch.router.grouping import make_sampling_key

        spec = self.spec
        pd = "prefill" in workers
        front_role = "prefill" if pd else "colocated"
        front = workers[front_role]
        decoders = workers.get("decode", [])
        router = Router(len(front), RouterConfig(policy=spec.router.policy, window=spec.router.window))
        from dlbatch.metrics import JobMetrics

        metrics = JobMetrics(spec.name)  # Prometheus-style metrics through Ray; no-op without Ray
        K = len(spec.tasks)
        smp = spec.sampling
        max_attempts = spec.retries.max_attempts
        max_batch_tokens = spec.batching.max_batch_tokens
        inflight_cap = spec.batching.max_inflight_batches * max(len(front), len(decoders))

        docs: dict[str, DocState] = {}
        ready: collections.deque = collections.deque()  # request rows ready to route
        routed: collections.deque = collections.deque()  # (rows, prefill worker) batches not yet submitted
        # documents whose batch failed: each is retried alone, with nothing else in flight
        # (quarantine), so a poison document cannot take innocent ones down with it again
        suspects: collections.OrderedDict = collections.OrderedDict()  # doc_id -> rows to redo
        inflight: dict = {}  # ref -> (items, front_idx, dec_idx, load, quarantine)
        dead: dict[str, set] = {role: set() for role in workers}  # workers Ray will not restart
        # workers that failed a call: nothing is sent to them until a ping answers again (a call to
        # a restarting actor fails at once, and must not count as an attempt of a document)
        unhealthy: dict[tuple, dict] = {}  # (role, idx) -> {"since", "probe", "next"}
        # kv_transport=rdt: a worker Ray restarted is a new process outside the collective
        # group; nothing is submitted until the group is re-formed, which waits for the
        # batches in flight to end (re-forming tears down every member's communicator)
        regroup: dict = {"needed": False, "next": 0.0, "why": ""}
        dec_load = [0] * len(decoders)
        commit_rows: list[dict] = []
        commit_docs = 0
        error_rows: list[dict] = []
        last_flush = time.time()
        new_ok = new_failed = rows_written = 0
        prompt_tokens = output_tokens = 0
        prompt_hist: list[int] = []
        output_hist: list[int] = []
        exhausted = False
        progress = self._progress()
        docs_seen = tokens_seen = 0  # documents tokenized this run and their tokens: the ETA of the others
        last_progress = time.time()
        last_check = 0.0
        missing_since: float | None = None

        def items_for(rows):
            out = []
            for r in rows:
                out.append({"request_id": f"{r['doc_id']}::{r['task']}", "token_ids": list(r["prompt_ids"]),
                            "max_tokens": int(r["max_tokens"]), "temperature": smp.temperature, "top_p": smp.top_p,
                            "top_k": smp.top_k, "seed": int(r["seed"]) if smp.temperature > 0 else None})
            return out

        def dead_letter(doc: DocState, stage: str, etype: str, msg: str):
            nonlocal new_failed
            doc.failed = True
            src = doc.rows[0]["source"] if doc.rows else ""
            error_rows.append({"doc_id": doc.doc_id, "source": src, "stage": stage, "error_type": etype,
                               "error": msg[:1000]})
            log.warning("dead-lettered document %s (%s: %s)", doc.doc_id, etype, msg[:200])
            new_failed += 1
            metrics.docs(failed=1)
            docs.pop(doc.doc_id, None)
            suspects.pop(doc.doc_id, None)

        def live(role: str, n: int) -> list[int]:
            idx = [i for i in range(n) if i not in dead[role]]
            if not idx:
                raise JobFailed(f"every {role} worker is dead and Ray will not restart it again "
                                f"(max_restarts={MAX_RESTARTS} used up, e.g. by a document that kills its worker "
                                f"more often than that, or by lost nodes); {new_ok} documents were committed in "
                                f"this run and committed output is intact: rerun to resume")
            return idx

        def available(role: str, n: int) -> list[int]:
            """Live workers that are up now (not restarting); raises when every one is dead."""
            return [i for i in live(role, n) if (role, i) not in unhealthy]

        def can_submit() -> bool:
            if regroup["needed"]:
                return False
            return bool(available(front_role, len(front))) and (not pd or bool(available("decode", len(decoders))))

        def reform_rdt_group():
            """Re-form the RDT group over the live workers once nothing is in flight."""
            if not regroup["needed"] or inflight or unhealthy or time.time() < regroup["next"]:
                return
            from dlbatch.transfer import rdt

            members = [workers[role][i] for role in ("prefill", "decode") for i in live(role, len(workers[role]))]
            t0 = time.time()
            old, self.rdt_group = self.rdt_group, None
            try:
                self.rdt_group = rdt.reform_group(old, members, device=self.rdt_device)
            except Exception as e:  # a member died meanwhile: its crash is noted, and we try again
                regroup["next"] = time.time() + 1.0
                log.warning("re-forming the RDT group over %d workers failed, retrying: %s", len(members),
                            brief(e))
                return
            regroup["needed"] = False
            self.rdt_regroups += 1
            log.info("re-formed the RDT collective group over %d workers in %.1f s (%s)", len(members),
                     time.time() - t0, regroup["why"])

        def submit(items, front_idx, quarantine=False):
            lf = available(front_role, len(front))
            if front_idx not in lf:
                front_idx = lf[front_idx % len(lf)]
            if pd:
                d = min(available("decode", len(decoders)), key=lambda i: dec_load[i])
                load = sum(len(x["token_ids"]) + x["max_tokens"] for x in items)
                dec_load[d] += load
                pref = front[front_idx].prefill.remote(items)
                if self.kv_via == "rdt":  # the tensors go prefill worker -> decode worker directly
                    kv = front[front_idx].rdt_export.options(tensor_transport=self.rdt_backend).remote(pref)
                    ref = decoders[d].decode_rdt.remote(kv, pref, items)
                else:
                    ref = decoders[d].decode.remote(pref, items)
                inflight[ref] = (items, front_idx, d, load, quarantine)
            else:
                ref = front[front_idx].generate.remote(items)
                inflight[ref] = (items, front_idx, None, 0, quarantine)
            self.inflight = len(inflight)

        def route_window():
            """Route up to `router.window` ready rows (whole documents) into `routed`."""
            if not ready:
                return
            window_rows = []
            while ready and len(window_rows) < spec.router.window:
                window_rows.append(ready.popleft())
            # keep whole documents together: finish the last document's tasks
            while ready and window_rows and ready[0]["doc_id"] == window_rows[-1]["doc_id"]:
                window_rows.append(ready.popleft())
            normal = [r for r in window_rows if r["doc_id"] in docs]
            by_id = {f"{r['doc_id']}::{r['task']}": r for r in normal}
            reqs = [Request(rid, tuple(r["prompt_ids"]), int(r["max_tokens"]),
                            None if smp.temperature == 0 else make_sampling_key(rid, smp.temperature, smp.top_p,
                                                                                 smp.top_k, int(r["seed"])))
                    for rid, r in by_id.items()]
            routing = router.route(reqs) if reqs else []
            for kept, dups in getattr(routing, "fanout", {}).items():
                fanout.setdefault(kept, []).extend(dups)
            per_worker = []
            for w, lst in enumerate(routing):
                batches, batch, tokens = [], [], 0
                for req in lst:
                    r = by_id[req.request_id]
                    if batch and tokens + len(r["prompt_ids"]) > max_batch_tokens:
                        batches.append((batch, w))
                        batch, tokens = [], 0
                    batch.append(r)
                    tokens += len(r["prompt_ids"])
                if batch:
                    batches.append((batch, w))
                per_worker.append(batches)
            # interleave the workers' batches so that every worker gets work as slots free up
            for i in range(max((len(b) for b in per_worker), default=0)):
                routed.extend(b[i] for b in per_worker if i < len(b))

        def submit_routed():
            """Hand routed batches to the workers while fewer than max_inflight_batches per
            worker are in flight (the rest wait here, not in the workers' queues: documents
            then finish and commit in a steady stream, and a crash loses little)."""
            while routed and len(inflight) < inflight_cap:
                rows, w = routed.popleft()
                rows = [r for r in rows if r["doc_id"] in docs and not docs[r["doc_id"]].failed]
                if rows:
                    submit(items_for(rows), w)

        def run_suspect():
            """One suspect document alone, with nothing else in flight."""
            d_id, rows = suspects.popitem(last=False)
            doc = docs[d_id]
            lf = available(front_role, len(front))
            submit(items_for(rows), lf[doc.attempts % len(lf)], quarantine=True)

        fanout: dict[str, list[str]] = {}

        def handle_result(res: dict):
            rid = res["request_id"]
            targets = [rid] + fanout.pop(rid, [])
            for t in targets:
                doc_id, task = t.rsplit("::", 1)
                doc = docs.get(doc_id)
                if doc is None or doc.failed:
                    continue
                doc.results[task] = res
            self.gen.add(res, time.time())

        def fail_items(items, reason: str, etype: str):
            failed_docs = dict.fromkeys(it["request_id"].rsplit("::", 1)[0] for it in items)
            # requests folded onto a failed one (exact duplicates) failed with it
            for it in items:
                for t in fanout.pop(it["request_id"], []):
                    failed_docs.setdefault(t.rsplit("::", 1)[0], None)
            for d_id in failed_docs:
                doc = docs.get(d_id)
                if doc is None or doc.failed:
                    continue
                doc.attempts += 1
                self.retries += 1
                if doc.attempts >= max_attempts:
                    dead_letter(doc, "generate", etype,
                                f"failed on all {doc.attempts} attempts (retries.max_attempts={max_attempts}; "
                                f"a document that keeps crashing its worker is a poison pill); last error: {reason}")
                    continue
                doc.isolate = True
                missing = [r for r in doc.rows if r["task"] not in doc.results]
                suspects[d_id] = missing
                log.warning("retrying document %s alone (attempt %d/%d) after %s", d_id, doc.attempts + 1,
                            max_attempts, reason[:200])

        def note_crash(role: str, idx: int | None):
            """After a failed call: hold the worker until it answers a ping; is it gone for good?"""
            if idx is None or idx in dead[role]:
                return
            st = _actor_state(workers[role][idx])
            if st == "DEAD":  # (when the state cannot be read, the stall timeout bounds the wait)
                dead[role].add(idx)
                unhealthy.pop((role, idx), None)
                log.error("%s worker %d is dead and will not be restarted (state %s)", role, idx, st)
                return
            unhealthy.setdefault((role, idx), {"since": time.time(), "probe": None, "next": 0.0})

        def check_health():
            for key, h in list(unhealthy.items()):
                role, idx = key
                if idx in dead[role]:
                    unhealthy.pop(key, None)
                    continue
                if h["probe"] is None:
                    if time.time() >= h["next"]:
                        h["probe"] = workers[role][idx].ping.remote()
                    continue
                done_, _ = ray.wait([h["probe"]], timeout=0)
                if not done_:
                    continue
                try:
                    info = ray.get(h["probe"], timeout=10)
                except Exception as e:  # still restarting, or dead for good
                    h["probe"], h["next"] = None, time.time() + 1.0
                    if _actor_state(workers[role][idx]) == "DEAD":
                        dead[role].add(idx)
                        unhealthy.pop(key, None)
                        log.error("%s worker %d is dead and will not be restarted: %s", role, idx,
                                  brief(e))
                    continue
                unhealthy.pop(key, None)
                log.info("%s worker %d is back after %.1f s", role, idx, time.time() - h["since"])
                pid = info["pid"]
                if pid != self.worker_pids.get(key):  # Ray restarted it: a new process
                    self.worker_pids[key] = pid
                    if self.kv_via == "rdt" and pd:
                        regroup["needed"] = True
                        regroup["why"] = f"{role} worker {idx} restarted"

        def collect_done():
            nonlocal commit_docs, new_ok, prompt_tokens, output_tokens
            for d_id in [d for d, s in docs.items() if len(s.results) == K]:
                doc = docs.pop(d_id)
                suspects.pop(d_id, None)
                for r in doc.rows:
                    res = doc.results[r["task"]]
                    commit_rows.append({"doc_id": doc.doc_id, "source": r["source"], "task": r["task"],
                                        "output": res.get("output", ""), "prompt_tokens": len(r["prompt_ids"]),
                                        "output_tokens": res.get("output_tokens", 0),
                                        "finish_reason": res.get("finish_reason"), "truncated": bool(r["truncated"]),
                                        "model": spec.model.name, "ttft_s": res.get("ttft_s"),
                                        "latency_s": res.get("latency_s"), "text": r.get("text")})
                    prompt_tokens += len(r["prompt_ids"])
                    output_tokens += res.get("output_tokens", 0)
                    prompt_hist.append(len(r["prompt_ids"]))
                    output_hist.append(res.get("output_tokens", 0))
                commit_docs += 1
                new_ok += 1
                metrics.docs(ok=1)
                metrics.tokens(prompt=sum(len(r["prompt_ids"]) for r in doc.rows),
                               output=sum(doc.results[r["task"]].get("output_tokens", 0) for r in doc.rows))

        def flush(force=False):
            nonlocal commit_rows, commit_docs, error_rows, last_flush, rows_written
            if not force and commit_docs < self.flush_docs and time.time() - last_flush < self.flush_seconds:
                return
            if commit_rows:
                store.commit_results(commit_rows, spec.output.include_text)
                rows_written += len(commit_rows)
                commit_rows, commit_docs = [], 0
            if error_rows:
                store.commit_errors(error_rows)
                error_rows = []
            last_flush = time.time()
            self.timeline.append({"t": round(time.time() - t_start, 3), "docs_done": new_ok + new_failed,
                                  "tokens_done": prompt_tokens + output_tokens})

        def watchdog():
            nonlocal last_check, missing_since
            now = time.time()
            if now - last_check < 2.0:
                return
            last_check = now
            missing = self._missing_resources()
            missing_since = (missing_since or now) if missing else None
            if missing:
                log.warning("waiting for a node that provides %s (%.0f s of %.0f s)", ", ".join(missing),
                            now - missing_since, self.resource_timeout_s)
                if now - missing_since > self.resource_timeout_s:
                    raise JobFailed(self._no_resource_message(missing))
            waiting = [now - h["since"] for h in unhealthy.values()]
            if waiting and max(waiting) > self.stall_timeout_s:
                raise JobFailed(f"a worker has not come back for {max(waiting):.0f} s after a crash (stall_timeout "
                                f"{self.stall_timeout_s:.0f} s); committed output is intact: rerun to resume")
            if inflight and now - last_progress > self.stall_timeout_s:
                raise JobFailed(f"no batch finished or failed for {now - last_progress:.0f} s with {len(inflight)} "
                                f"in flight (stall_timeout {self.stall_timeout_s:.0f} s); committed output is "
                                f"intact: rerun to resume")

        try:
            while True:
                watchdog()
                # pull from the dataset while there is room
                while not exhausted and len(inflight) < inflight_cap and len(ready) < 2 * spec.router.window:
                    try:  # wait a little for input only when nothing else can progress
                        batch = batches.get(timeout=0.2 if not inflight and not ready and not suspects else 0.0)
                    except StopIteration:
                        exhausted = True
                        break
                    if batch is None:
                        break
                    for r in batch.to_pylist():
                        if r.get("error"):
                            doc = docs.setdefault(r["doc_id"], DocState(r["doc_id"], rows=[r]))
                            dead_letter(doc, r.get("stage") or "parse", r.get("error_type") or "Error", r["error"])
                            continue
                        doc = docs.setdefault(r["doc_id"], DocState(r["doc_id"]))
                        if any(x["task"] == r["task"] for x in doc.rows):
                            continue  # the same document twice in the input: computed once
                        doc.rows.append(r)
                        ready.append(r)
                        docs_seen += len(doc.rows) == 1
                        tokens_seen += len(r["prompt_ids"]) + int(r["max_tokens"])
                check_health()
                reform_rdt_group()
                if suspects:
                    if not inflight and can_submit():
                        run_suspect()
                elif len(inflight) < inflight_cap and can_submit():
                    submit_routed()
                    if not routed and len(inflight) < inflight_cap:
                        # a partial window is routed when the stream ended or a worker has room
                        route_window()
                        submit_routed()
                if not inflight:
                    if exhausted and not ready and not suspects and not routed:
                        break
                    if unhealthy or regroup["needed"]:
                        time.sleep(0.1)  # waiting for a worker to come back, or to re-form the RDT group
                    continue
                done, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
                for ref in done:
                    items, fi, di, load, _q = inflight.pop(ref)
                    self.inflight = len(inflight)
                    last_progress = time.time()
                    if di is not None:
                        dec_load[di] -= load
                    try:
                        results = ray.get(ref, timeout=60)
                    except Exception as e:  # worker died (restarted by Ray) or lost the KV payload
                        note_crash(front_role, fi)
                        if pd:
                            note_crash("decode", di)
                        fail_items(items, f"{type(e).__name__}: {brief(e, 300)}", "WorkerCrash")
                        continue
                    bad = [r for r in results if "error" in r]
                    for r in results:
                        if "error" not in r:
                            handle_result(r)
                    if bad:
                        fail_items([it for it in items if it["request_id"] in {b["request_id"] for b in bad}],
                                   bad[0]["error"], "EngineError")
                collect_done()
                flush()
                metrics.inflight(len(inflight))
                progress.update(docs_done=self.already_done + self.already_failed + new_ok + new_failed,
                                tokens=prompt_tokens + output_tokens,
                                remaining_tokens=self._remaining_tokens(docs, new_ok + new_failed, docs_seen,
                                                                        tokens_seen))
        except BaseException:
            # commit every document that is complete before giving up; never a partial one
            try:
                collect_done()
                flush(force=True)
            except Exception as e2:  # the original error is the one to report
                log.error("could not commit finished documents while failing: %s", e2)
            raise
        collect_done()
        flush(force=True)
        progress.close()
        stats = {}
        try:
            stats = {role: ray.get([w.stats.remote() for w in ws], timeout=60) for role, ws in workers.items()}
        except Exception as e:  # the report must not fail a finished job
            log.warning("could not collect worker stats: %s", e)
        wall_now = max(1e-9, time.time() - t_start)
        for role, sts in stats.items():
            for i, st in enumerate(sts):
                metrics.worker_busy(role, i, st.get("busy_s", 0.0) / wall_now)
        report = self._finish(store, t_start, stats, new_ok, new_failed, rows_written,
                              prompt_tokens=prompt_tokens, output_tokens=output_tokens, prompt_hist=prompt_hist,
                              output_hist=output_hist, router=router.stats.to_dict())
        store.write_json("_manifest.json", {**(store.read_json("_manifest.json") or {}), "complete": True,
                                            "inputs": sig})
        return report

    # ------------------------------------------------------------------------------------
    def _progress(self):
        from dlbatch.progress import Progress

        return Progress(self.spec.name, total_docs=self.docs_total_hint,
                        initial_docs=self.already_done + self.already_failed, tty=self.progress)

    def _remaining_tokens(self, docs: dict, finished: int, docs_seen: int, tokens_seen: int) -> int | None:
        """Tokens left: open requests exactly, documents not tokenized yet at the mean so far."""
        from dlbatch.progress import remaining_tokens

        open_docs = [d for d in docs.values() if not d.failed]
        open_rows = [(len(r["prompt_ids"]), int(r["max_tokens"])) for d in open_docs for r in d.rows
                     if r["task"] not in d.results]
        if not docs_seen:
            return None
        if self.docs_total_hint is None:  # a table input: only what is tokenized is known
            return sum(p + m for p, m in open_rows)
        unseen = self.docs_total_hint - self.already_done - self.already_failed - finished - len(open_docs)
        return remaining_tokens(open_rows, unseen, tokens_seen / docs_seen)

    def _finish(self, store, t_start, stats, new_ok, new_failed, rows, prompt_tokens=0, output_tokens=0,
                prompt_hist=(), output_hist=(), router=None, noop_docs=False) -> dict:
        from connectors.io_retry import retry_count

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
            "timeline": self.timeline, "prompt_token_hist": list(prompt_hist), "output_token_hist": list(output_hist),
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

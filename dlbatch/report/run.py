"""The report of one run: what it committed (`Tally`), where its time went (`RunReport`).

`Tally` counts this run's committed documents, rows and tokens (sums and histograms for the
report, the metrics and the progress line). `RunReport` owns the run's clocks: the start-up
intervals before the first token (`StartupClock`), the tokens by the time workers generated
them (`GenerationTimeline`), one point per commit; at the end, `finish` writes
``_report.json`` and the HTML/PNG report next to the output. Plain objects: the driver hands
them numbers; nothing here knows Ray, workers or the dispatcher.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

from dlbatch.report.timeline import GenerationTimeline, StartupClock

log = logging.getLogger("dlbatch.run")


class Sample:
    """A uniform sample of at most ``size`` of the values added (reservoir sampling, seeded):
    the report's token histograms cost the same memory for a thousand rows or a billion."""

    def __init__(self, size: int = 10_000, seed: int = 0):
        import random

        self.size, self.seen, self.values = size, 0, []
        self._rng = random.Random(seed)

    def __iadd__(self, values) -> "Sample":
        for v in values:
            self.seen += 1
            if len(self.values) < self.size:
                self.values.append(v)
            else:
                j = self._rng.randrange(self.seen)
                if j < self.size:
                    self.values[j] = v
        return self

    def __iter__(self):
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)


@dataclass
class Tally:
    """What this run committed, for the report, the metrics and the progress line."""

    metrics: object  # dlbatch.report.metrics.JobMetrics
    progress: object  # dlbatch.report.progress.Progress: the bar on a terminal, else a log line every 30 s
    already: int = 0  # documents done or failed before this run
    new_ok: int = 0
    new_failed: int = 0
    rows_written: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    prompt_hist: Sample = field(default_factory=Sample)  # tokens per request, sampled: bounded memory
    output_hist: Sample = field(default_factory=Sample)
    # documents by the long-input policy applied to them ("fit": none was needed; "skip": dead-lettered)
    policies: collections.Counter = field(default_factory=collections.Counter)

    @property
    def finished(self) -> int:
        return self.new_ok + self.new_failed

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

    def docs_failed(self, dead: list[dict]) -> None:
        self.policies["skip"] += sum(e.get("error_type") == "LongInput" for e in dead)
        self.new_failed += len(dead)
        self.metrics.docs(failed=len(dead))

    def show(self, inflight: int, remaining_tokens: int | None) -> None:
        self.metrics.inflight(inflight)
        self.progress.update(docs_done=self.already + self.finished, tokens=self.prompt_tokens + self.output_tokens,
                             remaining_tokens=remaining_tokens)


class RunReport:
    """Clocks and counts of one run, and the report written when it ends."""

    def __init__(self, spec, plan: dict | None, t_start: float, already_done: int = 0, already_failed: int = 0,
                 startup: StartupClock | None = None):
        self.spec, self.plan, self.t_start = spec, plan, t_start
        self.already_done, self.already_failed = already_done, already_failed
        self.inputs_deleted: list[str] = []  # sources with committed rows that the input no longer lists
        self.inputs_replaced: list[str] = []  # inputs whose content changed: old rows superseded, redone
        self.rows_edited = 0  # documents of table inputs edited since committed: old rows superseded, redone
        self.startup = startup or StartupClock(t_start)  # where the time before the first token went
        self.gen = GenerationTimeline(t_start)  # tokens by the time workers generated them
        self.commits: list[dict] = []  # one point per commit: the commit-time timeline
        self.first_batch_at: float | None = None  # when the input pipeline's first batch came out
        self.layout = None  # dlbatch.driver.layout.Layout of the pools that ran (None: none started)
        self._note_process_start()

    # ---- during the run ----------------------------------------------------------------------
    def _note_process_start(self) -> None:
        """The driver process's own start-up (interpreter, imports, job file) before the run."""
        try:
            import psutil

            self.startup.span("driver_process", psutil.Process().create_time(), self.t_start)
        except Exception:  # psutil missing or /proc unreadable: the breakdown does without
            pass

    def note_worker_startup(self, infos: list[dict]) -> None:
        """Worker processes' start (Ray starts a Python process, imports) and model load, from
        the workers' first pings (``t_process``, ``t_init``, ``t_ready``)."""
        procs = [i["t_process"] for i in infos if i.get("t_process")]
        inits = [i["t_init"] for i in infos if i.get("t_init")]
        readies = [i["t_ready"] for i in infos if i.get("t_ready")]
        if procs and inits:
            self.startup.span("worker_process", min(procs), max(inits))
        if inits and readies:
            self.startup.span("model_load", min(inits), max(readies))

    def note_results(self, results: list[dict], received: float) -> None:
        for res in results:
            self.gen.add(res, received)

    def note_commit(self, tally: Tally) -> None:
        self.commits.append({"t": round(time.time() - self.t_start, 3), "docs_done": tally.finished,
                             "tokens_done": tally.prompt_tokens + tally.output_tokens})

    # ---- at the end ------------------------------------------------------------------------------
    def finish(self, store, tally: Tally | None = None, *, stats: dict | None = None, router: dict | None = None,
               dispatch: dict | None = None, retries: dict | None = None, compaction: dict | None = None,
               long_inputs: dict | None = None, kv_transport: str | None = None, rdt_regroups: int = 0,
               orphans: dict | None = None) -> dict:
        """The report dict, written to ``_report.json`` (and rendered as HTML/PNG) in ``store.files``.
        ``stats``: the workers' ``stats()`` by role; ``orphans``: the parts a process committed
        after it lost the lease, moved aside by this run (dlbatch/output/fence.py)."""
        stats = stats or {}
        t_finish = time.time()
        wall = t_finish - self.t_start
        new_ok, new_failed = (tally.new_ok, tally.new_failed) if tally else (0, 0)
        prompt_tokens, output_tokens = (tally.prompt_tokens, tally.output_tokens) if tally else (0, 0)
        tokens = prompt_tokens + output_tokens
        pools, prefill_computed, cached = {}, 0, 0
        layout_pools = self.layout.pools if self.layout is not None else {}
        for role, sts in stats.items():
            busy = [s.get("busy_s", 0.0) / max(wall, 1e-9) for s in sts]
            pool = layout_pools.get(role)
            pools[role] = {"replicas": len(sts), "chip": pool.chip if pool else None,
                           "busy_fraction": round(sum(busy) / max(1, len(busy)), 4),
                           "per_worker_busy": [round(b, 4) for b in busy]}
            if role in ("prefill", "colocated"):
                prefill_computed += sum(s.get("prefill_tokens_computed", 0) for s in sts)
                cached += sum(s.get("prefix_hit_tokens", 0) for s in sts)
        report = {
            "job": self.spec.name, "backend": self.spec.model.backend, "docs_total": self.already_done + self.already_failed + new_ok + new_failed,
            "docs_ok": self.already_done + new_ok, "docs_failed": self.already_failed + new_failed,
            "docs_this_run": new_ok + new_failed, "rows_written": tally.rows_written if tally else 0,
            "prompt_tokens": prompt_tokens, "prefill_tokens_computed": prefill_computed,
            "prefix_cache_hit_tokens": cached, "output_tokens": output_tokens, "wall_s": round(wall, 3),
            "docs_per_s": round((new_ok + new_failed) / wall, 4) if wall > 0 else 0.0,
            "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "plan": self.plan or {"pools": [{"role": r, "chip": p.chip, "replicas": p.replicas}
                                            for r, p in layout_pools.items()]},
            "pools": pools, "kv_transport": kv_transport if "prefill" in pools else None,
            "rdt_regroups": rdt_regroups, "router": router or {}, "retries": retries or {"worker": 0, "io": 0},
            "dispatch": dispatch or {}, "timeline": self.commits,
            "prompt_token_hist": list(tally.prompt_hist) if tally else [],
            "output_token_hist": list(tally.output_hist) if tally else [],
            "compaction": compaction or {}, "long_inputs": long_inputs or {},
            "orphans": orphans or {"count": 0, "parts": []},
            "inputs_deleted": {"count": len(self.inputs_deleted), "sources": self.inputs_deleted[:100]},
            "inputs_replaced": {"count": len(self.inputs_replaced), "sources": self.inputs_replaced[:100]},
            "rows_edited": self.rows_edited,
        }
        report.update(self._startup_report())
        if self.layout is not None:  # which layout ran, how it was chosen, expected beside measured
            report["layout"] = {**self.layout.to_dict(),
                                "measured": {"docs_per_s": report["docs_per_s"], "tokens_per_s": report["tokens_per_s"]}}
        usd_h = self.layout.usd_per_hour if self.layout is not None else None
        if usd_h:
            usd_h = float(usd_h)
            report["cost"] = {"usd_per_hour": usd_h, "usd_total": round(usd_h * wall / 3600, 6),
                              "usd_per_million_tokens": round(usd_h * wall / 3600 / max(tokens, 1) * 1e6, 6)}
        store.files.write_json("_report.json", report)
        t_render = time.time()
        try:
            from dlbatch.report.html import render_report

            render_report(report, store.files.url, store.files.storage_options)
        except Exception as e:  # pragma: no cover - a report figure must not fail the job
            log.warning("could not render the HTML report: %s", e)
        log.info("start-up: %s; report written in %.1f s (job stats %.1f s)", startup_line(report),
                 time.time() - t_render, t_render - t_finish)
        return report

    def _startup_report(self) -> dict:
        """`startup` (intervals before the first token) and `generation` (tokens by the time
        workers generated them) sections of the report."""
        if self.first_batch_at is not None and "data_plan" in self.startup.intervals:
            self.startup.span("data_first_batch", self.startup.t0 + self.startup.intervals["data_plan"][0],
                              self.first_batch_at)
        if self.gen.first_token is not None:
            self.startup.span("generation", self.gen.first_token, self.gen.last_done)
        return {"startup": self.startup.to_dict(self.gen.first_token), "generation": self.gen.to_dict()}


def startup_line(report: dict) -> str:
    st = report.get("startup") or {}
    parts = [f"{k} {v:.1f} s" for k, v in (st.get("phases_s") or {}).items()]
    if st.get("to_first_token_s") is not None:
        parts.append(f"first token {st['to_first_token_s']:.1f} s after the process started")
    return ", ".join(parts) or "no timings"

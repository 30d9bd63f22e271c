"""Prometheus-style metrics of a running job through `ray.util.metrics`.

Ray exports them on each node's metrics port (`ray start --metrics-export-port`), where
Prometheus scrapes them and the Ray dashboard's Grafana panels can show them; names get
Ray's `ray_` prefix (`ray_dlbatch_docs_done_total`, ...). Every metric carries the tag
`job` (the job's name); worker metrics also carry `role` (prefill / decode / colocated).

Everything here is a no-op when Ray is not initialised in this process, or when
`ray.util.metrics` is unavailable, so the runner can call it unconditionally:

    metrics = JobMetrics(spec.name)          # in the driver, after Ray is up
    metrics.docs(ok=1)                       # per committed document (collect_done)
    metrics.docs(failed=1)                   # per dead-lettered document
    metrics.tokens(prompt=n, output=m)       # per committed document
    metrics.inflight(len(inflight))          # each loop turn
    metrics.worker_busy("decode", 0, 0.73)   # from the workers' stats(), when polled
"""
from __future__ import annotations

import logging

log = logging.getLogger("dlbatch.report.metrics")

_DEFINITIONS = {
    # name: (kind, description, tag keys)
    "dlbatch_docs_done": ("counter", "documents committed", ("job",)),
    "dlbatch_docs_failed": ("counter", "documents dead-lettered", ("job",)),
    "dlbatch_prompt_tokens": ("counter", "prompt tokens of committed documents", ("job",)),
    "dlbatch_output_tokens": ("counter", "generated tokens of committed documents", ("job",)),
    "dlbatch_requests_inflight": ("gauge", "request batches in flight on the workers", ("job",)),
    "dlbatch_worker_busy_fraction": ("gauge", "fraction of wall time a worker spent computing",
                                     ("job", "role", "worker")),
}


def _ray_ready() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except Exception:  # ray missing or broken: metrics are optional
        return False


class JobMetrics:
    """The job's metrics; each method is a cheap no-op when Ray is not initialised."""

    def __init__(self, job: str):
        self.job = str(job)
        self._metrics: dict[str, object] = {}
        self.enabled = _ray_ready()
        if not self.enabled:
            return
        try:
            from ray.util import metrics as rm

            for name, (kind, desc, tags) in _DEFINITIONS.items():
                cls = rm.Counter if kind == "counter" else rm.Gauge
                self._metrics[name] = cls(name, description=desc, tag_keys=tags)
        except Exception as e:  # a metrics backend problem must never fail a job
            log.debug("metrics disabled: %s", e)
            self.enabled = False
            self._metrics = {}

    def _record(self, name: str, value: float, **tags) -> None:
        m = self._metrics.get(name)
        if m is None:
            return
        try:
            tags = {"job": self.job, **{k: str(v) for k, v in tags.items()}}
            if isinstance(m, _counter_cls()):
                if value > 0:
                    m.inc(value, tags=tags)
            else:
                m.set(value, tags=tags)
        except Exception as e:
            log.debug("metric %s not recorded: %s", name, e)

    def docs(self, ok: int = 0, failed: int = 0) -> None:
        self._record("dlbatch_docs_done", ok)
        self._record("dlbatch_docs_failed", failed)

    def tokens(self, prompt: int = 0, output: int = 0) -> None:
        self._record("dlbatch_prompt_tokens", prompt)
        self._record("dlbatch_output_tokens", output)

    def inflight(self, n: int) -> None:
        self._record("dlbatch_requests_inflight", n)

    def worker_busy(self, role: str, worker: int, fraction: float) -> None:
        self._record("dlbatch_worker_busy_fraction", fraction, role=role, worker=worker)


def _counter_cls():
    from ray.util.metrics import Counter

    return Counter

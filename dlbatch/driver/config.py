"""The configuration of one run, resolved once from the job (and a plan, when given).

`RunConfig.resolve(spec, plan)` does, once, what every part of a run depends on: the
backend class the job names (`dlbatch.backends.REGISTRY`) and its checks of the model
section against the model's ``config.json`` (installed, engine_args, architecture, an
explicit context), the context length (``max_model_len``: the backend's one rule,
`EngineBackend.limits`), every task's token budget against it, the layout
(`dlbatch.driver.layout`: the job's named pools, a plan's, or the solver's on the chips at
hand) and the worker pools by role with what each worker builds (`WorkerSpec`, from the
backend's `worker_spec`). The result is frozen and passed down: the
runner gives the same ``max_model_len`` to the prompt stage and the same worker specs to
the pools, `dlbatch validate` and `dlbatch plan` read the same value, so the prompts are cut
to the context the engines are built with.

Invariants: resolving reads the model's config.json (no weights; a GGUF is converted once,
a Hub id resolved from the cache); it raises, naming the bad value, for anything that would
fail the run later (ValueError: `BackendUnavailable`, `JobSpecError`; `JobFailed` for pools
a backend cannot fill).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from dlbatch.backends import BackendUnavailable, EngineBackend, WorkerSpec, backend_class
from dlbatch.backends.base import PD_ROLES
from dlbatch.driver.layout import Layout, resolve_layout
from dlbatch.workers.pools import JobFailed


@dataclass(frozen=True)
class PoolConfig:
    """One pool of the run: where its workers go (a chip resource, how many, the Ray
    resources of each) and what each of them builds (``worker``)."""

    role: str
    chip: str
    replicas: int
    device: str
    num_cpus: float
    num_gpus: float
    worker: WorkerSpec


@dataclass(frozen=True)
class RunConfig:
    """What a run is, decided once: the job, its backend class, the context length every
    stage uses and where it comes from, the layout (`dlbatch.driver.layout.Layout`: the
    pools and who chose them) and the pools by role. ``layout`` None: an attached cluster's
    auto layout, decided once the driver sees the cluster's chips (`with_chips`)."""

    job: Any  # the validated JobSpec
    backend: type[EngineBackend]
    max_model_len: int
    context_source: str  # where max_model_len comes from, for messages ("model.max_model_len", ...)
    roles: tuple[str, ...] = ("colocated",)  # the worker roles the backend fills for this model
    layout: Layout | None = None
    pools: Mapping[str, PoolConfig] = field(default_factory=dict)

    @property
    def pd(self) -> bool:
        """Prefill and decode pools (KV moves between them), not colocated ones."""
        return "prefill" in self.pools

    @classmethod
    def resolve(cls, spec, plan: dict | None = None, chips: dict | None = None) -> "RunConfig":
        """The run's configuration for job ``spec`` (a validated JobSpec), ``plan`` (the
        solver's pools, or None) and ``chips`` (the attached cluster's chip slots by name, or
        None: see `dlbatch.driver.layout.resolve_layout`)."""
        from dlbatch.engine.loader import load_hf_config
        from dlbatch.jobspec import JobSpecError, token_budget_problems

        backend = backend_class(spec.model.backend)
        why = backend.unavailable_reason()
        if why:
            raise BackendUnavailable(why)
        hf_config = load_hf_config(spec.model.ref)
        backend.check_model(spec.model, hf_config)
        limits = backend.limits(spec.model, hf_config)
        problems = token_budget_problems(spec, limits)
        if problems:
            raise JobSpecError(spec.source, problems)
        config = cls(job=spec, backend=backend, max_model_len=limits.max_model_len, context_source=limits.source,
                     roles=tuple(limits.roles))
        return config.with_layout(resolve_layout(spec, backend, config.roles, plan, chips,
                                                 max_model_len=limits.max_model_len))

    def with_chips(self, chips: dict) -> "RunConfig":
        """This configuration with the solver's layout on the attached cluster's ``chips``."""
        return self.with_layout(resolve_layout(self.job, self.backend, self.roles, None, chips,
                                               max_model_len=self.max_model_len))

    def with_layout(self, layout: Layout | None) -> "RunConfig":
        """This configuration with ``layout``'s pools and what each of their workers builds."""
        if layout is None:
            return replace(self, layout=None, pools={})
        sections, spec = layout.pools, self.job
        missing = [r for r in ("colocated", *PD_ROLES) if r in sections and r not in self.roles]
        if missing:
            where = {"plan": f"plan {[p.chip for p in sections.values()]}", "job": "the job's cluster section",
                     "solver": "the solver's layout"}[layout.source]
            raise JobFailed(f"{where} has {'/'.join(missing)} pools, which "
                            f"model.backend {self.backend.name} cannot run ({'/'.join(self.roles)} only; "
                            "docs/backends.md)")
        pools = {}
        for role, p in sections.items():
            self.backend.check_pool(spec.model, role, p)  # a plan's or the solver's pools too
            worker = self.backend.worker_spec(spec.model, p, max_model_len=self.max_model_len,
                                              max_batch_tokens=spec.batching.max_batch_tokens,
                                              num_threads=worker_threads(p, len(sections)))
            pools[role] = PoolConfig(role=role, chip=p.chip, replicas=p.replicas, device=p.device,
                                     num_cpus=p.num_cpus, num_gpus=p.num_gpus, worker=worker)
        return replace(self, layout=layout, pools=pools)


def worker_threads(pool, n_pools: int) -> int:
    """Torch threads of one worker of ``pool``: on a CPU its CPUs (at least 1; a run's only
    pool takes at least 2 where the machine has them), on an accelerator 1."""
    if pool.device != "cpu":
        return 1
    threads = max(1, int(round(pool.num_cpus)))
    if n_pools == 1:
        threads = max(threads, min(2, os.cpu_count() or 1))
    return threads

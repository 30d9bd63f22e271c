"""The configuration of one run, resolved once from the job (and a plan, when given).

`RunConfig.resolve(spec, plan)` does, once, what every part of a run depends on: the
backend class the job names (`dlbatch.backends.REGISTRY`) and its checks of the model
section against the model's ``config.json`` (installed, engine_args, architecture, an
explicit context), the context length (``max_model_len``: the backend's one rule,
`EngineBackend.limits`), every task's token budget against it, the worker pools by role
(the job's cluster section, or the plan's pools on its chips) with what each worker builds
(`WorkerSpec`, from the backend's `worker_spec`). The result is frozen and passed down: the
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
from dataclasses import dataclass, field
from typing import Any, Mapping

from dlbatch.backends import BackendUnavailable, EngineBackend, WorkerSpec, backend_class
from dlbatch.backends.base import PD_ROLES
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
    stage uses and where it comes from, the pools by role."""

    job: Any  # the validated JobSpec
    backend: type[EngineBackend]
    max_model_len: int
    context_source: str  # where max_model_len comes from, for messages ("model.max_model_len", ...)
    pools: Mapping[str, PoolConfig] = field(default_factory=dict)

    @property
    def pd(self) -> bool:
        """Prefill and decode pools (KV moves between them), not colocated ones."""
        return "prefill" in self.pools

    @classmethod
    def resolve(cls, spec, plan: dict | None = None) -> "RunConfig":
        """The run's configuration for job ``spec`` (a validated JobSpec) and ``plan`` (the
        solver's pools, or None: the job's cluster section)."""
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
        sections = pools_of(spec, plan)
        missing = [r for r in ("colocated", *PD_ROLES) if r in sections and r not in limits.roles]
        if missing:
            where = f"plan {plan.get('pools')}" if plan is not None else "the job's cluster section"
            raise JobFailed(f"{where} has {'/'.join(missing)} pools, which model.backend {backend.name} cannot run "
                            f"({'/'.join(limits.roles)} only; docs/backends.md)")
        pools = {}
        for role, p in sections.items():
            worker = backend.worker_spec(spec.model, p, max_model_len=limits.max_model_len,
                                         max_batch_tokens=spec.batching.max_batch_tokens,
                                         num_threads=worker_threads(p, len(sections)))
            pools[role] = PoolConfig(role=role, chip=p.chip, replicas=p.replicas, device=p.device,
                                     num_cpus=p.num_cpus, num_gpus=p.num_gpus, worker=worker)
        return cls(job=spec, backend=backend, max_model_len=limits.max_model_len, context_source=limits.source,
                   pools=pools)


def pools_of(spec, plan: dict | None) -> dict:
    """role -> the job's pool section (`PoolSpec`): the job's cluster section, or the plan's
    pools on its chips (each keeping the device and resources of the job's pool of its role,
    the prefill pool's when the job has none of that role)."""
    c = spec.cluster
    pools = c.pools()
    if plan is None:
        return pools
    from dlbatch.jobspec import PoolSpec

    out = {}
    for p in plan.get("pools", []):
        base = pools.get(p["role"]) or c.prefill
        out[p["role"]] = PoolSpec(chip=p.get("chip_resource") or base.chip, replicas=int(p["replicas"]),
                                  device=base.device, num_cpus=base.num_cpus, num_gpus=base.num_gpus,
                                  kv_cache_memory=base.kv_cache_memory)
    if "colocated" in out and ("prefill" in out or "decode" in out):
        raise JobFailed("plans that mix colocated and PD pools are run as PD only on this version: "
                        f"{plan.get('pools')}")
    return out


def worker_threads(pool, n_pools: int) -> int:
    """Torch threads of one worker of ``pool``: on a CPU its CPUs (at least 1; a run's only
    pool takes at least 2 where the machine has them), on an accelerator 1."""
    if pool.device != "cpu":
        return 1
    threads = max(1, int(round(pool.num_cpus)))
    if n_pools == 1:
        threads = max(threads, min(2, os.cpu_count() or 1))
    return threads

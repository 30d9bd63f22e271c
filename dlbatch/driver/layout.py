"""The pools a run starts and how they were chosen (`Layout`).

Three sources, in this order (`resolve_layout`):

* **a plan** (``dlbatch run --plan FILE`` or ``cluster.plan: <path>``): the plan's pools on
  its chips, each with the device and resources of the job's pool of its role, when the job
  names one (`pools_of`);
* **the job's pools** (``cluster.colocated``, or ``cluster.prefill`` with ``cluster.decode``):
  exactly those;
* **the solver** (no pools named, ``cluster.plan`` null or ``auto``): the chips
  (`dlbatch.driver.chips`: this machine's for a local run, the cluster's ``chip:`` resources
  for an attached one) decide. One chip type: colocated on every chip, nothing measured
  (`dlbatch.solver.layout`: PD can only tie there). Several: the job's first documents are
  measured (`job_workload`) and `choose_layout` picks colocated or prefill/decode pools by
  ``cluster.objective`` (or ``cluster.ttft_target_s``), simulated.

An attached cluster's chips are known once the driver is attached: `resolve_layout` then
returns None before (the runner asks again with the cluster's chips, `RunConfig.with_chips`).

Workers the solver places: one ``chip:<name>`` unit each, ``num_cpus`` 1, on the chip's
device (`chip_device`), with the backend's devices per replica as ``num_gpus`` off the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

SAMPLE_DOCS = 16  # documents measured when several chip types must be weighed


@dataclass(frozen=True)
class Layout:
    """The run's pools by role (job `PoolSpec` sections), who chose them (``source``: "job",
    "plan" or "solver"), why, and what the solver expected of them (None: not estimated)."""

    pools: Mapping[str, Any]
    source: str
    reason: str
    chips: Mapping[str, int] = field(default_factory=dict)
    expected: Mapping[str, float] | None = None
    alternatives: tuple = ()
    usd_per_hour: float | None = None

    @property
    def mode(self) -> str:
        return "pd" if "prefill" in self.pools else "colocated"

    def to_dict(self) -> dict[str, Any]:
        """The report's ``layout`` section."""
        return {"mode": self.mode, "chosen_by": self.source, "reason": self.reason,
                "pools": [{"role": r, "chip": p.chip, "replicas": p.replicas, "device": p.device}
                          for r, p in self.pools.items()],
                "chips": dict(self.chips), "expected": dict(self.expected) if self.expected else None,
                "alternatives": list(self.alternatives)}


def resolve_layout(spec, backend, roles: tuple[str, ...], plan: dict | None = None, chips: dict | None = None, *,
                   max_model_len: int) -> Layout | None:
    """The layout of job ``spec`` for ``backend`` (its class; ``roles`` the roles it fills).
    ``chips``: name -> slots of the cluster (None: this machine's for a local run; for an
    attached cluster None gives None: its chips are not known yet)."""
    if plan is not None:
        expected = {k: plan[k] for k in ("docs_per_s", "tokens_per_s") if isinstance(plan.get(k), (int, float))}
        return Layout(pools=pools_of(spec, plan), source="plan", reason="the plan file's pools",
                      expected=expected or None, usd_per_hour=plan.get("usd_per_hour"))
    named = spec.cluster.pools()
    if named:
        return Layout(pools=named, source="job", reason="the pools the job names")
    from dlbatch.driver.chips import local_chips

    if chips is None:
        if spec.cluster.address is not None:
            return None
        chips = local_chips(spec.model.name)
    chips = {k: int(n) for k, n in chips.items() if n >= 1}
    if not chips:
        raise ValueError("no chip to place workers on: the cluster's nodes declare no chip:<name> resource (start "
                         "them with e.g. ray start --resources='{\"chip:h100_sxm\": 8}'), or name the pools in the job")
    choice = _choose(spec, chips, roles, max_model_len)
    return Layout(pools=_pool_sections(spec, backend, choice.pools), source="solver", reason=choice.reason,
                  chips=chips, expected=choice.expected,
                  alternatives=tuple(c.to_dict() for c in choice.candidates),
                  usd_per_hour=choice.expected.get("usd_per_hour") if choice.expected else None)


def _choose(spec, chips: dict[str, int], roles: tuple[str, ...], max_model_len: int):
    """`LayoutChoice` for the job on ``chips``: the one-type rule, or the solver on the
    measured workload."""
    from dlbatch.driver.chips import chip_device, chip_profiles
    from dlbatch.solver.layout import choose_layout, colocated_everywhere

    for name in chips:
        chip_device(name, spec.model.name)  # every chip has a profile (or is this machine's CPU)
    if len(chips) == 1:
        (name, n), = chips.items()
        return colocated_everywhere(name, n)
    from dlbatch.driver.workload import job_workload

    sample = job_workload(spec, sample=SAMPLE_DOCS, max_model_len=max_model_len)
    profiles = chip_profiles(chips, sample.model)
    return choose_layout(profiles, chips, sample.model, sample.workload, objective=spec.cluster.objective,
                         ttft_target_s=spec.cluster.ttft_target_s, roles=roles, max_batch=max_num_seqs(spec),
                         chunk_tokens=max(512, min(spec.batching.max_batch_tokens, 4096)))


def max_num_seqs(spec) -> int:
    """Sequences one worker runs at once: the job's ``model.engine_args.max_num_seqs`` (both
    backends take it), else the engine's default."""
    from dlbatch.engine.config import DEFAULT_MAX_NUM_SEQS

    n = (spec.model.engine_args or {}).get("max_num_seqs")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else DEFAULT_MAX_NUM_SEQS


def _pool_sections(spec, backend, pools: list[tuple[str, str, int]]) -> dict:
    """role -> `PoolSpec` of the solver's ``(role, chip, replicas)``."""
    from dlbatch.driver.chips import chip_device
    from dlbatch.jobspec import PoolSpec

    out = {}
    for role, chip, n in pools:
        device = chip_device(chip, spec.model.name)
        gpus = 0.0 if device == "cpu" else float(backend.devices_per_replica(spec.model))
        out[role] = PoolSpec(chip=chip, replicas=n, device=device, num_cpus=1.0, num_gpus=gpus)
    return out


def pools_of(spec, plan: dict) -> dict:
    """role -> the pool section (`PoolSpec`) of each pool of ``plan`` on its chip, keeping the
    device and resources of the job's pool of that role (the prefill pool's when the job names
    none of that role; the defaults when it names no pool)."""
    from dlbatch.jobspec import PoolSpec
    from dlbatch.workers.pools import JobFailed

    named = spec.cluster.pools()
    out = {}
    for p in plan.get("pools", []):
        base = named.get(p["role"]) or named.get("prefill") or PoolSpec(chip=p.get("chip_resource") or p["chip"])
        out[p["role"]] = PoolSpec(chip=p.get("chip_resource") or base.chip, replicas=int(p["replicas"]),
                                  device=base.device, num_cpus=base.num_cpus, num_gpus=base.num_gpus,
                                  kv_cache_memory=base.kv_cache_memory)
    if "colocated" in out and ("prefill" in out or "decode" in out):
        raise JobFailed("plans that mix colocated and PD pools are run as PD only on this version: "
                        f"{plan.get('pools')}")
    if not out:
        raise JobFailed(f"the plan has no pools: {plan.get('pools')!r}")
    return out

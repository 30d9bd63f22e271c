"""The layout a job runs on: colocated pools, or prefill/decode pools, and how many of each.

`choose_layout` answers it from chip profiles, the model and the workload (plain objects,
no engine, no Ray):

* **One chip type**: colocated workers on every chip, without solving anything. A
  colocated worker does ``Tp`` of prefill plus ``Td`` of decode per document, rate
  ``1/(Tp+Td)``; a perfectly balanced PD pair of the same chip does the same work on two
  workers, ``1/(Tp+Td)`` per worker, so PD can only tie, and loses to whole-worker rounding
  and to moving the KV (docs/solver.md). Measured here: on two identical cores the PD pools
  are about 1.5x slower than one colocated pool.
* **Several chip types**: two candidates, each the MILP's best plan with one chip type per
  role (`solve(..., one_chip_per_role=True)`: one pool per role, what the runner runs):
  colocated pools only, and prefill + decode pools (on one chip type or two: the MILP picks
  the chips and the ratio). Each candidate is simulated (`simulate`) on the job's workload;
  the layout is the better one by the job's objective on the simulated figures: documents/s
  per dollar-hour (``cost``) or documents/s (``throughput``). PD must win by more than
  ``MIN_GAIN`` (2%): otherwise colocated, which has fewer moving parts.
* **A TTFT target** (seconds from a document's prefill start to its first token, `ttft_s`)
  keeps only the candidates whose estimate meets it; when none does, the lowest estimate
  wins and the reason says so.

`ttft_s` estimates: on a prefill worker, its prefill ``Tp`` plus the KV's transfer over the
slower of the two links; on a colocated worker, ``Tp`` plus one decode step of the running
batch per prefill chunk (the chunks take turns with the decode steps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from dlbatch.solver.capacity import ROLES, role_rates
from dlbatch.solver.milp import Plan, SolverError, solve
from dlbatch.solver.profile import ChipProfile, ModelSpec
from dlbatch.solver.workload import Workload

# sequences per worker when the caller names none: the engine's default max_num_seqs
# (dlbatch.engine.config.DEFAULT_MAX_NUM_SEQS; the solver imports no engine, a test keeps the two equal)
DEFAULT_MAX_BATCH = 128

MIN_GAIN = 0.02  # PD must beat colocated by more than this to be chosen
SIM_DOCS = 2000  # documents simulated per candidate (the job's, when fewer)
OBJECTIVES = ("cost", "throughput")
ONE_TYPE_REASON = ("one chip type: colocated on every chip (a colocated worker's rate 1/(Tp+Td) equals a balanced "
                   "prefill/decode pair's rate per worker, so PD can only tie, and loses to whole-worker rounding and "
                   "to moving the KV; nothing measured)")


@dataclass
class Candidate:
    """One layout the solver weighed: its MILP plan (None when infeasible: ``error``), the
    simulator's figures and the TTFT estimate."""

    mode: str  # "colocated" | "pd"
    plan: Plan | None = None
    sim_docs_per_s: float = 0.0
    sim_tokens_per_s: float = 0.0
    ttft_s: float = math.inf
    error: str = ""

    @property
    def usd_per_hour(self) -> float:
        return self.plan.cost_per_hour if self.plan is not None else 0.0

    def score(self, objective: str) -> float:
        """The objective on the simulated figures: documents/s per dollar-hour, or documents/s."""
        if self.plan is None:
            return -math.inf
        if objective == "cost" and self.usd_per_hour > 0:
            return self.sim_docs_per_s / self.usd_per_hour
        return self.sim_docs_per_s

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mode": self.mode}
        if self.plan is None:
            return {**d, "error": self.error}
        p = self.plan
        return {**d, "pools": [{"role": x.role, "chip": x.chip, "replicas": x.replicas} for x in p.pools],
                "docs_per_s": p.docs_per_s, "tokens_per_s": p.tokens_per_s, "usd_per_hour": p.cost_per_hour,
                "simulated_docs_per_s": self.sim_docs_per_s, "simulated_tokens_per_s": self.sim_tokens_per_s,
                "ttft_s": self.ttft_s if math.isfinite(self.ttft_s) else None}


@dataclass
class LayoutChoice:
    """The layout chosen: ``mode``, the pools as ``(role, chip, replicas)``, why, and every
    candidate weighed (empty when one chip type decided it without solving)."""

    mode: str
    pools: list[tuple[str, str, int]]
    reason: str
    chosen: Candidate | None = None
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def expected(self) -> dict[str, float] | None:
        """What the solver expects of the chosen layout (MILP and simulator), or None."""
        c = self.chosen
        if c is None or c.plan is None:
            return None
        return {"docs_per_s": c.plan.docs_per_s, "tokens_per_s": c.plan.tokens_per_s,
                "simulated_docs_per_s": c.sim_docs_per_s, "simulated_tokens_per_s": c.sim_tokens_per_s,
                "usd_per_hour": c.plan.cost_per_hour}

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "pools": [{"role": r, "chip": c, "replicas": n} for r, c, n in self.pools],
                "reason": self.reason, "expected": self.expected,
                "alternatives": [c.to_dict() for c in self.candidates]}


def colocated_everywhere(chip: str, count: int) -> LayoutChoice:
    """The one-chip-type rule: ``count`` colocated workers on ``chip``."""
    if count < 1:
        raise ValueError(f"chip {chip!r}: count must be >= 1, got {count}")
    return LayoutChoice(mode="colocated", pools=[("colocated", chip, count)], reason=ONE_TYPE_REASON)


def choose_layout(chips: dict[str, ChipProfile], available: dict[str, int], model: ModelSpec, workload: Workload,
                  objective: str = "cost", ttft_target_s: float | None = None, roles: Iterable[str] = ROLES,
                  max_batch: int = DEFAULT_MAX_BATCH, chunk_tokens: int = 4096) -> LayoutChoice:
    """The layout for ``workload`` on ``available`` chips (name -> count, each with a profile
    in ``chips``); ``roles``: the worker roles the backend fills. See the module docstring."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if ttft_target_s is not None and not ttft_target_s > 0:
        raise ValueError(f"ttft_target_s must be > 0, got {ttft_target_s!r}")
    types = [c for c, n in available.items() if n > 0]
    if not types:
        raise ValueError(f"no chips to place workers on: available={available}")
    missing = [c for c in types if c not in chips]
    if missing:
        raise ValueError(f"chip(s) {', '.join(missing)} have no profile; profiles: {sorted(chips)}")
    roles = tuple(roles)
    modes = [m for m, rs in (("colocated", ("colocated",)), ("pd", ("prefill", "decode"))) if set(rs) <= set(roles)]
    cands = [_candidate(m, chips, available, model, workload, objective, max_batch, chunk_tokens) for m in modes]
    if len(types) == 1:
        choice = colocated_everywhere(types[0], available[types[0]])
        choice.candidates = cands
        choice.chosen = next((c for c in cands if c.mode == "colocated" and c.plan is not None), None)
        return choice
    return _pick(cands, objective, ttft_target_s)


def _candidate(mode: str, chips, available, model, workload, objective, max_batch, chunk_tokens) -> Candidate:
    from dlbatch.solver.simulate import simulate

    roles = ("colocated",) if mode == "colocated" else ("prefill", "decode")
    try:
        plan = solve(chips, available, model, workload, objective, max_batch=max_batch, roles=roles,
                     chunk_tokens=chunk_tokens, compare_modes=False, one_chip_per_role=True)
    except SolverError as e:
        return Candidate(mode=mode, error=str(e))
    sim = simulate(plan, chips, model, workload, n_docs=min(workload.n_docs, SIM_DOCS), max_batch=max_batch,
                   chunk_tokens=chunk_tokens)
    return Candidate(mode=mode, plan=plan, sim_docs_per_s=sim.docs_per_s, sim_tokens_per_s=sim.tokens_per_s,
                     ttft_s=ttft_s(plan, chips, model, workload, max_batch, chunk_tokens))


def ttft_s(plan: Plan, chips: dict[str, ChipProfile], model: ModelSpec, workload: Workload, max_batch: int = DEFAULT_MAX_BATCH,
           chunk_tokens: int = 4096) -> float:
    """Seconds from a document's prefill start to its first token on ``plan``'s slowest
    prefilling pool (the module docstring's estimate)."""
    worst = 0.0
    decoders = [p for p in plan.pools if p.role == "decode"]
    for p in plan.pools:
        if p.role == "decode":
            continue
        rr = role_rates(chips[p.chip], model, workload, max_batch=max_batch, chunk_tokens=chunk_tokens)
        if p.role == "prefill":
            link = min([chips[p.chip].kv_link_bw] + [chips[d.chip].kv_link_bw for d in decoders])
            t = rr.prefill_s_per_doc + rr.kv_bytes_per_doc / link
        else:
            chunks = math.ceil(workload.prefill_tokens_per_doc / chunk_tokens)
            t = rr.prefill_s_per_doc + chunks * rr.decode_step_s
        worst = max(worst, t)
    return worst


def _pick(cands: list[Candidate], objective: str, ttft_target_s: float | None) -> LayoutChoice:
    feasible = [c for c in cands if c.plan is not None]
    if not feasible:
        raise SolverError("no layout is feasible: " + "; ".join(f"{c.mode}: {c.error}" for c in cands))
    unit = "documents/s per $/h" if objective == "cost" else "documents/s"
    ok, notes = feasible, [f"{c.mode} infeasible: {c.error}" for c in cands if c.plan is None]
    if ttft_target_s is not None:
        meet = [c for c in ok if c.ttft_s <= ttft_target_s]
        if meet:
            notes.append(f"TTFT target {ttft_target_s:g} s met by {'/'.join(c.mode for c in meet)}")
        else:
            meet = [min(ok, key=lambda c: c.ttft_s)]
            notes.append(f"no layout meets the TTFT target {ttft_target_s:g} s: {meet[0].mode} has the lowest "
                         f"estimate ({meet[0].ttft_s:.3g} s)")
        ok = meet
    col = next((c for c in ok if c.mode == "colocated"), None)
    pd = next((c for c in ok if c.mode == "pd"), None)
    if col is not None and pd is not None:
        gain = pd.score(objective) / col.score(objective) - 1 if col.score(objective) > 0 else math.inf
        chosen = pd if gain > MIN_GAIN else col
        why = (f"simulated {col.score(objective):,.4g} {unit} colocated vs {pd.score(objective):,.4g} prefill/decode "
               f"({100 * gain:+.1f}%; PD must gain > {100 * MIN_GAIN:.0f}%)")
    else:
        chosen = col or pd
        why = f"simulated {chosen.score(objective):,.4g} {unit} {chosen.mode}"
    pools = [(p.role, p.chip, p.replicas) for p in chosen.plan.pools]
    return LayoutChoice(mode=chosen.mode, pools=pools, reason="; ".join([why, *notes]), chosen=chosen,
                        candidates=cands)

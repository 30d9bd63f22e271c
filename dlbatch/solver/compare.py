"""Does mixing chip types pay? Best heterogeneous plan vs best single-chip-type plans."""
from __future__ import annotations

from dataclasses import dataclass, field, asdict
from typing import Any, Iterable

from dlbatch.solver.capacity import ROLES
from dlbatch.solver.milp import Plan, SolverError, solve
from dlbatch.solver.profile import ChipProfile, ModelSpec
from dlbatch.solver.workload import Workload


@dataclass
class Comparison:
    heterogeneous: Plan
    best_single: Plan
    singles: list[dict[str, Any]]          # every single-type plan tried (label, docs/s, $/h, error)
    budget_per_hour: float
    throughput_ratio: float                # heterogeneous docs/s / best single docs/s
    per_dollar_ratio: float                # (docs/s per $/h) heterogeneous / best single
    pays: bool
    chosen: Plan
    verdict: str
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "heterogeneous": self.heterogeneous.to_dict(), "best_single": self.best_single.to_dict(),
            "singles": self.singles, "budget_per_hour": self.budget_per_hour,
            "throughput_ratio": self.throughput_ratio, "per_dollar_ratio": self.per_dollar_ratio,
            "pays": self.pays, "chosen": "heterogeneous" if self.pays else "single",
            "verdict": self.verdict, "assumptions": self.assumptions,
        }


def compare_heterogeneous(chips: dict[str, ChipProfile], available: dict[str, int], model: ModelSpec,
                          workload: Workload, budget_per_hour: float | None = None, max_batch: int = 256,
                          roles: Iterable[str] = ROLES, chunk_tokens: int = 8192,
                          min_gain: float = 0.02) -> Comparison:
    """Best plan over all chip types vs the best plan using one chip type (colocated-only
    or PD-only), all maximising throughput at the same hourly budget.

    Without ``budget_per_hour`` the budget is the cost of the unconstrained
    heterogeneous plan. Heterogeneity "pays" when the heterogeneous plan really uses
    more than one chip type and beats the best single-type plan's throughput by more
    than ``min_gain`` (default 2%); otherwise the single-type plan is chosen (fewer
    moving parts).
    """
    roles = tuple(roles)
    het = solve(chips, available, model, workload, "throughput", budget_per_hour, None, max_batch, roles,
                chunk_tokens, compare_modes=False)
    budget = budget_per_hour if budget_per_hour is not None else het.cost_per_hour
    if budget_per_hour is None:
        het.budget_per_hour = None
    singles: list[dict[str, Any]] = []
    best: Plan | None = None
    modes = []
    if "colocated" in roles:
        modes.append(("colocated", ("colocated",)))
    if {"prefill", "decode"} <= set(roles):
        modes.append(("pd", ("prefill", "decode")))
    for name in chips:
        if available.get(name, 0) <= 0:
            continue
        for label, rs in modes:
            try:
                p = solve({name: chips[name]}, {name: available[name]}, model, workload, "throughput",
                          budget, None, max_batch, rs, chunk_tokens, compare_modes=False)
            except SolverError as e:
                singles.append({"label": f"{name} {label}", "error": str(e)})
                continue
            singles.append({"label": f"{name} {label}", "docs_per_s": p.docs_per_s,
                            "cost_per_hour": p.cost_per_hour, "cost_per_mtok": p.cost_per_mtok,
                            "pools": [asdict(x) for x in p.pools]})
            key = (p.docs_per_s, p.docs_per_s / max(p.cost_per_hour, 1e-12))
            if best is None or key > (best.docs_per_s, best.docs_per_s / max(best.cost_per_hour, 1e-12)):
                best = p
    if best is None:
        raise SolverError("no single-chip-type plan is feasible at budget "
                          f"${budget:,.2f}/h: {[s['error'] for s in singles]}")
    t_ratio = het.docs_per_s / best.docs_per_s
    pd_h = het.docs_per_s / max(het.cost_per_hour, 1e-12)
    pd_s = best.docs_per_s / max(best.cost_per_hour, 1e-12)
    per_dollar = pd_h / pd_s
    mixes = len(het.chip_types) > 1
    pays = mixes and t_ratio > 1.0 + min_gain
    best_label = f"{best.chip_types[0]} {best.mode}"
    if pays:
        verdict = (f"heterogeneity pays: {' + '.join(het.chip_types)} gives {het.docs_per_s:,.4g} docs/s at "
                   f"${het.cost_per_hour:,.2f}/h vs {best.docs_per_s:,.4g} docs/s for the best single type "
                   f"({best_label}, ${best.cost_per_hour:,.2f}/h) at the same ${budget:,.2f}/h budget: "
                   f"{t_ratio:.3f}x throughput, {per_dollar:.3f}x throughput per dollar")
        if per_dollar < 1.0:
            verdict += (f". Note: per dollar it is {per_dollar:.3f}x, so the gain comes from buying more "
                        f"workers than {best.chip_types[0]} alone can supply (availability/budget), "
                        f"not from cheaper tokens")
    elif mixes:
        verdict = (f"heterogeneity does not pay: the mixed plan gains only {100 * (t_ratio - 1):.2f}% "
                   f"(< {100 * min_gain:.0f}%) over {best_label} ({best.docs_per_s:,.4g} docs/s at "
                   f"${best.cost_per_hour:,.2f}/h); picking the single-chip plan")
    else:
        verdict = (f"heterogeneity does not pay: the best plan over all chips uses only "
                   f"{het.chip_types[0]} ({het.docs_per_s:,.4g} docs/s vs best single {best_label} "
                   f"{best.docs_per_s:,.4g} docs/s, per-dollar ratio {per_dollar:.3f}); picking the single-chip plan")
    assumptions = [f"all plans maximise throughput within ${budget:,.2f}/h"
                   + ("" if budget_per_hour is not None else " (the unconstrained heterogeneous plan's cost)"),
                   f"single-type plans tried: colocated-only and PD-only for each available chip; "
                   f"heterogeneity must gain > {100 * min_gain:.0f}% throughput to be chosen"] + het.assumptions
    return Comparison(heterogeneous=het, best_single=best, singles=singles, budget_per_hour=budget,
                      throughput_ratio=t_ratio, per_dollar_ratio=per_dollar, pays=pays,
                      chosen=het if pays else best, verdict=verdict, assumptions=assumptions)

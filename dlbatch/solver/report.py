"""Plain-text tables for plans, comparisons and simulation results."""
from __future__ import annotations

from typing import Any

from dlbatch.solver.compare import Comparison
from dlbatch.solver.milp import Plan
from dlbatch.solver.simulate import SimResult


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), line]
    out += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells[1:]]
    return "\n".join(out)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:,.4g}"
    return str(v)


def format_plan(plan: Plan) -> str:
    rows = [[p.chip, p.role, p.replicas, p.docs_per_s_each, p.docs_per_s, f"{100 * p.utilisation:.0f}%",
             p.decode_batch or "-", p.price_per_hour * p.replicas] for p in plan.pools]
    lines = [f"plan ({plan.objective}, {plan.mode}) for {plan.model}",
             _table(["chip", "role", "replicas", "docs/s each", "docs/s", "util", "batch", "$/h"], rows), "",
             f"predicted: {plan.docs_per_s:,.4g} docs/s, {plan.tokens_per_s:,.0f} tokens/s "
             f"(in {plan.input_tokens_per_s:,.0f} + out {plan.output_tokens_per_s:,.0f})",
             f"cost: ${plan.cost_per_hour:,.2f}/h, ${plan.cost_per_mtok:,.4g}/Mtok; job of "
             f"{plan.workload.get('n_docs', 0):,} docs: {plan.hours_for_job:,.3g} h, ${plan.job_cost:,.2f}",
             f"bottleneck: {plan.bottleneck}", f"why: {plan.why}"]
    for alt in plan.alternatives:
        if "error" in alt:
            lines.append(f"alternative {alt['label']}: infeasible ({alt['error']})")
        else:
            lines.append(f"alternative {alt['label']}: {alt['docs_per_s']:,.4g} docs/s, "
                         f"${alt['cost_per_hour']:,.2f}/h, ${alt['cost_per_mtok']:,.4g}/Mtok")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in plan.assumptions]
    return "\n".join(lines)


def format_comparison(cmp: Comparison) -> str:
    rows = []
    for s in cmp.singles:
        if "error" in s:
            rows.append([s["label"], "-", "-", "-", "infeasible"])
        else:
            rows.append([s["label"], s["docs_per_s"], s["cost_per_hour"], s["cost_per_mtok"], ""])
    h = cmp.heterogeneous
    rows.insert(0, ["heterogeneous (" + "+".join(h.chip_types) + ")", h.docs_per_s, h.cost_per_hour,
                    h.cost_per_mtok, "chosen" if cmp.pays else ""])
    for r in rows[1:]:
        if cmp.best_single is not None and r[0] == f"{cmp.best_single.chip_types[0]} {cmp.best_single.mode}":
            r[4] = r[4] or ("chosen" if not cmp.pays else "best single")
    return "\n".join([
        f"heterogeneous vs single chip type at ${cmp.budget_per_hour:,.2f}/h",
        _table(["plan", "docs/s", "$/h", "$/Mtok", ""], rows), "",
        f"throughput ratio {cmp.throughput_ratio:.3f}, throughput-per-dollar ratio {cmp.per_dollar_ratio:.3f}",
        f"verdict: {cmp.verdict}", "", format_plan(cmp.chosen)])


def format_simulation(res: SimResult) -> str:
    rows = [[s.chip, s.role, s.replicas, s.docs, f"{100 * s.busy_fraction:.0f}%",
             f"{100 * s.slot_occupancy:.0f}%" if s.role != "prefill" else "-",
             s.mean_queue_len, s.max_queue_len, s.mean_wait_s, s.max_wait_s] for s in res.pools]
    return "\n".join([
        f"simulation of {res.n_docs:,} documents ({res.wall_seconds:.1f} s wall)",
        _table(["chip", "role", "workers", "docs", "busy", "slots", "mean q", "max q", "mean wait s",
                "max wait s"], rows), "",
        f"makespan {res.makespan_s:,.1f} s; throughput {res.docs_per_s:,.4g} docs/s "
        f"({res.tokens_per_s:,.0f} tokens/s); steady state {res.steady_docs_per_s:,.4g} docs/s vs "
        f"predicted {res.predicted_docs_per_s:,.4g} "
        f"({100 * (res.steady_docs_per_s / res.predicted_docs_per_s - 1):+.1f}%)"
        if res.predicted_docs_per_s > 0 else f"makespan {res.makespan_s:,.1f} s",
        f"prefill wait mean {res.prefill_mean_wait_s:,.1f} s, max {res.prefill_max_wait_s:,.1f} s; "
        f"KV transfer mean {res.kv_transfer_mean_s * 1000:,.2f} ms"])

"""The pool-sizing MILP: how many workers of which chip in which role.

Formulation (solved with ``scipy.optimize.milp``, i.e. HiGHS)::

    variables   n[i,r] in {0..avail_i}   workers of chip i in role r (prefill/decode/colocated)
                x[i,r] >= 0              documents/s that pool processes
    capacity    x[i,r] <= rate[i,r] * n[i,r]                (rates: dlbatch.solver.capacity)
    chips       sum_r n[i,r] <= avail_i
    flow        sum_i x[i,prefill] = sum_i x[i,decode]        (every PD document is decoded)
    KV link     kvb * sum_i x[i,prefill] <= sum_i link_i * n[i,prefill]   (prefill egress)
                kvb * sum_i x[i,decode]  <= sum_i link_i * n[i,decode]    (decode ingress)
    budget      sum price_i * n[i,r] <= budget_per_hour                  (when given)
    one chip    n[i,r] <= avail_i * y[i,r], sum_i y[i,r] <= 1, y binary   (``one_chip_per_role``:
                each role on one chip type, the pools `dlbatch run` can run)
    throughput  T = sum_i x[i,prefill] + sum_i x[i,colocated]             documents/s

Objectives:

* ``throughput`` — maximise ``T`` (within the budget), then, at that ``T``, minimise
  $/hour (so no idle worker is bought), with a tiny tie-break towards colocated
  workers (simpler to run when PD gives nothing more).
* ``cost`` — minimise $/document ``= cost / T``, a ratio. It is linearised with
  Dinkelbach's method: starting from ``lambda`` = $/doc of the throughput plan,
  repeatedly solve the MILP ``min cost - lambda*T``; while its optimum is negative
  the new plan is cheaper per document and ``lambda`` becomes its $/doc; when it
  reaches 0, ``lambda`` is the optimal $/doc (finite convergence for MILPs). Since
  every plan scaled up keeps its $/doc, a last MILP picks, among plans at that $/doc
  (and within the budget), the one with the highest throughput: cheapest per
  document and then fastest.
* ``deadline`` — the job must finish ``n_docs`` within ``deadline_hours``:
  ``T >= n_docs / (3600 * deadline_hours)``; minimise the job's cost, which for a
  job paid while it runs is ``n_docs * $/doc`` — the ``cost`` objective under that
  constraint. If even the throughput-optimal plan is too slow, a
  :class:`DeadlineError` reports the best achievable hours.

Rates are steady-state averages; integrality is exact (whole workers), but a
fractional document flow through a pool is allowed (pools are large or the job long).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, asdict
from typing import Any, Iterable

import numpy as np

from dlbatch.solver.capacity import ROLES, RoleRates, role_rates
from dlbatch.solver.profile import ChipProfile, ModelSpec
from dlbatch.solver.workload import Workload

OBJECTIVES = ("throughput", "cost", "deadline")


class SolverError(ValueError):
    """The planning problem has no acceptable answer; the message says why, with numbers."""


class NoFeasibleChipError(SolverError):
    """The model (plus one document's KV) fits on no available chip."""


class NoAvailabilityError(SolverError):
    """No chips are available."""


class DeadlineError(SolverError):
    """The deadline cannot be met; ``best_hours`` is the fastest achievable."""

    def __init__(self, msg: str, best_hours: float):
        super().__init__(msg)
        self.best_hours = best_hours


@dataclass
class Pool:
    chip: str
    role: str
    replicas: int
    docs_per_s_each: float      # capacity of one worker
    docs_per_s: float           # assigned flow through the pool
    utilisation: float
    price_per_hour: float       # per worker
    decode_batch: int = 0       # sequences per decode/colocated worker
    # What `dlbatch run --plan` places the pool's actors on: the Ray custom resource
    # `chip:<chip_resource>` (dlbatch.workers.session.chip_resource). Defaults to the chip name.
    chip_resource: str = ""

    def __post_init__(self) -> None:
        if not self.chip_resource:
            self.chip_resource = self.chip


@dataclass
class Plan:
    objective: str
    pools: list[Pool]
    docs_per_s: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    cost_per_hour: float
    cost_per_mtok: float
    cost_per_doc: float
    hours_for_job: float
    job_cost: float
    mode: str                   # "colocated" | "pd" | "mixed"
    bottleneck: str
    binding: list[str]
    why: str
    assumptions: list[str]
    model: str = ""
    workload: dict[str, Any] = field(default_factory=dict)
    budget_per_hour: float | None = None
    deadline_hours: float | None = None
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    kv_bytes_per_doc: float = 0.0
    solve_seconds: float = 0.0
    max_batch: int = 256        # the per-worker sequence cap and prefill chunk the rates assumed
    chunk_tokens: int = 8192

    @property
    def tokens_per_s(self) -> float:
        """Input + output tokens/s (input = logical prompt tokens, K*(D+S) per doc)."""
        return self.input_tokens_per_s + self.output_tokens_per_s

    @property
    def chip_types(self) -> list[str]:
        return sorted({p.chip for p in self.pools})

    def replicas(self, chip: str, role: str) -> int:
        return sum(p.replicas for p in self.pools if p.chip == chip and p.role == role)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        d["usd_per_hour"] = self.cost_per_hour  # what `dlbatch run --plan` reads for the cost report
        return _jsonable(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        d = dict(d)
        d.pop("tokens_per_s", None)
        d.pop("usd_per_hour", None)
        known = {f.name for f in fields(Pool)}
        try:
            d["pools"] = [Pool(**{k: v for k, v in p.items() if k in known}) for p in d.get("pools", [])]
        except (TypeError, AttributeError) as e:
            raise ValueError(f"not a plan dictionary: bad pool entry: {e}") from e
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"not a plan dictionary: {e}") from e

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _jsonable(o: Any) -> Any:
    if isinstance(o, dict):
        return {k: _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (np.floating,)):
        o = float(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, np.integer):
        return int(o)
    return o


# -- the MILP ---------------------------------------------------------------------
class _Problem:
    def __init__(self, chips: dict[str, ChipProfile], available: dict[str, int], model: ModelSpec,
                 workload: Workload, roles: Iterable[str], max_batch: int, chunk_tokens: int,
                 one_chip_per_role: bool = False):
        self.chips, self.model, self.workload = chips, model, workload
        self.max_batch, self.chunk_tokens = max_batch, chunk_tokens
        self.gap = 1e-4
        self.available = available
        self.rates: dict[str, RoleRates] = {
            name: role_rates(p, model, workload, max_batch=max_batch, chunk_tokens=chunk_tokens)
            for name, p in chips.items()}
        roles = tuple(roles)
        self.vars: list[tuple[str, str]] = []
        for name in chips:
            if available.get(name, 0) <= 0:
                continue
            for r in roles:
                if self.rates[name].rate(r) > 0:
                    self.vars.append((name, r))
        pd_roles = {r for _, r in self.vars}
        if not ({"prefill", "decode"} <= pd_roles):   # PD needs both sides
            self.vars = [(c, r) for c, r in self.vars if r == "colocated"]
        self.nv = len(self.vars)
        self.ny = self.nv if one_chip_per_role else 0  # binaries y[i,r]: role r uses chip i
        kv = workload.kv_tokens_transferred_per_doc * model.kv_bytes_per_token
        self.kv_bytes_per_doc = kv

        nv = self.nv
        rate = np.array([self.rates[c].rate(r) for c, r in self.vars], dtype=float)
        price = np.array([chips[c].price_per_hour for c, _ in self.vars], dtype=float)
        avail = np.array([available[c] for c, _ in self.vars], dtype=float)
        is_p = np.array([r == "prefill" for _, r in self.vars], dtype=bool)
        is_d = np.array([r == "decode" for _, r in self.vars], dtype=bool)
        is_c = np.array([r == "colocated" for _, r in self.vars], dtype=bool)
        link = np.array([chips[c].kv_link_bw / kv for c, _ in self.vars], dtype=float)  # docs/s per worker
        self.rate, self.price, self.avail = rate, price, avail
        self.is_p, self.is_d, self.is_c, self.link_docs = is_p, is_d, is_c, link

        rows, lo, hi = [], [], []

        def add(n_coef, x_coef, l, h, y_coef=None):
            rows.append(np.concatenate([n_coef, x_coef, np.zeros(self.ny) if y_coef is None else y_coef]))
            lo.append(l)
            hi.append(h)

        z = np.zeros(nv)
        for j in range(nv):                      # capacity
            nc, xc = z.copy(), z.copy()
            nc[j], xc[j] = -rate[j], 1.0
            add(nc, xc, -np.inf, 0.0)
        for c in dict.fromkeys(c for c, _ in self.vars):   # availability per chip
            nc = np.array([1.0 if cc == c else 0.0 for cc, _ in self.vars])
            add(nc, z, -np.inf, float(available[c]))
        if is_p.any():
            add(z, is_p.astype(float) - is_d.astype(float), 0.0, 0.0)      # flow balance
            add(-link * is_p, is_p.astype(float), -np.inf, 0.0)             # prefill egress
            add(-link * is_d, is_d.astype(float), -np.inf, 0.0)             # decode ingress
        if self.ny:
            for j in range(nv):                  # n[j] only where y[j] = 1
                nc, yc = z.copy(), z.copy()
                nc[j], yc[j] = 1.0, -avail[j]
                add(nc, z, -np.inf, 0.0, yc)
            for r in dict.fromkeys(r for _, r in self.vars):   # one chip type per role
                add(z, z, -np.inf, 1.0, np.array([1.0 if rr == r else 0.0 for _, rr in self.vars]))
        zy = np.zeros(self.ny)
        self.base_A = np.array(rows) if rows else np.zeros((0, 2 * nv + self.ny))
        self.base_lo, self.base_hi = np.array(lo), np.array(hi)
        self.T_coef = np.concatenate([z, (is_p | is_c).astype(float), zy])
        self.cost_coef = np.concatenate([price, z, zy])
        self.pd_count = np.concatenate([(is_p | is_d).astype(float), z, zy])

    def run(self, c: np.ndarray, extra: list[tuple[np.ndarray, float, float]]) -> np.ndarray | None:
        from scipy.optimize import Bounds, LinearConstraint, milp

        nv = self.nv
        A, lo, hi = self.base_A, self.base_lo, self.base_hi
        if extra:
            A = np.vstack([A] + [e[0][None, :] for e in extra])
            lo = np.concatenate([lo, [e[1] for e in extra]])
            hi = np.concatenate([hi, [e[2] for e in extra]])
        ub = np.concatenate([self.avail, self.rate * self.avail, np.ones(self.ny)])
        integrality = np.concatenate([np.ones(nv), np.zeros(nv), np.ones(self.ny)])
        res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(2 * nv + self.ny), ub),
                   constraints=[LinearConstraint(A, lo, hi)],
                   options={"mip_rel_gap": self.gap, "time_limit": 30.0})
        if res.status == 2 or res.x is None:      # infeasible
            return None
        if res.status not in (0,):
            raise SolverError(f"MILP solver stopped without an optimal answer: {res.message}")
        x = res.x.copy()
        x[:nv] = np.round(x[:nv])
        x[2 * nv:] = np.round(x[2 * nv:])
        return x

    # evaluate an integer assignment deterministically (max flow through the pools)
    def evaluate(self, n: np.ndarray) -> dict[str, Any]:
        cap = self.rate * n
        capP, capD, capC = cap[self.is_p].sum(), cap[self.is_d].sum(), cap[self.is_c].sum()
        linkP = (self.link_docs * n)[self.is_p].sum()
        linkD = (self.link_docs * n)[self.is_d].sum()
        T_pd = min(capP, capD, linkP, linkD) if self.is_p.any() else 0.0
        flow = np.zeros(self.nv)
        if T_pd > 0:
            flow[self.is_p] = cap[self.is_p] * (T_pd / capP)
            flow[self.is_d] = cap[self.is_d] * (T_pd / capD)
        flow[self.is_c] = cap[self.is_c]
        return {"n": n, "cap": cap, "flow": flow, "capP": capP, "capD": capD, "capC": capC,
                "linkP": linkP, "linkD": linkD, "T_pd": T_pd, "T": T_pd + capC,
                "cost": float(self.price @ n)}


def _validate_inputs(chips, available, model, workload, objective, budget, deadline, roles) -> None:
    if not isinstance(chips, dict) or not chips:
        raise ValueError(f"chips must be a non-empty dict of name -> ChipProfile, got {chips!r}")
    for name, p in chips.items():
        if not isinstance(p, ChipProfile):
            raise ValueError(f"chips[{name!r}] must be a ChipProfile, got {type(p).__name__}")
    if not isinstance(available, dict):
        raise ValueError(f"available must be a dict of chip name -> count, got {available!r}")
    for name, k in available.items():
        if name not in chips:
            raise ValueError(f"available names chip {name!r}, which has no profile; known: {sorted(chips)}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"available[{name!r}] must be an integer >= 0, got {k!r}")
    if not isinstance(model, ModelSpec):
        raise ValueError(f"model must be a ModelSpec, got {type(model).__name__}")
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a Workload, got {type(workload).__name__}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if budget is not None and (not isinstance(budget, (int, float)) or not budget > 0 or not math.isfinite(budget)):
        raise ValueError(f"budget_per_hour must be a number > 0 or None, got {budget!r}")
    if objective == "deadline":
        if deadline is None:
            raise ValueError("objective 'deadline' needs deadline_hours")
    if deadline is not None and (not isinstance(deadline, (int, float)) or not deadline > 0):
        raise ValueError(f"deadline_hours must be a number > 0, got {deadline!r}")
    roles = tuple(roles)
    bad = [r for r in roles if r not in ROLES]
    if bad or not roles:
        raise ValueError(f"roles must be a non-empty subset of {ROLES}, got {roles!r}")


def _fmt_rate(x: float) -> str:
    return f"{x:,.3g}" if x < 100 else f"{x:,.0f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def _feasibility_errors(prob: _Problem, chips, available, model, workload, roles) -> None:
    if sum(available.values()) == 0:
        raise NoAvailabilityError(f"no chips available: every count is 0 in available={dict(available)}")
    if prob.nv > 0:
        return
    kvb = model.kv_bytes_per_token
    need_doc = workload.max_kv_tokens_per_doc * kvb
    lines = []
    for name, p in chips.items():
        if available.get(name, 0) <= 0:
            continue
        lines.append(f"{name}: {_gb(p.memory_bytes)} usable")
    biggest = max((chips[n].memory_bytes for n in chips if available.get(n, 0) > 0), default=0.0)
    raise NoFeasibleChipError(
        f"model {model.name!r} fits no available chip for roles {tuple(roles)}: it needs "
        f"{_gb(model.weight_bytes)} of weights + {_gb(need_doc)} KV for the largest document "
        f"({workload.max_kv_tokens_per_doc:,} tokens x {kvb:,} B) = {_gb(model.weight_bytes + need_doc)}, "
        f"but the largest available usable memory is {_gb(biggest)} ({'; '.join(lines)})")


def solve(chips: dict[str, ChipProfile], available: dict[str, int], model: ModelSpec, workload: Workload,
          objective: str = "throughput", budget_per_hour: float | None = None,
          deadline_hours: float | None = None, max_batch: int = 256,
          roles: Iterable[str] = ROLES, chunk_tokens: int = 8192, compare_modes: bool = True,
          one_chip_per_role: bool = False) -> Plan:
    """Choose worker counts per (chip, role) for ``objective``; see the module docstring.

    ``available`` maps chip names (keys of ``chips``) to how many chips may be used.
    With one chip type (and both colocated and PD roles allowed) the plan's ``why``
    compares the best colocated-only and PD-only plans and says which wins and why.
    ``one_chip_per_role``: every role's workers on one chip type (one pool per role, what
    `dlbatch run` runs).
    """
    import time

    roles = tuple(roles)
    _validate_inputs(chips, available, model, workload, objective, budget_per_hour, deadline_hours, roles)
    available = {n: int(available.get(n, 0)) for n in chips}
    t0 = time.perf_counter()
    prob = _Problem(chips, available, model, workload, roles, max_batch, chunk_tokens, one_chip_per_role)
    _feasibility_errors(prob, chips, available, model, workload, roles)

    extra_budget = []
    if budget_per_hour is not None:
        extra_budget.append((prob.cost_coef, -np.inf, float(budget_per_hour)))
        cheapest = float(prob.price.min())
        if cheapest > budget_per_hour:
            raise SolverError(f"budget ${budget_per_hour:,.2f}/h buys no worker: the cheapest usable chip "
                              f"({prob.vars[int(prob.price.argmin())][0]}) costs ${cheapest:,.2f}/h")

    x = _optimise(prob, objective, extra_budget, available, budget_per_hour, deadline_hours, roles)
    n = x[:prob.nv]
    ev = prob.evaluate(n)
    plan = _make_plan(prob, ev, objective, budget_per_hour, deadline_hours, roles)
    plan.solve_seconds = time.perf_counter() - t0

    if compare_modes and len(plan.chip_types) == 1 and "colocated" in roles and \
            {"prefill", "decode"} <= set(roles):
        _compare_modes(plan, chips, available, model, workload, objective, budget_per_hour, deadline_hours,
                       max_batch, chunk_tokens)
    return plan


def _optimise(prob: _Problem, objective: str, extra_budget: list, available: dict, budget_per_hour,
              deadline_hours, roles) -> np.ndarray:
    """The MILP in stages: (1) the highest throughput within the budget; then for
    ``throughput`` the cheapest plan at that throughput, else (``cost``, ``deadline``) the
    lowest $/doc (Dinkelbach), then the fastest plan at that $/doc and the cheapest at that
    speed. A deadline the fastest plan misses is a DeadlineError naming the best it reaches."""
    x = prob.run(-prob.T_coef, extra_budget)
    if x is None or prob.evaluate(x[:prob.nv])["T"] <= 0:
        raise SolverError(f"no plan produces any throughput with available={available}, "
                          f"budget_per_hour={budget_per_hour}, roles={roles}")
    T_max = float(prob.T_coef @ x)
    t_min = _deadline_rate(prob, T_max, objective, deadline_hours, budget_per_hour, available)
    tie = 1e-5 * max(float(prob.price[prob.price > 0].min()) if (prob.price > 0).any() else 1.0, 1e-9)
    at_best = (prob.T_coef, T_max * (1 - 1e-7), np.inf)
    if objective == "throughput":
        return prob.run(prob.cost_coef + tie * prob.pd_count, extra_budget + [at_best])
    extra = list(extra_budget) + ([(prob.T_coef, t_min, np.inf)] if t_min > 0 else [])
    x = prob.run(prob.cost_coef + tie * prob.pd_count, extra + [at_best])
    lam = _best_cost_ratio(prob, x, extra)
    # fastest plan at the optimal $/doc, then cheapest at that speed
    ratio_row = (prob.cost_coef - lam * (1 + 1e-6) * prob.T_coef, -np.inf, 0.0)
    y = prob.run(-prob.T_coef, extra + [ratio_row])
    if y is None:
        return x
    T_best = float(prob.T_coef @ y)
    z = prob.run(prob.cost_coef + tie * prob.pd_count, extra + [ratio_row, (prob.T_coef, T_best * (1 - 1e-7), np.inf)])
    return z if z is not None else y


def _deadline_rate(prob: _Problem, T_max: float, objective: str, deadline_hours, budget_per_hour,
                   available: dict) -> float:
    """docs/s a deadline needs (0 without one); raises DeadlineError when ``T_max`` is short of it."""
    if objective != "deadline":
        return 0.0
    n_docs = prob.workload.n_docs
    t_min = n_docs / (3600.0 * deadline_hours)
    if T_max < t_min * (1 - 1e-9):
        best_h = n_docs / T_max / 3600.0
        raise DeadlineError(
            f"deadline {deadline_hours:g} h is unreachable: {n_docs:,} documents need "
            f"{t_min:,.3f} docs/s, but the fastest plan (budget "
            f"{'unlimited' if budget_per_hour is None else f'${budget_per_hour:,.2f}/h'}, "
            f"available={available}) reaches {T_max:,.3f} docs/s, i.e. {best_h:,.2f} h at best",
            best_hours=best_h)
    return t_min


def _best_cost_ratio(prob: _Problem, x: np.ndarray, extra: list) -> float:
    """The lowest $/doc (cost per hour over docs/s) any plan within ``extra`` reaches:
    Dinkelbach's iteration from the plan ``x``."""
    scale = max(float(prob.price.max()), 1e-9)
    ev = prob.evaluate(x[:prob.nv])
    lam = ev["cost"] / ev["T"]
    for _ in range(50):
        y = prob.run(prob.cost_coef - lam * prob.T_coef, extra)
        if y is None:
            break
        val = float(prob.cost_coef @ y - lam * (prob.T_coef @ y))
        if val >= -1e-9 * scale:
            break
        ev_y = prob.evaluate(y[:prob.nv])
        if ev_y["T"] <= 0 or ev_y["cost"] / ev_y["T"] >= lam * (1 - 1e-12):
            break
        lam = ev_y["cost"] / ev_y["T"]
    return lam


def _mode(pools: list[Pool]) -> str:
    roles = {p.role for p in pools}
    if roles == {"colocated"}:
        return "colocated"
    if "colocated" in roles:
        return "mixed"
    return "pd"


def _make_plan(prob: _Problem, ev: dict[str, Any], objective, budget, deadline, roles) -> Plan:
    wl, model = prob.workload, prob.model
    pools = []
    for j, (c, r) in enumerate(prob.vars):
        k = int(ev["n"][j])
        if k <= 0:
            continue
        rr = prob.rates[c]
        pools.append(Pool(chip=c, role=r, replicas=k, docs_per_s_each=float(prob.rate[j]),
                          docs_per_s=float(ev["flow"][j]),
                          utilisation=float(ev["flow"][j] / ev["cap"][j]) if ev["cap"][j] > 0 else 0.0,
                          price_per_hour=float(prob.price[j]),
                          decode_batch=rr.decode_batch if r != "prefill" else 0))
    T, cost = float(ev["T"]), float(ev["cost"])
    inp, out = T * wl.input_tokens_per_doc, T * wl.output_tokens_per_doc
    tok = inp + out
    bottleneck, binding = _diagnose(prob, ev, budget)
    plan = Plan(
        objective=objective, pools=pools, docs_per_s=T, input_tokens_per_s=inp, output_tokens_per_s=out,
        cost_per_hour=cost, cost_per_mtok=cost / (tok * 3600.0) * 1e6 if tok > 0 else math.inf,
        cost_per_doc=cost / 3600.0 / T if T > 0 else math.inf,
        hours_for_job=wl.n_docs / T / 3600.0 if T > 0 else math.inf,
        job_cost=cost * wl.n_docs / T / 3600.0 if T > 0 else math.inf,
        mode=_mode(pools), bottleneck=bottleneck, binding=binding, why="",
        assumptions=_assumptions(prob, roles), model=model.name, workload=wl.summary(),
        budget_per_hour=budget, deadline_hours=deadline, kv_bytes_per_doc=prob.kv_bytes_per_doc,
        max_batch=prob.max_batch, chunk_tokens=prob.chunk_tokens)
    plan.why = _why(plan, prob, ev)
    return plan


def _diagnose(prob: _Problem, ev: dict[str, Any], budget: float | None) -> tuple[str, list[str]]:
    n = ev["n"]
    binding: list[str] = []
    used_per_chip: dict[str, int] = {}
    for j, (c, _) in enumerate(prob.vars):
        used_per_chip[c] = used_per_chip.get(c, 0) + int(n[j])
    spare = {c: prob.available[c] - used_per_chip.get(c, 0) for c in used_per_chip}
    addable = [float(prob.chips[c].price_per_hour) for c in spare if spare[c] > 0]
    budget_binds = False
    if budget is not None:
        left = budget - ev["cost"]
        if not addable or left < min(addable) - 1e-9:
            budget_binds = bool(addable) or left < 1e-9 * budget
            if budget_binds:
                binding.append(f"budget: ${ev['cost']:,.2f} of ${budget:,.2f}/h used"
                               + (f"; the cheapest addable worker costs ${min(addable):,.2f}/h" if addable else ""))
    exhausted = [c for c in used_per_chip if spare[c] == 0 and used_per_chip[c] > 0]
    for c in exhausted:
        binding.append(f"availability: all {prob.available[c]} {c} in use")
    all_exhausted = all(spare[c] == 0 for c in spare)
    stage = ""
    if ev["T_pd"] > 0:
        stages = {"prefill": ev["capP"], "decode": ev["capD"], "kv_link": min(ev["linkP"], ev["linkD"])}
        stage = min(stages, key=stages.get)
        binding.append(f"PD pipeline limited by {stage}: prefill {_fmt_rate(ev['capP'])}, decode "
                       f"{_fmt_rate(ev['capD'])}, KV link {_fmt_rate(stages['kv_link'])} docs/s")
    if budget_binds:
        return "budget", binding
    if stage == "kv_link":      # the link, not the chips, limits the pipeline
        return stage, binding
    if exhausted and (all_exhausted or not addable):
        return "availability", binding
    if stage:
        return stage, binding
    if exhausted:
        return "availability", binding
    return "colocated", binding


def _assumptions(prob: _Problem, roles) -> list[str]:
    wl = prob.workload
    return [
        "steady-state rates from the fitted cost models; ramp-up and drain are ignored (see simulate)",
        f"documents: mean {wl.mean_doc:,.0f} prefix tokens, K={wl.tasks_per_doc} tasks of mean "
        f"{wl.mean_suffix:,.0f} suffix and {wl.mean_output:,.0f} output tokens; prefix shared: {wl.prefix_shared}",
        "decode runs at the largest batch whose reserved KV (max_tokens) fits next to the weights",
        "colocated workers time-share prefill and decode (rate = 1 / (Tp + Td))",
        f"KV per document {_gb(prob.kv_bytes_per_doc)} crosses each PD pair's scale-out link "
        "(prefill egress and decode ingress), transfer overlapped with compute",
        "input tokens counted as logical prompt tokens K*(D+S); prices are per chip-hour while the job runs",
        f"roles allowed: {', '.join(roles)}",
    ]


def _pool_text(p: Pool) -> str:
    batch = f", batch {p.decode_batch}" if p.decode_batch else ""
    return f"{p.replicas}x{p.chip} {p.role} ({_fmt_rate(p.docs_per_s_each)} docs/s each{batch})"


def _why(plan: Plan, prob: _Problem, ev: dict[str, Any]) -> str:
    pools = plan.pools
    pre = [p for p in pools if p.role == "prefill"]
    dec = [p for p in pools if p.role == "decode"]
    col = [p for p in pools if p.role == "colocated"]
    parts = []
    if pre or dec:
        parts.append("PD: " + " + ".join(_pool_text(p) for p in pre) + " -> "
                     + " + ".join(_pool_text(p) for p in dec))
    if col:
        parts.append("colocated: " + " + ".join(_pool_text(p) for p in col))
    head = "; ".join(parts)
    s = (f"{head}. Predicted {plan.docs_per_s:,.3g} docs/s = {plan.tokens_per_s:,.0f} tokens/s at "
         f"${plan.cost_per_hour:,.2f}/h (${plan.cost_per_mtok:,.4g}/Mtok, ${plan.cost_per_doc * 1000:,.4g} "
         f"per 1k docs); {plan.workload.get('n_docs', 0):,} docs take {plan.hours_for_job:,.3g} h. "
         f"Bottleneck: {plan.bottleneck}")
    if plan.binding:
        s += " (" + "; ".join(plan.binding) + ")"
    s += "."
    return s


def _compare_modes(plan: Plan, chips, available, model, workload, objective, budget, deadline,
                   max_batch, chunk_tokens) -> None:
    """One chip type: solve colocated-only and PD-only, record both, explain the choice."""
    chip = plan.chip_types[0]
    res = {}
    for label, rs in (("colocated", ("colocated",)), ("pd", ("prefill", "decode"))):
        try:
            res[label] = solve({chip: chips[chip]}, {chip: available[chip]}, model, workload, objective,
                               budget, deadline, max_batch, rs, chunk_tokens, compare_modes=False)
        except SolverError as e:
            res[label] = e
    for label, r in res.items():
        if isinstance(r, Plan):
            plan.alternatives.append({"label": f"{chip} {label} only", "docs_per_s": r.docs_per_s,
                                      "cost_per_hour": r.cost_per_hour, "cost_per_mtok": r.cost_per_mtok,
                                      "pools": [asdict(p) for p in r.pools]})
        else:
            plan.alternatives.append({"label": f"{chip} {label} only", "error": str(r)})
    c, p = res.get("colocated"), res.get("pd")
    if isinstance(c, Plan) and isinstance(p, Plan):
        rr = role_rates(chips[chip], model, workload, max_batch=max_batch, chunk_tokens=chunk_tokens)
        pair = 1.0 / (rr.prefill_s_per_doc + rr.decode_s_per_doc)
        chosen = "PD" if plan.mode == "pd" else "colocated"
        plan.why += (
            f" One chip type ({chip}): colocated-only gives {c.docs_per_s:,.3g} docs/s at "
            f"${c.cost_per_mtok:,.4g}/Mtok, PD-only {p.docs_per_s:,.3g} docs/s at ${p.cost_per_mtok:,.4g}/Mtok; "
            f"chose {chosen}. On one chip type a colocated worker does Tp={rr.prefill_s_per_doc:.4g} s of "
            f"prefill plus Td={rr.decode_s_per_doc:.4g} s of decode per document ({pair:,.3g} docs/s per "
            f"worker), exactly what a perfectly balanced PD pair gives per worker, so PD can only tie "
            f"(and loses to whole-worker rounding and the {_gb(rr.kv_bytes_per_doc)}/doc KV link); PD pays "
            f"when prefill and decode run on chips with different cost ratios.")
    elif isinstance(c, Plan):
        plan.why += f" One chip type ({chip}): PD-only is infeasible ({res['pd']}); colocated chosen."

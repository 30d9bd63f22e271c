"""Entry points the CLI wires in (`dlbatch plan`, `dlbatch simulate`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dlbatch.solver.catalog import is_catalog_document, load_catalog, to_profile
from dlbatch.solver.milp import Plan, solve
from dlbatch.solver.profile import ChipProfile, ModelSpec, ProfileError, load_profile
from dlbatch.solver.report import format_plan, format_simulation
from dlbatch.solver.simulate import simulate
from dlbatch.solver.workload import Workload


def load_chips(chips_files: list[str], model: ModelSpec) -> dict[str, ChipProfile]:
    """Profiles from YAML files: measured profiles (``save_profile``) or catalogs
    (every catalog chip becomes a roofline profile for ``model``). Later files win."""
    import yaml

    if not chips_files:
        raise ValueError("no chip files given; pass measured profiles or configs/chips/catalog.yaml")
    chips: dict[str, ChipProfile] = {}
    for f in chips_files:
        p = Path(f)
        if not p.is_file():
            raise ProfileError(f"chip file not found: {str(p)!r}")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ProfileError(f"{p}: not valid YAML: {e}") from e
        if is_catalog_document(data):
            for name, entry in load_catalog(p).items():
                chips[name] = to_profile(entry, model)
        else:
            prof = load_profile(p)
            if prof.model and prof.model != model.name:
                raise ProfileError(f"{p}: profile was measured for model {prof.model!r}, not {model.name!r}")
            chips[prof.name] = prof
    return chips


def plan_command(chips_files: list[str], available: dict[str, int], model: ModelSpec, workload: Workload,
                 objective: str = "throughput", budget: float | None = None, deadline: float | None = None,
                 json_out: str | None = None, max_batch: int = 256, chunk_tokens: int = 8192,
                 quiet: bool = False) -> Plan:
    """Solve, print the plan table, optionally write the plan as JSON.

    ``max_batch`` (sequences per worker) and ``chunk_tokens`` (prefill tokens per forward
    pass) should be the engine settings the workers run with; they are stored in the plan
    so that ``simulate_command`` uses the same."""
    chips = load_chips(chips_files, model)
    unknown = [k for k in available if k not in chips]
    if unknown:
        raise ValueError(f"available names unknown chip(s) {unknown}; chip files define {sorted(chips)}")
    plan = solve({k: chips[k] for k in available}, available, model, workload, objective,
                 budget_per_hour=budget, deadline_hours=deadline, max_batch=max_batch, chunk_tokens=chunk_tokens)
    if not quiet:
        print(format_plan(plan))
    if json_out:
        Path(json_out).write_text(plan.to_json())
    return plan


def simulate_command(plan_path: str, chips_files: list[str], model: ModelSpec, workload: Workload,
                     n_docs: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Simulate a plan written by ``plan_command``; print the report, return it as a dict."""
    p = Path(plan_path)
    if not p.is_file():
        raise ValueError(f"plan file not found: {str(p)!r}")
    try:
        plan = Plan.from_dict(json.loads(p.read_text()))
    except (json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"{p}: not a plan JSON: {e}") from e
    chips = load_chips(chips_files, model)
    res = simulate(plan, chips, model, workload, n_docs=n_docs, max_batch=plan.max_batch,
                   chunk_tokens=plan.chunk_tokens)
    if not quiet:
        print(format_simulation(res))
    return res.to_dict()

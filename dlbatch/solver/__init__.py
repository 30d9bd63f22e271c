"""DLSolver: chip profiles, a pool-sizing MILP and a cluster simulator (no engine, no Ray).

Names are imported lazily (PEP 562) so that ``dlbatch --help``, which registers the
``plan`` / ``simulate`` / ``profile`` verbs from :mod:`dlbatch.cli.solver`, does not pay
for numpy and scipy.
"""
from __future__ import annotations

import importlib
import sys
import types

_EXPORTS = {
    "capacity": ("ROLES", "RoleRates", "role_rates"),
    "catalog": ("CatalogEntry", "calibrate", "catalog_profiles", "load_catalog", "measured_efficiencies",
                "to_profile"),
    "commands": ("load_chips", "plan_command", "simulate_command"),
    "compare": ("Comparison", "compare_heterogeneous"),
    "layout": ("Candidate", "LayoutChoice", "choose_layout", "colocated_everywhere"),
    "milp": ("DeadlineError", "NoAvailabilityError", "NoFeasibleChipError", "Plan", "Pool", "SolverError", "solve"),
    "profile": ("ChipProfile", "CostModel", "ModelSpec", "ProfileError", "fit_decode", "fit_prefill", "load_profile",
                "save_profile"),
    "report": ("format_comparison", "format_plan", "format_simulation"),
    "simulate": ("PoolStats", "SimResult", "simulate"),
    "workload": ("Workload",),
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'dlbatch.solver' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dlbatch.solver.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _SolverPackage(types.ModuleType):
    """Keeps ``dlbatch.solver.simulate`` the function (as the eager package did) although a
    submodule of the same name exists: the import system's ``setattr(package, name,
    submodule)`` is not allowed to shadow an exported name."""

    def __setattr__(self, name, value):
        if name in _WHERE and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _SolverPackage

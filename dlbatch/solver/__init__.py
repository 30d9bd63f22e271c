"""DLSolver: chip profiles, a pool-sizing MILP and a cluster simulator (no engine, no Ray)."""
from dlbatch.solver.capacity import ROLES, RoleRates, role_rates
from dlbatch.solver.catalog import CatalogEntry, calibrate, catalog_profiles, load_catalog, measured_efficiencies, to_profile
from dlbatch.solver.commands import load_chips, plan_command, simulate_command
from dlbatch.solver.compare import Comparison, compare_heterogeneous
from dlbatch.solver.milp import (DeadlineError, NoAvailabilityError, NoFeasibleChipError, Plan, Pool, SolverError,
                                 solve)
from dlbatch.solver.profile import (ChipProfile, CostModel, ModelSpec, ProfileError, fit_decode, fit_prefill,
                                    load_profile, save_profile)
from dlbatch.solver.report import format_comparison, format_plan, format_simulation
from dlbatch.solver.simulate import PoolStats, SimResult, simulate
from dlbatch.solver.workload import Workload

__all__ = [
    "ROLES", "RoleRates", "role_rates", "CatalogEntry", "calibrate", "catalog_profiles", "load_catalog",
    "measured_efficiencies", "to_profile", "load_chips", "plan_command", "simulate_command", "Comparison",
    "compare_heterogeneous", "DeadlineError", "NoAvailabilityError", "NoFeasibleChipError", "Plan", "Pool",
    "SolverError", "solve", "ChipProfile", "CostModel", "ModelSpec", "ProfileError", "fit_decode", "fit_prefill",
    "load_profile", "save_profile", "format_comparison", "format_plan", "format_simulation", "PoolStats",
    "SimResult", "simulate", "Workload",
]

"""Simulator tests: agreement with the plan's steady-state prediction, link limits, scale."""
from __future__ import annotations


import pytest

from dlbatch.solver import ModelSpec, Workload, catalog_profiles, format_simulation, simulate, solve
from tests.helpers.solver import TINY, chip


@pytest.fixture(scope="module")
def llama():
    m = ModelSpec.llama3_8b()
    return m, catalog_profiles(m)


@pytest.mark.parametrize("available,roles", [
    ({"l40s": 6, "mi300x": 4}, ("prefill", "decode")),               # heterogeneous PD
    ({"h100_sxm": 8}, ("colocated",)),                                # colocated
    ({"h100_sxm": 4, "l40s": 8}, ("prefill", "decode", "colocated")),  # mixed
])
def test_simulation_matches_plan_in_steady_state(llama, available, roles):
    m, chips = llama
    wl = Workload.paper(20_000)
    plan = solve(chips, available, m, wl, "throughput", roles=roles)
    res = simulate(plan, chips, m, wl, n_docs=20_000, seed=3)
    assert res.steady_docs_per_s == pytest.approx(plan.docs_per_s, rel=0.15)
    assert res.docs_per_s <= res.steady_docs_per_s * 1.05          # ramp-up and drain only cost
    assert res.n_docs == 20_000 and res.makespan_s > 0
    assert "steady state" in format_simulation(res)


def test_simulation_kv_link_bound():
    wl = Workload(n_docs=2000, tasks_per_doc=1, doc_tokens=(1000,), suffix_tokens=(0,), output_tokens=(100,))
    # 2 KB of KV per document over a 100 KB/s link: at most 50 docs/s, though compute allows 100
    f = chip("fast", tp=0.01, td=1.0, link=1e5)
    mm = chip("mem", tp=1.0, td=0.01, link=1e5)
    plan = solve({"fast": f, "mem": mm}, {"fast": 1, "mem": 1}, TINY, wl, "throughput", roles=("prefill", "decode"))
    assert plan.bottleneck == "kv_link" and plan.docs_per_s == pytest.approx(50.0)
    res = simulate(plan, {"fast": f, "mem": mm}, TINY, wl, seed=0)
    assert res.steady_docs_per_s == pytest.approx(50.0, rel=0.05)
    assert res.kv_transfer_mean_s == pytest.approx(0.02)


def test_simulation_hand_case_colocated():
    # mean output 100 tokens: Tp = 0.1 s, Td = 0.1 s -> 5 docs/s per worker, 10 docs/s for two
    wl = Workload(n_docs=10_000, tasks_per_doc=1, doc_tokens=(1000,), suffix_tokens=(0,),
                  output_tokens=(50, 100, 150))
    plan = solve({"a": chip("a")}, {"a": 2}, TINY, wl, "throughput")
    assert plan.docs_per_s == pytest.approx(10.0)
    res = simulate(plan, {"a": chip("a")}, TINY, wl, seed=0)
    assert res.steady_docs_per_s == pytest.approx(10.0, rel=0.05)
    assert res.makespan_s == pytest.approx(10_000 / 10.0, rel=0.05)
    pool = res.pools[0]
    assert pool.role == "colocated" and pool.docs == 10_000 and pool.busy_fraction > 0.95


def test_simulation_rejects_bad_input(llama):
    m, chips = llama
    wl = Workload.paper(100)
    plan = solve(chips, {"h100_sxm": 1}, m, wl, "throughput")
    with pytest.raises(ValueError, match="n_docs"):
        simulate(plan, chips, m, wl, n_docs=0)
    with pytest.raises(ValueError, match="'h100_sxm'"):
        simulate(plan, {"l4": chips["l4"]}, m, wl)


@pytest.mark.slow
def test_one_million_docs_over_1000_chips(llama):
    # its speed (target < 60 s) is measured by `dlbatch bench solver` [6], not asserted here
    m, chips = llama
    wl = Workload.paper(1_000_000)
    plan = solve(chips, {"h100_sxm": 500, "l40s": 500}, m, wl, "throughput", roles=("prefill", "decode"))
    assert sum(p.replicas for p in plan.pools) == 1000
    res = simulate(plan, chips, m, wl, seed=0)
    assert res.n_docs == 1_000_000
    assert res.steady_docs_per_s == pytest.approx(plan.docs_per_s, rel=0.15)

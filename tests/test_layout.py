"""The layout a job runs on (issue 36): named pools run as named, a plan's pools as planned,
otherwise the solver picks from the chips at hand: one chip type is colocated on every chip
without measuring anything; several are weighed (MILP per layout, simulated) by the job's
objective or TTFT target. Plain objects: no Ray, no engine (a job's tokenizer at most)."""
from __future__ import annotations

import os

import pytest

from dlbatch.driver.chips import LOCAL_CHIP, NoChipProfile, cluster_chips
from dlbatch.driver.config import RunConfig
from dlbatch.driver.layout import resolve_layout
from dlbatch.engine.config import DEFAULT_MAX_NUM_SEQS
from dlbatch.jobspec import JobSpecError, load_job
from dlbatch.solver import ModelSpec, Workload, catalog_profiles, choose_layout, simulate
from dlbatch.solver.layout import DEFAULT_MAX_BATCH, MIN_GAIN, SIM_DOCS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = ModelSpec.llama3_8b()
WL = Workload.paper(10_000)
CHIPS = catalog_profiles(M)


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture
def no_measuring(monkeypatch):
    """Fail any attempt to read the job's documents: the one-type rule measures nothing."""
    import dlbatch.driver.workload as workload

    def refuse(*a, **k):
        raise AssertionError("the layout measured the workload")

    monkeypatch.setattr(workload, "job_workload", refuse)


@pytest.fixture
def paper_workload(monkeypatch):
    """job_workload -> the catalog paper workload on Llama-3-8B (the job's tokenizer unread)."""
    import dlbatch.driver.workload as workload

    sample = workload.JobSample(workload=WL, model=M, docs_sampled=21, docs_total=WL.n_docs,
                                docs_total_estimated=False, truncated_docs=0)
    calls = []
    monkeypatch.setattr(workload, "job_workload", lambda spec, **kw: calls.append(kw) or sample)
    return calls


def _pools(layout) -> dict:
    return {r: (p.chip, p.replicas, p.device, p.num_gpus) for r, p in layout.pools.items()}


# ---------------------------------------------------------------------------------- who decides
def test_a_local_run_of_a_sample_job_is_one_colocated_pool_unmeasured(no_measuring):
    config = RunConfig.resolve(load_job("jobs/papers.yaml"))
    lay = config.layout
    assert lay.source == "solver" and lay.mode == "colocated" and lay.expected is None
    chip = next(iter(lay.chips))
    assert lay.chips == {chip: 1} and chip in (LOCAL_CHIP, "cpu-local")
    assert _pools(lay) == {"colocated": (chip, 1, "cpu", 0.0)} and not config.pd
    assert "one chip type" in lay.reason and "PD can only tie" in lay.reason
    # a job naming pools gets exactly them
    named = RunConfig.resolve(load_job("jobs/papers_pd.yaml")).layout
    assert named.source == "job" and _pools(named) == {"prefill": ("fast", 1, "cpu", 0.0),
                                                       "decode": ("cheap", 1, "cpu", 0.0)}
    # a plan file's pools
    plan = {"pools": [{"role": "colocated", "replicas": 3, "chip_resource": "l4"}], "docs_per_s": 2.5,
            "usd_per_hour": 2.55}
    planned = RunConfig.resolve(load_job("jobs/papers.yaml"), plan).layout
    assert planned.source == "plan" and _pools(planned) == {"colocated": ("l4", 3, "cpu", 0.0)}
    assert planned.expected == {"docs_per_s": 2.5} and planned.usd_per_hour == 2.55


def test_one_chip_type_of_a_cluster_is_colocated_on_every_chip(no_measuring, monkeypatch):
    from dlbatch.backends.vllm_backend import VllmBackend

    spec = load_job("jobs/papers.yaml", ["cluster.address=auto"])
    config = RunConfig.resolve(spec)
    assert config.layout is None and config.pools == {}  # attached: the cluster's chips decide at run time
    config = config.with_chips(cluster_chips({"CPU": 64.0, "GPU": 8.0, "chip:h100_sxm": 8.0, "node:1.2.3.4": 1.0}))
    assert _pools(config.layout) == {"colocated": ("h100_sxm", 8, "cuda", 1.0)}
    # a vLLM replica of tensor_parallel_size 2 asks for its two GPUs
    monkeypatch.setattr(VllmBackend, "unavailable_reason", classmethod(lambda cls: None))
    monkeypatch.setattr("dlbatch.backends.vllm_backend.engine_arg_names", lambda: {"tensor_parallel_size"})
    tp = RunConfig.resolve(load_job("jobs/papers.yaml", ["cluster.address=auto", "model.backend=vllm",
                                                         "model.engine_args.tensor_parallel_size=2"]))
    assert _pools(tp.with_chips({"a100_80gb": 4}).layout) == {"colocated": ("a100_80gb", 4, "cuda", 2.0)}


def test_a_chip_without_a_profile_is_named_with_how_to_profile_it(no_measuring):
    spec = load_job("jobs/papers.yaml", ["cluster.address=auto"])
    with pytest.raises(NoChipProfile, match=r"chip 'mystery_gpu' \(Ray resource chip:mystery_gpu\) has no profile.*"
                                            r"dlbatch profile --name mystery_gpu.*catalog.yaml"):
        RunConfig.resolve(spec).with_chips({"mystery_gpu": 2})
    with pytest.raises(ValueError, match=r"declare no chip:<name> resource"):
        RunConfig.resolve(spec).with_chips(cluster_chips({"CPU": 8.0}))


def test_several_chip_types_are_weighed_on_the_measured_workload(paper_workload, monkeypatch):
    spec = load_job("jobs/papers.yaml", ["cluster.address=auto"])
    config = RunConfig.resolve(spec).with_chips({"l40s": 8, "metax_c500": 8})
    lay = config.layout
    assert paper_workload and paper_workload[0]["max_model_len"] == config.max_model_len  # measured once
    assert lay.source == "solver" and lay.mode == "pd" and config.pd
    assert {r: p.chip for r, p in lay.pools.items()} == {"prefill": "l40s", "decode": "metax_c500"}
    assert {p.device for p in lay.pools.values()} == {"cuda"}
    assert lay.expected["docs_per_s"] > 0 and lay.expected["simulated_docs_per_s"] > 0
    assert {a["mode"] for a in lay.alternatives} == {"colocated", "pd"}
    # the same chips for vLLM (colocated workers only): colocated, the PD candidate never weighed
    from dlbatch.backends.vllm_backend import VllmBackend

    monkeypatch.setattr(VllmBackend, "unavailable_reason", classmethod(lambda cls: None))
    vllm = RunConfig.resolve(load_job("jobs/papers.yaml", ["cluster.address=auto", "model.backend=vllm"]))
    lay = vllm.with_chips({"l40s": 8, "metax_c500": 8}).layout
    assert lay.mode == "colocated" and [a["mode"] for a in lay.alternatives] == ["colocated"]


# ------------------------------------------------------------------------- the choice, from profiles
def test_the_solver_plans_with_the_engines_default_batch():
    assert DEFAULT_MAX_BATCH == DEFAULT_MAX_NUM_SEQS  # the solver imports no engine: the two constants kept equal


def _simulated(choice, mode):
    cand = next(c for c in choice.candidates if c.mode == mode)
    sim = simulate(cand.plan, CHIPS, M, WL, n_docs=min(WL.n_docs, SIM_DOCS), max_batch=DEFAULT_MAX_NUM_SEQS,
                   chunk_tokens=4096)
    return sim.docs_per_s / cand.plan.cost_per_hour


@pytest.mark.parametrize("pair,mode", [(("l40s", "metax_c500"), "pd"), (("l4", "a10g"), "pd"),
                                       (("h100_sxm", "l4"), "colocated"), (("h100_sxm", "mi300x"), "colocated")])
def test_pd_where_the_simulator_shows_it_pays_per_dollar_colocated_where_not(pair, mode):
    available = {k: 8 for k in pair}
    choice = choose_layout({k: CHIPS[k] for k in pair}, available, M, WL, objective="cost")
    assert choice.mode == mode, choice.reason
    pd, col = _simulated(choice, "pd"), _simulated(choice, "colocated")
    assert (pd > col * (1 + MIN_GAIN)) == (mode == "pd"), (pd, col)
    if mode == "pd":  # the ratio the MILP picks, one chip type per role
        roles = {r: c for r, c, _ in choice.pools}
        assert set(roles) == {"prefill", "decode"} and roles["prefill"] != roles["decode"]
        assert all(n >= 1 for _, _, n in choice.pools)
    assert "simulated" in choice.reason and choice.expected["usd_per_hour"] > 0


def test_the_objective_decides_between_per_dollar_and_raw_throughput():
    pair = {"h100_sxm": 8, "a100_80gb": 8}
    chips = {k: CHIPS[k] for k in pair}
    assert choose_layout(chips, pair, M, WL, objective="cost").mode == "colocated"
    fast = choose_layout(chips, pair, M, WL, objective="throughput")
    assert fast.mode == "pd" and dict((r, c) for r, c, _ in fast.pools) == {"prefill": "h100_sxm",
                                                                            "decode": "a100_80gb"}


def test_a_ttft_target_keeps_the_layouts_that_meet_it():
    pair = {"h200": 8, "l40s": 8}
    chips = {k: CHIPS[k] for k in pair}
    free = choose_layout(chips, pair, M, WL, objective="throughput")
    est = {c.mode: c.ttft_s for c in free.candidates}
    assert free.mode == "colocated" and est["pd"] < est["colocated"]
    target = (est["pd"] + est["colocated"]) / 2
    tight = choose_layout(chips, pair, M, WL, objective="throughput", ttft_target_s=target)
    assert tight.mode == "pd" and f"TTFT target {target:g} s met by pd" in tight.reason
    none = choose_layout(chips, pair, M, WL, objective="throughput", ttft_target_s=min(est.values()) / 10)
    assert none.mode == "pd" and "no layout meets the TTFT target" in none.reason


def test_one_chip_type_solves_nothing_it_needs():
    choice = choose_layout({"l40s": CHIPS["l40s"]}, {"l40s": 6}, M, WL)
    assert choice.mode == "colocated" and choice.pools == [("colocated", "l40s", 6)]
    assert "PD can only tie" in choice.reason
    with pytest.raises(ValueError, match=r"objective must be one of cost, throughput, got 'speed'"):
        choose_layout({"l40s": CHIPS["l40s"]}, {"l40s": 6}, M, WL, objective="speed")


# ------------------------------------------------------------------------------ the job's section
def test_the_cluster_section_names_pools_in_pairs_and_auto_or_pools(tmp_path):
    base = [f"output.path={tmp_path / 'o'}"]
    with pytest.raises(JobSpecError, match=r"cluster.prefill is named without cluster.decode: prefill and decode "
                                           r"pools come as a pair"):
        load_job("jobs/papers.yaml", [*base, "cluster.prefill.chip=fast"])
    with pytest.raises(JobSpecError, match=r"cluster.plan 'auto' lets the solver pick the pools, but the job names "
                                           r"prefill/decode pools"):
        load_job("jobs/papers_pd.yaml", [*base, "cluster.plan=auto"])
    with pytest.raises(JobSpecError, match=r"cluster.ttft_target_s"):
        load_job("jobs/papers.yaml", [*base, "cluster.ttft_target_s=0"])
    spec = load_job("jobs/papers.yaml", [*base, "cluster.plan=auto", "cluster.objective=throughput"])
    assert spec.cluster.mode == "auto" and spec.cluster.layout_source == "solver"


def test_the_report_says_which_layout_ran_and_what_was_expected(tmp_path, paper_workload):
    from dlbatch.output.parquet_store import ParquetStore
    from dlbatch.report.run import RunReport

    spec = load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}", "cluster.address=auto"])
    config = RunConfig.resolve(spec).with_chips({"l4": 8, "a10g": 8})
    report = RunReport(spec, None, t_start=0.0)
    report.layout = config.layout
    out = report.finish(ParquetStore(str(tmp_path / "o")))
    lay = out["layout"]
    assert lay["mode"] == "pd" and lay["chosen_by"] == "solver" and "simulated" in lay["reason"]
    assert lay["expected"]["docs_per_s"] > 0 and set(lay["measured"]) == {"docs_per_s", "tokens_per_s"}
    assert out["cost"]["usd_per_hour"] == pytest.approx(lay["expected"]["usd_per_hour"])
    assert {p["role"] for p in out["plan"]["pools"]} == {"prefill", "decode"}
    page = (tmp_path / "o" / "_report.html").read_text()
    assert 'data-key="layout.chosen_by"' in page and 'data-key="layout.expected.docs_per_s"' in page
    assert "layouts the solver weighed" in page


def test_resolve_layout_without_the_clusters_chips_waits_for_them():
    spec = load_job("jobs/papers.yaml", ["cluster.address=auto"])
    from dlbatch.backends.native import NativeBackend

    assert resolve_layout(spec, NativeBackend, NativeBackend.roles, max_model_len=4096) is None

"""`dlbatch profile | plan | simulate` end to end on this machine (tiny model for the profile,
the sample job's four PDFs and the datasheet catalog for plan/simulate)."""
from __future__ import annotations

import glob
import json
import os
import re

import pytest

from dlbatch.cli import main
from dlbatch.engine.config import DEFAULT_MAX_NUM_SEQS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "jobs", "papers.yaml")
CATALOG = os.path.join(ROOT, "configs", "chips", "catalog.yaml")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny") / "smollm")
    make_tiny_model("smollm", path)
    return path


@pytest.fixture(scope="module")
def tiny_profile(tiny_model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prof") / "tiny-cpu.yaml")
    rc = main(["profile", "--device", "cpu", "--model", tiny_model, "--name", "tiny-cpu", "--out", out, "--quick",
               "--threads", "1", "--price-per-hour", "0.05"])
    assert rc == 0
    return out


def test_profile_quick_writes_a_loadable_profile(tiny_profile, tiny_model, capsys):
    import yaml

    from dlbatch.solver import load_profile

    prof = load_profile(tiny_profile)
    assert prof.name == "tiny-cpu" and prof.source == "measured" and prof.model == tiny_model
    assert prof.price_per_hour == pytest.approx(0.05)
    # every measured time is positive and the fits predict positive, increasing times
    assert len(prof.prefill_points) >= 5 and len(prof.decode_points) >= 4
    assert all(p[2] > 0 for p in prof.prefill_points + prof.decode_points)
    assert sum(prof.prefill.as_tuple()) > 0 and sum(prof.decode.as_tuple()) > 0
    assert prof.prefill_time(128) > 0 and prof.prefill_time(256) > prof.prefill_time(1) * 0.999
    assert prof.decode_step_time(1, 64) > 0
    # the engine found the cached context it was given (points record the actual hit)
    assert any(p[1] > 0 for p in prof.prefill_points)
    assert prof.memory_bytes > 0 and prof.kv_link_bw > 0 and prof.mem_bw > 0
    raw = yaml.safe_load(open(tiny_profile))
    m = raw["measured"]
    assert m["compute_dtype"] in ("float32", "bfloat16") and m["requested_dtype"] == "bfloat16"
    assert -1.0 <= m["r2_prefill"] <= 1.0 and -1.0 <= m["r2_decode"] <= 1.0
    assert m["kv_bandwidth"]["transport"] == "memcpy"


def test_profile_bad_device_exits_2(capsys):
    rc = main(["profile", "--device", "tpu", "--model", "x", "--name", "n", "--out", "/dev/null"])
    assert rc == 2
    assert "tpu" in capsys.readouterr().err


def _plan(tmp_path, *extra):
    out = str(tmp_path / "plan.json")
    rc = main(["plan", JOB, "--chips", CATALOG, "--no-report", "--json", out, *extra])
    return rc, out


def test_plan_catalog_writes_json_the_runner_reads(tmp_path, capsys):
    rc, out = _plan(tmp_path, "--available", "h100_sxm=2", "l4=4", "--docs", "10000")
    cap = capsys.readouterr()
    text = cap.out
    assert rc == 0
    assert "workload: 10,000 documents" in text and "predicted:" in text and "bottleneck:" in text
    assert re.search(r"chip\s+role\s+replicas", text)
    plan = json.load(open(out))
    assert plan["pools"] and plan["usd_per_hour"] == pytest.approx(plan["cost_per_hour"])
    assert plan["max_batch"] == DEFAULT_MAX_NUM_SEQS and plan["chunk_tokens"] == 4096
    for p in plan["pools"]:
        assert p["role"] in ("prefill", "decode", "colocated") and p["replicas"] >= 1
        assert p["chip_resource"] == p["chip"] and p["chip"] in ("h100_sxm", "l4")
    roles = [p["role"] for p in plan["pools"]]
    if len(set(roles)) != len(roles):  # the runner runs one pool per role: plan says so
        assert "one pool per role" in cap.err
    # Plan.from_dict accepts what plan wrote (runner-only keys included)
    from dlbatch.solver import Plan

    back = Plan.from_dict(plan)
    assert back.pools[0].chip_resource == plan["pools"][0]["chip_resource"]


def test_plan_one_chip_type_compares_colocated_and_pd_and_runner_reads_it(tmp_path, capsys):
    rc, out = _plan(tmp_path, "--available", "l4=4", "--docs", "1000")
    text = capsys.readouterr().out
    assert rc == 0
    assert "alternative" in text and "colocated" in text and "chip:l4" in text
    plan = json.load(open(out))
    assert sum(p["replicas"] for p in plan["pools"]) <= 4
    # the runner's view of the plan: one PoolSpec per role, placed on Ray resource chip:<name>
    from dlbatch.jobspec import load_job
    from dlbatch.driver.config import RunConfig
    from dlbatch.workers.session import chip_resource

    pools = RunConfig.resolve(load_job(JOB), plan).pools
    assert set(pools) == {p["role"] for p in plan["pools"]}
    for p in plan["pools"]:
        assert pools[p["role"]].replicas == p["replicas"]
        assert chip_resource(pools[p["role"]].chip) == "chip:l4"


def test_simulate_runs_on_the_plan(tmp_path, capsys):
    rc, out = _plan(tmp_path, "--available", "l4=3", "--docs", "500")
    assert rc == 0
    capsys.readouterr()
    sim_json = str(tmp_path / "sim.json")
    rc = main(["simulate", JOB, "--plan", out, "--chips", CATALOG, "--no-report", "--docs", "300", "--json", sim_json])
    text = capsys.readouterr().out
    assert rc == 0
    assert "simulation of 300 documents" in text and "throughput" in text
    res = json.load(open(sim_json))
    assert res["n_docs"] == 300 and res["docs_per_s"] > 0


def test_zero_availability_exits_2_with_numbers(tmp_path, capsys):
    rc, _ = _plan(tmp_path, "--available", "h100_sxm=0")
    err = capsys.readouterr().err
    assert rc == 2 and "zero availability" in err and "0" in err


def test_unknown_chip_and_missing_available_exit_2(tmp_path, capsys):
    rc, _ = _plan(tmp_path, "--available", "nope=3")
    err = capsys.readouterr().err
    assert rc == 2 and "nope" in err
    rc, _ = _plan(tmp_path)
    err = capsys.readouterr().err
    assert rc == 2 and "--available" in err


def test_unreachable_deadline_exits_2_with_numbers(tmp_path, capsys):
    rc, _ = _plan(tmp_path, "--available", "l4=1", "--docs", "1000000", "--objective", "deadline",
                  "--deadline", "0.01")
    err = capsys.readouterr().err
    assert rc == 2 and "deadline 0.01 h is unreachable" in err
    assert re.search(r"\d[\d,]*\.\d+ docs/s", err)


def test_model_fits_no_chip_exits_2_with_numbers(tmp_path, capsys):
    cat = tmp_path / "small.yaml"
    cat.write_text("chips:\n  tiny_chip:\n    bf16_tflops: 10\n    memory_gb: 0.2\n    memory_gbps: 100\n"
                   "    interconnect_gbps: 10\n    kv_link_gbps: 1\n    price_per_hour: 0.1\n"
                   "    source: test chip\n")
    out = str(tmp_path / "p.json")
    rc = main(["plan", JOB, "--chips", str(cat), "--no-report", "--available", "tiny_chip=4", "--json", out])
    err = capsys.readouterr().err
    assert rc == 2 and "fits no available chip" in err
    assert re.search(r"\d+(\.\d+)? [GM]B", err)
    assert not os.path.exists(out)


def test_bad_available_syntax_exits_2(tmp_path, capsys):
    rc, _ = _plan(tmp_path, "--available", "l4:3")
    assert rc == 2 and "CHIP=COUNT" in capsys.readouterr().err


def test_plan_without_available_uses_the_local_profiled_chips(tmp_path, capsys):
    """A local run (cluster.address null) plans for this machine's measured profiles
    (configs/chips/cpu-local.yaml); a cluster job still needs --available."""
    out = str(tmp_path / "plan.json")
    local = os.path.join(ROOT, "configs", "chips", "cpu-local.yaml")
    rc = main(["plan", JOB, "--chips", CATALOG, local, "--no-report", "--json", out])
    text = capsys.readouterr().out
    assert rc == 0 and "cpu-local=1" in text
    plan = json.load(open(out))
    assert plan["pools"] and {p["chip_resource"] for p in plan["pools"]} == {"cpu-local"}
    assert sum(p["replicas"] for p in plan["pools"]) == 1  # one machine: one chip, one pool
    rc = main(["plan", JOB, "--chips", CATALOG, local, "--no-report", "--set", "cluster.address=auto"])
    err = capsys.readouterr().err
    assert rc == 2 and "--available" in err and "cluster" in err


# the jobs on the bundled model: the GPU job (a 7B model on A100 pools) and the figures job (a
# vision-language model) name models not bundled; tests/test_validate.py checks them offline
SAMPLE_JOBS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "jobs", "*.yaml"))
                     if os.path.basename(p) not in ("gpu_vllm.yaml", "papers_figures.yaml"))


@pytest.mark.parametrize("job", SAMPLE_JOBS)
def test_plan_on_this_machine_chooses_colocated_for_the_sample_jobs(job, tmp_path, capsys, monkeypatch):
    """One chip type (this machine): colocated, which `dlbatch run` runs for every sample job
    that names no pools; jobs/papers_pd.yaml names prefill/decode pools and runs those."""
    monkeypatch.chdir(ROOT)
    rc = main(["plan", job, "--sample", "2", "--no-report", "--set", f"output.path={tmp_path / 'out'}"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "layouts on cpu-local=1" in text and "solver's choice: colocated: colocated cpu-local x1" in text
    from dlbatch.jobspec import load_job

    if load_job(job).cluster.pools():
        assert "`dlbatch run` runs: prefill fast x1, decode cheap x1; chosen by job" in text
    else:
        assert "`dlbatch run` runs: colocated cpu-local x1; chosen by solver: one chip type" in text

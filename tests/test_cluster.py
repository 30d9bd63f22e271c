"""Running on a real Ray cluster: `dlbatch submit/logs/stop` through the Jobs API and
`dlbatch run --address` against a `ray start --head` cluster on 127.0.0.1; the incremental
daily job; the HTML report of a cluster run checked against its JSON.

The cluster is this test module's own: its own temp dir, free ports for every listener, a
process group of its own. It is torn down by signalling that group (never `ray stop`, which
would stop every Ray on the machine, other people's test clusters included).
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.cluster import (CLUSTER_TOKEN, JOB_TIMEOUT, ROOT, TINY, LocalCluster, cluster_env, free_ports,
                                   run_dlbatch)


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster({"chip:cpu-local": 2})  # one chip type, profiled: jobs naming no pools run colocated on it
    c.start()
    try:
        yield c
    finally:
        c.stop()
        leftover = c.alive_pids()
        assert not leftover, f"processes of the test cluster still alive: {leftover}"


def read_rows(out: Path):
    import pyarrow.parquet as pq

    files = sorted(out.glob("part-*.parquet"))
    assert files, f"no parquet parts in {out}: {sorted(p.name for p in out.iterdir())}"
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def assert_complete(out: Path, docs: int, tasks=("summary", "keywords", "question")) -> dict:
    rows = read_rows(out)
    assert len(rows) == docs * len(tasks), rows
    by_doc: dict[str, set] = {}
    for r in rows:
        by_doc.setdefault(r["doc_id"], set()).add(r["task"])
    assert len(by_doc) == docs and all(ts == set(tasks) for ts in by_doc.values()), by_doc
    assert all(r["output_tokens"] >= 1 for r in rows)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["complete"] is True
    report = json.loads((out / "_report.json").read_text())
    assert report["docs_ok"] == docs and report["docs_failed"] == 0
    return report


# --------------------------------------------------------------------------- no cluster needed


def test_unreachable_dashboard_is_a_clear_error_without_hanging():
    port = free_ports(1)[0]
    t0 = time.monotonic()
    r = run_dlbatch("submit", "jobs/papers.yaml", "--address", f"http://127.0.0.1:{port}", "--connect-timeout", "3",
                "--wait", timeout=60)
    assert r.returncode == 1
    assert f"http://127.0.0.1:{port}" in r.stderr and "cannot reach the Ray dashboard" in r.stderr
    assert time.monotonic() - t0 < 30
    r = run_dlbatch("logs", "raysubmit_x", "--address", f"127.0.0.1:{port}", "--connect-timeout", "3", timeout=60)
    assert r.returncode == 1 and f"http://127.0.0.1:{port}" in r.stderr
    r = run_dlbatch("stop", "raysubmit_x", "--address", "ray://127.0.0.1:10001", timeout=60)
    assert r.returncode == 2 and "dashboard" in r.stderr


def test_upload_holds_code_and_a_resolved_job(tmp_path, monkeypatch):
    from dlbatch.cli.cluster import build_upload, entrypoint
    from dlbatch.jobspec import load_job

    monkeypatch.chdir(ROOT)
    spec = load_job("jobs/papers.yaml", ["output.path=out/elsewhere", "input.limit=2"])
    rel = build_upload(spec, str(tmp_path))
    assert not os.path.isabs(rel)
    for pkg in ("dlbatch", "connectors", "pipelines"):
        assert (tmp_path / pkg / "__init__.py").exists()
    assert not list(tmp_path.rglob("__pycache__")) and not (tmp_path / ".venv").exists()
    assert not (tmp_path / "out").exists() and not (tmp_path / "samples").exists()
    monkeypatch.chdir(tmp_path)  # the job reloads on the cluster, in the upload, to the same absolute paths
    again = load_job(rel)
    assert again.input.path == str(ROOT / "samples" / "papers")
    assert again.output.path == str(ROOT / "out" / "elsewhere")
    assert again.input.limit == 2 and again.cluster.address is None
    from dlbatch.jobspec import job_fingerprint

    assert job_fingerprint(again) == job_fingerprint(spec)
    assert entrypoint(rel).split()[:4] == ["python", "-m", "dlbatch.cli", "run"]
    assert "--address auto" in entrypoint(rel)


# --------------------------------------------------------------------------- against the cluster


def _client(cluster):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(cluster.dashboard, headers={"Authorization": f"Bearer {CLUSTER_TOKEN}"})


@pytest.mark.ray
@pytest.mark.timeout(1200)  # includes starting the cluster, slow on a loaded machine
def test_submit_wait_then_logs(cluster, tmp_path):
    out = tmp_path / "papers"
    r = run_dlbatch("submit", "jobs/papers.yaml", "--address", cluster.dashboard, "--set", f"output.path={out}",
                *TINY, "--wait", "--timeout", str(JOB_TIMEOUT - 60))
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}\n{cluster.start_log()[-2000:]}"
    sid = r.stdout.strip().splitlines()[0]
    assert sid and " " not in sid
    assert "SUCCEEDED" in r.stderr
    assert _client(cluster).get_job_status(sid).value == "SUCCEEDED"
    report = assert_complete(out, docs=1)
    assert report["docs_this_run"] == 1
    # no pools named: the solver's layout on the cluster's chip resources, one type: colocated on every slot
    assert report["layout"]["chosen_by"] == "solver" and report["layout"]["chips"] == {"cpu-local": 2}
    assert report["pools"]["colocated"]["replicas"] == 2

    # logs, here without RAY_AUTH_MODE: dlbatch finds the token and sends it itself
    env = cluster_env()
    env.pop("RAY_AUTH_MODE")
    r = run_dlbatch("logs", sid, "--address", cluster.dashboard.replace("http://", ""), timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "job 'papers' finished: 1 documents ok" in r.stdout
    assert f"{out}/_report.html" in r.stdout
    assert "attached to Ray cluster at auto" in r.stdout  # the job's driver used the cluster it runs on

    r = run_dlbatch("logs", sid, "--address", cluster.dashboard, "--follow", "--timeout", "60", timeout=120)
    assert r.returncode == 0 and "job 'papers' finished" in r.stdout and "SUCCEEDED" in r.stderr

    r = run_dlbatch("logs", "raysubmit_no_such_job", "--address", cluster.dashboard, timeout=120)
    assert r.returncode == 1 and "raysubmit_no_such_job" in r.stderr and cluster.dashboard in r.stderr

    # a finished job: stop says so and succeeds
    r = run_dlbatch("stop", sid, "--address", cluster.dashboard, timeout=120)
    assert r.returncode == 0 and "already SUCCEEDED" in r.stdout


@pytest.mark.ray
@pytest.mark.timeout(1200)  # includes starting the cluster, slow on a loaded machine
def test_stop_a_running_job(cluster, tmp_path):
    out = tmp_path / "long"
    r = run_dlbatch("submit", "jobs/papers.yaml", "--address", cluster.dashboard, "--set", f"output.path={out}",
                "--set", "input.limit=4", "--set", "tasks.0.max_tokens=128", "--set", "model.max_model_len=2048",
                "--submission-id", f"dlbatch-stop-{uuid.uuid4().hex[:8]}", timeout=120)
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip().splitlines()[0]
    assert sid.startswith("dlbatch-stop-")
    client = _client(cluster)
    deadline = time.monotonic() + 120
    while client.get_job_status(sid).value == "PENDING" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert client.get_job_status(sid).value == "RUNNING"
    r = run_dlbatch("stop", sid, "--address", cluster.dashboard, "--timeout", "90", timeout=180)
    assert r.returncode == 0, r.stderr
    assert f"job {sid}: STOPPED" in r.stdout
    assert client.get_job_status(sid).value == "STOPPED"
    # --wait on a stopped job reports the failure with exit 1
    from dlbatch.cli.cluster import wait_for

    assert wait_for(client, sid, cluster.dashboard, timeout=10) == 1
    # the stopped job wrote no complete output
    manifest = out / "_manifest.json"
    assert not manifest.exists() or json.loads(manifest.read_text())["complete"] is False


@pytest.mark.ray
@pytest.mark.timeout(1200)  # includes starting the cluster, slow on a loaded machine
def test_run_attached_and_its_report(cluster, tmp_path):
    from tests.helpers.report_html import PNG_MAGIC, lookup, parse, same

    from dlbatch.report.html import HEADLINE_KEYS

    out = tmp_path / "attached"
    r = run_dlbatch("run", "jobs/papers_pd.yaml", "--address", cluster.gcs, "--no-progress",
                "--set", f"output.path={out}", "--set", "cluster.prefill.chip=cpu-local",
                "--set", "cluster.decode.chip=cpu-local", *TINY)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert f"attached to Ray cluster at {cluster.gcs}" in r.stderr  # not an embedded local Ray
    report = assert_complete(out, docs=1)
    assert report["pools"]["prefill"]["replicas"] == 1 and report["pools"]["decode"]["replicas"] == 1

    html_path, png_path = out / "_report.html", out / "_report.png"
    parsed = parse(html_path)
    for key, _ in HEADLINE_KEYS:
        if key in report:
            assert key in parsed.values, key
    for role in ("prefill", "decode"):
        for f in ("busy_fraction", "replicas", "chip"):
            assert f"pools.{role}.{f}" in parsed.values
    assert parsed.values, "no data-key values in the report page"
    for key, text in parsed.values.items():
        assert same(text, lookup(report, key)), (key, text, lookup(report, key))
    png = png_path.read_bytes()
    assert png.startswith(PNG_MAGIC) and png[12:16] == b"IHDR"
    import base64

    assert len(parsed.images) == 1 and base64.b64decode(parsed.images[0].split(",", 1)[1]) == png
    assert parsed.external == []


def _report(out: Path) -> dict:
    return json.loads((out / "_report.json").read_text())


@pytest.mark.ray
@pytest.mark.timeout(1200)  # includes starting the cluster, slow on a loaded machine
@pytest.mark.slow
def test_incremental_daily_job(cluster, tmp_path):
    """The jobs/daily_incremental.yaml example, as cron would run it: N files, then M more."""
    pdfs = sorted((ROOT / "samples" / "papers").glob("*.pdf"))
    assert len(pdfs) >= 3
    incoming, out = tmp_path / "incoming", tmp_path / "daily"
    incoming.mkdir()
    for p in pdfs[:2]:
        shutil.copy(p, incoming / p.name)
    args = ["run", "jobs/daily_incremental.yaml", "--address", cluster.gcs, "--no-progress",
            "--set", f"input.path={incoming}", "--set", f"output.path={out}", "--set", "tasks.0.max_tokens=6",
            "--set", "tasks.1.max_tokens=4", "--set", "model.max_model_len=2048"]
    run_dlbatch(*args, check=True)
    first = _report(out)
    assert first["docs_this_run"] == 2 and first["rows_written"] == 4 and first["docs_ok"] == 2
    rows = read_rows(out)
    assert len(rows) == 4

    shutil.copy(pdfs[2], incoming / pdfs[2].name)  # a new file arrives
    run_dlbatch(*args, check=True)
    second = _report(out)
    assert second["docs_this_run"] == 1 and second["rows_written"] == 2 and second["docs_ok"] == 3
    rows = read_rows(out)
    assert len(rows) == 6
    keys = [(r["doc_id"], r["task"]) for r in rows]
    assert len(set(keys)) == 6
    assert {Path(r["source"]).name for r in rows} == {p.name for p in pdfs[:3]}

    r = run_dlbatch(*args, check=True)  # nothing new: a no-op that writes nothing
    assert "already complete" in r.stderr
    assert len(read_rows(out)) == 6 and _report(out) == second


# --------------------------------------------------------------------------- metrics helper


def test_metrics_are_noops_without_ray(monkeypatch):
    import dlbatch.report.metrics as dm

    monkeypatch.setattr(dm, "_ray_ready", lambda: False)
    m = dm.JobMetrics("papers")
    assert m.enabled is False
    m.docs(ok=1, failed=1)
    m.tokens(prompt=10, output=2)
    m.inflight(3)
    m.worker_busy("decode", 0, 0.5)  # nothing to record to, nothing raised


def test_metrics_record_through_ray_util_metrics(monkeypatch):
    import ray.util.metrics as rm

    import dlbatch.report.metrics as dm

    calls = []

    class Fake:
        def __init__(self, name, description="", tag_keys=()):
            self.name, self.tag_keys = name, tag_keys

        def _check(self, tags):
            assert set(tags) == set(self.tag_keys), (self.name, tags)

    class FakeCounter(Fake):
        def inc(self, value=1.0, tags=None):
            self._check(tags)
            calls.append(("inc", self.name, value, tags))

    class FakeGauge(Fake):
        def set(self, value, tags=None):
            self._check(tags)
            calls.append(("set", self.name, value, tags))

    monkeypatch.setattr(rm, "Counter", FakeCounter)
    monkeypatch.setattr(rm, "Gauge", FakeGauge)
    monkeypatch.setattr(dm, "_ray_ready", lambda: True)
    m = dm.JobMetrics("papers")
    assert m.enabled
    m.docs(ok=2)
    m.tokens(prompt=100, output=7)
    m.inflight(4)
    m.worker_busy("prefill", 1, 0.25)
    assert ("inc", "dlbatch_docs_done", 2, {"job": "papers"}) in calls
    assert not any(c[1] == "dlbatch_docs_failed" for c in calls)  # zero increments are skipped
    assert ("inc", "dlbatch_output_tokens", 7, {"job": "papers"}) in calls
    assert ("set", "dlbatch_requests_inflight", 4, {"job": "papers"}) in calls
    assert ("set", "dlbatch_worker_busy_fraction", 0.25,
            {"job": "papers", "role": "prefill", "worker": "1"}) in calls

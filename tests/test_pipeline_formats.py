"""`dlbatch run` on every input format, and on s3:// input and output served by a real S3
server (moto) on 127.0.0.1: the same job, the same rows out, bad records dead-lettered."""
from __future__ import annotations

import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlbatch.jobspec import load_job

pytestmark = pytest.mark.ray

DOCS = {"d1": "Graph networks learn molecular properties from atoms and bonds. We test them on ten data sets.",
        "d2": "We measure the thermal conductivity of thin films with a new optical method and compare."}
FAST = ["tasks.0.max_tokens=2", "tasks.1.max_tokens=2", "tasks.2.max_tokens=2", "model.max_model_len=1024",
        "model.dtype=float32", "cluster.colocated={chip: fast, replicas: 1, num_cpus: 0.5}"]


def _run(overrides):
    from dlbatch.driver.runner import JobRunner

    spec = load_job("jobs/papers.yaml", FAST + overrides)
    report = JobRunner(spec, fresh=True, progress=False).run()
    from dlbatch.output.parquet_store import ParquetStore

    store = ParquetStore(spec.output.path, spec.output.storage_options)
    rows = store.results().to_pylist()
    return report, rows, store


@pytest.fixture
def small_parts(monkeypatch):
    """Read tasks of a few dozen bytes (connectors/read_tasks.py): every input of more than a
    row or two is cut into parts, so a run reads it as a large file is read."""
    import connectors.read_tasks as read_tasks

    monkeypatch.setattr(read_tasks, "READ_TASK_BYTES", 64)
    monkeypatch.setattr(read_tasks, "FIRST_TASK_BYTES", 32)


def _workers_before_listing(report) -> bool:
    """Did the workers start (Ray attached, actors created) before the checks that list the
    inputs ended? (dlbatch/driver/early_start.py: remote inputs only)"""
    iv = report["startup"]["intervals_s"]
    return iv["ray_start"][0] < iv["checks"][1]


def _check(report, rows, docs_ok, docs_failed):
    assert report["docs_ok"] == docs_ok and report["docs_failed"] == docs_failed
    assert len(rows) == 3 * docs_ok and report["rows_written"] == 3 * docs_ok
    assert {r["task"] for r in rows} == {"summary", "keywords", "question"}
    assert all(r["output_tokens"] >= 1 and r["prompt_tokens"] > 20 for r in rows)


def test_parquet_text_and_hf_inputs(ray_local, sample_model, tmp_path, small_parts):
    import datasets

    # Parquet, with one row whose text is missing -> dead-lettered, the job goes on; a row
    # group per row: read in parts (small_parts)
    pq.write_table(pa.table({"id": ["d1", "d2", "d3"], "body": [DOCS["d1"], DOCS["d2"], None]}),
                   tmp_path / "docs.parquet", row_group_size=1)
    rep, rows, store = _run(["input.format=parquet", f"input.path={tmp_path / 'docs.parquet'}",
                             "input.text_field=body", "input.id_field=id", f"output.path={tmp_path / 'o-pq'}"])
    _check(rep, rows, 2, 1)
    assert {r["doc_id"] for r in rows} == {"d1", "d2"}
    assert not _workers_before_listing(rep)  # a local input: listed and checked first, then the workers
    errors = store.errors().to_pylist()
    assert [(e["doc_id"], e["error_type"], e["source"].rsplit("#", 1)[1]) for e in errors] == \
        [("d3", "MissingField", "row2")]

    # plain text files (ids from content)
    (tmp_path / "txt").mkdir()
    for k, v in DOCS.items():
        (tmp_path / "txt" / f"{k}.txt").write_text(v)
    rep, rows, _ = _run(["input.format=text", f"input.path={tmp_path / 'txt'}", f"output.path={tmp_path / 'o-txt'}"])
    _check(rep, rows, 2, 0)

    # a saved Hugging Face dataset (no hub access)
    datasets.Dataset.from_dict({"uid": list(DOCS), "text": list(DOCS.values())}).save_to_disk(str(tmp_path / "hf"))
    rep, rows, _ = _run(["input.format=hf", f"input.path={tmp_path / 'hf'}", "input.id_field=uid",
                         f"output.path={tmp_path / 'o-hf'}"])
    _check(rep, rows, 2, 0)
    assert {r["doc_id"] for r in rows} == {"d1", "d2"}


def test_s3_input_and_output_on_loopback(ray_local, sample_model, s3_bucket, s3_options, small_parts):
    """The JSONL object is read in byte-range parts (small_parts): seeks and ranged reads."""
    fs = fsspec.filesystem("s3", **s3_options)
    fs.pipe_file(f"{s3_bucket}/in/docs.jsonl",
                 "".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in DOCS.items()).encode())
    opts = json.dumps(s3_options)
    rep, rows, store = _run(["input.format=jsonl", f"input.path=s3://{s3_bucket}/in/docs.jsonl", "input.id_field=id",
                             f"input.storage_options={opts}", f"output.path=s3://{s3_bucket}/out",
                             f"output.storage_options={opts}"])
    _check(rep, rows, 2, 0)
    assert {r["doc_id"] for r in rows} == {"d1", "d2"}
    assert _workers_before_listing(rep)  # a remote input: the workers load while it is listed
    from connectors.read_tasks import plan_read_tasks

    assert len(plan_read_tasks([(f"s3://{s3_bucket}/in/docs.jsonl", None)], "jsonl", s3_options)) == 2
    assert {(r["doc_id"], r["source"].rsplit("#", 1)[1]) for r in rows} == {("d1", "line1"), ("d2", "line2")}
    assert fs.exists(f"{s3_bucket}/out/_report.json")
    assert any(p.endswith(".parquet") for p in fs.find(f"{s3_bucket}/out"))

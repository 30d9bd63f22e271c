"""The output folder as readers meet it (issue 38, point 6): the natural DuckDB glob
``read_parquet('<out>/*.parquet')`` reads exactly the result rows (no bookkeeping file matches
``*.parquet`` at the top), and ``pd.read_parquet('<out>/_errors')`` works when nothing failed."""
from __future__ import annotations

import os

import pandas as pd
import pytest

from dlbatch.output.files import OLD_SOURCES_FILE, SOURCES_FILE
from dlbatch.output.parquet_store import ParquetStore
from dlbatch.records import ERROR_COLUMNS
from tests.helpers.lease_holder import doc_rows


def _finished(out):
    """An output as a run leaves it: parts under a lease, input versions, manifest, report."""
    store = ParquetStore(str(out))
    store.files.take_lease("j")
    store.recover()
    store.progress()
    store.files.write_sources({"in.jsonl": [None, "sha256:1"], "other.jsonl": ["k", "sha256:2"]})
    for d in ("a", "b", "c"):
        store.commit(doc_rows(d), [], False)
    store.files.write_json("_manifest.json", {"name": "j", "complete": True})
    store.files.write_json("_report.json", {"job": "j"})
    store.files.release_lease()
    return store


def test_the_natural_duckdb_glob_reads_exactly_the_rows_and_errors_read_when_empty(tmp_path):
    import duckdb

    out = tmp_path / "out"
    _finished(out)
    top = [f for f in os.listdir(out) if f.endswith(".parquet")]
    assert top and all(f.startswith("part-") for f in top)  # no bookkeeping file matches *.parquet
    got = duckdb.sql(f"SELECT doc_id, task FROM read_parquet('{out}/*.parquet')").fetchall()
    assert sorted(got) == sorted((d, t) for d in "abc" for t in ("summary", "keywords"))
    errors = pd.read_parquet(out / "_errors")
    assert len(errors) == 0 and list(errors.columns) == ERROR_COLUMNS
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/_errors/*.parquet')").fetchall() == [(0,)]
    assert len(pd.read_parquet(out)) == 6  # pyarrow skips the _ folders


def test_an_output_written_before_keeps_its_input_versions(tmp_path):
    """``_sources.parquet`` of an earlier output is read on resume; the next write replaces it
    by ``_sources.arrow``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"source": ["a.pdf"], "stat": ["k"], "version": ["sha256:1"]}), out / OLD_SOURCES_FILE)
    store = ParquetStore(str(out))
    assert store.files.read_sources() == {"a.pdf": ["k", "sha256:1"]}
    store.files.write_sources({"a.pdf": ["k", "sha256:1"], "b.pdf": [None, "sha256:2"]})
    assert not (out / OLD_SOURCES_FILE).exists() and (out / SOURCES_FILE).exists()
    assert ParquetStore(str(out)).files.read_sources() == {"a.pdf": ["k", "sha256:1"], "b.pdf": [None, "sha256:2"]}


@pytest.mark.slow
@pytest.mark.ray
def test_a_finished_runs_output_reads_with_the_natural_queries(ray_local, sample_model, tmp_path):
    import duckdb

    from tests.helpers.jobs import run_job, write_jsonl

    src = write_jsonl(tmp_path / "docs.jsonl", {"alpha": "Solar cells convert light into electricity. " * 3,
                                                 "beta": "Songbirds migrate at night by day length. " * 3})
    out = tmp_path / "out"
    rep = run_job("jobs/papers_jsonl.yaml", str(out), [f"input.path={src}", "input.id_field=id"])
    assert rep["docs_ok"] == 2 and rep["docs_failed"] == 0 and rep["orphans"] == {"count": 0, "parts": []}
    rows = ParquetStore(str(out)).results().num_rows
    assert rows == 6
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/*.parquet')").fetchall() == [(rows,)]
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/part-*.parquet')").fetchall() == [(rows,)]
    assert len(pd.read_parquet(out / "_errors")) == 0 and len(pd.read_parquet(out)) == rows

"""Delta Lake output (`output.format: delta`, dlbatch/output/delta_store.py): commits are
Delta transactions with an idempotent application transaction id; progress, dead letters,
supersede, compaction and --fresh on the table; deltalake, duckdb and polars see exactly the
committed rows. The slow drill kills `dlbatch run` (kill -9) mid-job and reruns it."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

deltalake = pytest.importorskip("deltalake")

from dlbatch.output import open_store, run_store  # noqa: E402
from dlbatch.output.dead_letters import ERRORS_DIR  # noqa: E402
from dlbatch.output.delta_store import DeltaStore, delta_storage_options  # noqa: E402
from dlbatch.output.parquet_store import ParquetStore  # noqa: E402
from dlbatch.output.rows import result_table  # noqa: E402
from tests.helpers.jobs import (REPO, SEQ, cli_sets, cli_status, kill_group_and_ray, ray_env,  # noqa: E402
                                start_run)

ROW = {"output": "generated text", "prompt_tokens": 10, "output_tokens": 2, "finish_reason": "length",
       "truncated": False, "model": "m"}
TASKS = ("summary", "keywords")


def _rows(doc: str, source: str = "a.jsonl", tasks=TASKS):
    return [{**ROW, "doc_id": doc, "source": source, "task": t} for t in tasks]


def _err(doc: str, source: str = "a.jsonl", task=None):
    return {"doc_id": doc, "source": source, "task": task, "stage": "generate", "error_type": "X", "error": "boom"}


def _keys(table):
    return sorted(zip(table.column("doc_id").to_pylist(), table.column("task").to_pylist()))


def _reader_keys(path):
    """(doc_id, task) pairs as deltalake, duckdb (over the snapshot's Arrow table and over its
    data files) and polars see them: all four must agree."""
    import duckdb
    import polars as pl

    dt = deltalake.DeltaTable(path)
    arrow = dt.to_pyarrow_table(columns=["doc_id", "task"])
    by_arrow = duckdb.sql("SELECT doc_id, task FROM arrow ORDER BY ALL").fetchall()
    by_files = duckdb.sql(f"SELECT doc_id, task FROM read_parquet({dt.file_uris()!r}) ORDER BY ALL").fetchall()
    by_polars = sorted(pl.read_delta(path).select(["doc_id", "task"]).iter_rows())
    assert _keys(arrow) == by_arrow == by_files == by_polars
    return by_arrow


def _pending(out):
    return [f for f in os.listdir(os.path.join(out, ERRORS_DIR, "_pending")) if f.endswith(".parquet")]


def _fill(store):
    """Three flushes (one with a task that failed alone), one of dead letters only."""
    store.commit(_rows("d1") + _rows("d2"), [], include_text=False)
    store.commit(_rows("d3", "b.jsonl", tasks=("summary",)), [_err("d3", "b.jsonl", task="keywords")], False)
    store.commit([], [_err("d4")], include_text=False)
    store.commit(_rows("d5", "b.jsonl"), [], include_text=False)


# --------------------------------------------------------------------------------- commit and read
def test_commit_progress_and_readers_see_exactly_the_rows(tmp_path):
    out = str(tmp_path / "out")
    store = DeltaStore(out)
    assert store.progress(tasks=set(TASKS))["rows"] == 0  # no table yet
    _fill(store)
    expected = sorted([(d, t) for d in ("d1", "d2", "d5") for t in TASKS] + [("d3", "summary")])
    assert _reader_keys(out) == expected
    prog = DeltaStore(out).progress(tasks=set(TASKS))
    assert (prog["rows"], prog["n_done"], prog["n_failed"], prog["duplicates"]) == (7, 4, 1, 0)
    assert sorted(prog["done_ids"].to_pylist()) == ["d1", "d2", "d3", "d5"] and prog["failed_ids"].to_pylist() == ["d4"]
    assert prog["prompt_tokens"] == 70 and prog["sources"] == {"a.jsonl", "b.jsonl"}
    dt = deltalake.DeltaTable(out)
    assert dt.version() == 2  # three appends: versions 0, 1, 2 (the dead-letter-only flush is no transaction)
    assert dt.transaction_version(store.app_id) == 3  # the run's commit sequence
    errs = store.errors()
    assert sorted(errs.column("doc_id").to_pylist()) == ["d3", "d4"]
    assert _pending(out) == []  # published, then removed
    # bookkeeping stays beside the table: Delta readers ignore the _ names
    store.files.write_json("_manifest.json", {"fingerprint": "f"})
    assert _reader_keys(out) == expected
    assert _keys(store.results(["doc_id", "task"])) == expected


def test_retried_commit_is_a_noop(tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    store = DeltaStore(out)
    store.commit(_rows("d1"), [], include_text=False)
    real = deltalake.write_deltalake
    calls = []

    def landed_reply_lost(*a, **k):  # the transaction lands, its reply does not
        calls.append(1)
        real(*a, **k)
        raise OSError("connection reset after the commit")

    # 1) inside one commit: the retry finds (app_id, version) in the log and writes nothing
    monkeypatch.setattr(deltalake, "write_deltalake", landed_reply_lost)
    store.commit(_rows("d2"), [], include_text=False)
    assert len(calls) == 1 and deltalake.DeltaTable(out).version() == 1
    # 2) the error escapes (one attempt), dead letters pending; the next flush holds the same
    #    rows plus new ones: the landed ones are dropped, its dead letters published
    monkeypatch.setattr("dlbatch.output.delta_store.COMMIT_ATTEMPTS", 1)
    with pytest.raises(OSError):
        store.commit(_rows("d3", tasks=("summary",)), [_err("d3", task="keywords")], include_text=False)
    monkeypatch.setattr(deltalake, "write_deltalake", real)
    store.commit(_rows("d3", tasks=("summary",)) + _rows("d4"), [_err("d3", task="keywords")], include_text=False)
    # 3) the same transaction from another store (same app_id, same version): a no-op
    again = DeltaStore(out)
    again._app_id = store.app_id
    again._append(result_table(_rows("d9"), False), 1)
    keys = _reader_keys(out)
    assert keys == sorted([(d, t) for d in ("d1", "d2", "d4") for t in TASKS] + [("d3", "summary")])
    prog = DeltaStore(out).progress(tasks=set(TASKS))
    assert prog["duplicates"] == 0 and prog["n_done"] == 4 and prog["n_failed"] == 0
    assert store.errors().column("doc_id").to_pylist() == ["d3"]


def test_dead_letters_count_only_when_their_transaction_landed(tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    store = DeltaStore(out)
    store.commit(_rows("d1"), [], include_text=False)
    # crash after the transaction, before the dead letters' copy: still counted, then published
    monkeypatch.setattr(store, "_publish", lambda name: None)
    store.commit(_rows("d2", tasks=("summary",)), [_err("d2", task="keywords")], include_text=False)

    # a commit that died before its transaction: its pending dead letters must not count
    def no_commit(*a, **k):
        raise OSError("killed")

    monkeypatch.setattr("dlbatch.output.delta_store.COMMIT_ATTEMPTS", 1)
    monkeypatch.setattr(deltalake, "write_deltalake", no_commit)
    with pytest.raises(OSError):
        store.commit(_rows("d3", tasks=("summary",)), [_err("d3", task="keywords")], include_text=False)
    monkeypatch.undo()
    assert len(_pending(out)) == 2
    rerun = DeltaStore(out)
    prog = rerun.progress(tasks=set(TASKS))
    assert sorted(prog["done_ids"].to_pylist()) == ["d1", "d2"] and prog["n_failed"] == 0
    assert rerun.recover() == {"error_copies": 1, "pending_dropped": 1, "compactions": 0}
    assert _pending(out) == []
    assert rerun.errors().column("doc_id").to_pylist() == ["d2"]
    assert sorted(rerun.progress(tasks=set(TASKS))["done_ids"].to_pylist()) == ["d1", "d2"]


def test_supersede_compact_and_fresh(tmp_path):
    out = tmp_path / "out"
    store = DeltaStore(str(out))
    _fill(store)
    for i in range(4):
        store.commit(_rows(f"e{i}", "c.txt"), [], include_text=False)
    version = deltalake.DeltaTable(str(out)).version()
    # supersede: one delete transaction; rows and dead letters of b.jsonl go
    assert store.supersede({"b.jsonl"}) == 3
    assert deltalake.DeltaTable(str(out)).version() == version + 1
    kept = sorted([(d, t) for d in ("d1", "d2", "e0", "e1", "e2", "e3") for t in TASKS])
    assert _reader_keys(str(out)) == kept
    assert store.errors().column("doc_id").to_pylist() == ["d4"]
    assert store.supersede({"b.jsonl"}) == 0  # again: nothing left to remove
    # compact: fewer data files, the same rows
    before = len(deltalake.DeltaTable(str(out)).file_uris())
    res = store.compact(min_parts=0)
    assert res["parts_before"] == before and res["parts_written"] == 1 and res["merged_parts"] == before
    assert len(deltalake.DeltaTable(str(out)).file_uris()) == 1 and _reader_keys(str(out)) == kept
    assert store.compact(min_parts=5)["merged_parts"] == 0  # one file: nothing to do
    # --fresh: the table and our files go, nothing else
    (out / "notes.txt").write_text("mine")
    (out / "year=2024").mkdir()
    (out / "year=2024" / "x.parquet").write_bytes(b"other job")
    store.files.write_json("_manifest.json", {"name": "j"})
    assert store.clear() > 0
    assert not deltalake.DeltaTable.is_deltatable(str(out))
    left = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    assert left == ["notes.txt", "year=2024/x.parquet"]  # (empty folders of ours may stay, as with Parquet)
    assert DeltaStore(str(out)).progress()["rows"] == 0


# ------------------------------------------------------------------------------- the job file
def test_job_file_format_selects_the_store_and_joins_the_fingerprint(tmp_path, monkeypatch):
    from dlbatch.jobspec import ResumeMismatchError, check_resume_compatible, fingerprint_fields, load_job
    from dlbatch.output.store import Store

    spec = load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}"])
    assert spec.output.format == "parquet" and "output.format" not in fingerprint_fields(spec)
    assert type(open_store(spec.output)) is ParquetStore and isinstance(open_store(spec.output), Store)
    delta = load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}", "output.format=delta"])
    assert fingerprint_fields(delta)["output.format"] == "delta"
    assert isinstance(open_store(delta.output), DeltaStore) and isinstance(open_store(delta.output), Store)
    with pytest.raises(ResumeMismatchError, match="output.format"):  # a Parquet output is not resumed as Delta
        check_resume_compatible(fingerprint_fields(spec), delta)
    with pytest.raises(Exception, match="format"):
        load_job("jobs/papers.yaml", ["output.format=iceberg"])
    monkeypatch.setitem(sys.modules, "deltalake", None)  # not installed
    with pytest.raises(ImportError, match=r"pip install 'dlbatch\[delta\]'"):
        open_store(delta.output)


def test_cli_status_and_compact_on_a_delta_output(tmp_path, capsys):
    from dlbatch.cli import main

    out = str(tmp_path / "out")
    store = DeltaStore(out)
    for i in range(3):
        store.commit(_rows(f"d{i}", tasks=("summary", "keywords", "question")), [], include_text=False)  # the job's
    sets = ["--set", f"output.path={out}", "--set", "output.format=delta"]  # the sample job's inputs
    assert main(["status", "jobs/papers.yaml", "--json", *sets]) == 0
    st = json.loads(capsys.readouterr().out.splitlines()[0])
    assert (st["rows"], st["docs_done"], st["duplicate_rows"]) == (9, 3, 0)
    assert main(["compact", "jobs/papers.yaml", *sets]) == 0
    assert "3 small parts merged into 1" in capsys.readouterr().out
    assert len(deltalake.DeltaTable(out).file_uris()) == 1 and len(_reader_keys(out)) == 9


def test_object_store_options_translated_for_delta_rs():
    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000",
                                                        "region_name": "us-east-1"}, "AWS_S3_X": 1}
    assert delta_storage_options("s3://b/out", opts) == {
        "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true", "AWS_S3_X": "1"}
    assert delta_storage_options("/local/out", {}) is None


# ----------------------------------------------------------------- driver kill -9, then rerun
def _delta_committed(out) -> bool:
    d = os.path.join(out, "_delta_log")
    return os.path.isdir(d) and any(f.endswith(".json") for f in os.listdir(d))


@pytest.mark.slow
@pytest.mark.ray
def test_driver_kill9_then_rerun_delta_exactly_once(sample_model, tmp_path, raytmp):
    import duckdb

    job, extra = "jobs/papers.yaml", ["input.limit=3", "output.format=delta", *SEQ]
    out = str(tmp_path / "out")
    seed = int(os.environ.get("DLBATCH_TEST_SEED", time.time_ns() % 1_000_000))
    print(f"delta driver kill seed: {seed} (rerun with DLBATCH_TEST_SEED={seed})")
    rng = random.Random(seed)
    for attempt in range(3):  # a run that died on its own before committing (Ray start-up) is redone
        with open(tmp_path / f"killed{attempt}.log", "wb") as logf:
            proc = start_run(job, out, extra, raytmp, logf)
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None and not _delta_committed(out):
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.5))  # a random moment after the first transaction
            rc = proc.poll()
            kill_group_and_ray(proc, raytmp)
        if _delta_committed(out):
            break
    rows = deltalake.DeltaTable(out).to_pyarrow_table(columns=["doc_id", "task"]).to_pylist()
    print(f"killed {'after the job finished' if rc == 0 else 'mid-job'}: {len(rows)} of 9 rows committed")
    with open(tmp_path / "rerun.log", "wb") as logf:
        proc = start_run(job, out, extra, raytmp, logf)
        rc = proc.wait(timeout=600)
    assert rc == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    keys = _reader_keys(out)  # deltalake, duckdb, polars agree
    assert len(keys) == len(set(keys)) == 9 and {t for _, t in keys} == {"summary", "keywords", "question"}
    arrow = deltalake.DeltaTable(out).to_pyarrow_table()  # noqa: F841 - read by duckdb's replacement scan
    assert duckdb.sql("SELECT count(*), count(DISTINCT (doc_id, task)) FROM arrow").fetchall() == [(9, 9)]
    st = cli_status(job, out, extra, raytmp)
    assert (st["rows"], st["docs_done"], st["duplicate_rows"], st["complete"]) == (9, 3, 0, True), st
    r = subprocess.run([sys.executable, "-m", "dlbatch.cli", "run", job, "--no-progress", *cli_sets(out, extra)],
                       cwd=REPO, env=ray_env(raytmp), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr[-2000:]


def test_delta_output_on_s3(s3_bucket, s3_options):
    """On an object store (moto S3 here): the same commits, progress and a retry no-op."""
    url = f"s3://{s3_bucket}/out"
    store = DeltaStore(url, s3_options)
    _fill(store)
    again = DeltaStore(url, s3_options)
    again._app_id = store.app_id
    again._append(result_table(_rows("d9"), False), 1)  # a committed transaction: no-op
    prog = again.progress(tasks=set(TASKS))
    assert (prog["rows"], prog["n_done"], prog["n_failed"], prog["duplicates"]) == (7, 4, 1, 0)
    dt = deltalake.DeltaTable(url, storage_options=store.delta_options)
    assert dt.version() == 2 and dt.transaction_version(store.app_id) == 3
    assert again.supersede({"b.jsonl"}) == 3 and again.errors().column("doc_id").to_pylist() == ["d4"]


def test_fresh_as_parquet_removes_the_delta_log_of_a_delta_output(tmp_path):
    """A job that wrote a Delta table and now asks for Parquet parts (--fresh, another format):
    the output's manifest says Delta, so the Delta store deletes its own files, data files and
    log, so no reader finds a table without its files; the run then writes Parquet parts on the
    same folder and lease. Another table's log (a manifest that is not a Delta job's) stays."""
    from dlbatch.jobspec import load_job

    out = tmp_path / "out"
    store = DeltaStore(str(out))
    _fill(store)
    store.files.write_json("_manifest.json", {"name": "j", "fields": {"output.format": "delta"}})
    parquet = load_job("jobs/papers.yaml", [f"output.path={out}"]).output
    written = open_store(parquet)  # what `dlbatch run --fresh` opens: the format that wrote the output
    assert type(written) is DeltaStore
    written.files.take_lease("j", "run --fresh")
    assert written.clear() > 0
    assert not deltalake.DeltaTable.is_deltatable(str(out))
    assert not [p for p in out.rglob("*") if p.is_file() and "_delta_log" in p.parts]
    fresh = run_store(written, parquet, cleared=True)
    assert type(fresh) is ParquetStore and fresh.files is written.files  # one folder, one lease
    fresh.commit(_rows("d1"), [], include_text=False)
    assert _keys(ParquetStore(str(out)).results()) == [("d1", "keywords"), ("d1", "summary")]
    written.files.release_lease()
    other = tmp_path / "other"
    _fill(DeltaStore(str(other)))
    ParquetStore(str(other)).files.write_json("_manifest.json", {"name": "j", "fields": {}})
    other_store = open_store(load_job("jobs/papers.yaml", [f"output.path={other}"]).output)
    assert type(other_store) is ParquetStore
    other_store.clear()
    assert any((other / "_delta_log").iterdir())  # not ours to delete


@pytest.mark.parametrize("manifest", [True, False], ids=["run-manifest", "store-api"])
def test_compact_of_a_delta_output_without_the_format_compacts_it_as_delta(tmp_path, capsys, manifest):
    """`dlbatch compact JOB` on a Delta output whose job file does not say `output.format:
    delta`: the command reads the output's manifest first (or, without one, finds the Delta
    log) and compacts the table as Delta. No data file of the table is deleted: deltalake
    reads every row, and the dead letters stay."""
    from dlbatch.cli import main

    out = str(tmp_path / "out")
    store = DeltaStore(out)
    _fill(store)  # three transactions: three data files
    if manifest:
        store.files.write_json("_manifest.json", {"name": "papers", "fields": {"output.format": "delta"}})
    expected = _reader_keys(out)
    assert main(["compact", "jobs/papers.yaml", "--set", f"output.path={out}"]) == 0
    assert "3 small parts merged into 1" in capsys.readouterr().out
    dt = deltalake.DeltaTable(out)
    assert len(dt.file_uris()) == 1 and all(os.path.exists(u) for u in dt.file_uris())
    assert _keys(deltalake.DeltaTable(out).to_pyarrow_table()) == expected == _reader_keys(out)
    assert sorted(DeltaStore(out).errors().column("doc_id").to_pylist()) == ["d3", "d4"]


def test_compact_of_a_parquet_output_asked_as_delta_compacts_parts(tmp_path, capsys):
    """The other way round: a job file saying delta on an output of Parquet parts compacts
    the parts (their format), and writes no Delta table."""
    from dlbatch.cli import main

    out = str(tmp_path / "out")
    store = ParquetStore(out)
    for i in range(3):
        store.commit(_rows(f"d{i}"), [], include_text=False)
    store.files.write_json("_manifest.json", {"name": "papers", "fields": {}})
    assert main(["compact", "jobs/papers.yaml", "--set", f"output.path={out}", "--set", "output.format=delta"]) == 0
    assert "3 small parts merged into 1" in capsys.readouterr().out
    assert not deltalake.DeltaTable.is_deltatable(out)
    assert len(ParquetStore(out).results()) == 6


def test_a_run_of_another_format_is_refused_before_it_changes_anything(tmp_path, capsys):
    """A run whose job asks Parquet parts on an output holding a Delta table (here committed
    through the store: no manifest) exits 2 naming both formats; nothing of the table changes.
    `dlbatch validate` says the same."""
    from dlbatch.cli import main

    out = tmp_path / "out"
    _fill(DeltaStore(str(out)))

    def snapshot():
        return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*")
                if p.is_file() and "_lease" not in p.parts}

    before = snapshot()
    rc = main(["run", "jobs/papers.yaml", "--no-progress", "--set", f"output.path={out}"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "holds a Delta table" in err and "output.format=delta" in err and "--fresh" in err
    assert snapshot() == before
    assert main(["validate", "jobs/papers.yaml", "--set", f"output.path={out}"]) == 2
    assert "holds a Delta table" in capsys.readouterr().err

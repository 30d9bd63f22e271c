"""One writer per output (the lease), one commit per document, --fresh that deletes only
this job's files, durable commits: the output-side promises of "exactly once" when people
and machines misbehave (docs/output.md)."""
from __future__ import annotations

import os
import socket

import pyarrow.parquet as pq
import pytest

from dlbatch.output.lease import LEASE_DIR, LeaseHeld, LeaseLost, OutputLease
from dlbatch.output.dead_letters import ERRORS_DIR
from dlbatch.output.parquet_store import ParquetStore
from tests.helpers.lease_holder import age_lease

ROW = {"doc_id": "d1", "source": "a.pdf", "output": "x", "prompt_tokens": 3, "output_tokens": 1}
ERR = {"doc_id": "d1", "source": "a.pdf", "task": "keywords", "stage": "generate", "error_type": "ConstraintError",
       "error": "no valid output"}


def _lease(out, job="j", **kw):
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(out))
    return OutputLease(fs, root, str(out), job, heartbeat_s=kw.pop("heartbeat_s", 20), **kw)


def test_a_second_writer_is_refused_with_the_holder_named(tmp_path):
    a = _lease(tmp_path, job="daily").acquire()
    with pytest.raises(LeaseHeld) as e:
        _lease(tmp_path, job="daily", command="run").acquire()
    msg = str(e.value)
    assert "'daily'" in msg and socket.gethostname() in msg and f"pid {os.getpid()}" in msg
    gen = a.gen
    a.release()
    b = _lease(tmp_path).acquire()  # released: free again, under a new number
    assert b.gen == gen + 1
    b.release()


def test_a_stale_lease_is_taken_over_and_its_old_holder_commits_nothing_more(tmp_path):
    old = ParquetStore(str(tmp_path))
    old.files.take_lease("j", stale_s=60, heartbeat_s=20)
    old.commit([{**ROW, "task": "summary"}], [], False)
    age_lease(tmp_path, 30)  # heartbeat 30 s old: still held
    with pytest.raises(LeaseHeld):
        _lease(tmp_path, stale_s=60).acquire()
    age_lease(tmp_path, 31)  # 61 s without a heartbeat: stale
    new = _lease(tmp_path, stale_s=60).acquire()
    old.files.lease._verified -= 61  # the old holder's own time moved on as well
    assert new.taken_over["owner"] == old.files.lease.token
    with pytest.raises(LeaseLost, match="taken over"):
        old.commit([{**ROW, "doc_id": "d2", "task": "summary"}], [], False)
    assert [r["doc_id"] for r in ParquetStore(str(tmp_path)).results().to_pylist()] == ["d1"]
    new.release()


def test_a_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    import json
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    held = _lease(tmp_path).acquire()
    held._stop.set()
    path = held._path(held.gen)
    rec = json.loads(open(path).read())
    rec["pid"] = int(dead)  # that process exited; its heartbeat is fresh
    open(path, "w").write(json.dumps(rec))
    taker = _lease(tmp_path).acquire()
    assert taker.taken_over["pid"] == int(dead)
    assert sorted(os.listdir(tmp_path / LEASE_DIR)) == [f"{held.gen:012d}.json", f"{taker.gen:012d}.json"]
    taker.release()


def test_dlbatch_run_refuses_an_output_another_process_writes(tmp_path, capsys):
    """A second `dlbatch run` (or a cron job overlapping yesterday's) on the same output
    starts nothing: exit 3, the holder named; the holder's output is untouched."""
    from dlbatch.cli.main import main

    out = tmp_path / "out"
    holder = ParquetStore(str(out))
    holder.files.take_lease("papers")
    holder.commit([{**ROW, "task": "summary"}], [], False)
    rc = main(["run", "jobs/papers.yaml", "--no-progress", "--set", f"output.path={out}"])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "in use by job 'papers'" in err and f"pid {os.getpid()}" in err
    assert len(ParquetStore(str(out)).results()) == 1
    rc = main(["compact", "jobs/papers.yaml", "--set", f"output.path={out}"])
    assert rc == 3 and "compaction not started" in capsys.readouterr().err
    holder.files.release_lease()


def test_a_documents_results_and_dead_letters_are_one_commit(tmp_path, monkeypatch):
    """A crash after the part with K-1 results but before the dead-letter copy: the
    document is still done (its dead letter is in the part's footer), and a resume writes
    the copy instead of redoing the document."""
    import connectors.sink as sink

    store = ParquetStore(str(tmp_path))
    real = sink.write_parquet_atomic

    def crash_on_error_copy(table, dest, name, *a, **k):
        if dest.endswith(ERRORS_DIR):
            raise OSError(28, "No space left on device")
        return real(table, dest, name, *a, **k)

    monkeypatch.setattr(sink, "write_parquet_atomic", crash_on_error_copy)
    with pytest.raises(OSError):
        store.commit([{**ROW, "task": "summary"}, {**ROW, "task": "question"}], [ERR], False)
    monkeypatch.undo()
    rerun = ParquetStore(str(tmp_path))
    prog = rerun.progress(tasks={"summary", "question", "keywords"})
    assert prog["done_ids"].to_pylist() == ["d1"]  # nothing to redo: keywords' outcome is its dead letter
    assert rerun.recover()["error_copies"] == 1
    errs = rerun.errors().to_pylist()
    assert [(e["doc_id"], e["task"], e["error_type"]) for e in errs] == [("d1", "keywords", "ConstraintError")]
    assert rerun.recover()["error_copies"] == 0 and len(rerun.errors()) == 1
    parts = [p for p in os.listdir(tmp_path) if p.startswith("part-")]
    assert len(parts) == 1 and parts[0].endswith("-e.parquet")
    assert pq.read_table(tmp_path / parts[0]).num_rows == 2  # readers of the results see results only


def test_a_lost_reply_to_a_combined_commit_commits_its_dead_letters_once(tmp_path, monkeypatch):
    import connectors.sink as sink

    store = ParquetStore(str(tmp_path))
    real = sink.write_parquet_atomic
    calls = []

    def lost_reply(table, dest, name, *a, **k):  # the part lands, the reply to its rename does not
        url = real(table, dest, name, *a, **k)
        if not calls:
            calls.append(name)
            raise ConnectionError("reply lost")
        return url

    monkeypatch.setattr(sink, "write_parquet_atomic", lost_reply)
    with pytest.raises(ConnectionError):
        store.commit([{**ROW, "task": "summary"}], [ERR], False)
    store.commit([{**ROW, "task": "summary"}], [ERR], False)  # the driver committing the same flush again
    assert len(calls) == 1 and calls[0].endswith("-e.parquet")  # the lost reply was the combined part's
    assert len(store.results()) == 1 and len(store.errors()) == 1


def test_compaction_keeps_dead_letters_of_parts_it_merges(tmp_path):
    store = ParquetStore(str(tmp_path))
    for i in range(4):
        store.commit([{**ROW, "doc_id": f"d{i}", "task": "summary"}], [{**ERR, "doc_id": f"d{i}"}], False)
    for f in (tmp_path / ERRORS_DIR).glob("part-*"):
        f.unlink()  # every copy lost
    assert store.compact(min_parts=1)["parts_written"] == 1
    assert sorted(e["doc_id"] for e in store.errors().to_pylist()) == ["d0", "d1", "d2", "d3"]
    assert len(store.results()) == 4


def test_fresh_deletes_only_this_jobs_files(tmp_path):
    store = ParquetStore(str(tmp_path))
    store.commit([{**ROW, "task": "summary"}], [ERR], False)
    store.files.write_json("_manifest.json", {"name": "j"})
    for sub in ("year=2024", "other_job"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "part-0001.parquet").write_bytes(b"someone else's")
        (tmp_path / sub / "_manifest.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    store.clear()
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["notes.txt", "other_job/_manifest.json", "other_job/part-0001.parquet",
                    "year=2024/_manifest.json", "year=2024/part-0001.parquet"]


def test_a_commit_reaches_the_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """fsync of the part before the rename and of the folder after it: a power loss never
    leaves a committed part empty."""
    import pyarrow as pa

    from connectors.sink import write_parquet_atomic

    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_parquet_atomic(pa.table({"a": [1]}), str(tmp_path), "part-x.parquet")
    assert any(p.startswith(str(tmp_path / "_tmp")) for p in synced)  # the bytes, before the rename
    assert str(tmp_path) in synced  # the rename itself


# ---------------------------------------------------------------- identity by content
def test_a_replaced_file_is_seen_even_when_size_and_mtime_are_kept(tmp_path):
    from connectors.versions import input_versions

    f = tmp_path / "a.txt"
    f.write_text("first version")
    before = input_versions([str(f)])
    st = f.stat()
    f.write_text("other version")  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime kept, as `cp -p` or a re-export may do
    after = input_versions([str(f)], cache=before)
    assert after[str(f)][1] != before[str(f)][1]
    # an unchanged file is not read again: its cached version is taken as is
    assert input_versions([str(f)], cache={str(f): [after[str(f)][0], "sha256:cached"]})[str(f)][1] == "sha256:cached"


def test_supersede_removes_a_sources_rows_results_index_and_dead_letters(tmp_path):
    store = ParquetStore(str(tmp_path))
    store.commit([{**ROW, "task": "summary"}, {**ROW, "doc_id": "d2", "source": "b.pdf", "task": "summary"}],
                 [ERR], False)
    store.commit([{**ROW, "doc_id": "d3", "task": "summary"}], [], False)
    store.commit_errors([{**ERR, "doc_id": "d4", "source": "b.pdf"}])
    assert store.supersede({"a.pdf"}) == 2
    rerun = ParquetStore(str(tmp_path))
    assert [(r["doc_id"], r["source"]) for r in rerun.results().to_pylist()] == [("d2", "b.pdf")]
    assert [e["doc_id"] for e in rerun.errors().to_pylist()] == ["d4"]
    prog = rerun.progress()
    assert prog["sources"] == {"b.pdf"} and prog["rows"] == 1
    assert not list((tmp_path / "_compact").glob("*.json"))
    assert not list((tmp_path / ERRORS_DIR / "_compact").glob("*.json"))


def test_a_crash_inside_supersede_leaves_each_row_once_and_a_rerun_finishes(tmp_path, monkeypatch):
    store = ParquetStore(str(tmp_path))
    store.commit([{**ROW, "task": "summary"}, {**ROW, "doc_id": "d2", "source": "b.pdf", "task": "summary"}], [],
                 False)
    real = store.files.rm

    def crash(path):  # the rewritten part is committed, the old one not yet deleted
        raise KeyboardInterrupt

    monkeypatch.setattr(store.files, "rm", crash)
    with pytest.raises(KeyboardInterrupt):
        store.supersede({"a.pdf"})
    monkeypatch.setattr(store.files, "rm", real)
    rerun = ParquetStore(str(tmp_path))
    assert [r["doc_id"] for r in rerun.results().to_pylist()] == ["d2"]  # the record hides the old part
    rerun.supersede({"a.pdf"})
    assert [r["doc_id"] for r in ParquetStore(str(tmp_path)).results().to_pylist()] == ["d2"]
    assert len([p for p in os.listdir(tmp_path) if p.startswith("part-")]) == 1

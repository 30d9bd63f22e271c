"""Fenced commits (issue 37, point 1): a holder that lost the lease makes nothing visible that
counts. Parquet parts carry the lease generation and the new holder's fence rules out what an
older generation renames into place after the takeover (never counted, moved aside); a Delta
commit of an older generation is rejected by the new holder's fence transaction.

The split-brain drills run the old holder in a child process (tests/helpers/lease_holder.py)
that stops itself (SIGSTOP) right after its last check before a rename or a Delta commit, at
a seeded commit (the seed is printed), is taken over, and is resumed."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from dlbatch.output.lease import LeaseHeld, LeaseLost, OutputLease
from dlbatch.output.parquet_store import ParquetStore
from tests.helpers.jobs import REPO
from tests.helpers.lease_holder import TASKS, age_lease, doc_rows, open_store


def _lease(out, **kw):
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(out))
    return OutputLease(fs, root, str(out), "j", heartbeat_s=kw.pop("heartbeat_s", 20), **kw)


def _child_env():
    return {**os.environ, "PYTHONPATH": REPO}


def _wait_stopped(proc, timeout=120):
    """Wait until ``proc`` stopped itself (state T); its output so far on failure."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError("the holder did not reach its pause")


def _take_over(fmt, out, timeout=60):
    """The new holder: a store of ``fmt`` whose lease is taken once the old one is stale
    (stale_s 2 s by the store's clock)."""
    store = open_store(fmt, str(out))
    deadline = time.time() + timeout
    while True:
        try:
            store.files.take_lease("drill", heartbeat_s=0.5, stale_s=2.0)
            return store
        except LeaseHeld:
            assert time.time() < deadline, "the stopped holder's lease never went stale"
            time.sleep(0.2)


def _plain_keys(out):
    """(doc_id, task) of every row a plain reader of the folder sees: DuckDB's natural glob."""
    import duckdb

    return sorted(duckdb.sql(f"SELECT doc_id, task FROM read_parquet('{out}/*.parquet')").fetchall())


def _delta_keys(out):
    import deltalake

    t = deltalake.DeltaTable(str(out)).to_pyarrow_table(columns=["doc_id", "task"])
    return sorted(zip(t.column("doc_id").to_pylist(), t.column("task").to_pylist()))


def _keys(docs):
    return sorted((d, t) for d in docs for t in TASKS)


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_a_holder_paused_after_its_check_and_taken_over_makes_nothing_visible_that_counts(tmp_path, fmt):
    """SIGSTOP after the lease check, takeover, SIGCONT: on Parquet the late part is an orphan,
    never counted and moved aside at the new holder's next commit (0 duplicates visible to a
    plain reader from then on); on Delta its commit is rejected by the new holder's fence (0
    duplicates ever)."""
    if fmt == "delta":
        pytest.importorskip("deltalake")
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    ndocs = rng.randint(2, 5)
    k = rng.randrange(ndocs)  # the old holder stops in the commit of d<k>
    out = tmp_path / "out"
    old = subprocess.Popen([sys.executable, "-m", "tests.helpers.lease_holder", "commit", fmt, str(out), str(ndocs),
                            str(k)], cwd=REPO, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        _wait_stopped(old)
        new = _take_over(fmt, out)
        assert new.files.lease.taken_over is not None
        new.recover()
        prog = new.progress(tasks=set(TASKS))
        assert sorted(prog["done_ids"].to_pylist()) == [f"d{i}" for i in range(k)]
        new.commit(doc_rows(f"d{k}"), [], False)  # the new holder redoes what the old one holds
        os.kill(old.pid, signal.SIGCONT)
        log = old.communicate(timeout=120)[0]
    finally:
        if old.poll() is None:
            old.kill()
    done = [f"d{i}" for i in range(k + 1)]
    assert sorted((r["doc_id"], r["task"]) for r in new.index().to_pylist()) == _keys(done)  # never counted
    if fmt == "delta":
        assert _delta_keys(out) == _keys(done)  # the old holder's commit never landed
    new.commit(doc_rows("next"), [], False)  # the new holder's next commit
    done.append("next")
    assert sorted((r["doc_id"], r["task"]) for r in new.results().to_pylist()) == _keys(done)
    assert old.returncode == 3 and f"lost d{k}" in log, log
    assert new.files.lease.suspects  # the old holder was alive when taken over
    if fmt == "parquet":
        assert _plain_keys(out) == _keys(done)  # 0 duplicates visible to a plain reader
        moved = new.orphans()
        assert len(moved) == 1 and moved[0].startswith("part-g") and (out / "_orphans" / moved[0]).exists()
        assert new.progress(tasks=set(TASKS))["duplicates"] == 0
    else:
        assert _delta_keys(out) == _keys(done)
        assert new.orphans() == []
    new.files.release_lease()


def test_a_rename_rereads_the_lease_even_right_after_a_check(tmp_path):
    """The part's rename re-reads the lease immediately before it: a holder whose last check
    passed a moment ago but which was taken over since commits nothing."""
    old = ParquetStore(str(tmp_path))
    old.files.take_lease("j", stale_s=60, heartbeat_s=20)
    old.commit(doc_rows("a"), [], False)
    age_lease(tmp_path, 61)
    new = _lease(tmp_path, stale_s=60).acquire()
    old.files.lease._verified = time.monotonic()  # as if it had just checked
    with pytest.raises(LeaseLost):
        old.commit(doc_rows("b"), [], False)
    assert sorted({r["doc_id"] for r in ParquetStore(str(tmp_path)).results().to_pylist()}) == ["a"]
    new.release()


def _status(out, src, capsys, *flags):
    from dlbatch.cli.main import main

    sets = [f"input.path={src}", "input.id_field=id", f"output.path={out}"]
    assert main(["status", "jobs/papers_jsonl.yaml", *flags, *[a for s in sets for a in ("--set", s)]]) == 0
    text = capsys.readouterr().out
    return json.loads(text) if flags else text


def test_orphans_are_not_counted_by_status_or_compaction_and_fresh_rules_out_older_generations(tmp_path, capsys):
    """A part of an older generation that appears after the fence (a late rename): dlbatch's
    readers skip it, compaction does not merge it, status names it; after --fresh no part of
    an older generation counts."""
    out = tmp_path / "out"
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document {i}"}) + "\n" for i in range(4)))
    a = ParquetStore(str(out))
    a.files.take_lease("j", stale_s=60, heartbeat_s=20)
    a.progress()
    a.commit(doc_rows("d0"), [], False)
    late = doc_rows("d1")
    age_lease(out, 61)
    b = ParquetStore(str(out))
    b.files.take_lease("j", stale_s=60, heartbeat_s=20)
    assert b.progress()["rows"] == 2
    a.files.lease._confirm = lambda: True  # the old holder's rename lands after the takeover
    a.commit(late, [], False)
    assert b.progress()["rows"] == 2 and len(ParquetStore(str(out)).results()) == 2  # not counted
    st = _status(out, src, capsys, "--json")
    assert (st["rows"], st["duplicate_rows"]) == (2, 0)  # the orphan's rows not counted
    assert (st["orphan_parts_moved"], st["orphan_parts_in_place"]) == (0, 1)
    assert "0 moved to _orphans/, 1 still in place" in _status(out, src, capsys)
    b.commit(doc_rows("d2"), [], False)
    st = _status(out, src, capsys, "--json")
    assert (st["orphan_parts_moved"], st["orphan_parts_in_place"], st["rows"]) == (1, 0, 4)
    assert b.compact(min_parts=0)["merged_parts"] == 2  # d0 and d2, never the orphan
    assert sorted({r["doc_id"] for r in b.results().to_pylist()}) == ["d0", "d2"]
    assert b.files.fence.moved and all(m.startswith("part-g000001-") for m in b.files.fence.moved)
    from dlbatch.output.fence import orphan_report

    assert orphan_report(b.files) == {"moved": 1, "in_place": 0}
    b.clear()
    a.commit(doc_rows("d3"), [], False)  # the old holder again, after --fresh
    assert len(ParquetStore(str(out)).results()) == 0
    b.files.release_lease()


def test_lease_fence_and_commits_on_s3(s3_bucket, s3_options):
    """On an object store the heartbeat's age is the lease object's LastModified against a probe
    object's: held while fresh, taken over once stale; the new holder's fence rules out a
    late part of the old one there too."""
    url = f"s3://{s3_bucket}/out"
    old = ParquetStore(url, s3_options)
    old.files.take_lease("j", heartbeat_s=0.5, stale_s=2.0)
    old.progress()
    old.commit(doc_rows("d0"), [], False)
    old.files.lease._stop.set()  # its heartbeat stops; the process stays alive
    new = ParquetStore(url, s3_options)
    with pytest.raises(LeaseHeld):
        new.files.take_lease("j", heartbeat_s=0.5, stale_s=2.0)
    time.sleep(2.5)
    new.files.take_lease("j", heartbeat_s=0.5, stale_s=2.0)
    assert new.progress()["rows"] == 2
    old.files.lease._confirm = lambda: True  # its late rename lands after the takeover
    old.commit(doc_rows("d1"), [], False)
    assert ParquetStore(url, s3_options).progress()["rows"] == 2  # not counted
    new.commit(doc_rows("d2"), [], False)
    assert sorted({r["doc_id"] for r in ParquetStore(url, s3_options).results().to_pylist()}) == ["d0", "d2"]
    assert len(new.orphans()) == 1
    new.files.release_lease()

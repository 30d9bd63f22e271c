"""Committed-output index, compaction and input fingerprints (no Ray, no model)."""
from __future__ import annotations

import json
import os

import pytest

from dlbatch.output.parquet_store import ParquetStore
from dlbatch.output.parts import INDEX_DIR
from dlbatch.testing.faultfs import FaultPlan, SimulatedCrash, install

ROW = {"output": "some output text " * 20, "prompt_tokens": 10, "output_tokens": 2, "finish_reason": "length",
       "truncated": False, "model": "m"}
TASKS = ("summary", "keywords")


def _doc_rows(doc: str, source: str = "src.jsonl"):
    return [{**ROW, "doc_id": doc, "source": source, "task": t} for t in TASKS]


def _keys(table):
    return sorted(zip(table.column("doc_id").to_pylist(), table.column("task").to_pylist()))


def _fill(store, n_parts: int, docs_per_part: int = 2):
    expected = []
    for p in range(n_parts):
        rows = [r for d in range(docs_per_part) for r in _doc_rows(f"d{p:03d}-{d}")]
        store.commit(rows, [], include_text=False)
        expected += [(r["doc_id"], r["task"]) for r in rows]
    return sorted(expected)


def _top_parts(root):
    return sorted(f for f in os.listdir(root) if f.startswith("part-") and f.endswith(".parquet"))


@pytest.fixture
def plan():
    p = install(FaultPlan())
    yield p
    install(FaultPlan())


# ------------------------------------------------------------------------------ the index
def test_progress_reads_index_files_not_the_parts(tmp_path, monkeypatch):
    store = ParquetStore(str(tmp_path / "out"))
    expected = _fill(store, 5)
    assert len(os.listdir(tmp_path / "out" / INDEX_DIR)) >= 5
    read = []
    real = store.files.fs.cat_file
    monkeypatch.setattr(store.files.fs, "cat_file", lambda p, *a, **k: (read.append(p), real(p, *a, **k))[1])
    prog = store.progress(tasks=set(TASKS))
    assert prog["rows"] == len(expected) == 20 and prog["duplicates"] == 0
    assert prog["n_done"] == 10 and prog["prompt_tokens"] == 200 and prog["output_tokens"] == 40
    parts_read = [p for p in read if "/" + INDEX_DIR + "/" not in p and os.path.basename(p).startswith("part-")]
    assert parts_read == [] and len(read) == 5  # five index files, no part (no output text)


def test_part_without_index_is_read_for_its_id_columns(tmp_path):
    store = ParquetStore(str(tmp_path / "out"))
    expected = _fill(store, 3)
    idx = tmp_path / "out" / INDEX_DIR
    os.remove(idx / sorted(f for f in os.listdir(idx) if f.endswith(".parquet"))[0])  # a crash between part and index
    assert _keys(store.index()) == expected
    assert store.progress()["rows"] == 12


def test_sources_done_only_when_all_their_docs_are(tmp_path):
    store = ParquetStore(str(tmp_path / "out"))
    store.commit(_doc_rows("a1", "a.txt") + _doc_rows("b1", "b.txt"), [], False)
    store.commit([{**ROW, "doc_id": "c1", "source": "c.txt", "task": "summary"}], [], False)  # one task of two
    store.commit_errors([{"doc_id": "b2", "source": "b.txt", "stage": "parse", "error_type": "E", "error": "x"}])
    store.commit_errors([{"doc_id": "d1", "source": "d.txt", "stage": "parse", "error_type": "E", "error": "x"}])
    prog = store.progress(tasks=set(TASKS))
    assert prog["sources_done"] == {"a.txt", "b.txt", "d.txt"}  # c.txt: its document lacks a task
    assert set(prog["failed_ids"].to_pylist()) == {"b2", "d1"}


# ---------------------------------------------------------------- commits that report errors
def test_rename_landed_reply_lost_commits_once(tmp_path, plan):
    store = ParquetStore(f"faultfile://{tmp_path}/out")
    plan.reply_lost = 2  # the mv happens, its reply is lost; retried, the source is gone
    store.commit(_doc_rows("a"), [], False)
    store.commit(_doc_rows("a"), [], False)  # the driver retrying the same rows: same name, skipped
    assert plan.injected["reply_lost"] == 2
    assert len(_top_parts(tmp_path / "out")) == 1
    assert _keys(store.results()) == sorted(("a", t) for t in TASKS)


def test_commit_error_that_escapes_then_larger_retry_has_no_duplicate(tmp_path, plan, monkeypatch):
    import connectors.sink as sink

    monkeypatch.setattr(sink, "_landed", lambda *a: False)  # the check after the error fails too
    store = ParquetStore(f"faultfile://{tmp_path}/out")
    plan.reply_lost, plan.error = 1, PermissionError  # permanent: not retried, the error escapes
    with pytest.raises(PermissionError):
        store.commit(_doc_rows("a"), [], False)
    assert len(_top_parts(tmp_path / "out")) == 1  # it did land
    # the driver's next flush: the same rows plus newly finished ones, so another part name
    store.commit(_doc_rows("a") + _doc_rows("b"), [], False)
    keys = _keys(store.results())
    assert keys == sorted((d, t) for d in "ab" for t in TASKS) and store.progress()["duplicates"] == 0
    # dead letters likewise
    plan.reply_lost, plan.match = 1, "/_errors/part-"
    err = {"source": "s", "stage": "generate", "error_type": "WorkerCrash", "error": "boom"}
    with pytest.raises(PermissionError):
        store.commit_errors([{**err, "doc_id": "x"}])
    store.commit_errors([{**err, "doc_id": "x"}, {**err, "doc_id": "y"}])
    assert sorted(store.errors().column("doc_id").to_pylist()) == ["x", "y"]


def test_disk_full_mid_commit_then_retry_exactly_once(tmp_path, plan):
    store = ParquetStore(f"faultfile://{tmp_path}/out")
    store.commit(_doc_rows("a"), [], False)
    plan.enospc_after = plan.written + 100  # the next part does not fit
    with pytest.raises(OSError) as ei:
        store.commit(_doc_rows("b"), [], False)
    assert ei.value.errno == 28 and plan.injected["enospc"] == 1
    assert _keys(store.results()) == sorted(("a", t) for t in TASKS)  # the half file is not visible
    plan.enospc_after = None  # space freed
    store.commit(_doc_rows("b"), [], False)
    assert _keys(store.results()) == sorted((d, t) for d in "ab" for t in TASKS)


def test_disk_full_after_the_part_costs_only_its_index(tmp_path, plan):
    store = ParquetStore(f"faultfile://{tmp_path}/out")
    plan.full_after_commits = 1  # full right after the part's rename: its index cannot be written
    store.commit(_doc_rows("a"), [], False)
    assert plan.injected["enospc"] >= 1
    plan.enospc_after = None
    prog = store.progress(tasks=set(TASKS))
    assert prog["rows"] == 2 and prog["done_ids"].to_pylist() == ["a"]


@pytest.mark.parametrize("crash_at", range(0, 6))
def test_crash_at_every_step_of_a_commit(tmp_path, plan, crash_at):
    store = ParquetStore(f"faultfile://{tmp_path}/out")
    store.commit(_doc_rows("a"), [], False)
    plan.crash_after = plan.mutations + crash_at
    try:
        store.commit(_doc_rows("b"), [], False)
    except SimulatedCrash:
        pass
    plan.crash_after = None
    rerun = ParquetStore(f"faultfile://{tmp_path}/out")  # a new driver: resumes from what is committed
    done = rerun.progress(tasks=set(TASKS))["done_ids"].to_pylist()
    if "b" not in done:
        rerun.commit(_doc_rows("b"), [], False)
    assert _keys(rerun.results()) == sorted((d, t) for d in "ab" for t in TASKS)


# ------------------------------------------------------------------------------ compaction
def test_compaction_merges_small_parts_keeps_every_row_once(tmp_path):
    from connectors.sink import read_committed

    store = ParquetStore(str(tmp_path / "out"))
    expected = _fill(store, 20)
    before = sorted(map(json.dumps, store.results().select(["doc_id", "task", "output"]).to_pylist()))
    assert store.compact(min_parts=30)["merged_parts"] == 0  # 20 parts: under the threshold
    res = store.compact(min_parts=8, target_rows=32)
    assert res["merged_parts"] == 20 and res["parts_written"] == 3  # 32 + 32 + 16 rows
    assert len(_top_parts(tmp_path / "out")) == 3
    assert sorted(os.listdir(tmp_path / "out" / INDEX_DIR)) == sorted(_top_parts(tmp_path / "out") + ["_tmp"])
    assert sorted(map(json.dumps, store.results().select(["doc_id", "task", "output"]).to_pylist())) == before
    assert _keys(read_committed(str(tmp_path / "out"))) == expected
    assert store.progress()["rows"] == 80 and not os.listdir(tmp_path / "out" / "_compact")


def _crash_compaction(tmp_path, plan, crash_at):
    from connectors.sink import read_committed

    out = f"faultfile://{tmp_path}/out"
    store = ParquetStore(out)
    expected = _fill(store, 6)
    plan.crash_after = plan.mutations + crash_at
    crashed = False
    try:
        store.compact(min_parts=2, target_rows=1000)
    except SimulatedCrash:
        crashed = True
    plan.crash_after = None
    # readers (ours and the plain sink reader) see each row exactly once at the crash point
    assert _keys(ParquetStore(out).results()) == expected
    assert _keys(read_committed(out)) == expected
    assert _keys(ParquetStore(out).index()) == expected
    ParquetStore(out).compact(min_parts=2, target_rows=1000)  # the next job end recovers and finishes
    assert _keys(ParquetStore(out).results()) == expected and len(_top_parts(tmp_path / "out")) == 1
    assert len(os.listdir(tmp_path / "out" / INDEX_DIR)) == 2  # the merged part's index (+ _tmp)
    return crashed


def test_compaction_crash_at_every_step_leaves_rows_exactly_once(tmp_path, plan):
    crashed, k = True, 0
    while crashed:  # crash before the 1st, 2nd, ... mutating call, until compaction completes
        crashed = _crash_compaction(tmp_path / str(k), plan, k)
        k += 1
    assert k > 15  # record, merged part, its index, 6 deletions of parts and of indexes, record


def test_list_committed_hides_replaced_parts_only_when_the_merged_part_exists(tmp_path):
    from connectors.sink import list_committed

    store = ParquetStore(str(tmp_path / "out"))
    _fill(store, 2)
    names = _top_parts(tmp_path / "out")
    store.files.write_json("_compact/part-cX.json", {"merged": "part-cX.parquet", "replaces": names})
    assert len(list_committed(str(tmp_path / "out"))) == 2  # merged part not there: the record is ignored
    (tmp_path / "out" / "part-cX.parquet").write_bytes((tmp_path / "out" / names[0]).read_bytes())
    assert [os.path.basename(u) for u in list_committed(str(tmp_path / "out"))] == ["part-cX.parquet"]


def test_clear_removes_index_and_compaction_records(tmp_path):
    store = ParquetStore(str(tmp_path / "out"))
    _fill(store, 3)
    store.files.write_json("_compact/part-cY.json", {"merged": "part-cY.parquet", "replaces": []})
    (tmp_path / "out" / "keep.txt").write_text("x")
    store.clear()
    left = sorted(os.path.relpath(os.path.join(d, f), tmp_path / "out") for d, _, fs in os.walk(tmp_path / "out")
                  for f in fs)
    assert left == ["keep.txt"]


# ------------------------------------------------------------------------ input fingerprint
def test_inputs_fingerprint_sees_appends_new_files_and_limit(tmp_path):
    from connectors.listing import inputs_fingerprint, list_inputs

    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl").write_text('{"id": "1", "text": "x"}\n')
    files = list_inputs(str(src), "jsonl")
    sig = inputs_fingerprint(files)
    assert inputs_fingerprint(list_inputs(str(src), "jsonl")) == sig  # nothing changed
    assert inputs_fingerprint(files, limit=5) != sig
    with open(src / "a.jsonl", "a") as f:
        f.write('{"id": "2", "text": "y"}\n')
    sig2 = inputs_fingerprint(files)
    assert sig2 != sig
    (src / "b.jsonl").write_text('{"id": "3", "text": "z"}\n')
    assert inputs_fingerprint(list_inputs(str(src), "jsonl")) != sig2
    os.utime(src / "a.jsonl", (1, 1))  # same size, another version
    assert inputs_fingerprint(files) != sig2


def test_status_bench_smoke(tmp_path):
    from dlbatch.cli import main

    out = tmp_path / "r.json"
    assert main(["bench", "status", "--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["docs"], r["parts"], r["parts_after_compaction"]) == (2000, 125, 1)
    assert r["compaction"]["merged_parts"] == 125
    assert all(r[k] > 0 for k in ("baseline_s", "index_compacted_s", "status_s", "resume_s"))

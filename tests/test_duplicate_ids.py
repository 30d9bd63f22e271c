"""The same document id from two input files (dlbatch/driver/dispatch.py: `Duplicates`): the
first copy to reach the driver is the document, the other a DuplicateId dead letter (stage
"read") naming the id and both sources, keyed by its own source so that it never marks the
document failed, handed over with the document's outcome (one commit), and not redone or
dead-lettered again by a rerun."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

from connectors.ids import content_id
from dlbatch.driver.feed import InputFeed
from dlbatch.records import request_id
from tests.test_dispatch import Clock, make, ok_results, rows_of


def copy_of(doc: str, source: str, text_id: int = 7):
    return [{**r, "source": source} for r in rows_of(doc, text_id=text_id)]


def run_all(d):
    while not d.finished():
        for b in d.next_batches():
            d.batch_done(b.id, ok_results(b))


def test_a_copy_from_another_file_is_a_dead_letter_given_with_the_documents_outcome():
    d = make({"colocated": 2}, Clock())
    for r in copy_of("x", "a.jsonl#line3", text_id=1):
        assert d.add_row(r)
    for r in copy_of("x", "b.jsonl#line1", text_id=2):  # the same id in another file
        assert not d.add_row(r)
    assert d.take_dead_letters() == []  # held: it lands with the document, never before it
    run_all(d)
    (done,) = d.take_completed()
    assert done.doc_id == "x" and done.source == "a.jsonl#line3"
    assert {r["source"] for r in done.output_rows("m")} == {"a.jsonl#line3"}
    (dead,) = d.take_dead_letters()
    assert dead["doc_id"] == content_id("b.jsonl#line1\nx") != "x"
    assert (dead["source"], dead["stage"], dead["error_type"]) == ("b.jsonl#line1", "read", "DuplicateId")
    assert "'x'" in dead["error"] and "a.jsonl#line3" in dead["error"] and "b.jsonl#line1" in dead["error"]


def test_a_copy_after_the_document_finished_is_given_at_once_and_only_once():
    d = make({"colocated": 2}, Clock())
    for r in copy_of("x", "a.pdf"):
        d.add_row(r)
    run_all(d)
    assert len(d.take_completed()) == 1
    assert not any(d.add_row(r) for r in copy_of("x", "c.pdf"))
    assert not any(d.add_row(r) for r in copy_of("x", "c.pdf"))  # its rows again: one dead letter
    assert [(e["source"], e["error_type"]) for e in d.take_dead_letters()] == [("c.pdf", "DuplicateId")]
    assert not d.add_row(copy_of("x", "a.pdf")[0])  # the document's own source again: ignored, as before
    assert d.take_dead_letters() == [] and d.finished()


def test_an_error_row_of_another_file_does_not_fail_the_open_document():
    """A row of the other copy that failed in the prompt stage carries the document's id: it is
    the duplicate's dead letter, not the document's."""
    d = make({"colocated": 2}, Clock())
    for r in copy_of("x", "a.jsonl#line1"):
        d.add_row(r)
    assert not d.add_row({"doc_id": "x", "source": "b.jsonl#line9", "error": "too long", "error_type": "TooLong",
                          "stage": "prompt"})
    run_all(d)
    assert [x.doc_id for x in d.take_completed()] == ["x"]
    (dead,) = d.take_dead_letters()
    assert dead["doc_id"] != "x" and dead["error_type"] == "DuplicateId"


def test_a_dead_lettered_document_takes_its_duplicates_letters_along():
    d = make({"colocated": 1}, Clock(), max_attempts=1)
    for r in copy_of("x", "a.txt"):
        d.add_row(r)
    d.add_row(copy_of("x", "b.txt")[0])
    while not d.finished():
        for b in d.next_batches():
            d.batch_done(b.id, [{"request_id": request_id(r), "error": "EngineError: boom"}
                                for r in b.rows])
        for w in d.unhealthy():
            d.worker_back(w.key)
    assert sorted((e["doc_id"] == "x", e["error_type"]) for e in d.take_dead_letters()) == \
        [(False, "DuplicateId"), (True, "EngineError")]


class _Batches:
    def __init__(self, tables):
        self.tables = list(tables)

    def get(self, timeout=0.0):
        if not self.tables:
            raise StopIteration
        return self.tables.pop(0)


def test_the_feed_counts_only_the_document_not_its_duplicate():
    d = make({"colocated": 2}, Clock())
    table = pa.Table.from_pylist(copy_of("x", "a.jsonl#line1") + copy_of("x", "b.jsonl#line1")
                                 + copy_of("y", "b.jsonl#line2", text_id=3))
    feed = InputFeed(_Batches([table]))
    while not feed.exhausted:
        feed.pull(d, room=lambda: True, idle=False)
    assert feed.docs_seen == 2 and sorted(d.docs) == ["x", "y"]
    run_all(d)
    assert sorted(x.doc_id for x in d.take_completed()) == ["x", "y"]
    assert [e["source"] for e in d.take_dead_letters()] == ["b.jsonl#line1"]


@pytest.mark.ray
def test_job_with_one_id_in_two_files_and_a_rerun(ray_local, sample_model, tmp_path):
    from dlbatch.output.parquet_store import ParquetStore
    from tests.helpers.jobs import output_rows, run_job

    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl").write_text(json.dumps({"id": "p1", "text": "Coastal fog forms at night. " * 10}) + "\n"
                                 + json.dumps({"id": "p2", "text": "Birds migrate at night. " * 10}) + "\n")
    (src / "b.jsonl").write_text(json.dumps({"id": "p2", "text": "Another paper under the same id. " * 10}) + "\n")
    out = str(tmp_path / "out")
    extra = [f"input.path={src}", "input.id_field=id"]
    rep = run_job("jobs/papers_jsonl.yaml", out, extra)
    rows = output_rows(out)
    assert sorted({r["doc_id"] for r in rows}) == ["p1", "p2"] and len(rows) == 6, rep
    p2 = {r["source"] for r in rows if r["doc_id"] == "p2"}
    assert len(p2) == 1
    (err,) = ParquetStore(out).errors().to_pylist()
    (other,) = {f"{src}/a.jsonl#line2", f"{src}/b.jsonl#line1"} - p2
    assert (err["source"], err["stage"], err["error_type"]) == (other, "read", "DuplicateId")
    assert err["doc_id"] == content_id(f"{other}\np2") and "'p2'" in err["error"] and next(iter(p2)) in err["error"]

    with open(src / "b.jsonl", "a") as f:  # a rerun with one new document
        f.write(json.dumps({"id": "p3", "text": "Soil moisture limits wheat yield. " * 10}) + "\n")
    run_job("jobs/papers_jsonl.yaml", out, extra)
    rows = output_rows(out)
    assert len(rows) == 9 and len({(r["doc_id"], r["task"]) for r in rows}) == 9
    assert ParquetStore(out).errors().num_rows == 1


@pytest.mark.ray
def test_one_id_in_two_read_tasks_of_one_file_and_a_rerun(ray_local, sample_model, tmp_path, monkeypatch):
    """One file cut into read tasks (connectors/read_tasks.py): an id repeated inside a part is
    that part's DuplicateId (stage "parse", the earlier line is the document, as in a file read
    whole); one repeated across parts reaches the driver under both sources, and `Duplicates`
    dead-letters the copy that comes second (stage "read"), naming both lines. A rerun redoes
    nothing."""
    import connectors.read_tasks as read_tasks
    from dlbatch.output.parquet_store import ParquetStore
    from tests.helpers.jobs import output_rows, run_job

    ids = ["p0", "p1", "p2", "p3", "p3", "p5", "p6", "p7", "p1", "p9"]  # p3: lines 4-5; p1: lines 2 and 9
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": d, "text": f"Paper {i} on coastal fog and tides. " * 8}) + "\n"
                           for i, d in enumerate(ids)))
    monkeypatch.setattr(read_tasks, "READ_TASK_BYTES", 800)  # lines of 297 bytes: parts of lines 1-3, 4-6, 7-9, 10
    monkeypatch.setattr(read_tasks, "FIRST_TASK_BYTES", 800)
    tasks = read_tasks.plan_read_tasks([(str(src), None)], "jsonl")
    part_of = {line: next(i for i, t in enumerate(tasks) if t.part.line <= line
                          and (i + 1 == len(tasks) or line < tasks[i + 1].part.line)) for line in range(1, 11)}
    assert part_of[4] == part_of[5] and part_of[2] != part_of[9]  # one repeat inside a part, one across parts
    out = str(tmp_path / "out")
    extra = [f"input.path={src}", "input.id_field=id"]
    run_job("jobs/papers_jsonl.yaml", out, extra)
    rows = output_rows(out)
    assert sorted({r["doc_id"] for r in rows}) == sorted(set(ids)) and len(rows) == 3 * len(set(ids))
    assert {r["source"] for r in rows if r["doc_id"] == "p3"} == {f"{src}#line4"}
    errors = {e["error_type"] + ":" + e["stage"]: e for e in ParquetStore(out).errors().to_pylist()}
    assert sorted(errors) == ["DuplicateId:parse", "DuplicateId:read"]
    inside, across = errors["DuplicateId:parse"], errors["DuplicateId:read"]
    assert inside["source"] == f"{src}#line5" and f"{src}#line4" in inside["error"] and "'p3'" in inside["error"]
    p1 = {r["source"] for r in rows if r["doc_id"] == "p1"}
    (other,) = {f"{src}#line2", f"{src}#line9"} - p1
    assert across["source"] == other and next(iter(p1)) in across["error"] and "'p1'" in across["error"]
    again = run_job("jobs/papers_jsonl.yaml", out, extra)
    assert again.get("noop") is True and len(output_rows(out)) == len(rows)
    assert ParquetStore(out).errors().num_rows == 2

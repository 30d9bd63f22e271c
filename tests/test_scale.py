"""The driver's memory and start-up work do not grow with what a job already did."""
from __future__ import annotations

import json


def test_report_histograms_hold_a_bounded_sample():
    from dlbatch.report.metrics import JobMetrics
    from dlbatch.report.progress import Progress
    from dlbatch.report.run import Tally

    t = Tally(metrics=JobMetrics("j"), progress=Progress("j", total_docs=None, initial_docs=0, tty=False))
    for i in range(25_000):
        t.doc_ok([{"prompt_tokens": 100 + i % 7, "output_tokens": 4}, {"prompt_tokens": 90, "output_tokens": 5}])
    assert len(t.prompt_hist) == len(t.output_hist) == 10_000 and t.prompt_hist.seen == 50_000
    assert t.prompt_tokens == sum(100 + i % 7 for i in range(25_000)) + 90 * 25_000  # sums stay exact
    assert set(t.output_hist) == {4, 5}


def test_status_counts_table_inputs_without_parsing_them(tmp_path, monkeypatch):
    import connectors
    import connectors.listing as listing
    from dlbatch.output.status import job_status
    from dlbatch.jobspec import load_job

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": "x " * 50}) + "\n" for i in range(300)))

    def no_parse(*a, **k):
        raise AssertionError("status parsed the input")

    monkeypatch.setattr(listing, "read_document_file", no_parse)
    monkeypatch.setattr(connectors, "read_document_file", no_parse)
    spec = load_job("jobs/papers_jsonl.yaml", [f"input.path={src}", "input.id_field=id",
                                               f"output.path={tmp_path / 'out'}"])
    st = job_status(spec)
    assert st["docs_total"] == 300 and st["docs_pending"] == 300
    spec = load_job("jobs/papers_jsonl.yaml", [f"input.path={src}", "input.id_field=id", "input.limit=120",
                                               f"output.path={tmp_path / 'out'}"])
    assert job_status(spec)["docs_total"] == 120


def test_skip_set_answers_membership_in_8_bytes_per_id():
    import pickle

    import pyarrow as pa

    from dlbatch.prompts.skip import SkipSet

    ids = [f"doc-{i:07d}" for i in range(100_000)]
    s = SkipSet(pa.array(ids))
    assert len(s) == 100_000 and "doc-0031337" in s and "doc-0100000" not in s and "other" not in s
    assert len(pickle.dumps(s)) < 100_000 * 8 + 1024  # what each prompt actor receives
    assert all(i in s for i in ids[::997])


def test_progress_holds_columns_not_python_objects_per_row(tmp_path):
    from dlbatch.output.parquet_store import ParquetStore

    store = ParquetStore(str(tmp_path))
    rows = [{"doc_id": f"d{i}", "source": f"/in/{i}.pdf", "task": t, "output": "x", "prompt_tokens": 3,
             "output_tokens": 1} for i in range(2000) for t in ("a", "b")]
    store.commit(rows[:-1], [], False)  # d1999 lacks task b
    store.commit_errors([{"doc_id": "bad", "source": "/in/bad.pdf", "stage": "parse", "error_type": "E", "error": "x"}])
    p = store.progress(tasks={"a", "b"})
    assert p["n_done"] == 1999 and p["failed_ids"].to_pylist() == ["bad"] and p["rows"] == 3999
    assert hasattr(p["done_ids"], "to_pylist") and "d1999" not in set(p["done_ids"].to_pylist())
    assert "/in/bad.pdf" in p["sources_done"] and "/in/1999.pdf" not in p["sources_done"]
    assert p["prompt_tokens"] == 3 * 3999 and p["duplicates"] == 0


def test_the_feed_hands_a_big_block_over_in_slices_cut_between_documents():
    """A block of 3,000 documents (one input file) reaches the dispatcher SLICE_ROWS rows at a
    time while it has room, each document's rows together: the driver's Python rows stay
    bounded by what is in flight, whatever the input's size."""
    import pyarrow as pa

    from dlbatch.driver.feed import InputFeed

    rows = [{"doc_id": f"d{i}", "task": t, "prompt_ids": [1, 2, 3], "max_tokens": 2}
            for i in range(3000) for t in ("a", "b", "c")]

    class Blocks:
        def __init__(self):
            self.left = [pa.Table.from_pylist(rows)]

        def get(self, timeout=0.0):
            if not self.left:
                raise StopIteration
            return self.left.pop(0)

    class Queue:
        def __init__(self):
            self.rows = []

        def add_row(self, r):
            self.rows.append(r)
            return True

    feed, q = InputFeed(Blocks()), Queue()
    pulls = []
    while not feed.exhausted:
        before = len(q.rows)
        feed.pull(q, room=lambda: len(q.rows) - before < 600, idle=False)
        pulls.append(len(q.rows) - before)
        docs = [r["doc_id"] for r in q.rows]
        assert len(docs) % 3 == 0 and docs[-1] == docs[-3]  # never a part of a document
    assert max(pulls) <= 2 * InputFeed.SLICE_ROWS + 2  # bounded by the room, not by the block
    assert [r["doc_id"] for r in q.rows] == [r["doc_id"] for r in rows] and feed.docs_seen == 3000


def test_bench_scale_writes_the_same_documents_as_one_file_or_several(tmp_path):
    """`dlbatch bench scale --files N`: the N-file input holds the one-file input's documents,
    in the same order, about N/files per file."""
    from dlbatch.bench.scale import input_files, write_docs

    one = write_docs(str(tmp_path / "one.jsonl"), 10, 6)
    many = write_docs(str(tmp_path / "many"), 10, 6, files=3)
    files = input_files(many)
    assert [f.rsplit("/", 1)[1] for f in files] == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    lines = [open(f).read().splitlines() for f in files]
    assert [len(x) for x in lines] == [3, 3, 4] and sum(lines, []) == open(one).read().splitlines()
    assert input_files(one) == [one]

"""input.limit takes the first N rows in a fixed order (files sorted by path, rows in file
order) whatever the reading parallelism, and a repeated input.id_field value is a dead
letter naming the id and both sources, never dropped in silence."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.listing import count_rows, limited_reads, list_inputs, read_document_file
from connectors.parse import parse_file
from connectors.records import DUPLICATE_ID


def _jsonl(path, ids, blank_every=0, pad=""):
    lines = []
    for i, d in enumerate(ids):
        lines.append(json.dumps({"id": d, "text": f"document {d} {pad}"}))
        if blank_every and i % blank_every == 0:
            lines.append("")  # blank lines are no rows
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _ids(rows):
    return [r["doc_id"] for r in rows]


def _read(reads, fmt="jsonl"):
    out = []
    for url, n in reads:
        out += list(read_document_file(url, fmt, id_field="id", max_rows=n))
    return out


def test_limit_takes_the_first_rows_of_the_sorted_files(tmp_path):
    _jsonl(tmp_path / "c.jsonl", [f"c{i}" for i in range(4)])
    _jsonl(tmp_path / "a.jsonl", [f"a{i}" for i in range(3)], blank_every=1)
    _jsonl(tmp_path / "b.jsonl", [f"b{i}" for i in range(2)])
    files = list_inputs(str(tmp_path), "jsonl")
    shuffled = [files[2], files[0], files[1]]  # the plan sorts them itself
    reads = limited_reads(shuffled, "jsonl", 6)
    assert [(url.rsplit("/", 1)[1], n) for url, n in reads] == [("a.jsonl", 3), ("b.jsonl", 2), ("c.jsonl", 1)]
    assert _ids(_read(reads)) == ["a0", "a1", "a2", "b0", "b1", "c0"]
    assert limited_reads(files, "jsonl", 2) == [(files[0], 2)]  # only the files the limit reaches
    assert limited_reads(files, "jsonl", 100) == [(files[0], 3), (files[1], 2), (files[2], 4)]
    assert limited_reads(files, "jsonl", None) == [(f, None) for f in files]


def test_limit_over_parquet_counts_the_footer_and_a_corrupt_file_is_one_row(tmp_path):
    for name, ids in (("p1.parquet", ["x0", "x1"]), ("p3.parquet", ["z0", "z1"])):
        pq.write_table(pa.table({"id": ids, "text": [f"text {i}" for i in ids]}), tmp_path / name)
    (tmp_path / "p2.parquet").write_bytes(b"not a parquet file")
    files = list_inputs(str(tmp_path), "parquet")
    reads = limited_reads(files, "parquet", 4)
    assert [n for _, n in reads] == [2, 1, 1]
    rows = _read(reads, "parquet")
    assert _ids(rows)[:2] == ["x0", "x1"] and rows[2]["error_type"] == "CorruptFile" and _ids(rows)[3] == "z0"
    assert count_rows(files[1], "parquet", 10) == 1


def test_parse_file_honours_the_row_cap(tmp_path):
    url = _jsonl(tmp_path / "a.jsonl", ["d0", "d1", "d2"])
    kw = dict(fmt="jsonl", text_field="text", id_field="id", storage_options=None, max_pages=None)
    assert _ids(parse_file({"url": url, "max_rows": 2}, **kw)) == ["d0", "d1"]
    assert _ids(parse_file({"url": url}, **kw)) == ["d0", "d1", "d2"]


def test_a_repeated_id_is_a_dead_letter_naming_the_id_and_both_sources(tmp_path):
    url = _jsonl(tmp_path / "dup.jsonl", ["d0", "d1", "d0", "d2"])
    rows = list(read_document_file(url, "jsonl", id_field="id"))
    assert _ids(rows)[:2] == ["d0", "d1"] and rows[3]["doc_id"] == "d2"
    dup = rows[2]
    assert dup["error_type"] == DUPLICATE_ID and dup["text"] == ""
    assert dup["doc_id"] not in {"d0", "d1", "d2"}  # its dead letter does not take the document's id
    assert "'d0'" in dup["error"] and f"{url}#line3" in dup["error"] and f"{url}#line1" in dup["error"]
    # through the parse stage: the prompt stage dead-letters it (stage "parse")
    parsed = parse_file({"url": url}, fmt="jsonl", text_field="text", id_field="id", storage_options=None,
                        max_pages=None)
    assert [r["error_type"] for r in parsed] == [None, None, DUPLICATE_ID, None]
    # without an id field the ids are content hashes: equal texts are one document, no error
    assert all(r["error"] is None for r in read_document_file(url, "jsonl"))


@pytest.mark.ray
def test_limit_over_several_files_gives_the_same_documents_on_every_run(ray_local, sample_model, tmp_path):
    """The first file in order is slow to parse and the others fast: a limit taken from the
    stream would take the rows of the files that finish first."""
    from dlbatch.jobspec import load_job
    from pipelines.papers import build

    src = tmp_path / "in"
    src.mkdir()
    _jsonl(src / "a.jsonl", [f"a{i:05d}" for i in range(60000)], pad="x" * 200)
    for name in "bcdefgh":
        _jsonl(src / f"{name}.jsonl", [f"{name}{i}" for i in range(3)])
    files = list_inputs(str(src), "jsonl")
    spec = load_job("jobs/papers_jsonl.yaml", [f"input.path={src}", "input.id_field=id", "input.limit=5",
                                               f"output.path={tmp_path / 'out'}", "model.max_model_len=2048"])
    seen = []
    for _ in range(2):
        ds = build(spec, files, set(), max_model_len=spec.model.max_model_len, parse_concurrency=4)
        seen.append(sorted({r["doc_id"] for r in ds.iter_rows()}))
    assert seen[0] == seen[1] == [f"a{i:05d}" for i in range(5)]


@pytest.mark.ray
def test_limit_over_the_parts_of_one_file_gives_the_same_documents_on_every_run(ray_local, sample_model, tmp_path,
                                                                                 monkeypatch):
    """One file cut into read tasks (connectors/read_tasks.py) that several prompt actors
    parse in parallel: the limit's rows are the file's first N, whatever part finishes first."""
    import connectors.read_tasks as read_tasks
    from dlbatch.jobspec import load_job
    from pipelines.papers import build

    src = tmp_path / "in"
    src.mkdir()
    _jsonl(src / "a.jsonl", [f"a{i:05d}" for i in range(2000)], blank_every=5, pad="y" * 20)
    monkeypatch.setattr(read_tasks, "READ_TASK_BYTES", 4096)
    monkeypatch.setattr(read_tasks, "FIRST_TASK_BYTES", 512)
    files = list_inputs(str(src), "jsonl")
    spec = load_job("jobs/papers_jsonl.yaml", [f"input.path={src}", "input.id_field=id", "input.limit=300",
                                               f"output.path={tmp_path / 'out'}", "model.max_model_len=2048"])
    assert len(read_tasks.plan_read_tasks(limited_reads(files, "jsonl", 300), "jsonl")) > 4
    seen = []
    for _ in range(2):
        ds = build(spec, files, set(), max_model_len=spec.model.max_model_len, parse_concurrency=4)
        seen.append(sorted({r["doc_id"] for r in ds.iter_rows()}))
    assert seen[0] == seen[1] == [f"a{i:05d}" for i in range(300)]

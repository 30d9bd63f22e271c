"""Connectors: listing, record readers, ids, io_retry and the atomic Parquet sink (local/memory)."""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import pathlib
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from connectors import io_retry
from connectors.ids import content_id
from connectors.listing import list_inputs, read_document_file
from connectors.sink import list_committed, read_committed, write_parquet_atomic
from connectors.text_sources import read_hf, read_jsonl, read_parquet, read_text
from tests.helpers.bad_inputs import build_bad_corpus

ROW_KEYS = {"doc_id", "source", "text", "title", "pages", "error", "error_type"}
PDF_STRUCTURE_KEYS = {"abstract", "sections", "references", "references_span"}  # readable PDFs only


@pytest.fixture
def fast_retries():
    previous = io_retry.set_default_policy(
        io_retry.IOBackoff(max_attempts=4, initial_wait_s=0.001, max_wait_s=0.005, jitter_s=0.001))
    yield
    io_retry.set_default_policy(previous)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_bad_corpus(tmp_path_factory.mktemp("bad"), oversized_pages=30)


# ------------------------------------------------------------------ bad-input corpus


def test_bad_pdfs_become_error_rows_and_good_ones_come_out(corpus):
    urls = list_inputs(str(corpus.pdf_dir), "pdf")
    assert [pathlib.Path(u).name for u in urls] == sorted(corpus.pdf_expected)
    rows = {pathlib.Path(u).name: list(read_document_file(u, "pdf", max_pages=10)) for u in urls}
    for name, expected in corpus.pdf_expected.items():
        (row,) = rows[name]
        assert set(row) == (ROW_KEYS | PDF_STRUCTURE_KEYS if expected is None else ROW_KEYS)
        assert row["error_type"] == expected, (name, row["error"])
        if expected is None:
            assert row["error"] is None and row["text"]
        else:
            assert row["error"] and row["text"] == ""
    big = rows["oversized.pdf"][0]
    assert big["pages"] == corpus.oversized_pages
    assert "marker-010" in big["text"] and "marker-011" not in big["text"]


def test_text_files(corpus):
    urls = list_inputs(str(corpus.text_dir), "text")
    got = {pathlib.Path(u).name: next(read_document_file(u, "text")) for u in urls}
    assert {k: r["error_type"] for k, r in got.items()} == corpus.text_expected
    assert got["notes.md"]["title"] == "Field Notes"
    assert "byte 3" in got["latin1.txt"]["error"]
    replaced = next(read_text(str(corpus.text_dir / "latin1.txt"), errors="replace"))
    assert replaced["error"] is None and "\ufffd" in replaced["text"] and replaced["text"].startswith("Caf")
    with pytest.raises(ValueError, match="id_field"):
        next(read_text(str(corpus.text_dir / "good.txt"), id_field="id"))


def test_jsonl_rows_and_line_numbers(corpus):
    rows = list(read_jsonl(str(corpus.jsonl_path), "text", "id"))
    got = {int(r["source"].rsplit("#line", 1)[1]): r for r in rows}
    assert {n: r["error_type"] for n, r in got.items()} == corpus.jsonl_expected
    assert got[1]["doc_id"] == "a1" and got[1]["title"] == "One" and got[1]["text"] == "First good record."
    assert got[3]["doc_id"] == "a3"  # the id survives on a MissingField row
    assert got[2]["error"].startswith("line 2:")
    # without id_field the id is the content hash and a missing id is no error
    no_ids = {int(r["source"].rsplit("#line", 1)[1]): r for r in read_jsonl(str(corpus.jsonl_path))}
    assert no_ids[8]["error"] is None
    assert no_ids[1]["doc_id"] == hashlib.sha256(b"First good record.").hexdigest()[:16]


def test_jsonl_gz_listed_and_read(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "zipped doc"}\n'))
    (tmp_path / "b.json").write_text('{"text": "plain doc"}\n')
    (tmp_path / "_tmp").mkdir()
    (tmp_path / "_tmp" / "c.jsonl").write_text('{"text": "hidden"}\n')
    (tmp_path / "notes.txt").write_text("not jsonl")
    urls = list_inputs(str(tmp_path), "jsonl")
    assert [pathlib.Path(u).name for u in urls] == ["a.jsonl.gz", "b.json"]
    texts = [r["text"] for u in urls for r in read_document_file(u, "jsonl")]
    assert texts == ["zipped doc", "plain doc"]


def test_parquet_reader(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": ["p0", "p1", "p2"], "body": ["alpha", None, "gamma"],
                             "title": ["A", None, "C"], "extra": [1, 2, 3]}), path)
    rows = list(read_parquet(str(path), text_field="body", id_field="id"))
    assert [r["source"].rsplit("#", 1)[1] for r in rows] == ["row0", "row1", "row2"]
    assert [r["error_type"] for r in rows] == [None, "MissingField", None]
    assert [r["doc_id"] for r in rows] == ["p0", "p1", "p2"]
    assert rows[0]["title"] == "A" and rows[2]["text"] == "gamma"
    # a column that does not exist: every row is a MissingField row
    missing = list(read_parquet(str(path), text_field="nope"))
    assert len(missing) == 3 and {r["error_type"] for r in missing} == {"MissingField"}
    # a corrupt file is one CorruptFile row, not an exception
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    (row,) = list(read_document_file(str(bad), "parquet"))
    assert row["error_type"] == "CorruptFile"


def test_hf_saved_dataset_and_data_files(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    ds = datasets.Dataset.from_dict({"uid": ["h0", "h1", "h2"], "text": ["one", "", "three"]})
    saved = tmp_path / "saved"
    ds.save_to_disk(str(saved))
    assert list_inputs(str(saved), "hf") == [str(saved)]
    rows = list(read_document_file(str(saved), "hf", id_field="uid"))
    assert [r["doc_id"] for r in rows] == ["h0", "h1", "h2"]
    assert [r["error_type"] for r in rows] == [None, "EmptyDocument", None]
    assert rows[2]["source"] == f"{saved}#row2"
    assert os.environ["HF_HUB_OFFLINE"] == "0"  # the offline switch is restored

    dd = datasets.DatasetDict({"train": ds, "test": ds.select([0])})
    dd.save_to_disk(str(tmp_path / "dd"))
    rows = list(read_hf(str(tmp_path / "dd"), id_field="uid"))
    assert [r["source"].rsplit("#", 1)[1] for r in rows] == ["test/row0", "train/row0", "train/row1",
                                                              "train/row2"]
    assert len(list(read_hf(str(tmp_path / "dd"), split="test"))) == 1

    data = tmp_path / "files"
    data.mkdir()
    (data / "part.jsonl").write_text('{"text": "from a data file"}\n{"other": 1}\n')
    rows = [r for u in list_inputs(str(data), "hf") for r in read_document_file(u, "hf")]
    assert [r["error_type"] for r in rows] == [None, "MissingField"]
    (data / "broken.jsonl").write_text('{"text": "ok"}\n{broken\n')
    rows = list(read_hf(str(data / "broken.jsonl")))
    assert [r["error_type"] for r in rows] == [None, "MalformedJSON"]
    assert rows[1]["source"].endswith("#line2")


# ------------------------------------------------------------------ ids


def test_doc_ids_are_stable_content_hashes(tmp_path):
    (tmp_path / "a.txt").write_text("same words")
    (tmp_path / "b.txt").write_text("same words")
    (tmp_path / "c.txt").write_text("other words")
    ids = [next(read_document_file(u, "text"))["doc_id"] for u in list_inputs(str(tmp_path), "text")]
    assert ids[0] == ids[1] == content_id("same words") == hashlib.sha256(b"same words").hexdigest()[:16]
    assert ids[2] != ids[0]
    assert content_id(b"\x00\x01") == hashlib.sha256(b"\x00\x01").hexdigest()[:16]
    with pytest.raises(TypeError):
        content_id(12)


def test_id_field_values_map_to_ids_one_to_one():
    """Distinct values, distinct ids (a string is never a number, nor spaces nothing); equal
    values, equal ids; plain strings stay as they are (existing outputs resume)."""
    from connectors.ids import id_from_field

    distinct = [" a ", "a", "a ", 1, "1", True, "True", "true", "bool:true", 1.5, "num:1", "str:x", "x", [1], "[1]",
                {"k": 1}, -1, 10 ** 20]
    ids = [id_from_field(v) for v in distinct]
    assert len(set(ids)) == len(ids), ids
    assert id_from_field(1) == id_from_field(1.0) == id_from_field(1.0 + 0) and id_from_field(b"a") == id_from_field("a")
    assert id_from_field({"b": 1, "a": 2}) == id_from_field({"a": 2, "b": 1})
    for plain in ("a", "doc-17", "17", "x y", "True"):
        assert id_from_field(plain) == plain
    for missing in (None, "", "  ", float("nan")):
        assert id_from_field(missing) is None


# ------------------------------------------------------------------ listing


def test_links_out_of_the_input_folder_are_skipped_with_a_warning(tmp_path, caplog):
    inp, elsewhere = tmp_path / "incoming", tmp_path / "private"
    inp.mkdir()
    elsewhere.mkdir()
    (inp / "a.jsonl").write_text('{"text": "mine"}\n')
    (elsewhere / "secret.jsonl").write_text('{"text": "not for the output"}\n')
    (elsewhere / "more").mkdir()
    (elsewhere / "more" / "b.jsonl").write_text('{"text": "nor this"}\n')
    (inp / "link.jsonl").symlink_to(elsewhere / "secret.jsonl")
    (inp / "linked_dir").symlink_to(elsewhere / "more")
    (inp / "alias.jsonl").symlink_to(inp / "a.jsonl")  # a link that stays inside: read
    with caplog.at_level("WARNING", logger="connectors.listing"):
        got = list_inputs(str(inp), "jsonl")
    assert got == [str(inp / "a.jsonl"), str(inp / "alias.jsonl")]
    assert f"{inp / 'link.jsonl'} resolves to {elsewhere / 'secret.jsonl'}" in caplog.text
    assert "b.jsonl" not in caplog.text  # a linked folder is not walked into at all
    assert list_inputs(str(inp / "*.jsonl"), "jsonl") == got  # a glob too
    assert list_inputs(str(inp / "link.jsonl"), "jsonl") == [str(inp / "link.jsonl")]  # named: read as named


def test_listing_forms_and_errors(tmp_path):
    for name in ["b.pdf", "a.PDF", "c.txt"]:
        (tmp_path / name).write_bytes(b"%PDF-1.4")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.pdf").write_bytes(b"%PDF-1.4")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "e.pdf").write_bytes(b"%PDF-1.4")
    expected = [str(tmp_path / n) for n in ["a.PDF", "b.pdf", "sub/d.pdf"]]
    assert list_inputs(str(tmp_path), "pdf") == expected
    assert list_inputs(f"file://{tmp_path}", "pdf") == expected
    assert list_inputs(str(tmp_path / "*.pdf"), "pdf") == [str(tmp_path / "b.pdf")]
    assert list_inputs(str(tmp_path / "c.txt"), "pdf") == [str(tmp_path / "c.txt")]  # named file
    with pytest.raises(FileNotFoundError, match="does not exist.*nowhere"):
        list_inputs(str(tmp_path / "nowhere"), "pdf")
    with pytest.raises(FileNotFoundError, match="no parquet inputs"):
        list_inputs(str(tmp_path), "parquet")
    with pytest.raises(FileNotFoundError, match="glob"):
        list_inputs(str(tmp_path / "*.xyz"), "pdf")
    with pytest.raises(ValueError, match="unknown input format"):
        list_inputs(str(tmp_path), "docx")


def test_memory_url_listing_and_reading():
    root = f"memory://corpus-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    fs.pipe({f"{root}/x/2.jsonl": b'{"text": "two"}\n', f"{root}/x/1.jsonl": b'{"text": "one"}\n'})
    urls = list_inputs(root, "jsonl")
    assert urls == sorted(urls) and len(urls) == 2 and all(u.startswith("memory://") for u in urls)
    assert [r["text"] for u in urls for r in read_document_file(u, "jsonl")] == ["one", "two"]


# ------------------------------------------------------------------ io_retry


def _client_error(status: int, code: str):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def test_transient_classification():
    transient = [ConnectionResetError("reset"), TimeoutError("slow"), OSError(errno.EIO, "io"),
                 OSError(errno.EBUSY, "SlowDown"), _client_error(503, "SlowDown"),
                 _client_error(500, "InternalError"), _client_error(429, "TooManyRequests")]
    permanent = [FileNotFoundError("x"), PermissionError("x"), OSError(errno.EINVAL, "bad arg"),
                 _client_error(404, "NoSuchKey"), _client_error(403, "AccessDenied"),
                 ValueError("not io"), KeyError("k")]
    assert all(io_retry.is_transient(e) for e in transient)
    assert not any(io_retry.is_transient(e) for e in permanent)


def test_retry_then_success_counts_retries(fast_retries):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("peer reset")
        return "ok"

    before = io_retry.retry_count()
    assert io_retry.call_with_retry(flaky, op="flaky op") == "ok"
    assert len(calls) == 3 and io_retry.retry_count() - before == 2


def test_permanent_error_raised_at_once(fast_retries):
    calls = []

    @io_retry.retry_io
    def missing():
        calls.append(1)
        raise FileNotFoundError("s3://b/nothing")

    before = io_retry.retry_count()
    with pytest.raises(FileNotFoundError) as info:
        missing()
    assert len(calls) == 1 and io_retry.retry_count() == before
    assert any("permanent" in n for n in info.value.__notes__)


def test_gives_up_after_bounded_attempts(fast_retries):
    calls = []

    @io_retry.retry_io(op="always failing")
    def always():
        calls.append(1)
        raise _client_error(503, "SlowDown")

    with pytest.raises(Exception) as info:
        always()
    assert len(calls) == 4
    assert any("after 4 attempts" in n for n in info.value.__notes__)
    with pytest.raises(ValueError):
        io_retry.IOBackoff(max_attempts=0)


class FlakyMemoryFS(MemoryFileSystem):
    """A memory filesystem whose first ``failures`` reads/writes raise a transient error."""

    protocol = "flakymem"
    failures = 0

    def _maybe_fail(self):
        if FlakyMemoryFS.failures > 0:
            FlakyMemoryFS.failures -= 1
            raise ConnectionResetError("injected transient failure")

    def cat_file(self, path, start=None, end=None, **kwargs):
        self._maybe_fail()
        return super().cat_file(path, start=start, end=end, **kwargs)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        self._maybe_fail()
        return super().pipe_file(path, value, mode=mode, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            self._maybe_fail()
        return super()._open(path, mode=mode, **kwargs)


def test_fault_injection_reads_and_writes_are_retried(fast_retries):
    fsspec.register_implementation("flakymem", FlakyMemoryFS, clobber=True)
    root = f"flakymem://run-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("flakymem")
    paper = pathlib.Path(__file__).resolve().parent.parent / "samples/papers/kv_cache_transfer.pdf"
    fs.pipe(f"{root}/in/paper.pdf", paper.read_bytes())
    fs.pipe(f"{root}/in/docs.jsonl", b'{"text": "hello"}\n')

    before = io_retry.retry_count()
    FlakyMemoryFS.failures = 2
    (row,) = read_document_file(list_inputs(f"{root}/in", "pdf")[0], "pdf")
    assert row["error"] is None and row["title"].startswith("Moving Attention")
    FlakyMemoryFS.failures = 2
    assert [r["text"] for r in read_document_file(f"{root}/in/docs.jsonl", "jsonl")] == ["hello"]
    FlakyMemoryFS.failures = 2
    write_parquet_atomic(pa.table({"x": [1, 2]}), f"{root}/out", "part-0.parquet")
    assert read_committed(f"{root}/out").column("x").to_pylist() == [1, 2]
    assert io_retry.retry_count() - before == 6

    FlakyMemoryFS.failures = 10  # more than max_attempts: the transient error surfaces
    with pytest.raises(ConnectionResetError):
        list(read_document_file(f"{root}/in/paper.pdf", "pdf"))
    FlakyMemoryFS.failures = 0


# ------------------------------------------------------------------ sink


def test_sink_atomic_idempotent_and_ignores_tmp(tmp_path):
    dest = str(tmp_path / "out")
    t0 = pa.table({"doc_id": ["a", "b"], "n": [1, 2]})
    t1 = pa.table({"doc_id": ["c"], "n": [3]})
    url = write_parquet_atomic(t0, dest, "part-00000.parquet")
    assert url == str(tmp_path / "out" / "part-00000.parquet")
    assert write_parquet_atomic(t0, dest, "part-00000.parquet") == url  # same content: no-op
    write_parquet_atomic(t1, dest, "part-00001.parquet")
    with pytest.raises(FileExistsError, match="different content"):
        write_parquet_atomic(t1, dest, "part-00000.parquet")
    # leftovers of a crashed writer and hidden files are never read
    (tmp_path / "out" / "_tmp" / "dead.parquet").write_bytes(b"partial garbage")
    (tmp_path / "out" / ".part-x.parquet").write_bytes(b"hidden")
    assert [pathlib.Path(p).name for p in list_committed(dest)] == ["part-00000.parquet",
                                                                    "part-00001.parquet"]
    table = read_committed(dest)
    assert table.column("doc_id").to_pylist() == ["a", "b", "c"]
    assert sorted(os.listdir(tmp_path / "out" / "_tmp")) == ["dead.parquet"]  # own temps removed
    write_parquet_atomic(t1, dest, "part-00000.parquet", on_conflict="overwrite")
    assert read_committed(dest).num_rows == 2
    assert list_committed(str(tmp_path / "never")) == [] and read_committed(str(tmp_path / "never")).num_rows == 0
    for bad in ["../x.parquet", "_tmp.parquet", "x.csv", ""]:
        with pytest.raises(ValueError):
            write_parquet_atomic(t0, dest, bad)


def test_rows_round_trip_through_sink(corpus, tmp_path):
    rows = list(read_jsonl(str(corpus.jsonl_path), "text", "id"))
    table = pa.Table.from_pylist(rows)
    write_parquet_atomic(table, f"file://{tmp_path}/rows", "rows.parquet")
    back = read_committed(str(tmp_path / "rows")).to_pylist()
    assert back == [{**r, "columns": r.get("columns")} for r in rows]  # a good row's input columns
    assert json.loads(json.dumps({k: v for k, v in back[0].items() if k != "columns"}))["doc_id"] == "a1"


def test_reading_committed_parts_never_aborts_the_process_at_exit(tmp_path):
    """Regression: pyarrow's read_table freed the Python bytes it read from on an Arrow thread
    after returning; racing interpreter exit, that aborted ~1 process in 3 (exit 134, e.g. a
    no-op rerun of a finished job); with Arrow's CPU pool decoding the columns, ~1 in 80 still
    did. Each subprocess reads the committed parts and exits."""
    import subprocess
    import sys

    import pyarrow as pa

    from connectors.sink import write_parquet_atomic

    for k in range(4):
        write_parquet_atomic(pa.table({"doc_id": [f"d{k}"] * 50, "x": list(range(50))}), str(tmp_path),
                             f"part-{k}.parquet")
    code = ("import sys; from connectors.sink import read_committed; "
            "t = read_committed(sys.argv[1]); assert t.num_rows == 200, t.num_rows")
    rcs = [subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True).returncode
           for _ in range(40)]
    assert rcs == [0] * 40, rcs

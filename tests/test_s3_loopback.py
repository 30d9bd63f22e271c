"""S3 end to end against moto on 127.0.0.1: list, read, commit Parquet, read back; fault injection."""

from __future__ import annotations

import pathlib

import fsspec
import pyarrow as pa
import pytest

from connectors import io_retry
from connectors.listing import list_inputs, read_document_file
from connectors.sink import list_committed, read_committed, write_parquet_atomic

PAPERS = sorted((pathlib.Path(__file__).resolve().parent.parent / "samples" / "papers").glob("*.pdf"))


@pytest.fixture
def loaded_bucket(s3_bucket, s3_options):
    fs = fsspec.filesystem("s3", **s3_options)
    for pdf in PAPERS:
        fs.pipe_file(f"{s3_bucket}/in/papers/{pdf.name}", pdf.read_bytes())
    fs.pipe_file(f"{s3_bucket}/in/records/docs.jsonl",
                 b'{"id": "r1", "text": "first"}\n{"id": "r2"}\n{"id": "r3", "text": "third"}\n')
    fs.pipe_file(f"{s3_bucket}/in/papers/_tmp/ignored.pdf", b"%PDF-1.4 junk")
    return s3_bucket


def test_s3_list_read_write_roundtrip(loaded_bucket, s3_options):
    bucket = loaded_bucket
    urls = list_inputs(f"s3://{bucket}/in/papers", "pdf", storage_options=s3_options)
    assert urls == [f"s3://{bucket}/in/papers/{p.name}" for p in PAPERS]
    assert list_inputs(f"s3://{bucket}/in/papers/*.pdf", "pdf", storage_options=s3_options) == urls
    rows = [r for u in urls for r in read_document_file(u, "pdf", storage_options=s3_options)]
    import pymupdf

    pages = {p.name: pymupdf.open(p).page_count for p in PAPERS}  # the same PDFs read locally
    assert all(r["error"] is None and r["pages"] == pages[r["source"].rsplit("/", 1)[-1]] for r in rows)
    assert rows[0]["source"] == urls[0]
    assert "Moving Attention Caches Between Unlike Accelerators" in {r["title"] for r in rows}

    (jsonl,) = list_inputs(f"s3://{bucket}/in/records", "jsonl", storage_options=s3_options)
    records = list(read_document_file(jsonl, "jsonl", id_field="id", storage_options=s3_options))
    assert [(r["doc_id"], r["error_type"]) for r in records] == [("r1", None), ("r2", "MissingField"),
                                                                ("r3", None)]
    assert records[1]["source"] == f"{jsonl}#line2"

    dest = f"s3://{bucket}/out/summaries"
    table = pa.Table.from_pylist(rows + records)
    final = write_parquet_atomic(table, dest, "part-00000.parquet", storage_options=s3_options)
    assert final == f"{dest}/part-00000.parquet"
    write_parquet_atomic(table, dest, "part-00000.parquet", storage_options=s3_options)  # idempotent
    fs = fsspec.filesystem("s3", **s3_options)
    fs.invalidate_cache()
    assert fs.find(f"{bucket}/out") == [f"{bucket}/out/summaries/part-00000.parquet"]  # no temp left
    fs.pipe_file(f"{bucket}/out/summaries/_tmp/crashed.parquet", b"half written")
    assert list_committed(dest, storage_options=s3_options) == [final]
    back = read_committed(dest, storage_options=s3_options)
    assert back.num_rows == len(rows) + len(records)
    assert back.column("doc_id").to_pylist() == [r["doc_id"] for r in rows + records]

    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_inputs(f"s3://{bucket}/missing/", "pdf", storage_options=s3_options)


def test_s3_transient_read_failures_are_retried(loaded_bucket, s3_options, monkeypatch):
    from botocore.exceptions import ClientError

    previous = io_retry.set_default_policy(io_retry.IOBackoff(max_attempts=4, initial_wait_s=0.001,
                                                                max_wait_s=0.005, jitter_s=0.001))
    try:
        url = f"s3://{loaded_bucket}/in/papers/{PAPERS[0].name}"
        fs, _ = fsspec.core.url_to_fs(url, **s3_options)  # the cached instance the connector uses
        real_cat_file = fs.cat_file
        failures = {"left": 2}

        def flaky_cat_file(path, *args, **kwargs):
            if failures["left"]:
                failures["left"] -= 1
                raise ClientError({"Error": {"Code": "SlowDown", "Message": "injected"},
                                   "ResponseMetadata": {"HTTPStatusCode": 503}}, "GetObject")
            return real_cat_file(path, *args, **kwargs)

        monkeypatch.setattr(fs, "cat_file", flaky_cat_file)
        before = io_retry.retry_count()
        (row,) = read_document_file(url, "pdf", storage_options=s3_options)
        assert row["error"] is None and row["text"]
        assert io_retry.retry_count() - before == 2 and failures["left"] == 0

        # a permanent error (missing key) is not retried
        before = io_retry.retry_count()
        with pytest.raises(FileNotFoundError):
            list(read_document_file(f"s3://{loaded_bucket}/in/papers/nope.pdf", "pdf",
                                    storage_options=s3_options))
        assert io_retry.retry_count() == before
    finally:
        io_retry.set_default_policy(previous)

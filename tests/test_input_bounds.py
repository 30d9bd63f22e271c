"""Inputs are bounded before work (issue 37, point 9): a JSONL or OpenAI batch line longer than
``input.max_line_bytes`` is that line's ``LineTooLong`` dead letter, read past without being
held; a document's text longer than ``input.max_text_chars`` is cut to it where it is parsed
(a PDF's in its parser process), the row saying how much went (``text_truncated_chars``).
The drills parse a 100 MB JSONL line and an 18 KB PDF that expands to 6 M characters in a
fresh process and assert its peak memory."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from connectors.listing import count_rows, list_inputs, read_document_file
from connectors.parse import parse_file
from tests.helpers.bounded_inputs import WORDS, bomb_pdf, huge_line_jsonl


def _jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_a_line_over_the_cap_is_its_own_dead_letter_and_the_others_are_read(tmp_path):
    long_text = "x" * 5000
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"id": "a", "text": "short"}), "",
                                          json.dumps({"id": "b", "text": long_text}),
                                          json.dumps({"id": "c", "text": "after"})])
    rows = list(read_document_file(path, "jsonl", id_field="id", max_line_bytes=1000))
    assert [r["doc_id"] for r in rows if not r["error"]] == ["a", "c"]
    (bad,) = [r for r in rows if r["error"]]
    assert bad["error_type"] == "LineTooLong" and bad["source"] == f"{path}#line3"
    assert "line 3: 5023 bytes, over input.max_line_bytes=1000" in bad["error"]
    assert count_rows(path, "jsonl", 10, max_line_bytes=1000) == len(rows) == 3  # input.limit counts it too
    assert [r["doc_id"] for r in read_document_file(path, "jsonl", id_field="id", max_line_bytes=None)] == ["a", "b", "c"]


def test_bounded_lines_in_a_compressed_file(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"text": "y" * 3000}) + "\n" + json.dumps({"text": "ok"}) + "\n")
    rows = list(read_document_file(str(path), "jsonl", max_line_bytes=2000))
    assert [r["error_type"] for r in rows] == ["LineTooLong", None] and rows[1]["text"] == "ok"


def test_a_long_text_is_cut_and_the_row_says_how_much(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = "word " * 400  # 2000 characters
    jsonl = _jsonl(tmp_path / "d.jsonl", [json.dumps({"text": text}), json.dumps({"text": "short"})])
    (long, short) = read_document_file(jsonl, "jsonl", max_text_chars=500)
    assert long["text"] == text[:500] and long["text_truncated_chars"] == 1500
    whole = next(read_document_file(jsonl, "jsonl", max_text_chars=None))
    assert whole["text"] == text and long["doc_id"] == whole["doc_id"]  # the id is the whole document's
    assert short["text"] == "short" and short.get("text_truncated_chars") is None
    pq.write_table(pa.table({"text": [text]}), tmp_path / "d.parquet")
    (row,) = read_document_file(str(tmp_path / "d.parquet"), "parquet", max_text_chars=100)
    assert len(row["text"]) == 100 and row["text_truncated_chars"] == 1900
    (tmp_path / "d.txt").write_text(text)
    (row,) = parse_file({"url": str(tmp_path / "d.txt")}, "text", "text", None, None, None, max_text_chars=10)
    assert row["text"] == text[:10] and row["text_truncated_chars"] == 1990


def test_a_pdf_text_is_cut_in_the_parser_with_its_structure(tmp_path):
    pdf = tmp_path / "b.pdf"
    pdf.write_bytes(bomb_pdf(pages=20, lines=20))
    (whole,) = parse_file({"url": str(pdf)}, "pdf", "text", None, None, None, max_text_chars=None)
    (cut,) = parse_file({"url": str(pdf)}, "pdf", "text", None, None, None, max_text_chars=3000)
    assert whole["text_truncated_chars"] is None and len(whole["text"]) > 30_000
    assert cut["text"] == whole["text"][:3000] and cut["text_truncated_chars"] == len(whole["text"]) - 3000
    assert cut["doc_id"] == whole["doc_id"]
    structure = json.loads(cut["structure"])
    assert sum(len(s["text"]) for s in structure["sections"]) <= 3000 and len(structure["abstract"]) <= 3000


def test_an_over_long_request_line_keeps_its_custom_id_and_its_own_place(tmp_path):
    from connectors.openai_batch import custom_ids

    body = {"model": "m", "messages": [{"role": "user", "content": "z" * 5000}]}
    lines = [json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}),
             json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/chat/completions", "body": body}),
             json.dumps({"method": "POST", "custom_id": "late", "url": "/v1/chat/completions", "body": body})]
    path = _jsonl(tmp_path / "b.jsonl", lines)
    rows = list(read_document_file(path, "openai_batch", max_line_bytes=1000))
    assert [r["error_type"] for r in rows] == [None, "LineTooLong", "LineTooLong"]
    assert rows[1]["doc_id"] != "big" and rows[1]["source"] == f"{path}#line2"
    import fsspec

    fs = fsspec.filesystem("file")
    assert custom_ids(path, fs, {1, 2, 3}, max_line_bytes=1000) == {1: "r1", 2: "big"}  # line 3 does not start with it
    lines.append(json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/completions", "body": {"model": "m"}}))
    _jsonl(tmp_path / "b.jsonl", lines)
    with pytest.raises(ValueError, match=r"custom_id 'big' is on .*b\.jsonl line 2 and .*b\.jsonl line 4"):
        list_inputs(path, "openai_batch", max_line_bytes=1000)


def _drill(fmt: str, path, caps: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.bounded_inputs", fmt, str(path), json.dumps(caps)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_drill_a_100_mb_jsonl_line_costs_the_parser_the_cap_not_the_line(tmp_path):
    path = tmp_path / "huge.jsonl"
    huge_line_jsonl(str(path), mib=100)
    got = _drill("jsonl", path, {})  # the job's defaults: max_line_bytes 16 MiB
    assert [(r["source"].rsplit("#", 1)[1], r["error_type"]) for r in got["rows"]] == [
        ("line1", None), ("line2", "LineTooLong"), ("line3", None)]
    assert got["grew_mb"] < 64, got  # read whole, the line and its parse took over 300 MB


@pytest.mark.slow
def test_drill_a_30_kb_pdf_that_expands_to_millions_of_characters(tmp_path):
    path = tmp_path / "bomb.pdf"
    data = bomb_pdf(pages=1000, lines=60)
    assert len(data) < 30_000
    path.write_bytes(data)
    got = _drill("pdf", path, {"max_text_chars": 200_000})
    (row,) = got["rows"]
    expanded = 1000 * 60 * (len(WORDS) + 3)  # each line's words, its number and the line break, about
    assert row["error_type"] is None and row["chars"] == 200_000
    assert row["text_truncated_chars"] > 0.9 * expanded - 200_000, row
    assert got["grew_mb"] < 48, got  # the 6 M characters stay in the parser process
    assert got["child_peak_mb"] < 1024, got

"""connectors.formats: one table of the input formats. The job schema takes its names, each
format's counter agrees with its reader, and the traits the rest of the tree asks
(one document per file, input columns) are the table's."""
from __future__ import annotations

import json
import pathlib
import shutil
import typing

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.formats import FORMATS, INPUT_FORMATS, input_format
from connectors.listing import count_rows, list_inputs, read_document_file
from connectors.parse import parse_file

SAMPLES = pathlib.Path(__file__).resolve().parent.parent / "samples"


def test_the_job_schema_takes_the_tables_formats():
    from dlbatch.jobspec.inputs import InputSpec

    assert typing.get_args(InputSpec.model_fields["format"].annotation) == FORMATS
    assert InputSpec.model_fields["format"].default in FORMATS


def test_an_unknown_format_is_named():
    with pytest.raises(ValueError, match=r"unknown input format 'docx'; expected one of \['pdf', 'jsonl'"):
        input_format("docx")


def test_one_document_per_file_has_no_columns():
    assert [f.name for f in INPUT_FORMATS.values() if f.one_doc_per_file] == ["pdf", "text"]
    assert all(f.has_columns != f.one_doc_per_file for f in INPUT_FORMATS.values())
    assert input_format("openai_batch").id_field == "custom_id"


def _inputs(tmp_path) -> dict[str, str]:
    """One small file of each local format."""
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join([json.dumps({"text": f"doc {i}"}) for i in range(3)] + ["", "{broken"]) + "\n")
    parquet = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(4)]}), parquet)
    text = tmp_path / "a.md"
    text.write_text("# A title\n\nSome text.")
    pdf = tmp_path / "a.pdf"
    shutil.copy(SAMPLES / "papers" / "kv_cache_transfer.pdf", pdf)
    batch = tmp_path / "b.jsonl"
    shutil.copy(SAMPLES / "openai_batch.jsonl", batch)
    return {"jsonl": str(jsonl), "parquet": str(parquet), "text": str(text), "pdf": str(pdf),
            "openai_batch": str(batch), "hf": str(jsonl)}


def test_each_formats_counter_agrees_with_its_reader(tmp_path):
    for fmt, url in _inputs(tmp_path).items():
        rows = list(read_document_file(url, fmt))
        assert count_rows(url, fmt, 1 << 62) == len(rows) > 0, fmt
        assert count_rows(url, fmt, 1) == 1, fmt
        if input_format(fmt).one_doc_per_file:
            assert len(rows) == 1, fmt


def test_the_byte_cap_applies_to_one_document_files_only(tmp_path):
    files = _inputs(tmp_path)
    capped = {fmt for fmt in ("text", "jsonl", "parquet")
              if parse_file({"url": files[fmt]}, fmt, "text", None, None, None,
                            max_file_bytes=8)[0]["error_type"] == "FileTooLarge"}
    assert capped == {"text"}
    assert list_inputs(str(tmp_path), "text") == [files["text"]]  # the table's extensions: .txt, .md

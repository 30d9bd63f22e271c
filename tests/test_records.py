"""dlbatch.records: a request's key and name, the result row and its schema, as every stage
reads them."""
from __future__ import annotations

import pytest

from dlbatch.records import (ERROR_COLUMNS, RESULT_COLUMNS, RequestKey, base_task, error_schema, request_id,
                             result_row, result_schema)


@pytest.mark.parametrize("key, name", [
    (RequestKey("d1", "summary"), "summary"),
    (RequestKey("d1", "ideas", sample=3), "ideas~3"),
    (RequestKey("d1", "summary", part="map:summary:0:4"), "summary#map:summary:0:4"),
    (RequestKey("d1", "summary", part="reduce:summary:2:0"), "summary#reduce:summary:2:0"),
])
def test_a_key_names_its_request_and_parses_back(key, name):
    assert key.name == name and key.id == f"d1::{name}"
    assert RequestKey.parse("d1", name) == key == RequestKey.of({"doc_id": "d1", "task": name})
    assert request_id({"doc_id": "d1", "task": name}) == key.id
    assert base_task(name) == key.task
    assert key.with_sample(0).with_part(None) == RequestKey("d1", key.task)


def test_a_doc_id_with_the_separators_stays_the_doc_id():
    key = RequestKey("a::b#c~1", "keywords", sample=2)
    assert key.id == "a::b#c~1::keywords~2" and RequestKey.parse(key.doc_id, key.name) == key


def test_result_row_takes_the_request_the_result_and_the_overrides():
    request = {"doc_id": "d1", "source": "s.pdf", "task": "summary", "prompt_ids": [1, 2, 3], "truncated": True,
               "text": "body", "long_input_policy": "truncate", "doc_tokens": 9000, "kept_tokens": 2000,
               "columns": b"packed"}
    result = {"output": "A summary.", "output_tokens": 4, "finish_reason": "stop", "ttft_s": 0.5, "latency_s": 1.0}
    row = result_row(request, result, "m", extra=lambda task, res: {"valid": task == "summary" and res is result})
    assert set(RESULT_COLUMNS) <= set(row) and row["valid"] is True
    assert (row["task"], row["output"], row["prompt_tokens"], row["output_tokens"], row["truncated"], row["model"],
            row["kept_tokens"], row["chunks"], row["text"], row["columns"]) == (
        "summary", "A summary.", 3, 4, True, "m", 2000, None, "body", b"packed")
    final = result_row(request, result, "m", task="notes", chunks=5, truncated=False)
    assert (final["task"], final["chunks"], final["truncated"]) == ("notes", 5, False)


def test_the_column_lists_are_the_schemas_names():
    import pyarrow as pa

    assert result_schema(False).names == RESULT_COLUMNS
    assert result_schema(True, [pa.field("valid", pa.bool_())]).names == RESULT_COLUMNS + ["text", "valid"]
    assert error_schema().names == ERROR_COLUMNS

"""Kept input columns of different types across rows (issue 37, point 8): a value that does not
fit its column's type is that row's dead letter, never the job's; the flush commits the
others, the whole output reads with one type per column, and a rerun is a no-op."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

from connectors.columns import pack
from dlbatch.output.parquet_store import ParquetStore

TASKS = ("summary", "keywords")


def _rows(doc: str, **columns):
    packed = pack({"id": doc, **columns})
    return [{"doc_id": doc, "source": "in.jsonl", "task": t, "output": f"{t} of {doc}", "prompt_tokens": 4,
             "output_tokens": 1, "columns": packed} for t in TASKS]


def _dead(store):
    return {e["doc_id"]: e for e in store.errors().to_pylist()}


def _store(fmt, out, keep):
    if fmt == "delta":
        pytest.importorskip("deltalake")
        from dlbatch.output.delta_store import DeltaStore

        return DeltaStore(str(out), keep_columns=keep)
    return ParquetStore(str(out), keep_columns=keep)


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_a_value_that_does_not_fit_its_column_is_that_documents_dead_letter(tmp_path, fmt):
    out = tmp_path / "out"
    store = _store(fmt, out, ["level"])
    # one flush: 1, "one", 2 -> int64 (most documents); "one" does not fit
    store.commit(_rows("a", level=1) + _rows("b", level="one") + _rows("c", level=2), [], False)
    res = store.results()
    assert res.schema.field("level").type == pa.int64()
    assert sorted({(r["doc_id"], r["level"]) for r in res.to_pylist()}) == [("a", 1), ("c", 2)]
    dead = _dead(store)
    assert set(dead) == {"b"} and dead["b"]["error_type"] == "ColumnType" and dead["b"]["task"] is None
    assert "'level'" in dead["b"]["error"] and "string" in dead["b"]["error"] and "int64" in dead["b"]["error"]
    # a later flush (another process): the committed type holds; null and narrower values fit
    again = _store(fmt, out, ["level"])
    again.commit(_rows("d", level="two") + _rows("e", level=None) + _rows("f", level=2.5) + _rows("g"), [], False)
    assert sorted(_dead(again)) == ["b", "d", "f"] and "double" in _dead(again)["f"]["error"]
    res = again.results()
    assert res.schema.field("level").type == pa.int64()
    assert sorted({(r["doc_id"], r["level"]) for r in res.to_pylist()}) == [
        ("a", 1), ("c", 2), ("e", None), ("g", None)]
    prog = again.progress(tasks=set(TASKS))  # what a rerun skips: every document has its outcome
    assert sorted(prog["done_ids"].to_pylist()) == ["a", "c", "e", "g"]
    assert sorted(prog["failed_ids"].to_pylist()) == ["b", "d", "f"]


def test_the_columns_type_comes_from_the_flush_when_its_values_promote(tmp_path):
    """int and float give float64; a struct gains fields; every document fits."""
    store = ParquetStore(str(tmp_path / "out"), keep_columns="all")
    store.commit(_rows("a", score=1, meta={"x": 1}) + _rows("b", score=0.5, meta={"x": 2, "y": "z"}), [], False)
    res = store.results()
    assert res.schema.field("score").type == pa.float64()
    assert res.schema.field("meta").type == pa.struct([("x", pa.int64()), ("y", pa.string())])
    assert store.errors().num_rows == 0 and res.num_rows == 4


@pytest.mark.slow
@pytest.mark.ray
def test_a_jsonl_with_a_mixed_type_kept_column_runs_to_completion_and_reruns_as_a_noop(ray_local, sample_model,
                                                                                       tmp_path):
    from tests.helpers.jobs import run_job

    src = tmp_path / "rows.jsonl"
    docs = [("a", 1), ("b", "one"), ("c", 3)]
    src.write_text("".join(json.dumps({"id": d, "text": f"Passage {d}: the sky is blue because of Rayleigh "
                                                        f"scattering of sunlight.", "level": v}) + "\n"
                           for d, v in docs))
    out = str(tmp_path / "out")
    extra = [f"input.path={src}", "input.id_field=id", "output.keep_columns=[level]"]
    rep = run_job("jobs/papers_jsonl.yaml", out, extra)
    assert not rep.get("noop")
    store = ParquetStore(out)
    res = store.results()
    assert res.schema.field("level").type == pa.int64()
    assert sorted({(r["doc_id"], r["level"]) for r in res.to_pylist()}) == [("a", 1), ("c", 3)]
    dead = _dead(store)
    assert set(dead) == {"b"} and dead["b"]["error_type"] == "ColumnType", dead
    assert run_job("jobs/papers_jsonl.yaml", out, extra).get("noop")  # the rerun has nothing to do

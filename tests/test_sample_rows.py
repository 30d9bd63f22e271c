"""One row per sample (issue 38, point 10): ``output.samples: rows`` writes each of a task's n
samples as its own row with ``sample_index``; the list column stays the default."""
from __future__ import annotations

import json

import pytest

from dlbatch.prompts.sampling import sample_rows

PASSAGE = "Rivers carry sediment to the sea, where deltas form as the current slows. " * 3


def _row(task, samples=None):
    row = {"doc_id": "d", "task": task, "output": "first", "output_tokens": 1, "finish_reason": "stop",
           "logprobs": None, "prompt_tokens": 7}
    if samples is not None:
        row["samples"] = samples
    return row


def test_each_sample_is_a_row_numbered_by_sample_index():
    samples = [{"output": o, "output_tokens": n, "finish_reason": f, "logprobs": None}
               for o, n, f in (("first", 1, "stop"), ("second", 2, "length"), ("third", 3, "stop"))]
    rows = sample_rows([_row("answer", samples), _row("title")], lambda task, s: {"valid": s["output"] != "second"})
    assert [(r["task"], r["sample_index"], r["output"], r["output_tokens"], r["finish_reason"]) for r in rows] == [
        ("answer", 0, "first", 1, "stop"), ("answer", 1, "second", 2, "length"), ("answer", 2, "third", 3, "stop"),
        ("title", 0, "first", 1, "stop")]
    assert [r.get("valid") for r in rows] == [True, False, True, None]  # typed columns per sample
    assert all("samples" not in r and r["prompt_tokens"] == 7 for r in rows)


def test_a_row_per_sample_is_its_own_result_and_not_a_duplicate():
    import pyarrow as pa

    from dlbatch.output.progress import committed_progress
    from dlbatch.output.rows import result_key

    assert result_key({"doc_id": "d", "task": "t"}) == ("d", "t")  # the list default: as ever
    assert result_key({"doc_id": "d", "task": "t", "sample_index": 1}) != result_key(
        {"doc_id": "d", "task": "t", "sample_index": 0})
    index = pa.table({"doc_id": ["d"] * 4, "source": ["s"] * 4, "task": ["t"] * 4, "prompt_tokens": [1] * 4,
                      "output_tokens": [1] * 4, "sample_index": [0, 1, 2, 2]})
    errors = pa.table({"doc_id": pa.array([], pa.string()), "source": pa.array([], pa.string()),
                       "task": pa.array([], pa.string())})
    prog = committed_progress(index, errors, {"t"})
    assert (prog["n_done"], prog["rows"], prog["duplicates"]) == (1, 4, 1)


def test_rows_are_refused_for_openai_batch_lines(tmp_path):
    from dlbatch.jobspec import JobSpecError, load_job

    with pytest.raises(JobSpecError, match="output.samples rows"):
        load_job("jobs/openai_batch.yaml", ["output.samples=rows", f"output.path={tmp_path / 'o'}"])


@pytest.mark.ray
def test_a_job_writes_one_row_per_sample_and_reruns_to_nothing(ray_local, sample_model, tmp_path):
    from dlbatch.driver.runner import JobRunner
    from dlbatch.jobspec import load_job
    from dlbatch.output.parquet_store import ParquetStore

    src = tmp_path / "q.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "context": PASSAGE, "topic": "geo", "question": q}) + "\n"
                           for i, q in enumerate(["Where do deltas form?", "What do rivers carry?"])))
    out = str(tmp_path / "out")
    sets = [f"input.path={src}", f"output.path={out}", "output.samples=rows", "model.dtype=float32",
            "tasks.0.max_tokens=6", "tasks.0.sampling.n=3", "tasks.0.sampling.logprobs=null",
            "tasks.1.max_tokens=8"]
    rep = JobRunner(load_job("jobs/synthetic_qa.yaml", sets), progress=False).run()
    assert rep["docs_ok"] == 2 and rep["docs_failed"] == 0
    t = ParquetStore(out).results()
    assert "samples" not in t.column_names and "sample_index" in t.column_names
    rows = t.to_pylist()
    answers = sorted((r["doc_id"], r["sample_index"]) for r in rows if r["task"] == "answer")
    assert answers == [(d, i) for d in ("q0", "q1") for i in range(3)]
    assert sorted(r["sample_index"] for r in rows if r["task"] == "qa_pair") == [0, 0]
    assert ParquetStore(out).progress({"answer", "qa_pair"})["duplicates"] == 0
    assert JobRunner(load_job("jobs/synthetic_qa.yaml", sets), progress=False).run().get("noop")

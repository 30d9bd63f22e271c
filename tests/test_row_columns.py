"""Any input column, everywhere: templates read a row's columns (``{{ row.question }}``, plain
names), ``output.keep_columns`` carries them into the result rows with their Arrow types, a
``messages`` column is a prompt, and a missing column is named before the run starts."""
from __future__ import annotations

import datetime
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.columns import columns_table, pack, unpack
from connectors.parse import parse_file
from dlbatch.jobspec import JobSpecError, parse_job
from dlbatch.prompts.columns import check_columns, peek_columns

QUESTIONS = [
    {"id": "q1", "text": "Paris is the capital of France.", "question": "What is the capital of France?",
     "level": 1, "tags": ["geo", "easy"]},
    {"id": "q2", "text": "Water boils at 100 degrees Celsius at sea level.", "question": "When does water boil?",
     "level": 2, "tags": []},
]
CHATS = [
    {"id": "c1", "messages": [{"role": "system", "content": "Answer in one word."},
                              {"role": "user", "content": "Capital of Italy?"}], "level": 3},
]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _job(tmp_path, path, fmt="jsonl", tasks=None, keep=None, **extra):
    return {"name": "qa", "pipeline": "papers",
            "input": {"format": fmt, "path": str(path), "id_field": "id"},
            "output": {"path": str(tmp_path / "out"), **({"keep_columns": keep} if keep is not None else {})},
            "tasks": tasks or [{"name": "answer", "prompt": "{{ text }}\nQuestion: {{ row.question }} "
                                                           "(level {{ level }})", "max_tokens": 8}], **extra}


def test_packed_columns_keep_their_arrow_types_and_join_across_rows():
    t = pa.table({"n": pa.array([7], pa.int32()), "when": pa.array([datetime.datetime(2026, 1, 2)], pa.timestamp("ms")),
                  "body": ["long text"]})
    a = pack(t, exclude=("body",))
    assert unpack(a) == {"n": 7, "when": datetime.datetime(2026, 1, 2)}
    b = pack({"n": None, "extra": "x"})
    joined = columns_table([a, b, None], ["n", "when", "extra", "absent"])
    assert joined.schema.field("n").type == pa.int32() and joined.schema.field("when").type == pa.timestamp("ms")
    assert joined.to_pylist() == [
        {"n": 7, "when": datetime.datetime(2026, 1, 2), "extra": None, "absent": None},
        {"n": None, "when": None, "extra": "x", "absent": None},
        {"n": None, "when": None, "extra": None, "absent": None}]
    # a lone surrogate in a column is repaired, never fatal; mixed lists travel as JSON text
    assert unpack(pack({"s": "a\ud800b"}))["s"] == "a\ufffdb"
    assert unpack(pack({"m": [1, "two", {"x": 3}]}))["m"] == '[1, "two", {"x": 3}]'


def test_templates_read_columns_and_the_prompt_stage_renders_them(tmp_path, sample_model):
    from tests.helpers.stage import prompt_stage

    path = _jsonl(tmp_path / "q.jsonl", QUESTIONS)
    spec = parse_job(_job(tmp_path, path, keep=["level"]))
    docs = parse_file({"url": path}, "jsonl", "text", "id", {}, None)
    stage = prompt_stage(spec)
    rows = [r for d in docs for r in stage.process(d)]
    assert [r["error"] for r in rows] == [None, None]
    prompt = stage.tok.decode(rows[0]["prompt_ids"])
    assert "Paris is the capital of France.\nQuestion: What is the capital of France? (level 1)" in prompt
    assert unpack(rows[1]["columns"]) == {"id": "q2", "question": "When does water boil?", "level": 2, "tags": []}
    # a row without the column a template reads: that document's task error names it
    bad = parse_file({"url": _jsonl(tmp_path / "b.jsonl", [{"id": "x", "text": "t"}])}, "jsonl", "text", "id", {}, None)
    (err,) = stage.process(bad[0])
    assert err["stage"] == "prompt" and "question" in err["error"]


def test_a_messages_column_is_a_prompt(tmp_path, sample_model):
    from tests.helpers.stage import prompt_stage

    path = _jsonl(tmp_path / "c.jsonl", CHATS)
    spec = parse_job(_job(tmp_path, path, tasks=[{"name": "reply", "messages": "{{ row.messages }}", "max_tokens": 4}]))
    (doc,) = parse_file({"url": path}, "jsonl", "text", "id", {}, None)
    assert doc["error"] is None and doc["text"] == "Answer in one word.\nCapital of Italy?"
    stage = prompt_stage(spec)
    (row,) = stage.process(doc)
    want = stage.tok.apply_chat_template(CHATS[0]["messages"])
    assert row["error"] is None and row["prompt_ids"] == stage.tok.encode(want, add_special_tokens=False)


def test_bad_messages_and_columns_are_refused_at_load_naming_them(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", CHATS)
    with pytest.raises(JobSpecError, match="exactly one of prompt"):
        parse_job(_job(tmp_path, path, tasks=[{"name": "r"}]))
    with pytest.raises(JobSpecError, match="messages must be one expression"):
        parse_job(_job(tmp_path, path, tasks=[{"name": "r", "messages": "Hello {{ row.messages }}"}]))
    with pytest.raises(JobSpecError, match="'question', which pdf inputs do not have"):
        parse_job({"name": "p", "pipeline": "papers", "tasks": [{"name": "a", "prompt": "{{ text }} {{ question }}"}]})
    with pytest.raises(JobSpecError, match="keep_columns: 'output' is the name of a result column"):
        parse_job(_job(tmp_path, path, keep=["output"]))


@pytest.mark.parametrize("name", ["valid", "output_error", "samples", "logprobs", "text", "pair_json"])
def test_keep_columns_named_like_any_result_field_is_refused_at_load(tmp_path, name):
    """Every field a result row may hold, the structured-output and sampling ones too, and the
    typed column of a JSON-schema task: kept under its name, the input column would be dropped."""
    path = _jsonl(tmp_path / "q.jsonl", QUESTIONS)
    tasks = [{"name": "pair", "prompt": "{{ text }}", "max_tokens": 8,
              "output": {"json_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    with pytest.raises(JobSpecError, match=f"keep_columns: '{name}' is the name of a result column"):
        parse_job(_job(tmp_path, path, tasks=tasks, keep=["question", name]))
    parse_job(_job(tmp_path, path, tasks=tasks, keep=["question", "answer_json"]))  # no task 'answer' here


def test_a_missing_column_is_named_before_the_run(tmp_path):
    path = _jsonl(tmp_path / "q.jsonl", QUESTIONS)
    assert peek_columns(path, "jsonl", "text") == {"id", "text", "question", "level", "tags"}
    check_columns(parse_job(_job(tmp_path, path, keep=["tags"])), [path])  # all there
    with pytest.raises(ValueError, match="task 'answer' reads column 'topic'"):
        check_columns(parse_job(_job(tmp_path, path, tasks=[{"name": "answer", "prompt": "{{ text }} {{ row.topic }}"}])),
                      [path])
    with pytest.raises(ValueError, match="keep_columns: 'nope' is not a column"):
        check_columns(parse_job(_job(tmp_path, path, keep=["nope"])), [path])


def test_validate_names_a_missing_column_with_exit_2(tmp_path):
    import yaml

    path = _jsonl(tmp_path / "q.jsonl", QUESTIONS)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_job(tmp_path, path, tasks=[{"name": "answer", "prompt": "{{ text }} {{ topic }}"}])))
    p = subprocess.run([sys.executable, "-m", "dlbatch.cli", "validate", str(job)], capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert "reads column 'topic'" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.ray
def test_columns_kept_in_the_output_with_their_types(ray_local, sample_model, tmp_path):
    """A Parquet input: a column used in the template, two kept with their Arrow types
    (int32, list<string>), and a chat task beside the template task."""
    from dlbatch.output.parquet_store import ParquetStore
    from dlbatch.driver.runner import JobRunner

    table = pa.table({"id": ["q1", "q2"], "text": [q["text"] for q in QUESTIONS],
                      "question": [q["question"] for q in QUESTIONS],
                      "level": pa.array([1, 2], pa.int32()), "tags": [q["tags"] for q in QUESTIONS]})
    pq.write_table(table, tmp_path / "q.parquet")
    spec = parse_job(_job(tmp_path, tmp_path / "q.parquet", fmt="parquet", keep=["level", "tags"],
                          model={"dtype": "float32", "max_model_len": 1024},
                          cluster={"colocated": {"chip": "fast", "replicas": 1, "num_cpus": 0.5}}))
    report = JobRunner(spec, fresh=True, progress=False).run()
    assert report["docs_ok"] == 2
    out = ParquetStore(spec.output.path).results()
    assert out.schema.field("level").type == pa.int32() and out.schema.field("tags").type == pa.list_(pa.string())
    got = sorted((r["doc_id"], r["task"], r["level"], r["tags"]) for r in out.to_pylist())
    assert got == [("q1", "answer", 1, ["geo", "easy"]), ("q2", "answer", 2, [])]

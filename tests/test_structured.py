"""Structured outputs in jobs (dlbatch/structured.py): `output:` specs in job files, typed
Parquet columns from JSON schemas, validity of each row, per-task error rows, chat control
(system prompt, template kwargs, custom template, raw tasks), and the sample structured job
end to end."""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

from dlbatch.jobspec import JobSpecError, load_job, parse_job

BASE = {"name": "j", "pipeline": "papers", "output": {"path": "out/test-structured"}}


def _spec(tasks, **extra):
    return parse_job({**BASE, "tasks": tasks, **extra})


# ---- JSON schema -> Arrow types ---------------------------------------------------------------------
def test_arrow_types_from_schema():
    from dlbatch.prompts.structured import arrow_type

    schema = {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
        "l": {"type": "array", "items": {"type": "integer"}},
        "o": {"type": "object", "properties": {"x": {"type": ["number", "null"]}, "t": {"type": "array", "items": {
            "type": "object", "properties": {"k": {"enum": ["a", "b"]}}}}}},
        "u": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "opt": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "free": {"type": "object"},
        "r": {"$ref": "#/$defs/R"}},
        "$defs": {"R": {"type": "object", "properties": {"v": {"type": "boolean"}, "again": {"$ref": "#/$defs/R"}}}}}
    t = arrow_type(schema)
    assert t == pa.struct([
        ("s", pa.string()), ("i", pa.int64()), ("n", pa.float64()), ("b", pa.bool_()), ("l", pa.list_(pa.int64())),
        ("o", pa.struct([("x", pa.float64()), ("t", pa.list_(pa.struct([("k", pa.string())])))])),
        ("u", pa.string()), ("opt", pa.int64()), ("free", pa.string()),
        ("r", pa.struct([("v", pa.bool_()), ("again", pa.string())]))])  # recursion stops as JSON text


def test_pydantic_schema_types():
    from pydantic import BaseModel

    from dlbatch.prompts.structured import arrow_type

    class Author(BaseModel):
        name: str
        h_index: int | None = None

    class Paper(BaseModel):
        title: str
        authors: list[Author]
        score: float

    assert arrow_type(Paper.model_json_schema()) == pa.struct([
        ("title", pa.string()), ("authors", pa.list_(pa.struct([("name", pa.string()), ("h_index", pa.int64())]))),
        ("score", pa.float64())])


# ---- job files ------------------------------------------------------------------------------------------
def test_output_spec_validation():
    with pytest.raises(JobSpecError, match="exactly one of"):
        _spec([{"name": "a", "prompt": "{{ text }}", "output": {"regex": "a", "choices": ["x"]}}])
    with pytest.raises(JobSpecError, match="exactly one of"):
        _spec([{"name": "a", "prompt": "{{ text }}", "output": {}}])
    with pytest.raises(JobSpecError, match="not a valid JSON Schema"):
        _spec([{"name": "a", "prompt": "{{ text }}", "output": {"json_schema": {"type": "strnig"}}}])
    with pytest.raises(JobSpecError, match="does not compile"):
        _spec([{"name": "a", "prompt": "{{ text }}", "output": {"regex": "(a"}}])
    s = _spec([{"name": "a", "prompt": "{{ text }}", "output": {"choices": ["x", "y"]}}])
    from dlbatch.prompts.structured import task_constraints

    assert task_constraints(s) == {"a": {"kind": "choices", "spec": ["x", "y"]}}


def test_schema_file_next_to_the_job(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "x.json").write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({**BASE, "output": {"path": str(tmp_path / "out")},
                               "model": {"chat_template": "chat.jinja"},
                               "tasks": [{"name": "t", "prompt": "{{ text }}", "output": {"json_schema": "s/x.json"}}]}))
    spec = load_job(str(job))
    assert spec.tasks[0].output.json_schema["properties"]["a"] == {"type": "integer"}
    assert spec.model.chat_template == str(tmp_path / "chat.jinja")
    assert parse_job(spec.to_dict()) == spec  # self-contained: workers re-parse the dict
    job.write_text(json.dumps({**BASE, "tasks": [{"name": "t", "prompt": "{{ text }}",
                                                  "output": {"json_schema": "missing.json"}}]}))
    with pytest.raises(JobSpecError, match="missing.json"):
        load_job(str(job))


def test_structured_job_file_loads():
    spec = load_job("jobs/papers_structured.yaml")
    from dlbatch.prompts.structured import result_fields

    f = {x.name: x.type for x in result_fields(spec)}
    assert f["record_json"] == pa.struct([("title", pa.string()), ("field", pa.string()),
                                          ("methods", pa.list_(pa.string())), ("datasets", pa.list_(pa.string())),
                                          ("main_result", pa.string())])
    assert f["valid"] == pa.bool_()


# ---- rows ----------------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items": {
    "type": "string"}}}, "required": ["n"], "additionalProperties": False}


def test_row_fields_validity():
    from dlbatch.prompts.structured import row_fields

    spec = _spec([{"name": "j", "prompt": "{{ text }}", "output": {"json_schema": SCHEMA}},
                  {"name": "c", "prompt": "{{ text }}", "output": {"choices": ["yes", "no"]}},
                  {"name": "r", "prompt": "{{ text }}", "output": {"regex": "[0-9]+"}},
                  {"name": "free", "prompt": "{{ text }}"}])
    ok = row_fields(spec, "j", {"output": '{"n": 3, "tags": ["a"]}', "finish_reason": "stop"})
    assert ok == {"valid": True, "output_error": None, "j_json": {"n": 3, "tags": ["a"]}}
    cut = row_fields(spec, "j", {"output": '{"n": 3, "tags": ["a"', "finish_reason": "length"})
    assert cut["valid"] is False and "max_tokens" in cut["output_error"] and cut["j_json"] is None
    # a complete-looking text cut by max_tokens is not valid either
    assert row_fields(spec, "j", {"output": '{"n": 3}', "finish_reason": "length"})["valid"] is False
    bad = row_fields(spec, "j", {"output": '{"n": "3"}', "finish_reason": "stop"})
    assert bad["valid"] is False and "schema" in bad["output_error"] and bad["j_json"] is None
    assert row_fields(spec, "j", {"output": "{", "finish_reason": "stop"})["output_error"].startswith("not JSON")
    assert row_fields(spec, "c", {"output": "no", "finish_reason": "stop"})["valid"] is True
    assert row_fields(spec, "c", {"output": "nope", "finish_reason": "stop"})["valid"] is False
    assert row_fields(spec, "r", {"output": "12a", "finish_reason": "stop"})["valid"] is False
    assert row_fields(spec, "free", {"output": "x", "finish_reason": "length"}) == {"valid": None, "output_error": None}


def test_committed_parquet_loads_typed_in_pandas(tmp_path):
    from dlbatch.output.parquet_store import ParquetStore
    from dlbatch.prompts.structured import result_fields, row_fields

    spec = _spec([{"name": "j", "prompt": "{{ text }}", "output": {"json_schema": SCHEMA}},
                  {"name": "k", "prompt": "{{ text }}", "output": {"json_schema": {
                      "type": "object", "properties": {"ok": {"type": "boolean"}, "x": {"type": "number"}}}}},
                  {"name": "free", "prompt": "{{ text }}"}])
    outs = {"j": '{"n": 7, "tags": ["p", "q"]}', "k": '{"ok": true, "x": 1.5}', "free": "hello"}
    rows = []
    for d in ("d1", "d2"):
        for t, text in outs.items():
            rows.append({"doc_id": d, "source": "s", "task": t, "output": text, "finish_reason": "stop",
                         **row_fields(spec, t, {"output": text, "finish_reason": "stop"})})
    store = ParquetStore(str(tmp_path / "out"))
    store.commit(rows, [], False, result_fields(spec))
    import pandas as pd

    df = pd.read_parquet(str(tmp_path / "out"))
    j = df[df.task == "j"].iloc[0]
    assert j["j_json"]["n"] == 7 and list(j["j_json"]["tags"]) == ["p", "q"] and j["valid"]
    assert df[df.task == "k"].iloc[0]["k_json"] == {"ok": True, "x": 1.5}
    assert df[df.task == "free"]["valid"].isna().all() and df[df.task != "j"]["j_json"].isna().all()
    import pyarrow.parquet as pq

    t = pq.read_table(str(tmp_path / "out"))
    assert t.schema.field("j_json").type == pa.struct([("n", pa.int64()), ("tags", pa.list_(pa.string()))])


def test_task_error_counts_as_the_tasks_outcome(tmp_path):
    from dlbatch.output.parquet_store import ParquetStore

    store = ParquetStore(str(tmp_path / "out"))
    store.commit([{"doc_id": "d", "source": "s", "task": "a", "output": "x"}], [], False)
    store.commit_errors([{"doc_id": "d", "source": "s", "task": "b", "stage": "prompt", "error_type": "TemplateError",
                          "error": "boom"},
                         {"doc_id": "e", "source": "s", "task": None, "stage": "parse", "error_type": "X", "error": "y"}])
    assert store.progress(tasks={"a", "b"})["done_ids"].to_pylist() == ["d"]  # b's outcome is its error row
    assert store.progress(tasks={"a", "b", "c"})["done_ids"].to_pylist() == []
    assert store.progress()["failed_ids"].to_pylist() == ["e"]
    assert store.errors().to_pylist()[0]["task"] == "b"


# ---- prompts: per-task errors and chat control -------------------------------------------------------
def _stage(tasks, **model):
    from tests.helpers.stage import prompt_stage

    spec = _spec(tasks, model={"name": "smollm2-135m-instruct", "max_model_len": 2048, **model})
    return prompt_stage(spec)


DOC = {"doc_id": "d1", "source": "s.pdf", "text": "A paper about paged attention.", "title": "T", "pages": 3}


def test_a_task_that_cannot_render_fails_alone():
    st = _stage([{"name": "ok", "prompt": "{{ text }}\n\nSummarize."},
                 {"name": "bad", "prompt": "{{ text }}\n\n{{ pages + 'x' }}"}])
    rows = st.process(DOC)
    assert [r["task"] for r in rows] == ["ok", "bad"]
    assert rows[0]["error"] is None and rows[0]["prompt_ids"]
    assert rows[1]["stage"] == "prompt" and "bad" in rows[1]["error"] and rows[1]["prompt_ids"] == []
    both_bad = _stage([{"name": "b1", "prompt": "{{ pages + 'x' }}"}, {"name": "b2", "prompt": "{{ pages + 'y' }}"}])
    rows = both_bad.process(DOC)
    assert len(rows) == 1 and rows[0]["task"] is None and rows[0]["error"]


def test_chat_control_system_kwargs_raw_and_template_file(tmp_path):
    st = _stage([{"name": "a", "prompt": "{{ text }}\n\nQ1"}, {"name": "b", "prompt": "{{ text }}\n\nQ2"},
                 {"name": "r", "prompt": "{{ text }}\n\nQ3", "raw": True},
                 {"name": "own", "prompt": "{{ text }}\n\nQ4", "system": "Be terse."}],
                system="You are a careful reader.")
    rows = {r["task"]: st.tok.decode(r["prompt_ids"], skip_special_tokens=False) for r in st.process(DOC)}
    assert "You are a careful reader." in rows["a"] and "You are a careful reader." in rows["b"]
    assert rows["r"] == DOC["text"] + "\n\nQ3"  # raw: no template at all
    assert "Be terse." in rows["own"] and "careful reader" not in rows["own"]
    # a system prompt shared by all tasks keeps the document in the shared prefix
    ids = {r["task"]: r["prompt_ids"] for r in st.process(DOC)}
    common = os.path.commonprefix([ids["a"], ids["b"]])
    assert st.tok.decode(common).find(DOC["text"]) >= 0

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                   "{% if add_generation_prompt %}<assistant{{ ' think' if thinking else '' }}>{% endif %}")
    st = _stage([{"name": "a", "prompt": "{{ text }}"},
                 {"name": "b", "prompt": "{{ text }}", "chat_template_kwargs": {"thinking": False}}],
                chat_template=str(tpl), chat_template_kwargs={"thinking": True})
    rows = {r["task"]: st.tok.decode(r["prompt_ids"], skip_special_tokens=False) for r in st.process(DOC)}
    assert rows["a"] == f"<user>{DOC['text']}<assistant think>"
    assert rows["b"] == f"<user>{DOC['text']}<assistant>"


# ---- end to end ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.ray
def test_papers_structured_job_end_to_end(ray_local, sample_model, tmp_path):
    """The sample structured job on one paper through PD workers: every row valid or
    marked, the record valid against its schema, and its typed struct column holds exactly
    the parsed record with the schema's types (strings, lists of strings), in Arrow and in
    pandas."""
    import jsonschema
    import pandas as pd

    from dlbatch.driver.runner import JobRunner

    out = str(tmp_path / "out")
    # the record keeps the job's max_tokens (256): a record cut by max_tokens is invalid, and it must be valid
    spec = load_job("jobs/papers_structured.yaml", [f"output.path={out}", "input.limit=1", "model.max_model_len=2048",
                                                    "model.dtype=float32"])
    rep = JobRunner(spec, progress=False).run()
    assert rep["docs_ok"] == 1
    df = pd.read_parquet(out)
    assert sorted(df.task) == ["kind", "record", "year"]
    schema = spec.tasks[0].output.json_schema
    for _, r in df.iterrows():
        if r.finish_reason == "length":
            assert not r.valid
        else:
            assert r.finish_reason == "stop" and r.valid, (r.task, r.output, r.output_error)
    rec = df[df.task == "record"].iloc[0]
    assert rec.valid, f"the record is not valid ({rec.finish_reason}): {rec.output_error}\n{rec.output}"
    value = json.loads(rec.output)
    jsonschema.validate(value, schema)
    assert df[df.task == "kind"].iloc[0].output in ("theoretical", "empirical", "survey")
    import pyarrow.parquet as pq

    # the struct column is typed from the schema: strings and lists of strings, not JSON text
    t = pq.read_table(out)
    struct = t.schema.field("record_json").type
    assert pa.types.is_struct(struct), struct
    fields = {f.name: f.type for f in struct}
    assert sorted(fields) == sorted(schema["properties"]), struct
    for name in ("title", "field", "main_result"):
        assert pa.types.is_string(fields[name]), (name, fields[name])
    for name in ("methods", "datasets"):
        assert pa.types.is_list(fields[name]) and pa.types.is_string(fields[name].value_type), (name, fields[name])
    # its value on the record row is exactly the parsed output; null on the other tasks' rows
    by_task = {r["task"]: r["record_json"] for r in t.to_pylist()}
    typed = by_task.pop("record")
    assert typed == value, (typed, value)
    for name in ("methods", "datasets"):
        assert isinstance(typed[name], list) and all(isinstance(x, str) for x in typed[name]), (name, typed[name])
    assert all(isinstance(typed[name], str) for name in ("title", "field", "main_result")), typed
    assert by_task == {"kind": None, "year": None}, by_task
    # pandas reads the struct as a dict (lists as arrays) with the same values
    assert rec.record_json["title"] == value["title"] and rec.record_json["main_result"] == value["main_result"]
    assert list(rec.record_json["methods"]) == value["methods"]
    assert list(rec.record_json["datasets"]) == value["datasets"]


def test_bench_structured_smoke(tmp_path):
    """`dlbatch bench structured` on a tiny model: every figure is in its JSON."""
    from types import SimpleNamespace

    from dlbatch.bench import run_bench
    from tests.helpers.tiny_models import make_tiny_model

    path = str(tmp_path / "tiny")
    make_tiny_model("llama", path)
    out = tmp_path / "r.json"
    assert run_bench(SimpleNamespace(name="structured", rest=["--model", path, "--dtype", "float32", "--quick",
                                                              "--batches", "1,4", "--max-model-len", "256",
                                                              "--json", str(out)])) == 0
    r = json.loads(out.read_text())
    assert [s["batch"] for s in r["steps"]] == [1, 4]
    for s in r["steps"]:
        assert s["free_step_ms"] > 0 and s["constrained_step_ms"] > 0 and s["timed_steps"][1] > 0
    assert r["compile"]["json_schema_compile_ms"] > 0 and r["compile"]["matcher_copy_ms"] > 0


@pytest.mark.slow
@pytest.mark.ray
def test_tasks_fail_alone_in_a_job(ray_local, sample_model, tmp_path):
    """A task whose prompt cannot render and a task whose grammar cannot compile become
    error rows naming the task; the document's other task commits; a rerun is a no-op."""
    from dlbatch.output.parquet_store import ParquetStore
    from dlbatch.driver.runner import JobRunner

    out = str(tmp_path / "out")
    spec = load_job("jobs/papers_structured.yaml", [
        f"output.path={out}", "input.limit=1", "model.max_model_len=2048", "model.dtype=float32",
        "cluster.colocated={chip: fast, replicas: 1, num_cpus: 0.5}",
        "tasks=[{name: kind, prompt: '{{ text }} Kind?', max_tokens: 6, output: {choices: [a, b]}},"
        " {name: badprompt, prompt: \"{{ text }}{{ pages + 'x' }}\", max_tokens: 4},"
        " {name: badgrammar, prompt: '{{ text }} Q', max_tokens: 4, output: {grammar: 'start: nosuchrule'}}]"])
    rep = JobRunner(spec, progress=False).run()
    store = ParquetStore(out)
    rows = store.results().to_pylist()
    errs = store.errors().to_pylist()
    assert [r["task"] for r in rows] == ["kind"] and rows[0]["output"] in ("a", "b") and rows[0]["valid"]
    assert sorted(e["task"] for e in errs) == ["badgrammar", "badprompt"]
    assert {e["task"]: e["error_type"] for e in errs}["badgrammar"] == "ConstraintError"
    assert rep["docs_ok"] == 1
    again = JobRunner(spec, progress=False).run()
    assert again.get("noop") or again.get("rows_written", 0) == 0

"""OpenAI Batch API files in and out (issue 29, point 2): ``input.format: openai_batch`` reads
request lines (connectors/openai_batch.py), each one request row of the implicit ``response``
task whose prompt and sampling are the line's body; ``output.format: openai_batch`` writes the
Batch API's results.jsonl / errors.jsonl from the committed rows (dlbatch/output/openai_export.py)."""
from __future__ import annotations

import json

import pytest

from connectors.openai_batch import DuplicateCustomId, InvalidRequest, translate
from dlbatch.jobspec import JobSpecError, parse_job

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]


def _line(cid, url=CHAT, **body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": MODEL, **body}}


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def _job(tmp_path, path, out_format="openai_batch", **extra):
    return {"name": "ob", "pipeline": "papers", "input": {"format": "openai_batch", "path": str(path)},
            "output": {"path": str(tmp_path / "out"), "format": out_format}, **extra}


# ---------------------------------------------------------------------------- body translation


def test_every_honoured_chat_key_is_translated():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = translate(CHAT, {"model": MODEL, "messages": [{"role": "developer", "content": "Be brief."},
                                                        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                                                     {"type": "text", "text": "there"}]}],
                           "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 11, "stop": "\n",
                           "n": 2, "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.5,
                           "frequency_penalty": -0.5, "user": "u1", "metadata": {"k": "v"}, "stream": False,
                           "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                    MODEL)
    assert req["chat"] and req["max_tokens"] == 9 and req["seed"] == 11
    assert req["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert req["sampling"] == {"temperature": 0.5, "top_p": 0.9, "stop": ["\n"], "n": 2, "logprobs": 3,
                               "presence_penalty": 0.5, "frequency_penalty": -0.5,
                               "constraint": {"kind": "json_schema", "spec": schema}}
    json_object = translate(CHAT, {"model": MODEL, "messages": MSGS, "response_format": {"type": "json_object"},
                                   "logprobs": True, "max_tokens": 4, "temperature": None}, MODEL)
    assert json_object["sampling"] == {"constraint": {"kind": "json_schema", "spec": {"type": "object"}},
                                       "logprobs": 0}
    assert translate(CHAT, {"model": MODEL, "messages": MSGS, "response_format": {"type": "text"}},
                     MODEL)["sampling"] == {}
    assert translate(CHAT, {"model": MODEL, "messages": MSGS, "seed": -1}, MODEL)["seed"] == 2 ** 32 - 1


def test_completions_keys_are_translated():
    req = translate(COMPLETIONS, {"model": MODEL, "prompt": ["Once"], "max_tokens": 5, "logprobs": 2,
                                  "stop": ["a", "b"], "echo": False, "best_of": 1}, MODEL)
    assert not req["chat"] and req["prompt"] == "Once" and req["max_tokens"] == 5
    assert req["sampling"] == {"logprobs": 2, "stop": ["a", "b"]}


@pytest.mark.parametrize("url,body,code,names", [
    (CHAT, {"model": "gpt-4o-mini", "messages": MSGS}, "ModelMismatch", ["'gpt-4o-mini'", repr(MODEL)]),
    (CHAT, {"messages": MSGS}, "ModelMismatch", ["None", repr(MODEL)]),
    (CHAT, {"model": MODEL, "messages": MSGS, "tools": [{"type": "function"}]}, "UnsupportedParameter", ["body.tools"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "functions": []}, "UnsupportedParameter", ["body.functions"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "logit_bias": {"1": 5}}, "UnsupportedParameter", ["body.logit_bias"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "stream": True}, "UnsupportedParameter", ["body.stream"]),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "echo": True}, "UnsupportedParameter", ["body.echo"]),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "suffix": "y"}, "UnsupportedParameter", ["body.suffix"]),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}}, "UnsupportedParameter",
     ["body.response_format"]),
    (COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"]}, "UnsupportedParameter", ["body.prompt"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "UnsupportedParameter",
     ["body.messages[0].role"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "UnsupportedParameter", ["body.messages[0].content[0].type"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "InvalidRequest", ["body.messages[0].content[0].image_url.url"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///nonexistent/dlbatch/a.png"}}]}]},
     "BadImage", ["body.messages[0].content[0].image_url.url", "no such file or URL"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]},
     "InvalidRequest", ["body.messages[0].content[0].image_url.url", "not a PNG image"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}]}]},
     "InvalidRequest", ["body.messages[0].content[0].image_url.url", "does not decode"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "system", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]},
     "InvalidRequest", ["body.messages[0].content[0]", "user messages"]),
    (CHAT, {"model": MODEL, "messages": []}, "InvalidRequest", ["body.messages"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "temperature": 3}, "InvalidRequest", ["body.temperature"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "top_p": 0}, "InvalidRequest", ["body.top_p"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 0}, "InvalidRequest", ["body.max_tokens"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": "8"}, "InvalidRequest", ["body.max_tokens"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 4, "max_completion_tokens": 5}, "InvalidRequest",
     ["body.max_tokens", "body.max_completion_tokens"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "n": 0}, "InvalidRequest", ["body.n"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "stop": ["a", ""]}, "InvalidRequest", ["body.stop"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "presence_penalty": 2.5}, "InvalidRequest", ["body.presence_penalty"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "frequency_penalty": "x"}, "InvalidRequest", ["body.frequency_penalty"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "seed": 1.5}, "InvalidRequest", ["body.seed"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "top_logprobs": 2}, "InvalidRequest", ["body.top_logprobs"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "logprobs": 2}, "InvalidRequest", ["body.logprobs"]),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logprobs": True}, "InvalidRequest", ["body.logprobs"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {}}},
     "InvalidRequest", ["body.response_format.json_schema.schema"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "response_format": {"type": "json_schema",
                                                                  "json_schema": {"schema": {"type": "nope"}}}},
     "InvalidRequest", ["not a valid JSON Schema"]),
    (CHAT, {"model": MODEL, "messages": MSGS, "response_format": {"type": "regex"}}, "UnsupportedParameter",
     ["body.response_format.type"]),
])
def test_refusals_name_the_body_key(url, body, code, names):
    with pytest.raises(InvalidRequest) as e:
        translate(url, body, MODEL)
    assert e.value.code == code
    for n in names:
        assert n in str(e.value)


def test_image_parts_become_the_users_images():
    """An image_url part's data URL -> the compressed bytes, in place among the text parts
    (docs/multimodal.md); a JPEG under data:image/jpg too; detail other than auto refused."""
    import base64
    import io

    from PIL import Image

    out = {}
    for fmt in ("PNG", "JPEG"):
        buf = io.BytesIO()
        Image.new("RGB", (8, 6), (200, 30, 30)).save(buf, format=fmt)
        out[fmt] = buf.getvalue()
    url = {f: f"data:image/{'png' if f == 'PNG' else 'jpg'};base64," + base64.b64encode(b).decode()
           for f, b in out.items()}
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": url["PNG"]}},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": url["JPEG"], "detail": "auto"}}]}]}
    req = translate(CHAT, body, MODEL)
    assert req["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image", "data": out["PNG"]}, {"type": "text", "text": " and "},
        {"type": "image", "data": out["JPEG"]}]}]
    body["messages"][1]["content"][1]["image_url"]["detail"] = "low"
    with pytest.raises(InvalidRequest, match=r"content\[1\].image_url.detail 'low' is not supported") as e:
        translate(CHAT, body, MODEL)
    assert e.value.code == "UnsupportedParameter"


# ---------------------------------------------------------------------------- reading


def test_reader_rows_and_bad_lines(tmp_path):
    from connectors.columns import unpack
    from connectors.listing import list_inputs, read_document_file

    path = _write(tmp_path / "b.jsonl", [
        _line("a", messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]),
        _line("b", url=COMPLETIONS, prompt="Once upon"),
        "",
        "{not json",
        {"method": "POST", "url": CHAT, "body": {}},
        {**_line("c"), "url": "/v1/embeddings"},
        {**_line("d"), "method": "GET"},
        _line("a", messages=MSGS),
    ])
    with pytest.raises(DuplicateCustomId, match=r"custom_id 'a' is on .*b\.jsonl line 1 and .*b\.jsonl line 8"):
        list_inputs(str(tmp_path), "openai_batch")  # listing refuses the file, as an upload is refused
    rows = list(read_document_file(path, "openai_batch"))  # the reader alone still never runs an id twice
    assert [r["source"].rsplit("#", 1)[1] for r in rows] == ["line1", "line2", "line4", "line5", "line6", "line7",
                                                             "line8"]
    a, b = rows[0], rows[1]
    assert (a["doc_id"], a["text"], a["error"]) == ("a", "S\nQ", None)
    assert (b["doc_id"], b["text"]) == ("b", "Once upon")
    cols = unpack(a["columns"])
    assert set(cols) == {"custom_id", "url", "body"} and json.loads(cols["body"])["messages"][1]["content"] == "Q"
    assert [r["error_type"] for r in rows[2:]] == ["MalformedJSON", "MissingField", "InvalidRequest", "InvalidRequest",
                                                   "DuplicateId"]
    assert rows[4]["doc_id"] == "c" and "/v1/embeddings" in rows[4]["error"] and "line 6" in rows[4]["error"]
    assert "duplicate custom_id 'a'" in rows[6]["error"] and rows[6]["doc_id"] != "a"


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_repeated_custom_id_refuses_the_job_naming_the_lines(tmp_path, capsys, command):
    """As the Batch API refuses the upload: within one file or across two, the job exits 2
    before anything runs, naming both lines, and writes nothing."""
    from dlbatch.cli.main import main

    (tmp_path / "in").mkdir()
    _write(tmp_path / "in" / "a.jsonl", [_line("r1", messages=MSGS), _line("r2", messages=MSGS),
                                         _line("r1", messages=MSGS)])
    _write(tmp_path / "in" / "b.jsonl", [_line("r3", messages=MSGS), _line("r2", messages=MSGS)])
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(_job(tmp_path, tmp_path / "in")))
    assert main([command, str(job)]) == 2
    err = capsys.readouterr().err
    assert "custom_id 'r1' is on " in err and "a.jsonl line 1 and " in err and "a.jsonl line 3" in err
    assert "custom_id 'r2' is on " in err and "a.jsonl line 2 and " in err and "b.jsonl line 2" in err
    assert not (tmp_path / "out" / "results.jsonl").exists() and not list((tmp_path / "out").glob("*.parquet"))
    _write(tmp_path / "in" / "b.jsonl", [_line("r3", messages=MSGS)])
    _write(tmp_path / "in" / "a.jsonl", [_line("r1", messages=MSGS), _line("r2", messages=MSGS)])
    from connectors.listing import list_inputs

    assert len(list_inputs(str(tmp_path / "in"), "openai_batch")) == 2  # unique ids: listed


def test_reader_parts_keep_line_numbers_and_custom_ids(tmp_path):
    """A request file cut into byte-range read tasks: the parts' rows are the file's rows, each
    line keeping its number (the export's order); a custom_id repeated inside a part is that
    part's DuplicateId row, one repeated across parts reaches the driver under both sources
    (its `Duplicates` dead-letters the later one, tests/test_duplicate_ids.py)."""
    from connectors.listing import read_document_file
    from connectors.parse import parse_file
    from connectors.read_tasks import plan_read_tasks
    from connectors.splits import TaskSizes

    lines = []
    for i in range(40):
        lines.append(_line(f"r{i}", messages=[{"role": "user", "content": f"question {i} " + "x" * (i % 7)}]))
        if i % 9 == 0:
            lines += ["", f"{{not json {i}"]
    lines += [_line("r3", messages=MSGS)]  # r3 again, in the last part
    path = _write(tmp_path / "b.jsonl", lines)
    whole = list(read_document_file(path, "openai_batch"))
    tasks = plan_read_tasks([(path, None)], "openai_batch", sizes=TaskSizes(target=600), first_bytes=200)
    assert len(tasks) > 4
    rows = [r for t in tasks for r in parse_file(t.row(), "openai_batch", "text", None, None, None)]
    assert [r["source"] for r in rows] == [r["source"] for r in whole]
    assert [r["doc_id"] for r in rows[:-1]] == [r["doc_id"] for r in whole[:-1]]
    assert whole[-1]["error_type"] == "DuplicateId" and "duplicate custom_id 'r3'" in whole[-1]["error"]
    last = rows[-1]  # across parts: a good row under its own line, for the driver to catch
    assert (last["doc_id"], last["error"], last["source"]) == ("r3", None, whole[-1]["source"])
    dup = _write(tmp_path / "d.jsonl", [_line("a", messages=MSGS), _line("a", messages=MSGS)])
    (one,) = plan_read_tasks([(dup, None)], "openai_batch", sizes=TaskSizes(target=1 << 20))
    assert [r["error_type"] for r in parse_file(one.row(), "openai_batch", "text", None, None, None)] == \
        [None, "DuplicateId"]  # inside one part, as inside a file


# ---------------------------------------------------------------------------- the job file


def test_job_spec_rules(tmp_path):
    (tmp_path / "in").mkdir()
    path = _write(tmp_path / "in" / "b.jsonl", [])
    spec = parse_job(_job(tmp_path, path))
    assert [t.name for t in spec.tasks] == ["response"] and spec.output.keep_columns == ["custom_id", "url"]
    assert parse_job(spec.to_dict()) == spec
    kept = parse_job(_job(tmp_path, path, output={"path": str(tmp_path / "o"), "format": "openai_batch",
                                                  "keep_columns": ["body"]}))
    assert kept.output.keep_columns == ["body", "custom_id", "url"]
    assert parse_job(_job(tmp_path, path, out_format="parquet")).output.keep_columns == []
    with pytest.raises(JobSpecError, match="openai_batch input has no tasks"):
        parse_job(_job(tmp_path, path, tasks=[{"name": "a", "prompt": "{{ text }}"}]))
    with pytest.raises(JobSpecError, match="needs input.format openai_batch"):
        parse_job({"name": "x", "pipeline": "papers", "input": {"format": "jsonl", "path": path},
                   "output": {"path": str(tmp_path / "o"), "format": "openai_batch"}})
    with pytest.raises(JobSpecError, match="line's id is its custom_id"):
        parse_job(_job(tmp_path, path, input={"format": "openai_batch", "path": path, "id_field": "x"}))


# ---------------------------------------------------------------------------- the prompt stage


def test_prompt_stage_builds_one_request_row_per_line(tmp_path, sample_model):
    from connectors.parse import parse_file
    from dlbatch.prompts.sampling import request_sampling
    from tests.helpers.stage import prompt_stage

    path = _write(tmp_path / "b.jsonl", [
        _line("chat", messages=MSGS, max_tokens=4, n=2, seed=5, temperature=0.7, logprobs=True, top_logprobs=2),
        _line("plain", url=COMPLETIONS, prompt="Once upon a time"),
        _line("nomax", messages=MSGS),
        _line("wrong", model="gpt-4o", messages=MSGS),
        _line("long", messages=MSGS, max_tokens=200),
        _line("tools", messages=MSGS, tools=[]),
    ])
    spec = parse_job(_job(tmp_path, path, model={"max_model_len": 128}))
    stage = prompt_stage(spec)
    rows = [r for d in parse_file({"url": path}, "openai_batch", "text", None, {}, None) for r in stage.process(d)]
    by = {}
    for r in rows:
        by.setdefault(r["doc_id"], []).append(r)
    c0, c1 = by["chat"]
    assert (c0["task"], c1["task"], c0["seed"], c1["seed"], c0["max_tokens"]) == ("response", "response~1", 5, 6, 4)
    assert c0["prompt_ids"] == stage.tok.encode(stage.tok.apply_chat_template(MSGS), add_special_tokens=False)
    assert request_sampling(spec, c0) == {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "logprobs": 2, "seed": 5}
    (p,) = by["plain"]
    assert p["prompt_ids"] == stage.tok.encode("Once upon a time") and p["max_tokens"] == 16
    assert p["sampling"] is None and request_sampling(spec, p)["seed"] is None
    (nomax,) = by["nomax"]
    assert nomax["max_tokens"] == 128 - len(nomax["prompt_ids"])  # the rest of the context, under the 1024 default
    (w,) = by["wrong"]
    assert w["error_type"] == "ModelMismatch" and "'gpt-4o'" in w["error"] and repr(MODEL) in w["error"]
    (long,) = by["long"]
    assert long["error_type"] == "LongInput" and "max_tokens 200 exceeds max_model_len 128" in long["error"]
    (t,) = by["tools"]
    assert t["error_type"] == "UnsupportedParameter" and "body.tools" in t["error"]


# ---------------------------------------------------------------------------- the exporter


def _lp(tok, tid, lp, top=()):
    return {"token": tok, "token_id": tid, "logprob": lp,
            "top": [{"token": a, "token_id": b, "logprob": c} for a, b, c in top]}


def test_exporter_lines_parse_as_the_api_types():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    from dlbatch.output.openai_export import error_line, order_key, response_line

    lps = [_lp("Hi", 5, -0.1, [("Hi", 5, -0.1), ("Hey", 6, -2.5)]), _lp("é", 7, -0.2, [("é", 7, -0.2)])]
    chat = {"doc_id": "c1", "source": "/x/b.jsonl#line3", "task": "response", "output": "Hié", "prompt_tokens": 10,
            "output_tokens": 2, "finish_reason": "stop", "model": MODEL, "custom_id": "c1", "url": CHAT,
            "logprobs": lps, "samples": [{"output": "Hié", "output_tokens": 2, "finish_reason": "stop", "logprobs": lps},
                                         {"output": "Yo", "output_tokens": 3, "finish_reason": "length",
                                          "logprobs": lps[:1]}]}
    line = response_line(chat)
    assert line == response_line(dict(chat))  # deterministic
    assert line["custom_id"] == "c1" and line["error"] is None and line["id"].startswith("batch_req_")
    assert line["response"]["status_code"] == 200
    body = ChatCompletion.model_validate(line["response"]["body"])
    assert [c.index for c in body.choices] == [0, 1] and [c.finish_reason for c in body.choices] == ["stop", "length"]
    assert body.choices[1].message.content == "Yo" and body.usage.completion_tokens == 5
    assert body.usage.prompt_tokens == 10 and body.usage.total_tokens == 15
    content = body.choices[0].logprobs.content
    assert [c.token for c in content] == ["Hi", "é"] and content[1].bytes == [0xC3, 0xA9]
    assert [t.token for t in content[0].top_logprobs] == ["Hi", "Hey"]

    plain = {"doc_id": "p", "source": "/x/b.jsonl#line1", "task": "response", "output": "Hié", "prompt_tokens": 4,
             "output_tokens": 2, "finish_reason": "length", "model": MODEL, "custom_id": "p", "url": COMPLETIONS,
             "logprobs": lps, "samples": None}
    comp = Completion.model_validate(response_line(plain)["response"]["body"])
    assert comp.object == "text_completion" and comp.choices[0].text == "Hié"
    assert comp.choices[0].logprobs.tokens == ["Hi", "é"] and comp.choices[0].logprobs.text_offset == [0, 2]
    assert comp.choices[0].logprobs.top_logprobs[0] == {"Hi": -0.1, "Hey": -2.5}
    no_lp = response_line({**plain, "logprobs": None})["response"]["body"]
    assert no_lp["choices"][0]["logprobs"] is None and no_lp["choices"][0]["finish_reason"] == "length"

    err = error_line({"doc_id": "w", "source": "/x/b.jsonl#line2", "error_type": "ModelMismatch", "error": "m"}, "w")
    assert err == {"id": err["id"], "custom_id": "w", "response": None, "error": {"code": "ModelMismatch",
                                                                                    "message": "m"}}
    assert sorted(["/x/b.jsonl#line10", "/x/b.jsonl#line9", "/x/a.jsonl"], key=order_key) == [
        "/x/a.jsonl", "/x/b.jsonl#line9", "/x/b.jsonl#line10"]


# ---------------------------------------------------------------------------- end to end


@pytest.mark.ray
def test_openai_batch_job_end_to_end(ray_local, sample_model, tmp_path, monkeypatch):
    """The request file read in byte-range parts (connectors/read_tasks.py): the export is in
    input order all the same (file, line number)."""
    import jsonschema

    import connectors.read_tasks as read_tasks
    from openai.types import BatchError, Completion
    from openai.types.chat import ChatCompletion

    from dlbatch.driver.runner import JobRunner

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    lines = [
        _line("plain-chat", messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=6),
        _line("two", messages=[{"role": "user", "content": "Say a color."}], max_tokens=5, n=2, temperature=0.9,
              seed=3, logprobs=True, top_logprobs=2),
        _line("json", messages=[{"role": "user", "content": "A city as JSON."}], max_tokens=24,
              response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}),
        _line("wrong-model", model="gpt-4o-mini", messages=MSGS, max_tokens=4),
        _line("complete", url=COMPLETIONS, prompt="The sky is", max_tokens=5, logprobs=1),
    ]
    (tmp_path / "in").mkdir()
    path = _write(tmp_path / "in" / "requests.jsonl", lines)
    monkeypatch.setattr(read_tasks, "READ_TASK_BYTES", 200)
    monkeypatch.setattr(read_tasks, "FIRST_TASK_BYTES", 100)
    assert len(read_tasks.plan_read_tasks([(path, None)], "openai_batch")) >= 4
    spec = parse_job(_job(tmp_path, path, model={"dtype": "float32", "max_model_len": 1024},
                          cluster={"colocated": {"chip": "fast", "replicas": 1, "num_cpus": 0.5}}))
    report = JobRunner(spec, fresh=True, progress=False).run()
    assert report["docs_ok"] == 4 and report["docs_failed"] == 1
    out = tmp_path / "out"
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["plain-chat", "two", "json", "complete"]  # input order
    assert len({r["id"] for r in results}) == 4
    for r in results:
        assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"]
    bodies = {r["custom_id"]: r["response"]["body"] for r in results}
    chats = {k: ChatCompletion.model_validate(bodies[k]) for k in ("plain-chat", "two", "json")}
    assert all(c.model == MODEL and c.usage.total_tokens > c.usage.prompt_tokens for c in chats.values())
    two = chats["two"]
    assert [c.index for c in two.choices] == [0, 1]
    for c in two.choices:
        assert c.finish_reason in ("stop", "length") and c.logprobs.content
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert chats["plain-chat"].choices[0].logprobs is None and len(chats["plain-chat"].choices) == 1
    jsonschema.validate(json.loads(chats["json"].choices[0].message.content), schema)
    comp = Completion.model_validate(bodies["complete"])
    assert comp.object == "text_completion" and len(comp.choices) == 1
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    (err,) = errors
    assert err["custom_id"] == "wrong-model" and err["response"] is None
    BatchError.model_validate(err["error"])
    assert err["error"]["code"] == "ModelMismatch"
    assert "'gpt-4o-mini'" in err["error"]["message"] and repr(MODEL) in err["error"]["message"]

    before = {n: (out / n).read_bytes() for n in ("results.jsonl", "errors.jsonl")}
    again = JobRunner(spec, progress=False).run()
    assert again.get("noop") is True
    assert {n: (out / n).read_bytes() for n in before} == before
    (out / "results.jsonl").unlink()  # a completed job's missing files are written again, the same
    assert JobRunner(spec, progress=False).run().get("noop") is True
    assert {n: (out / n).read_bytes() for n in before} == before
    import yaml

    from dlbatch.cli.main import main

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec.to_dict()))
    for n in before:
        (out / n).unlink()
    assert main(["export", str(job)]) == 0  # `dlbatch export`: the same files from the committed rows
    assert {n: (out / n).read_bytes() for n in before} == before


def test_dlbatch_batch_answers_a_file_naming_another_model(sample_model, tmp_path):
    """`dlbatch batch -i -o --model --served-model-name` (vllm run-batch's interface): five chat
    requests written for "gpt-4o-mini" run unchanged; -o holds one response per request, each
    an openai ChatCompletion; a rerun resumes (nothing generated again) and writes -o again."""
    import subprocess
    import sys

    from openai.types.chat import ChatCompletion

    req = tmp_path / "requests.jsonl"
    req.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                       "body": {"model": "gpt-4o-mini", "max_tokens": 6, "temperature": 0,
                                                "messages": [{"role": "user", "content": f"Say {i} in words."}]}})
                           + "\n" for i in range(5)))
    out = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "dlbatch.cli", "batch", "-i", str(req), "-o", str(out), "--model", MODEL,
           "--served-model-name", "gpt-4o-mini", "--set", "model.dtype=float32", "--set", "model.max_model_len=512",
           "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == [f"r{i}" for i in range(5)]
    for x in lines:
        assert x["error"] is None and x["response"]["status_code"] == 200
        chat = ChatCompletion.model_validate(x["response"]["body"])
        assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1
    first = out.read_text()
    out.unlink()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert out.read_text() == first  # the same answers, from the work folder: none generated again


def test_a_served_model_name_is_accepted_and_any_other_name_is_refused_naming_them():
    from connectors.openai_batch import InvalidRequest, translate

    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    assert translate("/v1/chat/completions", body, (MODEL, "gpt-4o-mini"))["chat"] is True
    with pytest.raises(InvalidRequest, match=r"'smollm2-135m-instruct', 'gpt-4o'.*served_model_name") as e:
        translate("/v1/chat/completions", body, (MODEL, "gpt-4o"))
    assert e.value.code == "ModelMismatch"

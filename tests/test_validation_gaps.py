"""load_job refuses, in one line naming the field and the value, what would otherwise fail or
hang at run time: a max_tokens with no room left in max_model_len, an output path that is a
file, an output folder inside the input folder, and templates that read underscore attributes,
loop without bound or build a huge value (the template bombs). The render itself is bounded too."""
from __future__ import annotations

import json
import pathlib
import time

import pytest

from dlbatch.jobspec import JobSpecError, load_job
from dlbatch.prompts.templates import TemplateError, compile_task_templates

REPO = pathlib.Path(__file__).resolve().parents[1]
JOBS = sorted((REPO / "jobs").glob("*.yaml"))


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in").mkdir()
    return tmp_path


def refused(*overrides, job="jobs/papers_jsonl.yaml") -> str:
    with pytest.raises(JobSpecError) as info:
        load_job(REPO / job, list(overrides))
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def test_the_shipped_jobs_still_load(monkeypatch):
    monkeypatch.chdir(REPO)
    for job in JOBS:
        load_job(job)


def test_max_tokens_not_below_max_model_len(here):
    msg = refused("model.max_model_len=512", "tasks.1.max_tokens=512", "output.path=out")
    assert "tasks.1.max_tokens: 512" in msg and "max_model_len 512" in msg
    load_job(REPO / "jobs/papers_jsonl.yaml", ["model.max_model_len=512", "tasks.1.max_tokens=511",
                                               "output.path=out"])
    # no max_model_len: the engines take at most DEFAULT_MAX_MODEL_LEN of the model's context
    msg = refused("model.max_model_len=null", "tasks.0.max_tokens=8192", "output.path=out")
    assert "tasks.0.max_tokens: 8192" in msg and "8192" in msg
    # long_inputs chunk: the map requests' budget too
    msg = refused("model.max_model_len=256", "long_inputs=chunk", "chunking.map_max_tokens=300",
                  "tasks.0.max_tokens=16", "tasks.1.max_tokens=16", "tasks.2.max_tokens=16", "output.path=out")
    assert "chunking.map_max_tokens: 300" in msg


def test_max_tokens_against_the_context_in_the_models_config(here):
    """A model folder's config.json says its context: read at load, without the weights."""
    model = here / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 256}))
    msg = refused(f"model.name={model}", "model.max_model_len=null", "tasks.0.max_tokens=300", "output.path=out")
    assert "tasks.0.max_tokens: 300" in msg and "max_model_len 256" in msg and "config.json" in msg


def test_output_path_that_is_a_file(here):
    (here / "taken.parquet").write_text("x")
    msg = refused(f"output.path={here / 'taken.parquet'}")
    assert "output.path" in msg and "taken.parquet" in msg and "existing file" in msg
    msg = refused(f"output.path=file://{here / 'taken.parquet'}")
    assert "output.path" in msg and "existing file" in msg


@pytest.mark.parametrize("inp,out", [("in", "in"), ("in", "in/out"), ("in/", "in/sub/out"),
                                     ("in/*.jsonl", "in/out")])
def test_output_folder_inside_the_input_folder(here, inp, out):
    msg = refused(f"input.path={here / inp}", f"output.path={here / out}")
    assert msg.split(": ")[1] == "output.path" and str(here / out).rstrip("/") in msg and "inside input.path" in msg


@pytest.mark.parametrize("inp,out", [("s3://bucket/in", "S3://bucket/in/out"), ("s3://bucket/in", "s3a://bucket/in/out"),
                                     ("s3a://bucket/in/", "s3://bucket//in//out"), ("s3://bucket//in", "s3://bucket/in"),
                                     ("memory://bucket/in", "MEMORY://bucket///in/out"), ("gcs://b/in", "gs://b/in/x")])
def test_output_url_inside_the_input_url_whatever_its_spelling(inp, out):
    msg = refused(f"input.path={inp}", f"output.path={out}")
    assert "output.path" in msg and "inside input.path" in msg
    load_job(REPO / "jobs/papers_jsonl.yaml", [f"input.path={inp}", f"output.path={out.replace('in', 'elsewhere')}"])


def test_output_beside_the_input_or_input_a_single_file_loads(here):
    (here / "in" / "a.jsonl").write_text("")
    load_job(REPO / "jobs/papers_jsonl.yaml", [f"input.path={here / 'in'}", f"output.path={here / 'out'}"])
    load_job(REPO / "jobs/papers_jsonl.yaml", [f"input.path={here / 'in' / 'a.jsonl'}",
                                               f"output.path={here / 'in' / 'out'}"])
    msg = refused("input.path=memory://bucket/in", "output.path=memory://bucket/in/out")
    assert "inside input.path" in msg


@pytest.mark.parametrize("prompt,bad", [
    ("{{ text.__class__ }}", "'__class__'"),
    ("{{ text['__class__'] }}", "'__class__'"),
    ("{{ text|attr('__class__') }}", "'__class__'"),
    ("{{ title._x }}", "'_x'"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "range"),
    ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}", "steps"),
    ("{% for a in text %}{% for b in text %}{% endfor %}{% endfor %}", "steps"),
    ("{{ text * 100000 }}", "characters"),
    ("{{ 10 ** (10 ** 6) }}", "too large"),
    ("{{ text|center(1000000000) }}", "1000000000"),
    ("{{ '{:>999999999}'.format(1) }}", "999999999"),
    ("{{ '%999999999d'|format(1) }}", "999999999"),
    ("{{ text.nope }}", "nope"),
])
def test_templates_that_fail_or_hang_at_run_time_are_refused_at_load(here, prompt, bad):
    t0 = time.monotonic()
    msg = refused(f"tasks.1.prompt={json.dumps(prompt)}", "output.path=out")
    assert time.monotonic() - t0 < 30
    assert "tasks.1.prompt" in msg and "keywords" in msg and bad in msg, msg


# templates that build a huge value from a small document: (template, the bound its refusal names)
BOMBS = [
    ("{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "concatenation"),
    ("{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "+ of strings"),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(30) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "+ of lists"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(12) %}{% set ns.s = ns.s.replace('x', ns.s) %}{% endfor %}",
     "str.replace()"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(12) %}{% set ns.s = ns.s|replace('x', ns.s) %}{% endfor %}",
     "replace filter"),
    ("{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}",
     "join filter"),
    ("{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set ns.s = ''.join([ns.s, ns.s]) %}{% endfor %}",
     "str.join()"),
    ("{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set ns.s = '{0}{0}'.format(ns.s) %}{% endfor %}",
     "str.format()"),
    ("{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set ns.s = '%s%s' % (ns.s, ns.s) %}{% endfor %}",
     "% format"),
    ("{{ (text * 200)|indent(999999) }}", "indent filter"),
    ("{{ text|wordwrap(1, wrapstring=text * 200) }}", "wordwrap filter"),
    ("{% set l = [text] * 50000 %}{{ l|length }}", "list * 50000"),
    ("{% set x %}{% for i in range(10000) %}{{ text }}{% endfor %}{% endset %}{{ x|length }}", "wrote more than"),
    ("{% set ns = namespace(n=10) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "bits"),
    ("{{ lipsum(1000, false, 1000, 1000) }}", "lipsum"),
    ("{% set l = range(10000)|list %}{% for x in l recursive %}{% if loop.depth < 4 %}{{ loop(l) }}{% endif %}"
     "{% endfor %}", "steps"),
]


@pytest.mark.parametrize("prompt,bound", BOMBS)
def test_template_bombs_are_refused_at_load_naming_the_bound(here, prompt, bound):
    t0 = time.monotonic()
    msg = refused(f"tasks.1.prompt={json.dumps(prompt)}", "output.path=out")
    assert time.monotonic() - t0 < 30
    assert "tasks.1.prompt" in msg and "render bound" in msg and bound in msg, msg


def test_template_bombs_stay_within_a_memory_bound():
    """Every bomb checked in one fresh process: its peak RSS stays small (unbounded, the
    replace bomb alone took 4 GB and the join bomb 8 GB)."""
    import subprocess
    import sys

    script = ("import json, sys\n"
              "from dlbatch.prompts.templates import TemplateError, check_template\n"
              "from tests.helpers.bounded_inputs import _reset_peak, _status_mb\n"
              "_reset_peak()  # ru_maxrss would count the RSS of the pytest process this one was forked from\n"
              "refused = 0\n"
              "for prompt in json.loads(sys.stdin.read()):\n"
              "    try:\n"
              "        check_template('t', prompt)\n"
              "    except TemplateError:\n"
              "        refused += 1\n"
              "print(json.dumps([refused, _status_mb('VmHWM')]))\n")
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps([b for b, _ in BOMBS]), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    refused_n, peak_mb = json.loads(proc.stdout.strip().splitlines()[-1])
    assert refused_n == len(BOMBS) and peak_mb < 400, (refused_n, peak_mb)


def test_a_memory_error_while_checking_a_template_refuses_it(monkeypatch):
    from dlbatch.prompts import templates

    def exhausted(template, context):
        raise MemoryError

    monkeypatch.setattr(templates, "_render_bounded", exhausted)
    with pytest.raises(TemplateError, match=r"task 't': .*ran out of memory \(MemoryError\)"):
        templates.check_template("t", "{{ text }}")


def test_a_bound_or_memory_error_at_run_time_is_the_tasks_error():
    """A document long enough that the template's values pass the bound only at run time, and
    a value whose text cannot be built: each is that task's TemplateError, the process goes on."""
    doubling = compile_task_templates([{"name": "t", "prompt": BOMBS[0][0].replace("s='x'", "s=text")}])
    doc = {"text": "z" * 200_000, "title": "", "doc_id": "d", "source": "s", "pages": 1}
    with pytest.raises(TemplateError, match=r"task 't': .*render bound.*concatenation"):
        doubling(doc)

    class Huge:
        def __str__(self):
            raise MemoryError

    render = compile_task_templates([{"name": "t", "prompt": "{{ text }}{{ row.x }}"}])
    with pytest.raises(TemplateError, match=r"task 't': .*MemoryError"):
        render(dict(doc, row={"x": Huge()}))
    assert render(dict(doc, row={"x": 1})) == ["z" * 200_000 + "1"]


def test_the_render_is_bounded_at_run_time_too():
    """A document much longer than the sample: the budget holds for every document."""
    render = compile_task_templates([{"name": "t", "prompt": "{% for c in text %}{{ c }}{% endfor %}"}])
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="steps"):
        render({"text": "x" * 500_000, "title": "", "doc_id": "d", "source": "s", "pages": 1})
    assert time.monotonic() - t0 < 10
    ok = compile_task_templates([{"name": "t", "prompt": "{{ text }}{% for i in range(3) %}{{ loop.index }}{% endfor %}"}])
    assert ok({"text": "y" * 300_000, "title": "", "doc_id": "d", "source": "s", "pages": 1}) == ["y" * 300_000 + "123"]

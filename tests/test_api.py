"""The Python API (dlbatch/api.py): a job built in Python, a ray.data.Dataset in and rows out,
exactly once after a kill, and a pipeline of one's own registered from an installed package.

The runs happen in subprocesses, as a notebook or an Airflow task would run them: the
script starts Ray itself (a dataset needs it) and calls `dlbatch.run`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = [{"qid": f"q{i:02d}", "passage": f"Passage {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}.",
              "question": f"Is {i} even?"} for i in range(6)]

SCRIPT = """
import json, sys
import ray
import dlbatch

ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)  # as a notebook would: no chip resources
ds = ray.data.from_items(json.loads(sys.argv[2]))
job = {{"name": "qa", "pipeline": "papers",
        "input": {{"id_field": "qid", "text_field": "passage"}},
        "output": {{"path": sys.argv[1], "keep_columns": ["qid", "question"]}},
        "model": {{"dtype": "float32", "max_model_len": 512}},
        "tasks": [{{"name": "answer", "prompt": "{{{{ text }}}}\\nQuestion: {{{{ row.question }}}}\\nAnswer:",
                   "max_tokens": 4}}],
        "cluster": {{"colocated": {{"chip": "fast", "replicas": 1, "num_cpus": 1}}}}}}
result = dlbatch.run(job, dataset=ds, options={{"flush_docs": 1}}, **json.loads(sys.argv[3]))
rows = result.rows(["doc_id", "task", "qid", "question", "output"]).to_pylist()
print("RESULT " + json.dumps({{"docs_ok": result.docs_ok, "rows_written": result.rows_written, "noop": result.noop,
                              "rows": rows, "errors": result.errors().num_rows}}))
"""


def _run_script(out: Path, items: list, sections: dict | None = None, env: dict | None = None,
                timeout: float = 600) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(), str(out), json.dumps(items),
                           json.dumps(sections or {})], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_a_dataset_in_gives_its_rows_out_and_a_rerun_does_nothing_again(tmp_path, sample_model):
    out = tmp_path / "out"
    res = _run_script(out, QUESTIONS)
    assert res["docs_ok"] == len(QUESTIONS) and res["errors"] == 0
    rows = res["rows"]
    assert sorted(r["doc_id"] for r in rows) == [q["qid"] for q in QUESTIONS]  # the id column names the rows
    assert {r["qid"]: r["question"] for r in rows} == {q["qid"]: q["question"] for q in QUESTIONS}
    assert all(r["task"] == "answer" and r["output"] is not None for r in rows)
    again = _run_script(out, QUESTIONS)  # every id committed: nothing is generated twice
    assert again["rows_written"] == 0 and len(again["rows"]) == len(QUESTIONS)
    more = _run_script(out, QUESTIONS + [{"qid": "q99", "passage": "Passage 99.", "question": "Is 99 even?"}])
    assert more["rows_written"] == 1 and sorted(r["doc_id"] for r in more["rows"])[-1] == "q99"


@pytest.mark.slow
def test_a_dataset_job_killed_mid_run_commits_each_row_once_on_rerun(tmp_path, sample_model):
    """kill -9 of the whole process group once some rows are committed (seeded count), then the
    same script again: every id exactly once."""
    import random

    seed = int(os.environ.get("DLBATCH_TEST_SEED", time.time_ns() % 100000))
    print(f"seed {seed}")
    items = [{"qid": f"k{i:02d}", "passage": f"Passage {i} " + "word " * (20 + 7 * i), "question": "Why?"}
             for i in range(40)]
    # small batches, two in flight: commits of a few documents each, so the run makes more
    # parts than the seeded kill point asks for (with the default 8K-token batches it could
    # finish in fewer and end before the kill)
    longer = {"tasks": [{"name": "answer", "prompt": "{{ text }}\nQuestion: {{ row.question }}\nAnswer:",
                         "max_tokens": 24}], "batching": {"max_batch_tokens": 512, "max_inflight_batches": 2}}
    out = tmp_path / "out"
    wait_for = random.Random(seed).randint(1, 6)
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(), str(out), json.dumps(items), json.dumps(longer)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None and len(list(out.glob("part-*.parquet"))) < wait_for:
            time.sleep(0.2)
        assert proc.poll() is None, f"seed {seed}: the run ended before the kill: {proc.stderr.read()[-2000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done = len(list(out.glob("part-*.parquet")))
    assert done < len(items), f"seed {seed}: everything was committed before the kill"
    res = _run_script(out, items, longer)
    ids = [r["doc_id"] for r in res["rows"]]
    assert sorted(ids) == [i["qid"] for i in items], f"seed {seed}: {done} parts before the kill"
    assert len(ids) == len(set(ids))


PIPELINE = '''
"""A pipeline of one's own: the shipped build, a preprocess and a postprocess hook."""
from pipelines.papers import build
from dlbatch.prompts.hooks import Skip

POSTPROCESS_FIELDS = [("answer_words", "int64")]


def preprocess(doc):
    if doc["row"].get("skip"):
        raise Skip("marked skip")
    doc["row"]["question"] = doc["row"]["question"].upper()
    return doc


def postprocess(row):
    row["answer_words"] = len((row["output"] or "").split())
    return row
'''


def test_a_pipeline_registered_by_an_installed_package_runs_its_hooks(tmp_path, sample_model):
    """A package on the path with an entry point in the group dlbatch.pipelines (as `pip install`
    leaves it: a module and its dist-info) is a pipeline a job file names."""
    site = tmp_path / "site"
    (site / "mypipes").mkdir(parents=True)
    (site / "mypipes" / "__init__.py").write_text(textwrap.dedent(PIPELINE))
    dist = site / "mypipes-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mypipes\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[dlbatch.pipelines]\nupper = mypipes\n")
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({**q, "skip": q["qid"] == "q03"}) + "\n" for q in QUESTIONS[:4]))
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        name: hooks
        pipeline: upper
        input: {{format: jsonl, path: {data}, id_field: qid, text_field: passage}}
        output: {{path: {tmp_path / 'out'}, keep_columns: [qid]}}
        model: {{dtype: float32, max_model_len: 512}}
        tasks:
          - {{name: answer, prompt: "{{{{ text }}}} {{{{ row.question }}}}", max_tokens: 4}}
        cluster: {{colocated: {{chip: fast, replicas: 1, num_cpus: 1}}}}
        """))
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "dlbatch.cli", "run", str(job), "--no-progress"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "out").to_pylist()
    assert sorted(r["qid"] for r in rows) == ["q00", "q01", "q02"]  # q03 skipped by the hook
    assert all(isinstance(r["answer_words"], int) for r in rows)  # the postprocess column, typed
    errors = pq.read_table(tmp_path / "out" / "_errors").to_pylist()
    assert [(e["doc_id"], e["error_type"]) for e in errors] == [("q03", "Skipped")]


def test_load_merges_sections_and_overrides_into_a_job_file():
    import dlbatch

    spec = dlbatch.load("jobs/papers.yaml", overrides={"input.limit": 2}, model={"dtype": "float32"},
                        tasks=[{"name": "t", "prompt": "{{ text }} Sum up.", "max_tokens": 8}])
    assert spec.input.limit == 2 and spec.model.dtype == "float32" and spec.model.name == "smollm2-135m-instruct"
    assert [t.name for t in spec.tasks] == ["t"]
    with pytest.raises(TypeError, match="unknown job section"):
        dlbatch.load("jobs/papers.yaml", inputs={"limit": 2})
    with pytest.raises(ValueError, match="model.dtype"):
        dlbatch.load({"name": "x", "pipeline": "papers", "model": {"dtype": "fp8"}})

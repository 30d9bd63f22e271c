"""Row identity of table inputs (issue 37, points 6 and 7): a row's identity covers every
column its prompts read, and an edited row supersedes its old results (dlbatch/prompts/doc_identity.py,
dlbatch/driver/edits.py)."""
from __future__ import annotations

import json

import pytest

from tests.helpers.jobs import output_rows

PASSAGE = "Enzymes are proteins that speed up chemical reactions without being consumed. " * 3
OTHER = "A pendulum's period depends on its length and on gravity, not on the mass of its bob. " * 3

JOB = """name: identity
pipeline: papers
input: {format: jsonl, path: PATH, text_field: context}
output: {path: out/identity, keep_columns: [question]}
model: {name: smollm2-135m-instruct, dtype: float32, max_model_len: 1024}
tasks:
  - {name: answer, prompt: "{{ text }}\\n\\nQuestion: {{ row.question }}\\nAnswer briefly.", max_tokens: 4}
sampling: {temperature: 0.0, seed: 0}
"""


def _spec(tmp_path, **input_):
    from dlbatch.jobspec import load_job

    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("PATH", str(tmp_path / "rows.jsonl")))
    return load_job(str(job), [f"input.{k}={v}" for k, v in input_.items()])


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _doc(identity, **cols):
    from connectors.columns import pack

    text = cols.pop("context")
    return identity.apply({"doc_id": "reader-id", "source": "f#line1", "text": text, "error": None,
                           "columns": pack(cols)})


def test_identity_covers_the_columns_the_prompts_read(tmp_path):
    from connectors.ids import content_id
    from dlbatch.prompts.doc_identity import DocIdentity

    ident = DocIdentity.for_job(_spec(tmp_path))
    assert ident.columns == frozenset({"question"})
    a = _doc(ident, context=PASSAGE, question="Are enzymes used up?", topic="bio")
    b = _doc(ident, context=PASSAGE, question="What do enzymes speed up?", topic="bio")
    c = _doc(ident, context=PASSAGE, question="Are enzymes used up?", topic="chemistry")  # topic is not read
    assert a["doc_id"] != b["doc_id"] and a["doc_id"] == c["doc_id"] == a["doc_version"]
    assert a["doc_id"] != content_id(PASSAGE)  # not the text's hash alone
    by_field = DocIdentity.for_job(_spec(tmp_path, id_field="id"))
    d = _doc(by_field, context=PASSAGE, question="Are enzymes used up?")
    e = _doc(by_field, context=PASSAGE, question="What do enzymes speed up?")
    assert d["doc_id"] == e["doc_id"] == "reader-id" and d["doc_version"] != e["doc_version"]
    assert _doc(by_field, context=PASSAGE, question="x", extra=1)["doc_version"] == \
        _doc(by_field, context=PASSAGE, question="x", extra=2)["doc_version"]


def test_a_job_reading_only_the_text_keeps_text_ids(tmp_path):
    from connectors.ids import content_id
    from dlbatch.prompts.doc_identity import DocIdentity

    ident = DocIdentity(True, frozenset(), False, "context")
    a = _doc(ident, context=PASSAGE, question="q1")
    assert a["doc_version"] == content_id(PASSAGE) and a["doc_id"] == "reader-id"  # the reader's text hash
    error = ident.apply({"doc_id": "e", "source": "f#line2", "text": None, "error": "bad", "columns": None})
    assert error["doc_id"] == "e" and "doc_version" not in error


def run_job(job, out, extra):
    from dlbatch.driver.runner import JobRunner
    from dlbatch.jobspec import load_job

    return JobRunner(load_job(job, [f"output.path={out}", *extra]), progress=False).run()


def _answers(out):
    return {r["question"]: (r["doc_id"], r["doc_version"]) for r in output_rows(out)}


@pytest.mark.ray
@pytest.mark.parametrize("id_field", [None, "id"])
def test_two_questions_on_one_passage_and_an_edited_row(ray_local, sample_model, tmp_path, id_field):
    """Two rows with one passage and two questions are two documents; editing a row's question
    (its id kept, with id_field) redoes that row alone and leaves one result per row."""
    path = tmp_path / "rows.jsonl"
    rows = [{"id": "r1", "context": PASSAGE, "question": "Are enzymes used up?"},
            {"id": "r2", "context": PASSAGE, "question": "What do enzymes speed up?"},
            {"id": "r3", "context": OTHER, "question": "What sets a pendulum's period?"}]
    _write(path, rows)
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("PATH", str(path)))
    out = str(tmp_path / "out")
    extra = [f"input.id_field={id_field}"] if id_field else []
    rep = run_job(str(job), out, extra)
    assert rep["docs_ok"] == 3 and rep["docs_failed"] == 0
    before = _answers(out)
    assert len(before) == 3 and len({d for d, _ in before.values()}) == 3
    rows[2]["question"] = "Does the bob's mass change the period?"
    _write(path, rows)
    rep = run_job(str(job), out, extra)
    assert rep["rows_edited"] == 1 and rep["docs_this_run"] == 1, rep
    after = _answers(out)
    assert set(after) == {r["question"] for r in rows} and len(output_rows(out)) == 3
    assert after["Are enzymes used up?"] == before["Are enzymes used up?"]  # untouched rows not redone
    new = after["Does the bob's mass change the period?"]
    assert new[1] != before["What sets a pendulum's period?"][1]
    assert (new[0] == "r3") == (id_field == "id")
    assert run_job(str(job), out, extra).get("noop")  # nothing changed since: nothing to do

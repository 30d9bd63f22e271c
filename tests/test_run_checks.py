"""`dlbatch run` checks what `dlbatch validate` checks, before anything starts, with the same
exit codes (issue 37 point 13, issue 38 point 5); a run whose documents mostly fail stops
non-zero and its fix resumes without --fresh."""
from __future__ import annotations

import json
import os
import re

import pytest

from dlbatch.cli.main import main
from dlbatch.driver.dead_letter_share import MIN_DOCS, DeadLetterShare, TooManyDeadLetters
from dlbatch.jobspec import content_fields, fingerprint_fields, load_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture
def nothing_starts(monkeypatch):
    """Ray, the engine and the input pipeline must not start: each raises if asked."""
    import dlbatch.workers.session as session
    from dlbatch.driver.runner import JobRunner

    def refuse(*a, **k):
        raise AssertionError("started before the checks refused the job")

    monkeypatch.setattr(session, "start_ray", refuse)
    monkeypatch.setattr(JobRunner, "_run_pools", refuse)


def _err_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if not x.startswith(("20", "WARNING", "INFO"))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _manifest_of(spec, out, **changes):
    """An output written by ``spec`` (its manifest), as a run leaves it."""
    os.makedirs(out, exist_ok=True)
    fields = {**fingerprint_fields(spec), **content_fields(spec)}
    with open(os.path.join(out, "_manifest.json"), "w") as f:
        json.dump({"name": spec.name, "fields": fields, "complete": False, **changes}, f)


CASES = {
    "text_field": (["input.text_field=txt"], r"input.text_field 'txt' is in none of the first 8 rows .*"
                                             r"\(their columns: id, text, title\)"),
    "id_field": (["input.id_field=idd"], r"input.id_field 'idd' is in none of the first 8 rows .*columns: id, text"),
    "missing input": (["input.path=/nowhere/docs.jsonl"], r"input.path '/nowhere/docs.jsonl'"),
    "pipeline": (["pipeline=nope"], r"pipeline: .*nope"),
    "column": (['tasks.0.prompt="{{ text }} {{ row.topic }}"'], r"task 'summary' reads column 'topic'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_run_refuses_before_anything_starts_what_validate_refuses(case, tmp_path, capsys, nothing_starts):
    sets, msg = CASES[case]
    out = tmp_path / "out"
    args = ["jobs/papers_jsonl.yaml", *sum((["--set", s] for s in [*sets, f"output.path={out}"]), [])]
    assert main(["validate", *args]) == 2
    v = _err_line(capsys)
    assert main(["run", *args]) == 2
    r = _err_line(capsys)
    assert re.search(msg, v) and re.search(msg, r), (v, r)
    assert v.removeprefix("error: ") == r.removeprefix("invalid job: ")  # the same check, the same words
    assert not out.exists()  # nothing written by either


def test_a_resume_run_would_refuse_is_refused_by_validate_naming_the_changed_key(tmp_path, capsys, nothing_starts):
    out = str(tmp_path / "out")
    _manifest_of(load_job("jobs/papers_jsonl.yaml", [f"output.path={out}", "tasks.2.max_tokens=32"]), out)
    args = ["jobs/papers_jsonl.yaml", "--set", f"output.path={out}", "--set", "tasks.2.max_tokens=40"]
    assert main(["validate", *args]) == 2
    v = _err_line(capsys)
    assert main(["run", *args]) == 2
    r = _err_line(capsys)
    for line in (v, r):
        assert "cannot resume" in line and "changed: tasks.question.max_tokens: 32 -> 40" in line
    assert sorted(os.listdir(out)) == ["_manifest.json"]  # nothing else written


def test_an_uninstalled_backend_is_refused_by_both(tmp_path, capsys, monkeypatch, nothing_starts):
    from dlbatch.backends import vllm_backend

    monkeypatch.setattr(vllm_backend.importlib.util, "find_spec", lambda name: None)
    args = ["jobs/papers_jsonl.yaml", "--set", "model.backend=vllm", "--set", f"output.path={tmp_path / 'o'}"]
    for cmd in ("validate", "run"):
        assert main([cmd, *args]) == 2
        assert "needs vLLM in this environment" in _err_line(capsys)


# ------------------------------------------------------------------------------ the dead-letter share
def _dead(n, error_type="MissingField"):
    return [{"doc_id": f"d{i}", "error_type": error_type, "error": "text field 'text' is missing or null"}
            for i in range(n)]


def test_the_share_is_judged_from_min_docs_on_and_at_the_end():
    share = DeadLetterShare(0.5)
    share.note(dead=_dead(MIN_DOCS - 1))
    share.check()  # too few finished to judge mid-run
    with pytest.raises(TooManyDeadLetters, match=r"19 of the 19 documents this run finished were dead-lettered "
                                                  r"\(100%, over max_dead_letter_fraction 0.5\).*MissingField"):
        share.check(final=True)
    share = DeadLetterShare(0.5)
    share.note(ok=10)
    share.note(dead=_dead(10))
    share.check()
    share.check(final=True)  # 50%: not over
    share.note(dead=_dead(1, "LongInput"))
    with pytest.raises(TooManyDeadLetters) as e:
        share.check()
    assert "\n" not in str(e.value) and e.value.brief == "11 of 21 documents dead-lettered, 10 MissingField"
    assert "read again by the rerun" in str(e.value)
    DeadLetterShare(1.0).check(final=True)
    never = DeadLetterShare(1.0)
    never.note(dead=_dead(50))
    never.check(final=True)  # 1: never


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_dead_letters_a_resume_retries_are_removed_and_stay_removed(fmt, tmp_path):
    """retry_dead_letters drops whole documents' dead letters of the given types (Parquet's
    footer copies included: a recover does not bring them back); task-level ones and other
    types stay."""
    from dlbatch.output.delta_store import DeltaStore
    from dlbatch.output.parquet_store import ParquetStore

    Store = {"parquet": ParquetStore, "delta": DeltaStore}[fmt]

    row = {"output": "x", "prompt_tokens": 3, "output_tokens": 1, "finish_reason": "stop", "truncated": False,
           "model": "m"}

    def err(doc, t="MissingField", task=None):
        return {"doc_id": doc, "source": f"a.jsonl#line{doc}", "task": task, "stage": "parse", "error_type": t,
                "error": "boom"}

    out = str(tmp_path / "out")
    store = Store(out)
    store.commit([{**row, "doc_id": "1", "source": "a.jsonl#line1", "task": "summary"}],
                 [err("2"), err("1", task="keywords")], include_text=False)  # footer dead letters
    store.commit([], [err("3"), err("4", "LongInput")], include_text=False)  # a flush of dead letters only
    assert Store(out).retry_dead_letters({"MissingField"}) == 2
    for s in (Store(out), Store(out)):
        s.recover()
        left = sorted((r["doc_id"], r["error_type"]) for r in s.errors().to_pylist())
        assert left == [("1", "MissingField"), ("4", "LongInput")]
        prog = s.progress(tasks={"summary", "keywords"})
        assert prog["failed_ids"].to_pylist() == ["4"] and prog["done_ids"].to_pylist() == ["1"]
        assert prog["rows"] == 1


@pytest.mark.ray
def test_a_run_that_mostly_fails_stops_and_its_fix_resumes(ray_local, sample_model, tmp_path, capsys):
    """25 rows, each with an empty `text` (its text in `body`): the run stops non-zero, the
    output incomplete and halted; with nothing committed, the fixed job (another text_field:
    another fingerprint) starts it over without --fresh. Then rows that lack the field are the
    MissingField dead letters a plain rerun reads again once the input is fixed."""
    from tests.helpers.jobs import SHORT

    src = tmp_path / "docs.jsonl"
    body = "Tidal arrays lose power to wakes; spacing turbines wider recovers some of it."
    src.write_text("".join(json.dumps({"id": f"r{i}", "text": "", "body": body + f" ({i})"}) + "\n"
                           for i in range(25)))
    out = tmp_path / "out"
    base = ["jobs/papers_jsonl.yaml", "--no-progress", *sum((["--set", s] for s in [
        f"input.path={src}", "input.id_field=id", f"output.path={out}", *SHORT]), [])]
    assert main(["run", *base]) == 1
    err = capsys.readouterr().err
    assert "over max_dead_letter_fraction 0.5" in err and "EmptyDocument" in err
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["complete"] is False and "EmptyDocument" in manifest["halted"]
    assert main(["validate", *[a for a in base if a != "--no-progress"], "--set", "input.text_field=body"]) == 0
    assert "a run starts it over" in capsys.readouterr().out
    assert main(["run", *base, "--set", "input.text_field=body"]) == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["complete"] is True and "halted" not in manifest
    from dlbatch.output.parquet_store import ParquetStore

    store = ParquetStore(str(out))
    assert store.errors().num_rows == 0 and store.progress()["n_done"] == 25
    # three new rows without the field: this run's documents all fail; results exist, so it resumes
    fixed = [f"{b}\n" for b in src.read_text().splitlines()]
    src.write_text("".join(fixed) + "".join(json.dumps({"id": f"m{i}", "text": ""}) + "\n" for i in range(3)))
    sets = [*base, "--set", "input.text_field=body"]
    assert main(["run", *sets]) == 1
    assert "3 of the 3 documents this run finished" in capsys.readouterr().err
    assert ParquetStore(str(out)).progress()["n_failed"] == 3
    src.write_text("".join(fixed) + "".join(json.dumps({"id": f"m{i}", "body": body}) + "\n" for i in range(3)))
    assert main(["run", *sets]) == 0  # the rows fixed: their MissingField dead letters are read again
    store = ParquetStore(str(out))
    prog = store.progress()
    assert (prog["n_done"], prog["n_failed"], prog["rows"], store.errors().num_rows) == (28, 0, 84, 0)

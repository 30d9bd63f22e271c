"""`dlbatch validate` on every shipped job and on broken ones; CLI errors are one line, exit 2."""
from __future__ import annotations

import glob
import os

import pytest

from dlbatch.cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "jobs", "*.yaml")))


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # job files name their sample data relative to the repository


@pytest.mark.parametrize("job", JOBS)
def test_every_shipped_job_validates(job, tmp_path, capsys):
    rc = main(["validate", job, "--docs", "2", "--set", f"output.path={tmp_path / 'out'}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "is valid" in out and "inputs: " in out and "prompt tokens" in out and "estimate: " in out
    assert not (tmp_path / "out").exists()  # validate writes nothing: no probe, no folder


def _one_line_error(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if not x.startswith(("20", "WARNING", "INFO"))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_missing_input_is_one_line_and_exit_2(tmp_path, capsys):
    rc = main(["validate", "jobs/papers.yaml", "--set", f"input.path={tmp_path / 'nowhere'}",
               "--set", f"output.path={tmp_path / 'out'}"])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and "nowhere" in line and line.startswith("error: ")


def test_an_unwritable_output_is_named(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    rc = main(["validate", "jobs/papers.yaml", "--docs", "1", "--set", f"output.path={tmp_path / 'a_file' / 'out'}"])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and "output.path" in line and "a_file" in line


def test_a_job_whose_documents_give_no_prompts_is_invalid(tmp_path, capsys):
    src = tmp_path / "empty.jsonl"
    src.write_text('{"text": ""}\n')
    rc = main(["validate", "jobs/papers_jsonl.yaml", "--set", f"input.path={src}",
               "--set", f"output.path={tmp_path / 'out'}"])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and "gives prompts" in line


def test_status_of_a_job_whose_input_is_missing_is_one_line_exit_2(tmp_path, capsys):
    rc = main(["status", "jobs/papers_jsonl.yaml", "--set", f"input.path={tmp_path / 'missing.jsonl'}",
               "--set", f"output.path={tmp_path / 'out'}"])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and "missing.jsonl" in line

"""When `dlbatch run` starts its workers before listing the inputs (dlbatch/driver/early_start.py)."""
from __future__ import annotations

import json

import pytest

from dlbatch.driver.early_start import is_remote, starts_early
from dlbatch.jobspec import load_job


def test_is_remote():
    for p in ("s3://b/in", "gs://b/x/*.jsonl", "https://example.org/d.jsonl", "memory://in", "hf://datasets/a/b"):
        assert is_remote(p), p
    for p in ("samples/papers", "/data/in", "file:///data/in", "local:///x", "C:/data"):
        assert not is_remote(p), p


def _spec(tmp_path, *sets):
    return load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'out'}", *sets])


def test_local_inputs_are_listed_first(tmp_path):
    assert not starts_early(_spec(tmp_path), fresh=True)
    (tmp_path / "hf").mkdir()
    assert not starts_early(_spec(tmp_path, "input.format=hf", f"input.path={tmp_path / 'hf'}"), fresh=True)  # saved


def test_remote_inputs_start_the_workers_first_unless_the_job_is_complete(tmp_path):
    spec = _spec(tmp_path, "input.format=jsonl", "input.path=s3://bucket/in/")
    assert starts_early(spec, fresh=False)  # nothing written yet
    assert starts_early(_spec(tmp_path, "input.format=hf", "input.path=org/papers"), fresh=False)  # a Hub id
    out = tmp_path / "out"
    out.mkdir()
    (out / "_manifest.json").write_text(json.dumps({"name": "papers", "complete": False}))
    assert starts_early(spec, fresh=False)  # a resume: there is work
    (out / "_manifest.json").write_text(json.dumps({"name": "papers", "complete": True}))
    assert not starts_early(spec, fresh=False)  # most likely a no-op rerun: list first
    assert starts_early(spec, fresh=True)


def test_check_job_calls_on_config_before_listing(tmp_path):
    from dlbatch.driver.checks import JobInvalid, check_job

    seen = []
    spec = _spec(tmp_path, "input.format=jsonl", f"input.path={tmp_path / 'missing'}")
    with pytest.raises(JobInvalid, match="missing"):
        check_job(spec, on_config=seen.append)
    assert len(seen) == 1 and seen[0].max_model_len  # the resolved RunConfig, then the listing failed

"""jobs/papers.yaml, the job users copy: the per-file parse caps at their defaults and shown
with their keys, and outputs written with the page cap null still resume."""
from __future__ import annotations

import pathlib

import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
JOB = REPO / "jobs" / "papers.yaml"
CAPS = ("max_pages", "max_file_bytes", "parse_timeout_s", "parse_memory_mb", "max_line_bytes", "max_text_chars")


def test_papers_job_shows_every_parse_cap_at_its_default():
    from dlbatch.jobspec import InputSpec, load_job

    written = yaml.safe_load(JOB.read_text())["input"]
    assert set(CAPS) <= set(written), f"jobs/papers.yaml lacks {sorted(set(CAPS) - set(written))}"
    spec = load_job(str(JOB), [])
    for key in CAPS:
        assert getattr(spec.input, key) == InputSpec.model_fields[key].default, (key, getattr(spec.input, key))
    # each cap line says what it is
    lines = {ln.split(":")[0].strip(): ln for ln in JOB.read_text().splitlines() if ln.startswith("  ")}
    assert all("#" in lines[key] for key in CAPS), [lines[k] for k in CAPS]


def test_outputs_written_with_no_page_cap_still_resume():
    """The default cap counts as no cap in the fingerprint: a manifest written when the job
    file said ``max_pages: null`` is compatible with the job file as it is now."""
    from dlbatch.jobspec import check_resume_compatible, fingerprint_fields, job_fingerprint, load_job

    now = load_job(str(JOB), [])
    before = load_job(str(JOB), ["input.max_pages=null"])
    assert before.input.max_pages is None and now.input.max_pages == 1000
    assert job_fingerprint(now) == job_fingerprint(before)
    check_resume_compatible(fingerprint_fields(before), now)


def test_the_text_cap_counts_in_the_fingerprint_only_off_its_default():
    """``max_text_chars`` changes the rows of longer documents: another value is another job;
    its default and no cap alike keep the fingerprint of outputs written before it existed.
    ``max_line_bytes`` only decides which lines are dead letters."""
    from dlbatch.jobspec import job_fingerprint, load_job

    now = job_fingerprint(load_job(str(JOB), []))
    assert job_fingerprint(load_job(str(JOB), ["input.max_text_chars=null"])) == now
    assert job_fingerprint(load_job(str(JOB), ["input.max_text_chars=1000"])) != now
    assert job_fingerprint(load_job(str(JOB), ["input.max_line_bytes=1000"])) == now


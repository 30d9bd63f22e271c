"""`dlbatch plan` and the auto solver measure the workload on a sample of the job's documents
(dlbatch/driver/workload.py). That sample is parsed as the job parses it: PDFs in the parser
process under the job's caps, so a PDF that crashes MuPDF, hangs or is over a cap is left out
of the measurement, counted and named, and the measurement goes on."""
from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PAPERS = REPO / "samples" / "papers"
FAULTS = "tests.helpers.parse_faults"

# the measuring process: a parse of segv.pdf in this very process would segfault it, as MuPDF
# does on a poison PDF (the parser process runs parse_faults.by_name instead: a crash there)
MEASURE = """
import json, os, sys
import connectors.pdf
from tests.helpers import parse_faults
real = connectors.pdf.extract_pdf
def here(data, source, **kw):
    if os.path.basename(source).startswith("segv"):
        parse_faults.segfault()
    return real(data, source, **kw)
connectors.pdf.extract_pdf = here
from dlbatch.driver.workload import job_workload
from dlbatch.jobspec import load_job
spec = load_job("jobs/papers.yaml", sys.argv[1:])
s = job_workload(spec, sample=8, use_report=False, max_model_len=spec.model.max_model_len)
print("RESULT " + json.dumps({"sampled": s.docs_sampled, "total": s.docs_total, "failed": s.failed_docs}))
"""


def _pdfs(tmp_path) -> pathlib.Path:
    d = tmp_path / "pdfs"
    d.mkdir()
    for src, name in [("paged_attention_batch", "good-a"), ("perovskite_solar_stability", "good-b"),
                      ("kv_cache_transfer", "segv"), ("songbird_migration_timing", "hang"),
                      ("long_context_batch_serving", "big")]:
        shutil.copy(PAPERS / f"{src}.pdf", d / f"{name}.pdf")
    return d


def test_a_crashing_hanging_or_oversized_pdf_does_not_end_the_measurement(tmp_path, sample_model):
    """In a child process, so that a parse in the measuring process itself (a real segfault)
    shows as a failed run here rather than killing the test session."""
    d = _pdfs(tmp_path)
    cap = (PAPERS / "long_context_batch_serving.pdf").stat().st_size - 1  # big.pdf only is over it
    env = {**os.environ, "DLBATCH_TEST_PDF_PARSER": f"{FAULTS}:by_name", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", MEASURE, f"input.path={d}", "input.parse_timeout_s=3",
                        f"input.max_file_bytes={cap}", "input.parse_memory_mb=1024"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    got = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert got["sampled"] == 2 and got["total"] == 5, got
    failed = {os.path.basename(f.split(":", 1)[0]): f for f in got["failed"]}
    assert set(failed) == {"segv.pdf", "hang.pdf", "big.pdf"}, got["failed"]
    assert "ParseCrashed" in failed["segv.pdf"] and "SIGSEGV" in failed["segv.pdf"]
    assert "ParseTimeout" in failed["hang.pdf"] and "FileTooLarge" in failed["big.pdf"]
    # one warning line names what was left out
    (line,) = [ln for ln in r.stderr.splitlines() if "left out" in ln]
    assert "3 of the 5 sampled documents" in line and all(f"{n}.pdf" in line for n in ("segv", "hang", "big"))


def test_the_sample_is_parsed_with_the_jobs_caps(tmp_path, monkeypatch, sample_model, caplog):
    import connectors.parse as parse
    from dlbatch.driver.workload import job_workload
    from dlbatch.jobspec import load_job

    d = _pdfs(tmp_path)
    for name in ("segv", "hang", "big"):
        (d / f"{name}.pdf").unlink()
    seen = []
    real = parse.parse_file

    def spy(row, fmt, text_field, id_field, storage_options, max_pages, **caps):
        seen.append((os.path.basename(row["url"]), max_pages, caps))
        return real(row, fmt, text_field, id_field, storage_options, max_pages, **caps)

    monkeypatch.setattr(parse, "parse_file", spy)
    spec = load_job(str(REPO / "jobs" / "papers.yaml"),
                    [f"input.path={d}", "input.max_pages=2", "input.max_file_bytes=1000000",
                     "input.parse_timeout_s=30", "input.parse_memory_mb=2048"])
    with caplog.at_level(logging.WARNING, logger="dlbatch.solver"):
        s = job_workload(spec, sample=8, use_report=False, max_model_len=spec.model.max_model_len)
    assert s.docs_sampled == 2 and not s.failed_docs and not caplog.records
    caps = {"max_file_bytes": 1000000, "parse_timeout_s": 30.0, "parse_memory_mb": 2048, "images": None}
    assert seen == [("good-a.pdf", 2, caps), ("good-b.pdf", 2, caps)]

"""Poison inputs in the parse and prompt stages: a lone surrogate, a parser that segfaults,
hangs or runs out of memory, a file over the byte cap, a crash while building prompts. Each
becomes that document's repair or dead letter; the other documents go on, and a rerun does
not trip on it again (connectors/parse.py, connectors/isolate.py, connectors/repair.py,
dlbatch/prompts/stage.py)."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pyarrow as pa
import pytest

from tests.helpers import parse_faults

REPO = pathlib.Path(__file__).resolve().parent.parent
PAPERS = REPO / "samples" / "papers"
FAULTS = "tests.helpers.parse_faults"
# three good rows, two with lone surrogates in the id, the title and the text
SURROGATE_LINES = [
    json.dumps({"id": "good-1", "title": "Fog", "text": "Coastal fog forms at night. " * 10}),
    '{"id": "bad-\\ud800", "title": "T\\udc00itle", "text": "Lone \\ud800 surrogate in the text. ' + "More words. " * 10 + '"}',
    json.dumps({"id": "good-2", "text": "Birds migrate at night. " * 10}),
    '{"id": "bad-\\udfff", "title": "x", "text": "Another \\udfff one, and a pair \\ud83d\\ude00 that is fine. ' + "Text. " * 10 + '"}',
    json.dumps({"id": "good-3", "text": "Soil moisture limits wheat yield. " * 10}),
]


def _jsonl(tmp_path, lines=SURROGATE_LINES) -> str:
    p = tmp_path / "docs.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(p)


def _stage(tmp_path, monkeypatch, include_text=True):
    from dlbatch.jobspec import load_job
    from tests.helpers.stage import prompt_stage

    spec = load_job(str(REPO / "jobs" / "papers_jsonl.yaml"),
                    [f"output.path={tmp_path / 'out'}", f"output.include_text={str(include_text).lower()}",
                     "model.max_model_len=2048"])
    return prompt_stage(spec)


# ------------------------------------------------------------------ lone surrogates


def test_repair_is_deterministic_and_keeps_ids_distinct():
    from connectors.repair import repair_id, repair_row, repair_text

    assert repair_text("a\ud800b") == "a\ufffdb" and repair_text("ok") == "ok" and repair_text(None) is None
    assert repair_text("\ud83d\ude00") == "\U0001f600"  # a well-formed pair is its character
    assert repair_id("bad-\ud800") == "bad-\\ud800" != repair_id("bad-\udfff") == "bad-\\udfff"
    row = {"doc_id": "x\ud800", "source": "f#line1", "text": "t\udc00", "pages": 3}
    fixed = repair_row(row)
    assert fixed == {"doc_id": "x\\ud800", "source": "f#line1", "text": "t\ufffd", "pages": 3}
    assert repair_row(dict(row)) == fixed and row["doc_id"] == "x\ud800"  # the input is not changed
    clean = {"doc_id": "a", "text": "b"}
    assert repair_row(clean) is clean


def test_jsonl_lone_surrogates_are_repaired_and_the_batch_goes_on(tmp_path, monkeypatch, sample_model):
    """The parse stage's rows and the prompt stage's table encode; every document gets its K
    request rows; the repaired ids are distinct and the same on a second parse (a rerun)."""
    from connectors.parse import parse_file

    url = _jsonl(tmp_path)
    rows = parse_file({"url": url}, "jsonl", "text", "id", None, None)
    assert parse_file({"url": url}, "jsonl", "text", "id", None, None) == rows
    table = pa.Table.from_pylist(rows)  # raised UnicodeEncodeError: surrogates not allowed
    ids = [r["doc_id"] for r in rows]
    assert ids == ["good-1", "bad-\\ud800", "good-2", "bad-\\udfff", "good-3"]
    bad = rows[1]
    assert bad["error"] is None and bad["title"] == "T\ufffditle" and "Lone \ufffd surrogate" in bad["text"]
    assert "a pair \U0001f600 that" in rows[3]["text"]

    out = _stage(tmp_path, monkeypatch)(table)
    assert out.num_rows == 15 and out.column("error").null_count == 15
    assert sorted(set(out.column("doc_id").to_pylist())) == sorted(ids)
    # a rerun's skip set holds the repaired ids: the documents are skipped, not redone
    stage = _stage(tmp_path, monkeypatch)
    stage.skip = {"bad-\\ud800", "bad-\\udfff"}
    assert sorted(set(stage(table).column("doc_id").to_pylist())) == ["good-1", "good-2", "good-3"]


def test_prompt_stage_repairs_rows_that_did_not_come_through_the_parse_stage(tmp_path, monkeypatch, sample_model):
    """A caller that feeds reader rows straight in (the planner, a benchmark) gets the same repair."""
    stage = _stage(tmp_path, monkeypatch)
    doc = {"doc_id": "d\ud800", "source": "s\udc00", "title": "t\ud800", "pages": None, "error": None,
           "error_type": None, "text": "Some text with a lone \ud800 surrogate. " * 5}
    rows = stage.process(doc)
    assert len(rows) == 3 and all(r["error"] is None for r in rows)
    assert {r["doc_id"] for r in rows} == {"d\\ud800"} and rows[0]["source"] == "s\\udc00"
    table = stage([doc])
    assert table.num_rows == 3 and set(table.column("title").to_pylist()) == {"t\ufffd"}


def test_a_crash_while_building_one_documents_prompts_is_its_dead_letter(tmp_path, monkeypatch, sample_model):
    import dlbatch.prompts.stage as stage_mod

    stage = _stage(tmp_path, monkeypatch, include_text=False)
    real = stage_mod.derive_seed

    def derive_seed(seed, doc_id, task):
        if doc_id == "boom":
            raise MemoryError("no memory left for this document")
        return real(seed, doc_id, task)

    monkeypatch.setattr(stage_mod, "derive_seed", derive_seed)
    docs = [{"doc_id": d, "source": f"{d}.txt", "title": None, "pages": None, "error": None, "error_type": None,
             "text": f"Document {d} talks about rivers. " * 5} for d in ("a", "boom", "b")]
    rows = stage(pa.Table.from_pylist(docs)).to_pylist()
    assert [(r["doc_id"], r["task"]) for r in rows if r["error"] is None] == \
        [(d, t) for d in ("a", "b") for t in ("summary", "keywords", "question")]
    (dead,) = [r for r in rows if r["error"] is not None]
    assert (dead["doc_id"], dead["stage"], dead["error_type"], dead["task"]) == ("boom", "prompt", "MemoryError", None)
    assert "no memory left" in dead["error"]


# ------------------------------------------------------------------ the parser process


@pytest.mark.parametrize("fault, error_type, words", [
    ("segfault", "ParseCrashed", "signal 11 (SIGSEGV)"),
    ("kill_self", "ParseCrashed", "signal 11 (SIGSEGV)"),
    ("hang", "ParseTimeout", "no result after 2 s (input.parse_timeout_s)"),
    ("allocate", "ParseMemoryExceeded", "more than 600 MiB of address space (input.parse_memory_mb)"),
    ("raise_value_error", "ValueError", "a parser bug"),
])
def test_parser_process_failure_is_named_and_the_next_call_works(fault, error_type, words):
    from connectors import isolate

    t0 = time.monotonic()
    with pytest.raises(isolate.ParseFailed) as e:
        isolate.run(f"{FAULTS}:{fault}", timeout_s=2, memory_mb=600)
    assert e.value.error_type == error_type and words in e.value.message, e.value
    assert time.monotonic() - t0 < 30
    assert isolate.run(f"{FAULTS}:echo", (1,), {"k": 2}, timeout_s=30, memory_mb=600)["args"] == (1,)


def test_crash_in_a_reused_parser_process_is_retried_in_a_fresh_one():
    from connectors import isolate

    first = isolate.run(f"{FAULTS}:echo", timeout_s=30)["pid"]  # the process has served a file now
    assert isolate.run(f"{FAULTS}:crash_unless_fresh", timeout_s=30) != first  # died there, ran in a new one
    with pytest.raises(isolate.ParseFailed, match="SIGSEGV"):  # in a fresh process it is the file's
        isolate.run(f"{FAULTS}:segfault", timeout_s=30, memory_mb=2048)


def test_parser_process_pipes_above_descriptor_1024():
    """A Ray worker may hold over a thousand descriptors: the pipes' waits must not use select()."""
    import resource

    from connectors import isolate

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert isolate.run(f"{FAULTS}:echo", (7,), timeout_s=30, memory_mb=3000)["args"] == (7,)
        with pytest.raises(isolate.ParseFailed, match="ParseTimeout"):
            isolate.run(f"{FAULTS}:hang", timeout_s=1, memory_mb=3000)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_memory_cap_too_small_for_the_parser_itself_fails_loudly():
    from connectors import isolate

    with pytest.raises(isolate.ParserUnavailable, match="parse_memory_mb=64"):
        isolate.run(f"{FAULTS}:echo", timeout_s=30, memory_mb=64, preload=("pymupdf",))


def _pdf_dir(tmp_path) -> pathlib.Path:
    """Three sample papers under their own names, three (other papers) named to misbehave."""
    d = tmp_path / "pdfs"
    d.mkdir()
    for src, name in [("paged_attention_batch", "good-a"), ("perovskite_solar_stability", "good-b"),
                      ("kv_cache_transfer", "segv"), ("songbird_migration_timing", "hang"),
                      ("urban_heat_islands", "oom"), ("tidal_array_wakes", "good-c")]:
        shutil.copy(PAPERS / f"{src}.pdf", d / f"{name}.pdf")
    return d


def test_pdf_that_crashes_hangs_or_exhausts_memory_is_a_dead_letter_others_parse(tmp_path, monkeypatch):
    import connectors.parse as parse
    from connectors.ids import content_id

    monkeypatch.setattr(parse, "PDF_EXTRACT", f"{FAULTS}:by_name")
    d = _pdf_dir(tmp_path)
    got = {}
    for name in ("good-a", "segv", "good-b", "hang", "oom", "good-c"):
        url = str(d / f"{name}.pdf")
        (row,) = parse.parse_file({"url": url}, "pdf", "text", None, None, None, parse_timeout_s=4,
                                  parse_memory_mb=1024)
        got[name] = row
        assert row["source"] == url
    for name in ("good-a", "good-b", "good-c"):
        assert got[name]["error"] is None and len(got[name]["text"]) > 1000, got[name]
    assert (got["segv"]["error_type"], got["hang"]["error_type"], got["oom"]["error_type"]) == \
        ("ParseCrashed", "ParseTimeout", "ParseMemoryExceeded")
    assert "signal 11 (SIGSEGV)" in got["segv"]["error"]
    assert "4 s (input.parse_timeout_s)" in got["hang"]["error"]
    assert "1024 MiB" in got["oom"]["error"] and "input.parse_memory_mb" in got["oom"]["error"]
    for name in ("segv", "hang", "oom"):  # the dead letter's id: the file's bytes, the same on every run
        assert got[name]["doc_id"] == content_id((d / f"{name}.pdf").read_bytes()) and got[name]["text"] == ""
    # segv.pdf crashed a process that had parsed good-a.pdf: retried once in a fresh one, which
    # crashed too; hang.pdf is not retried (a timeout would cost the timeout again); oom.pdf ran
    # in the fresh process that replaced the hung one: its failure is final at once
    assert parse_faults.calls(d) == {**{f"{n}.pdf": 1 for n in got}, "segv.pdf": 2}


def test_real_pdfs_parse_the_same_in_the_parser_process():
    from connectors.parse import parse_file
    from connectors.pdf import extract_pdf

    for f in sorted(PAPERS.glob("*.pdf"))[:3]:
        (row,) = parse_file({"url": str(f)}, "pdf", "text", None, None, 1)
        direct = extract_pdf(f.read_bytes(), str(f), max_pages=1)
        assert (row["doc_id"], row["text"], row["title"], row["pages"]) == \
            (direct["doc_id"], direct["text"], direct["title"], direct["pages"])
        assert json.loads(row["structure"])["sections"] == direct["sections"]


def test_file_over_the_byte_cap_is_not_read(tmp_path):
    from connectors.parse import parse_file

    pdf = PAPERS / "tidal_array_wakes.pdf"
    size = pdf.stat().st_size
    (row,) = parse_file({"url": str(pdf)}, "pdf", "text", None, None, None, max_file_bytes=size - 1)
    assert row["error_type"] == "FileTooLarge" and f"{size} bytes" in row["error"]
    assert f"input.max_file_bytes={size - 1}" in row["error"]
    (ok,) = parse_file({"url": str(pdf)}, "pdf", "text", None, None, None, max_file_bytes=size)
    assert ok["error"] is None
    txt = tmp_path / "big.txt"
    txt.write_text("words " * 100)
    (row,) = parse_file({"url": str(txt)}, "text", "text", None, None, None, max_file_bytes=100)
    assert row["error_type"] == "FileTooLarge" and "600 bytes" in row["error"]


@pytest.mark.parametrize("message", ["code=2: malloc (417525534 bytes) failed", "code=2: calloc (8 x 6553600 bytes) failed",
                                     "FzErrorSystem: code=2: realloc (10485760 bytes) failed"])
def test_mupdf_allocation_failure_is_memory_not_a_corrupt_pdf(monkeypatch, message):
    import connectors.pdf as pdf

    def fail(*a, **k):
        raise RuntimeError(message)

    monkeypatch.setattr(pdf, "_extract_open", fail)
    with pytest.raises(MemoryError, match=message.split(": ")[-1].split(" (")[0]):
        pdf.extract_pdf((PAPERS / "tidal_array_wakes.pdf").read_bytes(), "x.pdf")


# ------------------------------------------------------------------ the job file


def test_parse_caps_in_the_job_file_defaults_and_validation(tmp_path):
    from connectors import parse
    from dlbatch.jobspec import JobSpecError, fingerprint_fields, load_job

    job = str(REPO / "jobs" / "papers_jsonl.yaml")
    spec = load_job(job, [])
    i = spec.input
    assert (i.max_pages, i.max_file_bytes, i.parse_timeout_s, i.parse_memory_mb) == \
        (1000, parse.MAX_FILE_BYTES, parse.PARSE_TIMEOUT_S, parse.PARSE_MEMORY_MB)
    for key, value in [("parse_timeout_s", "0"), ("parse_memory_mb", "100"), ("max_file_bytes", "0"),
                       ("max_pages", "0")]:
        with pytest.raises(JobSpecError, match=f"input.{key}"):
            load_job(job, [f"input.{key}={value}"])
    none = load_job(job, ["input.max_pages=null", "input.max_file_bytes=null", "input.parse_memory_mb=null"])
    assert none.input.max_file_bytes is None and none.input.parse_memory_mb is None
    # the default page cap resumes outputs written with no cap; other caps never refuse a resume
    assert fingerprint_fields(none) == fingerprint_fields(spec) == \
        fingerprint_fields(load_job(job, ["input.parse_timeout_s=5", "input.max_file_bytes=10"]))
    assert fingerprint_fields(load_job(job, ["input.max_pages=5"]))["input.max_pages"] == 5


# ------------------------------------------------------------------ end to end


@pytest.mark.ray
def test_job_over_jsonl_with_lone_surrogates_runs_and_reruns(ray_local, sample_model, tmp_path):
    """The issue's run: two rows with lone surrogates among three good ones. The job exits with
    every document done; a rerun is a no-op; a rerun after a new row runs only that row."""
    from dlbatch.output.parquet_store import ParquetStore
    from tests.helpers.jobs import output_rows, run_job

    src = _jsonl(tmp_path)
    out = str(tmp_path / "out")
    extra = [f"input.path={src}", "input.id_field=id", "output.include_text=true"]
    rep = run_job("jobs/papers_jsonl.yaml", out, extra)
    rows = output_rows(out)
    assert rep["docs_ok"] == 5 and rep["docs_failed"] == 0 and len(rows) == 15
    assert {r["doc_id"] for r in rows} == {"good-1", "bad-\\ud800", "good-2", "bad-\\udfff", "good-3"}
    assert run_job("jobs/papers_jsonl.yaml", out, extra).get("noop")
    with open(src, "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": "good-4", "text": "Tides move sand. " * 10}) + "\n")
    again = run_job("jobs/papers_jsonl.yaml", out, extra)
    assert (again["docs_ok"], again["docs_failed"]) == (6, 0), again
    rows = output_rows(out)
    assert len(rows) == 18 and len({(r["doc_id"], r["task"]) for r in rows}) == 18
    assert ParquetStore(out).errors().num_rows == 0


@pytest.mark.ray
def test_dlbatch_run_with_a_crashing_and_a_hanging_pdf_parser(raytmp, sample_model, tmp_path):
    """`dlbatch run` over five PDFs, one whose parser segfaults and one whose parser hangs:
    exit 0, three papers done, two dead letters naming the cause; a rerun with one more paper
    parses only that paper (the dead-lettered files are not parsed again)."""
    from dlbatch.output.parquet_store import ParquetStore
    from tests.helpers.jobs import output_rows, ray_env

    d = _pdf_dir(tmp_path)
    (d / "oom.pdf").unlink()
    out = str(tmp_path / "out")
    env = {**ray_env(raytmp), "DLBATCH_TEST_PDF_PARSER": f"{FAULTS}:by_name"}
    sets = [f"output.path={out}", f"input.path={d}", "input.parse_timeout_s=10", "tasks.0.max_tokens=4",
            "tasks.1.max_tokens=4", "tasks.2.max_tokens=4", "model.max_model_len=1024"]
    cmd = [sys.executable, "-m", "dlbatch.cli", "run", "jobs/papers.yaml", "--no-progress"]
    for s in sets:
        cmd += ["--set", s]

    def run():
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r

    first = run()
    done = {r["source"] for r in output_rows(out)}
    assert {os.path.basename(s) for s in done} == {"good-a.pdf", "good-b.pdf", "good-c.pdf"}
    # without -v, Ray's own notices (deprecations, execution plans, Ray Data's progress blocks) stay out
    noise = [x for x in first.stderr.splitlines() if "logging_progress.py" in x or "streaming_executor.py" in x
             or "deprecated" in x]
    assert not noise, noise
    errs = {os.path.basename(e["source"]): e for e in ParquetStore(out).errors().to_pylist()}
    assert set(errs) == {"segv.pdf", "hang.pdf"}
    assert errs["segv.pdf"]["error_type"] == "ParseCrashed" and "SIGSEGV" in errs["segv.pdf"]["error"]
    assert errs["hang.pdf"]["error_type"] == "ParseTimeout" and "10 s" in errs["hang.pdf"]["error"]
    assert parse_faults.calls(d) == {f"{n}.pdf": 1 for n in ("good-a", "good-b", "good-c", "segv", "hang")}

    shutil.copy(PAPERS / "rainfed_wheat_soil_moisture.pdf", d / "good-d.pdf")
    run()
    assert parse_faults.calls(d) == {f"{n}.pdf": 1 for n in ("good-a", "good-b", "good-c", "segv", "hang", "good-d")}
    assert len(output_rows(out)) == 12 and ParquetStore(out).errors().num_rows == 2

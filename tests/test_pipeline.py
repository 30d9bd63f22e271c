"""`dlbatch run` end to end on the local Ray of the test session."""
from __future__ import annotations

import json
import os

import pytest

from dlbatch.jobspec import load_job

pytestmark = pytest.mark.ray

SHORT = ["tasks.0.max_tokens=8", "tasks.1.max_tokens=6", "tasks.2.max_tokens=6", "model.max_model_len=2048"]


def _rows(out):
    from dlbatch.output.parquet_store import ParquetStore

    return ParquetStore(out).results().to_pylist()


def _run(job, out, extra=(), **kw):
    from dlbatch.driver.runner import JobRunner

    spec = load_job(job, [f"output.path={out}", *SHORT, *extra])
    return JobRunner(spec, progress=False, **kw).run()


def test_sample_job_pd_then_noop_and_status(ray_local, sample_model, tmp_path):
    out = str(tmp_path / "out")
    rep = _run("jobs/papers_pd.yaml", out, ["input.limit=2"])
    rows = _rows(out)
    assert len(rows) == 6 and rep["rows_written"] == 6 and rep["docs_ok"] == 2
    assert {r["task"] for r in rows} == {"summary", "keywords", "question"}
    assert all(r["output"] and r["prompt_tokens"] > 500 and r["model"] == "smollm2-135m-instruct" for r in rows)
    # the three tasks of a paper share its prefix: computed about once
    assert rep["prefill_tokens_computed"] <= (1 / 3 + 0.1) * rep["prompt_tokens"]
    assert set(rep["pools"]) == {"prefill", "decode"}
    assert rep["layout"]["mode"] == "pd" and rep["layout"]["chosen_by"] == "job"  # the pools the job names
    assert os.path.exists(os.path.join(out, "_report.html"))
    # the report says when tokens were generated and where the time before the first one went
    gen, st = rep["generation"], rep["startup"]
    assert gen["requests"] == 6 and gen["driver_clock_requests"] == 0  # one machine: the workers' clocks hold
    assert sum(gen["decode_tokens"]) == pytest.approx(rep["output_tokens"], abs=0.1)
    assert 0 < st["first_token_s"] <= gen["last_done_s"] <= rep["wall_s"]
    assert {"ray_start", "workers_ready", "model_load", "data_first_batch", "generation"} <= set(st["phases_s"])
    again = _run("jobs/papers_pd.yaml", out, ["input.limit=2"])
    assert again.get("noop") and len(_rows(out)) == 6
    from dlbatch.output.status import job_status

    st = job_status(load_job("jobs/papers_pd.yaml", [f"output.path={out}", *SHORT, "input.limit=2"]))
    assert (st["docs_done"], st["docs_failed"], st["docs_pending"], st["rows"]) == (2, 0, 0, 6)


def test_colocated_equals_pd_greedy_through_every_transport(ray_local, sample_model, tmp_path):
    """The sample job's PD pools (prefill worker -> KV -> decode worker) give the colocated
    outputs, through each KV transport that can run here."""
    from dlbatch.transfer.choose import get_transport
    from dlbatch.transfer.errors import TransportUnavailable

    key = lambda r: (r["doc_id"], r["task"])  # noqa: E731
    co = str(tmp_path / "co")
    rep = _run("jobs/papers.yaml", co, ["input.limit=1", "model.dtype=float32"])
    # no pools named, one chip type here: the solver's layout is one colocated pool, unmeasured
    assert rep["layout"]["mode"] == "colocated" and rep["layout"]["chosen_by"] == "solver"
    assert set(rep["pools"]) == {"colocated"} and "one chip type" in rep["layout"]["reason"]
    ref = {key(r): r["output"] for r in _rows(co)}
    assert len(ref) == 3
    for via in ("object_store", "shm", "rdt", "dlslime"):
        try:
            get_transport(via, same_node=True, device="cpu")
        except TransportUnavailable:
            continue  # e.g. dlslime not installed: tests/test_transfer_dlslime.py says why
        out = str(tmp_path / via)
        rep = _run("jobs/papers_pd.yaml", out, ["input.limit=1", "model.dtype=float32", f"cluster.kv_transport={via}"])
        assert set(rep["pools"]) == {"prefill", "decode"} and rep["kv_transport"] == via
        assert {key(r): r["output"] for r in _rows(out)} == ref, via


def test_jsonl_input_with_bad_rows_dead_lettered(ray_local, sample_model, tmp_path):
    from dlbatch.output.parquet_store import ParquetStore

    src = tmp_path / "docs.jsonl"
    good = "Solar cells convert light into electricity. " * 20
    lines = [json.dumps({"id": "a", "text": good}), "{not json", json.dumps({"id": "b"}),
             json.dumps({"id": "c", "text": "Birds migrate at night. " * 30}), json.dumps({"id": "d", "text": "   "})]
    src.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "out")
    rep = _run("jobs/papers_jsonl.yaml", out, [f"input.path={src}", "input.id_field=id",
                                               "max_dead_letter_fraction=1"])  # mostly bad input, on purpose
    rows = _rows(out)
    assert sorted({r["doc_id"] for r in rows}) == ["a", "c"] and len(rows) == 6
    errs = ParquetStore(out).errors().to_pylist()
    assert len(errs) == 3 and rep["docs_failed"] == 3
    assert {e["error_type"] for e in errs} >= {"MissingField"}
    assert all(e["error"] for e in errs)


def test_bad_pdfs_dead_lettered_good_ones_written(ray_local, sample_model, tmp_path):
    from dlbatch.output.parquet_store import ParquetStore
    from tests.helpers.bad_inputs import build_bad_corpus

    corpus = build_bad_corpus(tmp_path / "corpus", oversized_pages=8)
    out = str(tmp_path / "out")
    rep = _run("jobs/papers.yaml", out, [f"input.path={corpus.pdf_dir}", "input.max_pages=2",
                                         "max_dead_letter_fraction=1"])  # mostly bad input, on purpose
    rows = _rows(out)
    good = {k for k, v in corpus.pdf_expected.items() if v is None}
    assert {os.path.basename(r["source"]) for r in rows} == good and len(rows) == 3 * len(good)
    errs = ParquetStore(out).errors().to_pylist()
    want = {k: v for k, v in corpus.pdf_expected.items() if v is not None}
    got = {os.path.basename(e["source"]): e["error_type"] for e in errs}
    assert got == want
    assert all(e["error"] and e["stage"] == "parse" for e in errs)
    assert rep["docs_failed"] == len(want)


def test_long_inputs_truncate_and_skip(ray_local, sample_model, tmp_path):
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"id": "long", "text": "word " * 3000}) + "\n"
                   + json.dumps({"id": "short", "text": "short text about cells."}) + "\n")
    out = str(tmp_path / "t")
    _run("jobs/papers_jsonl.yaml", out, [f"input.path={src}", "input.id_field=id", "model.max_model_len=512"])
    rows = {(r["doc_id"], r["task"]): r for r in _rows(out)}
    assert rows[("long", "summary")]["truncated"] and not rows[("short", "summary")]["truncated"]
    assert all(r["prompt_tokens"] + 8 <= 512 for r in rows.values())
    out2 = str(tmp_path / "s")
    _run("jobs/papers_jsonl.yaml", out2, [f"input.path={src}", "input.id_field=id", "model.max_model_len=512",
                                          "long_inputs=skip"])
    from dlbatch.output.parquet_store import ParquetStore

    assert {r["doc_id"] for r in _rows(out2)} == {"short"}
    assert [e["error_type"] for e in ParquetStore(out2).errors().to_pylist()] == ["LongInput"]


def test_invalid_job_file_exit_code(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\npipeline: papers\nmodel: {dtype: fp8}\n")
    r = subprocess.run([sys.executable, "-m", "dlbatch.cli", "run", str(bad)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "model.dtype" in r.stderr

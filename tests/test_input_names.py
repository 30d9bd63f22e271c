"""Input files whose names are not UTF-8 (bytes a Linux file name may hold, which Python
decodes with ``surrogateescape``): they are processed like any other file, listed and named
in the output with each undecodable byte escaped (``\\udcff``), the same on every run, so a
rerun finds them done (connectors/listing.py, connectors/repair.py)."""
from __future__ import annotations

import json
import os
import pathlib
import shutil

import pyarrow as pa
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PAPERS = REPO / "samples" / "papers"
BAD = b"bad\xff\xfe"  # not UTF-8


def _name(folder: pathlib.Path, raw: bytes) -> str:
    """The str Python gives for a file name of these bytes in ``folder``."""
    return os.fsdecode(os.fsencode(str(folder)) + b"/" + raw)


def _escaped(folder: pathlib.Path, raw: bytes) -> str:
    return str(folder) + "/" + raw.decode("utf-8", "surrogateescape").encode("utf-8", "backslashreplace").decode()


def _texts(tmp_path) -> pathlib.Path:
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("Coastal fog forms at night over cold water. " * 8)
    with open(_name(d, BAD + b".txt"), "w") as f:
        f.write("Birds migrate at night and rest by day. " * 8)
    (d / "c.txt").write_text("Soil moisture limits the yield of rainfed wheat. " * 8)
    return d


def test_a_name_that_is_not_utf8_is_listed_escaped_and_parsed(tmp_path):
    from connectors.listing import inputs_fingerprint, limited_reads, list_inputs
    from connectors.parse import parse_file
    from connectors.repair import unescape_name

    d = _texts(tmp_path)
    files = list_inputs(str(d), "text")
    bad = _escaped(d, BAD + b".txt")
    assert files == [str(d / "a.txt"), bad, str(d / "c.txt")] and bad.endswith("bad\\udcff\\udcfe.txt")
    assert os.fsencode(unescape_name(bad)) == os.fsencode(str(d)) + b"/" + BAD + b".txt"
    assert inputs_fingerprint(files) == inputs_fingerprint(list_inputs(str(d), "text"))  # raised UnicodeEncodeError
    assert limited_reads(files, "text", 2) == [(files[0], 1), (bad, 1)]
    pa.table({"url": files})  # what the pipeline hands Ray Data
    rows = [r for f in files for r in parse_file({"url": f}, "text", "text", None, None, None)]
    assert [r["source"] for r in rows] == files and all(r["error"] is None for r in rows)
    assert "Birds migrate" in rows[1]["text"]
    pa.Table.from_pylist(rows)


def test_pdf_and_jsonl_files_with_such_names(tmp_path):
    from connectors.listing import list_inputs
    from connectors.parse import parse_file

    d = tmp_path / "pdfs"
    d.mkdir()
    shutil.copy(PAPERS / "tidal_array_wakes.pdf", _name(d, BAD + b".pdf"))
    (pdf,) = list_inputs(str(d), "pdf")
    (row,) = parse_file({"url": pdf}, "pdf", "text", None, None, None)
    assert row["error"] is None and row["source"] == pdf and len(row["text"]) > 1000

    j = tmp_path / "records"
    j.mkdir()
    with open(_name(j, BAD + b".jsonl"), "w") as f:
        f.write(json.dumps({"id": "r1", "text": "Tides move sand."}) + "\n")
        f.write(json.dumps({"id": "r2", "text": "Wind moves dunes."}) + "\n")
    (url,) = list_inputs(str(j), "jsonl")
    rows = parse_file({"url": url, "max_rows": None}, "jsonl", "text", "id", None, None)
    assert [(r["doc_id"], r["source"]) for r in rows] == [("r1", f"{url}#line1"), ("r2", f"{url}#line2")]


def test_a_name_that_spells_an_escape_literally_still_opens(tmp_path):
    """A valid UTF-8 name holding the text ``\\udcff`` is opened as itself."""
    from connectors.listing import list_inputs
    from connectors.parse import parse_file

    d = tmp_path / "lit"
    d.mkdir()
    (d / "lit\\udcff.txt").write_text("A name with a backslash in it. " * 5)
    (url,) = list_inputs(str(d), "text")
    assert url == str(d / "lit\\udcff.txt")
    (row,) = parse_file({"url": url}, "text", "text", None, None, None)
    assert row["error"] is None and row["source"] == url


@pytest.mark.ray
def test_job_over_a_folder_with_such_a_name_runs_and_reruns(ray_local, sample_model, tmp_path):
    """The job processes the file; the output names it as the listing does, so the runner
    counts it done; a rerun with one more file runs that file only."""
    from dlbatch.output.parquet_store import ParquetStore
    from tests.helpers.jobs import output_rows, run_job

    d = _texts(tmp_path)
    (d / "c.txt").unlink()
    out = str(tmp_path / "out")
    extra = [f"input.path={d}", "input.format=text"]
    rep = run_job("jobs/papers.yaml", out, extra)
    rows = output_rows(out)
    bad = _escaped(d, BAD + b".txt")
    assert (rep["docs_ok"], rep["docs_failed"]) == (2, 0) and len(rows) == 6, rep
    assert {r["source"] for r in rows} == {str(d / "a.txt"), bad}
    assert {str(d / "a.txt"), bad} <= ParquetStore(out).progress()["sources_done"]

    (d / "c.txt").write_text("Soil moisture limits the yield of rainfed wheat. " * 8)
    again = run_job("jobs/papers.yaml", out, extra)
    rows = output_rows(out)
    assert (again["docs_ok"], again["docs_failed"]) == (3, 0), again
    assert len(rows) == 9 and len({(r["doc_id"], r["task"]) for r in rows}) == 9
    assert ParquetStore(out).errors().num_rows == 0

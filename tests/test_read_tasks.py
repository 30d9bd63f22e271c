"""Read tasks (connectors/read_tasks.py): an input cut into bounded parts whose rows, read in
order, are the whole input's rows (sources with the file's own line and row numbers, ids,
error rows), ending at input.limit's row; small and compressed files read whole; parts alone
in their blocks, small files packed."""
from __future__ import annotations

import gzip
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.part import WHOLE, Part
from connectors.listing import limited_reads, list_inputs, read_document_file
from connectors.parse import parse_file
from connectors.read_tasks import ReadTask, blocks, plan_read_tasks, task_table
from connectors.splits import TaskSizes


def _messy_jsonl(path, n=400, seed=0, trailing_newline=True):
    """Records with blank and whitespace-only lines, CRLF endings, malformed lines, a line not
    UTF-8, and lines far longer than the parts the tests cut."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        r = rng.random()
        if r < 0.08:
            lines.append(b"")
        elif r < 0.12:
            lines.append(b"  \t\r")
        elif r < 0.16:
            lines.append(b"{not json")
        elif r < 0.17:
            lines.append(b'{"text": "caf\xe9"}')
        else:
            text = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.choice([1, 5, 40, 400])))
            end = b"\r" if r < 0.25 else b""
            lines.append(json.dumps({"id": f"d{i}", "text": text}).encode() + end)
    path.write_bytes(b"\n".join(lines) + (b"\n" if trailing_newline else b""))
    return str(path)


def _key(rows):
    return [(r["source"], r["doc_id"], r["error_type"], r["text"]) for r in rows]


def _parse(tasks, fmt="jsonl", id_field=None):
    return [r for t in tasks for r in parse_file(t.row(), fmt, "text", id_field, None, None)]


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_jsonl_parts_give_the_whole_files_rows_with_its_line_numbers(tmp_path, trailing_newline):
    url = _messy_jsonl(tmp_path / "a.jsonl", trailing_newline=trailing_newline)
    whole = _parse([ReadTask(url)])
    assert len(whole) > 300 and any(r["error_type"] == "MalformedJSON" for r in whole)
    size = (tmp_path / "a.jsonl").stat().st_size
    longest = max(len(x) + 1 for x in (tmp_path / "a.jsonl").read_bytes().split(b"\n"))
    for target, first, threads in ((64, 1, 3), (500, 100, 2), (3000, None, 16), (size // 2, 1000, 1)):
        tasks = plan_read_tasks([(url, None)], "jsonl", sizes=TaskSizes(target=target, threads=threads),
                                first_bytes=first or target)
        assert len(tasks) > 1 and tasks[0].part.start == 0 and tasks[0].part.line == 1 and tasks[-1].part.stop is None
        assert all(a.part.stop == b.part.start for a, b in zip(tasks, tasks[1:]))  # they cover the file once, in order
        assert all(t.nbytes <= target + longest for t in tasks)  # bounded: a part, plus one line at most
        assert _key(_parse(tasks)) == _key(whole), (target, first)
    one = tasks[1]  # one part alone, as a prompt actor reads it
    assert _key(read_document_file(url, "jsonl", part=one.part)) == \
        _key([r for r in whole if one.part.line <= int(r["source"].rsplit("#line", 1)[1]) < tasks[2].part.line])


def test_a_row_cap_ends_the_parts_at_the_capped_row(tmp_path):
    url = _messy_jsonl(tmp_path / "a.jsonl", seed=1)
    whole = _parse([ReadTask(url)])
    for n in (1, 2, 57, len(whole), len(whole) + 10):
        for target in (50, 700):
            tasks = plan_read_tasks([(url, n)], "jsonl", sizes=TaskSizes(target=target), first_bytes=10)
            assert all(t.max_rows is None and t.part.stop is not None for t in tasks)  # the cut is in the parts
            assert _key(_parse(tasks)) == _key(whole[:n]), (n, target)
    small = plan_read_tasks([(url, 3)], "jsonl", sizes=TaskSizes(target=1 << 20))  # one part's worth: read whole
    assert small == [ReadTask(url, max_rows=3, nbytes=(tmp_path / "a.jsonl").stat().st_size)]
    assert _key(_parse(small)) == _key(whole[:3])


def test_input_limit_over_split_files_takes_the_first_rows_in_order(tmp_path):
    for name, seed in (("b.jsonl", 2), ("a.jsonl", 3)):
        _messy_jsonl(tmp_path / name, n=150, seed=seed)
    files = list_inputs(str(tmp_path), "jsonl")
    whole = _parse([ReadTask(f) for f in files])
    reads = limited_reads(files, "jsonl", 180)
    tasks = plan_read_tasks(reads, "jsonl", sizes=TaskSizes(target=300), first_bytes=40)
    assert {t.url for t in tasks} == set(files) and len(tasks) > 4
    assert _key(_parse(tasks)) == _key(whole[:180])


def test_small_and_compressed_files_are_read_whole(tmp_path):
    big = _messy_jsonl(tmp_path / "big.jsonl", n=300)
    gz = tmp_path / "big.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "big.jsonl").read_bytes()))
    (tmp_path / "small.jsonl").write_text(json.dumps({"text": "tiny"}) + "\n")
    sizes = TaskSizes(target=100)
    assert [(t.url, t.part) for t in plan_read_tasks([(str(gz), None)], "jsonl", sizes=sizes)] == [(str(gz), WHOLE)]
    assert plan_read_tasks([(str(tmp_path / "small.jsonl"), None)], "jsonl", sizes=sizes, first_bytes=100)[0].part \
        == WHOLE
    assert len(plan_read_tasks([(big, None)], "jsonl", sizes=sizes)) > 10
    with pytest.raises(ValueError, match="read whole"):
        list(read_document_file(str(gz), "jsonl", part=Part(10, 20, 2)))
    with pytest.raises(ValueError, match="pdf inputs are read whole"):
        list(read_document_file(str(tmp_path / "x.pdf"), "pdf", part=Part(0, 5)))


def test_parquet_parts_are_runs_of_whole_row_groups(tmp_path):
    n = 1000
    table = pa.table({"id": [f"p{i}" for i in range(n)], "text": [f"paper {i} " + "x" * (i % 50) for i in range(n)],
                      "year": list(range(n))})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=64)
    url = str(tmp_path / "a.parquet")
    whole = _parse([ReadTask(url)], "parquet", "id")
    groups = [pq.ParquetFile(url).metadata.row_group(g).num_rows for g in range(16)]
    bounds = {sum(groups[:g]) for g in range(17)}
    tasks = plan_read_tasks([(url, None)], "parquet", sizes=TaskSizes(target=10_000), first_bytes=1)
    assert len(tasks) > 3 and tasks[-1].part.stop is None
    assert all(t.part.start in bounds for t in tasks)  # cut between row groups only
    assert _key(_parse(tasks, "parquet", "id")) == _key(whole)
    assert [r["source"].rsplit("#", 1)[1] for r in whole[:2]] == ["row0", "row1"]
    rows = _parse(tasks[1:2], "parquet", "id")  # a part's rows keep the file's row numbers and columns
    assert rows[0]["source"] == f"{url}#row{tasks[1].part.start}" and rows[0]["columns"] is not None
    capped = plan_read_tasks([(url, 300)], "parquet", sizes=TaskSizes(target=10_000), first_bytes=1)
    assert capped[-1].part.stop == 300 and _key(_parse(capped, "parquet", "id")) == _key(whole[:300])
    (tmp_path / "bad.parquet").write_bytes(b"not parquet" * 100)
    (bad,) = plan_read_tasks([(str(tmp_path / "bad.parquet"), 1)], "parquet", sizes=TaskSizes(target=10))
    assert bad.part == WHOLE and [r["error_type"] for r in _parse([bad], "parquet")] == ["CorruptFile"]


def test_saved_dataset_parts_count_through_its_splits(tmp_path):
    import datasets

    texts = {s: [f"{s} document {i} " + "y" * i for i in range(n)] for s, n in (("train", 40), ("test", 25))}
    dd = datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": t, "k": list(range(len(t)))})
                               for s, t in texts.items()})
    dd.save_to_disk(str(tmp_path / "dd"))
    dd["train"].save_to_disk(str(tmp_path / "one"))
    for name in ("dd", "one"):
        (url,) = list_inputs(str(tmp_path / name), "hf")
        whole = _parse([ReadTask(url)], "hf")
        tasks = plan_read_tasks([(url, None)], "hf", sizes=TaskSizes(target=200), first_bytes=50)
        assert len(tasks) > 3 and all(a.part.stop == b.part.start for a, b in zip(tasks, tasks[1:]))
        assert _key(_parse(tasks, "hf")) == _key(whole), name
        capped = plan_read_tasks([(url, 50)], "hf", sizes=TaskSizes(target=200), first_bytes=50)
        assert _key(_parse(capped, "hf")) == _key(whole[:50])
        if name == "dd":  # the splits one after another, sorted, each numbered from 0
            names = [r["source"].rsplit("#", 1)[1] for r in _parse(capped, "hf")]
            assert names[:2] == ["test/row0", "test/row1"] and names[25:27] == ["train/row0", "train/row1"]
    (tmp_path / "f.jsonl").write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(50)))
    (datafile,) = plan_read_tasks([(str(tmp_path / "f.jsonl"), None)], "hf", sizes=TaskSizes(target=10))
    assert datafile.part == WHOLE  # a data file read through datasets is read whole


def test_blocks_keep_parts_alone_and_pack_small_files():
    parts = [ReadTask("big", Part(s, s + 10), nbytes=10) for s in (0, 10, 20)]
    small = [ReadTask(f"f{i}", nbytes=3) for i in range(10)]
    got = blocks(small[:4] + parts + small[4:], target=7, max_blocks=4)  # budget min(7, 30 / 4)
    assert [[t.url for t in b] for b in got][:3] == [["f0", "f1"], ["f2", "f3"], ["big"]]
    assert all(len(b) == 1 for b in got if b[0].url == "big") and sum(len(b) for b in got) == 13
    assert len(blocks(small, target=1000, max_blocks=64)) == 10  # a few files still stream one by one
    assert len(blocks([ReadTask(f"f{i}", nbytes=1) for i in range(1000)], target=1 << 20, max_blocks=64)) <= 64
    pdfs = [ReadTask(f"{i}.pdf") for i in range(4)]  # sizes unknown: by count
    assert blocks(pdfs) == [[p] for p in pdfs]
    assert blocks([]) == []


def test_task_rows_round_trip_and_sizes():
    t = ReadTask("s3://b/a.jsonl", Part(100, 250, 7), max_rows=None, nbytes=150)
    assert ReadTask.of(task_table([t]).to_pylist()[0]) == ReadTask("s3://b/a.jsonl", Part(100, 250, 7))
    assert ReadTask.of({"url": "x"}) == ReadTask("x") and ReadTask.of({"url": "x", "max_rows": 3}).max_rows == 3
    assert t.source == "s3://b/a.jsonl#part100-250" and ReadTask("x").source == "x"
    sizes = TaskSizes(target=16, first=2)
    assert sizes.bounds(40) == [2, 6, 14, 30] and sizes.bounds(2) == [] and TaskSizes(target=5).bounds(11) == [5, 10]
    with pytest.raises(ValueError, match="start <= stop"):
        Part(5, 3)
    with pytest.raises(ValueError, match=">= 1"):
        TaskSizes(target=0)


@pytest.mark.slow
@pytest.mark.ray
def test_a_job_over_one_large_file_resumes_after_kill9_exactly_once(raytmp, tmp_path):
    """`dlbatch run` over one JSONL file of 6,000 documents (about 6 MiB: parts of 1, 2 and
    3 MiB at the default sizes) on the bench's tiny model, killed -9 with the group and its Ray
    once some documents are committed, then run again: every document once, its source the
    line it is on."""
    import subprocess
    import sys
    import time

    from dlbatch.bench.scale import write_docs, write_job
    from dlbatch.bench.tiny_model import make_tiny_model
    from tests.helpers.jobs import REPO, committed_parts, kill_group_and_ray, output_rows, ray_env

    n = 6000
    src = write_docs(str(tmp_path / "docs.jsonl"), n, 150)
    assert len(plan_read_tasks([(src, None)], "jsonl")) >= 3
    out = str(tmp_path / "out")
    job = write_job(str(tmp_path / "job.yaml"), src, out, make_tiny_model(str(tmp_path / "model")), 1)
    cmd = [sys.executable, "-m", "dlbatch.cli", "run", job, "--no-progress", "--commit-docs", "64",
           "--commit-seconds", "0"]
    with open(tmp_path / "run1.log", "wb") as logf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=ray_env(raytmp), stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not committed_parts(out):
            time.sleep(0.05)
        kill_group_and_ray(proc, raytmp)
    first = output_rows(out)
    assert 0 < len(first) < n, (len(first), (tmp_path / "run1.log").read_text()[-2000:])
    again = subprocess.run(cmd, cwd=REPO, env=ray_env(raytmp), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = output_rows(out)
    assert sorted(r["doc_id"] for r in rows) == [f"d{i:07d}" for i in range(n)]  # each once
    assert all(r["source"] == f"{src}#line{int(r['doc_id'][1:]) + 1}" for r in rows)
    assert {(r["doc_id"], r["output"]) for r in first} <= {(r["doc_id"], r["output"]) for r in rows}

"""`dlbatch bench status`: `dlbatch status` and the resume of a job with N committed documents.

Builds a synthetic output of N documents (K tasks each, outputs of realistic length)
through the real commit path (`ParquetStore.commit`, parts of --part-docs
documents, each with its index file), for a JSONL input of the same documents. Then times,
medians of --repeat runs:
  baseline  the full read every committed part whole, serially, output text included (what
            resume and status did before the index), on the uncompacted output;
  index     `ParquetStore.progress` from the index files (uncompacted, then compacted);
  status    `dlbatch status` (job_status: progress + counting the input documents);
  resume    `JobRunner.run()` up to the point where worker pools would start (listing,
            input fingerprint, manifest check, progress);
and the floor: reading the index files' bytes without parsing them (what the disk and the
page cache allow), next to the compaction's own time.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

from dlbatch.bench.common import fmt, median, ratio, table, time_repeats


def add_arguments(p) -> None:
    p.add_argument("--docs", type=int, default=100_000, help="committed documents (default 100000)")
    p.add_argument("--part-docs", type=int, default=16, help="documents per committed part (default 16)")
    p.add_argument("--output-chars", type=int, default=600, help="characters per output (default 600)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per figure (median; default 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2000 documents, one repeat")
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed at the end)")


def _naive_progress(store) -> int:
    """The pre-index resume read: every committed part whole, serially, text included."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from connectors.sink import committed_paths, find_all

    rows = 0
    docs: dict[str, set] = {}
    for p in committed_paths(store.files.fs, store.files.root, find_all(store.files.fs, store.files.root)):
        with pq.ParquetFile(pa.BufferReader(store.files.fs.cat_file(p))) as pf:
            for r in pf.read().to_pylist():
                docs.setdefault(r["doc_id"], set()).add(r["task"])
                rows += 1
    return rows


def _raw_index_read(store) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from connectors.sink import find_all

    idx = [f for f in find_all(store.files.fs, store.files.root) if "/_index/part-" in f]
    with ThreadPoolExecutor(16) as ex:
        return sum(len(b) for b in ex.map(store.files.fs.cat_file, idx))


def _build(work: str, n: int, part_docs: int, chars: int, tasks: list[str]) -> tuple[str, str, float]:
    from dlbatch.output.parquet_store import ParquetStore

    src = os.path.join(work, "docs.jsonl")
    with open(src, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"d{i:07d}", "text": f"Document {i}. " + "lorem ipsum " * 20}) + "\n")
    out = os.path.join(work, "out")
    store = ParquetStore(out)
    t0 = time.perf_counter()
    text = ("word " * (chars // 5 + 1))[:chars]
    for start in range(0, n, part_docs):
        rows = [{"doc_id": f"d{i:07d}", "source": src, "task": t, "output": f"{i} {text}", "prompt_tokens": 200,
                 "output_tokens": chars // 4, "finish_reason": "length", "truncated": False, "model": "m",
                 "ttft_s": 0.1, "latency_s": 1.0} for i in range(start, min(n, start + part_docs)) for t in tasks]
        store.commit(rows, [], include_text=False)
    return src, out, time.perf_counter() - t0


def _resume_seconds(spec, docs: int) -> float:
    """JobRunner.run() up to the start of the worker pools."""
    from dlbatch.driver.runner import JobRunner

    class _Reached(Exception):
        pass

    class _Probe(JobRunner):
        def _run_pools(self, store, config, files, skip_docs, report, docs_total_hint):
            self.probe = {"skip": len(skip_docs), "t": time.perf_counter()}
            raise _Reached  # where the worker pools would start: stop here

    r = _Probe(spec, progress=False)
    t0 = time.perf_counter()
    try:
        r.run()
    except _Reached:
        pass
    assert r.probe["skip"] == docs, r.probe
    return r.probe["t"] - t0


def run(args) -> int:
    from dlbatch.bench.common import finish_bench, machine_info
    from dlbatch.output.parquet_store import ParquetStore
    from dlbatch.output.status import job_status
    from dlbatch.jobspec import load_job

    if args.quick:
        args.docs, args.repeat = 2000, 1
    work = args.dir or tempfile.mkdtemp(prefix="dlbatch-bench-status-")
    os.makedirs(work, exist_ok=True)
    try:
        spec0 = load_job("jobs/papers_jsonl.yaml", [])
        tasks = [t.name for t in spec0.tasks]
        src, out, build_s = _build(work, args.docs, args.part_docs, args.output_chars, tasks)
        spec = load_job("jobs/papers_jsonl.yaml", [f"input.path={src}", "input.id_field=id", f"output.path={out}"])
        store = ParquetStore(out)
        n_parts = len([f for f in os.listdir(out) if f.startswith("part-")])
        res = {"machine": machine_info(), "docs": args.docs, "tasks": len(tasks), "parts": n_parts,
               "build_s": build_s, "repeat": args.repeat}
        print(f"built {args.docs} documents x {len(tasks)} tasks in {n_parts} parts ({build_s:.1f} s)", flush=True)
        rows = args.docs * len(tasks)
        assert _naive_progress(store) == rows and store.progress()["rows"] == rows
        res["baseline_s"] = median(time_repeats(lambda: _naive_progress(store), args.repeat, warmup=0))
        res["index_uncompacted_s"] = median(time_repeats(lambda: store.progress(), args.repeat, warmup=0))
        t0 = time.perf_counter()
        comp = store.compact(min_parts=0)
        res["compact_s"] = time.perf_counter() - t0
        res["parts_after_compaction"] = len([f for f in os.listdir(out) if f.startswith("part-")])
        res["compaction"] = comp
        assert store.progress()["rows"] == rows and store.progress()["duplicates"] == 0
        res["index_compacted_s"] = median(time_repeats(lambda: store.progress(), args.repeat, warmup=0))
        res["baseline_compacted_s"] = median(time_repeats(lambda: _naive_progress(store), args.repeat, warmup=0))
        res["floor_raw_index_read_s"] = median(time_repeats(lambda: _raw_index_read(store), args.repeat, warmup=0))
        st = job_status(spec)
        assert st["docs_done"] == args.docs and st["docs_pending"] == 0, st
        res["status_s"] = median(time_repeats(lambda: job_status(spec), args.repeat, warmup=0))
        res["resume_s"] = median([_resume_seconds(spec, args.docs) for _ in range(args.repeat)])
        res["speedup_status"] = ratio(res["baseline_s"], res["index_compacted_s"])
        return finish_bench(res, _render, args.json)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def _render(r: dict) -> str:
    rows = [
        ["baseline: full read of every part (uncompacted)", fmt(r["baseline_s"], 2), "1.0x"],
        ["index files (uncompacted)", fmt(r["index_uncompacted_s"], 2),
         f"{fmt(ratio(r['baseline_s'], r['index_uncompacted_s']))}x"],
        ["index files (compacted)", fmt(r["index_compacted_s"], 3),
         f"{fmt(ratio(r['baseline_s'], r['index_compacted_s']))}x"],
        ["full read of every part (compacted)", fmt(r["baseline_compacted_s"], 2),
         f"{fmt(ratio(r['baseline_s'], r['baseline_compacted_s']))}x"],
        ["dlbatch status (compacted; counts the input too)", fmt(r["status_s"], 2), ""],
        ["resume: run() until the pools start (compacted)", fmt(r["resume_s"], 2), ""],
        ["floor: raw bytes of the index files, no parse", fmt(r["floor_raw_index_read_s"], 4), ""],
        ["compaction itself (once)", fmt(r["compact_s"], 1), ""],
    ]
    return table(["what (seconds, median)", "s", "vs baseline"], rows,
                 title=f"{r['docs']} documents x {r['tasks']} tasks committed in {r['parts']} parts "
                       f"-> {r['parts_after_compaction']} after compaction")

"""`dlbatch bench pipeline --long`: the long sample papers (longer than the context) through
`dlbatch run` with `long_inputs: chunk` against `long_inputs: truncate`, the answer every
other engine gives (keep the head), measured in the same run on the same papers.

Printed per policy: wall time, prompt tokens the model computed (prefill, after prefix
hits), output tokens, and per document the share of its tokens that reached the model
(`kept_tokens / doc_tokens`: the head's share under truncate, all of it under chunk); the
machine's matmul peak and copy bandwidth measured in the same run are the limits.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile

from dlbatch.bench.common import finish_bench, job_chips, machine_info, ratio, start_bench_ray, table

POLICIES = ("truncate", "chunk")


def long_papers(max_model_len: int, n: int) -> list[str]:
    """The sample PDFs longer than `max_model_len` tokens, longest last (at most n)."""
    from connectors import read_document_file
    from dlbatch.engine.loader import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    sized = []
    for path in sorted(glob.glob(os.path.join("samples", "papers", "*.pdf"))):
        doc = next(iter(read_document_file(path, "pdf")))
        n_tokens = len(tok.encode(doc["text"], add_special_tokens=False))
        if n_tokens > max_model_len:
            sized.append((n_tokens, path))
    return [p for _, p in sorted(sized)[:n]]


def _rows(out: str) -> list[dict]:
    from dlbatch.output.parquet_store import ParquetStore

    return ParquetStore(out).results().to_pylist()


def run_long(args) -> int:
    from dlbatch.bench import limits
    from dlbatch.bench.common import run_job

    quick = args.quick
    max_model_len = args.max_model_len or (2048 if quick else 4096)
    n_docs = 1 if quick else args.docs
    max_tokens = args.max_tokens or (4 if quick else None)
    tmp = tempfile.mkdtemp(prefix="dlbatch-bench-long-")
    result: dict = {"bench": "pipeline-long", "args": dict(vars(args)), "machine": machine_info()}
    try:
        papers = long_papers(max_model_len, n_docs)
        if not papers:
            raise SystemExit(f"no sample paper is longer than max_model_len {max_model_len}")
        inp = os.path.join(tmp, "in")
        os.makedirs(inp)
        for p in papers:
            shutil.copy(p, inp)
        base = [f"input.path={inp}", "sampling.temperature=0.0", f"model.max_model_len={max_model_len}",
                *(["chunking.map_max_tokens=16", "chunking.overlap_tokens=32"] if quick else []),
                *(f"tasks.{i}.max_tokens={max_tokens}" for i in range(3) if max_tokens), *args.overrides]
        if args.dtype:
            base.append(f"model.dtype={args.dtype}")
        print(f"dlbatch bench pipeline --long: {len(papers)} papers longer than {max_model_len} tokens, "
              f"{', '.join(POLICIES)}")
        result["limits"] = limits.measure(["float32"], "cpu", quick=quick)
        from dlbatch.jobspec import load_job

        started = start_bench_ray(job_chips(load_job(args.job, base)))
        for policy in POLICIES:
            out = os.path.join(tmp, policy)
            report, _ = run_job(args.job, base + [f"output.path={out}", f"long_inputs={policy}"])
            rows = _rows(out)
            share = {}
            for r in rows:
                share.setdefault(os.path.basename(r["source"]), []).append(
                    (r["kept_tokens"] or 0) / max(1, r["doc_tokens"] or 1))
            result[policy] = {"wall_s": report["wall_s"], "rows": len(rows),
                              "prompt_tokens": report["prompt_tokens"],
                              "prefill_tokens_computed": report["prefill_tokens_computed"],
                              "output_tokens": report["output_tokens"],
                              "chunks": sum(r["chunks"] or 0 for r in rows if r["task"] == rows[0]["task"]),
                              "doc_tokens": {os.path.basename(r["source"]): r["doc_tokens"] for r in rows},
                              "share_reached": {k: round(min(v), 4) for k, v in share.items()},
                              "long_inputs": report.get("long_inputs")}
            print(f"  {policy}: {report['wall_s']:.1f}s", flush=True)
        if started:
            import ray

            ray.shutdown()
        t, c = result["truncate"], result["chunk"]
        result["ratio"] = {"wall": ratio(c["wall_s"], t["wall_s"]),
                           "prefill_tokens": ratio(c["prefill_tokens_computed"], t["prefill_tokens_computed"])}
        return finish_bench(result, render, args.json)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def render(result: dict) -> str:
    t, c, r = result["truncate"], result["chunk"], result["ratio"]
    rows = [["wall s", f"{t['wall_s']:.1f}", f"{c['wall_s']:.1f}", f"{r['wall'] or 0:.2f}x"],
            ["prefill tokens computed", t["prefill_tokens_computed"], c["prefill_tokens_computed"],
             f"{r['prefill_tokens'] or 0:.2f}x"],
            ["output tokens", t["output_tokens"], c["output_tokens"], ""],
            ["chunks (per task)", "-", c["chunks"], ""]]
    lines = [table(["figure", "truncate (head)", "chunk (map-reduce)", "chunk / truncate"], rows)]
    docs = sorted(t["share_reached"])
    lines.append("")
    lines.append(table(["paper", "tokens", "share reaching the model: truncate", "chunk"],
                       [[d, t["doc_tokens"].get(d, 0), f"{t['share_reached'][d]:.0%}",
                         f"{c['share_reached'].get(d, 0):.0%}"] for d in docs]))
    lim = result["limits"]
    mm = ", ".join(f"{d} {v['flops'] / 1e9:.1f} GFLOP/s" for d, v in lim["matmul"].items())
    lines.append(f"machine: matmul peak {mm}; copy {lim['copy']['copy_GBps']:.1f} GB/s; load average "
                 f"{result['machine'].get('loadavg_1m', 0):.1f} on {result['machine'].get('cpu_count')} CPUs")
    return "\n".join(lines)

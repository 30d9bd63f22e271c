"""`dlbatch bench router`: the same job (papers, K tasks per document sharing the document
as prefix) run with `router.policy=prefix_aware` and with `round_robin`, in one run.

Both runs use 2 prefill workers (`cluster.prefill.replicas=2`, 0.5 CPU each) and one
decode worker: with a single prefill worker round_robin would still send every task of
a paper to the same engine, whose prefix cache then computes the paper once anyway, and
the comparison would show nothing. Documents: the sample papers (long) mixed with short
excerpts from the middle of them (distinct prefixes), greedy.

Figures: `prefill_tokens_computed / prompt_tokens` (summed over the prefill engines; the
ideal with K tasks is about 1/K), end-to-end tokens/s (prompt + output tokens over wall
time) and its ratio, outputs identical across policies, and the per-worker token-load
imbalance (max/mean) from the report's `router` section, with the measured per-worker
busy fractions next to it. Machine limits (matmul peak, copy bandwidth) measured in the
same run. `--repeats` alternates the policies and reports medians.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from dlbatch.bench.common import (finish_bench, job_chips, job_overrides_for_docs, machine_info, median, ratio, run_job,
                                  sample_documents, start_bench_ray, table, write_jsonl)

POLICIES = ("prefix_aware", "round_robin")


def add_arguments(p) -> None:
    p.add_argument("--job", default="jobs/papers.yaml")
    p.add_argument("--long-docs", type=int, default=4, help="full sample papers (long documents)")
    p.add_argument("--short-docs", type=int, default=4, help="short excerpts (distinct prefixes)")
    p.add_argument("--short-chars", type=int, default=600, help="characters per short document")
    p.add_argument("--max-chars", type=int, default=None, help="cut long documents to this many characters")
    p.add_argument("--max-tokens", type=int, default=None, help="override every task's max_tokens")
    p.add_argument("--dtype", default=None, help="model dtype (default: the job's)")
    p.add_argument("--prefill-workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="runs per policy (alternating); medians reported")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--quick", action="store_true", help="1 long (cut) + 1 short document, max_tokens 4")


def mixed_documents(n_long: int, n_short: int, short_chars: int, max_chars: int | None) -> list[dict]:
    longs = sample_documents(max(n_long, 1), max_chars)[:n_long]
    pool = sample_documents(max(n_short, 1))
    shorts = []
    for i in range(n_short):
        t = pool[i % len(pool)]["text"]
        start = (len(t) // 2 + 977 * (i // len(pool))) % max(1, len(t) - short_chars)
        shorts.append({"id": f"short{i:04d}", "title": pool[i % len(pool)]["title"],
                       "text": f"Excerpt {i}.\n" + t[start:start + short_chars]})
    docs = []
    for i in range(max(len(longs), len(shorts))):  # interleave long and short
        if i < len(longs):
            docs.append(longs[i])
        if i < len(shorts):
            docs.append(shorts[i])
    return docs


def run(args) -> int:
    from dlbatch.bench import limits
    from dlbatch.engine.device import compute_dtype
    from dlbatch.jobspec import load_job

    if args.quick:
        args.long_docs, args.short_docs = min(args.long_docs, 1), min(args.short_docs, 1)
        args.max_chars = args.max_chars or 1500
        args.short_chars = min(args.short_chars, 300)
        args.max_tokens = args.max_tokens or 4
    tmp = tempfile.mkdtemp(prefix="dlbatch-bench-router-")
    result: dict = {"bench": "router", "args": dict(vars(args)), "machine": machine_info()}
    try:
        docs = mixed_documents(args.long_docs, args.short_docs, args.short_chars, args.max_chars)
        jsonl = write_jsonl(os.path.join(tmp, "docs.jsonl"), docs)
        base = job_overrides_for_docs(jsonl, os.path.join(tmp, "out")) + [
            "sampling.temperature=0.0", f"cluster.prefill.replicas={args.prefill_workers}",
            "cluster.prefill.num_cpus=0.5", "cluster.decode.replicas=1", "cluster.decode.num_cpus=0.5",
            "cluster.colocated=null"]
        spec0 = load_job(args.job, base)
        if args.dtype:
            base.append(f"model.dtype={args.dtype}")
        if args.max_tokens:
            base += [f"tasks.{i}.max_tokens={args.max_tokens}" for i in range(len(spec0.tasks))]
        base += list(args.overrides)
        spec = load_job(args.job, base)
        K = len(spec.tasks)
        print(f"dlbatch bench router: {len(docs)} documents ({args.long_docs} long, {args.short_docs} short) x {K} "
              f"tasks, {args.prefill_workers} prefill workers, model {spec.model.name} {spec.model.dtype}")
        cd = compute_dtype(spec.model.dtype, "cpu")
        result["limits"] = limits.measure(sorted({spec.model.dtype, cd}), "cpu", quick=args.quick)

        started = start_bench_ray(job_chips(spec))
        runs: dict[str, list] = {p: [] for p in POLICIES}
        outputs: dict[str, dict] = {}
        for rep in range(max(1, args.repeats)):
            order = POLICIES if rep % 2 == 0 else POLICIES[::-1]
            for pol in order:
                report, outs = run_job(args.job, base + [f"router.policy={pol}"])
                busy = report.get("pools", {}).get("prefill", {}).get("per_worker_busy", [])
                rt = report.get("router", {})
                runs[pol].append({
                    "wall_s": report["wall_s"], "tokens_per_s": report["tokens_per_s"],
                    "docs_per_s": report["docs_per_s"], "prompt_tokens": report["prompt_tokens"],
                    "output_tokens": report["output_tokens"],
                    "prefill_tokens_computed": report["prefill_tokens_computed"],
                    "compute_fraction": ratio(report["prefill_tokens_computed"], report["prompt_tokens"]),
                    "token_imbalance": rt.get("token_imbalance"), "worker_tokens": rt.get("worker_tokens"),
                    "router_compute_fraction_estimate": rt.get("compute_fraction"),
                    "prefix_hit_rate": rt.get("prefix_hit_rate"), "duplicates_folded": rt.get("duplicates_folded"),
                    "prefill_busy": busy,
                    "busy_imbalance": (max(busy) / (sum(busy) / len(busy))) if busy and sum(busy) > 0 else None,
                    "docs_ok": report["docs_ok"], "docs_failed": report["docs_failed"]})
                outputs.setdefault(pol, outs)
                print(f"  {pol}: {report['wall_s']:.1f}s, {report['tokens_per_s']:.1f} tok/s, computed "
                      f"{report['prefill_tokens_computed']}/{report['prompt_tokens']} prompt tokens", flush=True)
        if started:
            import ray

            ray.shutdown()
        summary = {}
        for pol, rs in runs.items():
            summary[pol] = {k: median([r[k] for r in rs]) for k in ("wall_s", "tokens_per_s", "docs_per_s",
                                                                      "compute_fraction")
                            if all(r[k] is not None for r in rs)}
            last = rs[-1]
            for k in ("prompt_tokens", "prefill_tokens_computed", "output_tokens", "token_imbalance",
                      "worker_tokens", "prefill_busy", "busy_imbalance", "prefix_hit_rate", "duplicates_folded",
                      "docs_ok", "docs_failed"):
                summary[pol][k] = last[k]
        pa, rr = summary["prefix_aware"], summary["round_robin"]
        keys = sorted(set(outputs["prefix_aware"]) | set(outputs["round_robin"]))
        same = sum(outputs["prefix_aware"].get(k) == outputs["round_robin"].get(k) for k in keys)
        speed = ratio(pa.get("tokens_per_s"), rr.get("tokens_per_s"))
        result.update(runs=runs, summary=summary, tokens_per_s_ratio=speed,
                      outputs={"compared": len(keys), "identical": same}, tasks=K)
        goal_frac = 1 / K + 0.1
        result["targets"] = [
            {"target": f"prefix_aware prefill_tokens_computed <= (1/{K} + 0.1) x prompt_tokens",
             "value": pa.get("compute_fraction"), "goal": goal_frac,
             "met": None if pa.get("compute_fraction") is None else pa["compute_fraction"] <= goal_frac},
            {"target": "end-to-end tokens/s >= 1.8x round_robin", "value": speed, "goal": 1.8,
             "met": None if speed is None else speed >= 1.8},
            {"target": "outputs identical across policies (greedy)", "value": same, "goal": len(keys),
             "met": same == len(keys)},
            {"target": f"token-load imbalance <= 1.2 with {args.prefill_workers} prefill workers",
             "value": pa.get("token_imbalance"), "goal": 1.2,
             "met": None if pa.get("token_imbalance") is None else pa["token_imbalance"] <= 1.2}]
        return finish_bench(result, render, args.json)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def render(result: dict) -> str:
    s = result["summary"]
    pa, rr = s["prefix_aware"], s["round_robin"]

    def f(x, d=3):
        return "-" if x is None else (f"{x:.{d}f}" if isinstance(x, float) else str(x))

    rows = [["tokens/s (end to end)", f(pa.get("tokens_per_s"), 1), f(rr.get("tokens_per_s"), 1),
             f"{result['tokens_per_s_ratio']:.2f}x" if result["tokens_per_s_ratio"] else "-"],
            ["wall s", f(pa.get("wall_s"), 1), f(rr.get("wall_s"), 1), ""],
            ["prefill computed / prompt tokens", f(pa.get("compute_fraction")), f(rr.get("compute_fraction")),
             f"{pa['prefill_tokens_computed']} vs {rr['prefill_tokens_computed']} of {pa['prompt_tokens']}"],
            ["token-load imbalance (router, max/mean)", f(pa.get("token_imbalance")), f(rr.get("token_imbalance")),
             ""],
            ["prefill busy imbalance (measured)", f(pa.get("busy_imbalance")), f(rr.get("busy_imbalance")),
             f"busy {pa.get('prefill_busy')} vs {rr.get('prefill_busy')}"]]
    lim = result["limits"]
    mm = ", ".join(f"{d} {v['flops'] / 1e9:.1f} GFLOP/s" for d, v in lim["matmul"].items())
    lines = [table(["figure", "prefix_aware", "round_robin", "ratio / detail"], rows),
             f"machine: matmul peak {mm}; copy {lim['copy']['copy_GBps']:.1f} GB/s; load average "
             f"{result['machine'].get('loadavg_1m', 0):.1f} on {result['machine'].get('cpu_count')} CPUs",
             f"outputs identical across policies: {result['outputs']['identical']}/{result['outputs']['compared']}",
             "",
             table(["target (issue 7)", "measured", "goal", "met"],
                   [[t["target"], "-" if t["value"] is None else f"{t['value']:.3g}", f"{t['goal']:.3g}",
                     "not measured" if t["met"] is None else ("yes" if t["met"] else "NO")]
                    for t in result["targets"]])]
    return "\n".join(lines)

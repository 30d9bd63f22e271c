"""`dlbatch bench NAME`: benchmarks that print the baseline measured in the same run, the
ratio, and the machine's physical limit measured on the same machine.

Each benchmark is a module `dlbatch.bench.<name>` with `add_arguments(parser)` and
`run(args) -> int`; a module is imported only when chosen, so `--help` stays instant.
"""
from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "engine": "engine prefill/decode throughput vs transformers, against matmul peak and memory bandwidth",
    "kv": "KV payload bandwidth per transport vs memcpy, and transfer/compute overlap",
    "pipeline": "end-to-end documents/s and tokens/s vs Ray Data + transformers generate",
    "router": "prefix-aware vs round-robin routing on the same job",
    "scale": "driver-side cost at N documents with a tiny model (docs/s, driver peak RSS, no-op rerun, status) vs Ray Data",
    "solver": "measured tokens/s vs the plan's prediction and the simulation",
    "status": "dlbatch status / resume on N committed documents (index, compaction) vs reading every part",
    "structured": "constrained vs free decode step time (batch 1, 32) and per-request grammar compile time",
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (baseline, ratio and machine limit in one run)",
                       description="\n".join(f"  {k:9s} {v}" for k, v in BENCHES.items()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark (dlbatch bench NAME --help)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=run_bench)


def run_bench(args) -> int:
    mod = importlib.import_module(f"dlbatch.bench.{args.name}")
    parser = argparse.ArgumentParser(prog=f"dlbatch bench {args.name}", description=BENCHES[args.name])
    parser.add_argument("--json", default=None, metavar="FILE", help="write every figure to FILE")
    mod.add_arguments(parser)
    ns = parser.parse_args(args.rest)
    return int(mod.run(ns) or 0)

"""Linear throughput per compute dtype and shape class on this CPU: the figures behind the
dtype table of ``dlbatch/engine/device.py`` (docs/benchmarks.md, "Which dtype the engine
computes in, per CPU kind").

    python -m dlbatch.bench.dtype_linear [--rows 1,8,24,64,256,2048] [--min-s 0.5] [--json FILE]

For each row count M (1-64: decode batches, GEMV and small GEMMs; 256-2048: prefill
chunks) the four layer linears of SmolLM2-135M (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536) run through each path the engine could take:

- ``float32 oneDNN packed``: the engine's float32 path (weight reordered once,
  ``mkldnn._linear_pointwise``; one row runs as two, as ``ops/cpu.py`` does);
- ``bfloat16 F.linear``: the engine's path for a bf16 model on a CPU;
- ``bfloat16 oneDNN packed``: a bf16 weight reordered for oneDNN (brgemm with
  AVX512_BF16 or AMX where the CPU has them).

Each figure is GFLOP/s of the four together (2·M·N·K summed over the shapes), from the
median time of repeated calls on the same input (cache-warm, ``--min-s`` per call site),
beside square 2048 matmuls in both dtypes (the benches' matmul peak). No model is loaded.
"""
from __future__ import annotations

import argparse
import time

from dlbatch.bench.common import machine_info, median, table, write_json

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K) of a SmolLM2-135M layer's linears
PATHS = ("float32 oneDNN packed", "bfloat16 F.linear", "bfloat16 oneDNN packed")


def _median_s(fn, min_s: float) -> float:
    fn()
    fn()
    times, end = [], time.perf_counter() + min_s
    while len(times) < 5 or time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def _calls(m: int, n: int, k: int, gen):
    """The three paths' calls for an (m, k) input and an (n, k) weight."""
    import torch
    import torch.nn.functional as F

    w32 = torch.randn(n, k, generator=gen) * 0.02
    w16 = w32.bfloat16()
    p32 = torch.ops.mkldnn._reorder_linear_weight(w32, 32)
    p16 = torch.ops.mkldnn._reorder_linear_weight(w16, 32)
    x32 = torch.randn(max(m, 2), k, generator=gen)  # one row runs as two on the packed paths
    x16 = x32.bfloat16()
    return {
        PATHS[0]: lambda: torch.ops.mkldnn._linear_pointwise(x32, p32, None, "none", [], ""),
        PATHS[1]: lambda: F.linear(x16[:m], w16),
        PATHS[2]: lambda: torch.ops.mkldnn._linear_pointwise(x16, p16, None, "none", [], ""),
    }


def measure(rows: list[int], min_s: float = 0.5) -> dict:
    """GFLOP/s per path for each row count, and the square-matmul figures."""
    import torch

    gen = torch.Generator().manual_seed(0)
    out = {"threads": torch.get_num_threads(), "rows": []}
    for m in rows:
        seconds = dict.fromkeys(PATHS, 0.0)
        flops = 0
        for n, k in SHAPES:
            flops += 2 * m * n * k
            for path, fn in _calls(m, n, k, gen).items():
                seconds[path] += _median_s(fn, min_s)
        out["rows"].append({"m": m, "flops": flops, "seconds": seconds,
                            "gflops": {p: flops / s / 1e9 for p, s in seconds.items()}})
    a, b = torch.randn(2048, 2048, generator=gen), torch.randn(2048, 2048, generator=gen)
    out["square_2048_gflops"] = {}
    for dt in (torch.float32, torch.bfloat16):
        x, y = a.to(dt), b.to(dt)
        out["square_2048_gflops"][str(dt).removeprefix("torch.")] = 2 * 2048**3 / _median_s(lambda: x @ y, min_s) / 1e9
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m dlbatch.bench.dtype_linear", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,24,64,256,2048", help="comma list of row counts M")
    ap.add_argument("--min-s", type=float, default=0.5, help="timing per call site, seconds (at least 5 calls)")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if not rows or min(rows) < 1:
        raise SystemExit(f"--rows must be positive integers, got {args.rows!r}")
    res = measure(rows, args.min_s)
    print(f"layer linears of SmolLM2-135M, GFLOP/s of the four together ({res['threads']} threads)")
    print(table(["rows M"] + list(PATHS) + ["fp32 / best bf16"],
                [[r["m"]] + [f"{r['gflops'][p]:.1f}" for p in PATHS]
                 + [f"{r['gflops'][PATHS[0]] / max(r['gflops'][PATHS[1]], r['gflops'][PATHS[2]]):.2f}x"]
                 for r in res["rows"]]))
    print("square 2048 matmul: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in res["square_2048_gflops"].items()))
    if args.json:
        write_json(args.json, {"bench": "dtype_linear", "machine": machine_info(), **res})
    return res


if __name__ == "__main__":
    main()

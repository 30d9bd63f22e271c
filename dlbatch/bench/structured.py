"""`dlbatch bench structured`: what constrained decoding costs, in one run.

Figures (medians):
- decode step time at each batch size with every sequence constrained (a JSON schema that
  keeps them generating) against the same batch unconstrained (`ignore_eos`, so it runs as
  long): the baseline; the ratio is the overhead (target <= 1.2x). Only steps in which all
  sequences of the batch decode are timed.
- the mask work alone for the batch (filling the bitmasks in llguidance's pool, and
  applying them to the logits), timed apart: the floor of the overhead if nothing overlapped.
- per-request compile time of distinct JSON schemas (first use; cached afterwards), the
  cost of copying a compiled matcher for one more request, and building the grammar
  engine's tokenizer (once per worker).
"""
from __future__ import annotations

import time

from dlbatch.bench.common import finish_bench, machine_info, median, ratio, table

LONG_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 40, "items": {
    "type": "string", "minLength": 4, "maxLength": 24}}}, "required": ["items"], "additionalProperties": False}
TARGET = 1.2


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batches", default="1,32", help="comma list of batch sizes")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per case")
    p.add_argument("--schemas", type=int, default=20, help="distinct schemas compiled for the compile time")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--quick", action="store_true", help="few steps and schemas: a smoke run")


def _paper_schema(i: int) -> dict:
    props = {"title": {"type": "string"}, "field": {"type": "string"},
             "methods": {"type": "array", "items": {"type": "string"}, "maxItems": 3 + i},
             "datasets": {"type": "array", "items": {"type": "string"}}, "main_result": {"type": "string"},
             f"extra_{i}": {"type": "integer"}}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _step_times(llm, batch: int, constrained: bool, steps: int) -> list[float]:
    from dlbatch.engine.sampling_params import SamplingParams
    from dlbatch.engine.constraint import Constraint

    eng = llm.engine
    c = Constraint("json_schema", LONG_SCHEMA) if constrained else None
    sp = SamplingParams(max_tokens=steps + 8, ignore_eos=not constrained, constraint=c)
    seqs = [eng.add_request(f"b{batch}-{constrained}-{i}", llm.encode(f"List {40 + i} short words as JSON."), sp)
            for i in range(batch)]
    times = []
    try:
        while eng.has_unfinished():
            decoding = all(s.output_ids for s in seqs) and not any(s.finish_reason for s in seqs)
            t0 = time.perf_counter()
            done = eng.step()
            dt = time.perf_counter() - t0
            if decoding and not done and len(times) < steps:
                times.append(dt)
    finally:
        if eng.has_unfinished():
            eng.scheduler.abort_all()
    return times


def _mask_alone(llm, batch: int, repeats: int = 20) -> tuple[float, float]:
    """(fill, apply) seconds for one step's masks of `batch` fresh matchers."""
    import torch

    from dlbatch.engine.constraint import Constraint, ConstraintMasker

    comp = llm.engine.constraints
    seqs = [type("S", (), {"matcher": comp.matcher(Constraint("json_schema", LONG_SCHEMA))})() for _ in range(batch)]
    m = ConstraintMasker(llm.engine.runner.masker.vocab_size)
    logits = torch.zeros(batch, llm.engine.mconf.vocab_size)
    fill, apply = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m.start(seqs)
        m._thread.join()
        t1 = time.perf_counter()
        m.apply(logits)
        fill.append(t1 - t0)
        apply.append(time.perf_counter() - t1)
    return median(fill), median(apply)


def _compile_times(llm, n: int) -> dict:
    from dlbatch.engine.constraint import Constraint, ll_tokenizer

    t0 = time.perf_counter()
    ll_tokenizer(llm.tokenizer, llm.engine.mconf.vocab_size)
    tok_s = time.perf_counter() - t0
    comp = llm.engine.constraints
    _ = comp.lltok  # built once, before the timed compiles
    first, copies = [], []
    for i in range(n):
        c = Constraint("json_schema", _paper_schema(i))
        t0 = time.perf_counter()
        comp.compile(c)
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        comp.matcher(c)
        copies.append(time.perf_counter() - t0)
    regex = []
    for i in range(n):
        t0 = time.perf_counter()
        comp.compile(Constraint("regex", f"[0-9]{{1,{i + 2}}}(\\.[0-9]+)? (kg|g)"))
        regex.append(time.perf_counter() - t0)
    return {"tokenizer_build_s": tok_s, "json_schema_compile_ms": median(first) * 1e3,
            "regex_compile_ms": median(regex) * 1e3, "matcher_copy_ms": median(copies) * 1e3, "schemas": n}


def run(args) -> int:
    from dlbatch.engine.llm import LLM

    steps = 6 if args.quick else args.steps
    batches = [int(x) for x in args.batches.split(",") if x.strip()]
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, num_threads=args.threads,
              max_num_seqs=max(batches + [1]))
    result = {"bench": "structured", "model": args.model, "dtype": args.dtype, "machine": machine_info("cpu"),
              "target_ratio": TARGET, "steps": [], "compile": _compile_times(llm, 3 if args.quick else args.schemas)}
    _step_times(llm, 1, True, 2)  # warm up both paths
    _step_times(llm, 1, False, 2)
    for b in batches:
        free = _step_times(llm, b, False, steps)
        cons = _step_times(llm, b, True, steps)
        fill, apply = _mask_alone(llm, b)
        f, c = median(free), median(cons)
        result["steps"].append({"batch": b, "free_step_ms": f * 1e3, "constrained_step_ms": c * 1e3,
                                "ratio": ratio(c, f), "mask_fill_ms": fill * 1e3, "mask_apply_ms": apply * 1e3,
                                "serial_floor_ratio": ratio(f + fill + apply, f), "timed_steps": [len(free), len(cons)],
                                "meets_target": bool(c <= TARGET * f)})
    return finish_bench(result, render, getattr(args, "json", None))


def render(r: dict) -> str:
    rows = [[s["batch"], s["free_step_ms"], s["constrained_step_ms"], s["ratio"], s["mask_fill_ms"],
             s["mask_apply_ms"], s["serial_floor_ratio"], "yes" if s["meets_target"] else "NO"] for s in r["steps"]]
    out = [table(["batch", "free step ms", "constrained step ms", "ratio", "mask fill ms", "mask apply ms",
                  "(free+fill+apply)/free", f"<= {r['target_ratio']}x"], rows,
                 title=f"constrained vs free decode steps ({r['model']}, {r['dtype']})")]
    c = r["compile"]
    out.append(table(["grammar tokenizer build s", "json schema compile ms", "regex compile ms", "matcher copy ms"],
                     [[c["tokenizer_build_s"], c["json_schema_compile_ms"], c["regex_compile_ms"],
                       c["matcher_copy_ms"]]], title=f"per-request compile (median of {c['schemas']} distinct)"))
    return "\n\n".join(out)

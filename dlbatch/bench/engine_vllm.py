"""`dlbatch bench engine --backend vllm`: our engine and vLLM side by side on the same
weights, the same token ids and the same device, with the roofline measured in the same
run (what `tools/gpu_check.sh` prints on a GPU; on a CPU it runs vLLM's CPU build).

- prefill: ``--prefill-lens`` prompts (distinct random token ids, no prefix-cache hit), one
  token each, timed per length (median of ``--repeats``); the limit is the model's FLOPs
  at the measured matmul peak;
- decode: ``--decode-batches`` sequences of ``--decode-context`` prompt tokens generating
  ``--decode-tokens`` each (ignore_eos). The decode part is the call's wall time less that
  of the same prompts generating one token (their prefill; prefix caching is off, so both
  calls compute it), over the ``--decode-tokens`` - 1 steps after the first token: the
  same subtraction on both sides, so neither depends on an engine's own timing metrics.
  The limit is one read of the weights per step at the measured copy bandwidth.

Both engines run in this process one after the other (vLLM's engine core in-process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with prefix caching off. vLLM's OpenMP threads are
bound to every CPU of the process unless ``VLLM_CPU_OMP_THREADS_BIND`` is set (its default
keeps a core for its scheduler; see dlbatch/bench/peers.py ``peer_env``).
"""
from __future__ import annotations

import os
import random
import statistics
import time

from dlbatch.bench.common import sync, table


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _ours(path, dtype, device, max_model_len, prefills, decode):
    from dlbatch.engine.llm import LLM
    from dlbatch.engine.sampling_params import SamplingParams

    llm = LLM(path, dtype=dtype, device=device, max_model_len=max_model_len, chat=False, enable_prefix_caching=False,
              max_num_batched_tokens=max(len(p) for p in prefills["prompts"]))

    def prefill(p):
        sync(device)
        t0 = time.perf_counter()
        llm.generate([p], SamplingParams(max_tokens=1, ignore_eos=True))
        sync(device)
        return time.perf_counter() - t0

    def dec(prompts, tokens):
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
        sync(device)
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        sync(device)
        return time.perf_counter() - t0

    return _measure(prefill, dec, prefills, decode)


def _vllm(path, dtype, device, max_model_len, prefills, decode):
    from dlbatch.bench.peers import peer_env

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        os.environ.setdefault(k, peer_env()[k])
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype=dtype, max_model_len=max_model_len, enable_prefix_caching=False,
              skip_tokenizer_init=True, seed=0, max_num_batched_tokens=max(len(p) for p in prefills["prompts"]))

    def prefill(p):
        sync(device)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
        sync(device)
        return time.perf_counter() - t0

    def dec(prompts, tokens):
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True, detokenize=False)
        sync(device)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        sync(device)
        return time.perf_counter() - t0

    return _measure(prefill, dec, prefills, decode)


def _measure(prefill, dec, prefills, decode) -> dict:
    prefill(prefills["warmup"])
    out = {"prefill": {}, "decode": {}}
    for length, group in prefills["by_len"].items():
        out["prefill"][length] = statistics.median(prefill(p) for p in group)
    for batch, prompts in decode["by_batch"].items():
        dec(prompts[:1], 2)  # warm this batch size's path (graphs, compiled kernels) on other ids
        first = dec(prompts, 1)  # the prefill and the first token
        # the decode part: the whole call less the same prompts' prefill
        out["decode"][batch] = max(1e-9, dec(prompts, decode["tokens"]) - first)
    return out


def run(args) -> int:
    from dlbatch.bench import limits
    from dlbatch.bench.common import finish_bench, machine_info
    from dlbatch.engine.loader import load_hf_config

    path = args.model_path
    cfg = load_hf_config(path)
    vocab, n_params = cfg["vocab_size"], _params(cfg)
    lens = [int(x) for x in (args.prefill_lens or "512,2048").split(",")]
    batches = [int(x) for x in (args.decode_batches or "1,32").split(",")]
    mml = max(max(lens) + 8, args.decode_context + args.decode_tokens + 8)
    prefills = {"warmup": _prompts(1, 64, vocab, 99)[0],
                "by_len": {n: _prompts(args.repeats, n, vocab, n) for n in lens}}
    prefills["prompts"] = [p for g in prefills["by_len"].values() for p in g]
    decode = {"tokens": args.decode_tokens,
              "by_batch": {b: _prompts(b, args.decode_context, vocab, 1000 + b) for b in batches}}
    lim = limits.measure([args.dtype], args.device, quick=args.quick)
    peak = lim["matmul"][args.dtype]["flops"] if args.dtype in lim["matmul"] else None
    bw = lim["copy"]["copy_GBps"] * 1e9
    bytes_per = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    ours = _ours(path, args.dtype, args.device, mml, prefills, decode)
    theirs = _vllm(path, args.dtype, args.device, mml, prefills, decode)
    rows = []
    for n in lens:
        floor = 2 * n_params * n / peak if peak else None
        rows.append([f"prefill {n} tokens", f"{ours['prefill'][n] * 1e3:.1f} ms", f"{theirs['prefill'][n] * 1e3:.1f} ms",
                     f"{theirs['prefill'][n] / ours['prefill'][n]:.2f}x",
                     "-" if floor is None else f"{floor * 1e3:.1f} ms (matmul peak)"])
    steps = max(1, args.decode_tokens - 1)
    for b in batches:
        step_o = ours["decode"][b] / steps
        step_t = theirs["decode"][b] / steps
        floor = n_params * bytes_per / bw
        rows.append([f"decode batch {b}, per step", f"{step_o * 1e3:.2f} ms", f"{step_t * 1e3:.2f} ms",
                     f"{step_t / step_o:.2f}x", f"{floor * 1e3:.2f} ms (weights at copy bandwidth)"])
    result = {"bench": "engine_vllm", "machine": machine_info(args.device), "limits": lim, "model": path,
              "params": n_params, "ours": ours, "vllm": theirs, "rows": rows}
    return finish_bench(result, lambda r: table(["case", "dlbatch engine", "vLLM", "dlbatch speed-up", "limit"],
                                                r["rows"]), args.json)


def _params(cfg: dict) -> int:
    h, L, i, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    per_layer = h * (nh * hd + 2 * nkv * hd) + nh * hd * h + 3 * h * i
    return L * per_layer + v * h * (1 if cfg.get("tie_word_embeddings") else 2)

"""The paper workload side by side with other engines: `dlbatch bench engine --papers`
and `--peer-python PATH` (repeatable).

Workload: the sample papers (samples/papers, read with the project's PDF connector as the
pipeline reads them), each rendered into the K task prompts of a job (jobs/papers.yaml:
the paper text first, then the task's instruction, through the model's chat template) by
the pipeline's own `PromptStage`, with `max_model_len` set so that the paper is cut
(`long_inputs: truncate`) to at most `--papers-prefix-tokens` prompt tokens. The K
prompts of a paper share the paper as prefix; no two prompts are equal. Every prompt
gets exactly `--papers-max-tokens` new tokens, greedy, EOS ignored, in `--papers-dtype`
(float32 by default: every side computes the same tokens; bfloat16 is what jobs ask for).

Ours is `dlbatch.engine.LLM` (prefix caching on) with one `generate` over all prompts, in
the requested dtype (it computes in what `dlbatch/engine/device.py` picks for the CPU).
Each peer runs in its own virtualenv: `peer_runner.py` (standard library only at import)
is executed by the peer's python, gets the same prompt token ids in a JSON file and
writes its outputs and timings back as JSON. The backend is what that python can import:
`vllm` (the weights exported once as an fp32 HF directory: the same dequantised weights
our loader produced, cast by vLLM to the requested dtype) or `llama_cpp` (an F32 GGUF
written from the original GGUF with every tensor dequantised by the same code as our
loader, so both compute on identical fp32 weights; it runs fp32 whatever is asked). A missing or broken peer is reported as "skipped: <reason>".

Figures: wall seconds of the generation (model loading and one short warm-up prompt
excluded on every side), output tokens/s, prompt+output tokens/s, ours/theirs speed
ratio, and token agreement with ours (identical sequences; output tokens equal position
by position). The physical limit is a lower bound on the workload's time from the
machine's limits measured in the same run: the prefill FLOPs of each paper once plus
each task's suffix at the fastest matmul peak measured (fp32 or the requested dtype), plus,
per decode step, every weight and the running sequences' KV (as ours holds them) read
once at the measured copy bandwidth.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from dlbatch.bench.common import table

log = logging.getLogger("dlbatch.bench")

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_runner.py")
DETECT_TIMEOUT_S = 180


def add_arguments(p) -> None:
    p.add_argument("--peer-python", action="append", default=[], metavar="PATH", type=os.path.abspath,
                   help="python of a virtualenv with vllm or llama_cpp: run the paper workload there too "
                        "(repeatable; implies --papers)")
    p.add_argument("--papers", action="store_true",
                   help="run the paper workload (papers x tasks sharing each paper as prefix) instead of the "
                        "synthetic prefill/decode cases")
    p.add_argument("--papers-job", default="jobs/papers.yaml", help="job whose input and tasks make the prompts")
    p.add_argument("--papers-prefix-tokens", type=int, default=2560,
                   help="cut each paper so that a task prompt has at most this many tokens")
    p.add_argument("--papers-max-tokens", type=int, default=64, help="new tokens per prompt (EOS ignored)")
    p.add_argument("--papers-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype ours and vLLM are asked for (llama.cpp runs its F32 GGUF)")
    p.add_argument("--peer-timeout-s", type=int, default=1800, help="time limit of one peer run")


# ---------------------------------------------------------------------------- prompts
def paper_prompts(job: str, prefix_tokens: int, max_tokens: int, limit: int | None = None) -> list[dict]:
    """[{"paper", "task", "ids"}] in paper-major order, rendered and tokenized by the
    pipeline's `PromptStage` from the job's input (read with the project's connectors)."""
    from connectors import list_inputs, read_document_file
    from dlbatch.jobspec import load_job, parse_job
    from dlbatch.prompts.stage import PromptStage

    spec = load_job(job)
    d = spec.to_dict()
    d["model"]["max_model_len"] = prefix_tokens + max_tokens
    d["long_inputs"] = "truncate"
    for t in d["tasks"]:
        t["max_tokens"] = max_tokens
        t["long_inputs"] = None
    spec = parse_job(d, source=f"{job} (paper workload)")
    stage = PromptStage(spec, max_model_len=spec.model.max_model_len)  # set above: the paper's cut
    inp = spec.input
    files = list_inputs(inp.path, inp.format, dict(inp.storage_options))[:limit]
    out = []
    for url in files:
        for doc in read_document_file(url, inp.format, text_field=inp.text_field, id_field=inp.id_field,
                                      storage_options=dict(inp.storage_options)):
            rows = stage.process({"doc_id": str(doc.get("doc_id")), "source": str(doc.get("source", url)),
                                  "text": doc.get("text") or "", "title": doc.get("title"),
                                  "pages": doc.get("pages"), "error": doc.get("error"),
                                  "error_type": doc.get("error_type")})
            bad = [r for r in rows if r.get("error")]
            if bad:
                raise ValueError(f"paper workload: {url}: {bad[0]['error']}")
            out.extend({"paper": os.path.basename(url), "task": r["task"], "ids": list(r["prompt_ids"])}
                       for r in rows)
    if not out:
        raise ValueError(f"paper workload: no documents under {inp.path!r}")
    return out


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shared_prefixes(prompts: list[dict]) -> dict[str, int]:
    """Paper -> tokens its task prompts all share."""
    by: dict[str, list[list[int]]] = {}
    for p in prompts:
        by.setdefault(p["paper"], []).append(p["ids"])
    return {k: min(common_prefix(v[0], x) for x in v[1:]) if len(v) > 1 else len(v[0]) for k, v in by.items()}


# ---------------------------------------------------------------------------- model exports
def export_f32_gguf(model: str) -> str:
    """An F32 copy of a GGUF model (same metadata and tensor names, every tensor
    dequantised to float32 by the code our loader uses), for llama.cpp. Made once."""
    from dlbatch.engine.loader import model_dir, resolve_model

    path = resolve_model(model)
    if not path.endswith(".gguf"):
        raise ValueError(f"llama.cpp needs a GGUF model; {model!r} is {path}")
    _, src = model_dir(model)
    dst = src.rstrip("/") + "-f32.gguf"
    if not os.path.exists(dst):
        tmp = dst + f".tmp{os.getpid()}"
        try:
            _write_f32_gguf(path, tmp)
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return dst


def _write_f32_gguf(src: str, dst: str) -> None:
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    from dlbatch.engine.gguf_quants import dequantize as fast_dequantize

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    w.add_file_type(0)  # LLAMA_FTYPE_ALL_F32
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        try:
            arr = fast_dequantize(t.data, t.tensor_type.name, shape).numpy()
        except KeyError:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w.add_tensor(t.name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------- peers
def detect_peer(python: str) -> tuple[list[str], str | None]:
    """(backends the python can import, None) or ([], reason it cannot be used)."""
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        return [], f"{python} is not an executable file"
    try:
        p = subprocess.run([python, RUNNER, "--detect"], capture_output=True, text=True, timeout=DETECT_TIMEOUT_S,
                           env=peer_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"{python} --detect failed: {e}"
    if p.returncode != 0:
        return [], f"{python} --detect exited {p.returncode}: {_tail(p.stderr)}"
    try:
        info = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [], f"{python} --detect printed no JSON: {_tail(p.stdout + p.stderr)}"
    found = [k for k, v in info["backends"].items() if v]
    if not found:
        errs = "; ".join(f"{k}: {v}" for k, v in info.get("errors", {}).items())
        return [], f"{python} cannot import vllm or llama_cpp ({errs})"
    return found, None


def peer_env() -> dict:
    """The peer's environment: ours without PYTHONPATH (the peer must not see dlbatch).
    vLLM's CPU default (`VLLM_CPU_OMP_THREADS_BIND=auto`) keeps one core per worker for
    its scheduler process, which on a small machine halves its compute; unless the user
    set it, the peer's OpenMP threads are bound to every CPU this process may use, its
    fastest setting measured here (docs/benchmarks.md)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    return env


def _tail(s: str, n: int = 400) -> str:
    s = " ".join((s or "").split())
    return s[-n:]


def run_peer(python: str, backend: str, model_path: str, prompts: list[list[int]], max_tokens: int,
             max_model_len: int, warmup: list[int], timeout_s: int, dtype: str = "float32") -> dict:
    """One peer run through the JSON protocol of peer_runner.py; -> its result dict
    (with "error" when it failed)."""
    tmp = tempfile.mkdtemp(prefix="dlbatch-peer-")
    try:
        req_path, res_path = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(req_path, "w") as f:
            json.dump({"backend": backend, "model": model_path, "prompts": prompts, "max_tokens": max_tokens,
                       "threads": os.cpu_count() or 1, "max_model_len": max_model_len, "warmup": warmup,
                       "dtype": dtype}, f)
        try:
            p = subprocess.run([python, RUNNER, req_path, res_path], capture_output=True, text=True,
                               timeout=timeout_s, env=peer_env())
        except subprocess.TimeoutExpired:
            return {"backend": backend, "error": f"timed out after {timeout_s}s"}
        return read_result(res_path, p.returncode, p.stderr, backend)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_result(path: str, returncode: int, stderr: str, backend: str) -> dict:
    """A peer's result file, checked; a missing or malformed one becomes an error naming why."""
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        return {"backend": backend, "error": f"exited {returncode} without a result ({e}): {_tail(stderr)}"}
    if res.get("error"):
        return {**res, "error": f"{res['error']} | {_tail(stderr, 300)}" if stderr else res["error"]}
    outs = res.get("outputs")
    if not isinstance(outs, list) or not all(isinstance(o, list) for o in outs) or \
            not isinstance(res.get("wall_s"), (int, float)):
        return {"backend": backend, "error": f"malformed result (keys {sorted(res)})"}
    return {**res, "stderr_tail": _tail(stderr, 2000)}


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Token agreement of two runs over the same prompts: identical sequences, and output
    tokens equal at the same position (over ours' token count)."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(theirs)} outputs for {len(ours)} prompts")
    same = sum(a == b for a, b in zip(ours, theirs))
    equal = sum(x == y for a, b in zip(ours, theirs) for x, y in zip(a, b))
    total = sum(len(a) for a in ours)
    first = [common_prefix(a, b) for a, b in zip(ours, theirs)]
    return {"identical_seqs": same, "seqs": len(ours), "tokens_equal": equal, "tokens": total,
            "tokens_equal_frac": equal / total if total else None,
            "median_first_divergence": sorted(first)[len(first) // 2]}


def peer_model(backend: str, model: str) -> tuple[str, str]:
    """(path the backend loads, how it was made) for `model`."""
    from dlbatch.engine.loader import resolve_model

    if backend == "llama_cpp":
        return export_f32_gguf(model), "F32 GGUF of the dequantised weights"
    path = resolve_model(model)
    if os.path.isdir(path):
        return path, "the HF directory"
    from dlbatch.backends.vllm_backend import model_dir_for_vllm

    return model_dir_for_vllm(model), "fp32 safetensors of the dequantised weights"


PEER_NAMES = {"vllm": "vLLM-CPU", "llama_cpp": "llama.cpp"}


def run_peers(pythons: list[str], model: str, prompts: list[list[int]], max_tokens: int, max_model_len: int,
              warmup: list[int], timeout_s: int, ours_out: list[list[int]], dtype: str = "float32") -> list[dict]:
    """One column per (peer python, backend it can import); skipped columns say why."""
    cols = []
    for py in pythons:
        backends, reason = detect_peer(py)
        if reason:
            print(f"peer {py}: skipped: {reason}", flush=True)
            cols.append({"python": py, "name": "peer", "skipped": reason})
            continue
        for b in backends:
            col = {"python": py, "backend": b, "name": PEER_NAMES[b]}
            try:
                col["model"], col["weights"] = peer_model(b, model)
            except Exception as e:  # noqa: BLE001 - a peer we cannot feed is skipped, the bench goes on
                col["skipped"] = f"cannot export the model for {b}: {type(e).__name__}: {e}"
                cols.append(col)
                continue
            print(f"peer {PEER_NAMES[b]} ({py}) on {col['model']} ...", flush=True)
            res = run_peer(py, b, col["model"], prompts, max_tokens, max_model_len, warmup, timeout_s, dtype)
            if res.get("error"):
                col["skipped"] = res["error"]
            else:
                col.update(version=res["version"], load_s=res["load_s"], warmup_s=res.get("warmup_s"),
                           wall_s=res["wall_s"], settings=res.get("settings"), stderr_tail=res.get("stderr_tail"),
                           agreement=agreement(ours_out, res["outputs"]))
            print(f"  {PEER_NAMES[b]}: " + (f"skipped: {col['skipped']}" if "skipped" in col
                                              else f"{col['wall_s']:.1f}s"), flush=True)
            cols.append(col)
    return cols


# ---------------------------------------------------------------------------- ours, limit
def run_ours(model: str, prompts: list[list[int]], max_tokens: int, max_model_len: int, warmup: list[int],
             threads: int | None, dtype: str = "float32") -> tuple[dict, dict]:
    """-> (our column, model counts for the limit)."""
    from dlbatch.bench.roofline import model_counts
    from dlbatch.engine.llm import LLM
    from dlbatch.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, max_model_len=max_model_len, chat=False, enable_prefix_caching=True,
              max_num_seqs=max(64, len(prompts)), num_threads=threads)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([warmup], sp)
    # vLLM-CPU (torch.zeros) and llama.cpp (a cleared buffer) write their whole KV cache at
    # start-up; ours is mapped lazily, so its pages are backed now too, outside the timing
    kv_bytes = llm.engine.runner.prefault_kv_cache()
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs, steps = _generate_timing_decode(llm, prompts, sp)
    wall_s = time.perf_counter() - t0
    col = {"name": "ours", "version": "dlbatch.engine.LLM", "load_s": load_s, "warmup_s": warmup_s,
           "wall_s": wall_s, "outputs": [list(o.token_ids) for o in outs],
           "decode_step_s": statistics.median(steps) if steps else None, "decode_steps": len(steps),
           "cached_tokens": sum(o.cached_tokens for o in outs),
           "weights": f"dequantised at load, {dtype} asked, computes in {llm.engine.compute_dtype}",
           "kv_cache_bytes_prefaulted": kv_bytes,
           "settings": {"ops": llm.engine.ops.describe(), "kv_cache_dtype": str(llm.engine.runner.kv_cache.dtype),
                        "compute_dtype": llm.engine.compute_dtype}}
    return col, model_counts(llm)


def _generate_timing_decode(llm, prompts: list[list[int]], sp) -> tuple[list, list[float]]:
    """llm.generate(prompts, sp), also timing each engine step in which every sequence
    decodes one token (no prompt token computed): the decode step the roofline bounds.
    The engine's `step` is wrapped for the duration of the call."""
    eng, steps = llm.engine, []
    step = eng.step

    def timed_step():
        pre, made = eng.stats["prefill_tokens_computed"], eng.stats["output_tokens"]
        t0 = time.perf_counter()
        finished = step()
        dt = time.perf_counter() - t0
        if eng.stats["prefill_tokens_computed"] == pre and eng.stats["output_tokens"] - made == len(prompts):
            steps.append(dt)
        return finished

    eng.step = timed_step
    try:
        return llm.generate(prompts, sp), steps
    finally:
        del eng.step  # the class's method again


def lower_bound(cnt: dict, prompts: list[list[int]], max_tokens: int, lim: dict) -> dict:
    """Seconds the workload needs at least on this machine: each prompt's tokens after
    the longest prefix shared with an earlier prompt computed once (FLOPs at the fastest
    matmul peak measured: fp32 or a half-precision dtype), then `max_tokens - 1` decode
    steps of all sequences, each step bounded by reading every weight and every
    sequence's KV once (copy bandwidth) or by its FLOPs."""
    from dlbatch.bench.roofline import decode_bytes

    peak_dtype, peak = max(((d, v["flops"]) for d, v in lim["matmul"].items()), key=lambda x: x[1])
    bw = lim["copy"]["copy_GBps"] * 1e9
    attn = 4.0 * cnt["layers"] * cnt["heads"] * cnt["head_dim"]
    flops = 0.0
    for i, p in enumerate(prompts):
        start = max((common_prefix(p, q) for q in prompts[:i]), default=0)
        start = min(start, len(p) - 1)
        n = len(p) - start
        flops += 2.0 * cnt["linear_params"] * n + 2.0 * cnt["lm_head_params"] + attn * n * (start + n / 2)
    prefill_s = flops / peak
    b = len(prompts)
    ctx = sum(len(p) for p in prompts) / b + max_tokens / 2
    step_s = max(decode_bytes(cnt, b, ctx) / bw, 2.0 * (cnt["linear_params"] + cnt["lm_head_params"]) * b / peak)
    steps = max_tokens - 1  # the first new token comes out of the prefill
    return {"prefill_s": prefill_s, "decode_s": steps * step_s, "total_s": prefill_s + steps * step_s,
            "prefill_flops": flops, "decode_step_s": step_s, "peak_flops": peak, "peak_dtype": peak_dtype,
            "copy_GBps": bw / 1e9}


# ---------------------------------------------------------------------------- the bench
def run_papers(args) -> int:
    from dlbatch.bench import limits
    from dlbatch.bench.common import finish_bench, machine_info

    quick = args.quick
    prefix = min(args.papers_prefix_tokens, 256) if quick else args.papers_prefix_tokens
    n_new = min(args.papers_max_tokens, 4) if quick else args.papers_max_tokens
    if prefix < 64 or n_new < 1:
        raise SystemExit("--papers-prefix-tokens must be >= 64 and --papers-max-tokens >= 1")
    if args.device != "cpu":
        raise SystemExit("the paper workload against peers runs on --device cpu")
    reqs = paper_prompts(args.papers_job, prefix, n_new, limit=2 if quick else None)
    prompts = [r["ids"] for r in reqs]
    mml = max(len(p) for p in prompts) + n_new + 16
    warmup = list(range(1000, 1032))
    shared = shared_prefixes(reqs)
    dtype = args.papers_dtype
    print(f"dlbatch bench engine --papers: {len(shared)} papers x {len(reqs) // len(shared)} tasks = {len(reqs)} "
          f"prompts, {sum(map(len, prompts))} prompt tokens, {n_new} new tokens each, greedy {dtype}, EOS ignored",
          flush=True)
    result: dict = {"bench": "engine-papers", "args": dict(vars(args)), "machine": machine_info("cpu"),
                    "workload": {"job": args.papers_job, "prefix_tokens": prefix, "max_tokens": n_new,
                                 "dtype": dtype,
                                 "prompts": [{"paper": r["paper"], "task": r["task"], "tokens": len(r["ids"])}
                                             for r in reqs], "shared_prefix": shared}}
    dtypes = sorted({"float32", dtype})
    lim = limits.measure(dtypes, "cpu", quick=quick)
    ours, cnt = run_ours(args.model, prompts, n_new, mml, warmup, args.threads, dtype)
    print(f"  ours: {ours['wall_s']:.1f}s", flush=True)
    result["peers"] = run_peers(args.peer_python, args.model, prompts, n_new, mml, warmup, args.peer_timeout_s,
                                ours["outputs"], dtype)
    result["limits"] = limits.merge_best(lim, limits.measure(dtypes, "cpu", quick=quick))
    result["lower_bound"] = lower_bound(cnt, prompts, n_new, result["limits"])
    result["ours"] = ours
    summarize(result)
    return finish_bench(result, render_papers, args.json)


def summarize(result: dict) -> None:
    """Speeds, ratios and the issue's target from the measured columns (in place)."""
    w = result["workload"]
    n_out = len(w["prompts"]) * w["max_tokens"]
    n_all = n_out + sum(p["tokens"] for p in w["prompts"])
    cols = [result["ours"]] + result["peers"]
    for c in cols:
        if "wall_s" in c:
            c["output_tokens_per_s"] = n_out / c["wall_s"]
            c["all_tokens_per_s"] = n_all / c["wall_s"]
            c["ours_over_theirs"] = c["wall_s"] / result["ours"]["wall_s"]
    ran = [c for c in result["peers"] if "wall_s" in c]
    fastest = min(ran, key=lambda c: c["wall_s"]) if ran else None
    x = fastest["ours_over_theirs"] if fastest else None
    result["target"] = {"target": "paper workload >= 2x the faster peer", "fastest_peer": fastest and fastest["name"],
                        "value": x, "goal": 2.0, "met": None if x is None else x >= 2.0}
    result["ours_frac_of_lower_bound"] = result["lower_bound"]["total_s"] / result["ours"]["wall_s"]


def render_papers(result: dict) -> str:
    w, lb, lim = result["workload"], result["lower_bound"], result["limits"]
    lens = sorted(p["tokens"] for p in w["prompts"])
    m = result["machine"]
    lines = [f"paper workload: {len(w['shared_prefix'])} papers x {len(lens) // len(w['shared_prefix'])} tasks, "
             f"prompt tokens {lens[0]}-{lens[-1]} (median {lens[len(lens) // 2]}), shared prefix per paper "
             f"{min(w['shared_prefix'].values())}-{max(w['shared_prefix'].values())} tokens, {w['max_tokens']} new "
             f"tokens each; greedy, {w.get('dtype', 'float32')}, EOS ignored; load average {m.get('loadavg_1m', 0):.1f} on "
             f"{m.get('cpu_count')} CPUs ({m.get('cpu', '?')})"]
    rows = []
    for c in [result["ours"]] + result["peers"]:
        if "skipped" in c:
            rows.append([f"{c['name']} ({c['python']})", "skipped: " + c["skipped"][:200]] + ["-"] * 5)
            continue
        a = c.get("agreement")
        rows.append([f"{c['name']} {c['version']}", c["weights"], f"{c['wall_s']:.1f}",
                     f"{c['output_tokens_per_s']:.1f}", f"{c['all_tokens_per_s']:.0f}",
                     f"{c['ours_over_theirs']:.2f}x" if c is not result["ours"] else "-",
                     f"{a['identical_seqs']}/{a['seqs']} seqs, {100 * a['tokens_equal_frac']:.1f}% tokens"
                     if a else "(reference)"])
    lines.append(table(["engine", "weights", "wall s", "out tok/s", "all tok/s", "ours/theirs", "same as ours"],
                        rows))
    lines.append(f"lower bound on this machine: {lb['total_s']:.1f}s (prefill {lb['prefill_flops'] / 1e9:.0f} GFLOP "
                 f"at {lb['peak_flops'] / 1e9:.1f} GFLOP/s {lb.get('peak_dtype', 'float32')} = {lb['prefill_s']:.1f}s; "
                 f"decode "
                 f"{w['max_tokens'] - 1} steps x {1e3 * lb['decode_step_s']:.0f} ms at "
                 f"{lim['copy']['copy_GBps']:.1f} GB/s copy = {lb['decode_s']:.1f}s); ours at "
                 f"{100 * result['ours_frac_of_lower_bound']:.0f}% of it")
    kv = result["ours"].get("kv_cache_bytes_prefaulted")
    if kv:
        lines.append(f"ours: its {kv / 2**30:.2f} GiB KV cache written once before timing, as the peers zero theirs "
                     "at start-up (the engine maps it lazily)")
    step = result["ours"].get("decode_step_s")
    if step:
        frac = lb["decode_step_s"] / step
        lines.append(f"decode step, all {len(lens)} sequences decoding (ours): median {1e3 * step:.0f} ms over "
                     f"{result['ours']['decode_steps']} steps; bound {1e3 * lb['decode_step_s']:.0f} ms -> "
                     f"{100 * frac:.0f}% of the roofline (target >= 50%: {'met' if frac >= 0.5 else 'NOT met'})")
    t = result["target"]
    lines.append(f"target: {t['target']}: " + ("not measured (no peer ran)" if t["value"] is None else
                                                 f"{t['value']:.2f}x vs {t['fastest_peer']} -> "
                                                 + ("met" if t["met"] else "NOT met")))
    return "\n".join(lines)

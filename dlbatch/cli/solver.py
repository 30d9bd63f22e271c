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

import glob
import json
import os
import sys

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def _chips_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "configs", "chips")


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
    f.add_argument("--max-batch", type=int, default=64, help="sequences per worker at run time (max_num_seqs)")
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
    p.add_argument("--max-batch", type=int, default=64,
                   help="sequences per worker (the workers' max_num_seqs; default 64 as dlbatch run)")
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


def default_chip_files(model_name: str) -> list[str]:
    """The catalog plus every measured profile in configs/chips/ made for ``model_name``."""
    import yaml

    d = _chips_dir()
    files = []
    cat = os.path.join(d, "catalog.yaml")
    if os.path.isfile(cat):
        files.append(cat)
    for f in sorted(glob.glob(os.path.join(d, "*.yaml"))):
        if f == cat:
            continue
        try:
            data = yaml.safe_load(open(f))
        except Exception:
            continue
        if isinstance(data, dict) and data.get("source") == "measured" and data.get("model") in (model_name, "", None):
            files.append(f)
    return files


def local_available(chip_files: list[str]) -> dict[str, int]:
    """This machine's chips that have a measured profile among `chip_files`: a profile
    measured on the CPU counts as one chip (it was measured with every core), one measured
    on CUDA as the number of CUDA devices here."""
    import yaml

    out: dict[str, int] = {}
    for f in chip_files:
        try:
            data = yaml.safe_load(open(f))
        except Exception:
            continue
        if not isinstance(data, dict) or data.get("source") != "measured" or not data.get("name"):
            continue
        device = str((data.get("measured") or {}).get("device", ""))
        if device == "cpu":
            out[data["name"]] = 1
        elif device.startswith("cuda"):
            import torch

            if torch.cuda.is_available() and torch.cuda.device_count():
                out[data["name"]] = torch.cuda.device_count()
    return out


def _load_spec(args):
    from dlbatch.jobspec import load_job

    try:
        return load_job(args.job, list(args.overrides))
    except FileNotFoundError as e:
        raise ValueError(f"job file not found: {e}") from None


def _job_context(args):
    """(spec, JobSample, chip files, max_batch, chunk_tokens) for plan / simulate."""
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
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    chunk = args.chunk_tokens or max(512, min(spec.batching.max_batch_tokens, 4096))
    if chunk < 1:
        raise ValueError(f"--chunk-tokens must be >= 1, got {chunk}")
    return spec, sample, chips, args.max_batch, chunk


def cmd_plan(args) -> int:
    from dlbatch.solver.commands import load_chips, plan_command

    spec, sample, chip_files, max_batch, chunk = _job_context(args)
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
    if args.compare:
        from dlbatch.solver.compare import compare_heterogeneous
        from dlbatch.solver.report import format_comparison

        cmp = compare_heterogeneous({k: chips[k] for k in available}, available, sample.model, sample.workload,
                                    args.budget, max_batch=max_batch, chunk_tokens=chunk)
        print()
        print(format_comparison(cmp))
    return EXIT_OK


def cmd_simulate(args) -> int:
    from dlbatch.solver.commands import simulate_command

    spec, sample, chip_files, _, _ = _job_context(args)
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

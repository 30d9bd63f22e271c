"""`dlbatch run`, `dlbatch status`, `dlbatch compact` and `dlbatch export`."""
from __future__ import annotations

import json
import sys

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
EXIT_BUSY = 3  # another process holds the output's lease: nothing was done
EXIT_INTERRUPTED = 130  # Ctrl-C: what was complete is committed


def register(sub) -> None:
    p = sub.add_parser("run", help="run a job file (embedded local Ray, or --address to attach)")
    p.add_argument("job", help="job YAML file (local path or fsspec URL)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a field of the job file (repeatable)")
    p.add_argument("--fresh", action="store_true", help="delete this job's previous output and start over")
    p.add_argument("--address", default=None, help="attach to a Ray cluster: auto or ray://HOST:PORT")
    p.add_argument("--plan", default=None, help="a plan JSON written by `dlbatch plan`")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("--commit-docs", type=int, default=16, metavar="N",
                   help="commit a Parquet part at least every N finished documents (default 16)")
    p.add_argument("--commit-seconds", type=float, default=5.0, metavar="S",
                   help="... or every S seconds, whichever comes first (default 5)")
    p.add_argument("--resource-timeout", type=float, default=120.0, metavar="S",
                   help="fail when no node provides a pool's chip for S seconds (default 120)")
    p.add_argument("--stall-timeout", type=float, default=1800.0, metavar="S",
                   help="fail when no batch returns for S seconds while some are in flight (default 1800)")
    p.add_argument("--input-timeout", type=float, default=600.0, metavar="S",
                   help="fail when the input pipeline yields no document for S seconds while every worker is "
                        "idle (default 600)")
    p.add_argument("--compact-parts", type=int, default=None, metavar="N",
                   help="at job end, merge the small committed parts when more than N exist (default 64; "
                        "-1: never)")
    p.set_defaults(func=cmd_run)

    s = sub.add_parser("status", help="documents done / failed / pending and tokens, from the committed output")
    s.add_argument("job")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_status)

    c = sub.add_parser("compact", help="merge a job's small committed parts into larger ones (crash-safe; "
                                       "finishes a compaction a crash interrupted)")
    c.add_argument("job")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    c.add_argument("--min-parts", type=int, default=None, metavar="N",
                   help="merge only when more than N small parts exist (default 0: always)")
    c.set_defaults(func=cmd_compact)

    e = sub.add_parser("export", help="write an openai_batch job's results.jsonl and errors.jsonl from its committed "
                                      "output (also done at the end of every run that completes)")
    e.add_argument("job")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    e.set_defaults(func=cmd_export)


def _load(args):
    from dlbatch.jobspec import JobSpecError, load_job

    overrides = list(args.overrides)
    if getattr(args, "address", None):
        overrides.append(f"cluster.address={args.address}")
    try:
        return load_job(args.job, overrides)
    except (JobSpecError, FileNotFoundError) as e:
        print(f"invalid job file: {e}", file=sys.stderr)
        return None


def cmd_run(args) -> int:
    spec = _load(args)
    if spec is None:
        return EXIT_INVALID
    plan = None
    plan_path = args.plan or (spec.cluster.plan if spec.cluster.plan not in (None, "auto") else None)
    if plan_path:
        import fsspec

        with fsspec.open(plan_path, "r") as f:
            plan = json.load(f)
    from dlbatch.api import run  # the pipeline and the rest of what validate checks: checks.check_job
    from dlbatch.driver.runner import JobFailed
    from dlbatch.driver.checks import JobInvalid
    from dlbatch.output.lease import LeaseHeld, LeaseLost

    options = dict(flush_docs=args.commit_docs, flush_seconds=args.commit_seconds,
                   resource_timeout_s=args.resource_timeout, stall_timeout_s=args.stall_timeout,
                   input_timeout_s=args.input_timeout,
                   **({"compact_min_parts": args.compact_parts} if args.compact_parts is not None else {}))
    try:
        report = run(spec, fresh=args.fresh, plan=plan, progress=None if not args.no_progress else False,
                     options=options).report
    except KeyboardInterrupt:
        print(f"interrupted: {_committed(spec)}; rerun the same command to resume (nothing committed is redone)",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except JobInvalid as e:  # what `dlbatch validate` refuses, refused before anything started
        print(f"invalid job: {e}", file=sys.stderr)
        return EXIT_INVALID
    except LeaseHeld as e:
        print(f"job not started: {e}", file=sys.stderr)
        return EXIT_BUSY
    except LeaseLost as e:
        print(f"job stopped: {e}; what it committed is intact", file=sys.stderr)
        return EXIT_FAILED
    except JobFailed as e:
        print(f"job failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:  # permanent I/O error, or transient ones that outlived their retries
        notes = "; ".join(getattr(e, "__notes__", []) or [])
        print(f"job failed: {type(e).__name__}: {e}{f' ({notes})' if notes else ''}; "
              f"committed output under {spec.output.path} is intact", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as e:
        import logging

        logging.getLogger("dlbatch").exception("job failed")
        print(f"job failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    if report.get("noop"):
        return EXIT_OK
    print(f"job {spec.name!r} finished: {report['docs_ok']} documents ok, {report['docs_failed']} dead-lettered "
          f"(see {spec.output.path}/_errors/), {report['rows_written']} rows written this run, "
          f"{report['tokens_per_s']:.0f} tokens/s, {report['wall_s']:.1f} s; report: {spec.output.path}/_report.html")
    return EXIT_OK


def _committed(spec) -> str:
    """What the output holds after an interrupted run, read from it (the run committed every
    complete document before it stopped)."""
    try:
        from dlbatch.output import open_store

        prog = open_store(spec.output).progress(tasks={t.name for t in spec.tasks})
    except Exception as e:  # the message must not fail
        return f"committed output under {spec.output.path} is intact (could not count it: {type(e).__name__})"
    return (f"{prog['n_done']} documents committed in {spec.output.path}"
            + (f", {prog['n_failed']} dead-lettered" if prog["n_failed"] else ""))


def cmd_status(args) -> int:
    spec = _load(args)
    if spec is None:
        return EXIT_INVALID
    from dlbatch.output.status import job_status

    st = job_status(spec)
    if args.json:
        print(json.dumps(st))
    else:
        print(f"job {st['job']} -> {st['output']}")
        print(f"  documents: {st['docs_done']} done, {st['docs_failed']} failed, {st['docs_pending']} pending "
              f"(of {st['docs_total']})")
        print(f"  rows: {st['rows']}   tokens: {st['prompt_tokens']} prompt, {st['output_tokens']} output")
        if st["orphan_parts_moved"] or st["orphan_parts_in_place"]:
            print(f"  orphan parts (committed by a process after it lost the lease; not counted): "
                  f"{st['orphan_parts_moved']} moved to _orphans/, {st['orphan_parts_in_place']} still in place "
                  f"(plain readers see them until the next run's commit moves them)")
        print(f"  state: {_state(st)}")
    return EXIT_OK


def _state(st: dict) -> str:
    if st["complete"]:
        return "complete"
    if st["last_run_complete"] and st["docs_pending"]:
        limit = st.get("last_run_limit")
        return (f"incomplete: the last run completed{f' with input.limit {limit}' if limit else ''}, and "
                f"{st['docs_pending']} documents of this job are not processed yet; rerun to process them")
    return "incomplete"


def cmd_compact(args) -> int:
    spec = _load(args)
    if spec is None:
        return EXIT_INVALID
    from dlbatch.output import open_store
    from dlbatch.output.lease import LeaseHeld

    store = open_store(spec.output)  # the format that wrote the output (its manifest): a Delta table compacts as one
    try:
        store.files.take_lease(spec.name, "compact")  # never beside a run or another compaction
    except LeaseHeld as e:
        print(f"compaction not started: {e}", file=sys.stderr)
        return EXIT_BUSY
    try:
        res = store.compact(min_parts=args.min_parts if args.min_parts is not None else 0)
        moved = store.orphans()  # parts committed by a process after it lost the lease, moved aside
    except OSError as e:
        print(f"compaction failed: {type(e).__name__}: {e}; committed output under {spec.output.path} is intact "
              f"(rerun to finish)", file=sys.stderr)
        return EXIT_FAILED
    finally:
        store.files.release_lease()
    print(f"{spec.output.path}: {res['merged_parts']} small parts merged into {res['parts_written']} "
          f"({res['parts_before']} small parts before)"
          + (f"; {len(moved)} orphan parts moved to _orphans/" if moved else ""))
    return EXIT_OK


def cmd_export(args) -> int:
    """results.jsonl / errors.jsonl of an ``output.format: openai_batch`` job, under its lease."""
    spec = _load(args)
    if spec is None:
        return EXIT_INVALID
    if spec.output.format != "openai_batch":
        print(f"dlbatch export writes OpenAI batch files: job {spec.name!r} has output.format {spec.output.format}, "
              "not openai_batch", file=sys.stderr)
        return EXIT_INVALID
    from dlbatch.output import open_store, openai_export
    from dlbatch.output.lease import LeaseHeld

    store = open_store(spec.output)
    try:
        store.files.take_lease(spec.name, "export")
    except LeaseHeld as e:
        print(f"export not started: {e}", file=sys.stderr)
        return EXIT_BUSY
    try:
        n = openai_export.export(spec, store)
    except OSError as e:
        print(f"export failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        store.files.release_lease()
    print(f"{spec.output.path}: {n['results']} lines in {openai_export.RESULTS_FILE}, {n['errors']} in "
          f"{openai_export.ERRORS_FILE}")
    return EXIT_OK

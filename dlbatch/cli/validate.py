"""`dlbatch validate JOB`: everything that can be checked before a run, without a model.

In order, each step printing what it found: the job file loads (schema, templates, the
cross-field checks of `load_job`); then the checks `dlbatch run` makes before it starts
anything, the same function (`dlbatch.driver.checks.check_job`): the pipeline, the run's
configuration (`RunConfig`: the backend is installed and runs the model, the context length,
the layout), the inputs listed (files, bytes), the fields and columns the job reads, the
output (writable, its format, a resume it would refuse, with the changed keys); then the
first documents are parsed (in the isolated parser, under the job's caps) and their prompts
built, each task's first prompt shown with its token count; the longest sampled documents
and what the long-input policy does to them; the plan's time and cost estimate for this
machine's profiled chips (or why there is none). Any failed check is one line ``error: ...``
naming the bad value, and exit code 2, as `dlbatch run` exits for it; nothing is written and
nothing is started (no Ray, no engine: the model's config.json and tokenizer, the inputs'
first documents and the output's records are read).
"""
from __future__ import annotations

import sys

EXIT_OK, EXIT_INVALID = 0, 2


def register(sub) -> None:
    v = sub.add_parser("validate", help="check a job without running it: inputs, output, prompts, long "
                                        "documents, the plan's time/cost estimate")
    v.add_argument("job", help="job YAML file")
    v.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a field of the job file (repeatable)")
    v.add_argument("--docs", type=int, default=3, metavar="N", help="documents to parse and render (default 3)")
    v.add_argument("--show-chars", type=int, default=160, metavar="C",
                   help="characters shown of each rendered prompt's start and end (default 160)")
    v.set_defaults(func=cmd_validate)


def cmd_validate(args) -> int:
    from dlbatch.driver.checks import JobInvalid, check_job
    from dlbatch.jobspec import JobSpecError, load_job

    try:
        spec = load_job(args.job, args.overrides)
    except (JobSpecError, FileNotFoundError) as e:
        print(f"error: invalid job file: {e}", file=sys.stderr)
        return EXIT_INVALID
    print(f"job {spec.name!r}: loads ({len(spec.tasks)} tasks, model {spec.model.name}, backend {spec.model.backend})")
    try:
        checked = check_job(spec)  # what `dlbatch run` checks before it starts anything
        describe(spec, checked)
        _prompts(spec, checked.files, max(1, args.docs), args.show_chars, checked.config.max_model_len)
    except (JobInvalid, Invalid) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    _estimate(spec, max(1, args.docs), checked.config.max_model_len)
    print(f"job {spec.name!r} is valid")
    return EXIT_OK


class Invalid(Exception):
    """A check of validate's own that failed (the prompts): its message names the bad value."""


def describe(spec, checked) -> None:
    """What `check_job` found: the model and layout, the inputs, their columns, the output."""
    config = checked.config
    print(f"model: backend {config.backend.name}, max_model_len {config.max_model_len:,} ({config.context_source})")
    print(f"layout: {layout_line(config.layout)}")
    print(paths_line(spec))
    _inputs_line(spec, checked.files)
    if checked.columns:
        print(f"columns (first rows of {checked.files[0]}): {', '.join(sorted(checked.columns))}")
    m = checked.manifest
    if m is None:
        state = "empty"
    elif checked.restart_reason:
        state = f"a run starts it over: {checked.restart_reason}"
    else:
        state = f"holds job {m.get('name')!r} ({'complete' if m.get('complete') else 'incomplete'}): a run resumes it"
    print(f"output: {spec.output.path} is writable; {state}")


def paths_line(spec) -> str:
    """The job's paths as the run uses them (docs/jobs.md, "Paths"): data paths from the
    current directory, the model's folder as the loader finds it."""
    import os

    from dlbatch.engine.loader import resolve_model

    try:
        model = resolve_model(spec.model.ref)
    except Exception as e:  # the model's own check reports it; here only where it would be
        model = f"{spec.model.name} (not found: {type(e).__name__})"
    return (f"paths (relative ones from {os.getcwd()}): input {spec.input.path}, output {spec.output.path}, "
            f"model {model}")


def layout_line(layout) -> str:
    """The pools a run starts and who chose them (`dlbatch.driver.layout.Layout`; None: an
    attached cluster's, chosen when the run sees its chips)."""
    if layout is None:
        return ("chosen by the solver when the run attaches to the cluster, from its nodes' chip:<name> resources "
                "(docs/cluster.md)")
    pools = ", ".join(f"{r} {p.chip} x{p.replicas}" + (f" ({p.device})" if p.device != "cpu" else "")
                      for r, p in layout.pools.items())
    return f"{pools}; chosen by {layout.source}: {layout.reason}"


def _inputs_line(spec, files: list[str]) -> None:
    from connectors.hf_hub import is_hub_url
    from connectors.listing import _url_to_fs, count_rows

    inp = spec.input
    if is_hub_url(files[0]):  # a Hub dataset: one input, listing checked its config and split
        what = f"Hub dataset {inp.path}, {count_rows(files[0], inp.format, 1 << 62, dict(inp.storage_options)):,} rows"
    else:
        total = 0
        for f in files[:10_000]:
            fs, p = _url_to_fs(f, dict(inp.storage_options))
            total += int(fs.info(p).get("size") or 0)
        more = " (bytes of the first 10,000)" if len(files) > 10_000 else ""
        what = f"{len(files):,} {inp.format} files, {total / 1e6:,.1f} MB{more} under {inp.path}"
    print(f"inputs: {what}" + (f"; input.limit {inp.limit}" if inp.limit is not None else ""))


def _prompts(spec, files: list[str], n_docs: int, show_chars: int, max_model_len: int) -> None:
    from connectors.parse import parse_file
    from dlbatch.prompts.multimodal import parse_request
    from dlbatch.prompts.stage import PromptStage
    from dlbatch.prompts.multimodal import has_images
    from dlbatch.records import base_task, prompt_length

    inp = spec.input
    stage = PromptStage(spec, map_reduce=True, max_model_len=max_model_len)  # as the run's: `chunk` plans map rows
    docs: list[tuple[dict, list[dict]]] = []
    for url in files:
        if len(docs) >= n_docs:
            break
        for doc in parse_file({"url": url, "max_rows": n_docs - len(docs)}, inp.format, inp.text_field,
                              inp.id_field, dict(inp.storage_options), inp.max_pages,
                              max_file_bytes=inp.max_file_bytes, parse_timeout_s=inp.parse_timeout_s,
                              parse_memory_mb=inp.parse_memory_mb, max_line_bytes=inp.max_line_bytes,
                              max_text_chars=inp.max_text_chars, images=parse_request(spec)):
            docs.append((doc, [] if doc.get("error") else stage.process(doc)))
    ok = [(d, rows) for d, rows in docs if rows and not rows[0].get("error")]
    for d, rows in docs:
        if d.get("error") or not rows or rows[0].get("error"):
            why = d.get("error") or (rows[0].get("error") if rows else "no prompt rows")
            print(f"  {d.get('source')}: would be a dead letter: {why}")
    if not ok:
        raise Invalid(f"none of the first {len(docs)} documents of {inp.path!r} gives prompts (see above)")
    d, rows = ok[0]
    print(f"prompts of the first document ({d.get('source')}):")
    n = show_chars
    by_task = {r["task"]: r for r in rows}  # a task's samples 1..n-1 (<task>~i) share its prompt
    for t in spec.tasks:
        r = by_task.get(t.name)
        if r is None:
            continue
        if r.get("error"):  # this task alone fails on this document
            print(f"  task {t.name}: a dead letter for this document: {r['error']}")
            continue
        samples = sum(1 for k in by_task if base_task(k) == t.name)
        text = stage.tok.decode(list(r["prompt_ids"]))
        shown = text if len(text) <= 2 * n else f"{text[:n]} [...] {text[-n:]}"
        print(f"  task {t.name}: {prompt_length(r):,} prompt tokens, max_tokens {r['max_tokens']}"
              + (f", {len(r['images'])} images ({r['image_tokens']:,} of the tokens)" if r.get("images") else "")
              + (f", {samples} samples" if samples > 1 else "")
              + (f", long-input policy {r.get('long_input_policy')}" if r.get("long_input_policy") else ""))
        print("    " + shown.replace("\n", "\n    "))
    if has_images(spec):
        _images(spec, ok)
    longest = sorted(ok, key=lambda dr: -int(dr[1][0].get("doc_tokens") or len(dr[1][0]["prompt_ids"])))[:3]
    print(f"longest of the {len(ok)} sampled documents (context {stage.max_model_len:,} tokens):")
    for d, rows in longest:
        r = rows[0]
        policy = r.get("long_input_policy") or "fits"
        n_doc = int(r.get("doc_tokens") or 0) or len(r["prompt_ids"])  # null when it fits: the prompt is it
        print(f"  {d.get('source')}: {n_doc:,} {'document' if r.get('doc_tokens') else 'prompt'} tokens -> {policy}"
              + (f", {int(r.get('kept_tokens') or 0):,} kept" if r.get("kept_tokens") else ""))


def _images(spec, docs: list[tuple[dict, list[dict]]]) -> None:
    """Each image task's images and their tokens (as the model's processor counts them) in
    each sampled document: docs/multimodal.md."""
    tasks = [t.name for t in spec.tasks if t.images is not None]
    print(f"images per task in the {len(docs)} sampled documents (count, tokens):")
    for d, rows in docs:
        by_task = {r["task"]: r for r in rows}
        shown = [f"{t} {len(by_task[t].get('images') or [])} ({int(by_task[t].get('image_tokens') or 0):,})"
                 if t in by_task and not by_task[t].get("error") else f"{t} -" for t in tasks]
        print(f"  {d.get('source')}: " + ", ".join(shown))


def _estimate(spec, n_docs: int, max_model_len: int) -> None:
    try:
        from dlbatch.driver.chips import default_chip_files, local_available
        from dlbatch.driver.workload import job_workload
        from dlbatch.solver.commands import load_chips, plan_command

        chip_files = default_chip_files(spec.model.name)
        sample = job_workload(spec, sample=n_docs, max_model_len=max_model_len)
        chips = load_chips(chip_files, sample.model)
        available = {k: n for k, n in local_available(chip_files).items() if k in chips}
        if not available:
            print("estimate: none: no chip profile measured on this machine for this model "
                  "(`dlbatch profile` makes one; `dlbatch plan --available CHIP=N` plans for others)")
            return
        chunk = max(512, min(spec.batching.max_batch_tokens, 4096))
        plan = plan_command(chip_files, available, sample.model, sample.workload, "throughput", quiet=True,
                            chunk_tokens=chunk)
    except (ValueError, OSError) as e:  # an estimate is advice: its absence is not an invalid job
        print(f"estimate: none: {e}")
        return
    cost = f", ${plan.job_cost:,.2f}" if plan.job_cost >= 0.01 else ""
    print(f"estimate: {sample.docs_total:,} documents in about {plan.hours_for_job * 3600:,.0f} s on "
          f"{' '.join(f'{k}={n}' for k, n in available.items())} ({plan.docs_per_s:,.2f} documents/s{cost}; "
          f"`dlbatch plan` for the pools)")

"""`dlbatch validate JOB`: everything that can be checked before a run, without a model.

In order, each step printing what it found: the job file loads (schema, templates, the
cross-field checks of `load_job`); the pipeline exists; the run's configuration resolves
(`RunConfig`: the backend is installed and runs the model, the context length every later
step uses, as a run would resolve it); the inputs are listed (files,
bytes); the output path is writable (a probe file written and removed under its `_tmp/`);
the first documents are parsed (in the isolated parser, under the job's caps) and their
prompts built, each task's first prompt shown with its token count; the longest sampled
documents and what the long-input policy does to them; the plan's time and cost estimate
for this machine's profiled chips (or why there is none). Any failed check is one line
``error: ...`` naming the bad value, and exit code 2; nothing is started (no Ray, no
engine: only the model's config.json and tokenizer are read).
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
    from dlbatch.jobspec import JobSpecError, load_job

    try:
        spec = load_job(args.job, args.overrides)
    except (JobSpecError, FileNotFoundError) as e:
        print(f"error: invalid job file: {e}", file=sys.stderr)
        return EXIT_INVALID
    print(f"job {spec.name!r}: loads ({len(spec.tasks)} tasks, model {spec.model.name}, backend {spec.model.backend})")
    v = Validation(spec, max(1, args.docs), args.show_chars)
    try:
        for check in (v.pipeline, v.config, v.inputs, v.output, v.prompts, v.estimate):
            check()
    except Invalid as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    print(f"job {spec.name!r} is valid")
    return EXIT_OK


class Invalid(Exception):
    """A check that failed: its message names the bad value."""


class Validation:
    """The checks of one job, in order; `config` resolves the context length and `inputs`
    lists the files that the later checks use."""

    def __init__(self, spec, docs: int = 3, show_chars: int = 160):
        self.spec, self.docs, self.show_chars = spec, docs, show_chars
        self.files: list[str] = []
        self.max_model_len = 0

    def pipeline(self) -> None:
        _pipeline(self.spec)

    def config(self) -> None:
        self.max_model_len = _config(self.spec)

    def inputs(self) -> None:
        self.files = _inputs(self.spec)

    def output(self) -> None:
        _output(self.spec)

    def prompts(self) -> None:
        _prompts(self.spec, self.files, self.docs, self.show_chars, self.max_model_len)

    def estimate(self) -> None:
        _estimate(self.spec, self.docs, self.max_model_len)


def _pipeline(spec) -> None:
    from pipelines import get_pipeline

    try:
        get_pipeline(spec.pipeline)
    except ValueError as e:
        raise Invalid(f"pipeline: {e}") from None


def _config(spec) -> int:
    """The run's configuration as `dlbatch run` resolves it; -> its max_model_len."""
    from dlbatch.driver.config import RunConfig
    from dlbatch.workers.pools import JobFailed

    try:
        config = RunConfig.resolve(spec)
    except (ValueError, JobFailed) as e:
        raise Invalid(str(e)) from None
    print(f"model: backend {config.backend.name}, max_model_len {config.max_model_len:,} ({config.context_source})")
    print(f"layout: {layout_line(config.layout)}")
    return config.max_model_len


def layout_line(layout) -> str:
    """The pools a run starts and who chose them (`dlbatch.driver.layout.Layout`; None: an
    attached cluster's, chosen when the run sees its chips)."""
    if layout is None:
        return ("chosen by the solver when the run attaches to the cluster, from its nodes' chip:<name> resources "
                "(docs/cluster.md)")
    pools = ", ".join(f"{r} {p.chip} x{p.replicas}" + (f" ({p.device})" if p.device != "cpu" else "")
                      for r, p in layout.pools.items())
    return f"{pools}; chosen by {layout.source}: {layout.reason}"


def _inputs(spec) -> list[str]:
    from connectors import input_format, list_inputs
    from connectors.listing import _url_to_fs

    inp = spec.input
    try:
        files = list_inputs(inp.path, inp.format, dict(inp.storage_options))
    except (OSError, ValueError) as e:
        raise Invalid(f"input.path {inp.path!r}: {e}") from None
    if not files:
        raise Invalid(f"input.path {inp.path!r}: no {inp.format} files there")
    total = 0
    from connectors.hf_hub import is_hub_url

    hub = is_hub_url(files[0])  # a Hub dataset: one input, listing checked its config and split
    for f in ([] if hub else files[:10_000]):
        fs, p = _url_to_fs(f, dict(inp.storage_options))
        try:
            total += int(fs.info(p).get("size") or 0)
        except OSError as e:
            raise Invalid(f"input {f!r}: {e}") from None
    more = " (bytes of the first 10,000)" if len(files) > 10_000 else ""
    if hub:
        from connectors.listing import count_rows

        what = f"Hub dataset {inp.path}, {count_rows(files[0], inp.format, 1 << 62, dict(inp.storage_options)):,} rows"
    else:
        what = f"{len(files):,} {inp.format} files, {total / 1e6:,.1f} MB{more} under {inp.path}"
    print(f"inputs: {what}" + (f"; input.limit {inp.limit}" if inp.limit is not None else ""))
    if input_format(inp.format).has_columns:
        from dlbatch.prompts.columns import missing_columns, peek_columns

        cols = peek_columns(files[0], inp.format, inp.text_field, dict(inp.storage_options))
        print(f"columns (first rows of {files[0]}): {', '.join(sorted(cols)) or 'none'}")
        problems = missing_columns(spec, cols)
        if problems:
            raise Invalid(f"{files[0]}: " + "; ".join(problems))
    return files


def _output(spec) -> None:
    import uuid

    from dlbatch.output import FormatMismatch, open_store, run_store

    out = spec.output.path
    try:
        store = open_store(spec.output)
        files = store.files
        probe = files.path(f"_tmp/validate-{uuid.uuid4().hex[:8]}")
        files.fs.makedirs(files.path("_tmp"), exist_ok=True)
        files.fs.pipe_file(probe, b"dlbatch validate")
        files.fs.rm_file(probe)
    except (OSError, ValueError, ImportError) as e:
        raise Invalid(f"output.path {out!r} is not writable: {type(e).__name__}: {e}") from None
    try:
        run_store(store, spec.output)  # what a run writes: the format that wrote the output
    except FormatMismatch as e:
        raise Invalid(str(e)) from None
    manifest = files.read_json("_manifest.json")
    state = ("empty" if manifest is None else
             f"holds job {manifest.get('name')!r} ({'complete' if manifest.get('complete') else 'incomplete'}): "
             f"a run resumes it")
    print(f"output: {out} is writable; {state}")


def _prompts(spec, files: list[str], n_docs: int, show_chars: int, max_model_len: int) -> None:
    from connectors.parse import parse_file
    from dlbatch.prompts.stage import PromptStage
    from dlbatch.records import base_task

    inp = spec.input
    stage = PromptStage(spec, max_model_len=max_model_len)
    docs: list[tuple[dict, list[dict]]] = []
    for url in files:
        if len(docs) >= n_docs:
            break
        for doc in parse_file({"url": url, "max_rows": n_docs - len(docs)}, inp.format, inp.text_field,
                              inp.id_field, dict(inp.storage_options), inp.max_pages,
                              max_file_bytes=inp.max_file_bytes, parse_timeout_s=inp.parse_timeout_s,
                              parse_memory_mb=inp.parse_memory_mb):
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
        samples = sum(1 for k in by_task if base_task(k) == t.name)
        text = stage.tok.decode(list(r["prompt_ids"]))
        shown = text if len(text) <= 2 * n else f"{text[:n]} [...] {text[-n:]}"
        print(f"  task {t.name}: {len(r['prompt_ids']):,} prompt tokens, max_tokens {r['max_tokens']}"
              + (f", {samples} samples" if samples > 1 else "")
              + (f", long-input policy {r.get('long_input_policy')}" if r.get("long_input_policy") else ""))
        print("    " + shown.replace("\n", "\n    "))
    longest = sorted(ok, key=lambda dr: -int(dr[1][0].get("doc_tokens") or len(dr[1][0]["prompt_ids"])))[:3]
    print(f"longest of the {len(ok)} sampled documents (context {stage.max_model_len:,} tokens):")
    for d, rows in longest:
        r = rows[0]
        policy = r.get("long_input_policy") or "fits"
        n_doc = int(r.get("doc_tokens") or 0) or len(r["prompt_ids"])  # null when it fits: the prompt is it
        print(f"  {d.get('source')}: {n_doc:,} {'document' if r.get('doc_tokens') else 'prompt'} tokens -> {policy}"
              + (f", {int(r.get('kept_tokens') or 0):,} kept" if r.get("kept_tokens") else ""))


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

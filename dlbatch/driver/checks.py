"""What `dlbatch validate` and `dlbatch run` check before anything starts: one function,
`check_job`, both call, so they agree.

In order, each failure a `JobInvalid` (exit code 2, one line naming the bad value):

1. the pipeline exists;
2. the run's configuration resolves (`RunConfig.resolve`): the backend is installed, it runs
   the model, the context, every task's budget, the layout;
3. the inputs are listed: a missing path or one with no file of the format is named;
4. the fields the job reads are there: ``input.text_field`` and ``input.id_field`` in at
   least one of the first rows of the first input (a field no row has is the job's mistake,
   not every row's dead letter), the columns templates and ``output.keep_columns`` name;
5. the output: readable, writable (judged without writing anything: the nearest existing
   folder of a local path must be a writable folder; an object store's path must answer),
   holding the format the job writes, and, unless ``--fresh``, written by this same job
   (`check_resume_compatible`: a refused resume names its changed keys).

Nothing is written and nothing is started (no Ray, no engine): the model's config.json,
the inputs' first rows and the output's records are read.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

PEEK_ROWS = 100  # first rows of the first input read for the fields the job names


class JobInvalid(ValueError):
    """The job cannot run as written; the message names the bad value (exit code 2)."""


@dataclass
class CheckedJob:
    """What the checks found: the run's configuration, the listed inputs, the first input's
    columns (column formats), the output's manifest (None: nothing written) and whether a run
    resumes it as a new start (`restart_reason`)."""

    config: object  # RunConfig
    files: list[str]
    columns: set[str] = field(default_factory=set)
    manifest: dict | None = None
    restart_reason: str | None = None


def check_job(spec, plan: dict | None = None, *, fresh: bool = False, on_config=None) -> CheckedJob:
    """Every check of the module docstring, in order; raises `JobInvalid` at the first failure.
    ``on_config(config)``, when given, is called once the configuration resolves, before the
    inputs are listed (`dlbatch run` starts its workers there for a remote input)."""
    config = _config(spec, plan)
    if on_config is not None:
        on_config(config)
    files = _inputs(spec)
    columns = _fields(spec, files)
    manifest, restart = _output(spec, fresh)
    return CheckedJob(config=config, files=files, columns=columns, manifest=manifest, restart_reason=restart)


def _config(spec, plan):
    from dlbatch.driver.config import RunConfig
    from dlbatch.workers.pools import JobFailed
    from pipelines import get_pipeline

    try:
        get_pipeline(spec.pipeline)
    except ValueError as e:
        raise JobInvalid(f"pipeline: {e}") from None
    try:
        return RunConfig.resolve(spec, plan)
    except (ValueError, JobFailed, OSError) as e:
        raise JobInvalid(str(e)) from None


def _inputs(spec) -> list[str]:
    from connectors import list_inputs

    inp = spec.input
    if inp.format == "dataset":  # rows of the ray.data.Dataset given to dlbatch.run: no files
        return []
    try:
        files = list_inputs(inp.path, inp.format, dict(inp.storage_options), max_line_bytes=inp.max_line_bytes)
    except (OSError, ValueError) as e:
        raise JobInvalid(f"input.path {inp.path!r}: {e}") from None
    if not files:
        raise JobInvalid(f"input.path {inp.path!r}: no {inp.format} files there")
    return files


def _fields(spec, files: list[str]) -> set[str]:
    """The first input's columns; raises naming a field the job reads that none of its first
    rows has (`field_problems`) or a column a template or keep_columns names."""
    from connectors.formats import input_format
    from dlbatch.prompts.columns import check_columns

    if not input_format(spec.input.format).has_columns or not files:  # no files: a Dataset's rows
        return set()
    problem = field_problem(spec, files[0])
    if problem:
        raise JobInvalid(problem)
    try:
        return check_columns(spec, files)
    except ValueError as e:
        raise JobInvalid(str(e)) from None


_KEYS = re.compile(r"\(keys: (.*)\)$")


def field_problem(spec, url: str) -> str | None:
    """Why the job's ``input.text_field`` / ``input.id_field`` cannot be read from ``url``:
    none of its first PEEK_ROWS rows has it (each of them is a MissingField row), naming the
    field and the columns the rows have; None when some row reads (rows lacking a field the
    others have are those rows' dead letters)."""
    from connectors.formats import input_format
    from connectors.listing import read_document_file
    from connectors.records import MISSING_FIELD
    from dlbatch.prompts.columns import peek_columns

    inp, fmt = spec.input, input_format(spec.input.format)
    if fmt.id_field:  # a format with its own id and text (OpenAI batch lines): no field of the job's
        return None
    rows = list(read_document_file(url, inp.format, text_field=inp.text_field, id_field=inp.id_field,
                                   storage_options=dict(inp.storage_options), max_rows=PEEK_ROWS))
    if not rows or any(not r.get("error") for r in rows) or any(r.get("error_type") != MISSING_FIELD for r in rows):
        return None
    if inp.id_field and all(f"id field {inp.id_field!r}" in r["error"] for r in rows):
        cols = peek_columns(url, inp.format, inp.text_field, dict(inp.storage_options), rows=PEEK_ROWS)
        have = f"columns: {', '.join(sorted(cols))}" if cols else "no row has the text field either"
        return f"input.id_field {inp.id_field!r} is in none of the first {len(rows)} rows of {url} ({have})"
    keys = sorted({k.strip() for r in rows for m in [_KEYS.search(r["error"] or "")] if m
                   for k in m.group(1).split(",") if k.strip()})
    have = f"their columns: {', '.join(keys)}" if keys else "no columns"
    return (f"input.text_field {inp.text_field!r} is in none of the first {len(rows)} rows of {url} ({have}); "
            f"set input.text_field to the column that holds the text")


def _output(spec, fresh: bool) -> tuple[dict | None, str | None]:
    """(the output's manifest, why a run starts it over: None to resume it)."""
    from dlbatch.jobspec import ResumeMismatchError, check_resume_compatible, content_fields
    from dlbatch.output import FormatMismatch, open_store, run_store

    out = spec.output.path
    try:
        store = open_store(spec.output)
        writable_problem = _not_writable(store.files)
        manifest = store.files.read_json("_manifest.json")
    except (OSError, ValueError, ImportError) as e:
        raise JobInvalid(f"output.path {out!r} is not usable: {type(e).__name__}: {e}") from None
    if writable_problem:
        raise JobInvalid(f"output.path {out!r} is not writable: {writable_problem}")
    if fresh:
        return manifest, None
    try:
        run_store(store, spec.output)  # what a run writes: the format that wrote the output
    except FormatMismatch as e:
        raise JobInvalid(str(e)) from None
    restart = restart_reason(store, manifest)
    if manifest is not None and restart is None:
        try:
            check_resume_compatible(manifest.get("fields", {}), spec, output=out, content=content_fields(spec))
        except ResumeMismatchError as e:
            raise JobInvalid(str(e)) from None
    return manifest, restart


def restart_reason(store, manifest: dict | None) -> str | None:
    """Why a run starts this output over instead of resuming it, or None: an output whose
    last run stopped on its dead-letter share (``halted`` in the manifest) and that holds no
    result row is nothing but that run's dead letters; the fixed job (any change of it) starts
    it again, as ``--fresh`` would, without being asked."""
    if not manifest or not manifest.get("halted"):
        return None
    if store.progress()["rows"]:
        return None
    return (f"the last run stopped ({manifest['halted']}) and committed no result row: its dead letters are "
            f"removed and the job starts over")


def _not_writable(files) -> str | None:
    """Why the output folder cannot be written (None: it can), found without writing: a local
    path's nearest existing folder must be a writable directory; a remote one must answer."""
    protos = files.fs.protocol if isinstance(files.fs.protocol, (tuple, list)) else (files.fs.protocol,)
    if "file" in protos or "local" in protos:
        p = files.root
        while not os.path.exists(p):
            p = os.path.dirname(p)
        if not os.path.isdir(p):
            return f"{p} is a file, not a folder"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"no permission to write in {p}"
        return None
    try:
        files.fs.exists(files.root)
    except Exception as e:  # the remote store does not answer, or refuses us
        return f"{type(e).__name__}: {e}"
    return None

"""Which input columns a job reads, checked against the input before a run starts.

Templates and ``messages`` expressions name columns (`dlbatch.prompts.templates.column_references`)
and ``output.keep_columns`` lists them; `check_columns` reads the first rows of the job's
first input (`peek_columns`) and names the first task or key whose column is not there, so a
misspelt column is one error at start-up, not a dead letter per document. Rows of JSON inputs
may differ: a column found in any of the first rows counts, and a later row without it is
that row's dead letter (the template's StrictUndefined names it).

``RESULT_COLUMNS`` are the names every result row has (dlbatch/records.py);
`result_column_names` adds those a job's rows may have besides (``text``, ``valid``,
``output_error``, ``samples``, ``logprobs``, ``<task>_json`` of a JSON-schema task): an input
column kept under one of them would be dropped or ambiguous, so ``keep_columns`` refuses them.
"""
from __future__ import annotations

from dlbatch.records import RESULT_COLUMNS

PEEK_ROWS = 100
# result fields a job's rows may hold besides RESULT_COLUMNS: the text (include_text), the
# structured-output verdict (dlbatch/prompts/structured.py), the samples and logprobs (sampling.py)
OPTIONAL_RESULT_COLUMNS = ["text", "valid", "output_error", "samples", "logprobs"]


def result_column_names(tasks) -> list[str]:
    """Every column name a result row of a job with these tasks may have."""
    from dlbatch.prompts.structured import json_column

    typed = [json_column(t.name) for t in tasks if getattr(getattr(t, "output", None), "json_schema", None) is not None]
    return RESULT_COLUMNS + OPTIONAL_RESULT_COLUMNS + typed


def peek_columns(url: str, fmt: str, text_field: str, storage_options: dict | None = None,
                 rows: int = PEEK_ROWS) -> set[str]:
    """The columns of an input's first ``rows`` good rows (JSON rows may differ: their union);
    the text column included. Empty for inputs without columns (pdf, text)."""
    from connectors.columns import unpack_table
    from connectors.formats import input_format
    from connectors.listing import read_document_file

    if not input_format(fmt).has_columns:
        return set()
    names: set[str] = set()
    for row in read_document_file(url, fmt, text_field=text_field, storage_options=storage_options, max_rows=rows):
        if not row.get("error"):
            names.add(text_field)
            names.update(unpack_table(row.get("columns")).schema.names)
    return names


def missing_columns(spec, columns: set[str]) -> list[str]:
    """Problems of a job whose templates or ``output.keep_columns`` name columns the input
    lacks (``columns``: `peek_columns` of its first file), each naming the task and column."""
    from connectors.formats import input_format
    from dlbatch.prompts.templates import TEMPLATE_VARIABLES, column_references

    if not input_format(spec.input.format).has_columns or not columns:
        return []
    problems = []
    for t in spec.tasks:
        for c in sorted(column_references(t.source) - columns - set(TEMPLATE_VARIABLES)):
            problems.append(f"task {t.name!r} reads column {c!r}, which the input does not have "
                            f"(columns: {', '.join(sorted(columns))})")
    keep = spec.output.keep_columns
    if isinstance(keep, list):
        for c in keep:
            if c not in columns:
                problems.append(f"output.keep_columns: {c!r} is not a column of the input "
                                f"(columns: {', '.join(sorted(columns))})")
    return problems


def check_columns(spec, files: list[str]) -> set[str]:
    """The first input's columns (`peek_columns`; empty for inputs without columns); raises
    ValueError naming every column a template or keep_columns names that is not among them
    (see `missing_columns`)."""
    from connectors.formats import input_format

    if not files or not input_format(spec.input.format).has_columns:
        return set()
    cols = peek_columns(files[0], spec.input.format, spec.input.text_field, dict(spec.input.storage_options))
    problems = missing_columns(spec, cols)
    if problems:
        raise ValueError(f"{files[0]}: " + "; ".join(problems))
    return cols

"""The Arrow tables a store commits, and the keys that name their rows.

A flush's result rows become one table of `dlbatch.records.result_schema` (`result_table`:
the result columns, ``text`` when the job keeps it, the typed columns of structured and
sampled tasks, then the input columns ``output.keep_columns`` names, one type per column:
dlbatch/output/kept_columns.py); its dead letters one
table of `dlbatch.records.error_schema` (`error_table`). A row's key names it across
retries: ``(doc_id, task)`` for a result, ``(doc_id, "<task>:<stage>")`` for a dead letter
(task empty: the whole document). A part's name is a hash of its keys (`part_name`), so the
same rows committed again find the same file; the rows of a commit that raised but landed
are recognised by their keys and not committed twice.
"""
from __future__ import annotations

import hashlib
import time
import uuid

from dlbatch.records import ERROR_COLUMNS, RESULT_COLUMNS, error_schema, result_schema


def result_key(r: dict) -> tuple:
    """A result row's identity: (document, task), and its sample with ``output.samples: rows``."""
    i = r.get("sample_index")
    return (r["doc_id"], r["task"]) if i is None else (r["doc_id"], r["task"], i)


def error_key(r: dict) -> tuple:
    return (r["doc_id"], f"{r.get('task') or ''}:{r.get('stage')}")


def keys_digest(keys) -> str:
    return hashlib.sha256("\n".join(sorted("\t".join(map(str, k)) for k in keys)).encode()).hexdigest()[:20]


def new_run_tag() -> str:
    """This process's tag in the names of the parts it commits: ``<ms>-<6 hex>``."""
    return f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:6]}"


def part_name(run_tag: str, keys, gen: int | None = None) -> str:
    """The name of a part of rows with ``keys``: ``part-g<gen>-<run tag>-<hash>.parquet`` when
    committed under a lease of generation ``gen`` (its fencing token, dlbatch/output/fence.py),
    ``part-<run tag>-<hash>.parquet`` without a lease."""
    from dlbatch.output.fence import part_prefix

    return f"{part_prefix(gen) if gen is not None else 'part-'}{run_tag}-{keys_digest(keys)}.parquet"


def error_table(rows: list[dict]):
    import pyarrow as pa

    return pa.Table.from_pylist([{c: (None if r.get(c) is None else str(r.get(c))) for c in ERROR_COLUMNS}
                                 for r in rows], schema=error_schema())


def result_table(rows: list[dict], include_text: bool, extra_fields=(), kept=None):
    """The rows as a table; ``kept``: the input columns ``output.keep_columns`` names, one row
    per row, typed (`dlbatch.output.kept_columns.KeptColumns.fit`), appended after the result
    columns (a kept column named like a result column stays out)."""
    import pyarrow as pa

    cols = RESULT_COLUMNS + (["text"] if include_text else []) + [f.name for f in extra_fields]
    table = pa.Table.from_pylist([{c: r.get(c) for c in cols} for r in rows],
                                 schema=result_schema(include_text, extra_fields))
    if kept is None or not rows:
        return table
    for name in kept.schema.names:
        if name not in table.schema.names:
            table = table.append_column(kept.schema.field(name), kept.column(name))
    return table


def not_failed_with(error_types: set[str]):
    """(keep, tag): ``keep(table)`` is the dead letters of ``table`` except those of whole
    documents (no task) whose ``error_type`` is one of ``error_types``; ``tag`` those types
    as an Arrow array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = pa.array(sorted(error_types), pa.string())

    def keep(t):
        hit = pc.is_in(t.column("error_type").cast(pa.string()), value_set=values)
        if "task" in t.column_names:  # parts written before the task column: every row a whole document
            hit = pc.and_(hit, pc.is_null(t.column("task")))
        return t.filter(pc.invert(pc.fill_null(hit, False)))

    return keep, values


def not_from(sources: set[str], doc_ids: set[str] | None = None):
    """(keep, tag): ``keep(table)`` is the rows of ``table`` whose input file is none of
    ``sources`` (`connectors.versions.source_files` of their ``source``) — with ``doc_ids``,
    whose input file is none of them or whose document is none of those (edited rows of a
    table input, `dlbatch.driver.edits`); ``tag`` the sorted sources (and ids) as an Arrow array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from connectors.versions import source_files

    values = pa.array(sorted(sources), pa.string())
    ids = None if doc_ids is None else pa.array(sorted(doc_ids), pa.string())

    def keep(t):
        hit = pc.is_in(source_files(t.column("source")), value_set=values)
        if ids is not None:
            hit = pc.and_(hit, pc.is_in(t.column("doc_id"), value_set=ids))
        return t.filter(pc.invert(hit))

    return keep, (values if ids is None else pa.concat_arrays([values, ids]))

"""Edited rows of table inputs: which committed documents an input file no longer holds as
they were, so their rows are superseded before a rerun reads anything as done.

A PDF or text file is its document: a changed file is replaced whole (`JobRunner`). A JSONL,
Parquet or ``hf`` file holds many documents and is appended to, so a changed file is read
again here, in the driver, before the stream starts: each row's id and version
(`dlbatch.prompts.doc_identity.DocIdentity`, the rule the prompt stage applies). A committed
document of that file is stale when

- its id is no longer in the file (without ``input.id_field`` an edited row has a new id:
  the old one is gone), or
- its committed ``doc_version`` differs from the row's version now (with ``input.id_field``
  an edited row keeps its id), or
- it was a dead letter and the file now holds it as a good row (a fixed row is retried).

Stale documents lose their rows and dead letters (`Store.supersede(files, doc_ids)`), so the
stream redoes those still in the file; the rest of the file stays done. Rows committed
without a ``doc_version`` compare by id only. Only files whose recorded version changed are
read: a first run and an unchanged input cost nothing here; a changed file costs one read.
The order (supersede, then record the files' new versions) makes a crash in between redo the
comparison, never skip it.
"""
from __future__ import annotations

from typing import Iterable


def current_versions(spec, identity, url: str) -> tuple[dict[str, str], set[str]]:
    """({doc id: version} of the good rows of ``url`` now, {ids of its rows that fail to
    parse}), read as the stream reads it (`connectors.parse.parse_file`)."""
    from connectors.parse import parse_file
    from connectors.repair import repair_row

    inp = spec.input
    rows = parse_file({"url": url}, inp.format, inp.text_field, inp.id_field, dict(inp.storage_options),
                      inp.max_pages, max_file_bytes=inp.max_file_bytes, parse_timeout_s=inp.parse_timeout_s,
                      parse_memory_mb=inp.parse_memory_mb, max_line_bytes=inp.max_line_bytes,
                      max_text_chars=inp.max_text_chars)
    good, bad = {}, set()
    for row in rows:
        doc = identity.apply(repair_row(row))
        if doc.get("error"):
            bad.add(doc["doc_id"])
        else:
            good[doc["doc_id"]] = doc.get("doc_version")
    return good, bad


def stale_documents(store, spec, identity, files: Iterable[str]) -> dict[str, set[str]]:
    """{file: ids of its committed documents that are stale} (module docstring)."""
    from connectors.versions import source_files

    files = set(files)
    if not files or not identity.applies:
        return {}
    committed = _committed(store)
    errors = store.errors(columns=["doc_id", "source"])
    failed: dict[str, set[str]] = {}
    if errors.num_rows:
        for f, d in zip(source_files(errors.column("source")).to_pylist(), errors.column("doc_id").to_pylist()):
            if f in files:
                failed.setdefault(f, set()).add(d)
    out = {}
    for f in files:
        good, _ = current_versions(spec, identity, f)
        stale = {d for d, v in committed.get(f, {}).items()
                 if d not in good or (v is not None and good[d] is not None and v != good[d])}
        stale |= {d for d in failed.get(f, ()) if d in good}
        if stale:
            out[f] = stale
    return out


def _committed(store) -> dict[str, dict[str, str | None]]:
    """{file: {doc id: committed version}} of the committed result rows."""
    from connectors.versions import source_files

    if store.results(columns=["doc_id"]).num_rows == 0:
        return {}
    try:
        t = store.results(columns=["doc_id", "source", "doc_version"])
        versions = t.column("doc_version").to_pylist()
    except Exception:  # rows committed before rows had a version: compared by id only
        t = store.results(columns=["doc_id", "source"])
        versions = [None] * t.num_rows
    out: dict[str, dict[str, str | None]] = {}
    for f, d, v in zip(source_files(t.column("source")).to_pylist(), t.column("doc_id").to_pylist(), versions):
        out.setdefault(f, {})[d] = v
    return out

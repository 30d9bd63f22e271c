"""Inputs that changed since their rows were committed, and edited rows of table inputs: which
committed documents an input no longer holds as they were, so their rows are superseded before
a rerun reads anything as done (`supersede_changed`, called by `JobRunner` once per run).

A PDF or text file is its document: a changed file is replaced whole. A JSONL,
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

import logging
from typing import Iterable

log = logging.getLogger("dlbatch.run")


def supersede_changed(store, spec, files: list[str], report, preprocess=None) -> tuple[list[str], str, bool]:
    """-> (the inputs this run reads, the digest of their versions, whether each is one
    document). Inputs whose version changed since their rows were committed lose those rows
    first: a one-document file whole, a table file its edited documents (`supersede_edited`).
    Then the inputs' versions are recorded (after the rows went: a crash between redoes the
    comparison). ``report``: `RunReport` (inputs_replaced, rows_edited, the start-up phase)."""
    from connectors.formats import input_format
    from connectors.versions import input_versions, versions_digest

    by_file = input_format(spec.input.format).one_doc_per_file  # a source is done when its document is
    if spec.input.limit is not None and by_file:
        files = files[:spec.input.limit]
    report.startup.start("input_versions")
    recorded = store.files.read_sources()
    versions = input_versions(files, dict(spec.input.storage_options), cache=recorded)
    report.startup.end("input_versions")
    changed = sorted(f for f, (_, v) in versions.items() if f in recorded and recorded[f][1] != v)
    replaced = changed if by_file else []
    if replaced:
        n = store.supersede(set(replaced))
        log.warning("%d inputs changed since their rows were committed (%s); %d old rows removed, redoing them",
                    len(replaced), ", ".join(replaced[:5]), n)
    report.inputs_replaced = replaced
    report.rows_edited = 0 if by_file else supersede_edited(store, spec, changed, preprocess)
    if versions != recorded:
        store.files.write_sources({**{s: r for s, r in recorded.items() if s not in versions}, **versions})
    return files, versions_digest(versions, spec.input.limit), by_file


def supersede_edited(store, spec, changed: list[str], preprocess=None) -> int:
    """The rows of the stale documents of the table inputs ``changed`` go, so the stream redoes
    those still there. Returns the documents superseded."""
    from dlbatch.prompts.doc_identity import DocIdentity

    stale = stale_documents(store, spec, DocIdentity.for_job(spec, preprocess), changed)
    ids = set().union(*stale.values()) if stale else set()
    if ids:
        n = store.supersede(set(stale), ids)
        log.warning("%d rows of %s changed since their results were committed; %d old rows removed, redoing them",
                    len(ids), ", ".join(sorted(stale)[:5]), n)
    return len(ids)


def current_versions(spec, identity, url: str) -> tuple[dict[str, str], set[str]]:
    """({doc id: version} of the good rows of ``url`` now, {ids of its rows that fail to
    parse}), read as the stream reads it (`connectors.parse.parse_file`)."""
    from connectors.parse import parse_file
    from connectors.repair import repair_row
    from dlbatch.prompts.multimodal import parse_request

    inp = spec.input
    # a row's column images are part of its version: read here as the stream reads them
    request = parse_request(spec) if identity.image_columns else None
    rows = parse_file({"url": url}, inp.format, inp.text_field, inp.id_field, dict(inp.storage_options),
                      inp.max_pages, max_file_bytes=inp.max_file_bytes, parse_timeout_s=inp.parse_timeout_s,
                      parse_memory_mb=inp.parse_memory_mb, max_line_bytes=inp.max_line_bytes,
                      max_text_chars=inp.max_text_chars, images=request)
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

"""Parquet parts (``output.format: parquet``, and the rows behind ``openai_batch``): the
`Store` whose result rows are Parquet parts at the top of the output path.

Why not Ray Data's own checkpointing here: `ray.data.checkpoint.CheckpointConfig` tracks
progress by an id column that must survive every operator one row in, one row out. Our
pipeline fans one document out into K task rows and generation happens outside Ray Data
(in the worker pools the plan places), so a row-level checkpoint of the read side would
mark a document done before its K outputs exist. Instead the driver commits complete
documents: every row of a document goes into one Parquet part, written to `_tmp/` and
renamed into place (atomic on a local/POSIX filesystem; on object stores the final object
appears whole when its single PUT/copy completes). A rerun reads the committed parts and
skips every document already there, so each (document, task) appears exactly once.

Layout (the folder's own records, the lease and ``_errors/``: dlbatch/output/__init__.py):
    part-g<gen>-<ms>-<run tag>-<hash of its (doc_id, task) keys>[-e].parquet
                                   result rows (-e: dead letters in its footer); ``gen``: the
                                   generation of the lease they were committed under (``part-``
                                   and no ``g<gen>`` when committed without a lease)
    part-g<gen>-c<hash>.parquet    a merged part (dlbatch/output/compaction.py)
    _index/<part name>             the part's (doc_id, source, task, tokens): its index
    _compact/<merged part>.json    a merge in progress
    _fence.json, _orphans/         the fence of lease generations, the parts it ruled out
                                   (dlbatch/output/fence.py)

One commit per flush of complete documents (`commit`): the result rows and the dead-letter
rows of the documents it holds land together or not at all. The dead letters travel inside
the result part, in its Parquet footer (key ``dlbatch.errors``; the part's name ends in
``-e.parquet``), so one atomic rename commits both; the copy under ``_errors/`` that readers
use is written next, under the same name, and `recover` writes any copy a crash lost before
a resume reads progress. A flush with dead letters only is one part under ``_errors/``.

Exactly once through commit errors: a part's name is fixed by its rows, so retrying the same
rows finds the identical file and skips; a lost reply to the rename is detected by the sink
(the file is there with our bytes); and when a commit raised anyway, the parts folder
remembers it and, before the next commit, the rows that part holds are dropped if it landed.

Fenced commits: every rename re-reads the lease immediately before it; a part that a
process renamed into place after it lost the lease anyway is an orphan, never counted and
moved aside (dlbatch/output/fence.py). Before it reads progress or commits, a holder raises
the fence to its generation (`OutputFiles.fence_up`).

Kept input columns (``output.keep_columns``) have one type per column for the whole output;
a document whose value does not fit is its dead letter (dlbatch/output/kept_columns.py).

Resume cost: progress comes from the index files (a few columns, never the output text),
read in parallel; a part without an index (crash between the two writes) is read for its
index columns instead. Compaction merges many small parts into a few large ones.
"""
from __future__ import annotations

import json
import logging

from dlbatch.output.compaction import (COMPACT_MIN_PARTS, COMPACT_TARGET_BYTES, COMPACT_TARGET_ROWS, SMALL_ROWS,
                                       Compaction)
from dlbatch.output.dead_letters import DeadLetters
from dlbatch.output.files import OutputFiles
from dlbatch.output.kept_columns import KeptColumns
from dlbatch.output.parts import COMPACT_DIR, ERRORS_META, INDEX_DIR, PartsFolder
from dlbatch.output.progress import committed_progress, with_pending
from dlbatch.output.rows import (error_key, error_table, new_run_tag, not_failed_with, not_from, part_name, result_key,
                                 result_table)
from dlbatch.records import INDEX_COLUMNS, SAMPLE_INDEX, index_columns, result_schema

log = logging.getLogger("dlbatch.output.parquet_store")

ERRORS_SUFFIX = "-e.parquet"  # name ending of a result part that carries dead letters


class ParquetStore:
    """Committed rows as Parquet parts: reading them (results, dead letters, progress from the
    index), committing them exactly once, superseding a replaced input's rows, compacting.
    The folder, its lease and records are `files`'; the result parts a `PartsFolder`'s; the
    dead letters `DeadLetters`'."""

    format = "parquet"

    def __init__(self, files: OutputFiles | str, storage_options: dict | None = None, keep_columns=()):
        """``files``: the output folder (an `OutputFiles`, with its lease) or its URL."""
        self.files = files if isinstance(files, OutputFiles) else OutputFiles(files, storage_options)
        self.keep_columns = keep_columns  # output.keep_columns: input columns appended to result rows
        self.kept = KeptColumns(keep_columns) if keep_columns else None
        self.run_tag = new_run_tag()
        self.parts = PartsFolder(self.files, "", index_columns=INDEX_COLUMNS, optional_index_columns=(SAMPLE_INDEX,))
        self.dead = DeadLetters(self.files, self.run_tag)

    # ---- reading what is committed ------------------------------------------------------------
    def results(self, columns: list[str] | None = None):
        return self.parts.read_all(columns)

    def errors(self, columns: list[str] | None = None):
        return self.dead.read(columns)

    def index(self):
        """Every committed row's INDEX_COLUMNS as one Table."""
        import pyarrow as pa

        tables = [t.select(index_columns(t.schema.names)) for _, t in self.parts.indexes()]
        return (pa.concat_tables(tables, promote_options="default") if tables
                else pa.table({c: [] for c in INDEX_COLUMNS}))

    def progress(self, tasks: set[str] | None = None) -> dict:
        """`committed_progress` of the index files and the dead letters (those of parts whose
        ``_errors/`` copy a crash lost included)."""
        self.files.fence_up()
        pending = [t for _, t in self.pending_error_copies()]
        return committed_progress(self.index(), with_pending(self.errors(), pending), tasks)

    # ---- committing -----------------------------------------------------------------------------
    def commit(self, rows: list[dict], errors: list[dict], include_text: bool, extra_fields=()) -> str | None:
        """Commit a flush of complete documents: result ``rows`` and dead-letter ``errors``
        land together (one part; its dead letters in its footer) or not at all.
        ``extra_fields``: pyarrow fields appended to the schema (dlbatch/prompts/structured.py
        `result_fields`: valid, output_error, one typed `<task>_json` per JSON-schema task)."""
        self.files.before_commit()
        rows, errors = self._drop_landed(rows, errors)
        rows, errors, kept = self._fit_kept(rows, errors, include_text, extra_fields)
        if not rows:
            return self.commit_errors(errors) if errors else None
        table = result_table(rows, include_text, extra_fields, kept)
        keys = [result_key(r) for r in rows] + [error_key(r) for r in errors]
        name = part_name(self.run_tag, keys, self.files.generation)
        if errors:
            etable = error_table(errors)
            meta = dict(table.schema.metadata or {})
            meta[ERRORS_META] = json.dumps(etable.to_pylist()).encode()
            table = table.replace_schema_metadata(meta)
            name = name[:-len(".parquet")] + ERRORS_SUFFIX
        url = self.parts.write(table, name, remember=True)
        self.parts.write_index(name, table)
        if errors:  # the copy readers use; `recover` rewrites it when a crash lost it
            self.dead.copy(etable, name)
        self.dead.ensure_readable()
        return url

    def commit_errors(self, rows: list[dict]) -> str | None:
        self.files.before_commit()
        url = self.dead.commit(rows)
        self.dead.ensure_readable()
        return url

    def orphans(self) -> list[str]:
        return self.files.sweep_orphans()

    def _fit_kept(self, rows: list[dict], errors: list[dict], include_text: bool, extra_fields):
        """(rows, errors, kept columns): the documents whose kept columns do not fit the
        output's types become dead letters (`KeptColumns`); types from the first committed part."""
        if self.kept is None:
            return rows, errors, None
        return self.kept.fit(rows, errors, result_schema(include_text, extra_fields).names, self._committed_schema)

    def _committed_schema(self):
        """The schema of the first committed part (None: nothing committed)."""
        import pyarrow.parquet as pq

        from connectors.io_retry import call_with_retry

        parts = self.parts.parts()
        if not parts:
            return None
        with call_with_retry(self.files.fs.open, parts[0], "rb", op=f"open {parts[0]}") as f:
            return pq.read_schema(f)

    def _drop_landed(self, rows: list[dict], errors: list[dict]) -> tuple[list[dict], list[dict]]:
        """``rows`` and ``errors`` without those that earlier commits which raised did commit
        after all (their reply was lost): such a result part gets its index and the copy of
        its footer dead letters now."""
        for name, t in self.parts.landed():
            got = {result_key(r) for r in t.to_pylist()}
            rows = [r for r in rows if result_key(r) not in got]
            self.parts.write_index(name, t)
            dead = _footer_errors(t.schema.metadata)
            if dead is not None:  # its dead letters landed with it: their copy, and no second commit
                self.dead.copy(dead, name)
                got = {error_key(r) for r in dead.to_pylist()}
                errors = [r for r in errors if error_key(r) not in got]
        return rows, self.dead.drop_landed(errors)

    def pending_error_copies(self) -> list[tuple[str, object]]:
        """[(part name, its dead letters)] of result parts whose ``_errors/`` copy is missing
        (a crash between a part and its copy): read from the parts' footers."""
        import pyarrow.parquet as pq

        from connectors.io_retry import call_with_retry

        parts, found = self.parts.listing()
        out = []
        for p in parts:
            name = self.parts.name(p)
            if not name.endswith(ERRORS_SUFFIX) or self.dead.has(name, found):
                continue
            with call_with_retry(self.files.fs.open, p, "rb", op=f"open {p}") as f:
                dead = _footer_errors(pq.read_schema(f).metadata)
            if dead is not None:
                out.append((name, dead))
        return out

    # ---- changing what is committed -------------------------------------------------------------
    def recover(self) -> dict:
        """Before a resume reads progress: write the ``_errors/`` copies a crash lost, finish
        or drop interrupted merges (of the results, then of the dead letters). A holder raises
        the fence first, so nothing a process that lost the lease renames later is finished."""
        self.files.fence_up()
        copies = self.pending_error_copies()
        for name, t in copies:
            self.dead.copy(t, name)
        if copies:
            log.warning("wrote %d dead-letter copies a crash had lost (their parts were committed)", len(copies))
        merges = Compaction(self.parts).recover() + self.dead.recover()
        return {"error_copies": len(copies), "compactions": merges}

    def supersede(self, sources: set[str], doc_ids: set[str] | None = None) -> int:
        """Remove every committed row of ``sources`` (inputs replaced since their rows were
        committed; with ``doc_ids``, only those documents' rows: edited rows of a table
        input): result rows, their index, dead letters. Each part is rewritten alone,
        crash-safely as a merge of one part (a record, the part without those rows, then the
        old part deleted), or deleted when every row goes. Returns the result rows removed."""
        self.recover()
        keep, tag = not_from(sources, doc_ids)
        removed = Compaction(self.parts).rewrite(keep, tag, self.parts.indexes())
        self.dead.supersede(keep, tag)
        return removed

    def retry_dead_letters(self, error_types: set[str]) -> int:
        """Remove the dead letters of whole documents failed with one of ``error_types``. After
        `recover` every footer's dead letters have their copy under ``_errors/``; a result part
        whose copy loses rows is first rewritten without its footer (a merge of one part: the
        same rows, the copy alone records its dead letters), then the copies are rewritten
        (`DeadLetters.supersede`), each step crash-safe as a merge."""
        self.recover()
        keep, tag = not_failed_with(error_types)
        paths = self.dead.parts.parts()
        hit = {self.dead.parts.name(p) for p, t in zip(paths, self.dead.parts.read(paths))
               if keep(t).num_rows < t.num_rows}
        comp = Compaction(self.parts)
        for p in self.parts.parts():
            if self.parts.name(p) in hit:
                comp.merge([p])
        return self.dead.supersede(keep, tag)

    def compact(self, min_parts: int = COMPACT_MIN_PARTS, small_rows: int = SMALL_ROWS,
                target_rows: int = COMPACT_TARGET_ROWS, target_bytes: int = COMPACT_TARGET_BYTES) -> dict:
        """Merge small parts into large ones (`Compaction.compact`), after `recover`: a merged
        part drops its parts' footers, so their dead letters' copies must exist first."""
        self.recover()
        return Compaction(self.parts).compact(min_parts, small_rows, target_rows, target_bytes)

    def clear(self) -> int:
        """--fresh: the result parts at the top of the output (a job writes none deeper), their
        index and merge records, the dead letters, and the folder's records (`OutputFiles.clear`)."""
        def ours(rel: str) -> bool:
            return (("/" not in rel and rel.startswith("part-") and rel.endswith(".parquet"))
                    or rel.startswith((f"{INDEX_DIR}/", f"{COMPACT_DIR}/")) or self.dead.holds(rel))

        return self.files.clear(ours)


def _footer_errors(meta):
    """The dead letters a result part's footer metadata carries, as a Table (None: none)."""
    meta = meta or {}
    return error_table(json.loads(meta[ERRORS_META])) if ERRORS_META in meta else None

"""Committed job output: exactly-once rows, dead letters, manifest, report.

Why not Ray Data's own checkpointing here: `ray.data.checkpoint.CheckpointConfig` tracks
progress by an id column that must survive every operator one row in, one row out. Our
pipeline fans one document out into K task rows and generation happens outside Ray Data
(in the worker pools the plan places), so a row-level checkpoint of the read side would
mark a document done before its K outputs exist. Instead the driver commits complete
documents: every row of a document goes into one Parquet part, written to `_tmp/` and
renamed into place (atomic on a local/POSIX filesystem; on object stores the final object
appears whole when its single PUT/copy completes). A rerun reads the committed parts and
skips every document already there, so each (document, task) appears exactly once.

Layout under the output path:
    part-<ms>-<run tag>-<hash of its (doc_id, task) keys>[-e].parquet result rows (-e: dead letters in its footer)
    _index/<part name>             the part's (doc_id, source, task, tokens): its index
    _compact/<merged part>.json    a compaction in progress (see `OutputStore.compact`)
    _errors/part-*.parquet         dead-letter rows (doc_id, source, stage, error_type, error)
    _manifest.json                 the job fingerprint (a rerun with other settings is refused)
    _lease/<n>.json                the writer's lease (dlbatch.output.lease)
    _sources.parquet               each input's content version when last listed: a replaced input's
                                   rows are superseded (`supersede`) and the input redone
    _report.json / .html / .png    the run report

One commit per flush of complete documents (`commit`): the result rows and the dead-letter
rows of the documents it holds land together or not at all. The dead letters travel inside
the result part, in its Parquet footer (key ``dlbatch.errors``; the part's name ends in
``-e.parquet``), so one atomic rename commits both; the copy under ``_errors/`` that readers
use is written next, under the same name, and `recover` writes any copy a crash lost
before a resume reads progress. A flush with dead letters only is one part under ``_errors/``.

One writer per output: every change (commits, the manifest, compaction, ``--fresh``) is
made under the output's lease (dlbatch.output.lease) when one is attached (``self.lease``):
each change first checks that this process still holds it.

Exactly once through commit errors: a part's name is fixed by its rows, so retrying the same
rows finds the identical file and skips; a lost reply to the rename is detected by the
sink (the file is there with our bytes); and when a commit raised anyway, the store
remembers it and, before the next commit, drops the rows that part holds if it landed.

Resume cost: progress comes from the index files (a few columns, never the output text),
read in parallel; a part without an index (crash between the two writes) is read for its
index columns instead. The index is written after its part, so it never claims rows that
are not committed. Compaction merges many small parts into a few large ones.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid

from dlbatch.output.compaction import (COMPACT_MIN_PARTS, COMPACT_TARGET_BYTES, COMPACT_TARGET_ROWS,  # noqa: F401
                                       ERRORS_META, SMALL_ROWS)
from dlbatch.output.files import COMPACT_DIR, ERRORS_DIR, INDEX_DIR, SOURCES_FILE, OutputFiles  # noqa: F401
from dlbatch.prompts.columns import RESULT_COLUMNS  # the columns every result row has

log = logging.getLogger("dlbatch.output.parquet_store")

ERROR_COLUMNS = ["doc_id", "source", "task", "stage", "error_type", "error"]  # task: None = the whole document
INDEX_COLUMNS = ["doc_id", "source", "task", "prompt_tokens", "output_tokens"]
ERRORS_SUFFIX = "-e.parquet"  # name ending of a result part that carries dead letters


def keys_digest(keys) -> str:
    return hashlib.sha256("\n".join(sorted(f"{a}\t{b}" for a, b in keys)).encode()).hexdigest()[:20]


class OutputStore(OutputFiles):
    """Committed rows: reading them (results, dead letters, progress from the index),
    committing them exactly once, superseding a replaced input's rows. The folder, its
    lease and small records are `OutputFiles`'; merges are `Compaction`'s."""


    def __init__(self, url: str, storage_options: dict | None = None, keep_columns=()):
        super().__init__(url, storage_options)
        self._run_tag = f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:6]}"
        self._uncertain: list[tuple[str, str]] = []  # (dir, part name) of commits that raised
        self.keep_columns = keep_columns  # output.keep_columns: input columns appended to result rows

    # ---- reading what is committed ------------------------------------------------------
    def _listing(self) -> tuple[list[str], set[str]]:
        """(committed result parts, every file under the output): one listing."""
        from connectors.sink import committed_paths, find_all

        found = find_all(self.fs, self.root)
        top = [f for f in found if "/" not in self._rel(f)]
        return committed_paths(self.fs, self.root, top + [f for f in found if self._rel(f).startswith(COMPACT_DIR)]), set(found)

    def results(self, columns: list[str] | None = None):
        import pyarrow as pa

        from connectors.sink import read_paths

        parts, _ = self._listing()
        tables = read_paths(self.fs, parts, columns)
        return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})

    def errors(self, columns: list[str] | None = None):
        from connectors.sink import read_committed

        return read_committed(self._u(ERRORS_DIR), self.storage_options, columns=columns)

    def part_indexes(self) -> list[tuple[str, object]]:
        """[(part path, its index Table)] for every committed part: the index file when there
        is one, else the part's index columns (never its text)."""
        from connectors.sink import read_paths

        parts, found = self._listing()
        with_index = [p for p in parts if self._p(f"{INDEX_DIR}/{self._rel(p)}") in found]
        indexed = set(with_index)
        without = [p for p in parts if p not in indexed]
        got = dict(zip(with_index, read_paths(self.fs, [self._p(f"{INDEX_DIR}/{self._rel(p)}") for p in with_index])))
        got.update(zip(without, read_paths(self.fs, without, INDEX_COLUMNS)))
        return [(p, got[p]) for p in parts]

    def index(self):
        """Every committed row's INDEX_COLUMNS as one Table."""
        import pyarrow as pa

        tables = [t.select(INDEX_COLUMNS) for _, t in self.part_indexes()]
        return pa.concat_tables(tables) if tables else pa.table({c: [] for c in INDEX_COLUMNS})

    def progress(self, tasks: set[str] | None = None) -> dict:
        """What is committed, from the index files and the dead letters, computed in Arrow
        (the driver holds no Python object per row: a resume of a million documents costs
        columns, not sets of strings):

        ``done_ids``   documents whose outcomes cover every task of ``tasks`` (a result row,
                       or a dead letter of that task alone); any result row when None
        ``failed_ids`` documents dead-lettered whole (no result row)
        ``n_done``, ``n_failed``, ``rows``, ``prompt_tokens``, ``output_tokens``,
        ``duplicates`` (result rows beyond one per (document, task))
        ``sources``    input files with committed rows (`connectors.versions.source_file`)
        ``sources_done`` one-document files (pdf, text) whose document is done or failed"""
        import pyarrow as pa
        import pyarrow.compute as pc

        from connectors.versions import source_files

        idx = self.index()
        err = self.errors()  # dead letters are few; parts written before the task column lack it
        pending = [t for _, t in self.pending_error_copies()]
        if pending:
            err = pa.concat_tables([err, *pending], promote_options="default") if err.num_rows else \
                pa.concat_tables(pending)

        def strings(t, c):
            return (t.column(c).cast(pa.string()) if c in t.column_names else pa.nulls(t.num_rows, pa.string()))

        res = pa.table({c: strings(idx, c) for c in ("doc_id", "source", "task")})
        errs = pa.table({c: strings(err, c) for c in ("doc_id", "source", "task")})
        with_rows = pc.unique(res["doc_id"])
        alone = errs.filter(pc.and_(pc.is_valid(errs["task"]), pc.is_in(errs["doc_id"], value_set=with_rows)))
        if tasks is None:
            done = with_rows
        else:  # a task that failed alone has its outcome: the document is not redone for it
            outcomes = pa.concat_tables([res.select(["doc_id", "task"]), alone.select(["doc_id", "task"])])
            outcomes = outcomes.filter(pc.is_in(outcomes["task"], value_set=pa.array(sorted(tasks), pa.string())))
            per = outcomes.group_by("doc_id").aggregate([("task", "count_distinct")])
            done = per.filter(pc.equal(per["task_count_distinct"], len(set(tasks))))["doc_id"].combine_chunks()
        failed = pc.unique(errs.filter(pc.invert(pc.is_in(errs["doc_id"], value_set=with_rows)))["doc_id"])
        pairs = pa.concat_tables([res.select(["source", "doc_id"]), errs.select(["source", "doc_id"])])
        files = pc.unique(source_files(pairs["source"]).drop_null())
        whole = pairs.filter(pc.equal(pairs["source"], source_files(pairs["source"])))  # one-document files
        ok = pc.is_in(whole["doc_id"], value_set=pa.concat_arrays([done, failed.cast(pa.string())]))
        g = pa.table({"source": whole["source"], "ok": ok}).group_by("source").aggregate([("ok", "all")])
        n = res.num_rows
        return {
            "rows": n,
            "done_ids": done,
            "failed_ids": failed,
            "n_done": len(done),
            "n_failed": len(failed),
            "sources_done": set(g.filter(g["ok_all"])["source"].to_pylist()),
            "sources": set(files.to_pylist()),
            "prompt_tokens": int(pc.sum(idx.column("prompt_tokens")).as_py() or 0) if n else 0,
            "output_tokens": int(pc.sum(idx.column("output_tokens")).as_py() or 0) if n else 0,
            "duplicates": n - res.group_by(["doc_id", "task"]).aggregate([]).num_rows,
        }

    # ---- committing ---------------------------------------------------------------------------
    def _part_name(self, keys) -> str:
        return f"part-{self._run_tag}-{keys_digest(keys)}.parquet"

    def _without_landed(self, rows: list[dict], key, dest: str) -> list[dict]:
        """Drop rows an earlier commit to ``dest`` that raised did write after all (its reply
        was lost). Uncertain commits to other directories stay for their own next commit."""
        from connectors.io_retry import call_with_retry
        from connectors.sink import read_parquet_bytes

        pending = [u for u in self._uncertain if u[0] == dest]
        self._uncertain = [u for u in self._uncertain if u[0] != dest]
        for d, name in pending:
            fs, p = self.fs, f"{self.fs._strip_protocol(d).rstrip('/')}/{name}"
            if hasattr(fs, "invalidate_cache"):
                fs.invalidate_cache(p)
            if not call_with_retry(fs.exists, p, op=f"exists {p}"):
                continue
            t = read_parquet_bytes(call_with_retry(fs.cat_file, p, op=f"read {p}"))
            landed = {key(r) for r in t.to_pylist()}
            log.warning("a commit that reported an error landed (%s): %d rows not committed again", name, len(landed))
            rows = [r for r in rows if key(r) not in landed]
            if d == self.url:
                self._write_index(name, t)
                meta = t.schema.metadata or {}
                if ERRORS_META in meta:  # its dead letters landed with it: their copy, and no second commit
                    self._commit(_error_table(json.loads(meta[ERRORS_META])), self._u(ERRORS_DIR), name)
                    self._uncertain.append((self._u(ERRORS_DIR), name))
        return rows

    def _commit(self, table, dest: str, name: str) -> str:
        from connectors.sink import write_parquet_atomic

        self._guard()
        try:
            return write_parquet_atomic(table, dest, name, self.storage_options)
        except BaseException:
            self._uncertain.append((dest, name))
            raise

    def _write_index(self, name: str, table) -> None:
        """The part's index; a failure only costs a slower resume (the part is read instead)."""
        from connectors.sink import write_parquet_atomic

        try:
            write_parquet_atomic(table.select(INDEX_COLUMNS), self._u(INDEX_DIR), name, self.storage_options,
                                 on_conflict="overwrite")
        except OSError as e:
            log.warning("could not write the index of %s (resume reads the part instead): %s", name, e)

    def commit(self, rows: list[dict], errors: list[dict], include_text: bool, extra_fields=()) -> str | None:
        """Commit a flush of complete documents: result ``rows`` and dead-letter ``errors``
        land together (one part; its dead letters in its footer) or not at all."""
        rows = self._without_landed(rows, key=_result_key, dest=self.url)
        errors = self._without_landed(errors, key=_error_key, dest=self._u(ERRORS_DIR))
        if not rows:
            return self.commit_errors(errors) if errors else None
        table = self._result_table(rows, include_text, extra_fields)
        name = self._part_name([_result_key(r) for r in rows] + [_error_key(r) for r in errors])
        if errors:
            etable = _error_table(errors)
            meta = dict(table.schema.metadata or {})
            meta[ERRORS_META] = json.dumps(etable.to_pylist()).encode()
            table = table.replace_schema_metadata(meta)
            name = name[:-len(".parquet")] + ERRORS_SUFFIX
        url = self._commit(table, self.url, name)
        self._write_index(name, table)
        if errors:  # the copy readers use; `recover` rewrites it when a crash lost it
            self._commit(etable, self._u(ERRORS_DIR), name)
        return url

    def commit_results(self, rows: list[dict], include_text: bool, extra_fields=()) -> str | None:
        """``extra_fields``: pyarrow fields appended to the schema (dlbatch/prompts/structured.py
        `result_fields`: valid, output_error, one typed `<task>_json` per JSON-schema task)."""
        return self.commit(rows, [], include_text, extra_fields)

    def _result_table(self, rows: list[dict], include_text: bool, extra_fields=()):
        """The rows as a table; with ``self.keep_columns`` (output.keep_columns), the input
        columns each row carries (``columns``, connectors/columns.py) after the result columns."""
        import pyarrow as pa

        cols = RESULT_COLUMNS + (["text"] if include_text else []) + [f.name for f in extra_fields]
        table = pa.Table.from_pylist([{c: r.get(c) for c in cols} for r in rows],
                                     schema=result_schema(include_text, extra_fields))
        if not self.keep_columns or not rows:
            return table
        from connectors.columns import columns_table

        names = None if self.keep_columns == "all" else list(self.keep_columns)
        kept = columns_table([r.get("columns") for r in rows], names)
        for name in kept.schema.names:
            if name not in table.schema.names:  # "all": a column named like a result column stays out
                table = table.append_column(kept.schema.field(name), kept.column(name))
        return table

    def commit_errors(self, rows: list[dict]) -> str | None:
        rows = self._without_landed(rows, key=_error_key, dest=self._u(ERRORS_DIR))
        if not rows:
            return None
        name = self._part_name(_error_key(r) for r in rows)
        return self._commit(_error_table(rows), self._u(ERRORS_DIR), name)

    def pending_error_copies(self) -> list[tuple[str, object]]:
        """[(part name, its dead letters)] of result parts whose ``_errors/`` copy is missing
        (a crash between a part and its copy): read from the parts' footers."""
        import pyarrow.parquet as pq

        from connectors.io_retry import call_with_retry

        parts, found = self._listing()
        out = []
        for p in parts:
            name = self._rel(p)
            if "/" in name or not name.endswith(ERRORS_SUFFIX) or self._p(f"{ERRORS_DIR}/{name}") in found:
                continue
            with call_with_retry(self.fs.open, p, "rb", op=f"open {p}") as f:
                meta = pq.read_schema(f).metadata or {}
            if ERRORS_META in meta:
                out.append((name, _error_table(json.loads(meta[ERRORS_META]))))
        return out

    def recover(self) -> dict:
        """Before a resume reads progress: write the ``_errors/`` copies a crash lost, finish
        or drop interrupted compactions, remove temporaries of dead commits."""
        copies = self.pending_error_copies()
        for name, t in copies:
            self._commit(t, self._u(ERRORS_DIR), name)
        if copies:
            log.warning("wrote %d dead-letter copies a crash had lost (their parts were committed)", len(copies))
        return {"error_copies": len(copies), "compactions": self.recover_compactions()}

    def supersede(self, sources: set[str]) -> int:
        """Remove every committed row of ``sources`` (inputs replaced since their rows were
        committed): result rows, their index, dead letters. Each part is rewritten alone,
        crash-safely as a compaction of one part (a record, the part without those rows, then
        the old part deleted), or deleted when every row goes. Returns the rows removed."""
        import pyarrow as pa
        import pyarrow.compute as pc

        from connectors.versions import source_files

        self.recover()
        values = pa.array(sorted(sources), pa.string())

        def keep(t):  # rows whose input file is not one of ``sources``
            return t.filter(pc.invert(pc.is_in(source_files(t.column("source")), value_set=values)))

        removed = 0
        for p, idx in self.part_indexes():
            drop = idx.num_rows - keep(idx).num_rows
            removed += drop
            if drop == idx.num_rows:
                self._rm(p)
                self._rm(self._p(f"{INDEX_DIR}/{self._rel(p)}"))
            elif drop:
                self._merge([p], keep=keep, tag=values)
        self._supersede_errors(keep, values)
        return removed

    def _supersede_errors(self, keep, tag) -> None:
        """The dead-letter parts without the rows ``keep`` drops (`Compaction.rewrite_errors`)."""
        from dlbatch.output.compaction import Compaction

        Compaction(self).rewrite_errors(keep, tag)

    def recover_compactions(self) -> int:
        """Finish or drop every compaction a crash left (`Compaction.recover`)."""
        from dlbatch.output.compaction import Compaction

        return Compaction(self).recover()

    def compact(self, min_parts: int = COMPACT_MIN_PARTS, small_rows: int = SMALL_ROWS,
                target_rows: int = COMPACT_TARGET_ROWS, target_bytes: int = COMPACT_TARGET_BYTES) -> dict:
        """Merge small parts into large ones (`Compaction.compact`)."""
        from dlbatch.output.compaction import Compaction

        return Compaction(self).compact(min_parts, small_rows, target_rows, target_bytes)

    def _merge(self, paths: list[str], keep=None, tag=None, base: str = "") -> str:
        """Replace ``paths`` by one part of their rows that ``keep`` keeps (`Compaction.merge`)."""
        from dlbatch.output.compaction import Compaction

        return Compaction(self).merge(paths, keep, tag, base)


def _result_key(r: dict) -> tuple:
    return (r["doc_id"], r["task"])


def _error_key(r: dict) -> tuple:
    return (r["doc_id"], f"{r.get('task') or ''}:{r.get('stage')}")


def _error_table(rows: list[dict]):
    import pyarrow as pa

    return pa.Table.from_pylist([{c: (None if r.get(c) is None else str(r.get(c))) for c in ERROR_COLUMNS}
                                 for r in rows], schema=error_schema())


def result_schema(include_text: bool, extra_fields=()):
    import pyarrow as pa

    fields = [("doc_id", pa.string()), ("source", pa.string()), ("task", pa.string()), ("output", pa.string()),
              ("prompt_tokens", pa.int64()), ("output_tokens", pa.int64()), ("finish_reason", pa.string()),
              ("truncated", pa.bool_()), ("model", pa.string()), ("ttft_s", pa.float64()), ("latency_s", pa.float64()),
              # long documents (docs/long_documents.md): the policy applied (null: the document fit),
              # its length, the tokens of it the model saw, the chunks of a map-reduce
              ("long_input_policy", pa.string()), ("doc_tokens", pa.int64()), ("kept_tokens", pa.int64()),
              ("chunks", pa.int64())]
    if include_text:
        fields.append(("text", pa.string()))
    return pa.schema(fields + [(f.name, f.type) for f in extra_fields])


def error_schema():
    import pyarrow as pa

    return pa.schema([(c, pa.string()) for c in ERROR_COLUMNS])

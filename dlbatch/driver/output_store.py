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
    _lease/<n>.json                the writer's lease (dlbatch.driver.lease)
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
made under the output's lease (dlbatch.driver.lease) when one is attached (``self.lease``):
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

from dlbatch.prompts.columns import RESULT_COLUMNS  # the columns every result row has

log = logging.getLogger("dlbatch.driver.output_store")

ERROR_COLUMNS = ["doc_id", "source", "task", "stage", "error_type", "error"]  # task: None = the whole document
INDEX_COLUMNS = ["doc_id", "source", "task", "prompt_tokens", "output_tokens"]
INDEX_DIR = "_index"
COMPACT_DIR = "_compact"
SOURCES_FILE = "_sources.parquet"  # each input's version when last listed (connectors.versions)
ERRORS_DIR = "_errors"
ERRORS_META = b"dlbatch.errors"  # footer key of a result part: the dead letters committed with it
ERRORS_SUFFIX = "-e.parquet"  # name ending of a result part that carries dead letters
# compaction defaults: parts under SMALL_ROWS rows are small; merge them when more than
# COMPACT_MIN_PARTS exist, into parts of about COMPACT_TARGET_ROWS rows
SMALL_ROWS = 4096
COMPACT_MIN_PARTS = 64
COMPACT_TARGET_ROWS = 65536
COMPACT_TARGET_BYTES = 64 << 20  # ... or of about this many Parquet bytes (a merge holds them in memory)


def keys_digest(keys) -> str:
    return hashlib.sha256("\n".join(sorted(f"{a}\t{b}" for a, b in keys)).encode()).hexdigest()[:20]


class OutputStore:
    def __init__(self, url: str, storage_options: dict | None = None, keep_columns=()):
        import fsspec

        from connectors.secrets import resolve_options

        self.url = url.rstrip("/")
        self.storage_options = resolve_options(dict(storage_options or {}))  # ${env:NAME} read here
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.root = self.root.rstrip("/")
        self._run_tag = f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:6]}"
        self._uncertain: list[tuple[str, str]] = []  # (dir, part name) of commits that raised
        self.lease = None  # dlbatch.driver.lease.OutputLease held while this process changes the output
        self.keep_columns = keep_columns  # output.keep_columns: input columns appended to result rows

    def take_lease(self, job: str, command: str = "run", stale_s: float | None = None):
        """Take the output's lease (raises LeaseHeld naming the holder); `release_lease` gives it back."""
        from dlbatch.driver.lease import STALE_S, OutputLease

        self.lease = OutputLease(self.fs, self.root, self.url, job, command, stale_s=stale_s or STALE_S).acquire()
        return self.lease

    def release_lease(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def _guard(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def _p(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _u(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _rel(self, path: str) -> str:
        return path[len(self.root):].lstrip("/") if path.startswith(self.root) else path

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

    # ---- committing -----------------------------------------------------------------------
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

    def read_json(self, name: str) -> dict | None:
        from connectors.io_retry import call_with_retry

        p = self._p(name)
        if not call_with_retry(self.fs.exists, p, op=f"exists {p}"):
            return None
        return json.loads(call_with_retry(self.fs.cat_file, p, op=f"read {p}"))

    def write_json(self, name: str, data: dict) -> None:
        """Write then rename, so readers never see half a file."""
        self._write_file(name, json.dumps(data, indent=2, default=str).encode())

    def _write_file(self, name: str, body: bytes) -> None:
        from connectors.io_retry import call_with_retry
        from connectors.sink import sync_dir, write_durable

        self._guard()
        call_with_retry(self.fs.makedirs, self._p("_tmp"), exist_ok=True, op="makedirs")
        tmp = self._p(f"_tmp/{uuid.uuid4().hex}")
        call_with_retry(write_durable, self.fs, tmp, body, op=f"write {tmp}")
        if "/" in name:
            call_with_retry(self.fs.makedirs, self._p(name.rsplit("/", 1)[0]), exist_ok=True, op="makedirs")
        call_with_retry(self.fs.mv, tmp, self._p(name), op=f"commit {name}")
        sync_dir(self.fs, self._p(name).rsplit("/", 1)[0])

    # ---- input versions (connectors.versions) -------------------------------------------------
    def read_sources(self) -> dict[str, list]:
        """{source: [stat key or None, version]} recorded when the inputs were last listed."""
        from connectors.io_retry import call_with_retry
        from connectors.sink import read_parquet_bytes

        p = self._p(SOURCES_FILE)
        if not call_with_retry(self.fs.exists, p, op=f"exists {p}"):
            return {}
        t = read_parquet_bytes(call_with_retry(self.fs.cat_file, p, op=f"read {p}")).to_pydict()
        return {s: [k, v] for s, k, v in zip(t["source"], t["stat"], t["version"])}

    def write_sources(self, sources: dict[str, list]) -> None:
        import pyarrow as pa

        from connectors.sink import table_to_parquet_bytes

        names = sorted(sources)
        t = pa.table({"source": pa.array(names, pa.string()),
                      "stat": pa.array([sources[n][0] for n in names], pa.string()),
                      "version": pa.array([sources[n][1] for n in names], pa.string())})
        self._write_file(SOURCES_FILE, table_to_parquet_bytes(t))

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
        """The dead-letter parts without the rows ``keep`` drops: each rewritten alone (a
        compaction of one part), or deleted when every row goes."""
        from connectors.sink import committed_paths, find_all, read_paths

        eroot = self._p(ERRORS_DIR)
        eparts = committed_paths(self.fs, eroot, find_all(self.fs, eroot))
        for p, t in zip(eparts, read_paths(self.fs, eparts)):
            drop = t.num_rows - keep(t).num_rows
            if drop == t.num_rows:
                self._rm(p)
            elif drop:
                self._merge([p], keep=keep, tag=tag, base=ERRORS_DIR)

    def _rm(self, path: str) -> None:
        from connectors.io_retry import call_with_retry

        self._guard()
        try:
            call_with_retry(self.fs.rm_file, path, op=f"delete {path}")
        except FileNotFoundError:
            pass

    # ---- compaction -------------------------------------------------------------------------
    def recover_compactions(self) -> int:
        """Finish (merged part committed) or drop (it is not) every compaction record left by
        a crash, of the results and of the dead letters; removes index files whose part is
        gone. Returns records handled."""
        from connectors.io_retry import call_with_retry
        from connectors.sink import find_all, read_parquet_bytes

        found = set(find_all(self.fs, self.root))
        n = 0
        for at in ("", f"{ERRORS_DIR}/"):
            recs = sorted(f for f in found if self._rel(f).startswith(f"{at}{COMPACT_DIR}/") and f.endswith(".json"))
            for r in recs:
                rec = json.loads(call_with_retry(self.fs.cat_file, r, op=f"read {r}"))
                merged = self._p(at + rec["merged"])
                if merged in found:
                    if not at and self._p(f"{INDEX_DIR}/{rec['merged']}") not in found:
                        t = read_parquet_bytes(call_with_retry(self.fs.cat_file, merged, op=f"read {merged}"))
                        self._write_index(rec["merged"], t)
                    for name in rec["replaces"]:
                        if self._p(at + name) in found:
                            self._rm(self._p(at + name))
                self._rm(r)
            n += len(recs)
        parts = {self._rel(f) for f in find_all(self.fs, self.root) if "/" not in self._rel(f)}
        for f in found:
            rel = self._rel(f)
            name = rel[len(INDEX_DIR) + 1:]
            if rel.startswith(f"{INDEX_DIR}/") and "/" not in name and name not in parts:
                self._rm(f)  # its part was compacted away: an index is written only after its part
        return n

    def compact(self, min_parts: int = COMPACT_MIN_PARTS, small_rows: int = SMALL_ROWS,
                target_rows: int = COMPACT_TARGET_ROWS, target_bytes: int = COMPACT_TARGET_BYTES) -> dict:
        """Merge the parts of fewer than ``small_rows`` rows into parts of about
        ``target_rows`` rows (or ``target_bytes`` Parquet bytes, whichever comes first) when
        more than ``min_parts`` of them exist.

        One merge: (1) the record ``_compact/<M>.json`` naming M and the parts S it replaces;
        (2) M, written atomically like any part, then its index; (3) the parts S, then their
        index files, deleted; (4) the record deleted. Readers skip S while the record and
        M both exist (connectors.sink.compaction_hidden), so a crash at any step leaves
        every row visible exactly once; `recover_compactions` finishes or drops the rest."""
        self.recover()
        small = [(p, t.num_rows) for p, t in self.part_indexes() if t.num_rows < small_rows]
        if len(small) <= min_parts:
            return {"parts_before": len(small), "merged_parts": 0, "parts_written": 0}
        from connectors.io_retry import call_with_retry

        sizes = {k: v.get("size") or 0 for k, v in
                 call_with_retry(self.fs.find, self.root, maxdepth=1, detail=True, op=f"find {self.root}").items()}
        groups, cur, n, nbytes = [], [], 0, 0
        for p, rows in small:
            cur.append(p)
            n += rows
            nbytes += sizes.get(p, 0)
            if n >= target_rows or nbytes >= target_bytes:
                groups.append(cur)
                cur, n, nbytes = [], 0, 0
        if len(cur) > 1:
            groups.append(cur)
        groups = [g for g in groups if len(g) > 1]
        for g in groups:
            self._merge(g)
        return {"parts_before": len(small), "merged_parts": sum(len(g) for g in groups), "parts_written": len(groups)}

    def _merge(self, paths: list[str], keep=None, tag=None, base: str = "") -> str:
        """Replace the parts ``paths`` (under ``base``: "" results, ERRORS_DIR dead letters)
        by one part holding their rows (``keep(table)`` of them); see `compact`."""
        import pyarrow as pa

        from connectors.sink import read_paths, write_parquet_atomic

        at = f"{base}/" if base else ""
        names = [self._rel(p)[len(at):] for p in paths]
        key = chr(10).join(names) + (f"{chr(10)}keep:{tag}" if keep is not None else "")
        merged = f"part-c{hashlib.sha256(key.encode()).hexdigest()[:24]}.parquet"
        record = f"{at}{COMPACT_DIR}/{merged[:-len('.parquet')]}.json"
        self.write_json(record, {"merged": merged, "replaces": names})
        table = pa.concat_tables(read_paths(self.fs, paths), promote_options="default")
        if keep is not None:
            table = keep(table)
        meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != ERRORS_META}
        table = table.replace_schema_metadata(meta or None)  # the copies under _errors/ exist (recover ran)
        write_parquet_atomic(table, self._u(base) if base else self.url, merged, self.storage_options)
        if not base:
            self._write_index(merged, table)
        for p, n in zip(paths, names):
            self._rm(p)
            if not base:
                self._rm(self._p(f"{INDEX_DIR}/{n}"))
        self._rm(self._p(record))
        log.info("%s %d parts (%d rows) into %s", "compacted" if keep is None else "rewrote", len(paths),
                 table.num_rows, at + merged)
        return merged

    def clear(self) -> int:
        """--fresh: delete what this job wrote under the output path and nothing else: the
        result parts at its top level (a job writes none deeper), its own folders
        (``_errors/``, ``_index/``, ``_compact/``, ``_tmp/``), manifest and report. Sub-folders
        (another job's output, a ``year=2024/`` partition) and every other file stay; so does
        the lease, which the caller holds. An output this job last wrote as a Delta table
        (its manifest says so; the job now asks for Parquet parts) loses its Delta log too,
        newest entry first, so no reader finds a table whose data files are gone."""
        from connectors.io_retry import call_with_retry

        if not call_with_retry(self.fs.exists, self.root, op=f"exists {self.root}"):
            return 0
        was_delta = ((self.read_json("_manifest.json") or {}).get("fields") or {}).get("output.format") == "delta"
        found = [(f[len(self.root):].lstrip("/"), f) for f in call_with_retry(self.fs.find, self.root,
                                                                                op=f"find {self.root}")]
        logs = sorted((x for x in found if x[0].startswith("_delta_log/")), reverse=True)  # newest entry first
        n = 0
        for rel, f in logs + [x for x in found if not x[0].startswith("_delta_log/")]:
            ours = (rel.startswith((f"{ERRORS_DIR}/", "_tmp/", f"{INDEX_DIR}/", f"{COMPACT_DIR}/"))
                    or rel in ("_manifest.json", "_report.json", "_report.html", "_report.png", SOURCES_FILE)
                    or ("/" not in rel and rel.startswith("part-") and rel.endswith(".parquet"))
                    or (was_delta and rel.startswith("_delta_log/")))
            if ours:
                self._guard()
                call_with_retry(self.fs.rm_file, f, op=f"delete {f}")
                n += 1
        return n


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

"""Delta Lake output (``output.format: delta``): the job's result rows as one Delta table.

`DeltaStore` is the `Store` whose result rows live in a Delta table at the output path
itself (its ``_delta_log/`` and data files ``part-*.parquet``), written with the
``deltalake`` package (delta-rs). A sibling of the Parquet store, not a kind of it: what the
two share they hold, not inherit — the folder and its lease (`OutputFiles`), the dead
letters (`DeadLetters`, ``_errors/``). Everything else lives in names starting with ``_``
that Delta readers skip: the lease (``_lease/``), ``_manifest.json``, ``_sources.arrow``
and the report.

Exactly once. One flush of complete documents is one Delta transaction (an append). It
carries an application transaction ``(app_id, version)``: ``app_id`` is this run's
(``dlbatch-<job fingerprint>-<run tag>``), ``version`` the run's commit sequence 1, 2, ...
Delta makes a commit visible whole or not at all (the log entry ``_delta_log/<n>.json``
is created exclusively: a rename on local disk, a conditional put on S3), and the table's
snapshot remembers the highest version committed per ``app_id``. So:

- before every attempt of a commit the store reads ``transaction_version(app_id)``; when it
  is already at ``version`` the commit landed (an earlier attempt's reply was lost) and
  the retry is a no-op;
- a commit that raised is remembered; before the next commit, the rows it held are dropped
  from that commit when its version is in the log (as the Parquet store does);
- a rerun after ``kill -9`` reads progress from the table's current snapshot: a document's
  rows are all there (its transaction is in the log) or none is; data files a dead commit
  left without a log entry are invisible to every Delta reader.

Fenced by the log. Every transaction a lease holder commits (appends, deletes, optimize)
also carries the application transaction ``("dlbatch-lease", <its lease generation>)``, and
a holder's first act, before it reads progress, is its *fence*: a transaction of no rows
carrying its generation (on an output without a table: the table created, empty, with the
result columns; the first flush adds its other columns by schema merge). Delta's conflict
check does the rest: a commit is checked against every transaction committed since the
snapshot it read, and two transactions that set the same application id conflict
("concurrent transaction"). So a holder paused after its checks and taken over finds, when
it wakes, its commit rejected by the new holder's fence — and a snapshot read after that fence
shows a newer generation, which the store refuses before writing (`LeaseLost`). A process that
lost the lease makes nothing visible in the table, ever: the new holder read everything that
landed before its fence, and nothing lands after it. (A stale process's written but
uncommitted data files stay invisible to every Delta reader; ``vacuum`` removes them.)

Dead letters of a flush that also has result rows land with them. Invariant: *a file
under ``_errors/_pending/`` counts only when its transaction is in the Delta log.* The flush
writes its dead letters first to ``_errors/_pending/<app_id>-<version>.parquet`` (hidden
from readers), then commits the rows; after the commit the file is published as
``_errors/part-<app_id>-<version>.parquet`` (the copy readers use, an idempotent write)
and the pending file removed. ``progress()`` counts a pending file whose transaction
landed (a crash between commit and publish), ``recover()`` publishes those and deletes the
ones whose transaction never landed. A flush of dead letters only is one part under
``_errors/``, as in the Parquet store.

Other changes: ``supersede(sources)`` is one Delta delete transaction (plus the dead letters'
rewrite, `DeadLetters.supersede`); ``compact()`` is ``optimize.compact()`` (one transaction)
then ``vacuum`` with the table's retention (default 7 days: only files removed from the
table more than a week ago go, so no reader of a recent snapshot loses a file);
``clear()`` (``--fresh``) deletes the Delta log (newest entry first), the data files, the
dead letters and the folder's records; never a Parquet store's ``_index/`` or ``_compact/``.

Object stores: ``storage_options`` are fsspec's (``key``, ``secret``, ``client_kwargs``);
the Delta side gets them translated to delta-rs names (`delta_storage_options`), and
upper-case object_store keys (``AWS_REGION``, ``AWS_ENDPOINT_URL``, ...) pass as they are.
delta-rs 1.x commits on S3 with conditional puts; one writer per output is still the
lease's job (the lease, not Delta, keeps two runs from interleaving commits and bookkeeping).
"""
from __future__ import annotations

import logging
import time

from dlbatch.output.compaction import COMPACT_MIN_PARTS, COMPACT_TARGET_BYTES
from dlbatch.output.dead_letters import ERRORS_DIR, DeadLetters
from dlbatch.output.files import MANIFEST, OutputFiles
from dlbatch.output.kept_columns import KeptColumns
from dlbatch.output.lease import LeaseLost
from dlbatch.output.parts import PartsFolder
from dlbatch.output.progress import committed_progress, with_pending
from dlbatch.output.rows import (error_key, error_table, new_run_tag, not_failed_with, not_from, result_key,
                                 result_table)
from dlbatch.records import INDEX_COLUMNS, index_columns, result_schema

log = logging.getLogger("dlbatch.output.delta_store")

PENDING_DIR = f"{ERRORS_DIR}/_pending"  # dead letters whose transaction may not have landed
DELTA_LOG = "_delta_log"
COMMIT_ATTEMPTS = 4  # a Delta commit that raised is retried (after checking it did not land)
LEASE_APP = "dlbatch-lease"  # application id whose version is the lease generation of the last holder to commit


def _deltalake():
    try:
        import deltalake
    except ImportError:
        raise ImportError("output.format 'delta' needs the deltalake package: pip install 'dlbatch[delta]'") from None
    return deltalake


def delta_storage_options(url: str, options: dict) -> dict[str, str] | None:
    """fsspec/s3fs ``storage_options`` as delta-rs (object_store) options; None for a local path."""
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    out: dict[str, str] = {}
    if scheme in ("s3", "s3a"):
        kw = dict(options.get("client_kwargs") or {})
        names = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN",
                 "endpoint_url": "AWS_ENDPOINT_URL", "region_name": "AWS_REGION"}
        for src in (options, kw):
            for k, v in src.items():
                if k in names and v is not None:
                    out[names[k]] = str(v)
        if options.get("anon"):
            out["AWS_SKIP_SIGNATURE"] = "true"
        if out.get("AWS_ENDPOINT_URL", "").startswith("http://"):
            out["AWS_ALLOW_HTTP"] = "true"
    out.update({k: str(v) for k, v in options.items() if k.isupper() and v is not None})
    return out or None


def _sql_string(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _txn_name(app_id: str, version: int) -> str:
    return f"{app_id}-{version:08d}.parquet"


def _parse_txn_name(name: str) -> tuple[str, int]:
    app_id, version = name[:-len(".parquet")].rsplit("-", 1)
    return app_id, int(version)


def _schema(dt):
    """The table's schema as a pyarrow Schema (the result columns' when there is no table)."""
    import pyarrow as pa

    return pa.schema(dt.schema().to_arrow()) if dt is not None else result_schema(False, ())


def _delete_predicate(dt, sources: set[str], doc_ids: set[str] | None) -> str | None:
    """The SQL predicate of the rows of input files ``sources`` (their ``source`` values in the
    table; with ``doc_ids``, of those documents only); None when the table holds none."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from connectors.versions import source_files

    src = dt.to_pyarrow_table(columns=["source"]).column("source").combine_chunks()
    hit = pc.unique(src.filter(pc.is_in(source_files(src), value_set=pa.array(sorted(sources), pa.string()))))
    if not len(hit):
        return None
    where = f"source IN ({', '.join(_sql_string(s) for s in hit.to_pylist())})"
    if doc_ids is not None:
        where += f" AND doc_id IN ({', '.join(_sql_string(d) for d in sorted(doc_ids))})"
    return where


def _check_fence(dt, gen: int | None, url: str) -> None:
    """Raise `LeaseLost` when the snapshot ``dt`` holds the fence of a lease generation newer
    than ``gen`` (this process's)."""
    if gen is not None and dt is not None and (dt.transaction_version(LEASE_APP) or 0) > gen:
        raise LeaseLost(f"the Delta table {url} is fenced by lease generation {dt.transaction_version(LEASE_APP)} "
                        f"(this process holds {gen}): another process took the lease over; nothing more is "
                        f"committed by this process")


class DeltaStore:
    """Committed rows as a Delta table: transactions with an application transaction id,
    dead letters counted once their transaction is in the log (module docstring)."""

    format = "delta"

    def __init__(self, files: OutputFiles | str, storage_options: dict | None = None, keep_columns=()):
        """``files``: the output folder (an `OutputFiles`, with its lease) or its URL."""
        self._dl = _deltalake()
        self.files = files if isinstance(files, OutputFiles) else OutputFiles(files, storage_options)
        self.keep_columns = keep_columns  # output.keep_columns: input columns appended to result rows
        self.kept = KeptColumns(keep_columns) if keep_columns else None
        self.run_tag = new_run_tag()
        self.dead = DeadLetters(self.files, self.run_tag)
        self.pending = PartsFolder(self.files, PENDING_DIR)  # one file per transaction with dead letters
        self.delta_options = delta_storage_options(self.files.url, self.files.storage_options)
        self._app_id: str | None = None
        self._seq = 0  # this run's commit sequence: the version of its application transaction
        self._uncertain_txns: list[tuple[int, set, set]] = []  # (version, result keys, error keys) that raised
        self._log_fenced: int | None = None  # the lease generation whose fence this store committed

    # ---- the table ------------------------------------------------------------------------
    def table(self):
        """The Delta table's current snapshot, or None before the first commit."""
        dl = self._dl
        try:
            return dl.DeltaTable(self.files.url, storage_options=self.delta_options)
        except dl.exceptions.TableNotFoundError:
            return None

    @property
    def app_id(self) -> str:
        """This run's application transaction id: the job fingerprint (from the manifest the
        runner writes before any commit) and the run tag."""
        if self._app_id is None:
            fp = str((self.files.read_json(MANIFEST) or {}).get("fingerprint") or "nojob")
            self._app_id = f"dlbatch-{fp[:16]}-{self.run_tag}"
        return self._app_id

    def _landed(self, app_id: str, version: int, dt=None) -> bool:
        dt = dt if dt is not None else self.table()
        return dt is not None and (dt.transaction_version(app_id) or 0) >= version

    # ---- reading what is committed -----------------------------------------------------------
    def results(self, columns: list[str] | None = None):
        import pyarrow as pa

        dt = self.table()
        return dt.to_pyarrow_table(columns=columns) if dt is not None else pa.table({})

    def errors(self, columns: list[str] | None = None):
        return self.dead.read(columns)

    def index(self):
        """Every committed row's INDEX_COLUMNS, read from the current snapshot (no text)."""
        import pyarrow as pa

        dt = self.table()
        if dt is None:
            return pa.table({c: pa.array([], pa.string() if c in ("doc_id", "source", "task") else pa.int64())
                             for c in INDEX_COLUMNS})
        return dt.to_pyarrow_table(columns=index_columns([f.name for f in dt.schema().fields]))

    def progress(self, tasks: set[str] | None = None) -> dict:
        """`committed_progress` of the snapshot and the dead letters (those of landed
        transactions whose copy is not published yet included)."""
        self.fence_up()
        pending = [t for _, t in self.pending_error_copies()]
        return committed_progress(self.index(), with_pending(self.errors(), pending), tasks)

    def pending_error_copies(self) -> list[tuple[str, object]]:
        """[(name, dead letters)] of pending files whose transaction landed but whose
        ``_errors/`` copy is not written yet (a crash between the two)."""
        files = self.pending.parts()
        if not files:
            return []
        dt = self.table()
        out = []
        for f in files:
            name = self.pending.name(f)
            if self._landed(*_parse_txn_name(name), dt=dt) and not self.dead.has(f"part-{name}"):
                out.append((name, self.pending.read([f])[0]))
        return out

    # ---- committing -------------------------------------------------------------------------
    def commit(self, rows: list[dict], errors: list[dict], include_text: bool, extra_fields=()) -> str | None:
        """One flush = one Delta transaction ``(app_id, version)``; its dead letters are
        counted only once that transaction is in the log (module docstring)."""
        self.fence_up()
        self.files.before_commit()
        rows, errors = self._without_landed_txns(rows, errors)
        kept = None
        if self.kept is not None:
            skip = result_schema(include_text, extra_fields).names
            rows, errors, kept = self.kept.fit(rows, errors, skip, lambda: _schema(self.table()))
        if not rows:
            return self.commit_errors(errors) if errors else None
        table = result_table(rows, include_text, extra_fields, kept)
        self._seq += 1
        version = self._seq
        try:
            if errors:
                self.pending.write(error_table(errors), _txn_name(self.app_id, version))
            self._append(table, version)
        except BaseException:
            self._uncertain_txns.append((version, {result_key(r) for r in rows}, {error_key(r) for r in errors}))
            raise
        if errors:
            self._publish(_txn_name(self.app_id, version))
        self.dead.ensure_readable()
        return self.files.url

    def commit_errors(self, rows: list[dict]) -> str | None:
        self.fence_up()
        self.files.before_commit()
        url = self.dead.commit(rows)
        self.dead.ensure_readable()
        return url

    def orphans(self) -> list[str]:
        return self.files.sweep_orphans()

    # ---- the fence -----------------------------------------------------------------------------
    def fence_up(self) -> None:
        """Before a holder reads progress or changes anything: the fence of ``_errors/``
        (`OutputFiles.fence_up`) and its fence in the Delta log, once per lease (module
        docstring); without a lease, nothing."""
        self.files.fence_up()
        gen = self.files.generation
        if gen is not None and self._log_fenced != gen:
            self._transact(None, None)
            self._log_fenced = gen

    def _props(self, app_version: int | None = None):
        """The commit properties of a transaction: this run's (app_id, ``app_version``) when
        given, and the lease generation when a lease is held."""
        dl, gen = self._dl, self.files.generation
        txns = ([dl.Transaction(self.app_id, app_version)] if app_version is not None else []) + \
            ([dl.Transaction(LEASE_APP, gen)] if gen is not None else [])
        return dl.CommitProperties(app_transactions=txns) if txns else None

    def _fenced_out(self, dt) -> None:
        _check_fence(dt, self.files.generation, self.files.url)

    def _append(self, table, version: int) -> None:
        self._transact(table, version)

    def _transact(self, table, version: int | None) -> None:
        """Commit ``table`` (appended) as one transaction carrying ``(app_id, version)`` and the
        lease generation, retried; an attempt that finds the version in the log (an earlier
        one landed, its reply lost) writes nothing. ``table`` and ``version`` None: the fence
        (no rows, the lease generation only; landed when the log carries that generation)."""
        dl, gen = self._dl, self.files.generation
        for attempt in range(COMMIT_ATTEMPTS):
            self.files.guard()
            dt = self.table()
            if version is not None and self._landed(self.app_id, version, dt):
                log.warning("Delta commit %s v%d is in the log already (a lost reply): not written again",
                            self.app_id, version)
                return
            if version is None and dt is not None and dt.transaction_version(LEASE_APP) == gen:
                return
            self._fenced_out(dt)
            self.files.verify()  # the lease read immediately before the commit
            try:
                self._write(dt, table if table is not None else _schema(dt).empty_table(), self._props(version))
                return
            except (dl.exceptions.SchemaMismatchError, dl.exceptions.DeltaProtocolError):
                raise
            except (OSError, dl.exceptions.DeltaError) as e:
                self._fenced_out(self.table())  # rejected by a newer holder's fence: final
                if attempt == COMMIT_ATTEMPTS - 1:
                    raise
                what = f"commit {self.app_id} v{version}" if version is not None else f"fence of generation {gen}"
                log.warning("Delta %s failed (%s: %s); retrying", what, type(e).__name__, e)
                time.sleep(0.5 * 2 ** attempt)

    def _write(self, dt, table, props) -> None:
        """One commit attempt against the snapshot ``dt`` (None: create the table; refused if
        it exists by then). The fault drills pause a process here, after its checks."""
        dl = self._dl
        if dt is None:
            dl.write_deltalake(self.files.url, table, mode="error", storage_options=self.delta_options,
                               commit_properties=props)
        else:
            dl.write_deltalake(dt, table, mode="append", schema_mode="merge", commit_properties=props)

    def _without_landed_txns(self, rows: list[dict], errors: list[dict]) -> tuple[list[dict], list[dict]]:
        """Drop the rows of earlier commits that raised but are in the log after all."""
        if not self._uncertain_txns:
            return rows, errors
        pending, self._uncertain_txns = self._uncertain_txns, []
        dt = self.table()
        for version, rkeys, ekeys in pending:
            name = _txn_name(self.app_id, version)
            if not self._landed(self.app_id, version, dt):
                self.files.rm(self.pending.path(name))  # its transaction never landed
                continue
            log.warning("a Delta commit that reported an error landed (v%d): %d rows not committed again",
                        version, len(rkeys))
            rows = [r for r in rows if result_key(r) not in rkeys]
            errors = [r for r in errors if error_key(r) not in ekeys]
            if ekeys:
                self._publish(name)
        return rows, errors

    def _publish(self, name: str) -> None:
        """The readers' copy of a landed transaction's dead letters, then its pending file removed."""
        p = self.pending.path(name)
        if not self.files.exists(f"{PENDING_DIR}/{name}"):
            return
        self.dead.copy(self.pending.read([p])[0], f"part-{name}", remember=False)
        self.files.rm(p)

    # ---- changing what is committed ---------------------------------------------------------
    def recover(self) -> dict:
        """Before a resume reads progress: publish the dead letters of landed transactions,
        delete those of transactions that never landed (their writer is gone: we hold the
        lease and our fence is in the log), finish or drop interrupted dead-letter rewrites."""
        self.fence_up()
        dt = self.table()
        published = dropped = 0
        for f in self.pending.parts():
            name = self.pending.name(f)
            if self.run_tag in name:
                continue  # this run's own: `commit` handles them
            if self._landed(*_parse_txn_name(name), dt=dt):
                self._publish(name)
                published += 1
            else:
                self.files.rm(f)
                dropped += 1
        if published:
            log.warning("wrote %d dead-letter copies a crash had lost (their transactions were committed)", published)
        return {"error_copies": published, "pending_dropped": dropped, "compactions": self.dead.recover()}

    def supersede(self, sources: set[str], doc_ids: set[str] | None = None) -> int:
        """Remove every committed row of ``sources`` (with ``doc_ids``: of those documents
        only): one Delta delete transaction for the result rows, then the dead letters
        rewritten (`DeadLetters.supersede`)."""
        self.recover()
        keep, values = not_from(sources, doc_ids)
        removed = 0
        dt = self.table()
        where = _delete_predicate(dt, sources, doc_ids) if dt is not None else None
        if where:
            self.files.verify()
            self._fenced_out(dt)
            removed = int(dt.delete(predicate=where, commit_properties=self._props()).get("num_deleted_rows", 0))
        self.dead.supersede(keep, values)
        return removed

    def retry_dead_letters(self, error_types: set[str]) -> int:
        """Remove the dead letters of whole documents failed with one of ``error_types``: after
        `recover` they are all copies under ``_errors/`` (no pending file left), rewritten
        crash-safely (`DeadLetters.supersede`)."""
        self.recover()
        keep, tag = not_failed_with(error_types)
        return self.dead.supersede(keep, tag)

    def compact(self, min_parts: int = COMPACT_MIN_PARTS, target_bytes: int = COMPACT_TARGET_BYTES) -> dict:
        """``optimize.compact()`` (one transaction) when the snapshot has more than
        ``min_parts`` data files, then ``vacuum`` with the table's retention (files removed
        from the table over a week ago). Delta compacts by bytes: ``target_bytes`` per file."""
        self.recover()
        dt = self.table()
        before = len(dt.file_uris()) if dt is not None else 0
        if dt is None or before <= min_parts:
            return {"parts_before": before, "merged_parts": 0, "parts_written": 0}
        self.files.verify()
        self._fenced_out(dt)
        m = dt.optimize.compact(target_size=target_bytes, commit_properties=self._props())
        self.files.guard()
        vacuumed = self.table().vacuum(dry_run=False)
        log.info("Delta optimize of %s: %s files into %s; vacuum removed %d old files", self.files.url,
                 m.get("numFilesRemoved"), m.get("numFilesAdded"), len(vacuumed))
        return {"parts_before": before, "merged_parts": int(m.get("numFilesRemoved", 0)),
                "parts_written": int(m.get("numFilesAdded", 0)), "vacuumed": len(vacuumed)}

    def clear(self) -> int:
        """--fresh: the Delta log (newest entry first, so a crash leaves an older valid
        version), then the data files, the dead letters and the folder's records
        (`OutputFiles.clear`)."""
        from connectors.io_retry import call_with_retry

        logs = sorted(self.files.find(DELTA_LOG), key=lambda f: (f.endswith("_last_checkpoint"), f), reverse=True)
        for f in logs:
            self.files.rm(f)
        if logs:
            try:
                call_with_retry(self.files.fs.rm, self.files.path(DELTA_LOG), recursive=True, op="delete _delta_log")
            except FileNotFoundError:
                pass

        def ours(rel: str) -> bool:  # delta-rs writes its data files at the top, named part-*.parquet
            return ("/" not in rel and rel.startswith("part-") and rel.endswith(".parquet")) or self.dead.holds(rel)

        self._log_fenced = None  # the log is gone: the next use fences the new table
        return len(logs) + self.files.clear(ours)

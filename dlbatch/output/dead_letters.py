"""Dead letters: the documents and tasks that failed, under ``_errors/``, kept alike by every store.

A dead letter is a row of `dlbatch.records.ERROR_COLUMNS` (doc_id, source, task, stage,
error_type, error; task None: the whole document failed). They are Parquet parts in the
output's ``_errors/`` folder (a `PartsFolder`), whatever the format of the result rows:

    _errors/part-g<gen>-<run tag>-<hash of their keys>.parquet   a flush of dead letters only
                                    (``gen``: its lease generation, dlbatch/output/fence.py)
    _errors/<name of the commit that carried them>   the readers' copy of dead letters
                                    committed with result rows (the Parquet store's part,
                                    the Delta store's transaction)
    _errors/empty.parquet           no rows, the columns: written after a store's first commit,
                                    so that ``pd.read_parquet("<out>/_errors")`` and DuckDB's
                                    ``read_parquet('<out>/_errors/*.parquet')`` read an empty
                                    table when nothing failed
    _errors/_compact/, _errors/_tmp/, _errors/_pending/   merges in progress, temporaries,
                                    the Delta store's pending files

Invariants: a flush of dead letters only is one atomic part; retried with the same rows, or
with more after an attempt that raised, each row is committed once (`drop_landed`); a
superseded input's dead letters go part by part, crash-safely (`Compaction.rewrite`).
"""
from __future__ import annotations

import logging

from dlbatch.output.compaction import Compaction
from dlbatch.output.parts import PartsFolder
from dlbatch.output.rows import error_key, error_table, part_name

log = logging.getLogger("dlbatch.output.dead_letters")

ERRORS_DIR = "_errors"
EMPTY_PART = "empty.parquet"  # the dead letters' columns, no rows


class DeadLetters:
    def __init__(self, files, run_tag: str):
        self.parts = PartsFolder(files, ERRORS_DIR)
        self.run_tag = run_tag  # in the names of the parts this process commits
        self._readable = False  # the schema-only part is known to be there

    def read(self, columns: list[str] | None = None):
        """Every committed dead letter (``columns`` of them) as one Table (`EMPTY_PART` not read:
        it has none)."""
        import pyarrow as pa

        paths = [p for p in self.parts.parts() if self.parts.name(p) != EMPTY_PART]
        tables = self.parts.read(paths, columns)
        return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})

    def has(self, name: str, found: set[str] | None = None) -> bool:
        """Whether the part ``name`` is committed (in ``found``, a listing of the output, when given)."""
        if found is not None:
            return self.parts.path(name) in found
        return self.parts.files.exists(f"{ERRORS_DIR}/{name}")

    def ensure_readable(self) -> None:
        """The schema-only part (`EMPTY_PART`), written once, so readers of ``_errors/`` find
        its columns when nothing failed. A failure only costs that (tried again next commit)."""
        if self._readable:
            return
        try:
            if not self.parts.files.exists(f"{ERRORS_DIR}/{EMPTY_PART}"):
                self.parts.write(error_table([]), EMPTY_PART)
        except OSError as e:
            log.warning("could not write %s/%s (readers of an empty _errors/ find no columns): %s", ERRORS_DIR,
                        EMPTY_PART, e)
            return
        self._readable = True

    def drop_landed(self, rows: list[dict]) -> list[dict]:
        """``rows`` without those an earlier write that raised did commit after all (its
        reply was lost)."""
        for _, t in self.parts.landed():
            got = {error_key(r) for r in t.to_pylist()}
            rows = [r for r in rows if error_key(r) not in got]
        return rows

    def commit(self, rows: list[dict]) -> str | None:
        """A flush of dead letters only: one part named by their keys."""
        rows = self.drop_landed(rows)
        if not rows:
            return None
        name = part_name(self.run_tag, [error_key(r) for r in rows], self.parts.files.generation)
        return self.parts.write(error_table(rows), name, remember=True)

    def copy(self, table, name: str, *, remember: bool = True) -> str:
        """The readers' copy of dead letters committed elsewhere (with result rows), as ``name``.
        ``remember``: a copy that raises is looked for by the next flush (`drop_landed`)."""
        return self.parts.write(table, name, remember=remember)

    def recover(self) -> int:
        """Finish or drop the merges a crash left under ``_errors/``; the records handled."""
        return Compaction(self.parts).recover()

    def supersede(self, keep, tag) -> int:
        """Every part without the rows ``keep`` drops; the rows dropped."""
        return Compaction(self.parts).rewrite(keep, tag)

    @staticmethod
    def holds(rel: str) -> bool:
        """Whether ``rel`` (relative to the output) is a file of the dead letters' folder."""
        return rel.startswith(f"{ERRORS_DIR}/")

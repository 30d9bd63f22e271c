"""Committed Parquet parts in one folder of an output: what the stores build on.

A `PartsFolder` is one folder of an output (``at``: "" its top, where the Parquet store keeps
its result parts; ``_errors`` the dead letters; ``_errors/_pending`` the Delta store's
not-yet-counted dead letters) holding whole Parquet files:

    <at>/<name>.parquet          a committed part: written under ``_tmp/`` and renamed into
                                 place (`connectors.sink.write_parquet_atomic`), so a reader
                                 sees it whole or not at all
    <at>/_index/<name>.parquet   its index: a few columns of it (``index_columns``), written
                                 after the part, so an index never claims rows that are not
                                 committed; a part without one is read for those columns
    <at>/_compact/<merged>.json  a merge in progress (dlbatch/output/compaction.py)

Invariants: the committed parts are the ``*.parquet`` at the folder's top level that no
committed merge replaced (`connectors.sink.committed_paths`) and that the output's fence
does not rule out (orphans: parts a process renamed into place after it lost the lease,
dlbatch/output/fence.py; every listing here leaves them out); every write and every delete
checks the lease of the folder's `OutputFiles` first, and every rename re-reads it
immediately before; a commit that raised is remembered (its reply may be lost while the
file landed) until `landed` looks for it, once.

Nothing here knows what the rows mean: the keys of a row, the dead letters a result part
carries in its footer (`ERRORS_META`) and when a part may be deleted are the stores'.
"""
from __future__ import annotations

import logging

log = logging.getLogger("dlbatch.output.parts")

INDEX_DIR = "_index"
COMPACT_DIR = "_compact"
ERRORS_META = b"dlbatch.errors"  # footer key of a result part: the dead letters committed with it


class PartsFolder:
    def __init__(self, files, at: str = "", index_columns=None, optional_index_columns=()):
        self.files = files  # the output's OutputFiles: filesystem, lease, records
        self.at = at.strip("/")
        self.index_columns = list(index_columns) if index_columns else None  # None: no index files
        self.optional_index_columns = tuple(optional_index_columns)  # indexed where a part has them
        self._uncertain: list[str] = []  # names of commits that raised

    # ---- where --------------------------------------------------------------------------------
    def _rel(self, name: str) -> str:
        """``name`` (relative to this folder) relative to the output."""
        return f"{self.at}/{name}" if self.at else name

    @property
    def url(self) -> str:
        return self.files.url_of(self.at)

    @property
    def root(self) -> str:
        return self.files.path(self.at)

    def path(self, name: str) -> str:
        """The path (of the output's filesystem) of ``name`` in this folder."""
        return self.files.path(self._rel(name))

    def name(self, path: str) -> str:
        """A path under this folder, relative to it."""
        return path[len(self.root):].lstrip("/") if path.startswith(self.root) else path

    def index_path(self, part: str) -> str:
        return self.path(f"{INDEX_DIR}/{self.name(part)}")

    # ---- reading --------------------------------------------------------------------------------
    def find(self) -> list[str]:
        """Every file under the folder, its sub-folders included, less the orphans: one listing."""
        return self.files.fence.visible(self.files.find(self.at))

    def listing(self) -> tuple[list[str], set[str]]:
        """(the committed parts, every file under the folder): one listing."""
        from connectors.sink import committed_paths

        found = self.find()
        top = [f for f in found if "/" not in self.name(f) or self.name(f).startswith(f"{COMPACT_DIR}/")]
        return committed_paths(self.files.fs, self.root, top), set(found)

    def parts(self) -> list[str]:
        return self.listing()[0]

    def read(self, paths: list[str], columns: list[str] | None = None) -> list:
        """Each part of ``paths`` as a Table, in order (read in parallel)."""
        from connectors.sink import read_paths

        return read_paths(self.files.fs, paths, columns)

    def read_all(self, columns: list[str] | None = None):
        """Every committed part's rows as one Table (an empty Table when there is none)."""
        import pyarrow as pa

        tables = self.read(self.parts(), columns)
        return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})

    def indexes(self) -> list[tuple[str, object]]:
        """[(part path, its index Table)] for every committed part: the index file when there
        is one, else the part's index columns (never its text)."""
        parts, found = self.listing()
        with_index = [p for p in parts if self.index_path(p) in found]
        indexed = set(with_index)
        without = [p for p in parts if p not in indexed]
        got = dict(zip(with_index, self.read([self.index_path(p) for p in with_index])))
        got.update(zip(without, self.read(without, self.index_columns)))
        return [(p, got[p]) for p in parts]

    def sizes(self) -> dict[str, int]:
        """{path: bytes} of the files at the folder's top level."""
        from connectors.io_retry import call_with_retry

        found = call_with_retry(self.files.fs.find, self.root, maxdepth=1, detail=True, op=f"find {self.root}")
        return {k: v.get("size") or 0 for k, v in found.items()}

    # ---- writing ----------------------------------------------------------------------------------
    def write(self, table, name: str, *, remember: bool = False) -> str:
        """Commit ``table`` as the part ``name`` under the lease (the same bytes again: a no-op);
        returns its URL. ``remember``: a write that raises is remembered for `landed`."""
        from connectors.sink import write_parquet_atomic

        self.files.guard()
        try:
            return write_parquet_atomic(table, self.url, name, self.files.storage_options,
                                        before_rename=self.files.before_rename)
        except BaseException:
            if remember:
                self._uncertain.append(name)
            raise

    def landed(self) -> list[tuple[str, object]]:
        """[(name, Table)] of the remembered writes whose part is there after all (the rename
        landed, its reply did not). Every remembered write is forgotten."""
        from connectors.io_retry import call_with_retry
        from connectors.sink import read_parquet_bytes

        pending, self._uncertain = self._uncertain, []
        fs, out = self.files.fs, []
        for name in pending:
            p = self.path(name)
            if hasattr(fs, "invalidate_cache"):
                fs.invalidate_cache(p)
            if call_with_retry(fs.exists, p, op=f"exists {p}"):
                t = read_parquet_bytes(call_with_retry(fs.cat_file, p, op=f"read {p}"))
                log.warning("a commit that reported an error landed (%s): %d rows not committed again", name,
                            t.num_rows)
                out.append((name, t))
        return out

    def write_index(self, name: str, table) -> None:
        """The index of the part ``name``; a failure only costs a slower resume (the part is
        read instead)."""
        from connectors.sink import write_parquet_atomic

        try:
            cols = self.index_columns + [c for c in self.optional_index_columns if c in table.schema.names]
            write_parquet_atomic(table.select(cols), self.files.url_of(self._rel(INDEX_DIR)), name,
                                 self.files.storage_options, on_conflict="overwrite",
                                 before_rename=self.files.before_rename)
        except OSError as e:
            log.warning("could not write the index of %s (resume reads the part instead): %s", name, e)

    def write_record(self, name: str, data: dict) -> str:
        """A small JSON record ``name`` of this folder, written whole; returns its path."""
        self.files.write_json(self._rel(name), data)
        return self.path(name)

    def read_record(self, path: str) -> dict | None:
        """A record this folder holds (None: removed since it was listed)."""
        import json

        from connectors.io_retry import call_with_retry

        try:
            return json.loads(call_with_retry(self.files.fs.cat_file, path, op=f"read {path}"))
        except FileNotFoundError:
            return None

    def remove(self, path: str) -> None:
        """Delete the part ``path``, then its index file."""
        self.files.rm(path)
        if self.index_columns:
            self.files.rm(self.index_path(path))

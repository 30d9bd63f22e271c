"""Atomic, idempotent Parquet commits to any fsspec destination.

``write_parquet_atomic(table, dest_dir_url, filename)``:
  1. serialise the table to Parquet bytes in memory (deterministic for equal tables);
  2. if ``dest/filename`` already exists with the same bytes: nothing to do (a rerun that
     commits the same shard twice leaves one file); with different bytes: FileExistsError
     unless ``on_conflict="overwrite"``;
  3. write ``dest/_tmp/<uuid>.parquet`` (on local disk: fsynced), then move it to
     ``dest/filename`` (a rename on local disk, then the folder fsynced, so a power loss
     never leaves a committed part empty; copy + delete on object stores, where the final
     object appears at once, complete, when the copy finishes); the temporary object is removed.
Readers (``list_committed`` / ``read_committed``) ignore ``_tmp/`` and every other name
starting with ``_`` or ``.``, so a crash at any point leaves nothing half-visible.
Every filesystem call goes through connectors.io_retry.

A lost reply: when the move raises but ``dest/filename`` is in place with the bytes we meant
to write (the rename landed, its answer did not), the commit counts as done; the caller
never retries it under another name.

Compaction records: ``dest/_compact/<name>.json`` = ``{"merged": M, "replaces": [S...]}``
says the part ``M`` holds every row of the parts ``S``. While such a record exists and ``M``
is committed, readers skip the parts ``S`` still present; when ``M`` is not there (a crash
before it was written) the record is ignored and ``S`` are the truth. So a compaction that
stops at any step leaves every row visible exactly once (see dlbatch.output.compaction).
"""

from __future__ import annotations

import hashlib
import logging
import uuid

from .io_retry import call_with_retry

log = logging.getLogger(__name__)

TMP_DIR = "_tmp"
COMPACT_DIR = "_compact"


def _url_to_fs(url: str, storage_options: dict | None):
    """``${env:NAME}`` values of ``storage_options`` resolved here (`connectors.secrets`)."""
    import fsspec

    from .secrets import masked, resolve_options

    with masked():
        return fsspec.core.url_to_fs(url, **resolve_options(storage_options))


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def _public(fs, p: str) -> str:
    from fsspec.implementations.local import LocalFileSystem

    return fs._strip_protocol(p) if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(p)


def table_to_parquet_bytes(table, compression: str = "zstd") -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression=compression)
    return sink.getvalue().to_pybytes()


def _check_filename(filename: str) -> None:
    if (not isinstance(filename, str) or not filename or "/" in filename or "\\" in filename
            or filename.startswith(("_", ".")) or not filename.endswith(".parquet")):
        raise ValueError(f"filename must be a plain '<name>.parquet' not starting with '_' or '.', "
                         f"got {filename!r}")


def write_parquet_atomic(table, dest_dir_url: str, filename: str, storage_options: dict | None = None,
                         *, on_conflict: str = "error", compression: str = "zstd", before_rename=None) -> str:
    """Commit ``table`` as ``dest_dir_url/filename``; returns the committed file's URL."""
    _check_filename(filename)
    if on_conflict not in ("error", "overwrite"):
        raise ValueError(f"on_conflict must be 'error' or 'overwrite', got {on_conflict!r}")
    fs, root = _url_to_fs(dest_dir_url, storage_options)
    final = _join(root, filename)
    data = table_to_parquet_bytes(table, compression=compression)
    digest = hashlib.sha256(data).hexdigest()

    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache(final)
    if call_with_retry(fs.exists, final, op=f"exists {final}"):
        existing = call_with_retry(fs.cat_file, final, op=f"read {final}")
        if hashlib.sha256(existing).hexdigest() == digest:
            log.info("%s already committed with identical content; skipping", _public(fs, final))
            return _public(fs, final)
        if on_conflict == "error":
            raise FileExistsError(f"{_public(fs, final)} is already committed with different content "
                                  f"({len(existing)} bytes vs {len(data)}); pass "
                                  f"on_conflict='overwrite' to replace it")
        log.warning("overwriting %s with different content", _public(fs, final))

    tmp_dir = _join(root, TMP_DIR)
    tmp = _join(tmp_dir, f"{uuid.uuid4().hex}.parquet")
    call_with_retry(fs.makedirs, tmp_dir, exist_ok=True, op=f"makedirs {tmp_dir}")
    call_with_retry(write_durable, fs, tmp, data, op=f"write {tmp}")
    try:
        if before_rename is not None:
            before_rename()
        call_with_retry(fs.mv, tmp, final, op=f"commit {final}")
        sync_dir(fs, root)
    except OSError as exc:
        if not _landed(fs, final, digest):
            raise
        log.warning("commit of %s reported %s but the file is in place with the intended content: committed",
                    _public(fs, final), brief_error(exc))
    finally:
        # on object stores mv is copy + delete; make sure no temp object lingers
        try:
            if fs.exists(tmp):
                fs.rm_file(tmp)
        except OSError as exc:  # a leftover under _tmp/ is harmless: readers skip it
            log.warning("could not remove temporary %s: %s", tmp, exc)
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache(root)
    return _public(fs, final)


def write_durable(fs, path: str, data: bytes) -> None:
    """Write ``path``; on a local filesystem its bytes reach the disk (fsync) before this
    returns, so a rename that follows never publishes a file a power loss leaves empty.
    Object stores make an object durable when its PUT completes."""
    import os

    from fsspec.implementations.local import LocalFileSystem

    fs.pipe_file(path, data)
    if isinstance(fs, LocalFileSystem):
        fd = os.open(fs._strip_protocol(path), os.O_RDONLY)
        try:
            os.fsync(fd)  # flushes the file's pages whichever descriptor wrote them
        finally:
            os.close(fd)


def sync_dir(fs, path: str) -> None:
    """fsync a local directory, so a rename into it survives a power loss; no-op elsewhere."""
    import os

    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def brief_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def _landed(fs, final: str, digest: str) -> bool:
    """Is ``final`` committed with the content whose sha256 is ``digest``? (after an error)"""
    try:
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache(final)
        if not call_with_retry(fs.exists, final, op=f"exists {final}"):
            return False
        return hashlib.sha256(call_with_retry(fs.cat_file, final, op=f"read {final}")).hexdigest() == digest
    except OSError as exc:
        log.warning("could not check whether %s landed: %s", final, brief_error(exc))
        return False


def compaction_hidden(fs, root: str, found: list[str]) -> set[str]:
    """Paths (fs-internal) of parts replaced by a committed compacted part, from the
    compaction records among ``found`` (a ``find`` of ``root``)."""
    import json

    root = root.rstrip("/")
    present = set(found)
    hidden: set[str] = set()
    for f in found:
        rel = f[len(root):].lstrip("/") if f.startswith(root) else f
        if not (rel.startswith(f"{COMPACT_DIR}/") and rel.endswith(".json")):
            continue
        try:
            rec = json.loads(call_with_retry(fs.cat_file, f, op=f"read {f}"))
        except FileNotFoundError:  # finished and removed since the listing
            continue
        if _join(root, rec["merged"]) in present:
            hidden.update(_join(root, n) for n in rec["replaces"])
    return hidden


def committed_paths(fs, root: str, found: list[str]) -> list[str]:
    """The committed ``*.parquet`` among ``found`` (fs-internal paths, sorted): not under a
    ``_``/``.`` name, not replaced by a committed compacted part."""
    root = root.rstrip("/")
    hidden = compaction_hidden(fs, root, found)
    out = []
    for f in found:
        rel = f[len(root):] if f.startswith(root) else f
        if (f.endswith(".parquet") and f not in hidden
                and not any(p.startswith(("_", ".")) for p in rel.split("/") if p)):
            out.append(f)
    return sorted(out)


def find_all(fs, root: str) -> list[str]:
    """Every file under ``root`` (one listing, retried); [] when ``root`` does not exist."""
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache()
    root = root.rstrip("/")
    if not call_with_retry(fs.exists, root, op=f"exists {root}"):
        return []
    return list(call_with_retry(fs.find, root, op=f"find {root}"))


def list_committed(dest_dir_url: str, storage_options: dict | None = None) -> list[str]:
    """Sorted URLs of committed ``*.parquet`` files under ``dest_dir_url`` (recursively),
    ignoring ``_tmp/`` and anything else whose name starts with ``_`` or ``.``, and parts
    that a committed compaction replaced."""
    fs, root = _url_to_fs(dest_dir_url, storage_options)
    root = root.rstrip("/")
    return [_public(fs, f) for f in committed_paths(fs, root, find_all(fs, root))]


def read_parquet_bytes(data: bytes, columns: list[str] | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # ParquetFile.read, not read_table: read_table's dataset scanner frees the Python bytes
    # it read from on one of Arrow's threads after returning, and when that raced interpreter
    # exit the process aborted ("terminate called without an active exception", exit 134;
    # about 1 noop rerun in 3 here). And on the calling thread: with Arrow's CPU pool decoding
    # the columns, ~1 process in 80 still aborted at exit (0 in 600 without; parts are small)
    with pq.ParquetFile(pa.BufferReader(data)) as pf:
        return pf.read(columns=columns, use_threads=False)


def read_paths(fs, paths: list[str], columns: list[str] | None = None, threads: int = 16) -> list:
    """Each file of ``paths`` (fs-internal) as a Table, in order; read ``threads`` at a time
    (an object store answers each small GET in tens of ms: serial reads add up)."""
    def one(p):
        return read_parquet_bytes(call_with_retry(fs.cat_file, p, op=f"read {_public(fs, p)}"), columns)

    if len(paths) <= 1 or threads <= 1:
        return [one(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(threads, len(paths))) as ex:
        return list(ex.map(one, paths))


def read_committed(dest_dir_url: str, storage_options: dict | None = None, columns: list[str] | None = None):
    """All committed files under ``dest_dir_url`` as one pyarrow Table (empty table if none)."""
    import pyarrow as pa

    fs, root = _url_to_fs(dest_dir_url, storage_options)
    root = root.rstrip("/")
    tables = read_paths(fs, committed_paths(fs, root, find_all(fs, root)), columns)
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="default")

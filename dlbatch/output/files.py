"""The output folder itself: where it is, who may change it, the records beside the rows.

`OutputFiles` is what every store stands on (dlbatch/output/store.py): the URL resolved to a
filesystem (its ``${env:NAME}`` credentials read here), the lease of the one writer and the
fence of its generation (dlbatch/output/fence.py), durable whole-file writes (`write_file`:
temp file, fsync, rename, the folder synced), and the records every format keeps beside its
rows: the manifest (``_manifest.json``: the job's fingerprint, its ``output.format``,
``complete``), the input versions (``_sources.arrow``) and the report (``_report.*``).

Fenced writes. Every change checks the lease first (`guard`: re-read when the last reading
started more than a heartbeat ago), and every rename that makes a file visible re-reads it
immediately before (`before_rename`), so a process that lost the lease renames nothing
after it noticed; what a pause between that reading and the rename still lets through is
the fence's to catch. A store asks `fence_up` before it reads progress or changes rows: the
holder's first call raises the fence to its generation.

No bookkeeping file matches ``*.parquet`` at the top of the output, so the natural glob
``read_parquet('<out>/*.parquet')`` reads result rows only: the input versions are an Arrow
IPC file (``_sources.arrow``; an output written before keeps its ``_sources.parquet``, read
until the next write replaces it).

It knows no store's layout: `clear` deletes those records, the temporaries (``_tmp/``) and
the files the calling store names as its own, and nothing else — so two stores of one
folder (the format that wrote it, the format a ``--fresh`` run writes next) can share one
`OutputFiles`, and with it one lease.
"""
from __future__ import annotations

import json
import uuid
from typing import Callable

from dlbatch.output.fence import FENCE_FILE, ORPHANS_DIR, Fence

MANIFEST = "_manifest.json"  # the job that writes the folder: fingerprint, fields (output.format), complete
SOURCES_FILE = "_sources.arrow"  # each input's version when last listed (connectors.versions)
OLD_SOURCES_FILE = "_sources.parquet"  # ... as outputs written before kept them
TMP_DIR = "_tmp"  # whole-file writes before their rename
RECORDS = (MANIFEST, SOURCES_FILE, OLD_SOURCES_FILE, FENCE_FILE, "_report.json", "_report.html", "_report.png")


class OutputFiles:
    """One output folder (a URL and its fsspec filesystem) and the lease of its writer."""

    def __init__(self, url: str, storage_options: dict | None = None):
        import fsspec

        from connectors.secrets import resolve_options

        self.url = url.rstrip("/")
        self.storage_options = resolve_options(dict(storage_options or {}))  # ${env:NAME} read here
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.root = self.root.rstrip("/")
        self.lease = None  # dlbatch.output.lease.OutputLease held while this process changes the output
        self.fence = Fence(self)  # which parts of older lease generations count (fence.py)
        self._fenced: int | None = None  # the generation this process raised the fence to

    # ---- the lease --------------------------------------------------------------------------------
    def take_lease(self, job: str, command: str = "run", **options):
        """Take the output's lease (raises LeaseHeld naming the holder); `release_lease` gives it
        back. ``options``: `OutputLease`'s (``stale_s``, ``heartbeat_s``, ``clock``)."""
        from dlbatch.output.lease import OutputLease

        self.lease = OutputLease(self.fs, self.root, self.url, job, command, **options).acquire()
        return self.lease

    def release_lease(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def guard(self) -> None:
        """Raise LeaseLost when a lease was taken and another process holds it now."""
        if self.lease is not None:
            self.lease.check()

    def verify(self) -> None:
        """Raise LeaseLost unless the lease taken is still this process's, read now."""
        if self.lease is not None:
            self.lease.verify()

    def before_rename(self) -> None:
        """Called immediately before every rename that makes a file visible: the lease read now.
        (`write_parquet_atomic`'s ``before_rename``; the fault drills pause a process here.)"""
        self.verify()

    @property
    def generation(self) -> int | None:
        """The generation of the lease held (the fencing token in part names); None: no lease."""
        return self.lease.gen if self.lease is not None else None

    def fence_up(self) -> None:
        """Before a holder reads progress or changes rows: raise the fence to its generation
        (once per lease; without a lease: nothing)."""
        gen = self.generation
        if gen is not None and self._fenced != gen:
            self.fence.raise_to(gen)
            self._fenced = gen

    def before_commit(self) -> None:
        """Before every commit: the fence raised; while earlier holders may still run (the
        lease's suspects), the orphans visible now moved aside."""
        self.fence_up()
        if self.lease is not None and self.lease.suspects:
            self.fence.sweep()

    def sweep_orphans(self) -> list[str]:
        """Move aside the orphans visible now (a holder's commits while its lease has suspects,
        and its end); returns every orphan this process moved aside."""
        if self.generation is not None:
            self.fence_up()
            self.fence.sweep()
        return list(self.fence.moved)

    # ---- paths ------------------------------------------------------------------------------------
    def path(self, name: str) -> str:
        """``name`` (relative to the output) as a path of `fs`."""
        return f"{self.root}/{name}" if name else self.root

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}" if name else self.url

    def rel(self, path: str) -> str:
        """A path of `fs` relative to the output."""
        return path[len(self.root):].lstrip("/") if path.startswith(self.root) else path

    def find(self, name: str = "") -> list[str]:
        """Every file under the output (or under its folder ``name``): one listing; [] when absent."""
        from connectors.sink import find_all

        return find_all(self.fs, self.path(name))

    def exists(self, name: str) -> bool:
        from connectors.io_retry import call_with_retry

        p = self.path(name)
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(p)
        return call_with_retry(self.fs.exists, p, op=f"exists {p}")

    def rm(self, path: str) -> None:
        """Delete the file ``path`` (of `fs`) under the lease; a file already gone is no error."""
        from connectors.io_retry import call_with_retry

        self.guard()
        try:
            call_with_retry(self.fs.rm_file, path, op=f"delete {path}")
        except FileNotFoundError:
            pass

    # ---- whole files and the records ------------------------------------------------------------------
    def read_bytes(self, name: str) -> bytes | None:
        """A whole file of the folder; None when it is not there."""
        from connectors.io_retry import call_with_retry

        p = self.path(name)
        if not call_with_retry(self.fs.exists, p, op=f"exists {p}"):
            return None
        return call_with_retry(self.fs.cat_file, p, op=f"read {p}")

    def read_json(self, name: str) -> dict | None:
        body = self.read_bytes(name)
        return None if body is None else json.loads(body)

    def write_json(self, name: str, data: dict) -> None:
        """Write then rename, so readers never see half a file."""
        self.write_file(name, json.dumps(data, indent=2, default=str).encode())

    def write_file(self, name: str, body: bytes) -> None:
        """``name`` written whole under the lease: a temporary file under ``_tmp/``, fsynced,
        renamed into place, the folder synced. A reader sees the old file or the new one."""
        from connectors.io_retry import call_with_retry
        from connectors.sink import sync_dir, write_durable

        self.guard()
        call_with_retry(self.fs.makedirs, self.path(TMP_DIR), exist_ok=True, op="makedirs")
        tmp = self.path(f"{TMP_DIR}/{uuid.uuid4().hex}")
        call_with_retry(write_durable, self.fs, tmp, body, op=f"write {tmp}")
        if "/" in name:
            call_with_retry(self.fs.makedirs, self.path(name.rsplit("/", 1)[0]), exist_ok=True, op="makedirs")
        self.before_rename()
        call_with_retry(self.fs.mv, tmp, self.path(name), op=f"commit {name}")
        sync_dir(self.fs, self.path(name).rsplit("/", 1)[0])

    def read_sources(self) -> dict[str, list]:
        """{source: [stat key or None, version]} recorded when the inputs were last listed."""
        from connectors.io_retry import call_with_retry

        for name in (SOURCES_FILE, OLD_SOURCES_FILE):
            p = self.path(name)
            if call_with_retry(self.fs.exists, p, op=f"exists {p}"):
                t = _read_table(call_with_retry(self.fs.cat_file, p, op=f"read {p}"), name).to_pydict()
                return {s: [k, v] for s, k, v in zip(t["source"], t["stat"], t["version"])}
        return {}

    def write_sources(self, sources: dict[str, list]) -> None:
        """The input versions as an Arrow IPC file (``_sources.arrow``); the old Parquet copy
        of an earlier output, when there is one, removed after."""
        import pyarrow as pa

        names = sorted(sources)
        t = pa.table({"source": pa.array(names, pa.string()),
                      "stat": pa.array([sources[n][0] for n in names], pa.string()),
                      "version": pa.array([sources[n][1] for n in names], pa.string())})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, t.schema) as w:
            w.write_table(t)
        self.write_file(SOURCES_FILE, sink.getvalue().to_pybytes())
        if self.exists(OLD_SOURCES_FILE):
            self.rm(self.path(OLD_SOURCES_FILE))

    def clear(self, ours: Callable[[str], bool]) -> int:
        """--fresh: delete the records (manifest, report, input versions, fence), the temporaries,
        the orphans moved aside and every file ``ours(rel)`` claims (``rel``: relative to the
        output; the calling store's own files, by its layout), under the lease. Everything else stays: sub-folders (another
        job's output, a ``year=2024/`` partition), other files, the lease the caller holds.
        A holder then raises the fence again with nothing counted: no part of an older
        generation that appears later counts. Returns the files deleted."""
        n = 0
        for f in self.find():
            rel = self.rel(f)
            if rel in RECORDS or rel.startswith((f"{TMP_DIR}/", f"{ORPHANS_DIR}/")) or ours(rel):
                self.rm(f)
                n += 1
        if self.generation is not None:
            self.fence.raise_to(self.generation, cleared=True)
            self._fenced = self.generation
        return n


def _read_table(data: bytes, name: str):
    """The input versions' table from the bytes of ``name`` (Arrow IPC, or an earlier Parquet)."""
    import pyarrow as pa

    from connectors.sink import read_parquet_bytes

    if name.endswith(".parquet"):
        return read_parquet_bytes(data)
    return pa.ipc.open_file(pa.BufferReader(data)).read_all()

"""The output folder's own files: where they are, who may change them, the small records.

`OutputFiles` is what every output store stands on: the URL resolved to a filesystem (its
``${env:NAME}`` credentials read here), the lease of the one writer (every change checks it
first, `_guard`), durable whole-file writes (`_write_file`: temp file, fsync, rename, the
folder synced), the manifest and the input versions (`_sources.parquet`), and `clear`
(``--fresh``), which deletes what a job writes and nothing else. It knows the layout's names
(dlbatch/output/parquet_store.py, the module docstring) but not what the parts hold.
"""
from __future__ import annotations

import json
import uuid

INDEX_DIR = "_index"
COMPACT_DIR = "_compact"
SOURCES_FILE = "_sources.parquet"  # each input's version when last listed (connectors.versions)
ERRORS_DIR = "_errors"


class OutputFiles:
    def __init__(self, url: str, storage_options: dict | None = None):
        import fsspec

        from connectors.secrets import resolve_options

        self.url = url.rstrip("/")
        self.storage_options = resolve_options(dict(storage_options or {}))  # ${env:NAME} read here
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.root = self.root.rstrip("/")
        self.lease = None  # dlbatch.output.lease.OutputLease held while this process changes the output

    def take_lease(self, job: str, command: str = "run", stale_s: float | None = None):
        """Take the output's lease (raises LeaseHeld naming the holder); `release_lease` gives it back."""
        from dlbatch.output.lease import STALE_S, OutputLease

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

    def _rm(self, path: str) -> None:
        from connectors.io_retry import call_with_retry

        self._guard()
        try:
            call_with_retry(self.fs.rm_file, path, op=f"delete {path}")
        except FileNotFoundError:
            pass

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

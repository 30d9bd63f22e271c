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
    part-<time>-<uuid>.parquet     result rows
    _errors/part-*.parquet         dead-letter rows (doc_id, source, stage, error_type, error)
    _manifest.json                 the job fingerprint (a rerun with other settings is refused)
    _report.json / .html / .png    the run report
"""
from __future__ import annotations

import json
import logging
import time
import uuid

log = logging.getLogger("dlbatch.checkpoint")

RESULT_COLUMNS = ["doc_id", "source", "task", "output", "prompt_tokens", "output_tokens", "finish_reason",
                  "truncated", "model", "ttft_s", "latency_s"]
ERROR_COLUMNS = ["doc_id", "source", "task", "stage", "error_type", "error"]  # task: None = the whole document


class OutputStore:
    def __init__(self, url: str, storage_options: dict | None = None):
        import fsspec

        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.root = self.root.rstrip("/")

    def _p(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _u(self, name: str) -> str:
        return f"{self.url}/{name}"

    # ---- reading what is committed ------------------------------------------------------
    def results(self, columns: list[str] | None = None):
        from connectors.sink import read_committed

        return read_committed(self.url, self.storage_options, columns=columns)

    def errors(self):
        from connectors.sink import read_committed

        return read_committed(self._u("_errors"), self.storage_options)

    def progress(self) -> dict:
        """What is committed: done/failed doc ids, rows per doc, tokens."""
        res = self.results()
        err = self.errors()
        rows = res.to_pylist() if res.num_rows else []
        errs = err.to_pylist() if err.num_rows else []
        docs: dict[str, set] = {}
        sources: dict[str, set] = {}
        for r in rows:
            docs.setdefault(r["doc_id"], set()).add(r["task"])
            sources.setdefault(r["source"], set()).add(r["doc_id"])
        for e in errs:  # a task that failed alone has its outcome (an error row): the document is not redone for it
            if e.get("task") and e["doc_id"] in docs:
                docs[e["doc_id"]].add(e["task"])
        failed = {e["doc_id"] for e in errs}
        return {
            "rows": len(rows),
            "docs_done": set(docs),
            "docs_failed": failed - set(docs),
            "tasks_by_doc": docs,
            "sources_done": {s for s in sources} | {e["source"] for e in errs},
            "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in rows),
            "output_tokens": sum(r.get("output_tokens") or 0 for r in rows),
            "duplicates": len(rows) - len({(r["doc_id"], r["task"]) for r in rows}),
        }

    # ---- committing -----------------------------------------------------------------------
    def _part_name(self) -> str:
        return f"part-{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:12]}.parquet"

    def commit_results(self, rows: list[dict], include_text: bool, extra_fields=()) -> str | None:
        """``extra_fields``: pyarrow fields appended to the schema (dlbatch/structured.py
        `result_fields`: valid, output_error, one typed `<task>_json` per JSON-schema task)."""
        if not rows:
            return None
        import pyarrow as pa

        from connectors.sink import write_parquet_atomic

        cols = RESULT_COLUMNS + (["text"] if include_text else []) + [f.name for f in extra_fields]
        table = pa.Table.from_pylist([{c: r.get(c) for c in cols} for r in rows],
                                     schema=result_schema(include_text, extra_fields))
        return write_parquet_atomic(table, self.url, self._part_name(), self.storage_options)

    def commit_errors(self, rows: list[dict]) -> str | None:
        if not rows:
            return None
        import pyarrow as pa

        from connectors.sink import write_parquet_atomic

        table = pa.Table.from_pylist([{c: (None if r.get(c) is None else str(r.get(c))) for c in ERROR_COLUMNS}
                                      for r in rows], schema=error_schema())
        return write_parquet_atomic(table, self._u("_errors"), self._part_name(), self.storage_options)

    def read_json(self, name: str) -> dict | None:
        from connectors.io_retry import call_with_retry

        p = self._p(name)
        if not call_with_retry(self.fs.exists, p, op=f"exists {p}"):
            return None
        return json.loads(call_with_retry(self.fs.cat_file, p, op=f"read {p}"))

    def write_json(self, name: str, data: dict) -> None:
        """Write then rename, so readers never see half a file."""
        from connectors.io_retry import call_with_retry

        body = json.dumps(data, indent=2, default=str).encode()
        call_with_retry(self.fs.makedirs, self._p("_tmp"), exist_ok=True, op="makedirs")
        tmp = self._p(f"_tmp/{uuid.uuid4().hex}.json")
        call_with_retry(self.fs.pipe_file, tmp, body, op=f"write {tmp}")
        call_with_retry(self.fs.mv, tmp, self._p(name), op=f"commit {name}")

    def clear(self) -> int:
        """--fresh: delete what this job wrote under the output path, nothing else: committed
        parts, dead letters, temporaries, manifest and report. Other files stay."""
        from connectors.io_retry import call_with_retry

        if not call_with_retry(self.fs.exists, self.root, op=f"exists {self.root}"):
            return 0
        n = 0
        for f in call_with_retry(self.fs.find, self.root, op=f"find {self.root}"):
            rel = f[len(self.root):].lstrip("/")
            name = rel.split("/")[-1]
            ours = (rel.startswith(("_errors/", "_tmp/")) or name in ("_manifest.json", "_report.json",
                    "_report.html", "_report.png") or (name.startswith("part-") and name.endswith(".parquet")))
            if ours:
                call_with_retry(self.fs.rm_file, f, op=f"delete {f}")
                n += 1
        return n


def result_schema(include_text: bool, extra_fields=()):
    import pyarrow as pa

    fields = [("doc_id", pa.string()), ("source", pa.string()), ("task", pa.string()), ("output", pa.string()),
              ("prompt_tokens", pa.int64()), ("output_tokens", pa.int64()), ("finish_reason", pa.string()),
              ("truncated", pa.bool_()), ("model", pa.string()), ("ttft_s", pa.float64()), ("latency_s", pa.float64())]
    if include_text:
        fields.append(("text", pa.string()))
    return pa.schema(fields + [(f.name, f.type) for f in extra_fields])


def error_schema():
    import pyarrow as pa

    return pa.schema([(c, pa.string()) for c in ERROR_COLUMNS])

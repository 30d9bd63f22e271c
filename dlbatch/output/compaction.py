"""Compaction: many small committed parts merged into a few large ones, crash-safely.

One merge: (1) the record ``_compact/<M>.json`` naming M and the parts S it replaces; (2) M,
written atomically like any part, then its index; (3) the parts S, then their index files,
deleted; (4) the record deleted. Readers skip S while the record and M both exist
(connectors.sink.compaction_hidden), so a crash at any step leaves every row visible exactly
once; `Compaction.recover` finishes or drops what a crash left. A rewrite of one part without
some rows (`OutputStore.supersede`) is the same merge of a single part.
"""
from __future__ import annotations

import hashlib
import json
import logging

from dlbatch.output.files import COMPACT_DIR, ERRORS_DIR, INDEX_DIR

log = logging.getLogger("dlbatch.output.parquet_store")

ERRORS_META = b"dlbatch.errors"  # footer key of a result part: the dead letters committed with it
# parts under SMALL_ROWS rows are small; merge them when more than COMPACT_MIN_PARTS exist,
# into parts of about COMPACT_TARGET_ROWS rows
SMALL_ROWS = 4096
COMPACT_MIN_PARTS = 64
COMPACT_TARGET_ROWS = 65536
COMPACT_TARGET_BYTES = 64 << 20  # ... or of about this many Parquet bytes (a merge holds them in memory)


class Compaction:
    """The merges of one output store (`dlbatch.output.parquet_store.OutputStore`): it reads
    and writes through the store (its lease, index and atomic writes)."""

    def __init__(self, store):
        self.store = store

    def recover(self) -> int:
        """Finish (merged part committed) or drop (it is not) every compaction record left by
        a crash, of the results and of the dead letters; removes index files whose part is
        gone. Returns records handled."""
        from connectors.io_retry import call_with_retry
        from connectors.sink import find_all, read_parquet_bytes

        s = self.store

        found = set(find_all(s.fs, s.root))
        n = 0
        for at in ("", f"{ERRORS_DIR}/"):
            recs = sorted(f for f in found if s._rel(f).startswith(f"{at}{COMPACT_DIR}/") and f.endswith(".json"))
            for r in recs:
                rec = json.loads(call_with_retry(s.fs.cat_file, r, op=f"read {r}"))
                merged = s._p(at + rec["merged"])
                if merged in found:
                    if not at and s._p(f"{INDEX_DIR}/{rec['merged']}") not in found:
                        t = read_parquet_bytes(call_with_retry(s.fs.cat_file, merged, op=f"read {merged}"))
                        s._write_index(rec["merged"], t)
                    for name in rec["replaces"]:
                        if s._p(at + name) in found:
                            s._rm(s._p(at + name))
                s._rm(r)
            n += len(recs)
        parts = {s._rel(f) for f in find_all(s.fs, s.root) if "/" not in s._rel(f)}
        for f in found:
            rel = s._rel(f)
            name = rel[len(INDEX_DIR) + 1:]
            if rel.startswith(f"{INDEX_DIR}/") and "/" not in name and name not in parts:
                s._rm(f)  # its part was compacted away: an index is written only after its part
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
        every row visible exactly once; `recover` finishes or drops the rest."""
        s = self.store
        s.recover()
        small = [(p, t.num_rows) for p, t in s.part_indexes() if t.num_rows < small_rows]
        if len(small) <= min_parts:
            return {"parts_before": len(small), "merged_parts": 0, "parts_written": 0}
        from connectors.io_retry import call_with_retry

        sizes = {k: v.get("size") or 0 for k, v in
                 call_with_retry(s.fs.find, s.root, maxdepth=1, detail=True, op=f"find {s.root}").items()}
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
            self.merge(g)
        return {"parts_before": len(small), "merged_parts": sum(len(g) for g in groups), "parts_written": len(groups)}

    def merge(self, paths: list[str], keep=None, tag=None, base: str = "") -> str:
        """Replace the parts ``paths`` (under ``base``: "" results, ERRORS_DIR dead letters)
        by one part holding their rows (``keep(table)`` of them); see `compact`."""
        import pyarrow as pa

        from connectors.sink import read_paths, write_parquet_atomic

        s = self.store
        at = f"{base}/" if base else ""
        names = [s._rel(p)[len(at):] for p in paths]
        key = chr(10).join(names) + (f"{chr(10)}keep:{tag}" if keep is not None else "")
        merged = f"part-c{hashlib.sha256(key.encode()).hexdigest()[:24]}.parquet"
        record = f"{at}{COMPACT_DIR}/{merged[:-len('.parquet')]}.json"
        s.write_json(record, {"merged": merged, "replaces": names})
        table = pa.concat_tables(read_paths(s.fs, paths), promote_options="default")
        if keep is not None:
            table = keep(table)
        meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != ERRORS_META}
        table = table.replace_schema_metadata(meta or None)  # the copies under _errors/ exist (recover ran)
        write_parquet_atomic(table, s._u(base) if base else s.url, merged, s.storage_options)
        if not base:
            s._write_index(merged, table)
        for p, n in zip(paths, names):
            s._rm(p)
            if not base:
                s._rm(s._p(f"{INDEX_DIR}/{n}"))
        s._rm(s._p(record))
        log.info("%s %d parts (%d rows) into %s", "compacted" if keep is None else "rewrote", len(paths),
                 table.num_rows, at + merged)
        return merged

    def rewrite_errors(self, keep, tag) -> None:
        """The dead-letter parts without the rows ``keep`` drops: each rewritten alone (a
        merge of one part), or deleted when every row goes."""
        from connectors.sink import committed_paths, find_all, read_paths

        s = self.store
        eroot = s._p(ERRORS_DIR)
        eparts = committed_paths(s.fs, eroot, find_all(s.fs, eroot))
        for p, t in zip(eparts, read_paths(s.fs, eparts)):
            drop = t.num_rows - keep(t).num_rows
            if drop == t.num_rows:
                s._rm(p)
            elif drop:
                self.merge([p], keep=keep, tag=tag, base=ERRORS_DIR)

"""Compaction: many small parts of a `PartsFolder` merged into a few large ones, crash-safely.

One merge of the parts S into M: (1) the record ``<folder>/_compact/<M>.json`` naming M and
S; (2) M, written atomically like any part, then its index; (3) the parts S, each then its
index file, deleted; (4) the record deleted. Readers skip S while the record and M both exist
(connectors.sink.compaction_hidden), so a crash at any step leaves every row visible exactly
once; `Compaction.recover` finishes (M is there) or drops (it is not) what a crash left.
A rewrite of one part without some rows (a replaced input's rows superseded, `rewrite`) is
the same merge of a single part.

Compaction works on one `PartsFolder` and on nothing else: it does not know what the rows
are. The caller keeps what the parts mean: a merged part carries no footer dead letters
(`parts.ERRORS_META`), so the Parquet store writes their copies under ``_errors/`` (its
``recover``) before it compacts its result parts.
"""
from __future__ import annotations

import hashlib
import logging

from dlbatch.output.fence import part_prefix
from dlbatch.output.parts import COMPACT_DIR, ERRORS_META, INDEX_DIR

log = logging.getLogger("dlbatch.output.compaction")

# parts under SMALL_ROWS rows are small; merge them when more than COMPACT_MIN_PARTS exist,
# into parts of about COMPACT_TARGET_ROWS rows
SMALL_ROWS = 4096
COMPACT_MIN_PARTS = 64
COMPACT_TARGET_ROWS = 65536
COMPACT_TARGET_BYTES = 64 << 20  # ... or of about this many Parquet bytes (a merge holds them in memory)


class Compaction:
    """The merges of one folder of parts (`dlbatch.output.parts.PartsFolder`)."""

    def __init__(self, parts):
        self.parts = parts

    def recover(self) -> int:
        """Finish (merged part committed) or drop (it is not) every merge record a crash left
        in the folder; removes index files whose part is gone. Returns the records handled."""
        parts = self.parts
        found = set(parts.find())
        recs = sorted(f for f in found if parts.name(f).startswith(f"{COMPACT_DIR}/") and f.endswith(".json"))
        for r in recs:
            rec = parts.read_record(r)
            if rec is None:
                continue
            merged = parts.path(rec["merged"])
            if merged in found:
                if parts.index_columns and parts.index_path(merged) not in found:
                    parts.write_index(rec["merged"], parts.read([merged])[0])
                for name in rec["replaces"]:
                    if parts.path(name) in found:
                        parts.files.rm(parts.path(name))
            parts.files.rm(r)
        if parts.index_columns:
            present = {parts.name(f) for f in parts.find() if "/" not in parts.name(f)}
            for f in found:
                name = parts.name(f)[len(INDEX_DIR) + 1:]
                if parts.name(f).startswith(f"{INDEX_DIR}/") and "/" not in name and name not in present:
                    parts.files.rm(f)  # its part was merged away: an index is written only after its part
        return len(recs)

    def compact(self, min_parts: int = COMPACT_MIN_PARTS, small_rows: int = SMALL_ROWS,
                target_rows: int = COMPACT_TARGET_ROWS, target_bytes: int = COMPACT_TARGET_BYTES) -> dict:
        """Merge the parts of fewer than ``small_rows`` rows into parts of about
        ``target_rows`` rows (or ``target_bytes`` Parquet bytes, whichever comes first) when
        more than ``min_parts`` of them exist (the module docstring: one merge)."""
        small = [(p, t.num_rows) for p, t in self.parts.indexes() if t.num_rows < small_rows]
        if len(small) <= min_parts:
            return {"parts_before": len(small), "merged_parts": 0, "parts_written": 0}
        sizes = self.parts.sizes()
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

    def merge(self, paths: list[str], keep=None, tag=None) -> str:
        """Replace the parts ``paths`` by one part holding their rows (``keep(table)`` of them;
        ``tag`` names what ``keep`` keeps, in the merged part's name); returns its name."""
        import pyarrow as pa

        parts = self.parts
        names = [parts.name(p) for p in paths]
        key = "\n".join(names) + (f"\nkeep:{tag}" if keep is not None else "")
        gen = parts.files.generation  # a merged part carries the merging holder's fencing token
        prefix = part_prefix(gen) if gen is not None else "part-"
        merged = f"{prefix}c{hashlib.sha256(key.encode()).hexdigest()[:24]}.parquet"
        record = parts.write_record(f"{COMPACT_DIR}/{merged[:-len('.parquet')]}.json",
                                    {"merged": merged, "replaces": names})
        table = pa.concat_tables(parts.read(paths), promote_options="default")
        if keep is not None:
            table = keep(table)
        meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != ERRORS_META}
        table = table.replace_schema_metadata(meta or None)  # their copies exist: the caller wrote them
        parts.write(table, merged)
        if parts.index_columns:
            parts.write_index(merged, table)
        for p in paths:
            parts.remove(p)
        parts.files.rm(record)
        log.info("%s %d parts (%d rows) into %s", "compacted" if keep is None else "rewrote", len(paths),
                 table.num_rows, parts.path(merged))
        return merged

    def rewrite(self, keep, tag, tables=None) -> int:
        """Every part without the rows ``keep`` drops: each rewritten alone (a merge of one
        part), or deleted when every row goes. ``tables``: [(part, the Table to judge it by)]
        (the results' index files); by default each part read whole. Returns the rows dropped."""
        if tables is None:
            paths = self.parts.parts()
            tables = zip(paths, self.parts.read(paths))
        removed = 0
        for p, t in tables:
            drop = t.num_rows - keep(t).num_rows
            removed += drop
            if drop == t.num_rows:
                self.parts.remove(p)
            elif drop:
                self.merge([p], keep=keep, tag=tag)
        return removed

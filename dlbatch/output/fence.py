"""Fenced commits of a folder of Parquet parts: what a process makes visible after it lost the
lease is never counted, and is moved aside.

The problem. A holder checks its lease, then renames a part into place. Paused between the
two (a stopped process, a VM pause, a long GC, an upload stuck on a partitioned link) for
longer than the lease's ``stale_s``, it is taken over; the new holder reads what is committed
and redoes the rest; the old one wakes and its rename lands — a second copy of rows the new
holder wrote. No check before a rename closes that window: only the store can refuse a write
from the past, and a plain folder of files cannot (readers see whatever is renamed in).

The design, after the fencing token of Chubby / GFS and the commit protocols of Delta Lake
and Iceberg (a commit is valid only against the state it read; here: the generation it held):

- **The token.** The lease's generation (dlbatch/output/lease.py: the number of the holder's
  lease file, never reused) is in the name of every part a holder commits:
  ``part-g<gen>-...parquet`` at the top of the output and under ``_errors/``.
- **The fence** (``_fence.json``: ``{"gen": G, "legit": [...]}``). Before a holder reads
  progress or changes anything it raises the fence to its own generation: every part of an
  older generation present at that moment that the previous fence did not rule out is listed
  as ``legit``. A part of a generation below G that the fence does not list appeared after a
  newer holder took over: an **orphan**. A dead letters' copy under ``_errors/`` (named after its result part) is an
  orphan exactly when its result part is.
- **Readers through dlbatch** (every store, `dlbatch status`, resume, compaction) skip orphans
  from the moment they appear (`PartsFolder` asks `orphan`), so an orphan is never counted as
  done and never merged into a part of a newer generation.
- **Moved aside.** The holder moves orphans to ``_orphans/`` (and drops their index) when it
  raises the fence, at every commit while its lease has suspects (earlier holders that may
  still run: `OutputLease.suspects`), and at its end; the run's ``_report.json`` and
  ``dlbatch status`` name them. The same documents are redone (or were) by the new holder.
- **Narrowing the window.** Every rename re-reads the lease immediately before it (`verify`),
  so only a pause that falls between that read and the rename can make an orphan.

The guarantee for plain readers (pandas, DuckDB, Spark listing the folder): after the new
holder's next commit, no duplicate is visible; between the old holder's late rename and that
commit a plain reader can see the orphan's rows twice. Readers through dlbatch never do.
Parts named without a generation (committed through a store that holds no lease, written
before generations existed, or the Delta store's published dead letters, whose transactions
the Delta log fences) are never orphans.
"""
from __future__ import annotations

import logging
import re

log = logging.getLogger("dlbatch.output.fence")

FENCE_FILE = "_fence.json"
ORPHANS_DIR = "_orphans"
ERRORS_DIR = "_errors"
_PART = re.compile(r"^(_errors/)?(part-g(\d+)-[^/]*\.parquet)$")


def part_prefix(gen: int) -> str:
    """The start of the name of every part a holder of generation ``gen`` commits."""
    return f"part-g{gen:06d}-"


def generation(rel: str) -> int | None:
    """The generation in the name of a part (``rel``: relative to the output; only parts at
    the top and under ``_errors/`` carry one); None for any other file."""
    m = _PART.match(rel)
    return int(m.group(3)) if m else None


class Fence:
    """The fence of one output folder (an `OutputFiles`): which parts of older generations count."""

    def __init__(self, files):
        self.files = files
        self.gen = 0  # parts of older generations count only when listed in `legit`
        self.legit: frozenset[str] = frozenset()
        self._loaded = False
        self.moved: list[str] = []  # orphans this process moved aside (relative names)

    def load(self) -> None:
        """Read ``_fence.json`` once (a reader's view; a holder's own fence replaces it)."""
        if self._loaded:
            return
        rec = self.files.read_json(FENCE_FILE) or {}
        self.gen, self.legit = int(rec.get("gen") or 0), frozenset(rec.get("legit") or ())
        self._loaded = True

    def orphan(self, rel: str) -> bool:
        """Whether the file ``rel`` (relative to the output) is a part made visible by a process
        after a newer holder took the lease."""
        m = _PART.match(rel)
        if m is None:
            return False
        self.load()
        if int(m.group(3)) >= self.gen:
            return False
        if m.group(1) and m.group(2).endswith("-e.parquet") and m.group(2) in self.legit:
            return False  # the copy of a counted result part's dead letters
        return rel not in self.legit

    def visible(self, paths: list[str]) -> list[str]:
        """``paths`` (of the output's filesystem) without the orphans."""
        return [p for p in paths if not self.orphan(self.files.rel(p))]

    # ---- the holder's side -------------------------------------------------------------------------
    def parts(self) -> list[str]:
        """Every part with a generation (relative names): the output's top and ``_errors/``."""
        from connectors.io_retry import call_with_retry

        fs, out = self.files.fs, []
        for at in ("", ERRORS_DIR):
            root = self.files.path(at)
            if hasattr(fs, "invalidate_cache"):
                fs.invalidate_cache(root)
            try:
                names = call_with_retry(fs.ls, root, detail=False, op=f"list {root}")
            except FileNotFoundError:
                continue
            for p in names:
                rel = self.files.rel(p.rstrip("/"))
                if generation(rel) is not None:
                    out.append(rel)
        return sorted(out)

    def raise_to(self, gen: int, cleared: bool = False) -> list[str]:
        """Close every generation below ``gen`` (the holder's, before it reads or changes
        anything): the parts of them present now count, nothing of them that appears later
        does. ``cleared``: the holder deleted every part (``--fresh``): none counts. Moves the
        orphans aside; returns their names."""
        self.load()
        present = [] if cleared else self.parts()
        legit = {r for r in present if generation(r) < gen and not self.orphan(r)}  # what counted still counts
        self.files.write_json(FENCE_FILE, {"gen": gen, "legit": sorted(legit)})
        self.gen, self.legit = gen, frozenset(legit)
        return self.sweep(present if not cleared else None)

    def sweep(self, present: list[str] | None = None) -> list[str]:
        """Move every orphan (of ``present``, a listing of `parts`; listed now by default) to
        ``_orphans/``, its index file deleted; returns their names."""
        from connectors.io_retry import call_with_retry
        from dlbatch.output.parts import INDEX_DIR

        orphans = [r for r in (self.parts() if present is None else present) if self.orphan(r)]
        fs = self.files.fs
        for rel in orphans:
            self.files.verify()
            dest = self.files.path(f"{ORPHANS_DIR}/{rel}")
            call_with_retry(fs.makedirs, dest.rsplit("/", 1)[0], exist_ok=True, op="makedirs")
            try:
                call_with_retry(fs.mv, self.files.path(rel), dest, op=f"move aside {rel}")
            except FileNotFoundError:
                continue
            at, _, name = rel.rpartition("/")
            self.files.rm(self.files.path(f"{at}/{INDEX_DIR}/{name}" if at else f"{INDEX_DIR}/{name}"))
            self.moved.append(rel)
            log.warning("moved aside %s: a part committed by a process after it lost the lease of %s "
                        "(its documents are redone by the holder)", rel, self.files.url)
        return orphans


def orphan_report(files) -> dict:
    """What `dlbatch status` says of orphans: ``moved`` (files under ``_orphans/``) and
    ``in_place`` (orphans a holder has not moved aside yet; plain readers see them)."""
    moved = [f for f in files.find(ORPHANS_DIR) if f.endswith(".parquet")]
    fence = files.fence
    in_place = [r for r in fence.parts() if fence.orphan(r)]
    return {"moved": len(moved), "in_place": len(in_place)}

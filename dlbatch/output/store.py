"""`Store`: what every output format promises, and all that the driver, the commands and the
OpenAI-batch export may use of one.

Two stores implement it, side by side: `ParquetStore` (dlbatch/output/parquet_store.py:
result parts at the top of the output) and `DeltaStore` (dlbatch/output/delta_store.py: a
Delta table at the output path). Both stand on one `OutputFiles` (``files``: the folder, its
lease, the manifest, the input versions, the report) and keep their dead letters alike
(`DeadLetters`, ``_errors/``). `dlbatch.output.open_store` picks the one that wrote a folder.

Invariants of every store:

- **Exactly once.** A flush (`commit`) lands whole or not at all: its result rows and its
  dead letters become visible together, and a document's rows are never split across
  flushes. A flush committed again — the same rows, or more rows after an attempt that
  raised (a lost reply) — commits each row once.
- **One writer.** Every change checks the lease of ``files`` first (when one is taken): a
  process that lost it changes nothing more (`LeaseLost`).
- **Fenced commits.** A process that lost the lease makes nothing visible afterwards that
  counts: a holder fences the output before it reads progress or changes it (Parquet parts:
  the fence of lease generations, dlbatch/output/fence.py, whose orphans are never read and
  are moved aside; Delta: a fence transaction in the log, which rejects an older holder's
  commit), and every rename re-reads the lease immediately before it.
- **Readers see commits only.** Nothing half-written is read; after a crash at any point,
  `recover` (run before progress is read) leaves each committed row visible once.
- **Its own files only.** A store changes the files its format wrote and the folder's
  records, never another format's files, sub-folders or unknown files.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from dlbatch.output.files import OutputFiles


@runtime_checkable
class Store(Protocol):
    format: str  # how the result rows are kept: "parquet" (parts) or "delta" (a Delta table)
    files: "OutputFiles"  # the output folder: URL, filesystem, lease, manifest, input versions, report

    def results(self, columns: list[str] | None = None):
        """Every committed result row (``columns`` of them) as one Arrow Table; an empty Table
        when there is none. Each (document, task) once."""

    def errors(self, columns: list[str] | None = None):
        """Every dead letter readers see (``_errors/``) as one Arrow Table of ERROR_COLUMNS."""

    def index(self):
        """Every committed result row's INDEX_COLUMNS (doc_id, source, task, token counts),
        read without the output text."""

    def progress(self, tasks: set[str] | None = None) -> dict:
        """What is committed (`dlbatch.output.progress.committed_progress`): done and failed
        documents, rows, tokens, duplicates, sources. Counts the dead letters committed with
        result rows whose readers' copy a crash has not written yet."""

    def commit(self, rows: list[dict], errors: list[dict], include_text: bool, extra_fields=()) -> str | None:
        """Commit one flush of complete documents: result ``rows`` (`dlbatch.records.result_row`)
        and dead letters ``errors`` land together or not at all. ``include_text``: the
        document's text is a column; ``extra_fields``: pyarrow fields of typed columns.
        Rows an earlier attempt that raised did commit are dropped first. Returns where the
        rows went (None: nothing to commit)."""

    def commit_errors(self, rows: list[dict]) -> str | None:
        """Commit a flush of dead letters only (one part under ``_errors/``), exactly once."""

    def recover(self) -> dict:
        """Finish what a crashed (or taken-over) writer left half done — readers' copies of
        committed dead letters, merges, pending files — so progress reads each row once.
        Returns counts of what it did (all 0: nothing was left)."""

    def supersede(self, sources: set[str], doc_ids: set[str] | None = None) -> int:
        """Remove every committed row and dead letter of the input files ``sources`` (replaced
        since their rows were committed; with ``doc_ids``, of those documents only: edited
        rows of a table input), crash-safely. Returns the result rows removed."""

    def retry_dead_letters(self, error_types: set[str]) -> int:
        """Remove, crash-safely, the dead letters of documents that failed whole with one of
        ``error_types``, so that a resume reads them again (`dlbatch.driver.runner`'s rule).
        Returns the dead letters removed."""

    def compact(self, min_parts: int = ...) -> dict:
        """Merge small data files into large ones when more than ``min_parts`` exist; every
        row stays visible once at every step. Returns ``parts_before``, ``merged_parts``,
        ``parts_written``."""

    def orphans(self) -> list[str]:
        """Move aside the parts a process committed after it lost the lease (orphans) visible
        now; returns every orphan this process moved aside (the run's report names them)."""

    def clear(self) -> int:
        """--fresh: delete the files this format wrote and the folder's records, nothing else
        (other jobs' sub-folders, unknown files, the lease). Returns the files deleted."""

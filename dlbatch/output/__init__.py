"""The output folder: everything a job writes under ``output.path``, behind one `Store` protocol.

Layout under the output path:

    _manifest.json             the job that writes the folder: its fingerprint (a rerun with
                               other settings is refused), its fields (``output.format`` when
                               not parquet), the inputs' digest, ``complete``   (files.py)
    _lease/<n>.json            the lease of the one writer; <n>: its generation (lease.py,
                               identity.py)
    _fence.json, _orphans/     the fence of lease generations; parts committed after a
                               takeover by the holder taken over, moved aside   (fence.py)
    _sources.arrow             each input's content version when last listed   (files.py; an
                               output written before keeps ``_sources.parquet`` until then)
    _report.json/.html/.png    the run report                                   (files.py)
    _tmp/                      whole-file writes before their rename            (files.py)
    _errors/                   dead letters, whatever the format               (dead_letters.py)
    part-*.parquet, _index/, _compact/    the result rows as Parquet parts     (parquet_store.py,
                                          parts.py, compaction.py; kept input columns typed by
                                          kept_columns.py)
    _delta_log/, part-*.parquet           ... or as a Delta table              (delta_store.py)
    results.jsonl, errors.jsonl           ``output.format: openai_batch``: written from the
                                          committed rows when a run completes (openai_export.py)

`Store` (store.py) is what the driver and the commands use: `ParquetStore` and `DeltaStore`
implement it side by side on one `OutputFiles` (the folder, its lease, its records);
`PartsFolder` (parts.py) is a folder of committed Parquet parts, which `Compaction` merges;
`status.py` reads a job's progress without Ray.

The manifest first. Every command opens its output with `open_store`, which reads the
manifest and opens the store of the format that wrote the folder — so ``dlbatch compact`` of
a Delta output compacts it as Delta whatever the job file says, ``--fresh`` lets the format
that wrote the folder delete its own files, and no store ever reads another format's files
as its own or deletes them. A run then writes only the job's own format (`run_store`).
"""
from __future__ import annotations

from dlbatch.output.files import MANIFEST, OutputFiles

STORE_OF = {"parquet": "parquet", "openai_batch": "parquet", "delta": "delta"}  # output.format -> its store
KINDS = {"parquet": "Parquet parts", "delta": "a Delta table"}


class FormatMismatch(ValueError):
    """A run asked to write one format into an output another format wrote."""


def written_format(files: OutputFiles) -> str | None:
    """The store format ("parquet" or "delta") of what the folder holds: its manifest's
    ``output.format`` (a manifest without one: parquet); for a folder without a manifest (rows
    committed through a store directly) "delta" when it holds a Delta log; None when nothing
    was written."""
    from dlbatch.output.delta_store import DELTA_LOG

    manifest = files.read_json(MANIFEST)
    if manifest is None:
        return "delta" if files.exists(DELTA_LOG) else None
    fmt = (manifest.get("fields") or {}).get("output.format") or "parquet"
    if fmt not in STORE_OF:
        raise ValueError(f"{files.url}/{MANIFEST} names output.format {fmt!r}, which is none of "
                         f"{sorted(STORE_OF)}: written by another version of dlbatch?")
    return STORE_OF[fmt]


def open_store(output, files: OutputFiles | None = None, fmt: str | None = None):
    """The `Store` of a job's ``output:`` section (`dlbatch.jobspec.OutputSpec`): by default
    the store of the format that wrote the folder (`written_format`: the manifest first), the
    job's ``output.format`` for a folder nothing wrote yet. ``fmt``: that store format
    instead; ``files``: the folder already open (its lease held), shared with the new store."""
    files = files if files is not None else OutputFiles(output.path, dict(output.storage_options))
    fmt = fmt or written_format(files) or STORE_OF[getattr(output, "format", "parquet")]
    if fmt == "delta":
        from dlbatch.output.delta_store import DeltaStore as cls
    else:
        from dlbatch.output.parquet_store import ParquetStore as cls
    kw = {"keep_columns": output.keep_columns} if getattr(output, "keep_columns", None) else {}
    return cls(files, **kw)


def run_store(store, output, cleared: bool = False):
    """The store a run commits with: ``store`` (`open_store`'s: the format that wrote the
    folder) when the job writes that format. After ``--fresh`` (``cleared``: ``store`` deleted
    its files) the job's format, on the same folder and lease. Otherwise `FormatMismatch`: a
    run never writes one format into a folder another wrote."""
    want = STORE_OF[getattr(output, "format", "parquet")]
    if store.format == want:
        return store
    if cleared:
        return open_store(output, store.files, want)
    raise FormatMismatch(f"the output {store.files.url} holds {KINDS[store.format]} (output.format {store.format}); "
                         f"this job writes {KINDS[want]} (output.format {getattr(output, 'format', 'parquet')}): "
                         f"set output.format={store.format} to resume it, or run with --fresh to delete it and "
                         f"start over")

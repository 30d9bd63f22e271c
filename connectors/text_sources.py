"""Readers for record-style and plain-text sources: JSONL, Parquet, text/markdown, HF datasets.

Every reader is a generator of rows (connectors/records.py). Bad records become error rows
with the line/row number in ``source`` and ``error``; they never stop the file:

* JSONL: a line that is not valid UTF-8 -> DecodeError; not JSON or not an object ->
  MalformedJSON; text field absent/null -> MissingField; text not a string -> BadFieldType;
  empty text -> EmptyDocument; ``id_field`` given but absent -> MissingField.
* Parquet / HF datasets: the same per-row rules; an unreadable Parquet file -> one
  CorruptFile row.
* Text: one document per file; non-UTF-8 -> DecodeError (unless errors="replace").

``source`` is ``<path>#line<N>`` (1-based) for JSONL and ``<path>#row<N>`` (0-based) for
Parquet and datasets (``<path>#<split>/row<N>`` for a DatasetDict).

Bounded lines. A JSONL (or OpenAI batch) line longer than ``max_line_bytes`` is never held:
:func:`bounded_lines` reads the file in chunks, keeps at most the cap plus one chunk, reads
past the rest of an over-long line to its newline and yields it as its length only; the line
is a ``LineTooLong`` error row naming its size and the cap (`line_too_long`).

Each reader also reads one part of its input (`connectors.part.Part`, cut by
`connectors.splits`): a JSONL byte range through `open_part` (its lines numbered from the
part's first line), a Parquet file's rows through the row groups that hold them, a dataset's
rows through ``Dataset.select``. The rows of a file's parts, in order, are the rows of the
whole file, sources included.
"""

from __future__ import annotations

import io
import json
import logging
import tempfile
from typing import Iterator, NamedTuple

from .io_retry import call_with_retry
from .part import WHOLE, Part
from .records import (CORRUPT_FILE, DECODE_ERROR, EMPTY_DOCUMENT, LINE_TOO_LONG, MALFORMED_JSON, error_row, ok_row,
                      record_to_row)

log = logging.getLogger(__name__)

DEFAULT_TEXT_FIELD = "text"
DEFAULT_TITLE_FIELD = "title"
MAX_LINE_BYTES = 16 << 20  # input.max_line_bytes's default
READ_CHUNK = 1 << 20       # bytes read at a time by bounded_lines
HEAD_BYTES = 4096          # what bounded_lines keeps of an over-long line


def _fs_for(path: str, fs, storage_options: dict | None = None):
    if fs is not None:
        return fs
    import fsspec

    from .secrets import masked, resolve_options

    with masked():
        fs, _ = fsspec.core.url_to_fs(path, **resolve_options(storage_options))
    return fs


def _open(fs, path: str, compression: str | None = None):
    """Open for reading, retrying transient errors on the open."""
    def do_open():
        return fs.open(path, "rb", compression=compression) if compression else fs.open(path, "rb")
    return call_with_retry(do_open, op=f"open {path}")


class _ByteRange(io.RawIOBase):
    """The bytes [start, stop) of an open file (stop None: to its end), as a raw stream that
    `io.BufferedReader` reads lines from; closing it closes the file."""

    def __init__(self, f, start: int, stop: int | None):
        self._f = f
        f.seek(start)
        self._left = None if stop is None else stop - start

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = len(b) if self._left is None else min(len(b), self._left)
        if n <= 0:
            return 0
        data = self._f.read(n)
        b[:len(data)] = data
        if self._left is not None:
            self._left -= len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


def open_part(fs, path: str, part: Part = WHOLE):
    """Open a JSON Lines file for reading ``part`` of it: the whole file, decompressed by its
    suffix, or the bytes of a byte-range part only (an uncompressed file: a compressed one
    cannot be entered in the middle, so it is never cut)."""
    compression = _compression_for(path)
    if part.whole:
        return _open(fs, path, compression)
    if compression:
        raise ValueError(f"{path}: a {compression} file is read whole, not from byte {part.start}")
    return io.BufferedReader(_ByteRange(_open(fs, path), part.start, part.stop), buffer_size=1 << 20)


def _compression_for(path: str) -> str | None:
    lower = path.lower()
    if lower.endswith(".gz"):
        return "gzip"
    if lower.endswith(".bz2"):
        return "bz2"
    if lower.endswith(".zst"):
        return "zstd"
    if lower.endswith(".xz"):
        return "xz"
    return None


# ------------------------------------------------------------------ JSONL


def bounded_lines(f, max_bytes: int | None, chunk: int = READ_CHUNK) -> Iterator[tuple[bytes | None, int, bytes]]:
    """``(line, length, head)`` of every line of the binary file ``f``, without its newline;
    the line is None when it is longer than ``max_bytes`` (None: no cap), and ``head`` is then
    its first ``HEAD_BYTES`` (b"" otherwise). Holds at most ``max_bytes + chunk`` bytes: an
    over-long line is read past, not kept."""
    buf = bytearray()
    skipped, head = -1, b""  # skipped >= 0: the length so far of an over-long line being read past
    while True:
        data = f.read(chunk)
        if not data:
            break
        start = 0
        if skipped >= 0:
            nl = data.find(b"\n")
            head += data[:min(HEAD_BYTES - len(head), len(data) if nl < 0 else nl)]
            if nl < 0:
                skipped += len(data)
                continue
            yield None, skipped + nl, head
            skipped, start = -1, nl + 1
        searched = len(buf)  # what buf holds already has no newline
        buf += data[start:] if start else data
        pos = 0
        while (nl := buf.find(b"\n", max(pos, searched))) >= 0:
            yield _line(buf, pos, nl, max_bytes)
            pos = nl + 1
        del buf[:pos]
        if max_bytes is not None and len(buf) > max_bytes:
            skipped, head, buf = len(buf), bytes(buf[:HEAD_BYTES]), bytearray()
    if skipped >= 0:
        yield None, skipped, head
    elif buf:
        yield _line(buf, 0, len(buf), max_bytes)


def _line(buf: bytearray, start: int, end: int, max_bytes: int | None) -> tuple[bytes | None, int, bytes]:
    n = end - start
    if max_bytes is None or n <= max_bytes:
        return bytes(buf[start:end]), n, b""
    return None, n, bytes(buf[start:min(end, start + HEAD_BYTES)])


class Line(NamedTuple):
    """A non-blank line of a JSON Lines file: ``raw`` is None when it was longer than the cap
    (``head``: its first bytes then)."""

    number: int  # 1-based, blank lines counted
    raw: bytes | None
    source: str  # <path>#line<N>
    size: int  # bytes, without the newline
    head: bytes = b""


def jsonl_lines(fs, path: str, max_line_bytes: int | None = MAX_LINE_BYTES, part: Part = WHOLE) -> Iterator[Line]:
    """Every non-blank line of a JSON Lines file (compressed by its suffix), or of a part of
    it (numbered from the part's first line), each over ``max_line_bytes`` without its bytes
    (:func:`bounded_lines`)."""
    with open_part(fs, path, part) as f:
        for number, (raw, size, head) in enumerate(bounded_lines(f, max_line_bytes), start=part.line):
            if raw is not None:
                raw = raw.rstrip(b"\r")
                if not raw.strip():
                    continue
            yield Line(number, raw, f"{path}#line{number}", size, head)


def line_too_long(line: Line, max_line_bytes: int | None) -> dict:
    """The error row of a line over the cap (its id: the hash of its source)."""
    return error_row(source=line.source, error_type=LINE_TOO_LONG,
                     error=f"line {line.number}: {line.size} bytes, over input.max_line_bytes={max_line_bytes}; "
                           "not read")


def read_jsonl(path: str, text_field: str = DEFAULT_TEXT_FIELD, id_field: str | None = None,
               fs=None, title_field: str | None = DEFAULT_TITLE_FIELD,
               storage_options: dict | None = None, max_line_bytes: int | None = MAX_LINE_BYTES,
               part: Part = WHOLE) -> Iterator[dict]:
    """One row per non-blank line of a JSON Lines file (``.jsonl``, ``.json``, ``.jsonl.gz``)."""
    fs = _fs_for(path, fs, storage_options)
    for line in jsonl_lines(fs, path, max_line_bytes, part):
        number, raw, source = line.number, line.raw, line.source
        if raw is None:
            yield line_too_long(line, max_line_bytes)
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield error_row(source=source, raw=raw, error_type=DECODE_ERROR,
                            error=f"line {number}: not valid UTF-8 at byte {exc.start}")
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            yield error_row(source=source, raw=raw, error_type=MALFORMED_JSON,
                            error=f"line {number}: invalid JSON: {exc.msg} (column {exc.colno})")
            continue
        row = record_to_row(record, source, text_field, id_field, title_field, raw=raw)
        if row["error"] and not row["error"].startswith("line "):
            row["error"] = f"line {number}: {row['error']}"
        yield row


# ------------------------------------------------------------------ Parquet


def read_parquet(path: str, text_field: str = DEFAULT_TEXT_FIELD, id_field: str | None = None,
                 fs=None, title_field: str | None = DEFAULT_TITLE_FIELD,
                 storage_options: dict | None = None, batch_size: int = 1024, part: Part = WHOLE) -> Iterator[dict]:
    """One row per Parquet row, its other columns with their types in ``columns``; a part's
    rows are read from the row groups that hold them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs = _fs_for(path, fs, storage_options)
    with _open(fs, path) as f:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as exc:
            if isinstance(exc, OSError) and not isinstance(exc, pa.ArrowException):
                raise
            yield error_row(source=path, raw=path, error_type=CORRUPT_FILE,
                            error=f"unreadable Parquet file: {exc}"[:300])
            return
        names = set(pf.schema_arrow.names)
        wanted = [c for c in dict.fromkeys([text_field, id_field, title_field]) if c and c in names]
        if text_field not in names:
            log.warning("%s: text field %r is not a column (columns: %s)", path, text_field,
                        sorted(names))
        stop = pf.metadata.num_rows if part.stop is None else min(part.stop, pf.metadata.num_rows)
        if not wanted:  # nothing we need exists: every row is a MissingField row
            for index in range(part.start, stop):
                yield record_to_row({}, f"{path}#row{index}", text_field, id_field, title_field,
                                    raw=f"{path}#row{index}")
            return
        groups, index = _row_groups(pf.metadata, part.start, stop)
        if not groups:
            return
        for batch in pf.iter_batches(batch_size=batch_size, row_groups=groups):  # every column: templates, keep_columns
            lo, hi = max(0, part.start - index), min(batch.num_rows, stop - index)
            for i, record in enumerate(batch.select(wanted).slice(lo, max(0, hi - lo)).to_pylist(), start=lo):
                source = f"{path}#row{index + i}"
                yield record_to_row(record, source, text_field, id_field, title_field,
                                    raw=None if record.get(text_field) else source, arrow=batch.slice(i, 1))
            index += batch.num_rows
            if index >= stop:
                return


def _row_groups(metadata, start: int, stop: int) -> tuple[list[int], int]:
    """(the row groups holding rows [start, stop), the file's index of their first row)."""
    groups, first, at = [], None, 0
    for g in range(metadata.num_row_groups):
        n = metadata.row_group(g).num_rows
        if at < stop and at + n > start:
            groups.append(g)
            first = at if first is None else first
        at += n
    return groups, (first if first is not None else start)


# ------------------------------------------------------------------ text


def read_text(path: str, text_field: str | None = None, id_field: str | None = None,
              fs=None, errors: str = "strict", storage_options: dict | None = None) -> Iterator[dict]:
    """One row for the whole file. ``errors="replace"`` decodes bad bytes as U+FFFD instead
    of yielding a DecodeError row. For ``.md`` the first ``# `` heading is the title."""
    if id_field:
        raise ValueError(f"id_field={id_field!r} is not supported for text files: "
                         "their doc_id is the hash of their content")
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors must be 'strict' or 'replace', got {errors!r}")
    fs = _fs_for(path, fs, storage_options)
    compression = _compression_for(path)

    def fetch() -> bytes:
        with _open(fs, path, compression) as f:
            return f.read()

    data = call_with_retry(fetch, op=f"read {path}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        if errors == "strict":
            yield error_row(source=path, raw=data, error_type=DECODE_ERROR,
                            error=f"not valid UTF-8 at byte {exc.start} "
                                  f"(byte 0x{data[exc.start]:02x}); pass errors='replace' to accept")
            return
        text = data.decode("utf-8-sig", errors="replace")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        yield error_row(source=path, raw=data, error_type=EMPTY_DOCUMENT, error="file has no text")
        return
    title = None
    if path.lower().endswith((".md", ".markdown")):
        for line in text.splitlines():
            if line.startswith("# "):
                title = line[2:].strip() or None
                break
    yield ok_row(doc_id=None, source=path, text=text, title=title)


# ------------------------------------------------------------------ Hugging Face datasets

_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def hf_offline():
    """No hub access inside: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set in the environment and
    in the already-imported config modules, both restored afterwards (`connectors.hf_hub`)."""
    from .hf_hub import offline_mode

    return offline_mode(True)


def is_saved_dataset_dir(path: str, fs=None, storage_options: dict | None = None) -> bool:
    fs = _fs_for(path, fs, storage_options)
    try:
        if not fs.isdir(path):
            return False
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    except FileNotFoundError:
        return False
    return "dataset_dict.json" in names or {"dataset_info.json", "state.json"} <= names


def _builder_for(path: str) -> str | None:
    lower = path.lower()
    if lower.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        return "json"
    if lower.endswith(".parquet"):
        return "parquet"
    return None


def read_hf(path: str, text_field: str = DEFAULT_TEXT_FIELD, id_field: str | None = None,
            split: str | None = None, title_field: str | None = DEFAULT_TITLE_FIELD,
            storage_options: dict | None = None, part: Part = WHOLE) -> Iterator[dict]:
    """Rows from a dataset saved with ``save_to_disk`` (``datasets.load_from_disk``) or from
    local JSON/Parquet data files (``datasets.load_dataset(builder, data_files=...)``).
    Never touches the hub. A JSON data file that ``datasets`` cannot parse is re-read line
    by line with :func:`read_jsonl`, so bad lines become error rows. ``part``: rows of a saved
    dataset (its chosen splits one after another, `dataset_splits`); a data file is read whole."""
    with hf_offline():
        import datasets

        if is_saved_dataset_dir(path, storage_options=storage_options):
            ds = call_with_retry(datasets.load_from_disk, path, storage_options=storage_options,
                                 op=f"load_from_disk {path}")
            yield from _iter_dataset(ds, path, text_field, id_field, split, title_field, part)
            return
        builder = _builder_for(path)
        if builder is None:
            raise ValueError(f"{path}: not a saved dataset directory (no dataset_info.json + "
                             f"state.json, or dataset_dict.json) and not a .json/.jsonl/.parquet "
                             f"data file")
        if not part.whole:
            raise ValueError(f"{path}: a data file read through datasets is read whole, not as {part}")
        with tempfile.TemporaryDirectory(prefix="dlbatch-hf-") as cache_dir:
            try:
                ds = datasets.load_dataset(builder, data_files=path, split="train", cache_dir=cache_dir,
                                           storage_options=storage_options)
            except datasets.exceptions.DatasetGenerationError as exc:
                if builder != "json":
                    raise
                log.warning("%s: datasets could not parse it (%s); reading line by line", path,
                            str(exc).splitlines()[0][:200])
                yield from read_jsonl(path, text_field, id_field, title_field=title_field,
                                      storage_options=storage_options)
                return
            yield from _iter_dataset(ds, path, text_field, id_field, split, title_field)


def dataset_splits(ds, path: str, split: str | None) -> list:
    """[(source prefix, Dataset)] of what a job reads of a loaded dataset, in reading order:
    a Dataset itself (``<path>#row``), or a DatasetDict's ``split`` (else every split, sorted:
    ``<path>#<split>/row``). A part's rows count through them one after another."""
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if split is not None and split not in ds:
            raise ValueError(f"{path}: no split {split!r} (splits: {sorted(ds)})")
        return [(f"{path}#{name}/row", ds[name]) for name in ([split] if split else sorted(ds))]
    return [(f"{path}#row", ds)]


def _iter_dataset(ds, path: str, text_field: str, id_field: str | None, split: str | None,
                  title_field: str | None, part: Part = WHOLE) -> Iterator[dict]:
    offset = 0
    for prefix, d in dataset_splits(ds, path, split):
        n = len(d)
        lo = max(part.start - offset, 0)
        hi = n if part.stop is None else min(part.stop - offset, n)
        if hi > lo:
            yield from _iter_split(d if (lo, hi) == (0, n) else d.select(range(lo, hi)), prefix, text_field,
                                   id_field, title_field, first=lo)
        offset += n


def _iter_split(ds, prefix: str, text_field: str, id_field: str | None,
                title_field: str | None, first: int = 0) -> Iterator[dict]:
    from .hf_hub import iter_rows  # every column, with its Arrow type (templates, keep_columns)

    yield from iter_rows(ds, prefix, text_field, id_field, title_field, first=first)

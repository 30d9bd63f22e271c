"""Input listing and per-file reading through fsspec.

``list_inputs(path, format)`` accepts a local directory, a glob, a single file, or any fsspec
URL (``s3://``, ``gs://``, ``memory://``, ``file://``) and returns a sorted, de-duplicated list
of file URLs (plain absolute paths for the local filesystem, ``proto://...`` otherwise).
Files and folders whose name starts with ``_`` or ``.`` (``_tmp/``, ``_SUCCESS``,
``.ipynb_checkpoints``) are skipped when walking a directory, and so is a local file that
resolves outside the listed folder (a symbolic link to elsewhere, or a file under a linked
folder), with a warning naming it and its target. A file named explicitly is read as named.

``read_document_file(url, format, ...)`` yields the rows of one listed input. What a format
holds, its file names, its reader and its row counter are its row of the input-format table
(`connectors.formats`).

A Hub dataset (``input.format: hf``, ``path: org/name``) is one input, named by the URL the
job spec folds its config/split/revision/streaming into (``hf-dataset://org/name?...``,
`connectors.hf_hub`): listing it checks that the dataset, config and split exist (a
`connectors.hf_hub.HubDatasetError` naming what does otherwise), reading it goes through
``datasets.load_dataset``, and its version is the prepared dataset's revision and sizes.

Names that are not UTF-8. A local file name with bytes that do not decode (Python gives each
as a lone surrogate, ``surrogateescape``) is listed escaped, ``\\udcXX`` per byte
(`connectors.repair.repair_id`, as an output's ``source`` spells it): every URL this module
hands out is plain UTF-8, so Arrow, JSON and the digests take it, and the listing, the rows'
``source`` and the output's index name the file the same way on every run. Opening goes
through `_url_to_fs`, which maps the escapes back to the name the file system spells
(`connectors.repair.unescape_name`); where both spellings exist as files, the one with the
undecodable bytes is meant.

``input.limit`` is applied here, not by the data plane: :func:`limited_reads` gives, for the
sorted listing, how many rows each file contributes so that the job takes the first N rows
in a fixed order (files sorted by URL, rows in file order). Ray Data's ``limit()`` takes the
first N rows that happen to arrive, which changes with parallelism, so a resumed run could
pick other documents. Counting stops at the limit: only the files the limit reaches are
read (JSONL: lines counted, not parsed; Parquet: the footer's row count).
"""

from __future__ import annotations

import logging
import re
from itertools import islice
from typing import Iterator

from .formats import FORMATS, ReadOptions, input_format
from .io_retry import call_with_retry
from .part import WHOLE, Part
from .records import MAX_TEXT_CHARS, DuplicateIds, cut_text
from .repair import repair_id, unescape_name
from .secrets import masked, resolve_options
from .text_sources import MAX_LINE_BYTES

log = logging.getLogger(__name__)

__all__ = ["FORMATS", "count_rows", "inputs_fingerprint", "limited_reads", "list_inputs", "read_document_file"]

_GLOB_CHARS = re.compile(r"[*?\[]")


def _url_to_fs(path: str, storage_options: dict | None):
    """(file system, path on it) of a URL this module handed out, or of a user's path.
    ``storage_options``: a dict or `secrets.seal`'s ref; ``${env:NAME}`` values resolved here.
    An escaped undecodable byte (``\\udcXX``) is the byte again in the path (module docstring)."""
    import fsspec

    with masked():
        fs, p = fsspec.core.url_to_fs(path, **resolve_options(storage_options))
    return fs, _spelled(fs, p)


def _spelled(fs, p: str) -> str:
    """The name the file system spells for a listed path: ``p`` with its escapes as the bytes
    they stand for, unless only the escaped spelling exists (a name with a literal ``\\udcXX``)."""
    raw = unescape_name(p)
    if raw == p or call_with_retry(fs.exists, raw, op=f"exists {p}"):
        return raw
    return p if call_with_retry(fs.exists, p, op=f"exists {p}") else raw


def _url_of(fs, p: str) -> str:
    """A path on ``fs`` -> its URL (a plain path for local files), as the file system spells it."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        return fs._strip_protocol(p)
    return fs.unstrip_protocol(p)


def _public(fs, p: str) -> str:
    """A path fsspec gave back -> the URL we hand out (an undecodable byte of its name
    escaped, see the module docstring)."""
    return repair_id(_url_of(fs, p))


def _hidden(relative: str) -> bool:
    return any(part.startswith(("_", ".")) for part in relative.split("/") if part)


def _matches(p: str, exts: tuple[str, ...]) -> bool:
    return p.lower().endswith(exts)


def list_inputs(path: str, format: str, storage_options: dict | None = None, *,
                max_line_bytes: int | None = MAX_LINE_BYTES) -> list[str]:
    """Sorted input file URLs for ``format`` under ``path`` (dir, glob, file or URL).

    Raises FileNotFoundError naming ``path`` when it does not exist or nothing matches,
    ValueError for an unknown format. OpenAI batch request files are checked as the Batch
    API checks an upload: a custom_id on two lines of them raises
    `connectors.openai_batch.DuplicateCustomId` naming both lines.
    """
    exts = input_format(format).extensions
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"input path must be a non-empty string, got {path!r}")
    from .hf_hub import check_hub_dataset, is_hub_url

    if is_hub_url(path):
        if format != "hf":
            raise ValueError(f"{path!r} is a Hub dataset: it is read with input.format hf, not {format}")
        check_hub_dataset(path, storage_options=resolve_options(storage_options))
        return [path]
    fs, root = _url_to_fs(path, storage_options)
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache()  # an object-store listing cache must not hide new files

    if _GLOB_CHARS.search(root):
        matched = call_with_retry(fs.glob, root, op=f"glob {path}")
        files: list[str] = []
        for m in matched:
            if call_with_retry(fs.isdir, m, op=f"isdir {m}"):
                files.extend(_walk(fs, m, exts, format))
            elif _matches(m, exts):
                files.append(m)
        if not matched:
            raise FileNotFoundError(f"no files match the glob {path!r}")
        files = _within(fs, root[:_GLOB_CHARS.search(root).start()].rsplit("/", 1)[0] or "/", files)
    elif call_with_retry(fs.isdir, root, op=f"isdir {path}"):
        files = _within(fs, root, _walk(fs, root, exts, format))
    elif call_with_retry(fs.exists, root, op=f"exists {path}"):
        files = [root]  # a file named explicitly is taken whatever its extension
    else:
        raise FileNotFoundError(f"input path does not exist: {path!r}")

    urls = sorted({_public(fs, f) for f in files})
    if not urls:
        raise FileNotFoundError(f"no {format} inputs ({', '.join(exts)}"
                                f"{' or a saved dataset directory' if format == 'hf' else ''}) "
                                f"found under {path!r}")
    if format == "openai_batch":
        from .openai_batch import check_custom_ids

        check_custom_ids(((u, *_url_to_fs(u, storage_options)) for u in urls), max_line_bytes)
    return urls


def _within(fs, folder: str, files: list[str]) -> list[str]:
    """``files`` less those that resolve outside ``folder`` (a symbolic link, or a file under a
    linked folder, pointing elsewhere), each skipped with a warning naming it and its target:
    a drop folder must not leak what a link points at into the output. Local files only
    (object stores have no links)."""
    import os

    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        return files
    base = os.path.realpath(folder)
    kept = []
    for f in files:
        real = os.path.realpath(f)
        if real == base or real.startswith(base.rstrip(os.sep) + os.sep):
            kept.append(f)
        else:
            log.warning("input %s resolves to %s, outside the input folder %s (a symbolic link): skipped",
                        repair_id(f), repair_id(real), repair_id(base))
    return kept


def _walk(fs, root: str, exts: tuple[str, ...], format: str) -> list[str]:
    if format == "hf":
        from .text_sources import is_saved_dataset_dir

        if is_saved_dataset_dir(root, fs=fs):
            return [root]
    root_clean = root.rstrip("/")
    found = call_with_retry(fs.find, root_clean, op=f"find {root}")
    out = []
    for f in found:
        rel = f[len(root_clean):] if f.startswith(root_clean) else f
        if not _hidden(rel) and _matches(f, exts):
            out.append(f)
    return out


def read_document_file(url: str, format: str, text_field: str = "text", id_field: str | None = None,
                       storage_options: dict | None = None, *, max_pages: int | None = None,
                       errors: str = "strict", title_field: str | None = "title",
                       split: str | None = None, max_rows: int | None = None, part: Part = WHOLE,
                       max_line_bytes: int | None = MAX_LINE_BYTES,
                       max_text_chars: int | None = MAX_TEXT_CHARS) -> Iterator[dict]:
    """Rows of one input (a URL returned by :func:`list_inputs`), or of one part of it
    (`connectors.part.Part`, as `connectors.splits` cuts them; a format without a
    ``split`` is read whole: ValueError for a part of it).

    pdf -> one row (connectors.pdf.extract_pdf; ``max_pages`` caps pages read);
    jsonl / parquet -> one row per record; text -> one row per file (``errors``);
    hf -> rows of a saved dataset or data file (``split`` picks a DatasetDict split).
    Infrastructure errors (missing file after retries, permission) raise; bad content
    becomes error rows. ``max_rows``: the first rows only (:func:`limited_reads`).
    With ``id_field``, a row whose id an earlier row of the file (of the part) has becomes a
    ``DuplicateId`` error row naming both sources (`connectors.records.DuplicateIds`; across
    the parts of a file, as across files, the driver's `Duplicates` does the same);
    openai_batch -> one row per request line, its id the line's ``custom_id`` (checked the same way).
    Bounds: a JSONL or request line over ``max_line_bytes`` is a ``LineTooLong`` error row, read
    past without being held; a document's text over ``max_text_chars`` is cut to it
    (`connectors.records.cut_text`: the row's ``text_truncated_chars`` says how much went; its
    id is that of the whole text).
    """
    fmt = input_format(format)
    if not part.whole and fmt.split is None:
        raise ValueError(f"{url}: {format} inputs are read whole, not as {part}")
    options = ReadOptions(text_field=text_field, id_field=id_field, title_field=title_field, max_pages=max_pages,
                          errors=errors, split=split, storage_options=resolve_options(storage_options),
                          max_line_bytes=max_line_bytes, max_text_chars=max_text_chars)
    rows = _read_rows(url, fmt, options, part)
    if max_text_chars is not None:
        rows = (cut_text(r, max_text_chars) for r in rows)
    id_field = fmt.id_field or id_field
    if id_field:
        rows = DuplicateIds(id_field).check(rows)
    return rows if max_rows is None else islice(rows, max_rows)


def _read_rows(url: str, fmt, options: ReadOptions, part: Part) -> Iterator[dict]:
    """The format's reader over one input (or a part of it); a Hub dataset through `connectors.hf_hub`."""
    from .hf_hub import is_hub_url

    if is_hub_url(url):
        from .hf_hub import read_hub

        yield from read_hub(url, options.text_field, options.id_field, options.title_field,
                            storage_options=options.storage_options, part=part)
        return
    fs, fspath = _url_to_fs(url, options.storage_options)
    if unescape_name(url) != url:  # the readers open the URL they are given: the file system's spelling
        url = _url_of(fs, fspath)
    yield from fmt.read(url, fs, fspath, options, part)


_VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "last_modified", "updated",
                 "modified", "created")


def _version(info: dict) -> str:
    """What changes when an object's content changes: its ETag/generation on object stores,
    its modification time on file systems (first key of _VERSION_KEYS present)."""
    for k in _VERSION_KEYS:
        if info.get(k) is not None:
            return f"{k}={info[k]}"
    return ""


def _describe(url: str, storage_options: dict | None) -> str:
    from .hf_hub import hub_version, is_hub_url

    if is_hub_url(url):  # a Hub dataset: its revision and sizes
        return hub_version(url, resolve_options(storage_options))
    fs, p = _url_to_fs(url, storage_options)
    info = call_with_retry(fs.info, p, op=f"info {url}")
    if info.get("type") == "directory":  # an hf saved-dataset directory: every file in it
        found = call_with_retry(fs.find, p, detail=True, op=f"find {url}")
        return ";".join(f"{k[len(p):]}:{v.get('size')}:{_version(v)}" for k, v in sorted(found.items()))
    return f"{info.get('size')}:{_version(info)}"


def inputs_fingerprint(files: list[str], storage_options: dict | None = None, limit: int | None = None,
                       threads: int = 16) -> str:
    """A digest of the listed inputs as they are now: names, sizes, versions (modification
    time, or ETag/generation on object stores) and ``input.limit``. Rows appended to a file,
    a new file, a replaced object or a raised limit change it; the same inputs give the same
    digest. The info calls run ``threads`` at a time (one HEAD per object on a store)."""
    import hashlib

    if len(files) > 1 and threads > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(threads, len(files))) as ex:
            described = list(ex.map(lambda f: _describe(f, storage_options), files))
    else:
        described = [_describe(f, storage_options) for f in files]
    body = "\n".join(f"{f}\t{d}" for f, d in zip(files, described)) + f"\nlimit={limit}"
    return hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()[:16]  # a saved dataset's inner names


def count_rows(url: str, format: str, stop: int, storage_options: dict | None = None, **read_kwargs) -> int:
    """How many rows :func:`read_document_file` yields for ``url``, counting at most ``stop``.

    The format's counter (`connectors.formats`): JSONL its non-blank lines (each is one
    row, good or error), Parquet the footer's row count (an unreadable file is one
    CorruptFile row), a one-document file one; hf the rows read (a Hub dataset: its split's
    size when the dataset states it). A file that fails part-way counts the rows before the
    failure and one error row, as `connectors.parse.parse_file` turns it; a missing file or a
    denied read raises.
    """
    fmt = input_format(format)
    if fmt.one_doc_per_file:
        return min(1, stop)
    from .hf_hub import count_hub_rows, is_hub_url

    if is_hub_url(url):  # the split's size when the dataset states it, else the rows read
        return count_hub_rows(url, stop, storage_options=resolve_options(storage_options), **read_kwargs)
    if fmt.count is None:
        counts = (1 for _ in read_document_file(url, format, storage_options=storage_options, **read_kwargs))
    else:
        fs, fspath = _url_to_fs(url, storage_options)
        counts = fmt.count(url, fs, fspath)
    n = 0
    try:
        for k in counts:
            n += k
            if n >= stop:
                return stop
        return n
    except (FileNotFoundError, PermissionError):
        raise
    except Exception:
        return min(n + 1, stop)


def limited_reads(files: list[str], format: str, limit: int | None, storage_options: dict | None = None,
                  **read_kwargs) -> list[tuple[str, int | None]]:
    """``(url, max_rows)`` for each file the job reads: every file whole (``max_rows``
    None) without a limit; under ``input.limit`` N, the files in sorted order until N rows,
    the last one cut at the rows still wanted. The same files and limit give the same
    documents on every run and resume, whatever the reading parallelism."""
    files = sorted(files)
    if limit is None:
        return [(f, None) for f in files]
    out: list[tuple[str, int | None]] = []
    left = limit
    for f in files:
        if left <= 0:
            break
        n = count_rows(f, format, left, storage_options, **read_kwargs)
        if n:
            out.append((f, n))
            left -= n
    return out

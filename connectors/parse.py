"""Parse one read task (an input file, or a part of one: `connectors.read_tasks`) into
documents, as a Ray Data ``flat_map`` stage.

Nothing a file holds can fail the job; what the file cannot give becomes a row with ``error``
and ``error_type`` that the prompt stage turns into a dead letter:

* bad content (a corrupt or encrypted PDF, a bad JSONL line): the readers' error rows
  (`connectors.records`); any other exception of a reader: one row naming it;
* a PDF is parsed in a parser process (`connectors.isolate`): a crash of MuPDF
  (``ParseCrashed``, with the signal), a parse running past ``parse_timeout_s`` seconds
  (``ParseTimeout``) or past ``parse_memory_mb`` MiB of address space (``ParseMemoryExceeded``)
  costs that file only. A PDF or text file larger than ``max_file_bytes`` is not read
  (``FileTooLarge``, naming its size and the cap); ``max_pages`` caps the pages read of a PDF;
* a JSONL or request line over ``max_line_bytes`` is a ``LineTooLong`` row, never held whole;
  a document's text over ``max_text_chars`` is cut to it (a PDF's in its parser process), and
  the row's ``text_truncated_chars`` says how many characters went (None: the whole text);
* strings Arrow cannot encode (lone surrogates) are repaired (`connectors.repair`).

Record files (JSONL, Parquet, datasets) are read in this process: their parsers are Python's
``json`` and pyarrow, whose failures are Python exceptions that become error rows line by line,
and one such file is a whole data set, so a per-file time or memory cap would fail healthy
large files. Text files are decoded here too, under the byte cap.

A dead letter's ``doc_id`` is stable: the hash of the PDF's bytes, else of the file's URL. Its
``source`` is the file's URL, so a rerun of a PDF or text job finds the file done and does not
parse it again; a record file is parsed again and its dead-lettered ids are skipped.

Infrastructure errors (the file vanished, no permission, a parser process that cannot start)
raise, after the I/O retries, and fail the job. The structure of a PDF (abstract, sections,
references) travels as one JSON string: Arrow schemas of list-of-struct columns differ between
blocks with and without sections.
"""
from __future__ import annotations

import json
import os

from .records import MAX_TEXT_CHARS
from .repair import repair_row, repair_text
from .text_sources import MAX_LINE_BYTES

STRUCTURE_KEYS = ("abstract", "sections", "references", "references_span")

# the defaults of input.max_file_bytes, input.parse_timeout_s and input.parse_memory_mb
# (input.max_line_bytes and input.max_text_chars: MAX_LINE_BYTES and MAX_TEXT_CHARS, imported here)
MAX_FILE_BYTES = 256 << 20
PARSE_TIMEOUT_S = 300.0
PARSE_MEMORY_MB = 4096

PDF_EXTRACT = "connectors.pdf:extract_pdf"   # what the parser process runs on a PDF's bytes
# fault drills only: "module:function" run instead of PDF_EXTRACT (a parser that crashes or
# hangs on chosen files); unset in every real job
TEST_PARSER_ENV = "DLBATCH_TEST_PDF_PARSER"
PDF_PRELOAD = ("pymupdf", "connectors.pdf")  # imported when the parser process starts
FILE_TOO_LARGE = "FileTooLarge"


def parse_file(row: dict, fmt: str, text_field: str, id_field: str | None, storage_options: dict | None,
               max_pages: int | None, *, max_file_bytes: int | None = MAX_FILE_BYTES,
               parse_timeout_s: float = PARSE_TIMEOUT_S, parse_memory_mb: int | None = PARSE_MEMORY_MB,
               max_line_bytes: int | None = MAX_LINE_BYTES, max_text_chars: int | None = MAX_TEXT_CHARS,
               images: dict | None = None) -> list[dict]:
    """One read task (``row``: `connectors.read_tasks.ReadTask.row`; ``{"url": ...}`` alone is
    the whole file) -> its documents, error rows for bad ones. A task that fails as a whole is
    one error row naming the file (and the part: `ReadTask.source`). ``images``: the page
    images and figure crops a PDF's tasks ask for (`connectors.images`), rendered in the
    parser process beside the text, under the same caps; or the image columns of a table
    input's rows (``images["columns"]``: `connectors.image_columns`), read and checked here."""
    from .isolate import ParserUnavailable
    from .listing import read_document_file
    from .read_tasks import ReadTask
    from .records import error_row
    from .secrets import redact

    task = ReadTask.of(row)
    url = task.url
    try:
        too_large = _too_large(url, fmt, storage_options, max_file_bytes)
        if too_large is not None:
            out = [too_large]
        elif fmt == "pdf":
            out = [_parse_pdf(url, storage_options, max_pages, parse_timeout_s, parse_memory_mb, max_file_bytes,
                              max_text_chars, images)]
        else:  # max_rows: input.limit's cut of a file read whole
            out = list(read_document_file(url, fmt, text_field=text_field, id_field=id_field,
                                          storage_options=storage_options, max_pages=max_pages,
                                          max_rows=task.max_rows, part=task.part,
                                          max_line_bytes=max_line_bytes, max_text_chars=max_text_chars))
            # a row's images: read and checked here, beside its text
            out = [with_column_images(d, images, storage_options, url, max_file_bytes, id_field is not None)
                   for d in out]
    except (FileNotFoundError, PermissionError, ParserUnavailable):
        raise
    except Exception as e:  # a file the reader cannot handle becomes a dead letter
        out = [error_row(source=task.source, error_type=type(e).__name__,
                         error=redact(f"{type(e).__name__}: {e}")[:500])]
    return [document_row(d) for d in out]


def document_row(d: dict) -> dict:
    """A reader's row as the parse stage yields it: the document keys, its structure as JSON text,
    strings repaired."""
    structure = None
    if "sections" in d:  # as JSON text with the characters as they are, then repaired like any string
        structure = repair_text(json.dumps({k: d[k] for k in STRUCTURE_KEYS}, ensure_ascii=False))
    packed = None
    if d.get("images"):  # compressed bytes with their labels: one binary value (connectors/images.py)
        from .images import pack_images

        packed = pack_images(d["images"])
    return repair_row({"doc_id": str(d["doc_id"]), "source": str(d["source"]), "text": d.get("text") or "",
                       "title": d.get("title"), "pages": d.get("pages"), "error": d.get("error"),
                       "error_type": d.get("error_type"), "structure": structure,
                       "columns": d.get("columns"), "text_truncated_chars": d.get("text_truncated_chars"),
                       "images": packed})


def with_column_images(d: dict, request: dict | None, storage_options, input_url: str | None, max_bytes: int | None,
                       keep_id: bool = True) -> dict:
    """Row ``d`` with the images of its image columns (``request``: `dlbatch.prompts.multimodal.
    parse_request`), or its dead letter naming the column, the value and why: with the row's
    id where it is the input's (``keep_id``: ``input.id_field``), else the hash of its source
    (a content id would be shared by rows with one text and other images)."""
    if d.get("error") or not (request and request.get("columns")):
        return d
    from .columns import unpack
    from .image_columns import ImageError, column_images
    from .records import error_row

    try:
        found = column_images(unpack(d.get("columns")), request["columns"], max_images=request.get("max_images"),
                              max_pixels=request.get("max_pixels"), base=request.get("base"),
                              storage_options=storage_options, input_url=input_url, max_bytes=max_bytes,
                              timeout_s=request.get("timeout_s"))
    except ImageError as e:
        return error_row(source=d["source"], doc_id=d["doc_id"] if keep_id else None, title=d.get("title"),
                         error_type=e.error_type,
                         error=f"{e.error_type}: {e}"[:500])
    return {**d, "images": found}


def _too_large(url: str, fmt: str, storage_options: dict | None, max_file_bytes: int | None) -> dict | None:
    """A FileTooLarge row when a one-document file (pdf, text: `connectors.formats`) is over the
    cap, its size read before its bytes."""
    from .formats import input_format

    if max_file_bytes is None or not input_format(fmt).one_doc_per_file:
        return None
    from .io_retry import call_with_retry
    from .listing import _url_to_fs
    from .records import error_row

    fs, path = _url_to_fs(url, storage_options)
    size = call_with_retry(fs.size, path, op=f"size {url}")
    if size is None or size <= max_file_bytes:
        return None
    return error_row(source=url, error_type=FILE_TOO_LARGE,
                     error=f"the file is {size} bytes, over input.max_file_bytes={max_file_bytes}; not read")


def _parse_pdf(url: str, storage_options: dict | None, max_pages: int | None, timeout_s: float,
               memory_mb: int | None, max_file_bytes: int | None, max_text_chars: int | None,
               images: dict | None = None) -> dict:
    """Read the PDF here (I/O retries, credentials), extract it in a parser process."""
    from .io_retry import call_with_retry
    from .isolate import ParseFailed, run
    from .listing import _url_to_fs
    from .records import error_row

    fs, path = _url_to_fs(url, storage_options)
    data = call_with_retry(fs.cat_file, path, op=f"read {url}")
    if max_file_bytes is not None and len(data) > max_file_bytes:  # grew since its size was read
        return error_row(source=url, error_type=FILE_TOO_LARGE,
                         error=f"the file is {len(data)} bytes, over input.max_file_bytes={max_file_bytes}; not read")
    try:
        kwargs = {"max_pages": max_pages, "max_text_chars": max_text_chars, **({"images": images} if images else {})}
        return run(os.environ.get(TEST_PARSER_ENV) or PDF_EXTRACT, (data, url), kwargs, timeout_s=timeout_s,
                   memory_mb=memory_mb, preload=PDF_PRELOAD)
    except ParseFailed as e:
        return error_row(source=url, raw=data, error_type=e.error_type, error=f"{e.error_type}: {e.message}"[:500])

"""The input formats, one table: what a file of each format holds, how it is read and counted.

``input.format`` names a row of `INPUT_FORMATS`; everything that depends on the format asks
the table instead of naming formats:

- ``extensions``: the file names `connectors.listing.list_inputs` takes when it walks a folder;
- ``one_doc_per_file``: a file is one document (pdf, text). Its size is capped
  (``input.max_file_bytes``, `connectors.parse`), ``input.limit`` N is its first N files,
  and a source is done when its one document is;
- ``has_columns``: its rows carry input columns (``{{ row.x }}``, ``output.keep_columns``);
  a one-document file has none;
- ``id_field``: the field that is a row's id whatever the job says (an OpenAI batch line's
  ``custom_id``), None where the job's ``input.id_field`` (or a content hash) decides;
- ``read(url, fs, path, options, part)``: the rows of one file (``path``: the URL on ``fs``),
  or of one part of it (`connectors.part.Part`);
- ``count(url, fs, path)``: the rows of one file as they are counted, one number at a time
  (`connectors.listing.count_rows` stops at what it needs), without parsing them where the
  format allows (JSONL: its non-blank lines; Parquet: its footer); None: by reading them;
- ``split(url, fs, path, options, sizes, max_rows)``: the file cut into parts of about the
  sizes `connectors.splits.TaskSizes` gives, each with its estimated bytes, ending at row
  ``max_rows`` when one is given; None where the file is read whole (small, compressed, or a
  format without a split). `connectors.read_tasks` turns the parts into the data plane's read
  tasks.

Readers are imported when a file is read: listing formats costs no parser import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from .part import WHOLE, Part


@dataclass(frozen=True)
class ReadOptions:
    """What the job says about reading a file (``input.*``); each reader takes what it needs."""

    text_field: str = "text"
    id_field: Optional[str] = None
    title_field: Optional[str] = "title"
    max_pages: Optional[int] = None  # a PDF's first pages only
    errors: str = "strict"  # how a text file's undecodable bytes are treated
    split: Optional[str] = None  # a saved DatasetDict's split
    storage_options: Optional[dict] = None  # resolved (`connectors.secrets.resolve_options`)
    max_line_bytes: Optional[int] = None  # a longer JSONL/request line is a LineTooLong row (input.max_line_bytes)
    max_text_chars: Optional[int] = None  # a PDF's text cut in its parser (input.max_text_chars)


@dataclass(frozen=True)
class InputFormat:
    name: str
    extensions: tuple[str, ...]
    one_doc_per_file: bool
    has_columns: bool
    read: Callable[[str, Any, str, ReadOptions, Part], Iterator[dict]]
    count: Optional[Callable[[str, Any, str], Iterator[int]]]
    id_field: Optional[str] = None
    split: Optional[Callable[..., Optional[list]]] = None


def _read_pdf(url: str, fs, path: str, o: ReadOptions, part: Part = WHOLE) -> Iterator[dict]:
    from .io_retry import call_with_retry
    from .pdf import extract_pdf

    data = call_with_retry(fs.cat_file, path, op=f"read {url}")
    yield extract_pdf(data, url, max_pages=o.max_pages, max_text_chars=o.max_text_chars)


def _read_jsonl(url: str, fs, path: str, o: ReadOptions, part: Part = WHOLE) -> Iterator[dict]:
    from .text_sources import read_jsonl

    return read_jsonl(url, o.text_field, o.id_field, fs=fs, title_field=o.title_field, max_line_bytes=o.max_line_bytes,
                      part=part)


def _read_parquet(url: str, fs, path: str, o: ReadOptions, part: Part = WHOLE) -> Iterator[dict]:
    from .text_sources import read_parquet

    return read_parquet(url, o.text_field, o.id_field, fs=fs, title_field=o.title_field, part=part)


def _read_text(url: str, fs, path: str, o: ReadOptions, part: Part = WHOLE) -> Iterator[dict]:
    from .text_sources import read_text

    return read_text(url, fs=fs, id_field=o.id_field, errors=o.errors)


def _read_hf(url: str, fs, path: str, o: ReadOptions, part: Part = WHOLE) -> Iterator[dict]:
    from .text_sources import read_hf

    return read_hf(url, o.text_field, o.id_field, split=o.split, title_field=o.title_field,
                   storage_options=o.storage_options, part=part)


def _read_openai_batch(url: str, fs, path: str, o: ReadOptions, part: Part = WHOLE) -> Iterator[dict]:
    from .openai_batch import read_openai_batch

    return read_openai_batch(url, fs, o.max_line_bytes, part=part)


def _read_dataset(url: str, fs, path: str, o: ReadOptions, part: Part = WHOLE) -> Iterator[dict]:
    raise ValueError("input.format 'dataset' is read from the ray.data.Dataset given to dlbatch.run(job, "
                     "dataset=...), not from files (connectors/ray_dataset.py)")


def _one(url: str, fs, path: str) -> Iterator[int]:
    yield 1


def _lines(url: str, fs, path: str) -> Iterator[int]:
    """One per non-blank line: each is one row, good or an error row (a line over any cap is
    one row too, counted without holding its bytes)."""
    from .text_sources import jsonl_lines

    for _ in jsonl_lines(fs, path):
        yield 1


def _footer(url: str, fs, path: str) -> Iterator[int]:
    """The footer's row count; an unreadable file is one row (read_parquet's CorruptFile row)."""
    import pyarrow.parquet as pq

    from .io_retry import call_with_retry

    with call_with_retry(fs.open, path, "rb", op=f"open {url}") as f:
        try:
            n = pq.ParquetFile(f).metadata.num_rows
        except Exception:
            n = 1
    yield n


def _split_lines(url: str, fs, path: str, o: ReadOptions, sizes, max_rows: Optional[int]) -> Optional[list]:
    from .splits import line_parts

    return line_parts(url, fs, path, sizes, max_rows)


def _split_row_groups(url: str, fs, path: str, o: ReadOptions, sizes, max_rows: Optional[int]) -> Optional[list]:
    from .splits import row_group_parts

    return row_group_parts(url, fs, path, sizes, max_rows)


def _split_dataset(url: str, fs, path: str, o: ReadOptions, sizes, max_rows: Optional[int]) -> Optional[list]:
    from .splits import dataset_parts

    return dataset_parts(url, fs, path, o, sizes, max_rows)


_JSONL = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
INPUT_FORMATS: dict[str, InputFormat] = {f.name: f for f in (
    InputFormat("pdf", (".pdf",), one_doc_per_file=True, has_columns=False, read=_read_pdf, count=_one),
    InputFormat("jsonl", _JSONL, one_doc_per_file=False, has_columns=True, read=_read_jsonl, count=_lines,
                split=_split_lines),
    InputFormat("parquet", (".parquet",), one_doc_per_file=False, has_columns=True, read=_read_parquet,
                count=_footer, split=_split_row_groups),
    InputFormat("text", (".txt", ".md"), one_doc_per_file=True, has_columns=False, read=_read_text, count=_one),
    # a data file or a saved-dataset directory (`connectors.listing`), or a Hub dataset (`connectors.hf_hub`)
    InputFormat("hf", _JSONL + (".parquet",), one_doc_per_file=False, has_columns=True, read=_read_hf,
                count=None, split=_split_dataset),
    # OpenAI Batch API request files (connectors/openai_batch.py)
    InputFormat("openai_batch", (".jsonl", ".jsonl.gz"), one_doc_per_file=False, has_columns=True,
                read=_read_openai_batch, count=_lines, id_field="custom_id", split=_split_lines),
    # a ray.data.Dataset handed to dlbatch.run (connectors/ray_dataset.py): no files
    InputFormat("dataset", (), one_doc_per_file=False, has_columns=True, read=_read_dataset, count=None),
)}
FORMATS = tuple(INPUT_FORMATS)  # the names, as ``input.format`` takes them


def input_format(name: str) -> InputFormat:
    """The table's row for ``name``; ValueError naming it and the formats otherwise."""
    try:
        return INPUT_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown input format {name!r}; expected one of {list(FORMATS)}") from None

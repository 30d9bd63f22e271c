"""The row every reader yields: a plain dict with a fixed set of keys.

Keys: doc_id (str), source (str), text (str), title (str|None), pages (int|None),
error (None or a short reason), error_type (None or a class-like name).
A row with ``error`` set has ``text == ""`` and is a dead-letter candidate.

`record_to_row` turns one record of a JSONL, Parquet or datasets input into such a row; a
good one also carries the record's other columns (``columns``, `connectors.columns`).

A document's text is at most ``input.max_text_chars`` characters (`cut_text`, applied by
every reader before the row leaves the parse stage, so nothing downstream tokenizes more):
a longer one is cut to its first ``max_text_chars`` characters and the row's
``text_truncated_chars`` holds how many were cut (absent or None: the text is whole). The
doc_id is taken from the whole text before the cut, so it names the document, not the cap.

Ids given by ``input.id_field`` must be unique: the first row with an id (in file order)
is the document; every later row with that id becomes a ``DuplicateId`` error row that
names the id and both sources (:class:`DuplicateIds`), so it is dead-lettered and reported
instead of being dropped. Its own doc_id is the hash of the later source, so the dead
letter never shares the document's id.
"""

from __future__ import annotations

import json
from typing import Any

from .ids import content_id, id_from_field

ROW_KEYS = ("doc_id", "source", "text", "title", "pages", "error", "error_type")

# error_type values used by the readers
ENCRYPTED_PDF = "EncryptedPDF"
CORRUPT_PDF = "CorruptPDF"
EMPTY_DOCUMENT = "EmptyDocument"
IMAGE_ONLY_PDF = "ImageOnlyPDF"
DECODE_ERROR = "DecodeError"
MISSING_FIELD = "MissingField"
MALFORMED_JSON = "MalformedJSON"
BAD_FIELD_TYPE = "BadFieldType"
CORRUPT_FILE = "CorruptFile"
DUPLICATE_ID = "DuplicateId"
LINE_TOO_LONG = "LineTooLong"

MAX_TEXT_CHARS = 2_000_000  # input.max_text_chars's default (about 500k tokens)


def ok_row(*, doc_id: str | None, source: str, text: str,
           title: str | None = None, pages: int | None = None) -> dict:
    """A good row; doc_id defaults to the content hash of ``text``."""
    return {
        "doc_id": doc_id if doc_id is not None else content_id(text),
        "source": source,
        "text": text,
        "title": title,
        "pages": pages,
        "error": None,
        "error_type": None,
    }


def error_row(*, source: str, error_type: str, error: str, raw: bytes | str | None = None,
              doc_id: str | None = None, title: str | None = None,
              pages: int | None = None) -> dict:
    """A dead-letter row; doc_id defaults to the hash of the raw input (or of the source)."""
    if doc_id is None:
        doc_id = content_id(raw if raw is not None else source)
    return {
        "doc_id": doc_id,
        "source": source,
        "text": "",
        "title": title,
        "pages": pages,
        "error": error,
        "error_type": error_type,
    }


def cut_text(row: dict, max_chars: int | None) -> dict:
    """``row`` with its text cut to ``max_chars`` characters and ``text_truncated_chars`` set
    to the number cut (module docstring); rows within the cap come back unchanged."""
    text = row.get("text") or ""
    if max_chars is None or len(text) <= max_chars:
        return row
    row["text"] = text[:max_chars]
    row["text_truncated_chars"] = (row.get("text_truncated_chars") or 0) + len(text) - max_chars
    return row


class DuplicateIds:
    """Checks a stream of rows for repeated ids: ``check(rows)`` yields them unchanged, but a
    row whose doc_id an earlier row had becomes a DuplicateId error row (a later error row
    too: its dead letter must not take the document's id). Holds one (id -> first source)
    entry per id of the stream (one input file)."""

    def __init__(self, id_field: str):
        self.id_field = id_field
        self.first: dict[str, str] = {}

    def check(self, rows):
        for row in rows:
            doc_id = row["doc_id"]
            if doc_id not in self.first:
                self.first[doc_id] = row["source"]
                yield row
                continue
            yield error_row(source=row["source"], raw=row["source"], error_type=DUPLICATE_ID, title=row["title"],
                            pages=row["pages"],
                            error=f"duplicate {self.id_field} {doc_id!r}: {row['source']} repeats the id of "
                                  f"{self.first[doc_id]}, which is the document; this row is not run")


def record_to_row(record: Any, source: str, text_field: str = "text",
                  id_field: str | None = None, title_field: str | None = "title",
                  raw: bytes | str | None = None, arrow=None) -> dict:
    """Turn one mapping into a row (or an error row); shared by JSONL/Parquet/HF readers.
    A good row carries the record's other columns (``columns``, `connectors.columns`; from
    ``arrow``, the record as a one-row Arrow batch, when the reader has it: its types kept).
    A record without the text field but with chat ``messages`` (a list of {role, content})
    is a document whose text is its messages' contents, one per line."""
    row = _record_to_row(record, source, text_field, id_field, title_field, raw)
    if not row["error"]:
        from .columns import pack

        row["columns"] = pack(arrow if arrow is not None else record, exclude=(text_field,))
    return row


def messages_text(messages: Any) -> str | None:
    """The text of an OpenAI-style ``messages`` list (contents joined), None when it is not one."""
    if not isinstance(messages, list) or not messages:
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            return None
        content = m.get("content")
        if isinstance(content, list):  # content parts: their text parts
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(str(content or ""))
    return "\n".join(parts)


def _record_to_row(record: Any, source: str, text_field: str, id_field: str | None, title_field: str | None,
                   raw: bytes | str | None) -> dict:
    if not isinstance(record, dict):
        return error_row(source=source, raw=raw if raw is not None else repr(record),
                         error_type=MALFORMED_JSON,
                         error=f"record is a JSON {type(record).__name__}, not an object")
    raw_for_id = raw if raw is not None else json.dumps(record, sort_keys=True, default=str)
    doc_id = None
    if id_field:
        doc_id = id_from_field(record.get(id_field))
        if doc_id is None:
            return error_row(source=source, raw=raw_for_id, error_type=MISSING_FIELD,
                             error=f"id field {id_field!r} is missing or empty")
    title = record.get(title_field) if title_field else None
    title = title.strip() or None if isinstance(title, str) else None
    text = record.get(text_field)
    if text is None and text_field not in record:
        text = messages_text(record.get("messages"))
    if text is None:
        keys = ", ".join(sorted(map(str, record))[:10])
        return error_row(source=source, raw=raw_for_id, doc_id=doc_id, title=title,
                         error_type=MISSING_FIELD,
                         error=f"text field {text_field!r} is missing or null (keys: {keys})")
    if not isinstance(text, str):
        return error_row(source=source, raw=raw_for_id, doc_id=doc_id, title=title,
                         error_type=BAD_FIELD_TYPE,
                         error=f"text field {text_field!r} is a {type(text).__name__}, not a string")
    if not text.strip():
        return error_row(source=source, raw=raw_for_id, doc_id=doc_id, title=title,
                         error_type=EMPTY_DOCUMENT, error=f"text field {text_field!r} is empty")
    return ok_row(doc_id=doc_id, source=source, text=text, title=title)

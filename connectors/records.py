"""The row every reader yields: a plain dict with a fixed set of keys.

Keys: doc_id (str), source (str), text (str), title (str|None), pages (int|None),
error (None or a short reason), error_type (None or a class-like name).
A row with ``error`` set has ``text == ""`` and is a dead-letter candidate.
"""

from __future__ import annotations

from .ids import content_id

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

"""The row every reader yields: a plain dict with a fixed set of keys.

Keys: doc_id (str), source (str), text (str), title (str|None), pages (int|None),
error (None or a short reason), error_type (None or a class-like name).
A row with ``error`` set has ``text == ""`` and is a dead-letter candidate.

Ids given by ``input.id_field`` must be unique: the first row with an id (in file order)
is the document; every later row with that id becomes a ``DuplicateId`` error row that
names the id and both sources (:class:`DuplicateIds`), so it is dead-lettered and reported
instead of being dropped. Its own doc_id is the hash of the later source, so the dead
letter never shares the document's id.
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
DUPLICATE_ID = "DuplicateId"


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

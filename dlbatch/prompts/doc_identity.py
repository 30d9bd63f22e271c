"""A record's identity and version: what makes two rows of a table input one document, and
what makes an edited row a new version of it.

Rows of a table input (JSONL, Parquet, ``hf``, a Ray Dataset) are documents whose prompts may
read other columns besides the text (``{{ row.question }}``). What the prompts read is the
document:

- **version**: the content hash (`connectors.ids.content_id`) of the text and of the values
  of every column the job's prompts read (their canonical JSON, by column name; all columns
  when a template reads ``row`` as a whole or a preprocess hook sees it), and of the images
  its tasks take from image columns (their bytes' digests, `connectors.images.packed_digest`:
  an image edited behind the same path or URL is a new version). A committed row
  records it (``doc_version``); a rerun over an input file that changed compares it
  (`dlbatch.output.edits`): an edited row supersedes its old results, as a replaced PDF does.
- **id**: ``input.id_field``'s value where the job names one (the reader's, unchanged);
  otherwise the version when the prompts read columns, so two rows with the same passage and
  two questions are two documents; otherwise the text's hash, as for any document.

One-document files (PDF, text) and OpenAI batch lines keep their ids and carry no version:
a PDF is superseded as a file, a batch line by its ``custom_id``.
"""
from __future__ import annotations

import json
from typing import Optional

ALL = None  # every column


class DocIdentity:
    """The identity rule of one job (module docstring); picklable, built from the spec."""

    def __init__(self, applies: bool, columns: Optional[frozenset], by_field: bool, text_field: str,
                 image_columns: frozenset = frozenset()):
        self.applies = applies        # a table input: rows have columns and a version
        self.columns = columns        # the columns prompts read (ALL: every one; empty: none)
        self.by_field = by_field      # ids come from input.id_field
        self.text_field = text_field
        self.image_columns = image_columns  # the columns tasks take images from (by the images' bytes)

    @classmethod
    def for_job(cls, spec, preprocess=None) -> "DocIdentity":
        from connectors.formats import input_format
        from dlbatch.prompts.templates import column_references, reads_row

        fmt = input_format(spec.input.format)
        applies = fmt.has_columns and fmt.id_field is None
        sources = [t.source for t in spec.tasks]
        if preprocess is not None or any(reads_row(s) and not column_references(s) for s in sources):
            columns = ALL
        else:
            columns = frozenset(c for s in sources for c in column_references(s)) - {spec.input.text_field}
        images = frozenset(t.images.column for t in spec.tasks if t.images is not None and t.images.column)
        return cls(applies, columns, spec.input.id_field is not None, spec.input.text_field, images)

    @property
    def reads_columns(self) -> bool:
        return self.columns is ALL or bool(self.columns) or bool(self.image_columns)

    def version(self, text: str, row: dict, images: str | None = None) -> str:
        """The content hash of ``text``, of the columns the prompts read from ``row`` and of
        ``images`` (the digest of the row's column images; None: it has none)."""
        from connectors.ids import content_id

        if not self.reads_columns:
            return content_id(text)
        names = sorted(row) if self.columns is ALL else sorted(self.columns)
        read = {n: row.get(n) for n in names if n != self.text_field}
        body = json.dumps(read, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        return content_id(text + "\x00" + body + (f"\x00images:{images}" if images else ""))

    def apply(self, doc: dict) -> dict:
        """``doc`` (a parsed row) with its ``doc_version`` and, without id_field, its id from
        the version. Rows that failed to parse keep the id they have."""
        if not self.applies or doc.get("error") or not isinstance(doc.get("text"), str):
            return doc
        row = {}
        if self.reads_columns:
            from connectors.columns import unpack

            row = unpack(doc.get("columns"))
        images = None
        if self.image_columns:
            from connectors.images import packed_digest

            images = packed_digest(doc.get("images"))
        version = self.version(doc["text"], row, images)
        doc = {**doc, "doc_version": version}
        if not self.by_field and self.reads_columns:
            doc["doc_id"] = version
        return doc

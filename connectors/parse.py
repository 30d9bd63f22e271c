"""Parse one input file into documents, as a Ray Data ``flat_map`` stage.

A file the reader cannot handle becomes one error row (``error``, ``error_type``) that the
prompt stage turns into a dead letter: bad content never raises. Infrastructure errors
(the file vanished, no permission) do raise, after the I/O retries, and fail the job.
The structure of a PDF (abstract, sections, references) travels as one JSON string:
Arrow schemas of list-of-struct columns differ between blocks with and without sections.
"""
from __future__ import annotations

import json

STRUCTURE_KEYS = ("abstract", "sections", "references", "references_span")


def parse_file(row: dict, fmt: str, text_field: str, id_field: str | None, storage_options: dict | None,
               max_pages: int | None) -> list[dict]:
    """One input file (``row["url"]``) -> its documents, error rows for bad ones."""
    from connectors.listing import read_document_file

    url = row["url"]
    out = []
    try:
        for doc in read_document_file(url, fmt, text_field=text_field, id_field=id_field,
                                      storage_options=storage_options, max_pages=max_pages):
            out.append(doc)
    except (FileNotFoundError, PermissionError):
        raise
    except Exception as e:  # a file the reader cannot handle becomes a dead letter
        from connectors.ids import content_id

        out.append({"doc_id": content_id(url.encode()), "source": url, "text": "", "title": None, "pages": None,
                    "error": f"{type(e).__name__}: {e}"[:500], "error_type": type(e).__name__})
    return [{"doc_id": str(d["doc_id"]), "source": str(d["source"]), "text": d.get("text") or "",
             "title": d.get("title"), "pages": d.get("pages"), "error": d.get("error"),
             "error_type": d.get("error_type"),
             "structure": json.dumps({k: d[k] for k in STRUCTURE_KEYS}) if "sections" in d else None}
            for d in out]

"""Stable document ids.

A document id is either taken from the record (``id_field``) or derived from the
content: the first 16 hex characters of the SHA-256 of the text (UTF-8), or of the
raw bytes when text extraction failed. The same content gives the same id in every
run, on every machine.
"""

from __future__ import annotations

import hashlib

ID_HEX_CHARS = 16


def content_id(content: str | bytes) -> str:
    """First 16 hex chars of sha256(content); str is hashed as UTF-8."""
    if isinstance(content, str):
        content = content.encode("utf-8", errors="surrogatepass")
    elif not isinstance(content, (bytes, bytearray, memoryview)):
        raise TypeError(f"content_id needs str or bytes, got {type(content).__name__}")
    return hashlib.sha256(content).hexdigest()[:ID_HEX_CHARS]


def id_from_field(value: object) -> str | None:
    """Normalise a user-supplied id value to a string; None/'' means missing."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    return text or None

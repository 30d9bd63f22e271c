"""Stable document ids.

A document id is either taken from the record (``id_field``) or derived from the
content: the first 16 hex characters of the SHA-256 of the text (UTF-8), or of the
raw bytes when text extraction failed. The same content gives the same id in every
run, on every machine.

An ``id_field`` value becomes an id one to one (`id_from_field`): distinct values give
distinct ids, equal values equal ones. A string is its own id, exactly as written (spaces
kept), so the ids of plain string fields never change; a value of another type is spelled
with its type, so it can never meet a string: ``17`` and ``17.0`` (one number) are
``num:17``, ``1.5`` is ``num:1.5``, ``true`` is ``bool:true``, a list or mapping is
``json:`` and its canonical JSON. The rare string that starts with one of these prefixes
(or with ``str:``) is spelled ``str:`` + itself. Bytes are their UTF-8 text. None, NaN, and
a string of nothing but whitespace are a missing id.
"""

from __future__ import annotations

import hashlib
import json
import math

ID_HEX_CHARS = 16


def content_id(content: str | bytes) -> str:
    """First 16 hex chars of sha256(content); str is hashed as UTF-8."""
    if isinstance(content, str):
        content = content.encode("utf-8", errors="surrogatepass")
    elif not isinstance(content, (bytes, bytearray, memoryview)):
        raise TypeError(f"content_id needs str or bytes, got {type(content).__name__}")
    return hashlib.sha256(content).hexdigest()[:ID_HEX_CHARS]


_TYPED = ("num:", "bool:", "json:", "str:")


def id_from_field(value: object) -> str | None:
    """A user-supplied id value as an id (module docstring); None when it is missing."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str):
        if not value.strip():
            return None
        return "str:" + value if value.startswith(_TYPED) else value
    if isinstance(value, bool):
        return "bool:true" if value else "bool:false"
    if isinstance(value, int):
        return f"num:{value}"
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return f"num:{int(value)}" if value.is_integer() else f"num:{value!r}"
    return "json:" + json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)

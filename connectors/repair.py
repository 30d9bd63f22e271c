"""Strings that Arrow, Parquet and JSON can always encode.

A Python ``str`` may hold lone UTF-16 surrogates (U+D800..U+DFFF): JSON allows ``"\\ud800"``,
and file names decoded with ``surrogateescape`` carry them. UTF-8 cannot encode them, so one
such value fails ``pa.Table.from_pylist`` and, with it, a whole batch of documents. Every
string that leaves the parse stage or the prompt stage goes through here first:

* ids and sources (``doc_id``, ``source``): each lone surrogate becomes its escape text
  (a backslash, ``u`` and its four hex digits: ``"b\\ud800"`` -> ``"b\\\\ud800"``, as the JSON
  file spells it), so two ids that differ only in their surrogates stay two ids, and the same
  input gives the same id in every run (a rerun finds the document committed or dead-lettered and skips it);
* text (``text``, ``title``, ``error`` and the rest): each lone surrogate becomes U+FFFD, the
  replacement character, as any UTF-8 decoder does with a bad byte; the document is processed.

A well-formed surrogate pair (two code units of one character outside the BMP) becomes that
character in both cases. Content-derived ids (`connectors.ids.content_id`) hash the text as
read, before the repair, so they too are stable and distinct.

File names. A local file name with bytes that are not UTF-8 reaches Python with each such byte
as a lone surrogate U+DC80..U+DCFF (``surrogateescape``: ``b"bad\\xff.pdf"`` -> ``"bad\\udcff.pdf"``).
The listing hands such a name out escaped like an id (``"bad\\\\udcff.pdf"``), so the URL is plain
UTF-8 in Arrow, the manifest and the output's ``source`` alike; `unescape_name` gives back the
name the file system spells, for opening it (`connectors.listing`).
"""
from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED_BYTE = re.compile(r"\\u(dc[89a-f][0-9a-f])")  # repair_id's text for an undecodable byte

ID_KEYS = ("doc_id", "source")


def has_surrogates(value: str) -> bool:
    return _SURROGATE.search(value) is not None


def _joined(value: str) -> str:
    """``value`` with its well-formed surrogate pairs joined; lone surrogates kept."""
    return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def repair_text(value):
    """A string with every lone surrogate replaced by U+FFFD; other values as they are."""
    if not isinstance(value, str) or not _SURROGATE.search(value):
        return value
    return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def repair_id(value):
    """A string with every lone surrogate written as its escape (``\\ud800`` for U+D800);
    other values as they are. Deterministic and injective on strings without a literal
    ``\\ud`` escape."""
    if not isinstance(value, str) or not _SURROGATE.search(value):
        return value
    return _joined(value).encode("utf-8", "backslashreplace").decode("utf-8")


def unescape_name(value: str) -> str:
    """``value`` with each escape of an undecodable byte (``\\udc80``..``\\udcff``, as
    `repair_id` writes it) back as its lone surrogate: the inverse of `repair_id` on names
    that ``surrogateescape`` decoded (``os.fsencode`` of the result gives the original bytes)."""
    if "\\udc" not in value:
        return value
    return _ESCAPED_BYTE.sub(lambda m: chr(int(m.group(1), 16)), value)


def repair_row(row: dict) -> dict:
    """``row`` with every string value (and every string in a list value) encodable: ids and
    sources escaped, the rest replaced (see the module docstring). The same dict when clean."""
    fixed = None
    for key, value in row.items():
        if isinstance(value, str):
            new = repair_id(value) if key in ID_KEYS else repair_text(value)
        elif isinstance(value, list) and any(isinstance(v, str) for v in value):
            new = [repair_text(v) for v in value]
            new = value if new == value else new
        else:
            continue
        if new is not value:
            fixed = fixed if fixed is not None else dict(row)
            fixed[key] = new
    return row if fixed is None else fixed

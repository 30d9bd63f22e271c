"""Inputs that are small to store and huge to read, and a child-process body that parses one
and reports its memory (tests/test_input_bounds.py).

``bomb_pdf``: a PDF of a few tens of KB whose pages all share one content stream, so its
text is pages x lines long (1000 pages of 60 lines: about 6 M characters from 18 KB).
``huge_line_jsonl``: a JSONL file with one line of ``mib`` MiB between two short ones,
written in pieces (the test never holds it).

``python -m tests.helpers.bounded_inputs FORMAT PATH [CAPS_JSON]`` parses the file the way
the parse stage does (`connectors.parse.parse_file`, the job's caps), after a warm-up on a
small file of the same format (imports, the parser process), and prints one JSON line:
the rows (source, error_type, text length, text_truncated_chars), ``grew_mb`` (this
process's peak resident memory, VmHWM reset before the parse, past what it held before it)
and ``child_peak_mb`` (the largest resident memory a child process, the PDF parser, reached;
it may count what this process held when it started the child), with ``rss_before_mb`` and
``peak_mb`` behind ``grew_mb``.
"""
from __future__ import annotations

import json
import os
import resource
import sys

WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore"


def bomb_pdf(pages: int = 1000, lines: int = 60) -> bytes:
    import pymupdf

    doc = pymupdf.open()
    first = doc.new_page(width=612, height=792)
    first.insert_text((40, 70), "\n".join(f"{WORDS} {i}" for i in range(lines)), fontsize=9, lineheight=1.15)
    contents = doc.xref_get_key(first.xref, "Contents")[1]
    resources = doc.xref_get_key(first.xref, "Resources")[1]
    for _ in range(pages - 1):  # every other page points at the first page's content stream
        page = doc.new_page(width=612, height=792)
        doc.xref_set_key(page.xref, "Contents", contents)
        doc.xref_set_key(page.xref, "Resources", resources)
    return doc.tobytes(garbage=1, deflate=True, use_objstms=1)


def huge_line_jsonl(path: str, mib: int = 100) -> None:
    piece = WORDS + " "
    with open(path, "w") as f:
        f.write(json.dumps({"id": "before", "text": "a short document"}) + "\n")
        f.write('{"id": "huge", "text": "')
        for _ in range((mib << 20) // len(piece)):
            f.write(piece)
        f.write('"}\n')
        f.write(json.dumps({"id": "after", "text": "another short document"}) + "\n")


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> None:
    """Start the process's peak resident memory (VmHWM) afresh: ru_maxrss would keep the RSS
    the process had when it was forked from a large parent (pytest), before its exec."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _parse(fmt: str, path: str, caps: dict) -> list[dict]:
    from connectors.parse import parse_file

    id_field = "id" if fmt == "jsonl" else None
    return parse_file({"url": path}, fmt, "text", id_field, None, caps.pop("max_pages", 1000), **caps)


def main(fmt: str, path: str, caps: dict) -> dict:
    warm = os.path.join(os.path.dirname(path), f"warm.{fmt}")
    if fmt == "pdf":
        with open(warm, "wb") as f:
            f.write(bomb_pdf(pages=1, lines=3))
    else:
        with open(warm, "w") as f:
            f.write(json.dumps({"id": "w", "text": "warm"}) + "\n")
    _parse(fmt, warm, dict(caps))
    _reset_peak()
    before = _status_mb("VmRSS")
    rows = _parse(fmt, path, dict(caps))
    peak = _status_mb("VmHWM")
    from connectors.isolate import _POOL

    _POOL.close_all()  # a child's peak is counted once it has exited
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"rows": [{"source": r["source"], "error_type": r["error_type"], "chars": len(r["text"]),
                      "text_truncated_chars": r.get("text_truncated_chars")} for r in rows],
            "grew_mb": peak - before, "child_peak_mb": child, "rss_before_mb": before, "peak_mb": peak}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})))

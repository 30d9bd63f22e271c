"""Parsers that misbehave, for the parse-isolation tests (tests/test_parse_isolation.py). Each
is named by ``"module:function"`` and runs in the parser process (`connectors.isolate`), never
in the test's own process.

``by_name`` stands in for `connectors.pdf.extract_pdf` (``DLBATCH_TEST_PDF_PARSER`` or a
monkeypatched ``connectors.parse.PDF_EXTRACT``): it misbehaves on files whose name starts with
``segv``, ``hang`` or ``oom``, extracts the others, and records every call as a file under
``_calls/`` beside the input (hidden from the job's listing), so a test can tell which files
a run parsed.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
import uuid

CALLS = 0  # calls this parser process has served


def echo(*args, **kwargs):
    global CALLS
    CALLS += 1
    return {"args": args, "kwargs": kwargs, "pid": os.getpid()}


def segfault(*args, **kwargs):
    ctypes.string_at(0)  # reads address 0: SIGSEGV in native code


def kill_self(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGSEGV)


def hang(*args, **kwargs):
    time.sleep(3600)


def allocate(mib: int = 8192, *args, **kwargs):
    blocks = [bytearray(1 << 20) for _ in range(mib)]
    return len(blocks)


def raise_value_error(*args, **kwargs):
    raise ValueError("a parser bug")


def crash_unless_fresh(*args, **kwargs):
    """Dies in a process that served a call before (state an earlier file left behind)."""
    global CALLS
    if CALLS:
        os.kill(os.getpid(), signal.SIGSEGV)
    CALLS += 1
    return os.getpid()


def by_name(data: bytes, source: str, **kwargs):
    folder, name = os.path.split(source)
    os.makedirs(os.path.join(folder, "_calls"), exist_ok=True)
    with open(os.path.join(folder, "_calls", f"{name}.{uuid.uuid4().hex}"), "w"):
        pass
    if name.startswith("segv"):
        segfault()
    if name.startswith("hang"):
        hang()
    if name.startswith("oom"):
        allocate()
    from connectors.pdf import extract_pdf

    return extract_pdf(data, source, **kwargs)


def calls(folder) -> dict[str, int]:
    """How many times `by_name` parsed each file of ``folder``."""
    out: dict[str, int] = {}
    d = os.path.join(folder, "_calls")
    for f in os.listdir(d) if os.path.isdir(d) else []:
        name = f.rsplit(".", 1)[0]
        out[name] = out.get(name, 0) + 1
    return out

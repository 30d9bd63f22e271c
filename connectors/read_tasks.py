"""Read tasks: the listed inputs cut into the units the data plane reads in parallel.

A read task is one input or a contiguous part of one (`connectors.part.Part`), read by one
call of `connectors.parse.parse_file` in a prompt actor, so an actor holds one task's rows at a
time, never a whole large file. `plan_read_tasks` turns the reads `connectors.listing.limited_reads`
gives (sorted files, ``input.limit``'s row caps) into tasks, each format cutting its files with
the ``split`` of its row in the input-format table (`connectors.splits`: byte ranges at line
starts for JSONL and OpenAI batch files, runs of row groups for Parquet, row ranges for saved
and Hub datasets); pdf and text files are one task each.

Sizes: parts of about ``READ_TASK_BYTES``; the job's first input starts with smaller ones
(``FIRST_TASK_BYTES``, doubling), so the first documents reach the engine after one small part
is parsed and tokenized, not a whole large file.

Blocks (`blocks`): every part is a block of its own (a block is what one prompt-actor call
takes); whole files are packed into blocks of consecutive files, at most ``READ_TASK_BYTES``
(sizes unknown: by count) and at least ``min(files, MAX_BLOCKS)`` blocks, so many small
files do not cost a Ray task each and a few files still stream one by one.

Invariants: the parts of an input, read in order, give the rows of the whole input (sources,
ids, error rows); the same input and cap give the same tasks. An id repeated within a part is
caught there (`connectors.records.DuplicateIds`), across the parts of a file by the driver's
`Duplicates`, as across files: the later one to reach the driver is its dead letter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional

from .formats import ReadOptions, input_format
from .io_retry import call_with_retry
from .part import WHOLE, Part
from .splits import TaskSizes, hub_parts

READ_TASK_BYTES = 16 << 20
FIRST_TASK_BYTES = 1 << 20
MAX_BLOCKS = 64


@dataclass(frozen=True)
class ReadTask:
    """One read: ``url`` (a listed input), which ``part`` of it, ``max_rows`` (input.limit's
    cut of an input read whole) and ``nbytes`` (its estimated size, for packing; None when
    unknown). A data-plane row holds it flat (`row`, `of`)."""

    url: str
    part: Part = WHOLE
    max_rows: Optional[int] = None
    nbytes: Optional[int] = None

    @property
    def source(self) -> str:
        """What a failure of the whole task names: the input, or the input and the part."""
        p = self.part
        return self.url if p.whole else f"{self.url}#part{p.start}-{'' if p.stop is None else p.stop}"

    def row(self) -> dict:
        p = self.part
        return {"url": self.url, "start": p.start, "stop": p.stop, "line": p.line, "max_rows": self.max_rows}

    @classmethod
    def of(cls, row: Mapping) -> "ReadTask":
        """The task a data-plane row describes (``{"url": ...}`` alone: the whole input)."""
        def get(key: str, default):
            return default if row.get(key) is None else int(row[key])

        return cls(url=row["url"], part=Part(get("start", 0), get("stop", None), get("line", 1)),
                   max_rows=get("max_rows", None))


def task_table(tasks: list[ReadTask]):
    """The tasks as an Arrow table, one row each (`ReadTask.row`): one block of the data plane."""
    import pyarrow as pa

    schema = pa.schema([("url", pa.string()), ("start", pa.int64()), ("stop", pa.int64()), ("line", pa.int64()),
                        ("max_rows", pa.int64())])
    return pa.Table.from_pylist([t.row() for t in tasks], schema=schema)


# ---------------------------------------------------------------------------- planning
def plan_read_tasks(reads: list[tuple[str, Optional[int]]], format: str, storage_options: dict | None = None, *,
                    sizes: TaskSizes | None = None, first_bytes: int | None = None, text_field: str = "text",
                    id_field: str | None = None, title_field: str | None = "title",
                    split: str | None = None) -> list[ReadTask]:
    """The read tasks of ``reads`` (``(url, max_rows)`` in reading order, as
    `connectors.listing.limited_reads` gives them), in the same order. ``sizes``: parts of
    ``READ_TASK_BYTES`` unless given; the first input's parts start at ``first_bytes``
    (``FIRST_TASK_BYTES``). Inputs are sized and cut ``sizes.threads`` at a time."""
    from .secrets import resolve_options

    sizes = sizes or TaskSizes(READ_TASK_BYTES)
    first_bytes = FIRST_TASK_BYTES if first_bytes is None else first_bytes
    fmt = input_format(format)
    options = ReadOptions(text_field=text_field, id_field=id_field, title_field=title_field, split=split,
                          storage_options=resolve_options(storage_options))
    if fmt.one_doc_per_file:  # a file is a document: nothing to size or cut
        return [ReadTask(url, max_rows=n) for url, n in reads]
    jobs = [(url, n, replace(sizes, first=first_bytes) if i == 0 else sizes) for i, (url, n) in enumerate(reads)]
    if len(jobs) <= 1 or sizes.threads <= 1:
        per_input = [_tasks_of(url, n, fmt, options, s) for url, n, s in jobs]
    else:
        from concurrent.futures import ThreadPoolExecutor

        outer = min(sizes.threads, len(jobs))
        inner = max(1, sizes.threads // outer)  # a scan's own threads: at most ``threads`` in all
        with ThreadPoolExecutor(max_workers=outer) as ex:
            per_input = list(ex.map(lambda j: _tasks_of(j[0], j[1], fmt, options, replace(j[2], threads=inner)),
                                    jobs))
    return [t for tasks in per_input for t in tasks]


def _tasks_of(url: str, max_rows: Optional[int], fmt, options: ReadOptions, sizes: TaskSizes) -> list[ReadTask]:
    from .hf_hub import is_hub_url
    from .listing import _url_of, _url_to_fs
    from .repair import unescape_name

    if is_hub_url(url):
        parts = hub_parts(url, sizes, max_rows, options.storage_options)
        size = None
    else:
        fs, path = _url_to_fs(url, options.storage_options)
        spelled = _url_of(fs, path) if unescape_name(url) != url else url  # as the readers open it
        parts = fmt.split(spelled, fs, path, options, sizes, max_rows) if fmt.split is not None else None
        size = None if parts is not None else _size(fs, path, url)
    if parts is None:
        return [ReadTask(url, max_rows=max_rows, nbytes=size)]
    return [ReadTask(url, p, nbytes=n) for p, n in parts]


def _size(fs, path: str, url: str) -> Optional[int]:
    info = call_with_retry(fs.info, path, op=f"info {url}")
    return None if info.get("type") == "directory" else info.get("size")


def blocks(tasks: list[ReadTask], target: int | None = None, max_blocks: int = MAX_BLOCKS) -> list[list[ReadTask]]:
    """The tasks grouped into the data plane's blocks, in order (module docstring): a part
    alone; consecutive whole inputs packed up to a budget of ``target`` bytes
    (``READ_TASK_BYTES``), lowered so that there are at least ``min(whole inputs, max_blocks)``
    blocks of them (by count where a size is unknown)."""
    target = READ_TASK_BYTES if target is None else target
    whole = [t for t in tasks if t.part.whole]
    by_bytes = all(t.nbytes is not None for t in whole)
    weight = (lambda t: max(1, t.nbytes)) if by_bytes else (lambda t: 1)
    total = sum(weight(t) for t in whole)
    budget = math.ceil(total / max(1, min(len(whole), max_blocks)))
    if by_bytes:
        budget = min(budget, target)
    out: list[list[ReadTask]] = []
    group: list[ReadTask] = []
    held = 0
    for t in tasks:
        if not t.part.whole or (group and held + weight(t) > budget):
            if group:
                out.append(group)
            group, held = [], 0
        if not t.part.whole:
            out.append([t])
            continue
        group.append(t)
        held += weight(t)
    if group:
        out.append(group)
    return out

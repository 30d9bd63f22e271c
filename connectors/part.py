"""Which rows of one input a reader yields: the whole input, or a contiguous part of it.

`connectors.splits` cuts inputs into parts, `connectors.read_tasks` makes each part a read
task of the data plane, and every reader (`connectors.formats`) reads a part as it reads a
whole file, its rows keeping the numbers they have in the whole file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Part:
    """Which rows of one input a reader yields: the whole input (`WHOLE`), or a contiguous
    part the format's ``split`` cut. JSONL and OpenAI batch files: the bytes [start, stop),
    both line starts, ``line`` the number of the line at ``start`` (so sources stay
    ``<file>#line<N>`` with the file's own N); Parquet and datasets: the rows [start, stop),
    numbered from ``start``. ``stop`` None: to the end of the input."""

    start: int = 0
    stop: Optional[int] = None
    line: int = 1

    def __post_init__(self):
        if self.start < 0 or self.line < 1 or (self.stop is not None and self.stop < self.start):
            raise ValueError(f"a part needs 0 <= start <= stop and line >= 1, got {self}")

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop is None


WHOLE = Part()

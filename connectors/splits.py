"""How an input is cut into parts (`connectors.part.Part`) of about a given size: the
``split`` of each row of the input-format table (`connectors.formats`), which
`connectors.read_tasks` makes the data plane's read tasks.

- JSONL and OpenAI batch files (uncompressed): byte ranges cut at line starts (`line_parts`).
  One pass over the file's bytes, in fixed chunks read by ``threads`` threads, counts the
  newlines of each chunk and finds the first line start at or after the chunk's start: the
  cuts are those line starts, and each part's first line number is 1 + the newlines before
  it, exact, so rows keep their ``<file>#line<N>`` sources. Under a row cap the pass is
  sequential and ends at the cap's row (blank lines are no rows), so the parts hold exactly
  the first N rows. A compressed file cannot be entered in the middle: read whole.
- Parquet: runs of whole row groups (`row_group_parts`), by their uncompressed bytes; a row
  group larger than a part is a part alone. A file whose footer does not read is read whole
  (its one CorruptFile row).
- ``hf``: a saved dataset's rows (`dataset_parts`: its chosen splits one after another) and a
  Hub dataset's split (`hub_parts`, not streamed), cut by rows at the average row size; a data
  file read through ``datasets`` and a streamed Hub dataset are read whole.

Each split gives ``[(Part, estimated bytes)]`` in file order, covering the input once (the last
part open-ended unless a row cap ends it), or None: read the input whole, as it is when it is
no larger than its first part. A scan reads ``SCAN_PIECE`` bytes at a time, never a whole
line, so a long line costs no memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from .io_retry import call_with_retry
from .part import Part

SCAN_PIECE = 1 << 20  # bytes a scan reads at a time
THREADS = 16


@dataclass(frozen=True)
class TaskSizes:
    """How big the parts of one input are: ``first`` for its first part (None: ``target``),
    each next one twice the one before, up to ``target``; ``threads`` read a scan's chunks."""

    target: int
    first: Optional[int] = None
    threads: int = THREADS

    def __post_init__(self):
        if self.target < 1 or (self.first is not None and self.first < 1) or self.threads < 1:
            raise ValueError(f"part sizes and threads must be >= 1, got {self}")

    @property
    def first_size(self) -> int:
        return min(self.first or self.target, self.target)

    def __iter__(self) -> Iterator[int]:
        size = self.first_size
        while True:
            yield size
            size = min(2 * size, self.target)

    def bounds(self, size: int) -> list[int]:
        """The nominal cuts of ``size`` bytes: the running sums of the part sizes below it."""
        out, at = [], 0
        for step in self:
            at += step
            if at >= size:
                return out
            out.append(at)


# ---------------------------------------------------------------------------- JSONL: byte ranges
def line_parts(url: str, fs, path: str, sizes: TaskSizes, max_rows: Optional[int]) -> Optional[list]:
    """``[(Part, bytes)]`` of a JSON Lines file cut at line starts, or None: read it whole
    (compressed, or no larger than its first part)."""
    from .text_sources import _compression_for

    if _compression_for(path):
        return None
    size = call_with_retry(fs.size, path, op=f"size {url}")
    if size is None or size <= sizes.first_size:
        return None
    if max_rows is not None:
        return call_with_retry(_first_rows, fs, path, sizes, max_rows, op=f"read {url}")
    bounds = sizes.bounds(size)
    chunks = list(zip([0] + bounds, bounds + [size]))
    scans = _map(lambda c: call_with_retry(_scan, fs, path, c[0], c[1], op=f"read {url}"), chunks, sizes.threads)
    starts = [(0, 1)]  # (offset of a part's first line, its line number)
    before = 0  # newlines before the chunk's start
    for (lo, _), (newlines, first) in zip(chunks, scans):
        if lo > 0 and first is not None and starts[-1][0] < first < size:
            starts.append((first, 1 + before + (first > lo)))  # one newline in [lo, first) when first > lo
        before += newlines
    if len(starts) == 1:
        return None
    stops = [s for s, _ in starts[1:]] + [None]
    return [(Part(s, e, line), (size if e is None else e) - s) for (s, line), e in zip(starts, stops)]


def _map(fn, items: list, threads: int) -> list:
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as ex:
        return list(ex.map(fn, items))


def _scan(fs, path: str, lo: int, hi: int) -> tuple[int, Optional[int]]:
    """(newlines in the bytes [lo, hi), the first line start at or after lo: 0 for lo 0, else
    the byte after the first newline at or after lo - 1; None when none follows)."""
    from .text_sources import _open

    newlines, first = 0, (0 if lo == 0 else None)
    with _open(fs, path) as f:
        pos = max(lo - 1, 0)
        f.seek(pos)
        while pos < hi or first is None:
            buf = f.read(SCAN_PIECE if pos >= hi else min(SCAN_PIECE, hi - pos))
            if not buf:
                break
            if first is None:
                i = buf.find(b"\n")
                first = pos + i + 1 if i >= 0 else None
            a, b = max(lo, pos) - pos, min(hi, pos + len(buf)) - pos
            if b > a:
                newlines += buf.count(b"\n", a, b)
            pos += len(buf)
    return newlines, first


def _first_rows(fs, path: str, sizes: TaskSizes, max_rows: int) -> list:
    """``[(Part, bytes)]`` holding the file's first ``max_rows`` rows (non-blank lines): one
    sequential pass, a piece at a time (a long line is never held whole)."""
    from .text_sources import _open

    wants = iter(sizes)
    want = next(wants)
    parts: list = []
    start, line = 0, 1  # the current part's first byte and line number
    number, rows, nonblank, at = 1, 0, False, 0  # the current line; rows ended; its bytes so far; buf's offset
    with _open(fs, path) as f:
        while rows < max_rows:
            buf = f.read(SCAN_PIECE)
            if not buf:
                break
            i = 0
            while i < len(buf) and rows < max_rows:
                j = buf.find(b"\n", i)
                nonblank = nonblank or bool(buf[i:len(buf) if j < 0 else j].strip())
                if j < 0:
                    break
                rows, number, nonblank, i = rows + nonblank, number + 1, False, j + 1
                end = at + i  # the next line's start
                if rows < max_rows and end - start >= want:
                    parts.append((Part(start, end, line), end - start))
                    start, line, want = end, number, next(wants)
            at += i if rows >= max_rows else len(buf)
    if at > start:
        parts.append((Part(start, at, line), at - start))
    return parts


# ---------------------------------------------------------------------------- Parquet: row groups
def row_group_parts(url: str, fs, path: str, sizes: TaskSizes, max_rows: Optional[int]) -> Optional[list]:
    """``[(Part, bytes)]`` of a Parquet file as runs of whole row groups (rows), ending at row
    ``max_rows``; None: read it whole (one part's worth, or a footer that does not read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .text_sources import _open

    with _open(fs, path) as f:
        try:
            md = pq.ParquetFile(f).metadata
        except pa.ArrowException:
            return None
    groups = [(md.row_group(g).num_rows, md.row_group(g).total_byte_size) for g in range(md.num_row_groups)]
    total = md.num_rows if max_rows is None else min(md.num_rows, max_rows)
    if len(groups) < 2 or sum(b for _, b in groups) <= sizes.first_size:
        return None
    wants = iter(sizes)
    want = next(wants)
    parts, start, at, held = [], 0, 0, 0
    for rows, nbytes in groups:
        if at >= total:
            break
        if at > start and held + nbytes > want:
            parts.append((Part(start, at), held))
            start, held, want = at, 0, next(wants)
        at, held = at + rows, held + nbytes
    parts.append((Part(start, None if max_rows is None else total), held))
    return parts if len(parts) > 1 or max_rows is not None else None


# ---------------------------------------------------------------------------- datasets: rows
def row_parts(rows: int, nbytes: int, sizes: TaskSizes, max_rows: Optional[int]) -> Optional[list]:
    """``[(Part, bytes)]`` of ``rows`` rows of ``nbytes`` bytes cut at the average row size,
    ending at row ``max_rows``; None: read them whole (one part's worth)."""
    total = rows if max_rows is None else min(rows, max_rows)
    if rows <= 0 or not nbytes or nbytes <= sizes.first_size:
        return None
    per_row = nbytes / rows
    parts, start = [], 0
    for want in sizes:
        if start >= total:
            break
        stop = min(start + max(1, int(want / per_row)), total)
        parts.append((Part(start, stop), int((stop - start) * per_row)))
        start = stop
    if len(parts) == 1:
        return None
    if max_rows is None:
        last, n = parts[-1]
        parts[-1] = (Part(last.start, None), n)
    return parts


def dataset_parts(url: str, fs, path: str, options, sizes: TaskSizes,
                  max_rows: Optional[int]) -> Optional[list]:
    """Parts of a saved dataset (`connectors.text_sources.dataset_splits`: the splits
    ``options.split`` chooses, one after another), by rows; None for a data file (read whole
    through ``datasets``). ``options``: the job's `connectors.formats.ReadOptions`."""
    from .text_sources import dataset_splits, hf_offline, is_saved_dataset_dir

    if not is_saved_dataset_dir(path, fs=fs):
        return None
    with hf_offline():
        import datasets

        ds = call_with_retry(datasets.load_from_disk, url, storage_options=options.storage_options,
                             op=f"load_from_disk {url}")
        splits = [d for _, d in dataset_splits(ds, url, options.split)]
        return row_parts(sum(len(d) for d in splits), sum(d.data.nbytes for d in splits), sizes, max_rows)


def hub_parts(url: str, sizes: TaskSizes, max_rows: Optional[int], storage_options: dict | None) -> Optional[list]:
    """Parts of a Hub dataset's split, by rows, from the sizes its card states; None: read it
    whole (streamed, or sizes not stated)."""
    from .hf_hub import check_hub_dataset, parse_hub_url

    ref = parse_hub_url(url)
    if ref.streaming:
        return None
    rows, nbytes = (check_hub_dataset(url, storage_options)["splits"].get(ref.split) or [None, None])[:2]
    if not rows or not nbytes:
        return None
    return row_parts(int(rows), int(nbytes), sizes, max_rows)

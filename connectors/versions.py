"""What each input file holds now: a version that changes exactly when its content does.

A local file's version is the sha256 of its bytes (``sha256:<hex>``): a file replaced in
place by a same-size copy that keeps its modification time is still seen as changed, and
a tree copied elsewhere with ``rsync -a`` is not. Hashing reads every byte, so the hash is
cached per file under its stat key (size, mtime_ns, ctime_ns, inode): a file whose stat key
is unchanged since the last run is not read again. No user can set ctime, so an in-place
rewrite always changes the key. On object stores the version is the store's own: ETag,
generation or version id, with the size (``connectors.listing._version``); a directory (an
``hf`` saved dataset) is the digest of its files' sizes and versions; a Hub dataset
(``hf-dataset://``) is the digest of its prepared revision and split sizes
(`connectors.hf_hub.hub_version`).

``input_versions(files, storage_options, cache)`` returns ``{url: [stat key or None,
version]}``, which is also the cache the caller keeps for the next run (the output store's
``_sources.arrow``).
"""
from __future__ import annotations

import hashlib

from .io_retry import call_with_retry

CHUNK = 1 << 20
# a row's ``source`` is its file's URL, with ``#line<N>`` (JSONL), ``#row<N>`` (Parquet) or
# ``#<split>/row<N>`` (hf) after it for formats of many rows per file
ROW_SUFFIX = r"#(line[0-9]+|row[0-9]+|[^#]*/row[0-9]+)$"


def source_file(source: str) -> str:
    """The input file a row's ``source`` came from."""
    import re

    return re.sub(ROW_SUFFIX, "", source)


def source_files(column):
    """`source_file` over an Arrow string column (vectorised)."""
    import pyarrow.compute as pc

    return pc.replace_substring_regex(column, pattern=ROW_SUFFIX, replacement="")


def _stat_key(path: str) -> str | None:
    import os

    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                break
            h.update(b)
    return f"sha256:{h.hexdigest()}"


def file_version(url: str, storage_options: dict | None = None, cache: dict | None = None) -> tuple[str, str | None]:
    """(version, stat key or None) of one input: see the module docstring."""
    from fsspec.implementations.local import LocalFileSystem

    from .hf_hub import is_hub_url
    from .listing import _describe, _url_to_fs

    if is_hub_url(url):
        return _describe(url, storage_options), None
    fs, p = _url_to_fs(url, storage_options)
    if isinstance(fs, LocalFileSystem) and not fs.isdir(p):
        key = _stat_key(p)
        hit = (cache or {}).get(url)
        if key is not None and hit is not None and hit[0] == key:
            return hit[1], key
        return call_with_retry(_sha256, p, op=f"read {url}"), key
    desc = _describe(url, storage_options)
    return f"meta:{hashlib.sha256(desc.encode('utf-8', 'surrogateescape')).hexdigest()[:32]}", None


def input_versions(files: list[str], storage_options: dict | None = None, cache: dict | None = None,
                   threads: int = 8) -> dict[str, list]:
    """{url: [stat key or None, version]} for ``files``; hashing runs ``threads`` files at a
    time (hashlib releases the GIL on large buffers)."""
    def one(f):
        return file_version(f, storage_options, cache)

    if len(files) > 1 and threads > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(threads, len(files))) as ex:
            got = list(ex.map(one, files))
    else:
        got = [one(f) for f in files]
    return {f: [k, v] for f, (v, k) in zip(files, got)}


def versions_digest(versions: dict[str, list], limit: int | None = None) -> str:
    """One digest of every input's version and ``input.limit``: the "nothing to do" check
    of a complete job compares it."""
    body = "\n".join(f"{f}\t{versions[f][1]}" for f in sorted(versions)) + f"\nlimit={limit}"
    return hashlib.sha256(body.encode("utf-8", "surrogateescape")).hexdigest()[:16]

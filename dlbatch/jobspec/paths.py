"""Paths in a job file: URLs left as written, local paths resolved, output folders that
``--fresh`` may delete, and whether the output lies inside the input folder."""
from __future__ import annotations

import os
import re
from typing import Optional


_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_BUCKET_SCHEMES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}


def is_url(path: str) -> bool:
    """True for ``scheme://...`` (fsspec URLs, including ``file://``)."""
    return bool(_URL_RE.match(path))


def _resolve_local(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _is_same_or_ancestor(candidate: str, of: str) -> bool:
    candidate = os.path.realpath(candidate)
    of = os.path.realpath(of)
    if candidate == of:
        return True
    return of.startswith(candidate.rstrip(os.sep) + os.sep)


def _check_local_output(raw: str, resolved: str) -> None:
    real = os.path.realpath(resolved)
    if real == os.path.realpath(os.sep) or os.path.dirname(real) == real:
        raise ValueError(f"{raw!r} is the filesystem root; {_OUT_HINT}")
    home = os.path.expanduser("~")
    cwd = os.getcwd()
    for what, where in (("the home directory", home), ("the current directory", cwd)):
        if _is_same_or_ancestor(real, where):
            rel = "is" if os.path.realpath(where) == real else "contains"
            raise ValueError(f"{raw!r} resolves to {real!r}, which {rel} {what}; {_OUT_HINT}")


def _local_path(path: str) -> Optional[str]:
    """The local filesystem path of a plain path or ``file://`` URL; None for other URLs."""
    if not is_url(path):
        return path
    scheme, rest = path.split("://", 1)
    return _resolve_local(rest or "/") if scheme.lower() in ("file", "local") else None


_SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3", "gcs": "gs", "abfss": "abfs"}  # one filesystem, two spellings


def _canonical_url(url: str) -> str:
    """A URL as the filesystem reads it: the scheme in lower case and under its one name
    (``S3://``, ``s3a://`` -> ``s3://``), runs of ``/`` in the path as one, no trailing ``/``."""
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    return f"{_SCHEME_ALIASES.get(scheme, scheme)}://{re.sub(r'/+', '/', rest).strip('/')}"


def _is_inside(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or below it (local paths by their real path, URLs by their
    `_canonical_url`)."""
    a, b = _local_path(path), _local_path(folder)
    if a is not None and b is not None:
        return _is_same_or_ancestor(b, a)
    if a is not None or b is not None:
        return False
    a, b = _canonical_url(path), _canonical_url(folder)
    return a == b or a.startswith(b + "/")


def _input_folder(spec) -> Optional[str]:
    """The folder input.path lists: the path itself when it is a folder (or a URL prefix),
    the part before the first glob character for a glob; None for one file."""
    path = spec.input.path
    if re.search(r"[*?\[]", path):
        return path[: re.search(r"[*?\[]", path).start()].rsplit("/", 1)[0] or "/"
    local = _local_path(path)
    if local is not None:
        return None if os.path.isfile(local) else local  # a folder, or one that does not exist yet
    return path if spec.input.format != "hf" or "://" in path else None


_OUT_HINT = "the output directory is deleted by --fresh, so use a dedicated subdirectory such as 'out/<job>'"


def _normalize_output_path(raw: str) -> str:
    if not raw or not raw.strip():
        raise ValueError(f"must not be empty; {_OUT_HINT}")
    if raw.strip() in ("/", "~", "~/", ".", "./"):
        raise ValueError(f"{raw!r} is not allowed as output path; {_OUT_HINT}")
    if is_url(raw):
        scheme, rest = raw.split("://", 1)
        scheme = scheme.lower()
        if scheme in ("file", "local"):
            local = rest or "/"
            _check_local_output(raw, _resolve_local(local))
            return raw
        if not rest.strip("/"):
            raise ValueError(f"{raw!r} has no path after the scheme; {_OUT_HINT}")
        if scheme in _BUCKET_SCHEMES and "/" not in rest.strip("/"):
            raise ValueError(f"{raw!r} is the root of a bucket; {_OUT_HINT}")
        return raw
    resolved = _resolve_local(raw)
    _check_local_output(raw, resolved)
    return resolved

"""The per-user cache directory: compiled C helpers, converted GGUF models, remote GGUFs.

``$DLBATCH_CACHE`` (``$DLBATCH_CACHE_DIR`` is read too, for the native helpers' old name),
else ``~/.cache/dlbatch``; when the home directory cannot be written, ``<tmp>/dlbatch-<uid>``.
Whatever the place, the directory is created 0700 and checked before use: it must be a
real directory (not a symlink) owned by this user and not writable by group or others —
otherwise nobody else could have planted a ``.so`` or a model file we would load. A
directory of ours with looser bits is tightened to 0700; one owned by someone else is
refused with an error naming it.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def secure_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (0700) if missing and check it is ours; returns it, or raises
    PermissionError naming the directory and its owner."""
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(p)
    uid = _uid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"cache directory {p} is a symlink or not a directory: refusing to use it "
                              f"(set DLBATCH_CACHE to a directory of yours)")
    if uid is not None and st.st_uid != uid:
        raise PermissionError(f"cache directory {p} belongs to uid {st.st_uid}, not to you (uid {uid}): refusing "
                              f"to load anything from it (set DLBATCH_CACHE to a directory of yours)")
    if st.st_mode & 0o077:
        os.chmod(p, 0o700)
    return p


def safe_file(path: str | os.PathLike) -> bool:
    """Is ``path`` a regular file of ours that group and others cannot write?"""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    uid = _uid()
    return (stat.S_ISREG(st.st_mode) and (uid is None or st.st_uid == uid) and not st.st_mode & 0o022)


def cache_candidates() -> list[Path]:
    env = os.environ.get("DLBATCH_CACHE") or os.environ.get("DLBATCH_CACHE_DIR")
    if env:
        return [Path(env)]
    out = []
    try:
        out.append(Path.home() / ".cache" / "dlbatch")
    except RuntimeError:  # no home directory (HOME unset, no passwd entry)
        pass
    return out + [Path(tempfile.gettempdir()) / f"dlbatch-{'u' if _uid() is None else _uid()}"]


def user_cache_dir(sub: str | None = None) -> Path:
    """The first usable per-user cache directory (see the module docstring), with ``sub``
    created 0700 inside it."""
    errors = []
    for root in cache_candidates():
        try:
            d = secure_dir(root)
            return secure_dir(d / sub) if sub else d
        except OSError as e:
            errors.append(str(e))
    raise PermissionError("no usable per-user cache directory: " + "; ".join(errors))


def publish_dir(tmp: str, dst: str) -> None:
    """Make the finished folder ``tmp`` (holding a COMPLETE marker) appear as ``dst`` at
    once; if another process published ``dst`` first, keep theirs (``tmp`` is the caller's
    to remove)."""
    open(os.path.join(tmp, "COMPLETE"), "w").close()
    try:
        os.rename(tmp, dst)
    except OSError:
        if not os.path.exists(os.path.join(dst, "COMPLETE")):
            raise

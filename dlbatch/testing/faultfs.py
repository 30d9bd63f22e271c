"""A local filesystem that injects the storage faults of a real cluster, for the drills.

``faultfile:///abs/path`` is the local disk seen through :class:`FaultyLocalFileSystem`,
which obeys the :class:`FaultPlan` installed with :func:`install` (class-wide, because
fsspec hands out cached instances):

* ``reply_lost=N``: the next N moves whose destination contains ``match`` really happen,
  then raise ``error`` (default ConnectionResetError) as if the rename's reply was lost;
* ``enospc_after=B``: after B bytes written in all (files opened for writing or exclusive
  creation, which pipe_file and the lease's create use too), a write stores what fits and
  raises OSError(ENOSPC) (disk full: with B=0 an exclusive create leaves an empty file);
* ``full_after_commits=N``: after N moves into a ``match`` path, the disk is full (every
  later write raises ENOSPC) until the plan changes;
* ``crash_after=K``: the (K+1)-th mutating call (write, move, delete) and every one after
  it raise :class:`SimulatedCrash`, a BaseException no handler retries: the process
  "died" there, so a test can stop a multi-step operation at every step;
* ``injected`` counts what was injected, by kind.

Use it as an output path (``output.path=faultfile:///tmp/x/out``) or with ParquetStore.
"""
from __future__ import annotations

import collections
import errno
import io
from dataclasses import dataclass, field

from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "faultfile"


@dataclass
class FaultPlan:
    reply_lost: int = 0
    match: str = "/part-"
    error: type = ConnectionResetError
    enospc_after: int | None = None
    full_after_commits: int | None = None
    crash_after: int | None = None
    written: int = 0
    commits: int = 0
    mutations: int = 0
    injected: collections.Counter = field(default_factory=collections.Counter)

    def room(self, n: int) -> int:
        """How many of ``n`` bytes fit; counts them as written."""
        if self.enospc_after is None:
            self.written += n
            return n
        fit = max(0, min(n, self.enospc_after - self.written))
        self.written += fit
        return fit


    def mutate(self, what: str) -> None:
        """Called before every mutating call: raises SimulatedCrash past crash_after."""
        self.mutations += 1
        if self.crash_after is not None and self.mutations > self.crash_after:
            self.injected["crash"] += 1
            raise SimulatedCrash(f"injected crash before {what} (mutation {self.mutations})")


class SimulatedCrash(BaseException):
    """The process died here (not an Exception: nothing retries or handles it)."""


def _full(path: str) -> OSError:
    return OSError(errno.ENOSPC, f"injected: no space left on device (writing {path})")


class _CountingWriter(io.RawIOBase):
    """A file opened for writing whose bytes count against the plan's budget."""

    def __init__(self, fs: "FaultyLocalFileSystem", f, path: str):
        self.fs, self.f, self.path = fs, f, path

    def writable(self):
        return True

    def write(self, b):
        b = bytes(b)
        fit = self.fs.plan.room(len(b))
        self.f.write(b[:fit])
        if fit < len(b):
            self.fs.plan.injected["enospc"] += 1
            raise _full(self.path)
        return len(b)

    def close(self):
        if not self.closed:
            self.f.close()
        super().close()


class FaultyLocalFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)
    plan: FaultPlan = FaultPlan()

    def mv(self, path1, path2, *args, **kwargs):
        p = self.plan
        p.mutate(f"mv {path2}")
        out = super().mv(path1, path2, *args, **kwargs)
        if p.match in str(path2):
            p.commits += 1
            if p.full_after_commits is not None and p.commits >= p.full_after_commits:
                p.enospc_after = p.written
        if p.reply_lost > 0 and p.match in str(path2):
            p.reply_lost -= 1
            p.injected["reply_lost"] += 1
            raise p.error(f"injected: the reply to moving {path1} -> {path2} was lost (the move happened)")
        return out

    def rm_file(self, path):
        self.plan.mutate(f"rm {path}")
        return super().rm_file(path)

    def _open(self, path, mode="rb", *args, **kwargs):
        if not any(m in mode for m in "wax"):
            return super()._open(path, mode, *args, **kwargs)
        self.plan.mutate(f"open {path}")
        return io.BufferedWriter(_CountingWriter(self, super()._open(path, mode, *args, **kwargs), path))


def install(plan: FaultPlan | None = None) -> FaultPlan:
    """Register ``faultfile://`` and make ``plan`` (a fresh one when None) the active plan."""
    import fsspec

    fsspec.register_implementation(PROTOCOL, FaultyLocalFileSystem, clobber=True)
    FaultyLocalFileSystem.plan = plan or FaultPlan()
    return FaultyLocalFileSystem.plan

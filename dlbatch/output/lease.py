"""One writer per output: a lease under ``<output>/_lease/``.

Every process that changes an output (a run, ``--fresh``, ``dlbatch compact``) holds the
output's lease while it does. The lease is a numbered file ``_lease/<gen>.json`` naming
its holder (owner token, job, host, pid, command) and its last heartbeat; the holder is
the file with the highest number.

Taking it: list ``_lease/``; if the newest file is held (not released, heartbeat fresh,
and on this host its pid alive) the take is refused with a message naming the holder;
otherwise create ``<gen+1>.json`` exclusively. Exclusive creation is what makes two takers
safe: ``O_CREAT|O_EXCL`` on a local/POSIX filesystem, a conditional put (If-None-Match)
on S3 through s3fs; on other stores fsspec's check-then-write is a best effort (two
processes starting within the same second can both believe they won; docs/output.md).
Numbers are never reused: releasing marks the file released instead of deleting it, and
a taker deletes only files older than the one it replaced.

Holding it: a heartbeat thread rewrites the holder's own file every ``heartbeat_s``; before
each commit the store calls `check`, which re-verifies ownership when the last verified
heartbeat is older than ``heartbeat_s``. A holder that finds a newer file (its heartbeat
stopped for ``stale_s`` and another process took over) raises `LeaseLost` and commits
nothing more. Invariant: while `check` passes, no other process has taken the lease,
provided clocks agree to well within ``stale_s`` (heartbeats carry wall-clock times).

A lease whose heartbeat stopped for ``stale_s`` (or whose pid is gone on this host) is
taken over; the taker then reads what the dead holder committed like any resume does
(committed parts, finished or dropped compactions, dead-letter copies), so nothing it
committed is redone and nothing half-written is shown.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid

from connectors.io_retry import call_with_retry

log = logging.getLogger("dlbatch.output.lease")

LEASE_DIR = "_lease"
HEARTBEAT_S = 10.0
STALE_S = 60.0


class LeaseHeld(RuntimeError):
    """Another process holds the output's lease."""


class LeaseLost(RuntimeError):
    """This process's lease was taken over: it must not commit anything more."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def describe(rec: dict, now: float) -> str:
    return (f"job {rec.get('job')!r} ({rec.get('command')}) on host {rec.get('host')} pid {rec.get('pid')}, "
            f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rec.get('started', 0)))}, "
            f"last heartbeat {now - rec.get('heartbeat', 0):.0f} s ago")


class OutputLease:
    """The lease of one output (an fsspec filesystem and the output's root path in it)."""

    def __init__(self, fs, root: str, url: str, job: str, command: str = "run", heartbeat_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S, clock=time.time):
        if not stale_s > 2 * heartbeat_s:
            raise ValueError(f"lease stale_s ({stale_s}) must exceed twice heartbeat_s ({heartbeat_s})")
        self.fs, self.dir, self.url = fs, f"{root.rstrip('/')}/{LEASE_DIR}", url
        self.heartbeat_s, self.stale_s, self.clock = heartbeat_s, stale_s, clock
        self.token = uuid.uuid4().hex
        self.rec = {"owner": self.token, "job": job, "command": command, "host": socket.gethostname(),
                    "pid": os.getpid(), "started": clock(), "heartbeat": clock(), "released": False}
        self.gen: int | None = None
        self.taken_over: dict | None = None  # the stale holder this lease replaced, if any
        self._verified = 0.0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- reading ------------------------------------------------------------------------------
    def _path(self, gen: int) -> str:
        return f"{self.dir}/{gen:012d}.json"

    def _gens(self) -> list[int]:
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(self.dir)
        try:
            names = call_with_retry(self.fs.ls, self.dir, detail=False, op=f"list {self.dir}")
        except FileNotFoundError:
            return []
        gens = []
        for n in names:
            base = n.rstrip("/").rsplit("/", 1)[-1]
            if base.endswith(".json") and base[:-5].isdigit():
                gens.append(int(base[:-5]))
        return sorted(gens)

    def _read(self, gen: int) -> dict | None:
        try:
            return json.loads(call_with_retry(self.fs.cat_file, self._path(gen), op=f"read {self._path(gen)}"))
        except FileNotFoundError:
            return None
        except ValueError:  # a holder's rewrite seen half-way on a store without atomic overwrite
            return {"owner": "?", "heartbeat": self.clock(), "released": False}

    def holder(self) -> dict | None:
        """The record of the live holder, or None when the lease is free (none, released or stale)."""
        gens = self._gens()
        if not gens:
            return None
        rec = self._read(gens[-1])
        return rec if rec is not None and self._live(rec) else None

    def _live(self, rec: dict) -> bool:
        if rec.get("released"):
            return False
        if rec.get("host") == socket.gethostname() and isinstance(rec.get("pid"), int) and not _pid_alive(rec["pid"]):
            return False
        return self.clock() - float(rec.get("heartbeat", 0)) < self.stale_s

    # ---- taking and giving back ------------------------------------------------------------------
    def acquire(self) -> OutputLease:
        """Take the lease or raise `LeaseHeld` naming the holder."""
        for _ in range(5):  # another taker may win the same number: look again
            gens = self._gens()
            top = gens[-1] if gens else 0
            rec = self._read(top) if gens else None
            if rec is not None and self._live(rec) and rec.get("owner") != self.token:
                raise LeaseHeld(f"the output {self.url} is in use by {describe(rec, self.clock())}; one writer per "
                                f"output: wait for it to finish, or stop it (a lease whose heartbeat stopped for "
                                f"{self.stale_s:.0f} s is taken over)")
            self.rec["heartbeat"] = self.clock()
            if self._create(self._path(top + 1), self._body()):
                self.gen = top + 1
                if rec is not None and not rec.get("released"):
                    self.taken_over = rec
                    log.warning("took over the lease of %s from %s", self.url, describe(rec, self.clock()))
                for g in gens[:-1]:  # keep the one replaced: numbers are never reused
                    self._rm(self._path(g))
                self._verified = self.clock()
                self._start_heartbeat()
                return self
        raise LeaseHeld(f"could not take the lease of {self.url}: other processes kept taking it")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.gen is None or self._lost:
            return
        try:
            cur = self._read(self.gen)
            if cur is not None and cur.get("owner") == self.token:
                self.rec["released"] = True
                self._write(self._path(self.gen), self._body())
        except OSError as e:  # the lease then goes stale and is taken over after stale_s
            log.warning("could not release the lease of %s: %s", self.url, e)
        self.gen = None

    def __enter__(self) -> OutputLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ---- holding it --------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise `LeaseLost` unless this process still holds the lease (re-verified when the
        last verified heartbeat is older than heartbeat_s)."""
        if self._lost:
            raise LeaseLost(self._lost)
        if self.gen is None:
            raise LeaseLost(f"the lease of {self.url} is not held")
        if self.clock() - self._verified > self.heartbeat_s:
            self.beat()
            if self._lost:
                raise LeaseLost(self._lost)

    def beat(self) -> None:
        """Verify ownership, then rewrite the heartbeat (the heartbeat thread's step)."""
        gens = self._gens()
        top = gens[-1] if gens else None
        rec = self._read(top) if top is not None else None
        if top != self.gen or rec is None or rec.get("owner") != self.token:
            who = describe(rec, self.clock()) if rec else "nobody (the lease files are gone)"
            self._lost = (f"the lease of {self.url} was taken over by {who} after this process's heartbeat "
                          f"stopped for {self.stale_s:.0f} s; nothing more is committed by this process")
            log.error(self._lost)
            return
        t = self.clock()
        self.rec["heartbeat"] = t
        self._write(self._path(self.gen), self._body())
        self._verified = t

    def _start_heartbeat(self) -> None:
        def run():
            while not self._stop.wait(self.heartbeat_s):
                try:
                    self.beat()
                except Exception as e:  # a missed beat is retried; check() re-verifies before commits
                    log.warning("lease heartbeat of %s failed: %s", self.url, e)
                if self._lost:
                    return

        self._stop.clear()
        self._thread = threading.Thread(target=run, name="dlbatch-lease", daemon=True)
        self._thread.start()

    # ---- the store ---------------------------------------------------------------------------------
    def _body(self) -> bytes:
        return json.dumps(self.rec).encode()

    def _create(self, path: str, body: bytes) -> bool:
        """Create ``path`` only if it does not exist; False when another process did."""
        from fsspec.implementations.local import LocalFileSystem

        call_with_retry(self.fs.makedirs, self.dir, exist_ok=True, op=f"makedirs {self.dir}")
        if isinstance(self.fs, LocalFileSystem):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            return True
        try:  # s3fs: a conditional put; others: check then write
            call_with_retry(self.fs.pipe_file, path, body, mode="create", op=f"create {path}")
        except FileExistsError:  # another taker's, or ours when a retried put had landed
            rec = self._read(int(path.rsplit("/", 1)[-1][:-5]))
            return rec is not None and rec.get("owner") == self.token
        except OSError as e:  # S3 answers a lost race with 412 Precondition Failed
            if "412" in str(e) or "PreconditionFailed" in str(e):
                return False
            raise
        return True

    def _write(self, path: str, body: bytes) -> None:
        from fsspec.implementations.local import LocalFileSystem

        if isinstance(self.fs, LocalFileSystem):
            tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            call_with_retry(self.fs.pipe_file, path, body, op=f"write {path}")

    def _rm(self, path: str) -> None:
        try:
            call_with_retry(self.fs.rm_file, path, op=f"delete {path}")
        except (FileNotFoundError, OSError) as e:
            if not isinstance(e, FileNotFoundError):
                log.warning("could not remove an old lease file %s: %s", path, e)


def command_line() -> str:
    return " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv[:3]))

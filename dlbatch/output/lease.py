"""One writer per output: a lease under ``<output>/_lease/``.

Every process that changes an output (a run, ``--fresh``, ``dlbatch compact``) holds the
output's lease while it does. The lease is a numbered file ``_lease/<gen>.json`` naming
its holder (owner token, job, command, and the process: host, boot id, pid namespace, pid,
start time; dlbatch/output/identity.py) and its last heartbeat; the holder is the file with
the highest number, and that number is the holder's *generation*: the fencing token its
commits carry (dlbatch/output/fence.py).

Taking it: list ``_lease/``; if the newest file is held the take is refused with a message
naming the holder; otherwise create ``<gen+1>.json`` exclusively. Exclusive creation is what
makes two takers safe: ``O_CREAT|O_EXCL`` on a local/POSIX filesystem, a conditional put
(If-None-Match) on S3 through s3fs; on other stores fsspec's check-then-write is a best
effort (two processes starting within the same second can both believe they won). A create
that fails after the file exists (a full disk) removes what it made. Numbers are never
reused: releasing marks the file released instead of deleting it, and a taker deletes only
files older than the one it replaced.

When a lease is held. The newest file is held unless it is released, or its process is
provably gone (same boot and pid namespace, pid gone or reused: `identity.provably_gone`), or
its heartbeat is stale: the file was last written more than ``stale_s`` ago *by the store's
own clock* — the file's modification time against the time the store stamps on a probe file
written now. The writers' wall clocks decide nothing (they are in the record for people to
read), so a taker whose clock runs ahead cannot take a live lease and a dead holder whose clock
ran ahead does not block anyone longer than ``stale_s``. A file that cannot be parsed (empty
after a full disk, half written on a store without atomic overwrite) names no one: it is held
while it is fresh and free once it is ``stale_s`` old, like any other.

Holding it: a heartbeat thread rewrites the holder's own file every ``heartbeat_s``. `check`
re-reads the lease when the last verification *started* more than ``heartbeat_s`` ago (a pause
between reading the lease and noting it verified cannot stretch the window), and `verify`
re-reads it now: the stores call it immediately before every rename that makes something
visible. A holder that finds a newer file raises `LeaseLost` and commits nothing more.

Suspects. A holder taken over while its process might still run (its heartbeat stopped,
its process not provably gone: a paused VM, a stopped process, a partitioned host) may wake
up and finish a rename it had verified before. The taker records such holders (and those its
predecessor recorded, less the provably gone) as ``suspects``; while there are any, the
stores look for what they may have made visible after the takeover at every commit
(dlbatch/output/fence.py).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid

from connectors.io_retry import call_with_retry
from dlbatch.output.identity import provably_gone, this_process

log = logging.getLogger("dlbatch.output.lease")

LEASE_DIR = "_lease"
HEARTBEAT_S = 10.0
STALE_S = 60.0
IDENTITY = ("host", "boot", "pidns", "pid", "start")


class LeaseHeld(RuntimeError):
    """Another process holds the output's lease."""


class LeaseLost(RuntimeError):
    """This process's lease was taken over: it must not commit anything more."""


def describe(rec: dict, age_s: float | None) -> str:
    """The holder of ``rec`` for a message; ``age_s``: its heartbeat's age by the store's clock."""
    beat = f"last heartbeat {age_s:.0f} s ago" if age_s is not None else "heartbeat age unknown"
    if rec.get("unreadable"):
        return f"a lease file that cannot be read (empty or half written), {beat}"
    return (f"job {rec.get('job')!r} ({rec.get('command')}) on host {rec.get('host')} pid {rec.get('pid')}, "
            f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rec.get('started', 0)))}, {beat}")


class OutputLease:
    """The lease of one output (an fsspec filesystem and the output's root path in it)."""

    def __init__(self, fs, root: str, url: str, job: str, command: str = "run", heartbeat_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S, clock=time.time):
        """``clock``: the wall clock written into the record for people to read (nothing is
        decided from it)."""
        if not stale_s > 2 * heartbeat_s:
            raise ValueError(f"lease stale_s ({stale_s}) must exceed twice heartbeat_s ({heartbeat_s})")
        self.fs, self.dir, self.url = fs, f"{root.rstrip('/')}/{LEASE_DIR}", url
        self.heartbeat_s, self.stale_s, self.clock = heartbeat_s, stale_s, clock
        self.token = uuid.uuid4().hex
        self.rec = {"owner": self.token, "job": job, "command": command, **this_process(), "started": clock(),
                    "heartbeat": clock(), "released": False, "suspects": []}
        self.gen: int | None = None
        self.taken_over: dict | None = None  # the holder this lease replaced while it was not released
        self._verified = 0.0  # time.monotonic() when the last verification that passed started
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def suspects(self) -> list[dict]:
        """Earlier holders that may still be running (taken over, not provably gone)."""
        return self.rec["suspects"]

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
        """The record of ``gen``; None when the file is gone; ``{"unreadable": True}`` when it
        does not parse (it names no holder)."""
        try:
            rec = json.loads(call_with_retry(self.fs.cat_file, self._path(gen), op=f"read {self._path(gen)}"))
        except FileNotFoundError:
            return None
        except ValueError:
            return {"unreadable": True}
        return rec if isinstance(rec, dict) else {"unreadable": True}

    def _mtime(self, path: str) -> float:
        """When the store last wrote ``path``, by the store's clock (seconds since the epoch)."""
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(path)
        try:
            return call_with_retry(self.fs.modified, path, op=f"stat {path}").timestamp()
        except NotImplementedError:  # fsspec's default `modified`: a filesystem without it states times in info
            info = call_with_retry(self.fs.info, path, op=f"stat {path}")
            for k in ("mtime", "LastModified", "last_modified", "updated", "created"):
                v = info.get(k)
                if v is not None:
                    return v.timestamp() if hasattr(v, "timestamp") else float(v)
            raise OSError(f"{path}: the store reports no modification time ({sorted(info)})") from None

    def store_now(self) -> float:
        """The store's clock now: the modification time it stamps on a probe file written now."""
        probe = f"{self.dir}/.clock-{self.token}"
        call_with_retry(self.fs.makedirs, self.dir, exist_ok=True, op=f"makedirs {self.dir}")
        call_with_retry(self.fs.pipe_file, probe, b"", op=f"write {probe}")
        try:
            return self._mtime(probe)
        finally:
            self._rm(probe)

    def heartbeat_age(self, gen: int, now: float | None = None) -> float | None:
        """Seconds since the file of ``gen`` was last written, by the store's clock (None: gone)."""
        try:
            written = self._mtime(self._path(gen))
        except FileNotFoundError:
            return None
        return (self.store_now() if now is None else now) - written

    def _live(self, rec: dict, gen: int) -> tuple[bool, float | None]:
        """(whether ``rec``, the file of ``gen``, holds the lease; its heartbeat age if read)."""
        if rec.get("released") or provably_gone(rec):
            return False, None
        age = self.heartbeat_age(gen)
        return age is not None and age < self.stale_s, age

    def holder(self) -> dict | None:
        """The record of the live holder, or None when the lease is free (none, released or stale)."""
        gens = self._gens()
        if not gens:
            return None
        rec = self._read(gens[-1])
        return rec if rec is not None and self._live(rec, gens[-1])[0] else None

    # ---- taking and giving back ------------------------------------------------------------------
    def acquire(self) -> OutputLease:
        """Take the lease or raise `LeaseHeld` naming the holder."""
        for _ in range(5):  # another taker may win the same number: look again
            gens = self._gens()
            top = gens[-1] if gens else 0
            rec = self._read(top) if gens else None
            if rec is not None and rec.get("owner") != self.token:
                live, age = self._live(rec, top)
                if live:
                    raise LeaseHeld(f"the output {self.url} is in use by {describe(rec, age)}; one writer per "
                                    f"output: wait for it to finish, or stop it (a lease whose heartbeat stopped "
                                    f"for {self.stale_s:.0f} s is taken over)")
            self.rec["heartbeat"] = self.clock()
            self.rec["suspects"] = _suspects(rec, top)
            if self._create(self._path(top + 1), self._body()):
                self.gen = top + 1
                if rec is not None and not rec.get("released"):
                    self.taken_over = rec
                    log.warning("took over the lease of %s from %s", self.url, describe(rec, None))
                for g in gens[:-1]:  # keep the one replaced: numbers are never reused
                    self._rm(self._path(g))
                self._verified = time.monotonic()
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
        """Raise `LeaseLost` unless this process still holds the lease (read again when the last
        verification started more than heartbeat_s ago)."""
        if self._lost:
            raise LeaseLost(self._lost)
        if self.gen is None:
            raise LeaseLost(f"the lease of {self.url} is not held")
        if time.monotonic() - self._verified > self.heartbeat_s:
            self.verify()

    def verify(self) -> None:
        """Read the lease now; raise `LeaseLost` unless this process is its holder. Called
        immediately before every rename that makes something visible."""
        if self.gen is None and not self._lost:
            raise LeaseLost(f"the lease of {self.url} is not held")
        started = time.monotonic()
        if not self._confirm():
            raise LeaseLost(self._lost)
        self._verified = max(self._verified, started)

    def beat(self) -> None:
        """Verify ownership, then rewrite the heartbeat (the heartbeat thread's step)."""
        started = time.monotonic()
        if not self._confirm():
            return
        self.rec["heartbeat"] = self.clock()
        self._write(self._path(self.gen), self._body())
        self._verified = max(self._verified, started)

    def _confirm(self) -> bool:
        """Whether the newest lease file is still this process's; when not, remember why."""
        if self._lost:
            return False
        gens = self._gens()
        top = gens[-1] if gens else None
        rec = self._read(top) if top is not None else None
        if top == self.gen and rec is not None and rec.get("owner") == self.token:
            return True
        who = describe(rec, None) if rec else "nobody (the lease files are gone)"
        self._lost = (f"the lease of {self.url} was taken over by {who} after this process's heartbeat "
                      f"stopped for {self.stale_s:.0f} s; nothing more is committed by this process")
        log.error(self._lost)
        return False

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
        """Create ``path`` only if it does not exist; False when another process did. A create
        that fails once the file exists (a full disk) removes it before raising."""
        from fsspec.implementations.local import LocalFileSystem

        call_with_retry(self.fs.makedirs, self.dir, exist_ok=True, op=f"makedirs {self.dir}")
        if isinstance(self.fs, LocalFileSystem):
            try:
                f = self.fs.open(path, "xb")  # O_CREAT|O_EXCL
            except FileExistsError:
                return False
            try:
                with f:
                    f.write(body)
                fd = os.open(self.fs._strip_protocol(path), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException:
                self._rm(path)  # an empty or partial lease file must not stay behind
                raise
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
            with open(self.fs._strip_protocol(tmp), "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(self.fs._strip_protocol(tmp), self.fs._strip_protocol(path))
        else:
            call_with_retry(self.fs.pipe_file, path, body, op=f"write {path}")

    def _rm(self, path: str) -> None:
        try:
            call_with_retry(self.fs.rm_file, path, op=f"delete {path}")
        except (FileNotFoundError, OSError) as e:
            if not isinstance(e, FileNotFoundError):
                log.warning("could not remove %s: %s", path, e)


def _suspects(rec: dict | None, gen: int) -> list[dict]:
    """The suspects of a lease that replaces ``rec`` (the file of ``gen``): those ``rec``
    recorded, and ``rec``'s holder when it was taken over unreleased, less the provably gone.
    An unreadable record may hide earlier suspects: it is one, of unknown identity."""
    if rec is None:
        return []
    out = [s for s in rec.get("suspects") or [] if isinstance(s, dict) and not provably_gone(s)]
    if not rec.get("released") and not provably_gone(rec):
        out.append({"gen": gen, **{k: rec.get(k) for k in IDENTITY}})
    return out


def command_line() -> str:
    return " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv[:3]))

"""Run a parser in a child process, so that a crash, a hang or a memory blow-up on one file
costs that file only.

``run(ref, args, kwargs, timeout_s=..., memory_mb=...)`` calls the function named by ``ref``
(``"module:function"``, imported in the child) in a parser process and returns its result,
or raises `ParseFailed` with one of:

* ``ParseCrashed``: the process died (a segfault in native code: ``signal 11 (SIGSEGV)``;
  an abort; the kernel's OOM killer: ``signal 9 (SIGKILL)``);
* ``ParseTimeout``: no answer within ``timeout_s`` seconds of wall time; the process is
  killed (SIGKILL: native code holding the GIL cannot be interrupted any other way);
* ``ParseMemoryExceeded``: the process ran out of its address space, ``memory_mb`` MiB
  (``RLIMIT_AS``, set in the child before it imports anything of the parser's);
* the function raised another exception: its class name, e.g. ``ValueError`` (and its message).

A parser process that cannot start at all raises `ParserUnavailable`: that is the machine's or
the job's problem (a memory cap too small for the parser's own imports), not the file's.

The process is reused: a parent (a Ray Data task or actor process) keeps idle parser processes
in a small pool and starts one the first time it needs it (Python + pymupdf: about 0.1-0.3 s,
once per parent; sending a file and its row through a pipe costs well under a millisecond per
100 KB). A process that failed is killed and replaced. Because a reused process carries what
earlier files left behind (fragmented heap, native state), a crash or memory failure in a
process that had parsed other files first is retried once in a fresh process: only a failure
in a fresh process is charged to the file. A timeout is not retried (it would cost the timeout
again). A process is retired after ``MAX_CALLS_PER_PROCESS`` calls to bound that drift.

Orphans: the child reads requests from its stdin and exits at end of file, so it ends with
its parent; a child still busy when its parent dies is ended by ``SIGALRM`` (default action:
terminate) a few seconds after the timeout it was given. The protocol runs on a duplicate of
the child's stdout; its fd 1 is pointed at stderr, so what native code prints cannot corrupt it.
"""
from __future__ import annotations

import atexit
import importlib
import math
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time

CRASHED = "ParseCrashed"
TIMEOUT = "ParseTimeout"
MEMORY = "ParseMemoryExceeded"

MAX_CALLS_PER_PROCESS = 200
START_TIMEOUT_S = 120.0   # Python start-up and the preloaded imports, on a busy machine
ALARM_GRACE_S = 5         # the child's own SIGALRM comes this long after the parent's deadline
_HEADER = struct.Struct("!Q")


class ParseFailed(Exception):
    """A parse that did not return: ``error_type`` (one of the names above) and a message."""

    def __init__(self, error_type: str, message: str):
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message


class ParserUnavailable(RuntimeError):
    """The parser process could not start (not the fault of any file)."""


class _Dead(Exception):
    """The child closed the pipe (died) before a whole reply."""


# ------------------------------------------------------------------ framing

def _ready(fd: int, event: int, deadline: float) -> bool:
    """Whether ``fd`` is ready (or closed) before ``deadline``: poll, not select, which fails on
    descriptors above 1024 (a Ray worker may hold that many)."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    p = select.poll()
    p.register(fd, event)
    return bool(p.poll(left * 1000))


def _write_all(fd: int, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        if not _ready(fd, select.POLLOUT, deadline):
            raise TimeoutError
        view = view[os.write(fd, view[: 1 << 20]):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None and not _ready(fd, select.POLLIN, deadline):
            raise TimeoutError
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise _Dead
        buf += chunk
    return bytes(buf)


def _frame(obj) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _read_frame(fd: int, deadline: float | None):
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, n, deadline))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


# ------------------------------------------------------------------ the parent's side

class ParserProcess:
    """One child process that runs parse calls one at a time."""

    def __init__(self, memory_mb: int | None = None, preload: tuple[str, ...] = ()):
        self.memory_mb = memory_mb
        self.calls = 0
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([here, *(p for p in sys.path if p)]))
        self.proc = subprocess.Popen([sys.executable, "-m", "connectors.isolate", str(memory_mb or 0), *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        try:
            reply = _read_frame(self.proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S)
        except (TimeoutError, _Dead, EOFError, pickle.UnpicklingError) as e:
            self.close()
            cap = f" under input.parse_memory_mb={memory_mb}" if memory_mb else ""
            raise ParserUnavailable(f"the parser process did not start{cap} ({type(e).__name__}, exit status "
                                    f"{self.proc.returncode}; its stderr says why)") from None
        if reply[0] != "ready":
            self.close()
            cap = f" under input.parse_memory_mb={memory_mb}" if memory_mb else ""
            raise ParserUnavailable(f"the parser process could not start{cap}: {reply[1]}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, ref: str, args: tuple, kwargs: dict, timeout_s: float):
        """``ref(*args, **kwargs)`` in the child; raises `ParseFailed`. After a failure the
        process is gone (closed here)."""
        self.calls += 1
        deadline = time.monotonic() + timeout_s
        alarm = math.ceil(timeout_s) + ALARM_GRACE_S
        try:
            _write_all(self.proc.stdin.fileno(), _frame((ref, args, kwargs, alarm)), deadline)
            reply = _read_frame(self.proc.stdout.fileno(), deadline)
        except TimeoutError:
            self.close()
            raise ParseFailed(TIMEOUT, f"no result after {timeout_s:g} s (input.parse_timeout_s); "
                                       "the parser process was killed") from None
        except (_Dead, BrokenPipeError, EOFError, pickle.UnpicklingError):
            self.close()
            raise ParseFailed(CRASHED, self._death()) from None
        kind = reply[0]
        if kind == "ok":
            return reply[1]
        self.close()
        if kind == "memory":
            raise ParseFailed(MEMORY, f"parsing needed more than {self.memory_mb} MiB of address space "
                                      f"(input.parse_memory_mb){': ' + reply[1] if reply[1] else ''}")
        raise ParseFailed(reply[1], reply[2])

    def _death(self) -> str:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "the parser process closed its pipe and did not exit"
        if rc < 0:
            hint = " (killed from outside: the kernel's out-of-memory killer?)" if -rc == signal.SIGKILL else ""
            return f"the parser process died of signal {-rc} ({_signal_name(-rc)}){hint}"
        return f"the parser process exited with status {rc}"

    def close(self) -> None:
        """End the child: end of file on its stdin, then SIGKILL if it is busy."""
        if self.proc.poll() is None:
            self.proc.kill()  # idle children exit at EOF, but a busy or hung one must not linger
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
            pass


class _Pool:
    """Idle parser processes of this (parent) process, by (memory cap, preload)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.idle: dict[tuple, list[ParserProcess]] = {}

    def take(self, key: tuple) -> ParserProcess | None:
        with self.lock:
            procs = self.idle.get(key) or []
            while procs:
                p = procs.pop()
                if p.alive:
                    return p
                p.close()
        return None

    def give(self, key: tuple, p: ParserProcess) -> None:
        if not p.alive or p.calls >= MAX_CALLS_PER_PROCESS:
            p.close()
            return
        with self.lock:
            self.idle.setdefault(key, []).append(p)

    def close_all(self) -> None:
        with self.lock:
            procs = [p for ps in self.idle.values() for p in ps]
            self.idle.clear()
        for p in procs:
            p.close()


_POOL = _Pool()
atexit.register(_POOL.close_all)


def run(ref: str, args: tuple = (), kwargs: dict | None = None, *, timeout_s: float,
        memory_mb: int | None = None, preload: tuple[str, ...] = ()):
    """``ref(*args, **kwargs)`` in a parser process (see the module docstring); raises
    `ParseFailed` when it crashed, timed out, ran out of memory or raised."""
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if memory_mb is not None and not (isinstance(memory_mb, int) and memory_mb > 0):
        raise ValueError(f"memory_mb must be a positive int or None, got {memory_mb!r}")
    key = (memory_mb, tuple(preload))
    proc = _POOL.take(key)
    fresh = proc is None
    if fresh:
        proc = ParserProcess(memory_mb, tuple(preload))
    try:
        result = proc.call(ref, args, kwargs or {}, timeout_s)
    except ParseFailed as e:
        if fresh or e.error_type not in (CRASHED, MEMORY):
            raise
        # a reused process: what earlier files left in it may be to blame; a fresh one decides
        proc = ParserProcess(memory_mb, tuple(preload))
        result = proc.call(ref, args, kwargs or {}, timeout_s)
    _POOL.give(key, proc)
    return result


# ------------------------------------------------------------------ the child's side

def _resolve(ref: str):
    module, _, name = ref.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _child_main(argv: list[str]) -> int:
    import resource

    memory_mb, preload = int(argv[0]), argv[1:]
    out_fd = os.dup(1)
    os.dup2(2, 1)  # what the parser prints goes to stderr, not into the protocol
    in_fd = sys.stdin.fileno()
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    out_of_memory = _frame(("failed", "MemoryError (the imports alone need more address space)"))

    def send(obj) -> None:
        data = _frame(obj)
        view = memoryview(data)
        while view:
            view = view[os.write(out_fd, view):]

    try:
        if memory_mb:
            limit = memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        for module in preload:
            importlib.import_module(module)
    except MemoryError:
        os.write(out_fd, out_of_memory)  # built before the cap: nothing left to build it with now
        return 1
    except BaseException as e:  # noqa: BLE001 - told to the parent, which refuses to go on
        send(("failed", f"{type(e).__name__}: {e}"[:1000]))
        return 1
    send(("ready",))
    while True:
        try:
            request = _read_frame(in_fd, None)
        except _Dead:
            return 0  # the parent closed the pipe (or died)
        except MemoryError:
            send(("memory", "the request itself did not fit"))
            return 1
        ref, args, kwargs, alarm = request
        signal.alarm(alarm)
        try:
            reply = ("ok", _resolve(ref)(*args, **kwargs))
        except MemoryError as e:
            reply = ("memory", str(e))
        except Exception as e:  # noqa: BLE001 - a parser's exception is the file's, told to the parent
            reply = ("raised", type(e).__name__, str(e)[:1000])
        del request, args, kwargs
        signal.alarm(0)
        try:
            send(reply)
        except MemoryError:
            reply = None
            send(("memory", "the result did not fit"))
            return 1


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))

"""Faults the drills inject into workers, switched on by an environment variable.

``DLBATCH_TEST_FAULTS`` holds a JSON object; a worker started with it set (the driver passes
its ``DLBATCH_*`` variables on to its workers) builds a `WorkerFaults` and calls
``before_call(role, items)`` before each batch:

* ``{"die_on": "poison::"}``: the worker's process exits at once (``os._exit(1)``, as a
  segfault or the OOM killer would end it) when a request id of the batch contains the text.
* ``{"hang_on": "poison::"}``: the call never returns (a kernel or a collective that hangs);
  the worker's other calls go on.

Unset (every real job), workers hold no `WorkerFaults` and nothing here runs.

`stop_at` pauses a process the way a VM pause or a stopped process does (SIGSTOP: every
thread, the lease's heartbeat included, stops until SIGCONT): a drill's child process wraps a
call with it — the output filesystem's ``mv`` (a part's rename: the lease was just read),
``deltalake.write_deltalake`` (a Delta commit, after the store's checks) — so the pause falls
at a chosen call, deterministically.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

ENV = "DLBATCH_TEST_FAULTS"


@dataclass(frozen=True)
class WorkerFaults:
    die_on: str | None = None
    hang_on: str | None = None

    @classmethod
    def from_env(cls) -> "WorkerFaults | None":
        raw = os.environ.get(ENV)
        if not raw:
            return None
        try:
            return cls(**json.loads(raw))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{ENV} must be a JSON object with the keys of WorkerFaults, got {raw!r}: {e}") from None

    def before_call(self, role: str, items: list[dict]) -> None:
        if self.die_on and any(self.die_on in it["request_id"] for it in items):
            os._exit(1)
        if self.hang_on and any(self.hang_on in it["request_id"] for it in items):
            import time

            while True:
                time.sleep(3600)


def env(**faults) -> dict:
    """{ENV: json} for a test's monkeypatch.setenv / subprocess environment."""
    return {ENV: json.dumps(faults)}


def stop_at(fn, nth: int, when: str = "after"):
    """``fn`` wrapped so that this process stops itself (SIGSTOP) right ``when`` ("after" or
    "before") its ``nth`` call (1-based); every other call is ``fn`` alone."""
    import signal

    if when not in ("after", "before") or nth < 1:
        raise ValueError(f"stop_at needs when 'after' or 'before' and nth >= 1, got {when!r}, {nth}")
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        hit = calls[0] == nth
        if hit and when == "before":
            os.kill(os.getpid(), signal.SIGSTOP)
        out = fn(*args, **kwargs)
        if hit and when == "after":
            os.kill(os.getpid(), signal.SIGSTOP)
        return out

    return wrapped

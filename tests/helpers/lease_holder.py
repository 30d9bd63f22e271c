"""A lease holder in its own process, for the fencing and lease drills (tests/test_fencing.py).

    python -m tests.helpers.lease_holder commit FORMAT OUT NDOCS PAUSE_AT
        takes the lease of OUT (heartbeat 0.5 s), reads progress as a run does, then commits
        documents d0 .. d<NDOCS-1> one flush each; at the commit of d<PAUSE_AT> it stops itself
        (SIGSTOP) right after its last check (parquet: just before the part's rename, the
        filesystem's ``mv``; delta: just before ``deltalake.write_deltalake``). Resumed
        (SIGCONT), it goes on; exits 3 printing "lost d<i>" on LeaseLost.
    python -m tests.helpers.lease_holder hold OUT
        takes the lease, prints "held <pid> <pid namespace>", and keeps it (heartbeat 0.5 s)
        until killed.

`age_lease` moves the store's clock on for the lease files of an output (local disk).
"""
from __future__ import annotations

import sys
import time

TASKS = ("summary", "keywords")


def age_lease(out, seconds):
    """The store's clock moved on ``seconds`` since the lease files of the output ``out`` (a
    pathlib.Path) were written: their modification times set back (leases are judged by it)."""
    import os

    for f in (out / "_lease").glob("*.json"):
        st = f.stat()
        os.utime(f, (st.st_atime - seconds, st.st_mtime - seconds))


def doc_rows(doc: str) -> list[dict]:
    return [{"doc_id": doc, "source": "in.jsonl", "task": t, "output": f"{t} of {doc}", "prompt_tokens": 10,
             "output_tokens": 2} for t in TASKS]


def open_store(fmt: str, out: str):
    from dlbatch.output import open_store as open_
    from dlbatch.output.files import OutputFiles

    class Output:  # what open_store reads of a job's output section
        path, storage_options, format, keep_columns = out, {}, fmt, []

    return open_(Output(), OutputFiles(out), fmt)


def commit(fmt: str, out: str, ndocs: int, pause_at: int) -> int:
    from dlbatch.output.lease import LeaseLost
    from dlbatch.testing.faults import stop_at

    store = open_store(fmt, out)
    store.files.take_lease("drill", heartbeat_s=0.5, stale_s=2.0)
    store.recover()
    store.progress(tasks=set(TASKS))
    for i in range(ndocs):
        if i == pause_at and fmt == "delta":  # the commit's first Delta write: after every check
            import deltalake

            deltalake.write_deltalake = stop_at(deltalake.write_deltalake, 1, "before")
        elif i == pause_at:  # the commit's first rename (its part): after the lease was read
            store.files.fs.mv = stop_at(store.files.fs.mv, 1, "before")
        try:
            store.commit(doc_rows(f"d{i}"), [], False)
        except LeaseLost as e:
            print(f"lost d{i}: {e}", flush=True)
            return 3
        print(f"committed d{i}", flush=True)
    store.files.release_lease()
    return 0


def hold(out: str) -> int:
    import os

    from dlbatch.output.files import OutputFiles

    files = OutputFiles(out)
    files.take_lease("drill", heartbeat_s=0.5, stale_s=2.0)
    print(f"held {os.getpid()} {os.readlink('/proc/self/ns/pid')}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "commit":
        sys.exit(commit(args[0], args[1], int(args[2]), int(args[3])))
    sys.exit(hold(args[0]))

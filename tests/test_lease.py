"""Leases robust to PID namespaces, empty lease files and clock skew (issue 37, points 3-5), and
a heartbeat that cannot count a pause as verified: a lease is judged by the store's clock, not
by the writers' clocks; a pid decides only within its own boot and pid namespace; an empty
lease file neither locks the output for good nor stays behind after a failed create."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dlbatch.output.lease import LEASE_DIR, LeaseHeld, LeaseLost, OutputLease
from tests.helpers.jobs import REPO
from tests.helpers.lease_holder import age_lease


def _lease(out, **kw):
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(out))
    return OutputLease(fs, root, str(out), "j", heartbeat_s=kw.pop("heartbeat_s", 20), **kw)


def test_a_pause_inside_a_heartbeat_does_not_count_as_verified(tmp_path):
    """beat() notes the lease verified as of when its reading *started*: a pause between the
    reading and the note (taken over meanwhile) leaves the next check to read the lease again."""
    held = _lease(tmp_path, heartbeat_s=0.3, stale_s=1.0).acquire()
    held._stop.set()
    held._thread.join()
    real = held._write

    def pause_then_write(path, body):  # the lease was read; the heartbeat's write comes next
        age_lease(tmp_path, 2)  # paused past stale_s: another process takes over
        _lease(tmp_path, heartbeat_s=0.3, stale_s=1.0).acquire()
        time.sleep(0.4)  # longer than a heartbeat
        real(path, body)

    held._write = pause_then_write
    held.beat()
    held._write = real
    with pytest.raises(LeaseLost, match="taken over"):
        held.check()


def _unshare_works() -> str | None:
    try:
        r = subprocess.run(["unshare", "-pf", "--mount-proc", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare cannot run here: {e}"
    return None if r.returncode == 0 else f"unshare -pf is not permitted here: {r.stderr.strip()}"


def test_a_live_lease_in_another_pid_namespace_is_not_taken_over(tmp_path):
    """A holder in another pid namespace on the same host (a container): its pid means nothing
    here, so its lease is judged by its heartbeat alone; taken over only once stale."""
    why = _unshare_works()
    if why:
        pytest.skip(why)
    alive = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    pid = next(p for p in range(30001, 32000) if p not in alive and p - 1 not in alive)  # dead here
    inner = ("import subprocess, sys; open('/proc/sys/kernel/ns_last_pid', 'w').write(sys.argv[1]); "
             "sys.exit(subprocess.call([sys.executable, '-m', 'tests.helpers.lease_holder', 'hold', sys.argv[2]]))")
    holder = subprocess.Popen(["unshare", "-pf", "--mount-proc", sys.executable, "-c", inner, str(pid - 1),
                               str(tmp_path)], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        line = holder.stdout.readline().split()
        assert line[:2] == ["held", str(pid)] and line[2] != os.readlink("/proc/self/ns/pid"), line
        rec = json.loads(next((tmp_path / LEASE_DIR).glob("*.json")).read_text())
        assert rec["pid"] == pid and rec["host"] == os.uname().nodename
        for _ in range(3):  # its pid is not alive here, yet the lease is live
            with pytest.raises(LeaseHeld):
                _lease(tmp_path, heartbeat_s=0.5, stale_s=2.0).acquire()
            time.sleep(0.5)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    t0 = time.time()
    while True:  # dead now: free once its heartbeat is stale_s old by the store's clock
        try:
            taker = _lease(tmp_path, heartbeat_s=0.5, stale_s=2.0).acquire()
            break
        except LeaseHeld:
            assert time.time() - t0 < 30
            time.sleep(0.2)
    assert taker.taken_over["pid"] == pid
    taker.release()


def test_an_empty_lease_file_after_enospc_is_removed_or_goes_stale(tmp_path):
    """The disk fills up right after the exclusive create: the create removes what it made, so
    the next take succeeds at once; an empty lease file left anyway (a crash there) is held
    while fresh and free once stale_s old by the store's clock — never locked for good."""
    from dlbatch.testing.faultfs import FaultPlan, install

    import fsspec

    plan = install(FaultPlan(enospc_after=0))
    try:
        fs, root = fsspec.core.url_to_fs(f"faultfile://{tmp_path}/a")
        with pytest.raises(OSError) as e:
            OutputLease(fs, root, f"faultfile://{tmp_path}/a", "j").acquire()
        assert e.value.errno == 28 and plan.injected["enospc"] >= 1
        assert not list((tmp_path / "a" / LEASE_DIR).glob("*.json"))  # nothing left behind
    finally:
        install(FaultPlan())
    lease = OutputLease(fs, root, f"faultfile://{tmp_path}/a", "j").acquire()  # space again: taken at once
    assert lease.gen == 1
    lease.release()

    b = tmp_path / "b"
    (b / LEASE_DIR).mkdir(parents=True)
    (b / LEASE_DIR / f"{1:012d}.json").write_bytes(b"")  # a crash between the create and the write
    with pytest.raises(LeaseHeld, match="cannot be read"):
        _lease(b, stale_s=60).acquire()
    age_lease(b, 61)
    taker = _lease(b, stale_s=60).acquire()
    assert taker.gen == 2 and taker.taken_over == {"unreadable": True} and taker.rec["suspects"]
    taker.release()


def test_leases_are_judged_by_the_stores_clock_not_the_writers(tmp_path):
    """A taker whose clock runs 61 s ahead cannot take a live lease; a dead holder whose clock
    ran an hour ahead blocks others for stale_s of the store's time, not for an hour."""
    ahead = tmp_path / "ahead"
    held = _lease(ahead, stale_s=60).acquire()
    with pytest.raises(LeaseHeld):
        _lease(ahead, stale_s=60, clock=lambda: time.time() + 61).acquire()
    held.release()

    skewed = tmp_path / "skewed"
    dead = _lease(skewed, stale_s=60, clock=lambda: time.time() + 3600).acquire()
    dead._stop.set()  # its heartbeat stops (the process hangs; its pid stays alive)
    dead._thread.join()
    with pytest.raises(LeaseHeld):
        _lease(skewed, stale_s=60).acquire()
    age_lease(skewed, 61)
    taker = _lease(skewed, stale_s=60).acquire()
    assert taker.taken_over["owner"] == dead.token
    taker.release()


def test_a_reused_pid_does_not_keep_a_lease_alive_and_a_dead_one_frees_it(tmp_path):
    """In this boot and pid namespace a pid decides at once: gone, or reused by a process that
    started at another time, frees the lease without waiting for the heartbeat."""
    held = _lease(tmp_path).acquire()
    held._stop.set()
    path = held._path(held.gen)
    rec = json.loads(open(path).read())
    rec["start"] = (rec.get("start") or 0) + 1  # this pid now belongs to another process
    open(path, "w").write(json.dumps(rec))
    taker = _lease(tmp_path).acquire()
    assert taker.taken_over["pid"] == os.getpid() and not taker.rec["suspects"]  # provably gone: no suspect
    taker.release()


def test_a_store_without_modified_is_timed_by_its_info(tmp_path):
    """fsspec's default `modified` raises NotImplementedError (e.g. an HTTP-like store): the
    lease reads the time the store states in `info`; a store stating none is an OSError naming
    the keys it has, never a lease judged by the writer's clock."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class NoModified(LocalFileSystem):
        def modified(self, path):
            raise NotImplementedError

    class NoTimes(NoModified):
        def info(self, path, **kw):
            return {k: v for k, v in super().info(path, **kw).items() if k not in ("mtime", "created")}

    _, root = fsspec.core.url_to_fs(str(tmp_path))
    before = time.time()
    now = OutputLease(NoModified(), root, str(tmp_path), "j").store_now()
    assert before - 5 <= now <= time.time() + 5  # the local file's mtime, as info states it
    with pytest.raises(OSError, match="reports no modification time"):
        OutputLease(NoTimes(), root, str(tmp_path), "j").store_now()

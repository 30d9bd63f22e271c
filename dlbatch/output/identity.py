"""Which process holds a lease, named so that another process can tell when it is provably gone.

A lease record names its holder by host name, pid and three things that make the pid mean
something: the kernel's boot id (``/proc/sys/kernel/random/boot_id``), the pid namespace
(the inode of ``/proc/self/ns/pid``) and the process's start time (field 22 of
``/proc/<pid>/stat``, clock ticks since boot).

A host name and a pid alone do not name a process: two containers (or a cloned VM) share a
host name and each has its own pid 1, 2, ...; a reboot or a long uptime reuses pids. So the
shortcut "its pid is gone on this host, so the lease is free at once" is taken only when the
record was written in the same boot and the same pid namespace as the reader (then the pid
is one the reader can look up), and the pid is gone or now belongs to a process that started
at another time. Whenever any of these is unknown or differs, nothing is decided from the pid:
the lease is judged by its heartbeat alone (dlbatch/output/lease.py), which is slower after a
crash but never wrong.
"""
from __future__ import annotations

import os
import socket


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def boot_id() -> str | None:
    """This kernel's boot id (Linux), None where there is none."""
    return _read("/proc/sys/kernel/random/boot_id")


def pid_namespace() -> str | None:
    """This process's pid namespace, e.g. ``pid:[4026531836]`` (Linux), None where unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), None when it is not there or unknown."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None or ")" not in stat:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 (state) is fields[0]
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def this_process() -> dict:
    """The fields that name this process in a lease record."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": boot_id(), "pidns": pid_namespace(), "pid": pid,
            "start": start_ticks(pid)}


def same_pid_space(rec: dict) -> bool:
    """Whether ``rec``'s pid can be looked up here: same host name, boot and pid namespace
    (each known on both sides)."""
    boot, ns = boot_id(), pid_namespace()
    return (rec.get("host") == socket.gethostname() and boot is not None and rec.get("boot") == boot
            and ns is not None and rec.get("pidns") == ns)


def provably_gone(rec: dict) -> bool:
    """Whether the process ``rec`` names has certainly exited: its pid is in this pid space and
    is gone, or belongs to a process that started at another time (a reused pid)."""
    pid = rec.get("pid")
    if not isinstance(pid, int) or not same_pid_space(rec):
        return False
    if not pid_alive(pid):
        return True
    started = rec.get("start")
    now = start_ticks(pid)
    return isinstance(started, int) and now is not None and now != started

"""A receiving process for the KV transfer benches: the sender times until the child says
it has copied the last layer (`ReceiverProcess`, `run_to_child`). Shared by the shm and the
DLSlime benches."""
from __future__ import annotations

import multiprocessing as mp
import time


class ReceiverProcess:
    """A receiving process running ``target(conn, verify)``: ``expect(handle)`` before the
    sender starts, ``wait()`` -> what the child sent back (for shm: the monotonic time the
    last layer was copied, seconds in its receive loop); a child may answer
    ``("error", message)``."""

    def __init__(self, target, verify: bool, what: str = "shm"):
        self.what = what
        ctx = mp.get_context("spawn")  # fork after torch/OpenMP or Ray threads started can deadlock
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, verify), daemon=True)
        self.proc.start()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            self.close()
            raise TimeoutError(f"{what} bench receiver process did not start within 120s")

    def expect(self, handle) -> None:
        self.conn.send(handle)

    def wait(self, timeout: float = 300.0):
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"{self.what} bench receiver process died (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.what} bench receiver did not finish within {timeout:g}s")
        msg = self.conn.recv()
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            raise RuntimeError(f"{self.what} bench receiver failed: {msg[1]}")
        return msg

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def run_to_child(tr, rx: ReceiverProcess, meta, layers, repeats: int, verify: bool, after=None):
    """``repeats`` transfers of ``layers`` through transport ``tr`` to the receiving process
    ``rx``: times (sender open .. receiver's last layer copied) and per-phase parts.
    ``after(sender)`` runs once the receiver is done (outside the timed span)."""
    times, parts = [], []
    try:
        for _ in range(repeats):
            t0 = time.monotonic()
            sender = tr.open_sender(meta, verify=verify)
            rx.expect(sender.handle)
            for i, a in enumerate(layers):
                sender.send_layer(i, a)
            sender.close()
            send_s = time.monotonic() - t0
            done, rx_parts = rx.wait()
            times.append(done - t0)
            if not isinstance(rx_parts, dict):
                rx_parts = {"receive_copy_verify_s": rx_parts}
            part = {"send_s": send_s, **rx_parts}
            if after is not None:
                t1 = time.monotonic()
                after(sender)
                part["after_s"] = time.monotonic() - t1
            parts.append(part)
    finally:
        rx.close()
    return times, parts

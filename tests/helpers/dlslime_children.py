"""Child-process bodies for tests/test_transfer_dlslime.py (spawned: numpy + dlbatch.transfer only,
no torch, so a child starts in about a second)."""

from __future__ import annotations

import time

import numpy as np


def receiver(conn, verify=True):
    """Receive one transfer into a destination, reporting each layer as it lands."""
    from dlbatch.transfer.dlslime_transport import DLSlimeTransport

    tr = DLSlimeTransport()
    conn.send("ready")
    handle = conn.recv()
    m = handle.meta
    dest = np.zeros((m.num_layers, *m.layer_shape), dtype=m.storage_dtype)
    rx = tr.open_receiver(handle, verify=verify)
    try:
        for i, arr in rx.receive_layers(timeout=20, out=dest.__getitem__):
            assert arr is dest[i] or np.shares_memory(arr, dest)
            conn.send(("got", i, time.monotonic()))
    except Exception as e:  # report, do not hang the parent
        conn.send(("error", type(e).__name__, str(e)))
        return
    finally:
        rx.release()
    conn.send(("done", dest.tobytes()))


def sender(conn, meta, layers, stall_after):
    """Send ``layers``; stop (sleep) before layer ``stall_after``: a stuck or about-to-be-killed producer."""
    from dlbatch.transfer.dlslime_transport import DLSlimeTransport

    s = DLSlimeTransport().open_sender(meta)
    conn.send(s.handle)
    for i, a in enumerate(layers):
        if stall_after is not None and i >= stall_after:
            conn.send(("stalled", i))
            time.sleep(3600)
        s.send_layer(i, a)
    s.close()
    s.wait_received(timeout=20)  # a short-lived producer outlives its receiver's read
    conn.send("done")

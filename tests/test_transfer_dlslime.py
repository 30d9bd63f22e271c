"""The optional dlslime KV transport (TCP endpoint over loopback). Skips, naming the reason,
when dlslime cannot be imported here (not installed, libibverbs missing, ...)."""

from __future__ import annotations

import builtins
import multiprocessing as mp
import os
import pickle
import signal
import time

import numpy as np
import pytest
import torch

from dlbatch.transfer import payload as P
from dlbatch.transfer.choose import get_transport
from dlbatch.transfer.errors import CorruptPayload, SenderDied, TransferError, TransferTimeout, TransportUnavailable
from tests.helpers import dlslime_children as children
from tests.helpers.optional import dlslime_missing

FP = "llama:abc123"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_layers(dtype, n_layers=3, tokens=7, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, tokens, heads, dim, generator=g).to(dtype) for _ in range(n_layers)]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _threads_settle_at_most(n: int, timeout: float = 5.0) -> bool:
    """Other components of the test process (Ray, torch, thread pools of earlier tests) start
    and end threads of their own: wait a little for the count to come down to ``n``."""
    deadline = time.monotonic() + timeout
    while _threads() > n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def D():
    from dlbatch.transfer import dlslime_transport

    reason = dlslime_missing()
    if reason:
        pytest.skip(reason)
    yield dlslime_transport
    dlslime_transport.shutdown()  # the process's sender endpoint and pool: every test starts clean


@pytest.fixture
def tr(D):
    return get_transport("dlslime")


def _send(tr, p):
    sender = tr.open_sender(p.meta)
    for i, a in enumerate(p.layers):
        sender.send_layer(i, a)
    return sender, sender.close()


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return proc, parent


# ------------------------------------------------------------------ availability
def test_unavailable_reason_when_dlslime_cannot_be_imported(monkeypatch):
    from dlbatch.transfer import dlslime_transport

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "dlslime" or name.startswith("dlslime."):
            raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    reason = dlslime_transport.unavailable_reason()
    assert reason is not None and "libibverbs" in reason and "dlslime" in reason
    assert not dlslime_transport.is_available()
    with pytest.raises(TransportUnavailable, match="dlslime.*libibverbs"):
        get_transport("dlslime")


# ------------------------------------------------------------------ in-process
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_bit_exact(tr, D, dtype):
    p = P.from_torch_layers(make_layers(dtype), FP)
    before = D.pool_stats()
    handle = tr.send(p)
    q = tr.receive(handle, timeout=10, expected_fingerprint=FP)
    assert q.meta.dtype == P.dtype_name(dtype)
    assert [a.tobytes() for a in p.layers] == [b.tobytes() for b in q.layers]
    for i in range(3):
        assert torch.equal(P.layer_to_torch(q, i), P.layer_to_torch(p, i))
    # the receiver acknowledged: the buffer is back in the pool and the next transfer reuses it
    h2 = tr.send(p)
    assert h2.addr == handle.addr and h2.generation != handle.generation
    stats = D.pool_stats()
    assert stats["reused"] - before["reused"] == 1 and stats["created"] - before["created"] == 1
    tr.receive(h2, timeout=10)


def test_handle_pickles_and_is_small(tr):
    p = P.from_torch_layers(make_layers(torch.bfloat16), FP)
    sender, handle = _send(tr, p)
    blob = pickle.dumps(handle)
    assert len(blob) < 2048
    h2 = pickle.loads(blob)
    assert h2 == handle and h2.host == "127.0.0.1" and h2.port > 0
    q = tr.receive(h2, timeout=10)
    assert [a.tobytes() for a in p.layers] == [b.tobytes() for b in q.layers]
    sender.wait_received(timeout=5)


@pytest.mark.parametrize("algo", P.CHECKSUM_ALGOS)
def test_receive_into_destination_verifies(tr, algo):
    p = P.from_torch_layers(make_layers(torch.bfloat16, tokens=301), FP, checksum_algo=algo)
    dest = np.zeros((3, *p.meta.layer_shape), dtype=np.uint16)
    sender, handle = _send(tr, p)
    rx = tr.open_receiver(handle)
    got = []
    for i, arr in rx.receive_layers(timeout=10, out=dest.__getitem__):
        assert np.shares_memory(arr, dest[i])  # read straight into the destination
        got.append(i)
    rx.release()
    assert got == [0, 1, 2] and all(np.array_equal(dest[i], p.layers[i]) for i in range(3))
    sender.wait_received(timeout=5)
    # bit rot in the sender's buffer after the checksum was recorded
    sender = tr.open_sender(p.meta)
    for i, a in enumerate(p.layers):
        sender.send_layer(i, a)
    sender._mem[P.buffer_layout(sender.meta).layer_offsets[2] + 1] ^= 0x10
    rx = tr.open_receiver(sender.close())
    with pytest.raises(CorruptPayload, match="layer 2 is corrupt"):
        for _ in rx.receive_layers(timeout=10, out=dest.__getitem__):
            pass
    with pytest.raises(TransferError, match="gave up"):  # the receiver told the sender
        sender.wait_received(timeout=5)


def test_receive_into_one_reused_scratch_buffer_and_early_ack(tr, D):
    """An ``out`` that hands back the same memory for every layer: layer i+1 is not read into it
    while layer i is still being consumed. After the last layer the sender is acknowledged and
    the receiver's endpoint is gone before ``release``."""
    p = P.from_torch_layers(make_layers(torch.float32, n_layers=4, tokens=50), FP)
    scratch = np.zeros(p.meta.layer_shape, dtype=np.float32)
    sender, handle = _send(tr, p)
    base = _threads()
    rx = tr.open_receiver(handle)
    got = []
    for i, arr in rx.receive_layers(timeout=10, out=lambda i: scratch):
        assert np.shares_memory(arr, scratch)
        got.append(arr.copy())
    assert [a.tobytes() for a in p.layers] == [b.tobytes() for b in got]
    assert _threads_settle_at_most(base)  # the receiver's endpoint was shut down after the last layer
    sender.wait_received(timeout=0.5)  # already acknowledged
    rx.release()


def test_corrupt_layer_detected_and_named(tr):
    p = P.from_torch_layers(make_layers(torch.float32), FP)
    sender = tr.open_sender(p.meta)
    for i, a in enumerate(p.layers):
        sender.send_layer(i, a)
    sender._mem[P.buffer_layout(sender.meta).layer_offsets[1] + 3] ^= 0xFF
    with pytest.raises(CorruptPayload, match="layer 1 is corrupt"):
        tr.receive(sender.close(), timeout=10)
    # verify=False skips the checksums on both sides
    p2 = P.from_torch_layers(make_layers(torch.float32, seed=1), FP)
    s2 = tr.open_sender(p2.meta, verify=False)
    for i, a in enumerate(p2.layers):
        s2.send_layer(i, a)
    q = tr.receive(s2.close(), timeout=10, verify=False)
    assert [a.tobytes() for a in p2.layers] == [b.tobytes() for b in q.layers]


def test_receive_timeout_is_clear_and_fast(tr, D):
    p = P.from_torch_layers(make_layers(torch.float32), FP)
    sender = tr.open_sender(p.meta)
    base = _threads()  # with the sender's endpoint
    sender.send_layer(0, p.layers[0])  # layer 1 never comes
    rx = tr.open_receiver(sender.handle)
    it = rx.receive_layers(timeout=0.5)
    assert next(it)[0] == 0  # streaming: layer 0 before the sender wrote the rest
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout) as ei:
        next(it)
    assert time.monotonic() - t0 < 3
    msg = str(ei.value)
    assert "0.5s" in msg and "layer 1 not ready" in msg and f"127.0.0.1:{sender.handle.port}" in msg
    assert _threads_settle_at_most(base)  # the receiver's endpoint (and its I/O thread) is gone
    sender.abort()
    assert D.pool_stats()["outstanding"] == 0


def test_stale_and_aborted_handles_are_refused(tr, D):
    p = P.from_torch_layers(make_layers(torch.float16), FP)
    h1 = tr.send(p)
    tr.receive(h1, timeout=10)
    h2 = tr.send(p)  # same buffer, new generation
    assert h2.addr == h1.addr
    with pytest.raises(TransferError, match="already received"):
        tr.receive(h1, timeout=10)  # a stale handle never reads the next payload
    q = tr.receive(h2, timeout=10)
    assert [a.tobytes() for a in p.layers] == [b.tobytes() for b in q.layers]
    sender = tr.open_sender(p.meta)
    sender.send_layer(0, p.layers[0])
    rx = tr.open_receiver(sender.handle)
    it = rx.receive_layers(timeout=10)
    assert next(it)[0] == 0
    sender.abort()
    with pytest.raises(TransferError, match="aborted"):
        next(it)


def test_sender_lends_its_buffer_and_pool_stays_bounded(tr, D, monkeypatch):
    base = _threads()
    before = D.pool_stats()
    p = P.from_torch_layers(make_layers(torch.bfloat16), FP)
    for _ in range(5):
        sender = tr.open_sender(p.meta)
        for i, a in enumerate(p.layers):
            sender.layer_buffer(i)[...] = a  # the producer writes in place: no copy on send
            sender.send_layer(i, sender.layer_buffer(i))
        q = tr.receive(sender.close(), timeout=10)
        assert [a.tobytes() for a in p.layers] == [b.tobytes() for b in q.layers]
        sender.wait_received(timeout=5)
    stats = D.pool_stats()
    assert stats["created"] - before["created"] == 1 and stats["reused"] - before["reused"] == 4
    assert stats["outstanding"] == 0
    assert _threads_settle_at_most(base + 1)  # only the sender endpoint's I/O thread, however many transfers
    # a receiver that never answers: its buffer comes back after the lease, not never
    monkeypatch.setattr(D, "LEASE_S", 0.0)
    _, h = _send(tr, p)
    rx = tr.open_receiver(h)  # opened, never read
    _, h2 = _send(tr, p)  # reclaims the unacknowledged buffer
    monkeypatch.setattr(D, "LEASE_S", 600.0)
    assert D.pool_stats()["lease"] - before["lease"] == 1 and h2.addr == h.addr
    with pytest.raises(TransferError, match="reused"):
        rx.receive(timeout=5)
    tr.receive(h2, timeout=10)
    D.shutdown()
    assert _threads_settle_at_most(base)


def test_sender_endpoint_shut_down_is_sender_died(tr, D):
    p = P.from_torch_layers(make_layers(torch.float32), FP)
    sender = tr.open_sender(p.meta)
    sender.send_layer(0, p.layers[0])
    rx = tr.open_receiver(sender.handle)
    it = rx.receive_layers(timeout=20)
    assert next(it)[0] == 0
    D.shutdown()
    t0 = time.monotonic()
    with pytest.raises(SenderDied, match="is gone.*after 1 of 3 layers"):
        next(it)
    assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------ across processes
def test_cross_process_streaming_into_destination(tr):
    p = P.from_torch_layers(make_layers(torch.bfloat16, n_layers=4, tokens=64), FP)
    proc, conn = _spawn(children.receiver)
    try:
        assert conn.poll(30) and conn.recv() == "ready"
        sender = tr.open_sender(p.meta)
        conn.send(sender.handle)
        sender.send_layer(0, p.layers[0])
        assert conn.poll(10), "receiver did not take layer 0"
        msg = conn.recv()
        assert msg[:2] == ("got", 0), msg  # the receiver has layer 0 while layers 1-3 are unwritten
        for i in range(1, 4):
            time.sleep(0.05)
            sender.send_layer(i, p.layers[i])
        sender.close()
        msgs = [conn.recv() for _ in range(4) if conn.poll(10)]
        assert [m[:2] for m in msgs[:3]] == [("got", 1), ("got", 2), ("got", 3)], msgs
        assert msgs[3][0] == "done"
        assert msgs[3][1] == b"".join(a.tobytes() for a in p.layers)  # bit-exact, verified on the way
        sender.wait_received(timeout=10)  # the child's release acknowledged it
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_sender_process_killed_mid_transfer(tr):
    p = P.from_torch_layers(make_layers(torch.float16, n_layers=5), FP)
    proc, conn = _spawn(children.sender, p.meta.without_checksums(), p.layers, 2)
    try:
        assert conn.poll(30), "sender child did not send its handle"
        handle = conn.recv()
        rx = tr.open_receiver(handle)
        it = rx.receive_layers(timeout=30)
        assert next(it)[0] == 0 and next(it)[0] == 1
        assert conn.poll(10) and conn.recv() == ("stalled", 2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(SenderDied, match=rf"pid {proc.pid} .*is gone.*after 2 of 5 layers.*no longer exists"):
            next(it)
        assert time.monotonic() - t0 < 5  # noticed at once, not after the 30 s timeout
        with pytest.raises(SenderDied, match="is gone"):
            tr.open_receiver(handle)  # connection refused
    finally:
        if proc.is_alive():
            proc.kill()

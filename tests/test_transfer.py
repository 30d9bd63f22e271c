"""KV payload format, shared-memory transport, get_transport (no Ray)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch

from dlbatch.transfer import payload as P
from dlbatch.transfer import shm as S
from dlbatch.transfer.choose import get_transport
from dlbatch.transfer.errors import (
    CorruptPayload,
    FingerprintMismatch,
    LayoutMismatch,
    SenderDied,
    TransferTimeout,
    TransportUnavailable,
    TruncatedPayload,
)

FP = "llama:abc123"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_layers(dtype, n_layers=3, tokens=7, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, tokens, heads, dim, generator=g).to(dtype) for _ in range(n_layers)]


@pytest.fixture(autouse=True)
def no_shm_leaks():
    before = set(S.list_segments())
    yield
    S.drain_pool()  # idle pooled segments are this process's, not leaks
    leaked = set(S.list_segments()) - before
    for name in leaked:
        os.unlink(os.path.join(S.SHM_DIR, name))
    assert not leaked, f"test leaked shared-memory segments {sorted(leaked)}"


# ------------------------------------------------------------------ payload
@pytest.mark.parametrize("dtype", DTYPES)
def test_from_torch_zero_copy_and_back(dtype):
    layers = make_layers(dtype)
    p = P.from_torch_layers(layers, FP)
    assert p.meta.dtype == P.dtype_name(dtype)
    assert p.meta.layer_shape == (2, 7, 2, 8)
    assert p.meta.checksums is not None and len(p.meta.checksums) == 3
    # zero-copy: the array shares the tensor's memory
    assert p.layers[0].ctypes.data == layers[0].data_ptr()
    for i, t in enumerate(layers):
        back = P.layer_to_torch(p, i)
        assert back.dtype == dtype
        assert torch.equal(back, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_buffer_round_trip_bit_exact(dtype):
    layers = make_layers(dtype)
    p = P.from_torch_layers(layers, FP)
    buf = P.to_buffer(p)
    q = P.from_buffer(bytes(buf), expected_fingerprint=FP)
    assert q.meta == p.meta
    for a, b in zip(p.layers, q.layers):
        assert a.tobytes() == b.tobytes()
        assert not b.flags.writeable  # zero-copy view of an immutable buffer
    for i, off in enumerate(P.buffer_layout(p.meta).layer_offsets):
        assert off % 64 == 0, f"layer {i} is not 64-byte aligned"


def test_dtype_conversion():
    x = torch.randn(2, 5, 2, 4)
    p16 = P.from_torch_layers([x.to(torch.bfloat16)], FP)
    up = P.layer_to_torch(p16, 0, dtype=torch.float32)
    assert up.dtype == torch.float32
    assert torch.equal(up, x.to(torch.bfloat16).float())  # bf16 -> fp32 is exact
    p32 = P.from_torch_layers([x], FP)
    down = P.layer_to_torch(p32, 0, dtype="bfloat16")
    assert down.dtype == torch.bfloat16
    assert torch.equal(down, x.to(torch.bfloat16))
    rel = ((down.float() - x).abs() / x.abs().clamp_min(1e-30)).max().item()
    assert rel <= 2**-8, rel  # round-to-nearest: half an ulp of an 8-bit mantissa
    assert P.layer_to_torch(p32, 0, dtype=torch.float16).dtype == torch.float16


def test_corrupt_byte_names_layer():
    p = P.from_torch_layers(make_layers(torch.float16), FP)
    buf = P.to_buffer(p)
    lay = P.buffer_layout(p.meta)
    buf[lay.layer_offsets[2] + 5] ^= 0x40
    with pytest.raises(CorruptPayload, match="layer 2") as ei:
        P.from_buffer(buf)
    assert ei.value.layer == 2
    P.from_buffer(buf, verify=False)  # opt-out skips the check


@pytest.mark.parametrize("algo", P.CHECKSUM_ALGOS)
def test_checksum_detects_single_byte_changes(algo):
    a = np.random.default_rng(0).integers(0, 255, size=1003, dtype=np.uint8)
    base = P.checksum(a, algo)
    for pos in (0, 7, 8, 500, 1002):
        b = a.copy()
        b[pos] ^= 1
        assert P.checksum(b, algo) != base, (algo, pos)
    assert P.checksum(a[:-1], algo) != base


def test_truncated_buffer():
    p = P.from_torch_layers(make_layers(torch.float32), FP)
    buf = bytes(P.to_buffer(p))
    with pytest.raises(TruncatedPayload, match="1 of 3 layers are complete"):
        P.from_buffer(buf[: P.buffer_layout(p.meta).layer_offsets[1] + 10])
    with pytest.raises(TruncatedPayload, match="header"):
        P.from_buffer(buf[:10])
    with pytest.raises(TruncatedPayload, match="2 of 3 layers"):
        P.validate(P.KVPayload(p.meta, p.layers[:2]))
    # a layer never marked ready
    raw = bytearray(buf)
    lay = P.buffer_layout(p.meta)
    raw[lay.table_offset + 1 * P.ENTRY_SIZE + 8] = 0
    with pytest.raises(TruncatedPayload, match="layer 1 of 3 was never written"):
        P.from_buffer(raw)


def test_fingerprint_mismatch_names_both():
    p = P.from_torch_layers(make_layers(torch.float32), "qwen2:deadbeef")
    with pytest.raises(FingerprintMismatch) as ei:
        P.validate(p, expected_fingerprint=FP)
    assert "qwen2:deadbeef" in str(ei.value) and FP in str(ei.value)
    with pytest.raises(FingerprintMismatch):
        P.from_buffer(P.to_buffer(p), expected_fingerprint=FP)


def test_layout_checks():
    p = P.from_torch_layers(make_layers(torch.float32), FP)
    with pytest.raises(LayoutMismatch, match=r"\(2, 8, 3\).*\(4, 8, 3\)"):
        P.validate(p, expected_shape=(4, 8, 3))
    bad = P.KVPayload(p.meta, [p.layers[0], p.layers[1][:, :3], p.layers[2]])
    with pytest.raises(LayoutMismatch, match="layer 1 has shape"):
        P.validate(bad)
    with pytest.raises(LayoutMismatch, match="dtype"):
        P.from_torch_layers([make_layers(torch.float32)[0], make_layers(torch.float16)[0]], FP)
    with pytest.raises(ValueError, match="'int8'"):
        P.make_meta(FP, "int8", 1, 1, 1, 1)
    with pytest.raises(ValueError, match="num_tokens.*0"):
        P.make_meta(FP, "float32", 1, 0, 1, 1)
    with pytest.raises(ValueError, match="fingerprint"):
        P.make_meta("", "float32", 1, 1, 1, 1)
    buf = P.to_buffer(p)
    buf[0:4] = b"XXXX"
    with pytest.raises(LayoutMismatch, match="magic"):
        P.from_buffer(buf)


# ------------------------------------------------------------------ shm
def _shm_child(conn, meta, layers, stall_after, delay):
    tr = S.ShmTransport()
    sender = tr.open_sender(meta)
    conn.send(sender.handle)
    for i, a in enumerate(layers):
        if stall_after is not None and i >= stall_after:
            time.sleep(3600)  # a stuck (or about to be killed) producer
        time.sleep(delay)
        sender.send_layer(i, a)
    sender.close()
    conn.send("done")


def _start_child(meta, layers, stall_after=None, delay=0.0):
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_shm_child, args=(child, meta, layers, stall_after, delay), daemon=True)
    proc.start()
    assert parent.poll(20), "shm sender child did not send its handle"
    return proc, parent, parent.recv()


@pytest.mark.parametrize("dtype", DTYPES)
def test_shm_cross_process_streaming(dtype):
    p = P.from_torch_layers(make_layers(dtype, n_layers=4), FP)
    proc, conn, handle = _start_child(p.meta.without_checksums(), p.layers, delay=0.05)
    assert handle.name.startswith(S.PREFIX) and str(proc.pid) in handle.name
    rx = S.ShmTransport().open_receiver(handle)
    got, t_first = [], None
    t0 = time.monotonic()
    for i, view in rx.receive_layers(timeout=20):
        t_first = t_first if t_first is not None else time.monotonic() - t0
        got.append(view.copy())
    rx.release()
    total = time.monotonic() - t0
    assert t_first < total  # layer 0 consumed before the last layer was written
    for a, b in zip(p.layers, got):
        assert a.tobytes() == b.tobytes()
    assert conn.poll(20) and conn.recv() == "done"
    proc.join(10)
    assert handle.name not in S.list_segments()


def test_shm_one_shot_send_receive():
    p = P.from_torch_layers(make_layers(torch.bfloat16), FP)
    tr = get_transport("shm", same_node=True, device="cpu")
    handle = tr.send(p)
    q = tr.receive(handle, timeout=5, expected_fingerprint=FP)
    assert [a.tobytes() for a in p.layers] == [b.tobytes() for b in q.layers]
    assert torch.equal(P.layer_to_torch(q, 1), P.layer_to_torch(p, 1))
    # the received segment went back to this process's pool, not unlinked
    assert handle.name in S.list_segments()
    assert S.drain_pool() == [handle.name]
    assert handle.name not in S.list_segments()


def test_shm_pool_reuses_segment_and_rejects_stale_handle():
    p = P.from_torch_layers(make_layers(torch.float32), FP)
    tr = S.ShmTransport()
    S.drain_pool()
    base = S.pool_stats()["outstanding"]  # segments an earlier test of this process left in flight
    h1 = tr.send(p)
    assert S.pool_stats()["outstanding"] == base + 1
    tr.receive(h1, timeout=5)  # sets the done flag
    before = S.pool_stats()
    assert before["idle"] == 1 and before["outstanding"] == base
    h2 = tr.send(p)  # same size class: same (already faulted) segment, new generation
    assert h2.name == h1.name and h2.generation != h1.generation
    assert S.pool_stats()["reused"] == before["reused"] + 1
    with pytest.raises(Exception, match="reused"):
        tr.open_receiver(h1)  # a stale handle never reads the next payload
    q = tr.receive(h2, timeout=5)
    assert [a.tobytes() for a in p.layers] == [b.tobytes() for b in q.layers]
    # a different size class gets its own segment; a non-pooled sender is unlinked on release
    big = P.from_torch_layers(make_layers(torch.float32, tokens=50000), FP)
    h3 = tr.send(big)
    assert h3.name != h1.name and S.size_class(h3.size + 64) > S.size_class(h1.size + 64)
    tr.receive(h3, timeout=5)
    sender = tr.open_sender(p.meta, pooled=False)
    for i, a in enumerate(p.layers):
        sender.send_layer(i, a)
    h4 = sender.close()
    tr.receive(h4, timeout=5)
    assert h4.name not in S.list_segments()
    assert sorted(S.drain_pool()) == sorted([h1.name, h3.name])
    S.prewarm(p.meta)  # a pre-faulted idle segment: the next sender of that shape takes it
    stats = S.pool_stats()
    assert stats["idle"] == 1
    h5 = tr.send(p)
    assert S.pool_stats()["reused"] == stats["reused"] + 1
    tr.receive(h5, timeout=5)
    assert S.size_class(1) == 1 << 20 and S.size_class((256 << 20) + 1) == 320 << 20


def test_shm_sender_exits_before_receiver():
    # ownership passes to the receiver at close: the sender's exit must not unlink an unreceived segment
    p = P.from_torch_layers(make_layers(torch.float32), FP)
    proc, conn, handle = _start_child(p.meta.without_checksums(), p.layers)
    assert conn.poll(20) and conn.recv() == "done"
    proc.join(10)
    assert proc.exitcode == 0 and handle.name in S.list_segments()
    q = S.ShmTransport().receive(handle, timeout=5)
    assert [a.tobytes() for a in p.layers] == [b.tobytes() for b in q.layers]
    assert handle.name not in S.list_segments()


def test_shm_receive_timeout_is_clear_and_cleans_up():
    p = P.from_torch_layers(make_layers(torch.float32), FP)
    proc, _, handle = _start_child(p.meta.without_checksums(), p.layers, stall_after=1)
    rx = S.ShmTransport().open_receiver(handle)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout) as ei:
        for _ in rx.receive_layers(timeout=0.5):
            pass
    assert time.monotonic() - t0 < 5
    msg = str(ei.value)
    assert "0.5s" in msg and handle.name in msg and "layer 1 not ready" in msg
    assert handle.name not in S.list_segments()
    proc.kill()
    proc.join(10)


def test_shm_sender_killed_mid_transfer():
    p = P.from_torch_layers(make_layers(torch.float16, n_layers=5), FP)
    proc, _, handle = _start_child(p.meta.without_checksums(), p.layers, stall_after=2)
    rx = S.ShmTransport().open_receiver(handle)
    it = rx.receive_layers(timeout=20)
    assert next(it)[0] == 0 and next(it)[0] == 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    t0 = time.monotonic()
    with pytest.raises(SenderDied, match=rf"{proc.pid} died after writing 2 of 5 layers"):
        next(it)
    assert time.monotonic() - t0 < 5  # noticed the death, did not wait for the timeout
    assert handle.name not in S.list_segments()


def test_shm_corrupt_layer_detected():
    p = P.from_torch_layers(make_layers(torch.float32), FP)
    tr = S.ShmTransport()
    sender = tr.open_sender(p.meta)
    for i, a in enumerate(p.layers):
        sender.send_layer(i, a)
    off = P.buffer_layout(sender.meta).layer_offsets[1]
    sender._shm.buf[off + 3] ^= 0xFF  # bit rot after the checksum was recorded
    handle = sender.close()
    with pytest.raises(CorruptPayload, match="layer 1"):
        tr.receive(handle, timeout=5)
    assert handle.name not in S.list_segments()


@pytest.mark.parametrize("algo", P.CHECKSUM_ALGOS)
def test_shm_receive_into_destination_verifies(algo):
    p = P.from_torch_layers(make_layers(torch.bfloat16, tokens=301), FP, checksum_algo=algo)
    tr = S.ShmTransport()
    dest = np.zeros((3, *p.meta.layer_shape), dtype=np.uint16)
    handle = tr.send(p)
    rx = tr.open_receiver(handle)
    got = [i for i, arr in rx.receive_layers(timeout=5, out=dest.__getitem__) if arr is not None]
    rx.release()
    assert got == [0, 1, 2] and all(np.array_equal(dest[i], p.layers[i]) for i in range(3))
    sender = tr.open_sender(p.meta)  # reuses the segment
    for i, a in enumerate(p.layers):
        sender.send_layer(i, a)
    sender._shm.buf[P.buffer_layout(sender.meta).layer_offsets[2] + 1] ^= 0x10
    rx = tr.open_receiver(sender.close())
    with pytest.raises(CorruptPayload, match="layer 2"):
        for _ in rx.receive_layers(timeout=5, out=dest.__getitem__):
            pass


def test_copy_checksum_matches_checksum():
    rng = np.random.default_rng(1)
    for n in (1, 7, 8, 1003, (1 << 20) + 13):
        a = rng.integers(0, 256, size=n, dtype=np.uint8)
        a[:8] = 255  # words near 2**64: the sum must wrap
        d = np.empty_like(a)
        for algo in P.CHECKSUM_ALGOS:
            assert P.copy_checksum(d, a, algo) == P.checksum(a, algo) and np.array_equal(d, a)
        assert P.copy_checksum(d, a, None) is None


def test_native_copy_matches_numpy_fallback(monkeypatch):
    from dlbatch.transfer import fastcopy

    if not fastcopy.available():
        pytest.skip(f"native copy unavailable: {fastcopy.unavailable_reason()}")
    rng = np.random.default_rng(2)
    for n in ((64 << 10) + 5, (1 << 20) + 13, 3 << 20):
        a = rng.integers(0, 256, size=n + 3, dtype=np.uint8)[3:]  # unaligned source
        a[:16] = 255
        d_native, d_numpy = np.empty(n + 5, np.uint8)[5:], np.empty(n, np.uint8)  # unaligned destination
        got = P.copy_checksum(d_native, a)
        with monkeypatch.context() as m:
            m.setattr(fastcopy, "available", lambda: False)
            want = P.copy_checksum(d_numpy, a)
            assert P.checksum(a) == want
        assert got == want == P.checksum(a) and np.array_equal(d_native, a) and np.array_equal(d_numpy, a)
        assert P.copy_checksum(d_native, a, None) is None
    with pytest.raises(ValueError, match="C-contiguous"):
        P.copy_checksum(np.empty((4, 2), np.uint8)[:, 0], np.zeros(4, np.uint8))


def test_shm_receiver_keeps_mapping_of_pooled_segment():
    p = P.from_torch_layers(make_layers(torch.float32, n_layers=2, tokens=64), FP)
    tr = S.ShmTransport()
    seen = []
    for _ in range(3):
        handle = tr.send(p)
        rx = tr.open_receiver(handle)
        q = rx.receive(timeout=5)
        seen.append((handle.name, id(rx._shm) if rx._shm is not None else None))
        assert [a.tobytes() for a in q.layers] == [a.tobytes() for a in p.layers]
    assert len({name for name, _ in seen}) == 1  # the pool reused the segment
    assert handle.name in S._MAPS.entries  # and the receiver kept it mapped
    S.drain_pool()
    p2 = P.from_torch_layers(make_layers(torch.float32, n_layers=1, tokens=8), FP)
    tr.receive(tr.send(p2), timeout=5)  # the next open sweeps the unlinked segment's mapping
    assert handle.name not in S._MAPS.entries
    S.drop_receiver_mappings()


def test_shm_bad_layer_and_abort():
    p = P.from_torch_layers(make_layers(torch.float32), FP)
    tr = S.ShmTransport()
    sender = tr.open_sender(p.meta)
    with pytest.raises(LayoutMismatch, match="layer 0 has numpy dtype float16"):
        sender.send_layer(0, p.layers[0].astype(np.float16))
    with pytest.raises(LayoutMismatch, match="layer index 7"):
        sender.send_layer(7, p.layers[0])
    sender.abort()
    assert sender.handle.name not in S.list_segments()
    with pytest.raises(Exception, match="does not exist"):
        tr.open_receiver(sender.handle)


def test_sweep_stale_segments():
    p = P.from_torch_layers(make_layers(torch.float32), FP)
    proc, _, handle = _start_child(p.meta.without_checksums(), p.layers, stall_after=0)
    proc.kill()
    proc.join(10)
    assert handle.name in S.list_segments()
    assert handle.name in S.sweep_stale_segments()
    assert handle.name not in S.list_segments()


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_sweep_leaves_another_users_segment_and_does_not_fail(tmp_path):
    """A file planted under another owner (any local user can) is neither removed nor fatal."""
    path = os.path.join(S.SHM_DIR, f"{S.PREFIX}{_dead_pid()}_planted")
    with open(path, "wb") as f:
        f.write(b"x")
    try:
        if os.getuid() == 0:
            os.chown(path, 4242, -1)
        if os.stat(path).st_uid == os.getuid():
            pytest.skip("needs root to give a file another owner")
        assert os.path.basename(path) not in S.sweep_stale_segments()
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_sweep_skips_a_segment_it_cannot_remove(monkeypatch):
    name = f"{S.PREFIX}{_dead_pid()}_locked"
    path = os.path.join(S.SHM_DIR, name)
    open(path, "wb").close()
    real_unlink = os.unlink

    def refuse(p, *a, **k):
        if p == path:
            raise PermissionError(1, "Operation not permitted", p)
        return real_unlink(p, *a, **k)

    try:
        monkeypatch.setattr(os, "unlink", refuse)
        assert name not in S.sweep_stale_segments()  # logged and left, not raised
    finally:
        monkeypatch.undo()
        real_unlink(path)


# ------------------------------------------------------------------ get_transport
def test_get_transport_choices():
    with pytest.raises(ValueError, match="'carrier_pigeon'"):
        get_transport("carrier_pigeon")
    with pytest.raises(TransportUnavailable, match="same node"):
        get_transport("shm", same_node=False)
    assert get_transport("auto", same_node=True, device="cpu", ray_handles=False).name == "shm"
    assert get_transport("auto", same_node=True, device="cpu").name == "object_store"
    assert get_transport("auto", same_node=False, device="cpu").name == "object_store"
    if not torch.cuda.is_available():
        assert get_transport("auto", device="cuda:0").name == "object_store"
        with pytest.raises(TransportUnavailable, match="CUDA"):
            get_transport("rdt", device="cuda:0")
    with pytest.raises(TransportUnavailable, match="device 'tpu'"):
        get_transport("rdt", device="tpu")
    from dlbatch.transfer import dlslime_transport

    if not dlslime_transport.is_available():
        with pytest.raises(TransportUnavailable, match="dlslime"):
            get_transport("dlslime")


def test_errors_pickle():
    import pickle

    for e in (FingerprintMismatch("a:1", "b:2"), CorruptPayload(3, 1, 2, "sum64"), TruncatedPayload("x")):
        e2 = pickle.loads(pickle.dumps(e))
        assert type(e2) is type(e) and str(e2) == str(e)

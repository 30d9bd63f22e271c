"""KV transfer bandwidth of the optional ``dlslime`` transport (TCP endpoint), measured the way
``bench._run_shm`` measures shm: the receiver is a spawned child process that reads every
layer into a destination tensor (the "paged cache") with the checksum verified; each time
spans from the sender opening the transfer until the receiver has the last layer copied.

``run_dlslime(meta, layers, repeats, verify) -> (times, parts)`` is what ``bench_kv`` calls;
``python -m dlbatch.bench.kv_dlslime --size-mb 256`` runs it alone and prints it next
to ``numpy.copyto`` of the same size measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

MB = 1 << 20


def _child(conn, verify: bool) -> None:
    from dlbatch.transfer import fastcopy
    from dlbatch.transfer.dlslime_transport import DLSlimeTransport

    fastcopy.available()  # build/load the native checksum before timing starts
    tr = DLSlimeTransport()
    dest = None
    conn.send("ready")  # imports done
    while True:
        handle = conn.recv()
        if handle is None:
            return
        try:
            m = handle.meta
            if dest is None or dest.shape != (m.num_layers, *m.layer_shape) or dest.dtype != m.storage_dtype:
                dest = np.empty((m.num_layers, *m.layer_shape), dtype=m.storage_dtype)  # the "paged cache"
            t0 = time.perf_counter()
            rx = tr.open_receiver(handle, verify=verify)
            t1 = time.perf_counter()
            try:
                # each layer read straight into dest[i] over TCP, then its checksum verified
                for _ in rx.receive_layers(timeout=300, out=dest.__getitem__):
                    pass
                done = time.monotonic()
                t2 = time.perf_counter()
            finally:
                rx.release()  # the ack: the sender may reuse its buffer
            t3 = time.perf_counter()
            conn.send((done, {"open_s": t1 - t0, "receive_copy_verify_s": t2 - t1, "release_ack_s": t3 - t2}))
        except Exception as e:  # reported to the parent, which raises it
            conn.send(("error", f"{type(e).__name__}: {e}"))


def run_dlslime(meta, layers, repeats: int, verify: bool) -> tuple[list[float], list[dict]]:
    """``repeats`` transfers of ``layers`` (numpy arrays, ``meta.layer_shape``) to a spawned receiver.

    times[k]: seconds from ``open_sender`` to the receiver's last verified layer in its destination.
    parts[k]: ``send_s`` (open .. close on the sender, i.e. the copies into its buffer), the
    receiver's ``open_s``, ``receive_copy_verify_s`` (its loop, including waiting for the sender:
    pipelined) and ``release_ack_s``, and ``after_s`` (sender, after the timed span: until it
    saw the ack and the buffer was back in its pool for the next repeat). The first repeat pays
    first-touch page faults (fresh sender buffer, fresh destination).
    """
    from dlbatch.transfer import dlslime_transport

    reason = dlslime_transport.unavailable_reason()
    if reason:
        from dlbatch.transfer.errors import TransportUnavailable

        raise TransportUnavailable(f"the 'dlslime' KV transport is unavailable: {reason}")
    from dlbatch.bench.kv_child import ReceiverProcess, run_to_child

    # after each transfer: until the sender saw the ack and the buffer is back in its pool
    return run_to_child(dlslime_transport.DLSlimeTransport(), ReceiverProcess(_child, verify, "dlslime"), meta,
                        layers, repeats, verify, after=lambda sender: sender.wait_received(timeout=60))


# ---------------------------------------------------------------- standalone run
def _copyto_gbps(nbytes: int, repeats: int) -> float:
    a = np.random.default_rng(1).integers(0, 1 << 15, size=nbytes // 2, dtype=np.uint16)
    b = np.empty_like(a)
    np.copyto(b, a)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t0)
    return nbytes / statistics.median(ts) / 1e9


def _tcp_loopback_gbps(nbytes: int, repeats: int, chunks: int = 16) -> float:
    """Plain sockets, one loopback connection (a thread sends, this one ``recv_into``s): the
    ceiling of any TCP transport on this machine."""
    import socket
    import threading

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)

    def serve():
        c, _ = ls.accept()
        mv, step = memoryview(src), -(-nbytes // chunks)
        with c:
            while c.recv(1):
                for off in range(0, nbytes, step):
                    c.sendall(mv[off : off + step])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ts = []
    with socket.create_connection(ls.getsockname()) as cl:
        mv = memoryview(dst)
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            cl.send(b"x")
            got = 0
            while got < nbytes:
                got += cl.recv_into(mv[got:], nbytes - got)
            ts.append(time.perf_counter() - t0)
    t.join(10)
    ls.close()
    return nbytes / statistics.median(ts[1:]) / 1e9


def main(argv=None) -> dict:
    from dlbatch.transfer import fastcopy
    from dlbatch.transfer.payload import make_meta

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="warm repeats (one cold repeat is run first)")
    ap.add_argument("--no-verify", action="store_true")
    args = ap.parse_args(argv)
    heads, dim = 8, 128
    tokens = max(1, args.size_mb * MB // (args.layers * 2 * heads * dim * 2))
    rng = np.random.default_rng(0)
    layers = [rng.integers(0, 1 << 15, size=(2, tokens, heads, dim), dtype=np.uint16) for _ in range(args.layers)]
    meta = make_meta("bench:0", "bfloat16", args.layers, tokens, heads, dim)
    verify = not args.no_verify
    fastcopy.available()
    base = _copyto_gbps(meta.nbytes, max(3, args.repeats))
    times, parts = run_dlslime(meta, layers, args.repeats + 1, verify)
    base_after = _copyto_gbps(meta.nbytes, max(3, args.repeats))
    tcp = _tcp_loopback_gbps(meta.nbytes, max(3, args.repeats))
    warm = statistics.median(times[1:])
    gbps = meta.nbytes / warm / 1e9
    breakdown = {k: statistics.median(p[k] for p in parts[1:]) for k in parts[0]}
    print(f"dlslime TCP (loopback) KV transfer, {meta.nbytes / MB:.0f} MiB bf16 in {args.layers} layers "
          f"({tokens} tokens x {heads} KV heads x {dim}), checksums {'on' if verify else 'off'}, "
          f"native copy {'on' if fastcopy.available() else 'off'}")
    print(f"  numpy.copyto same size:   {base:6.2f} GB/s before, {base_after:6.2f} GB/s after")
    print(f"  plain TCP loopback (sockets, one connection, no checksum): {tcp:6.2f} GB/s (the TCP ceiling)")
    print(f"  dlslime warm (median of {args.repeats}): {gbps:6.2f} GB/s = {gbps / base:.2f}x copyto, "
          f"{gbps / tcp:.2f}x plain TCP; "
          f"cold {meta.nbytes / times[0] / 1e9:.2f} GB/s; times {[round(t, 3) for t in times]}")
    print("  warm breakdown (s): " + " ".join(f"{k}={v:.3f}" for k, v in breakdown.items()))
    return {"gbps": gbps, "copyto_gbps": [base, base_after], "tcp_loopback_gbps": tcp, "times_s": times,
            "parts": parts}


if __name__ == "__main__":
    main()

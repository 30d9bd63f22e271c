"""``dlbatch bench kv``: KV transfer bandwidth next to memcpy, and layer-wise overlap.

Bandwidth: a bf16 payload of the given size (``num_layers`` layers, 8 KV heads x 128)
goes sender -> receiver in another process and is copied into a destination tensor
(what import costs: one copy into the paged cache). Timed from the first
``send_layer`` to the receiver's last copy; medians over ``repeats``. Baselines in
the same run: ``torch`` ``copy_`` and ``numpy.copyto`` of the same size.

Overlap: an 8K-token prefill streamed layer by layer. Each layer "computes" with a
real bf16 matmul loop sized to ``compute_s_per_layer``, then hands its KV to the
transport (on a background thread), while the receiver consumes. Hidden fraction
= (compute + transfer - overlapped) / transfer.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MB = 1 << 20
HEADS, DIM, ITEM = 8, 128, 2  # bf16


def _gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9 if s > 0 else float("inf")


def _memcpy(nbytes: int, repeats: int) -> dict:
    import torch

    a = torch.empty(nbytes // 2, dtype=torch.bfloat16).random_()
    b = torch.empty_like(a)
    na, nb = a.view(torch.uint16).numpy(), b.view(torch.uint16).numpy()
    out = {}
    for name, fn in (("torch_copy_", lambda: b.copy_(a)), ("numpy_copyto", lambda: np.copyto(nb, na))):
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = _gbps(nbytes, statistics.median(ts))
    return out


def _make_layers(nbytes: int, num_layers: int):
    tokens = max(1, nbytes // (num_layers * 2 * HEADS * DIM * ITEM))
    rng = np.random.default_rng(0)
    layers = [rng.integers(0, 1 << 15, size=(2, tokens, HEADS, DIM), dtype=np.uint16) for _ in range(num_layers)]
    return tokens, layers


# ---------------------------------------------------------------- shm (child process receives)
def _shm_child(conn, verify):
    import torch

    from dlbatch.transfer.shm import ShmTransport

    tr = ShmTransport()
    dest = None
    conn.send("ready")  # imports done: timing starts after this
    while True:
        handle = conn.recv()
        if handle is None:
            return
        rx = tr.open_receiver(handle, verify=verify)
        if dest is None:
            dest = torch.empty((handle.meta.num_layers, *handle.meta.layer_shape), dtype=torch.bfloat16)
        for i, view in rx.receive_layers(timeout=120):
            dest[i].copy_(torch.from_numpy(view).view(torch.bfloat16))  # torch's uint16 copy is slow
        rx.release()
        conn.send(time.monotonic())


def _run_shm(meta, layers, repeats, verify, compute=None):
    from dlbatch.transfer.shm import ShmTransport

    ctx = mp.get_context("spawn")  # fork after torch/OpenMP or Ray threads started can deadlock
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_shm_child, args=(child, verify), daemon=True)
    proc.start()
    tr = ShmTransport()
    times = []
    try:
        if not parent.poll(120) or parent.recv() != "ready":
            raise TimeoutError("shm bench receiver process did not start within 120s")
        for _ in range(repeats):
            t0 = time.monotonic()
            sender = tr.open_sender(meta, verify=verify)
            parent.send(sender.handle)
            _produce(sender, layers, compute)
            sender.close()
            deadline = time.monotonic() + 300
            while not parent.poll(0.5):
                if not proc.is_alive():
                    raise RuntimeError(f"shm bench receiver process died (exit code {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise TimeoutError("shm bench receiver did not finish within 300s")
            times.append(parent.recv() - t0)
    finally:
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return times


def _produce(sender, layers, compute):
    """Compute layer i (if simulated) then hand it over on a background thread."""
    if compute is None:
        for i, a in enumerate(layers):
            sender.send_layer(i, a)
        return
    with ThreadPoolExecutor(1) as pool:
        futs = []
        for i, a in enumerate(layers):
            compute()
            futs.append(pool.submit(sender.send_layer, i, a))
        for f in futs:
            f.result(timeout=300)


# ---------------------------------------------------------------- object store (Ray actor receives)
def _object_store_actor():
    import ray

    @ray.remote(num_cpus=0.5)
    class KVSink:
        def consume(self, handle, verify):
            import torch

            from dlbatch.transfer.object_store import ObjectStoreReceiver

            rx = ObjectStoreReceiver(handle, verify)
            meta = handle.meta
            dest = torch.empty((meta.num_layers, *meta.layer_shape), dtype=torch.bfloat16)
            for i, arr in rx.receive_layers(timeout=300):
                dest[i].copy_(torch.from_numpy(arr).view(torch.bfloat16))
            rx.release()
            return time.monotonic()

    return KVSink.remote()


def _run_object_store(meta, layers, repeats, verify, sink, compute=None):
    import ray

    from dlbatch.transfer.object_store import ObjectStoreTransport

    tr = ObjectStoreTransport()
    times = []
    for _ in range(repeats):
        t0 = time.monotonic()
        sender = tr.open_sender(meta, verify=verify)
        _produce(sender, layers, compute)
        handle = sender.close(timeout=300)
        done = ray.get(sink.consume.remote(handle, verify), timeout=600)
        times.append(done - t0)
        del handle, sender
    return times


# ---------------------------------------------------------------- overlap
def _matmul_compute(seconds: float):
    import torch

    n = 256  # fp32: on this sandbox bf16 matmul measured ~300x slower than fp32
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    per = (time.perf_counter() - t0) / 20
    reps = max(1, round(seconds / per))

    def compute():
        for _ in range(reps):
            a @ b

    return compute, reps, per


def bench_kv(
    sizes=(256 * MB, 1024 * MB),
    transports=("shm", "object_store"),
    repeats: int = 5,
    verify: bool = True,
    num_layers: int = 16,
    overlap: bool = True,
    overlap_tokens: int = 8192,
    overlap_layers: int = 16,
    compute_s_per_layer: float = 0.05,
    print_table: bool = True,
) -> dict:
    """Run the benchmark; returns a JSON-friendly dict (and prints a table)."""
    from dlbatch.transfer.payload import make_meta

    for t in transports:
        if t not in ("shm", "object_store"):
            raise ValueError(f"bench_kv measures 'shm' and 'object_store'; got transport {t!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    ray_started = False
    sink = None
    if "object_store" in transports:
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
            ray_started = True
        sink = _object_store_actor()
    result: dict = {"verify": verify, "repeats": repeats, "sizes": {}, "overlap": {}}
    try:
        for size in sizes:
            tokens, layers = _make_layers(size, num_layers)
            meta = make_meta("bench:0", "bfloat16", num_layers, tokens, HEADS, DIM)
            nbytes = meta.nbytes
            row = {"bytes": nbytes, "memcpy_gbps": _memcpy(nbytes, repeats), "transports": {}}
            base = row["memcpy_gbps"]["torch_copy_"]
            for t in transports:
                ts = (
                    _run_shm(meta, layers, repeats, verify)
                    if t == "shm"
                    else _run_object_store(meta, layers, repeats, verify, sink)
                )
                gbps = _gbps(nbytes, statistics.median(ts))
                row["transports"][t] = {"median_gbps": gbps, "ratio_to_memcpy": gbps / base, "times_s": ts}
            result["sizes"][str(size)] = row
            del layers
        if overlap:
            _, layers = _make_layers(overlap_tokens * overlap_layers * 2 * HEADS * DIM * ITEM, overlap_layers)
            meta = make_meta("bench:0", "bfloat16", overlap_layers, overlap_tokens, HEADS, DIM)
            compute, reps, per = _matmul_compute(compute_s_per_layer)
            t0 = time.perf_counter()
            for _ in range(overlap_layers):
                compute()
            t_compute = time.perf_counter() - t0
            for t in transports:
                run = (
                    (lambda c: _run_shm(meta, layers, 1, verify, c))
                    if t == "shm"
                    else (lambda c: _run_object_store(meta, layers, 1, verify, sink, c))
                )
                t_transfer = statistics.median(run(None)[0] for _ in range(3))
                t_both = statistics.median(run(compute)[0] for _ in range(3))
                hidden = (t_compute + t_transfer - t_both) / t_transfer if t_transfer > 0 else 1.0
                result["overlap"][t] = {
                    "tokens": overlap_tokens,
                    "layers": overlap_layers,
                    "compute_s": t_compute,
                    "transfer_s": t_transfer,
                    "overlapped_s": t_both,
                    "hidden_fraction": max(0.0, min(1.0, hidden)),
                }
            result["overlap_compute"] = {"s_per_layer": compute_s_per_layer, "matmul_256_fp32_s": per, "reps": reps}
    finally:
        if sink is not None:
            import ray

            ray.kill(sink)
        if ray_started:
            import ray

            ray.shutdown()
    if print_table:
        print(format_table(result))
    return result


def format_table(result: dict) -> str:
    lines = [f"KV transfer bandwidth (median of {result['repeats']}, verify={result['verify']})"]
    lines.append(f"{'size':>8} {'what':<16} {'GB/s':>7} {'x memcpy':>9}")
    for row in result["sizes"].values():
        size = f"{row['bytes'] / MB:.0f}MB"
        for name, g in row["memcpy_gbps"].items():
            lines.append(f"{size:>8} {name:<16} {g:7.2f} {'':>9}")
        for name, r in row["transports"].items():
            lines.append(f"{size:>8} {name:<16} {r['median_gbps']:7.2f} {r['ratio_to_memcpy']:9.2f}")
    for name, o in result["overlap"].items():
        lines.append(
            f"overlap {name}: {o['tokens']} tokens x {o['layers']} layers, compute {o['compute_s']:.2f}s, "
            f"transfer {o['transfer_s']:.2f}s, both {o['overlapped_s']:.2f}s -> {o['hidden_fraction']:.0%} hidden"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    import json
    import sys

    res = bench_kv(sizes=tuple(int(s) * MB for s in sys.argv[1:]) or (256 * MB,), repeats=3)
    print(json.dumps({k: v for k, v in res.items()}, default=str)[:2000])

"""``dlbatch bench kv``: KV transfer bandwidth next to memcpy, and layer-wise overlap.

Bandwidth: a bf16 payload of the given size (``num_layers`` layers, 8 KV heads x 128)
goes sender -> receiver in another process and is copied into a destination tensor
(what import costs: one copy into the paged cache). Timed from the first
``send_layer`` to the receiver's last copy; medians over ``repeats``. Baselines in
the same run: ``torch`` ``copy_`` and ``numpy.copyto`` of the same size; the ratio is
against the faster of the two.

Overlap: an 8K-token prefill streamed layer by layer. Each layer "computes" with a
real fp32 matmul loop sized to ``compute_s_per_layer`` (bf16 matmul is emulated and
~300x slower on this CPU), then hands its KV to the transport (on a background
thread), while the receiver consumes. The compute runs on ``compute_threads`` (1)
torch threads, standing in for accelerator compute: on CPU the transfer is itself
CPU work (memcpy), so with every core computing nothing can hide. Compute-only, transfer-only and both are run
interleaved ``overlap_rounds`` times after a warm-up; hidden fraction
= (compute + transfer - both) / transfer from the medians.

Each bandwidth measurement runs ``repeats + 1`` times: the first pays the
first-touch page faults (fresh shm segment, untouched object-store pages, the
destination), is reported as "cold", and the median of the rest is the result.
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

    from dlbatch.transfer import fastcopy

    fastcopy.available()  # build/load the native copy before timing starts
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
            dest_np = dest.view(torch.uint16).numpy()
        t = time.perf_counter()
        # the import copy, checksum verified on the way (one pass over the segment)
        for _ in rx.receive_layers(timeout=120, out=dest_np.__getitem__):
            pass
        copy_s = time.perf_counter() - t  # includes waiting for the sender (pipelined)
        rx.release()
        conn.send((time.monotonic(), copy_s))


def _run_shm(meta, layers, repeats, verify, compute=None, with_parts=False, schedule=None):
    from dlbatch.transfer.shm import ShmTransport

    ctx = mp.get_context("spawn")  # fork after torch/OpenMP or Ray threads started can deadlock
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_shm_child, args=(child, verify), daemon=True)
    proc.start()
    tr = ShmTransport()
    times, parts = [], []
    try:
        if not parent.poll(120) or parent.recv() != "ready":
            raise TimeoutError("shm bench receiver process did not start within 120s")
        for step in schedule or [compute] * repeats:
            if step == "compute_only":  # overlap baseline, interleaved with the transfers
                times.append(_time_compute(compute, len(layers)))
                parts.append({})
                continue
            t0 = time.monotonic()
            sender = tr.open_sender(meta, verify=verify)
            parent.send(sender.handle)
            _produce(sender, layers, step)
            sender.close()
            send_s = time.monotonic() - t0
            deadline = time.monotonic() + 300
            while not parent.poll(0.5):
                if not proc.is_alive():
                    raise RuntimeError(f"shm bench receiver process died (exit code {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise TimeoutError("shm bench receiver did not finish within 300s")
            done, copy_s = parent.recv()
            times.append(done - t0)
            parts.append({"send_s": send_s, "receive_copy_verify_s": copy_s})
    finally:
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return (times, parts) if with_parts else times


def _time_compute(compute, n: int) -> float:
    t0 = time.monotonic()
    for _ in range(n):
        compute()
    return time.monotonic() - t0


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
        """The receiving worker: takes each layer's ref as the sender forwards it (streamed,
        in order), verifies it and copies it into its destination ("paged cache") tensor."""

        def begin(self, meta, verify):
            import torch

            from dlbatch.transfer.object_store import ObjectStoreReceiver

            self._rx = ObjectStoreReceiver.streaming(meta, verify)
            if getattr(self, "_dest_shape", None) != (meta.num_layers, *meta.layer_shape):
                self._dest_shape = (meta.num_layers, *meta.layer_shape)
                self._dest = torch.empty(self._dest_shape, dtype=torch.bfloat16)  # the "paged cache"
                self._dest_np = self._dest.view(torch.uint16).numpy()
            self._receive_s = 0.0

        def take(self, i, refs, csum):
            t = time.perf_counter()
            # fetch (zero-copy view of the store) + verify + the import copy, fused
            self._rx.receive_layer(i, refs[0], csum, timeout=300, out=self._dest_np.__getitem__)
            self._receive_s += time.perf_counter() - t
            if self._rx.stream_complete:
                self._rx.release()
                return time.monotonic(), self._receive_s
            return None

        def warm(self):
            import torch  # noqa: F401  (imports are not part of the transfer)

            import dlbatch.transfer.object_store  # noqa: F401
            from dlbatch.transfer import fastcopy

            fastcopy.available()  # build/load the native copy outside the timed span
            return True

    sink = KVSink.remote()
    ray.get(sink.warm.remote(), timeout=300)
    return sink


def _run_object_store(meta, layers, repeats, verify, sink, compute=None, with_parts=False, schedule=None):
    import ray

    from dlbatch.transfer.object_store import ObjectStoreTransport

    tr = ObjectStoreTransport()
    times, parts = [], []
    for step in schedule or [compute] * repeats:
        if step == "compute_only":
            times.append(_time_compute(compute, len(layers)))
            parts.append({})
            continue
        ray.get(sink.begin.remote(meta, verify), timeout=60)
        takes = []

        def forward(i, ref, csum):  # on the sender's put thread, in layer order
            takes.append(sink.take.remote(i, [ref], csum))  # nested: the sink fetches it itself

        t0 = time.monotonic()
        sender = tr.open_sender(meta, verify=verify, on_layer=forward)
        _produce(sender, layers, step)
        handle = sender.close(timeout=300)
        put_s = time.monotonic() - t0
        done, receive_s = ray.get(takes[-1], timeout=600)
        ray.get(takes, timeout=600)  # surfaces an error from any layer
        times.append(done - t0)
        parts.append({"put_s": put_s, "receive_copy_verify_s": receive_s})
        del handle, sender, takes
    return (times, parts) if with_parts else times


def _checksum_speed(layer: np.ndarray) -> dict:
    """GB/s of each checksum over one layer (the per-layer cost on each side with verify)."""
    from dlbatch.transfer.payload import CHECKSUM_ALGOS, checksum

    out = {}
    for algo in CHECKSUM_ALGOS:
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            checksum(layer, algo)
            ts.append(time.perf_counter() - t0)
        out[algo] = _gbps(layer.nbytes, statistics.median(ts))
    return out


# ---------------------------------------------------------------- overlap
def _matmul_compute(seconds: float, threads: int = 1):
    import torch

    torch.set_num_threads(threads)  # see bench_kv(compute_threads=...)
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
    overlap_rounds: int = 3,
    compute_threads: int = 1,
    print_table: bool = True,
) -> dict:
    """Run the benchmark; returns a JSON-friendly dict (and prints a table)."""
    from dlbatch.transfer.payload import make_meta

    for t in transports:
        if t not in ("shm", "object_store"):
            raise ValueError(f"bench_kv measures 'shm' and 'object_store'; got transport {t!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    from dlbatch.transfer import fastcopy

    native = fastcopy.available()  # build/load before anything is timed
    ray_started = False
    sink = None
    if "object_store" in transports:
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
            ray_started = True
        sink = _object_store_actor()
    result: dict = {
        "verify": verify, "repeats": repeats, "sizes": {}, "overlap": {},
        "native_copy": native, "native_copy_reason": fastcopy.unavailable_reason(),
    }
    try:
        for size in sizes:
            tokens, layers = _make_layers(size, num_layers)
            meta = make_meta("bench:0", "bfloat16", num_layers, tokens, HEADS, DIM)
            nbytes = meta.nbytes
            row = {"bytes": nbytes, "memcpy_gbps": _memcpy(nbytes, repeats), "transports": {}}
            # the better of the two copies is the physical limit (torch's copy_ runs 2 threads and
            # suffers most on a loaded machine; using the slower one would flatter the ratio)
            base = max(row["memcpy_gbps"].values())
            for t in transports:
                # one more repeat than asked: the first pays first-touch page faults (fresh shm
                # segment / untouched plasma pages / destination), the rest run warm
                extra = 0  # untimed warm-ups (none: see docs/transfer.md on plasma first-touch)
                ts, parts = (
                    _run_shm(meta, layers, repeats + 1, verify, with_parts=True)
                    if t == "shm"
                    else _run_object_store(meta, layers, repeats + 1 + extra, verify, sink, with_parts=True)
                )
                ts, parts = ts[:1] + ts[1 + extra:], parts[:1] + parts[1 + extra:]
                gbps = _gbps(nbytes, statistics.median(ts[1:]))
                row["transports"][t] = {
                    "median_gbps": gbps,
                    "ratio_to_memcpy": gbps / base,
                    "first_touch_gbps": _gbps(nbytes, ts[0]),
                    "times_s": ts,
                    "breakdown_s": {k: statistics.median(p[k] for p in parts[1:]) for k in parts[0]},
                    "untimed_warmups": extra,
                }
            if "shm" in transports:
                from dlbatch.transfer import shm as _shm

                row["shm_pool"] = _shm.pool_stats()  # created vs reused segments (sender side)
            row["checksum_gbps"] = _checksum_speed(layers[0])
            result["sizes"][str(size)] = row
            del layers
        if overlap:
            _, layers = _make_layers(overlap_tokens * overlap_layers * 2 * HEADS * DIM * ITEM, overlap_layers)
            meta = make_meta("bench:0", "bfloat16", overlap_layers, overlap_tokens, HEADS, DIM)
            import torch

            threads_before = torch.get_num_threads()
            compute, reps, per = _matmul_compute(compute_s_per_layer, compute_threads)

            for t in transports:
                # one receiver for all runs; a warm-up transfer first, then rounds of
                # compute-only / transfer-only / both, interleaved so load changes hit all alike
                schedule = [None] + ["compute_only", None, compute] * overlap_rounds
                ts = (
                    _run_shm(meta, layers, 0, verify, compute, schedule=schedule)
                    if t == "shm"
                    else _run_object_store(meta, layers, 0, verify, sink, compute, schedule=schedule)
                )
                tc, tt, tb = ts[1::3], ts[2::3], ts[3::3]
                t_compute, t_transfer, t_both = map(statistics.median, (tc, tt, tb))
                hidden = (t_compute + t_transfer - t_both) / t_transfer if t_transfer > 0 else 1.0
                result["overlap"][t] = {
                    "tokens": overlap_tokens,
                    "layers": overlap_layers,
                    "rounds": overlap_rounds,
                    "compute_s": t_compute,
                    "transfer_s": t_transfer,
                    "overlapped_s": t_both,
                    "compute_runs_s": tc,
                    "transfer_runs_s": tt,
                    "both_runs_s": tb,
                    "hidden_fraction": max(0.0, min(1.0, hidden)),
                }
            torch.set_num_threads(threads_before)
            result["overlap_compute"] = {
                "threads": compute_threads, "s_per_layer": compute_s_per_layer, "matmul_256_fp32_s": per, "reps": reps
            }
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
    verify = result["verify"]
    native = result.get("native_copy")
    lines = [
        f"KV transfer bandwidth, checksums {'ON (sum64 computed by the sender, verified by the receiver)' if verify else 'OFF (--no-verify)'}; "
        f"copies: {'native fused copy+sum64' if native else 'numpy (native copy unavailable: ' + str(result.get('native_copy_reason')) + ')'}",
        "timed span: from the sender opening the transfer (first send_layer) until the receiver (another process) has "
        "the last layer verified and copied into its destination tensor",
        f"'GB/s' is the median of {result['repeats']} warm repeats after one first-touch repeat ('cold'); "
        "'x memcpy' is against the faster memcpy baseline measured just before, in this run",
    ]
    lines.append(f"{'size':>8} {'what':<16} {'GB/s':>7} {'x memcpy':>9} {'cold GB/s':>10}  breakdown (warm, s)")
    for row in result["sizes"].values():
        size = f"{row['bytes'] / MB:.0f}MB"
        for name, g in row["memcpy_gbps"].items():
            lines.append(f"{size:>8} {name:<16} {g:7.2f}")
        for name, r in row["transports"].items():
            parts = " ".join(f"{k}={v:.2f}" for k, v in r.get("breakdown_s", {}).items())
            if r.get("untimed_warmups"):
                parts += f" (after {r['untimed_warmups']} untimed warm-up transfers that wrap the plasma store)"
            lines.append(
                f"{size:>8} {name:<16} {r['median_gbps']:7.2f} {r['ratio_to_memcpy']:9.2f} "
                f"{r.get('first_touch_gbps', float('nan')):10.2f}  {parts}"
            )
        if "shm_pool" in row:
            sp = row["shm_pool"]
            lines.append(f"{size:>8} shm pool: {sp['created']} segments created, {sp['reused']} reused so far")
        if "checksum_gbps" in row:
            lines.append(
                f"{size:>8} checksum (1 layer) " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in row["checksum_gbps"].items())
            )
    for name, o in result["overlap"].items():
        lines.append(
            f"overlap {name}: {o['tokens']} tokens x {o['layers']} layers, median of {o.get('rounds', 1)} interleaved "
            f"rounds: compute {o['compute_s']:.2f}s, transfer {o['transfer_s']:.2f}s, both {o['overlapped_s']:.2f}s "
            f"-> {o['hidden_fraction']:.0%} hidden"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    import json
    import sys

    res = bench_kv(sizes=tuple(int(s) * MB for s in sys.argv[1:]) or (256 * MB,), repeats=3)
    print(json.dumps({k: v for k, v in res.items()}, default=str)[:2000])

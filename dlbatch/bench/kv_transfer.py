"""``dlbatch bench kv``: KV transfer bandwidth next to memcpy, and layer-wise overlap.

Bandwidth: a bf16 payload of the given size (``num_layers`` layers, 8 KV heads x 128)
goes sender -> receiver in another process and is copied into a destination tensor
(what import costs: one copy into the paged cache). Timed from the sender opening the
transfer to the receiver's last copy; medians over ``repeats``. Baselines in the same
run: plain memcpy (``numpy.copyto``: one thread, glibc memcpy) -- the target's
reference -- and the all-cores copy (``torch`` ``copy_``); for the object store also
each half on its own: ``ray.put`` alone (the sender's puts, nobody receiving) and the
receive alone (the receiver's fetch + verified copy of objects put beforehand).

Overlap: a real prefill on the engine (the bundled model by default, 8K tokens, one
chunk) with its KV streamed out of the forward layer by layer (``LLM.prefill(...,
kv_sink_factory=...)`` -> ``dlbatch.transfer.sink.TransportSink``) to a receiver in
another process that copies each layer into its destination as it arrives. Measured:
the prefill alone; the transfer of the same KV alone (after the fact); and the prefill
with streaming, where the *exposed* transfer time is from the prefill's return to the
receiver's last copy. Hidden fraction = 1 - exposed / transfer alone. The slowdown of
the prefill itself while it streams (on CPU the transfer competes for the same cores)
is reported next to it.

Each bandwidth measurement runs ``repeats + 1`` times: the first pays the first-touch
page faults (fresh shm segment, the destination), is reported as "cold", and the
median of the rest is the result. The object store is prewarmed first (see
``object_store.prewarm``): a long-running worker's steady state.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from dlbatch.bench.kv_child import ReceiverProcess, run_to_child

MB = 1 << 20
HEADS, DIM, ITEM = 8, 128, 2  # bf16
BENCH_TRANSPORTS = ("shm", "object_store", "dlslime")


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
    from dlbatch.transfer import fastcopy
    from dlbatch.transfer.shm import ShmTransport

    fastcopy.available()  # build/load the native copy before timing starts
    tr = ShmTransport()
    dest = None
    conn.send("ready")  # imports done: timing starts after this
    while True:
        handle = conn.recv()
        if handle is None:
            return
        rx = tr.open_receiver(handle, verify=verify)
        m = handle.meta
        if dest is None or dest.shape[1:] != m.layer_shape or dest.shape[0] != m.num_layers or \
                dest.dtype != m.storage_dtype:
            dest = np.empty((m.num_layers, *m.layer_shape), dtype=m.storage_dtype)  # the "paged cache"
        t = time.perf_counter()
        # the import copy, checksum verified on the way (one pass over the segment)
        for _ in rx.receive_layers(timeout=300, out=dest.__getitem__):
            pass
        copy_s = time.perf_counter() - t  # includes waiting for the sender (pipelined)
        rx.release()
        conn.send((time.monotonic(), copy_s))


def ShmReceiverProcess(verify: bool) -> ReceiverProcess:  # noqa: N802  (reads as a class)
    return ReceiverProcess(_shm_child, verify, "shm")


def _run_shm(meta, layers, repeats, verify):
    from dlbatch.transfer.shm import ShmTransport

    return run_to_child(ShmTransport(), ShmReceiverProcess(verify), meta, layers, repeats, verify)


# ---------------------------------------------------------------- object store (Ray actor receives)
def _object_store_actor():
    import ray

    @ray.remote(num_cpus=0.5)
    class KVSink:
        """The receiving worker: takes each object's ref as the sender forwards it (streamed,
        in order), verifies its layers and copies them into its destination ("paged cache")."""

        def begin(self, meta, verify):
            from dlbatch.transfer.object_store import ObjectStoreReceiver

            self._rx = ObjectStoreReceiver.streaming(meta, verify)
            shape = (meta.num_layers, *meta.layer_shape)
            if getattr(self, "_dest", None) is None or self._dest.shape != shape or \
                    self._dest.dtype != meta.storage_dtype:
                self._dest = np.empty(shape, dtype=meta.storage_dtype)  # the "paged cache"
            self._receive_s = 0.0

        def take(self, first, refs, csums):
            t = time.perf_counter()
            # fetch (zero-copy views of the store) + verify + the import copy, fused
            self._rx.receive_object(first, refs[0], csums, timeout=300, out=self._dest.__getitem__)
            self._receive_s += time.perf_counter() - t
            if self._rx.stream_complete:
                self._rx.release()
                return time.monotonic(), self._receive_s
            return None

        def touch(self, refs):
            from dlbatch.transfer.object_store import touch

            return touch(refs)  # this reader's first-touch faults of the store, paid before timing

        def warm(self):
            import dlbatch.transfer.object_store  # noqa: F401  (imports are not part of the transfer)
            from dlbatch.transfer import fastcopy

            fastcopy.available()  # build/load the native copy outside the timed span
            return True

    sink = KVSink.remote()
    ray.get(sink.warm.remote(), timeout=300)
    return sink


def _prewarm_object_store(sink, largest: int) -> dict:
    """The steady state of a long-running worker: both processes have touched the store's
    pages once (see object_store.prewarm) -- 70% of it (below Ray's spilling threshold), or
    what a few of the largest payloads need when the store is much bigger. Timed, reported."""
    import ray

    from dlbatch.transfer.object_store import PREWARM_CHUNK, prewarm, store_capacity

    cap = store_capacity()
    t0 = time.monotonic()
    refs = prewarm(min(int(cap * 0.7), 3 * largest + (256 << 20)), keep=True)
    t1 = time.monotonic()
    ray.get(sink.touch.remote(refs), timeout=600)
    t2 = time.monotonic()
    warmed = len(refs) * PREWARM_CHUNK
    del refs
    return {"store_bytes": cap, "bytes": warmed, "sender_s": t1 - t0, "receiver_s": t2 - t1}


class ObjectStoreStream:
    """Sender side of one streamed object-store transfer to the sink actor: each object's
    ref is forwarded to the sink as soon as it is in the store."""

    def __init__(self, sink, meta, verify: bool):
        import ray

        from dlbatch.transfer.object_store import ObjectStoreTransport

        self._ray = ray
        ray.get(sink.begin.remote(meta, verify), timeout=60)
        self.takes: list = []

        def forward(first, ref, csums):  # on the sender's put thread, in order
            self.takes.append(sink.take.remote(first, [ref], csums))  # nested: the sink fetches it itself

        self.sender = ObjectStoreTransport().open_sender(meta, verify=verify, on_object=forward)

    def wait(self, timeout: float = 600.0) -> tuple[float, float]:
        done = self._ray.get(self.takes[-1], timeout=timeout)
        self._ray.get(self.takes, timeout=timeout)  # surfaces an error from any object
        return done


def _run_object_store(meta, layers, repeats, verify, sink):
    times, parts = [], []
    for _ in range(repeats):
        t0 = time.monotonic()
        stream = ObjectStoreStream(sink, meta, verify)
        for i, a in enumerate(layers):
            stream.sender.send_layer(i, a)
        handle = stream.sender.close(timeout=300)
        put_s = time.monotonic() - t0
        done, receive_s = stream.wait()
        times.append(done - t0)
        parts.append({"put_s": put_s, "receive_copy_verify_s": receive_s})
        del handle, stream
    return times, parts


def _put_all(meta, layers, verify, on_object=None):
    """Every layer through an object-store sender, waited for; returns its handle."""
    from dlbatch.transfer.object_store import ObjectStoreTransport

    sender = ObjectStoreTransport().open_sender(meta, verify=verify, on_object=on_object)
    for i, a in enumerate(layers):
        sender.send_layer(i, a)
    return sender.close(timeout=300)


def _ray_put_alone(meta, layers, repeats, verify) -> float:
    """GB/s of the object store's own half: the sender's puts (same objects, same
    checksums) with nobody receiving -- the ceiling of the object_store transport here."""
    ts = []
    for _ in range(repeats + 1):
        t0 = time.monotonic()
        handle = _put_all(meta, layers, verify)
        ts.append(time.monotonic() - t0)
        del handle
    return _gbps(meta.nbytes, statistics.median(ts[1:]))


def _receive_alone(meta, layers, repeats, verify, sink) -> float:
    """GB/s of the object store's other half: the sink actor fetching, verifying and copying
    objects that are all in the store already (put beforehand, not timed) -- with
    ``ray.put alone`` it shows what each half reaches when it has the cores to itself."""
    import ray

    ts = []
    for _ in range(repeats + 1):
        objs = []
        handle = _put_all(meta, layers, verify, on_object=lambda first, ref, csums: objs.append((first, ref, csums)))
        ray.get(sink.begin.remote(meta, verify), timeout=60)
        t0 = time.monotonic()
        takes = [sink.take.remote(first, [ref], csums) for first, ref, csums in objs]
        done, _ = ray.get(takes[-1], timeout=600)
        ray.get(takes, timeout=600)
        ts.append(done - t0)
        del handle, takes
        objs.clear()  # frees the objects before the next repeat puts its own
    return _gbps(meta.nbytes, statistics.median(ts[1:]))


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


# ---------------------------------------------------------------- overlap (a real prefill)
class _Receiver:
    """The receiving end of one transfer in the overlap experiment, for either transport."""

    def __init__(self, transport: str, verify: bool, sink=None):
        self.transport, self.verify, self.sink = transport, verify, sink
        self.shm = ShmReceiverProcess(verify) if transport == "shm" else None

    def open(self, meta):
        """A TransportSink for the engine (or for the exported layers), receiver waiting."""
        from dlbatch.transfer.shm import ShmTransport
        from dlbatch.transfer.sink import TransportSink

        if self.shm is not None:
            sender = ShmTransport().open_sender(meta, verify=self.verify)
            self.shm.expect(sender.handle)
            self._stream = None
        else:
            self._stream = ObjectStoreStream(self.sink, meta, self.verify)
            sender = self._stream.sender
        return TransportSink(sender)

    def wait(self) -> float:
        return (self.shm.wait() if self.shm is not None else self._stream.wait())[0]

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()


def bench_overlap(model: str, tokens: int, transports, verify: bool, sink=None, rounds: int = 1,
                  dtype: str = "bfloat16") -> dict:
    """An ``tokens``-token prefill of ``model`` streamed layer by layer through each transport."""
    import torch

    from dlbatch.engine.llm import LLM
    from dlbatch.engine.sampling_params import SamplingParams
    from dlbatch.engine.loader import load_model
    from dlbatch.transfer.payload import dtype_name, make_meta

    mpe = load_model(model).config.max_position_embeddings
    tokens = min(tokens, mpe - 1)  # one more position for the sampled token
    # one chunk, no prefix cache (the same prompt is prefilled several times)
    llm = LLM(model, dtype=dtype, max_model_len=tokens + 1, max_num_batched_tokens=tokens, max_num_seqs=1,
              enable_prefix_caching=False, chat=False)
    c = llm.engine.mconf
    rng = np.random.default_rng(0)
    ids = [int(x) for x in rng.integers(3, c.vocab_size, size=tokens)]
    params = SamplingParams(max_tokens=1)
    llm.prefill([ids[:256]], params)  # warm-up: kernels, allocator
    out: dict = {"model": model, "tokens": tokens, "layers": c.num_layers, "compute_dtype": llm.engine.compute_dtype,
                 "threads": torch.get_num_threads(), "transports": {}}
    compute = []
    layers = None
    for _ in range(rounds):
        t0 = time.monotonic()
        res = llm.prefill([ids], params)
        compute.append(time.monotonic() - t0)
        layers = res[0].kv
    out["prefill_alone_s"] = statistics.median(compute)
    meta = make_meta(llm.fingerprint, dtype_name(layers[0].dtype), c.num_layers, tokens, c.num_kv_heads, c.head_dim)
    out["kv_bytes"] = meta.nbytes
    for name in transports:
        rx = _Receiver(name, verify, sink)
        try:
            alone, streamed, exposed = [], [], []
            for _ in range(rounds + 1):  # the first transfer warms the receiver's destination and buffers
                t0 = time.monotonic()
                kv_sink = rx.open(meta)
                for i, layer in enumerate(layers):
                    kv_sink.send_layer(i, layer)
                kv_sink.finish(timeout=300)
                alone.append(rx.wait() - t0)
            alone = alone[1:]
            for _ in range(rounds):
                sinks = []

                def factory(k, n):
                    sinks.append(rx.open(meta))
                    return sinks[-1]

                t0 = time.monotonic()
                res = llm.prefill([ids], params, kv_sink_factory=factory)
                t_done = time.monotonic()
                assert res[0].kv_streamed
                sinks[0].finish(timeout=300)
                done = rx.wait()
                streamed.append(t_done - t0)
                exposed.append(max(0.0, done - t_done))
        finally:
            rx.close()
        t_alone, t_exposed, t_streamed = map(statistics.median, (alone, exposed, streamed))
        out["transports"][name] = {
            "transfer_alone_s": t_alone, "exposed_s": t_exposed, "prefill_streaming_s": t_streamed,
            "transfer_alone_gbps": _gbps(meta.nbytes, t_alone),
            "hidden_fraction": max(0.0, 1.0 - t_exposed / t_alone) if t_alone > 0 else 1.0,
            "prefill_slowdown": t_streamed / out["prefill_alone_s"] - 1.0,
            "runs": {"alone_s": alone, "exposed_s": exposed, "prefill_streaming_s": streamed},
        }
    return out


# ---------------------------------------------------------------- the whole benchmark
def bench_kv(
    sizes=(256 * MB, 1024 * MB),
    transports=("shm", "object_store"),
    repeats: int = 5,
    verify: bool = True,
    num_layers: int = 16,
    overlap: bool = True,
    overlap_tokens: int = 8192,
    overlap_model: str = "smollm2-135m-instruct",
    overlap_rounds: int = 1,
    print_table: bool = True,
) -> dict:
    """Run the benchmark; returns a JSON-friendly dict (and prints a table)."""
    from dlbatch.transfer import fastcopy
    from dlbatch.transfer.payload import make_meta

    for t in transports:
        if t not in BENCH_TRANSPORTS:
            raise ValueError(f"bench_kv measures {BENCH_TRANSPORTS}; got transport {t!r}")
    if "dlslime" in transports:
        from dlbatch.transfer.dlslime_transport import unavailable_reason

        reason = unavailable_reason()
        if reason:
            from dlbatch.transfer.errors import TransportUnavailable

            raise TransportUnavailable(f"bench kv --transports dlslime: {reason}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    if overlap_rounds < 1:
        raise ValueError(f"overlap_rounds must be >= 1, got {overlap_rounds!r}")
    native = fastcopy.available()  # build/load before anything is timed
    ray_started = False
    sink = None
    result: dict = {
        "verify": verify, "repeats": repeats, "sizes": {}, "overlap": {},
        "native_copy": native, "native_copy_reason": fastcopy.unavailable_reason(),
    }
    try:
        if "object_store" in transports:
            import ray

            if not ray.is_initialized():
                # a store sized for the job at hand (3 payloads in flight) rather than 30% of RAM, so
                # that warming it up below takes seconds
                store = max(3 * max(sizes, default=0), 1 << 30)
                ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                         object_store_memory=store)
                ray_started = True
            sink = _object_store_actor()
            result["object_store_prewarm"] = _prewarm_object_store(sink, max(sizes, default=0))
        for size in sizes:
            tokens, layers = _make_layers(size, num_layers)
            meta = make_meta("bench:0", "bfloat16", num_layers, tokens, HEADS, DIM)
            nbytes = meta.nbytes
            row = {"bytes": nbytes, "memcpy_gbps": _memcpy(nbytes, repeats), "transports": {}}
            # the target compares with plain memcpy: one thread, glibc's memcpy (numpy.copyto), one
            # stream of bytes as a transfer is; the all-cores copy (torch copy_, 2 threads here) is
            # printed too, with the ratio to it
            base = row["memcpy_gbps"]["numpy_copyto"]
            par = row["memcpy_gbps"]["torch_copy_"]
            if "object_store" in transports:
                row["ray_put_alone_gbps"] = _ray_put_alone(meta, layers, repeats, verify)
                row["receive_alone_gbps"] = _receive_alone(meta, layers, repeats, verify, sink)
            for t in transports:
                # one more repeat than asked: the first pays first-touch page faults (fresh shm
                # segment / destination), the rest run warm
                if t == "shm":
                    ts, parts = _run_shm(meta, layers, repeats + 1, verify)
                elif t == "dlslime":
                    from dlbatch.bench.kv_dlslime import run_dlslime

                    ts, parts = run_dlslime(meta, layers, repeats + 1, verify)
                else:
                    ts, parts = _run_object_store(meta, layers, repeats + 1, verify, sink)
                gbps = _gbps(nbytes, statistics.median(ts[1:]))
                row["transports"][t] = {
                    "median_gbps": gbps,
                    "ratio_to_memcpy": gbps / base,
                    "ratio_to_parallel_copy": gbps / par,
                    "first_touch_gbps": _gbps(nbytes, ts[0]),
                    "times_s": ts,
                    "breakdown_s": {k: statistics.median(p[k] for p in parts[1:]) for k in parts[0]},
                }
            if "shm" in transports:
                from dlbatch.transfer import shm as _shm

                row["shm_pool"] = _shm.pool_stats()  # created vs reused segments (sender side)
            row["checksum_gbps"] = _checksum_speed(layers[0])
            result["sizes"][str(size)] = row
            del layers
        if overlap:
            streamed = [t for t in transports if t in ("shm", "object_store")]
            result["overlap"] = bench_overlap(overlap_model, overlap_tokens, streamed, verify, sink, overlap_rounds)
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
        "'x memcpy' is against plain memcpy (numpy_copyto: one thread, glibc memcpy) measured just before, in this run; "
        "'x all-core' against the all-cores copy (torch copy_)",
    ]
    if "object_store_prewarm" in result:
        pw = result["object_store_prewarm"]
        lines.append(
            f"object store: {pw['store_bytes'] / MB:.0f} MiB, {pw.get('bytes', 0) / MB:.0f} MiB of it prewarmed (pages "
            f"touched once by the sender, {pw['sender_s']:.1f}s, and the receiver, {pw['receiver_s']:.1f}s: a "
            "long-running worker's steady state)")
    lines.append(f"{'size':>8} {'what':<16} {'GB/s':>7} {'x memcpy':>9} {'x all-core':>10} {'cold GB/s':>10}  "
                 "breakdown (warm, s)")
    for row in result["sizes"].values():
        size = f"{row['bytes'] / MB:.0f}MB"
        for name, g in row["memcpy_gbps"].items():
            lines.append(f"{size:>8} {name:<16} {g:7.2f}")
        if "ray_put_alone_gbps" in row:
            g = row["ray_put_alone_gbps"]
            lines.append(f"{size:>8} {'ray.put alone':<16} {g:7.2f} {g / row['memcpy_gbps']['numpy_copyto']:9.2f}"
                         f"{'':>22}  (the object store's own ceiling: the sender's puts, nobody receiving)")
        if "receive_alone_gbps" in row:
            g = row["receive_alone_gbps"]
            lines.append(f"{size:>8} {'receive alone':<16} {g:7.2f} {g / row['memcpy_gbps']['numpy_copyto']:9.2f}"
                         f"{'':>22}  (the other half: the receiver's get + verified copy of objects already put)")
        for name, r in row["transports"].items():
            parts = " ".join(f"{k}={v:.3f}" for k, v in r.get("breakdown_s", {}).items())
            lines.append(
                f"{size:>8} {name:<16} {r['median_gbps']:7.2f} {r['ratio_to_memcpy']:9.2f} "
                f"{r.get('ratio_to_parallel_copy', float('nan')):10.2f} "
                f"{r.get('first_touch_gbps', float('nan')):10.2f}  {parts}"
            )
        if "shm_pool" in row:
            sp = row["shm_pool"]
            lines.append(f"{size:>8} shm pool: {sp['created']} segments created, {sp['reused']} reused so far")
        if "checksum_gbps" in row:
            lines.append(
                f"{size:>8} checksum (1 layer) " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in row["checksum_gbps"].items())
            )
    o = result.get("overlap") or {}
    if o:
        lines.append(
            f"overlap: {o['model']} prefill of {o['tokens']} tokens in one chunk ({o['layers']} layers, "
            f"{o['compute_dtype']}, {o['threads']} threads), KV {o['kv_bytes'] / MB:.0f} MiB streamed out of the forward "
            f"layer by layer; prefill alone {o['prefill_alone_s']:.2f}s")
        for name, t in o["transports"].items():
            lines.append(
                f"overlap {name}: transfer alone {t['transfer_alone_s']:.3f}s ({t['transfer_alone_gbps']:.2f} GB/s), "
                f"exposed after the prefill {t['exposed_s'] * 1e3:.1f} ms -> {t['hidden_fraction']:.0%} hidden; "
                f"prefill while streaming {t['prefill_streaming_s']:.2f}s ({t['prefill_slowdown']:+.1%})")
    return "\n".join(lines)

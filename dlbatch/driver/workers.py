"""Ray actors that own one inference engine each: colocated (prefill + decode), prefill-only
(exports KV) and decode-only (imports KV). Each runs its engine in one loop thread so that
requests from many concurrent calls share continuous batching; calls block until their own
requests finish. Placed by resources: a pool's chip `fast` asks for `{"chip:fast": 1}`.

The module imports Ray lazily; `make_worker_class(role)` returns the remote class.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from dlbatch.engine.config import EngineConfig

log = logging.getLogger("dlbatch.driver.workers")


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its engine: the model, the engine configuration (one
    object, `EngineConfig`, with the engine's defaults), and how it talks to the others."""

    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    chat: bool | None = None
    num_threads: int = 1
    storage_options: dict | None = None
    kv_transport: str = "object_store"  # how prefill workers hand KV to decode workers
    kv_timeout_s: float = 120.0  # longest wait for a KV transfer (put, receive) before it fails


# transports fed layer by layer from inside the prefill forward (dlbatch/transfer/sink.py);
# "rdt" keeps the tensors in the prefill worker until the decode worker pulls them
STREAMED = ("object_store", "shm", "dlslime")
RDT_KEEP = 4096  # prefill results kept for an RDT pull at most (oldest dropped, with a warning)


def request_params(r: dict):
    from dlbatch import SamplingParams

    return SamplingParams(max_tokens=int(r["max_tokens"]), temperature=float(r.get("temperature", 0.0)),
                          top_p=float(r.get("top_p", 1.0)), top_k=int(r.get("top_k", 0)), seed=r.get("seed"),
                          ignore_eos=bool(r.get("ignore_eos", False)), constraint=r.get("constraint"))


def local_device(device: str) -> str:
    """The pool's device string as this process sees it (Ray renumbers an actor's GPUs)."""
    if not device.startswith("cuda"):
        return device
    import torch

    from dlbatch.engine.device import resolve_device

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return resolve_device(device, os.environ.get("CUDA_VISIBLE_DEVICES"), count)


def device_info(device: str) -> dict:
    """Where this worker's tensors live and whether RDT can move them."""
    import torch

    from dlbatch.transfer import rdt

    return {"device": device, "cuda": torch.cuda.is_available(),
            "rdt": rdt.unavailable_reason(device) if device != "cpu" else "a CPU worker"}


def probe_device(device: str) -> dict:
    """Ray task body run with a pool's exact resources (GPUs, chip) before its workers are
    made: ``device_info`` as a worker of that pool will see it (kv_transport=auto)."""
    try:
        return device_info(local_device(device))
    except ValueError as e:
        return {"device": device, "cuda": False, "rdt": str(e)}


class EngineLoop:
    """Owns an LLM; one thread runs `step()` while calls enqueue work and wait on futures."""

    def __init__(self, spec: WorkerSpec, role: str):
        import torch

        from dlbatch import LLM

        torch.set_num_threads(max(1, spec.num_threads))
        self.role = role
        self.device = local_device(spec.engine.device)
        self.spec = spec
        self.llm = LLM(spec.model, replace(spec.engine, device=self.device), chat=spec.chat,
                       storage_options=spec.storage_options)
        self.engine = self.llm.engine
        self.inbox: queue.Queue = queue.Queue()
        self.futures: dict[int, tuple[Future, object]] = {}
        self.busy_s = 0.0
        self.started = time.time()
        self.error: BaseException | None = None
        self._transports: dict = {}
        self._rdt_kept: dict = {}
        self._rdt_lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name=f"dlbatch-{role}-engine", daemon=True)
        self.thread.start()

    # called from actor threads -----------------------------------------------------------
    def submit(self, kind: str, item) -> Future:
        fut: Future = Future()
        self.inbox.put((kind, item, fut))
        return fut

    # the engine thread ---------------------------------------------------------------------
    def _admit(self, kind, item, fut) -> None:
        eng = self.engine
        try:
            if kind == "generate":
                seq = eng.add_request(item["request_id"], item["token_ids"], request_params(item))
            elif kind == "prefill":
                seq = eng.add_request(item["request_id"], item["token_ids"], request_params(item), prefill_only=True)
                if self.kv_via in STREAMED:
                    seq.kv_sink = self._open_sink(len(seq.prompt_ids))
            elif kind == "decode":
                seq = self._import(item)
            else:  # pragma: no cover
                raise ValueError(kind)
        except Exception as e:  # a bad request fails alone
            fut.set_exception(e)
            return
        self.futures[id(seq)] = (fut, seq)

    @property
    def kv_via(self) -> str:
        # auto: the object store (the runner resolves auto before it makes PD workers)
        return self.spec.kv_transport if self.spec.kv_transport != "auto" else "object_store"

    def _open_sink(self, num_tokens: int):
        from dlbatch.transfer.payload import dtype_name, make_meta
        from dlbatch.transfer.sink import TransportSink

        c = self.engine.mconf
        meta = make_meta(self.llm.fingerprint, dtype_name(self.engine.runner.kv_cache.dtype), c.num_layers,
                         num_tokens, c.num_kv_heads, c.head_dim)
        tr = self.transport(self.kv_via)
        return TransportSink(open=lambda: tr.open_sender(meta))  # buffers taken when the prefill runs

    def receive_kv(self, item: dict) -> dict:
        """Decode side, on the calling thread (not the engine's): pull a request's KV through
        the transport it came by; the layers stay zero-copy views of the transport's buffers
        (object store, shm) until the engine has copied them into its blocks."""
        from dlbatch.transfer.payload import KVPayload, layer_to_torch, validate

        kv, via = item.get("kv"), item.get("kv_via", "object_store")
        release = None
        if isinstance(kv, KVPayload):  # carried inline (RDT: the tensors that came by the collective)
            payload = kv
        else:
            rx = self.transport(via).open_receiver(kv)
            release = rx.release
            try:
                arrays = [a for _, a in rx.receive_layers(timeout=self.spec.kv_timeout_s)]
                payload = KVPayload(rx.meta, arrays)
            except BaseException:
                rx.release()
                raise
        try:
            validate(payload, expected_fingerprint=self.llm.fingerprint, verify=False)
            layers = [layer_to_torch(payload, i) for i in range(payload.meta.num_layers)]
        except BaseException:
            if release is not None:
                release()
            raise
        return {**item, "kv": None, "kv_layers": layers, "kv_release": release}

    def _import(self, item):
        release = item.get("kv_release")
        try:
            seq = self.engine.add_imported(item["request_id"], item["token_ids"], item["first_token"],
                                           request_params(item), item["kv_layers"], item.get("generator_state"))
        except BaseException:
            if release is not None:
                release()
            raise
        if release is not None:
            if seq.kv_import is None:  # nothing to copy (the first token ended it)
                release()
            else:
                seq.kv_imported = release
        return seq

    def _loop(self) -> None:
        eng = self.engine
        while True:
            try:
                block = not eng.has_unfinished()
                try:
                    kind, item, fut = self.inbox.get(timeout=0.5 if block else 0.0) if block else self.inbox.get_nowait()
                    self._admit(kind, item, fut)
                    while True:
                        kind, item, fut = self.inbox.get_nowait()
                        self._admit(kind, item, fut)
                except queue.Empty:
                    pass
                if not eng.has_unfinished():
                    continue
                t0 = time.perf_counter()
                finished = eng.step()
                self.busy_s += time.perf_counter() - t0
                for seq in finished:
                    entry = self.futures.pop(id(seq), None)
                    if entry is None:
                        continue
                    fut, _ = entry
                    try:
                        fut.set_result(self._result(seq))
                    except Exception as e:  # e.g. its KV could not be handed over: it fails alone
                        self._drop_transfer(seq)
                        fut.set_exception(e)
            except Exception as e:  # engine failure: fail every pending call, keep serving
                log.exception("engine step failed")
                self.error = e
                for fut, seq in self.futures.values():
                    self._drop_transfer(seq)
                    if not fut.done():
                        fut.set_exception(e)
                self.futures.clear()
                eng.scheduler.abort_all()

    @staticmethod
    def _drop_transfer(seq) -> None:
        """A failed sequence's KV stream (prefill) or imported views (decode) are let go."""
        sink, seq.kv_sink = seq.kv_sink, None
        if sink is not None:
            sink.abort()
        done, seq.kv_imported = seq.kv_imported, None
        if done is not None:
            done()

    def transport(self, name: str):
        if name not in self._transports:
            from dlbatch.transfer.choose import get_transport

            self._transports[name] = get_transport(name, same_node=True, device=self.device)
        return self._transports[name]

    @staticmethod
    def _wall(perf: float | None) -> float | None:
        """A perf_counter stamp of this process as wall-clock time (time.time)."""
        return None if perf is None else perf + (time.time() - time.perf_counter())

    def _result(self, seq) -> dict:
        if self.role == "prefill":
            via, kv = self.kv_via, None
            sink, seq.kv_sink = seq.kv_sink, None
            if seq.pd_finish is not None:  # the first token ended it: no decode, no KV to move
                if sink is not None:
                    sink.abort()
            elif sink is not None:
                kv = sink.finish(timeout=self.spec.kv_timeout_s)  # the handle the decode worker pulls with
            elif via == "rdt":
                self._keep_for_rdt(seq.seq_id, seq.kv_export)
            seq.kv_export = None
            return {"kv_via": via, "request_id": seq.seq_id, "token_ids": list(seq.prompt_ids), "first_token": seq.output_ids[0],
                    "finish_reason": seq.pd_finish, "generator_state": seq.generator_state, "kv": kv,
                    "ttft_s": (seq.first_token_time - seq.arrival) if seq.first_token_time else None,
                    "t_first_token": self._wall(seq.first_token_time), "cached_tokens": seq.num_cached}
        out = self.engine.to_output(seq)
        return {"request_id": out.request_id, "output": out.text, "output_ids": out.token_ids,
                "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
                "output_tokens": len(out.token_ids), "cached_tokens": out.cached_tokens,
                "ttft_s": out.metrics.get("ttft_s"), "latency_s": out.metrics.get("latency_s"),
                "t_first_token": self._wall(seq.first_token_time), "t_done": time.time()}

    # ---- RDT: the tensors stay here until the decode worker pulls them ----------------------
    def _keep_for_rdt(self, request_id: str, layers) -> None:
        with self._rdt_lock:
            self._rdt_kept[request_id] = layers
            while len(self._rdt_kept) > RDT_KEEP:
                old = next(iter(self._rdt_kept))
                self._rdt_kept.pop(old)
                log.warning("dropped the KV of request %s: not pulled over RDT among the last %d", old, RDT_KEEP)

    def rdt_export(self, prefilled: list[dict]) -> dict:
        """{request_id: rdt.pack(meta, layers)} for the prefilled requests that need a decode."""
        from dlbatch.transfer import rdt
        from dlbatch.transfer.payload import dtype_name, make_meta

        c = self.engine.mconf
        out = {}
        with self._rdt_lock:
            for p in prefilled:
                layers = self._rdt_kept.pop(p["request_id"], None)
                if layers is None:
                    continue  # failed, finished at its first token, or not ours
                meta = make_meta(self.llm.fingerprint, dtype_name(layers[0].dtype), c.num_layers, layers[0].shape[1],
                                 c.num_kv_heads, c.head_dim)
                out[p["request_id"]] = rdt.pack(meta, layers)
        return out

    def run_batch(self, kind: str, items: list[dict], timeout: float) -> list[dict]:
        futs = [self.submit(kind, it) for it in items]
        out = []
        deadline = time.monotonic() + timeout
        for it, f in zip(items, futs):
            try:
                out.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except Exception as e:  # report per request, never lose one silently
                out.append({"request_id": it["request_id"], "error": f"{type(e).__name__}: {e}"})
        return out

    def stats(self) -> dict:
        st = self.llm.stats()
        bm = self.engine.block_manager
        st.update(role=self.role, pid=os.getpid(), busy_s=self.busy_s, uptime_s=time.time() - self.started,
                  free_blocks=bm.num_available, total_blocks=bm.num_blocks, running=len(self.engine.scheduler.running),
                  waiting=len(self.engine.scheduler.waiting), fingerprint=self.llm.fingerprint)
        return st


class _WorkerBase:
    ROLE = "colocated"

    def __init__(self, spec: WorkerSpec):
        self.t_init = time.time()
        self.loop = EngineLoop(spec, self.ROLE)
        self.t_ready = time.time()
        self.faults = _drill_faults()

    def _before_call(self, items) -> None:
        if self.faults is not None:
            self.faults.before_call(self.ROLE, items)

    def ping(self) -> dict:
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {"pid": os.getpid(), "role": self.ROLE, "fingerprint": self.loop.llm.fingerprint, "node_id": node,
                "t_process": _process_start(), "t_init": self.t_init, "t_ready": self.t_ready}

    def shm_cleanup(self, close: bool = False) -> list[str]:
        """kv_transport=shm: sweep this node's segments of dead processes; ``close``: also
        unlink this worker's pooled segments (a graceful stop before ray.kill)."""
        from dlbatch.transfer import shm

        return shm.cleanup(close=close)

    def stats(self) -> dict:
        return self.loop.stats()

    def device_info(self) -> dict:
        return device_info(self.loop.device)


class ColocatedWorkerImpl(_WorkerBase):
    ROLE = "colocated"

    def generate(self, items: list[dict], timeout: float = 3600.0) -> list[dict]:
        self._before_call(items)
        return self.loop.run_batch("generate", items, timeout)


class PrefillWorkerImpl(_WorkerBase):
    ROLE = "prefill"

    def prefill(self, items: list[dict], timeout: float = 3600.0) -> list[dict]:
        self._before_call(items)
        return self.loop.run_batch("prefill", items, timeout)

    def rdt_export(self, prefilled: list[dict]) -> dict:
        """kv_transport=rdt: call with ``.options(tensor_transport=backend)`` after ``prefill``
        (pass its ObjectRef, so this runs once it is done); the tensors move from here to
        the decode worker that receives the returned ref as a top-level argument."""
        return self.loop.rdt_export(prefilled)


class DecodeWorkerImpl(_WorkerBase):
    ROLE = "decode"

    def decode_rdt(self, kv: dict, prefilled: list[dict], items: list[dict], timeout: float = 3600.0) -> list[dict]:
        """kv_transport=rdt: ``kv`` is the prefill worker's ``rdt_export`` result (moved by
        Ray's tensor transport); otherwise as ``decode``."""
        from dlbatch.transfer import rdt

        joined = []
        for p in prefilled:
            if "error" not in p and p.get("finish_reason") is None:
                obj = kv.get(p["request_id"])
                if obj is None:
                    p = {"request_id": p["request_id"], "error": "TransferError: the prefill worker had no KV for "
                         f"request {p['request_id']} to send over RDT (restarted, or the KV was dropped)"}
                else:
                    try:
                        # checked here (fingerprint, shapes, dtype); the tensors stay where the
                        # collective put them (the device) and go straight into the cache
                        _, tensors = rdt.unpack(obj, expected_fingerprint=self.loop.llm.fingerprint)
                        p = {**p, "kv": None, "kv_layers": list(tensors), "kv_release": None}
                    except Exception as e:
                        p = {"request_id": p["request_id"], "error": f"{type(e).__name__}: {e}"}
            joined.append(p)
        return self.decode(joined, items, timeout)

    def decode(self, prefilled: list[dict], items: list[dict], timeout: float = 3600.0) -> list[dict]:
        """`prefilled` (from a prefill worker, resolved by Ray from its ObjectRef) joined with
        the original `items` (sampling params) by request id. Each request's KV is pulled
        through the transport its handle names, here on the calling thread, as zero-copy
        views where the transport allows; the engine copies them into its blocks."""
        self._before_call(items)
        by_id = {it["request_id"]: it for it in items}
        work, out = [], {}
        for p in prefilled:
            base = by_id.get(p["request_id"], {})
            if "error" in p:
                out[p["request_id"]] = p
                continue
            if p.get("finish_reason") is not None:  # first token ended it
                text = self.loop.llm.tokenizer.decode([] if p["finish_reason"] == "stop" else [p["first_token"]])
                out[p["request_id"]] = {"request_id": p["request_id"], "output": text, "output_ids": [p["first_token"]],
                                        "finish_reason": p["finish_reason"], "prompt_tokens": len(p["token_ids"]),
                                        "output_tokens": 1, "cached_tokens": p.get("cached_tokens", 0),
                                        "ttft_s": p.get("ttft_s"), "latency_s": p.get("ttft_s"),
                                        "t_first_token": p.get("t_first_token"), "t_done": p.get("t_first_token")}
                continue
            if p.get("kv_layers") is not None:  # RDT: already received and checked
                work.append({**base, **p})
                continue
            try:
                work.append(self.loop.receive_kv({**base, **p}))
            except Exception as e:  # a lost, corrupt or foreign payload fails its request, clearly
                out[p["request_id"]] = {"request_id": p["request_id"], "error": f"{type(e).__name__}: {e}"}
        for r in self.loop.run_batch("decode", work, timeout):
            src = next((p for p in prefilled if p["request_id"] == r["request_id"]), {})
            if "error" not in r:
                r["ttft_s"] = src.get("ttft_s")
                r["t_first_token"] = src.get("t_first_token")  # the prefill worker's clock
                r["cached_tokens"] = src.get("cached_tokens", 0)
            out[r["request_id"]] = r
        return [out[it["request_id"]] for it in items if it["request_id"] in out]


def _drill_faults():
    """The fault drills' injected faults (`dlbatch.testing.faults`), only when their
    environment variable is set: in a job, always None."""
    if not os.environ.get("DLBATCH_TEST_FAULTS"):
        return None
    from dlbatch.testing.faults import WorkerFaults

    return WorkerFaults.from_env()


def _process_start() -> float | None:
    """Wall-clock start of this process (the worker's own start-up: Python, imports)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil missing or /proc unreadable: the start-up breakdown does without
        return None


def make_worker_class(role: str, tensor_transport: bool = False):
    """The Ray actor class for ``role``; ``tensor_transport=True`` for kv_transport=rdt."""
    import ray

    impl = {"colocated": ColocatedWorkerImpl, "prefill": PrefillWorkerImpl, "decode": DecodeWorkerImpl}[role]
    if tensor_transport:
        return ray.remote(max_concurrency=64, enable_tensor_transport=True)(impl)
    return ray.remote(max_concurrency=64)(impl)

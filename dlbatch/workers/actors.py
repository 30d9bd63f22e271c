"""Ray actors that own one inference engine each: colocated (prefill + decode), prefill-only
(exports KV) and decode-only (imports KV). Each runs its engine in one loop thread
(`dlbatch.workers.engine_loop.EngineLoop`) so that requests from many concurrent calls share
continuous batching; calls block until their own requests finish. Placed by resources: a
pool's chip `fast` asks for `{"chip:fast": 1}`. The prefill and decode actors use only the
declared KV half of the backend contract (`dlbatch.backends.DisaggregatedBackend`:
``rdt_export``, ``receive_kv``, ``first_token_result``, ``fingerprint``).

The module imports Ray lazily; `make_worker_class(role)` returns the remote class.
"""
from __future__ import annotations

import os
import time

from dlbatch.backends import WorkerSpec
from dlbatch.workers.engine_loop import EngineLoop


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


class _WorkerBase:
    ROLE = "colocated"

    def __init__(self, spec: WorkerSpec):
        self.t_init = time.time()
        self.loop = EngineLoop(spec, self.ROLE, local_device(spec.engine.device))
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
            if p.get("finish_reason") is not None:  # first token ended it: the row, no decode
                out[p["request_id"]] = self.loop.backend.first_token_result(p, base)
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

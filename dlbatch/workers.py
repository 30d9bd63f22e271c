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
from dataclasses import dataclass

log = logging.getLogger("dlbatch.workers")


@dataclass(frozen=True)
class WorkerSpec:
    model: str
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_model_len: int = 4096
    chat: bool | None = None
    kv_cache_memory: str | int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    num_threads: int = 1
    block_size: int = 16
    storage_options: dict | None = None
    kv_transport: str = "object_store"  # how prefill workers hand KV to decode workers


def request_params(r: dict):
    from dlbatch import SamplingParams

    return SamplingParams(max_tokens=int(r["max_tokens"]), temperature=float(r.get("temperature", 0.0)),
                          top_p=float(r.get("top_p", 1.0)), top_k=int(r.get("top_k", 0)), seed=r.get("seed"),
                          ignore_eos=bool(r.get("ignore_eos", False)))


class EngineLoop:
    """Owns an LLM; one thread runs `step()` while calls enqueue work and wait on futures."""

    def __init__(self, spec: WorkerSpec, role: str):
        import torch

        from dlbatch import LLM

        torch.set_num_threads(max(1, spec.num_threads))
        self.role = role
        self.spec = spec
        self.llm = LLM(spec.model, dtype=spec.dtype, device=spec.device, max_model_len=spec.max_model_len,
                       chat=spec.chat, kv_cache_memory=spec.kv_cache_memory, block_size=spec.block_size,
                       max_num_batched_tokens=spec.max_num_batched_tokens, max_num_seqs=spec.max_num_seqs,
                       storage_options=spec.storage_options)
        self.engine = self.llm.engine
        self.inbox: queue.Queue = queue.Queue()
        self.futures: dict[int, tuple[Future, object]] = {}
        self.busy_s = 0.0
        self.started = time.time()
        self.error: BaseException | None = None
        self._transports: dict = {}
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
            elif kind == "decode":
                seq = self._import(item)
            else:  # pragma: no cover
                raise ValueError(kind)
        except Exception as e:  # a bad request fails alone
            fut.set_exception(e)
            return
        self.futures[id(seq)] = (fut, seq)

    def _import(self, item):
        from dlbatch.transfer.payload import layer_to_torch, validate

        payload = item["kv"]
        via = item.get("kv_via", "object_store")
        if via != "object_store":  # a handle: pull the payload through that transport
            payload = self.transport(via).receive(payload, timeout=120, expected_fingerprint=self.llm.fingerprint)
        validate(payload, expected_fingerprint=self.llm.fingerprint)
        layers = [layer_to_torch(payload, i) for i in range(payload.meta.num_layers)]
        return self.engine.add_imported(item["request_id"], item["token_ids"], item["first_token"],
                                        request_params(item), layers, item.get("generator_state"))

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
                    fut.set_result(self._result(seq))
            except Exception as e:  # engine failure: fail every pending call, keep serving
                log.exception("engine step failed")
                self.error = e
                for fut, _ in self.futures.values():
                    if not fut.done():
                        fut.set_exception(e)
                self.futures.clear()
                eng.scheduler.abort_all()

    def transport(self, name: str):
        if name not in self._transports:
            from dlbatch.transfer.base import get_transport

            self._transports[name] = get_transport(name, same_node=True, device=self.spec.device)
        return self._transports[name]

    def _result(self, seq) -> dict:
        if self.role == "prefill":
            from dlbatch.transfer.payload import from_torch_layers

            kv = from_torch_layers(seq.kv_export, self.llm.fingerprint) if seq.kv_export is not None else None
            seq.kv_export = None
            # auto: the object store (works across nodes); shm/rdt/dlslime only when asked for
            via = self.spec.kv_transport if self.spec.kv_transport != "auto" else "object_store"
            if kv is not None and via != "object_store":
                kv = self.transport(via).send(kv)
            return {"kv_via": via, "request_id": seq.seq_id, "token_ids": list(seq.prompt_ids), "first_token": seq.output_ids[0],
                    "finish_reason": seq.pd_finish, "generator_state": seq.generator_state, "kv": kv,
                    "ttft_s": (seq.first_token_time - seq.arrival) if seq.first_token_time else None,
                    "cached_tokens": seq.num_cached}
        out = self.engine.to_output(seq)
        return {"request_id": out.request_id, "output": out.text, "output_ids": out.token_ids,
                "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
                "output_tokens": len(out.token_ids), "cached_tokens": out.cached_tokens,
                "ttft_s": out.metrics.get("ttft_s"), "latency_s": out.metrics.get("latency_s")}

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

    def __init__(self, spec: WorkerSpec, fail_on: str | None = None):
        self.loop = EngineLoop(spec, self.ROLE)
        self.fail_on = fail_on  # tests: a request id whose processing kills this process

    def _maybe_die(self, items):
        if self.fail_on and any(self.fail_on in it["request_id"] for it in items):
            os._exit(1)

    def ping(self) -> dict:
        return {"pid": os.getpid(), "role": self.ROLE, "fingerprint": self.loop.llm.fingerprint}

    def stats(self) -> dict:
        return self.loop.stats()


class ColocatedWorkerImpl(_WorkerBase):
    ROLE = "colocated"

    def generate(self, items: list[dict], timeout: float = 3600.0) -> list[dict]:
        self._maybe_die(items)
        return self.loop.run_batch("generate", items, timeout)


class PrefillWorkerImpl(_WorkerBase):
    ROLE = "prefill"

    def prefill(self, items: list[dict], timeout: float = 3600.0) -> list[dict]:
        self._maybe_die(items)
        return self.loop.run_batch("prefill", items, timeout)


class DecodeWorkerImpl(_WorkerBase):
    ROLE = "decode"

    def decode(self, prefilled: list[dict], items: list[dict], timeout: float = 3600.0) -> list[dict]:
        """`prefilled` (from a prefill worker, resolved by Ray from its ObjectRef: the KV
        arrays are zero-copy views of the object store) joined with the original `items`
        (sampling params) by request id."""
        self._maybe_die(items)
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
                                        "ttft_s": p.get("ttft_s"), "latency_s": p.get("ttft_s")}
                continue
            work.append({**base, **p})
        for r in self.loop.run_batch("decode", work, timeout):
            src = next((p for p in prefilled if p["request_id"] == r["request_id"]), {})
            if "error" not in r:
                r["ttft_s"] = src.get("ttft_s")
                r["cached_tokens"] = src.get("cached_tokens", 0)
            out[r["request_id"]] = r
        return [out[it["request_id"]] for it in items if it["request_id"] in out]


def make_worker_class(role: str):
    import ray

    impl = {"colocated": ColocatedWorkerImpl, "prefill": PrefillWorkerImpl, "decode": DecodeWorkerImpl}[role]
    return ray.remote(max_concurrency=64)(impl)

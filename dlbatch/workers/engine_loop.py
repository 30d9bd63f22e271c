"""The engine loop of a worker: one thread owns the worker's engine backend and steps it,
while the actor's calls (many at once: the actor is threaded) enqueue requests and wait on
futures, so the requests of many in-flight batches share continuous batching.

Invariants: the backend is built and stepped in the same thread (torch's and OpenMP's
thread settings, vLLM-CPU's thread binding are per thread); every request submitted gets
its future resolved (a result, or an exception: a bad request fails alone, an engine
failure fails every pending request and the loop keeps serving), or is aborted in the
engine when its call gives up on it (`cancel`).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future

from dlbatch.backends import WorkerSpec

log = logging.getLogger("dlbatch.workers.engine_loop")


class EngineLoop:
    """Owns one engine backend (dlbatch/backends); one thread runs its `step()` while calls
    enqueue requests and wait on futures, so the requests of many concurrent calls share
    continuous batching. A request that fails fails alone; an engine failure fails every
    pending request and the loop keeps serving."""

    def __init__(self, spec: WorkerSpec, role: str, device: str):
        """``device``: where the engine runs, as this process sees it (`actors.local_device`)."""
        self.role = role
        self.device = device
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

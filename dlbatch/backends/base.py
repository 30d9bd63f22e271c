"""The engine-backend interface: what a worker (dlbatch/driver/workers.py) asks of the engine
it owns, whichever engine that is.

A backend is driven by one thread (the worker's `EngineLoop`):

    key = backend.add(kind, item)     # a request: token ids + sampling; raises if it is bad
    while backend.has_unfinished():
        for key, result in backend.step():   # finished requests: a result dict or an exception
            ...
    backend.abort(keys)               # give up requests (a call that timed out)
    backend.abort_all()               # after an engine failure: the engine is left empty

``kind`` is a request's role: "generate" (colocated), "prefill" (KV exported, first token)
or "decode" (KV imported); `roles` says which worker roles a backend can fill. ``item`` is
the driver's request dict: ``request_id``, ``token_ids`` (our templates and tokenizer are
the single source of truth, so every backend sees the same tokens), ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``ignore_eos``, ``constraint`` ({"kind":
json_schema|regex|choices|grammar, "spec": ...}). A finished generate/decode request's
result is `result_row` 's dict; the driver, router, map-reduce, structured columns, commits
and report read only that, so they do not know which backend ran.

``stats()`` reports at least ``prefix_hit_tokens``, ``prefix_query_tokens``,
``kv_usage`` (0..1 of the KV cache in use), ``running``, ``waiting`` and ``fingerprint``.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod


class BackendUnavailable(ValueError):
    """The job names a backend this environment cannot run (not installed, or a role it lacks)."""


class EngineBackend(ABC):
    name: str = ""
    roles: tuple[str, ...] = ("colocated",)

    fingerprint: str  # the model's identity: PD peers and a resume must agree on it
    tokenizer: object  # dlbatch.engine.tokenizer.Tokenizer of the model (decodes first tokens)

    @abstractmethod
    def add(self, kind: str, item: dict) -> object:
        """Admit one request; -> its key. Raises (ValueError, ...) for a request that is bad alone."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def step(self) -> list[tuple[object, object]]:
        """One engine step; -> [(key, result dict or exception)] of the requests it finished."""

    @abstractmethod
    def abort(self, keys) -> None:
        """Drop these requests (finished or unknown keys are ignored)."""

    @abstractmethod
    def abort_all(self) -> list[object]:
        """Drop every request; -> their keys."""

    @abstractmethod
    def stats(self) -> dict: ...

    def close(self) -> None:
        """Let go of the engine's resources (the worker is stopping)."""


def wall(perf: float | None) -> float | None:
    """A perf_counter stamp of this process as wall-clock time (time.time)."""
    return None if perf is None else perf + (time.time() - time.perf_counter())


def result_row(request_id: str, text: str, output_ids: list[int], finish_reason: str, prompt_tokens: int,
               cached_tokens: int, ttft_s: float | None, latency_s: float | None,
               t_first_token: float | None) -> dict:
    """A finished request as every backend reports it (wall-clock times, seconds)."""
    return {"request_id": request_id, "output": text, "output_ids": list(output_ids), "finish_reason": finish_reason,
            "prompt_tokens": prompt_tokens, "output_tokens": len(output_ids), "cached_tokens": cached_tokens,
            "ttft_s": ttft_s, "latency_s": latency_s, "t_first_token": t_first_token, "t_done": time.time()}

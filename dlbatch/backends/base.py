"""The engine-backend interface: what a worker (dlbatch/workers/actors.py) asks of the engine
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
``temperature``, ``top_p``, ``top_k``, ``seed``, ``ignore_eos``, ``stop``, ``constraint``
({"kind": json_schema|regex|choices|grammar, "spec": ...}), and the optional sampling extras
(absent or None: off, and the output is what it was without them):

- ``min_p`` (float in [0, 1], 0 off): tokens whose probability (after temperature) is below
  min_p x the most likely token's are dropped (vLLM's min-p).
- ``repetition_penalty`` (float > 0, 1 off): logits of tokens seen in the prompt or the output
  are divided by it when positive, multiplied when negative (HF / vLLM).
- ``presence_penalty``, ``frequency_penalty`` (floats in [-2, 2], 0 off; OpenAI's, over the
  output tokens only): logit -= presence x [count > 0] + frequency x count.
- ``logprobs`` (int k >= 0): each output token's log-probability and the k most likely
  tokens, from the model's raw distribution (vLLM's default ``raw_logprobs``: before
  penalties, temperature and the top-k/top-p/min-p filters; after a constraint's mask).
- ``n`` (int >= 1): n independent samples of the prompt, sample i seeded ``seed + i`` (seed
  None: unseeded), so sample 0 is the n = 1 request's output. Colocated only: a prefill or
  decode request with n > 1 is refused by `add` (ValueError "n > 1 runs on colocated workers").

A finished generate/decode request's result is `result_row` 's dict: ``request_id``,
``output``, ``output_ids``, ``finish_reason``, ``prompt_tokens``, ``output_tokens``,
``cached_tokens``, ``ttft_s``, ``latency_s``, ``t_first_token``, ``t_done``, and when asked:
``logprobs``, a list with one entry per output token (EOS included when it ended the output)
``{"token": str, "token_id": int, "logprob": float, "top": [{"token", "token_id",
"logprob"}, ... k, highest first]}`` (``token`` is our tokenizer's text of that one token);
``samples`` (n > 1 only), n dicts ``{output, output_ids, output_tokens, finish_reason,
logprobs}``, the first being the top-level fields' sample (logprobs None when not asked).
The driver, router, map-reduce, structured columns, commits and report read only that, so
they do not know which backend ran.

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
               t_first_token: float | None, logprobs: list | None = None, samples: list | None = None) -> dict:
    """A finished request as every backend reports it (wall-clock times, seconds); ``logprobs``
    and ``samples`` (see the module's docstring) only when the request asked for them."""
    row = {"request_id": request_id, "output": text, "output_ids": list(output_ids), "finish_reason": finish_reason,
           "prompt_tokens": prompt_tokens, "output_tokens": len(output_ids), "cached_tokens": cached_tokens,
           "ttft_s": ttft_s, "latency_s": latency_s, "t_first_token": t_first_token, "t_done": time.time()}
    if logprobs is not None:
        row["logprobs"] = logprobs
    if samples is not None:
        row["samples"] = samples
    return row


def sample_row(text: str, output_ids: list[int], finish_reason: str, logprobs: list | None) -> dict:
    """One of the n samples of a request (its result's ``samples``)."""
    return {"output": text, "output_ids": list(output_ids), "output_tokens": len(output_ids),
            "finish_reason": finish_reason, "logprobs": logprobs}


SAMPLING_EXTRAS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "n")


def sampling_extras(item: dict) -> dict:
    """The extras an item sets ({name: value}; absent or None: off), as given: each backend's
    sampling parameters check them."""
    return {k: item[k] for k in SAMPLING_EXTRAS if item.get(k) is not None}

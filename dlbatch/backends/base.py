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

Besides the running engine, a backend class owns its configuration, asked of the class
(no engine is built, no heavy package imported until a method needs it), so no other
package branches on a backend's name (`dlbatch.backends.REGISTRY` maps names to classes):

- ``unavailable_reason()``: why it cannot run in this environment (None: it can);
- ``validate_model(model)``: cheap checks of a job's model section at job load (no model
  files read), ``check_model(model, hf_config)``: the full checks before a run (its engine
  arguments, the model's architecture, an explicit max_model_len against the context);
- ``limits(model, hf_config)``: the context length it runs the model with and the worker
  roles it fills (`ModelLimits`), one rule for job load, the prompt stage and the workers;
- ``devices_per_replica(model)``: the devices one worker drives (a GPU pool's ``num_gpus``);
- ``check_pool(model, role, pool)``: a pool's ``num_gpus`` against those devices, at job load
  for the pools a job names and at run resolve for every pool (a plan's, the solver's);
- ``worker_spec(model, pool, ...)``: what each worker of a pool builds (`WorkerSpec`).

A backend that fills the prefill and decode roles implements `DisaggregatedBackend`, the
KV half of the contract.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from dlbatch.backends.worker_spec import WorkerSpec, engine_config

PD_ROLES = ("prefill", "decode")


class BackendUnavailable(ValueError):
    """The job names a backend this environment cannot run (not installed, or a role it lacks)."""


@dataclass(frozen=True)
class ModelLimits:
    """What a backend runs a model with: ``max_model_len`` (prompt + output tokens of one
    request), where that number comes from (``source``, for messages naming it) and the
    worker roles the backend fills."""

    max_model_len: int
    source: str
    roles: tuple[str, ...]


class EngineBackend(ABC):
    name: str = ""
    roles: tuple[str, ...] = ("colocated",)
    pd_note: str = ""  # why the backend runs no prefill/decode pools, said when a job asks for them
    # what a request may carry besides token ids (docs/adapters.md, docs/multimodal.md): a LoRA
    # adapter (item["adapter"]) and image inputs (item["images"]); a job asking for what its
    # backend lacks is refused at load with `feature_note`
    runs_adapters: bool = False
    runs_images: bool = False
    feature_note: str = ""

    fingerprint: str  # the model's identity: PD peers and a resume must agree on it
    tokenizer: object  # dlbatch.engine.tokenizer.Tokenizer of the model (decodes first tokens)

    # ---- the class: configuration, before any engine exists ---------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run in this environment (a package missing), or None."""
        return None

    @classmethod
    def validate_model(cls, model) -> None:
        """At job load: what can be checked of the job's ``model`` section without reading the
        model or importing the engine; raises ValueError naming the bad value."""
        cls.check_features(adapters=bool(model.adapters))

    @classmethod
    def check_features(cls, adapters: bool = False, images: bool = False) -> None:
        """Refuse, naming why, a job whose requests carry adapters or images this backend does
        not run (``adapters``/``images``: whether the job's requests do)."""
        for asked, runs, what in ((adapters, cls.runs_adapters, "LoRA adapters (model.adapters)"),
                                  (images, cls.runs_images, "image inputs (tasks' images:, OpenAI batch image parts)")):
            if asked and not runs:
                raise ValueError(f"{what}: model.backend {cls.name} does not run them. {cls.feature_note}")

    @classmethod
    def check_model(cls, model, hf_config: dict) -> None:
        """Before a run: the job's ``model`` section against the model's ``config.json``
        (``hf_config``): its engine_args are this backend's own, it runs the architecture, an
        explicit max_model_len is within the model's context. Raises ValueError naming the
        problem. Asked once `unavailable_reason` said the backend is installed."""
        limit = cls.longest_context(hf_config)
        if model.max_model_len and model.max_model_len > limit:
            raise ValueError(f"model.max_model_len {model.max_model_len} exceeds the context of {model.ref!r} "
                             f"({limit} tokens, its config.json)")

    @classmethod
    def longest_context(cls, hf_config: dict) -> int:
        """The longest max_model_len this backend accepts for the model of ``hf_config``."""
        from dlbatch.engine.loader import context_length

        return context_length(hf_config)

    @classmethod
    def limits(cls, model, hf_config: dict | None) -> ModelLimits:
        """The one rule for the context length: the job's ``model.max_model_len``; else the
        model's context (its config.json, ``hf_config``) capped at DEFAULT_MAX_MODEL_LEN;
        ``hf_config`` None (not read: at job load, a model not at hand) gives the cap, an
        upper bound of what the run will use."""
        from dlbatch.engine.config import DEFAULT_MAX_MODEL_LEN
        from dlbatch.engine.loader import context_length

        if model.max_model_len:
            return ModelLimits(model.max_model_len, "model.max_model_len", cls.roles)
        context = context_length(hf_config) if hf_config is not None else None
        if context is not None and context < DEFAULT_MAX_MODEL_LEN:
            return ModelLimits(context, f"the model's context ({model.name!r} config.json)", cls.roles)
        return ModelLimits(DEFAULT_MAX_MODEL_LEN, "the engines' default max_model_len", cls.roles)

    @classmethod
    def devices_per_replica(cls, model) -> int:
        """Accelerator devices one worker (replica) drives for the job's ``model`` section:
        the ``num_gpus`` of a worker on a GPU pool. One engine per device: 1."""
        return 1

    @classmethod
    def check_pool(cls, model, role: str, pool) -> None:
        """A pool of ``role`` (a job `PoolSpec` section) against the job's ``model``: each of
        its workers asks Ray for the devices it drives. One engine per device: ``num_gpus`` at
        most 1 (a fraction puts several engines on one GPU); more GPUs are more replicas.
        Raises ValueError naming both values."""
        need = cls.devices_per_replica(model)
        if pool.num_gpus > need:
            raise ValueError(f"cluster.{role}.num_gpus {pool.num_gpus:g}: a model.backend {cls.name} engine drives "
                             f"{need} device per replica (num_gpus <= {need}; a fraction shares one GPU); "
                             f"for more GPUs raise cluster.{role}.replicas")

    @classmethod
    def worker_spec(cls, model, pool, *, max_model_len: int, max_batch_tokens: int, num_threads: int) -> WorkerSpec:
        """What each worker of ``pool`` (a job's pool section) builds for the job's ``model``
        section: the engine configuration with the run's ``max_model_len``; the job's
        engine_args are this backend's own arguments, passed as they are."""
        return WorkerSpec(model=model.ref, engine=engine_config(model, pool, max_model_len, max_batch_tokens),
                          backend=cls.name, engine_args=dict(model.engine_args), chat=model.chat,
                          num_threads=num_threads)

    # ---- the running engine -----------------------------------------------------------------
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


class DisaggregatedBackend(EngineBackend):
    """The prefill/decode half of the contract: a backend that fills the prefill and decode
    roles moves a request's KV from the prefill worker's engine to the decode worker's.

    A prefill request's result is not a row but a handle: ``request_id``, ``token_ids``,
    ``first_token`` (and ``first_logprobs``), ``finish_reason`` (set when the first token
    ended the request: no decode follows), ``generator_state``, ``kv`` / ``kv_via`` (how
    the decode worker pulls the KV), ``ttft_s``, ``t_first_token``, ``cached_tokens``. The
    decode worker gets that handle and the original item, and either builds the row at once
    (`first_token_result`) or imports the KV (`receive_kv`) and adds a "decode" request.

    Invariants: every KV payload carries ``fingerprint`` and an import refuses one of
    another model; the tensors a prefill worker keeps for a pull (`rdt_export`) are let go
    once pulled or dropped.
    """

    roles = ("colocated", *PD_ROLES)

    fingerprint: str  # carried by every KV payload; a decode worker refuses another model's KV

    @abstractmethod
    def rdt_export(self, prefilled: list[dict]) -> dict:
        """kv_transport=rdt, prefill side: {request_id: packed KV} of the ``prefilled``
        requests that need a decode (Ray's tensor transport moves the tensors)."""

    @abstractmethod
    def receive_kv(self, item: dict) -> dict:
        """Decode side, on the calling thread (not the engine's): pull the KV that the
        prefill handle in ``item`` names; -> the item ready for ``add("decode", ...)``."""

    @abstractmethod
    def first_token_result(self, prefilled: dict, item: dict) -> dict:
        """The result row (`result_row`, logprobs included when ``item`` asked for them) of a
        request whose first token ended it on the prefill worker (``prefilled``'s
        ``finish_reason`` is set): nothing to decode, no KV to move."""


def wall(perf: float | None) -> float | None:
    """A perf_counter stamp of this process as wall-clock time (time.time)."""
    return None if perf is None else perf + (time.time() - time.perf_counter())


def result_row(request_id: str, text: str, output_ids: list[int], finish_reason: str, prompt_tokens: int,
               cached_tokens: int, ttft_s: float | None, latency_s: float | None,
               t_first_token: float | None, logprobs: list | None = None, samples: list | None = None,
               t_done: float | None = None) -> dict:
    """A finished request as every backend reports it (wall-clock times, seconds; ``t_done``
    None: now); ``logprobs`` and ``samples`` (see the module's docstring) only when the
    request asked for them."""
    row = {"request_id": request_id, "output": text, "output_ids": list(output_ids), "finish_reason": finish_reason,
           "prompt_tokens": prompt_tokens, "output_tokens": len(output_ids), "cached_tokens": cached_tokens,
           "ttft_s": ttft_s, "latency_s": latency_s, "t_first_token": t_first_token,
           "t_done": time.time() if t_done is None else t_done}
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

"""Per-worker capacity (documents/s) of a chip in each role, from its cost models.

* **prefill** worker: a stream of chunked prefill batches of ``chunk_tokens`` tokens;
  per document ``Tp = a * P / chunk_tokens + b * P + c * Q`` with ``P`` the tokens
  prefilled per document and ``Q`` the mean ``sum tokens*(cached + tokens/2)``
  (see :class:`~dlbatch.solver.workload.Workload`). Capacity ``1 / Tp``.
* **decode** worker: continuous batching at the largest batch that fits memory:
  ``docs = floor((memory - weights) / (kv_bytes * kv_tokens_per_doc))`` capped by
  ``max_batch / K``; batch ``B = K * docs`` sequences. Step time
  ``t(B) = a + b*B + c*B*ctx`` (``ctx`` the step-weighted mean context). It emits
  ``B / t(B)`` tokens/s, i.e. ``B / (t(B) * K * E[O])`` documents/s. Because
  ``B / t(B)`` increases with ``B`` whenever ``a > 0``, the largest batch is best.
* **colocated** worker: time-shares the two (prefill a document, then decode it
  within the running batch): duty split ``Tp : Td`` with ``Td = K*E[O]*t(B)/B``,
  capacity ``1 / (Tp + Td)`` (the harmonic combination of the two rates).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dlbatch.solver.profile import ChipProfile, ModelSpec
from dlbatch.solver.workload import Workload

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class RoleRates:
    chip: str
    prefill_s_per_doc: float          # Tp (inf when the chip cannot prefill a document)
    decode_s_per_doc: float           # Td at batch B (inf when no document fits)
    decode_batch: int                 # B, sequences
    decode_step_s: float              # t(B)
    kv_bytes_per_doc: float
    kv_capacity_docs: int             # documents whose KV fits next to the weights
    prefill_fits: bool
    decode_fits: bool

    def rate(self, role: str) -> float:
        if role == "prefill":
            return 1.0 / self.prefill_s_per_doc if self.prefill_fits else 0.0
        if role == "decode":
            return 1.0 / self.decode_s_per_doc if self.decode_fits else 0.0
        if role == "colocated":
            if not (self.prefill_fits and self.decode_fits):
                return 0.0
            return 1.0 / (self.prefill_s_per_doc + self.decode_s_per_doc)
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")


def role_rates(chip: ChipProfile, model: ModelSpec, workload: Workload, max_batch: int = 256,
               chunk_tokens: int = 8192) -> RoleRates:
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
    K = workload.tasks_per_doc
    kvb = model.kv_bytes_per_token
    free = chip.memory_bytes - model.weight_bytes
    a, b, c = chip.prefill.as_tuple()
    P = workload.prefill_tokens_per_doc
    Tp = a * P / chunk_tokens + b * P + c * workload.prefill_quad_per_doc
    max_prefill_kv = (max(workload.doc_tokens) + K * max(workload.suffix_tokens)) if workload.prefix_shared \
        else K * (max(workload.doc_tokens) + max(workload.suffix_tokens))
    prefill_fits = free >= max_prefill_kv * kvb and Tp > 0

    kv_doc_tokens = workload.kv_tokens_per_sequence * K
    docs_fit = int(math.floor(free / (kv_doc_tokens * kvb))) if free > 0 else 0
    decode_fits = free >= workload.max_kv_tokens_per_doc * kvb and docs_fit >= 1
    docs_running = min(docs_fit, max(1, max_batch // K)) if decode_fits else 0
    B = K * docs_running
    if decode_fits:
        step = chip.decode_step_time(B, B * workload.mean_decode_context)
        Td = K * workload.mean_output * step / B
        if step <= 0:
            decode_fits = False
    else:
        step, Td = math.inf, math.inf
    return RoleRates(chip=chip.name, prefill_s_per_doc=Tp if prefill_fits else math.inf,
                     decode_s_per_doc=Td if decode_fits else math.inf, decode_batch=B,
                     decode_step_s=step, kv_bytes_per_doc=workload.kv_tokens_transferred_per_doc * kvb,
                     kv_capacity_docs=max(docs_fit, 0), prefill_fits=prefill_fits, decode_fits=decode_fits)

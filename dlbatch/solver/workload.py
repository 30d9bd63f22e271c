"""The job the solver plans for: documents, K tasks per document, token lengths.

Each document has a prefix (its own tokens, ``D``); each of its ``K`` tasks adds a
suffix (the task instruction, ``S``) and generates ``O`` output tokens. Lengths are
given as samples; the solver uses their moments, the simulator draws from them.
Document, suffix and output lengths are treated as independent.

With ``prefix_shared`` the K tasks of a document reuse the document's KV (router
keeps them together, prefix cache / block sharing), so per document the prefill
computes ``D + K*S`` tokens and KV memory holds ``D`` once; otherwise every task
prefills and stores ``D + S`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


def _as_tokens(values: Sequence[int], what: str, allow_zero: bool) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ValueError(f"{what} must be a list of token counts, got {values!r}")
    if len(values) == 0:
        raise ValueError(f"{what} must not be empty")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (0 if allow_zero else 1):
            low = "an integer >= 0" if allow_zero else "an integer >= 1"
            raise ValueError(f"{what} entries must each be {low}, got {v!r}")
        out.append(int(v))
    return tuple(out)


@dataclass(frozen=True)
class Workload:
    """A batch job: ``n_docs`` documents, ``tasks_per_doc`` tasks each.

    ``doc_tokens``, ``suffix_tokens`` and ``output_tokens`` are samples of the
    per-document prefix length, per-task suffix length and per-task output length
    (output = ``max_tokens``: batch jobs reserve it, and the models assume it is used).
    """

    n_docs: int
    tasks_per_doc: int
    doc_tokens: tuple[int, ...]
    suffix_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    prefix_shared: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.n_docs, bool) or not isinstance(self.n_docs, (int, np.integer)) or self.n_docs < 1:
            raise ValueError(f"Workload n_docs must be an integer >= 1, got {self.n_docs!r}")
        if (isinstance(self.tasks_per_doc, bool) or not isinstance(self.tasks_per_doc, (int, np.integer))
                or self.tasks_per_doc < 1):
            raise ValueError(f"Workload tasks_per_doc must be an integer >= 1, got {self.tasks_per_doc!r}")
        object.__setattr__(self, "doc_tokens", _as_tokens(self.doc_tokens, "doc_tokens", allow_zero=False))
        object.__setattr__(self, "suffix_tokens", _as_tokens(self.suffix_tokens, "suffix_tokens", allow_zero=True))
        object.__setattr__(self, "output_tokens", _as_tokens(self.output_tokens, "output_tokens", allow_zero=False))
        if not isinstance(self.prefix_shared, bool):
            raise ValueError(f"Workload prefix_shared must be a bool, got {self.prefix_shared!r}")

    @classmethod
    def from_samples(cls, doc_tokens: Sequence[int], task_suffix_tokens: Sequence[int],
                     task_max_tokens: Sequence[int], n_docs: int, tasks_per_doc: int | None = None,
                     prefix_shared: bool = True) -> "Workload":
        """Build from token-count samples. ``tasks_per_doc`` defaults to
        ``len(task_suffix_tokens)`` (one entry per task of the job)."""
        k = len(task_suffix_tokens) if tasks_per_doc is None else tasks_per_doc
        return cls(n_docs=n_docs, tasks_per_doc=k, doc_tokens=tuple(doc_tokens),
                   suffix_tokens=tuple(task_suffix_tokens), output_tokens=tuple(task_max_tokens),
                   prefix_shared=prefix_shared)

    @classmethod
    def paper(cls, n_docs: int = 10_000) -> "Workload":
        """The scientific-paper job: ~6,000-token documents (spread 4,000-8,000),
        K=3 tasks (summary, keywords, QA) with short instructions, ~100 output tokens."""
        docs = tuple(int(x) for x in np.linspace(4000, 8000, 21))
        return cls(n_docs=n_docs, tasks_per_doc=3, doc_tokens=docs, suffix_tokens=(40, 30, 50),
                   output_tokens=(120, 60, 120), prefix_shared=True)

    # -- moments ------------------------------------------------------------------
    @property
    def mean_doc(self) -> float:
        return float(np.mean(self.doc_tokens))

    @property
    def mean_suffix(self) -> float:
        return float(np.mean(self.suffix_tokens))

    @property
    def mean_output(self) -> float:
        return float(np.mean(self.output_tokens))

    def _m2(self, xs: tuple[int, ...]) -> float:
        return float(np.mean(np.square(np.asarray(xs, dtype=float))))

    @property
    def prefill_tokens_per_doc(self) -> float:
        """Mean tokens prefilled per document (``D + K*S`` shared, ``K*(D+S)`` not)."""
        K = self.tasks_per_doc
        if self.prefix_shared:
            return self.mean_doc + K * self.mean_suffix
        return K * (self.mean_doc + self.mean_suffix)

    @property
    def prefill_quad_per_doc(self) -> float:
        """Mean of ``sum tokens * (cached + tokens/2)`` over a document's prefill chunks
        (the term multiplied by the prefill ``c`` coefficient)."""
        K = self.tasks_per_doc
        ed, es = self.mean_doc, self.mean_suffix
        ed2, es2 = self._m2(self.doc_tokens), self._m2(self.suffix_tokens)
        if self.prefix_shared:
            return ed2 / 2.0 + K * (es * ed + es2 / 2.0)
        return K * (ed2 + 2 * ed * es + es2) / 2.0

    @property
    def kv_tokens_transferred_per_doc(self) -> float:
        """KV tokens shipped prefill -> decode per document (what was prefilled)."""
        return self.prefill_tokens_per_doc

    @property
    def input_tokens_per_doc(self) -> float:
        """Logical prompt tokens per document, ``K * (D + S)`` (what a user is billed for)."""
        return self.tasks_per_doc * (self.mean_doc + self.mean_suffix)

    @property
    def output_tokens_per_doc(self) -> float:
        return self.tasks_per_doc * self.mean_output

    @property
    def mean_decode_context(self) -> float:
        """Step-weighted mean context of a decoding sequence: ``E[D] + E[S] + E[O^2]/(2 E[O])``
        (a sequence with more output spends more steps, at growing context)."""
        eo = self.mean_output
        return self.mean_doc + self.mean_suffix + self._m2(self.output_tokens) / (2.0 * eo)

    @property
    def kv_tokens_per_sequence(self) -> float:
        """Mean KV tokens reserved per running sequence (``D/K + S + O`` shared, ``D + S + O`` not)."""
        if self.prefix_shared:
            return self.mean_doc / self.tasks_per_doc + self.mean_suffix + self.mean_output
        return self.mean_doc + self.mean_suffix + self.mean_output

    @property
    def max_kv_tokens_per_doc(self) -> int:
        """KV tokens of the largest possible document (for the does-it-fit check)."""
        K = self.tasks_per_doc
        d, s, o = max(self.doc_tokens), max(self.suffix_tokens), max(self.output_tokens)
        return d + K * (s + o) if self.prefix_shared else K * (d + s + o)

    def summary(self) -> dict[str, Any]:
        return {
            "n_docs": int(self.n_docs), "tasks_per_doc": int(self.tasks_per_doc),
            "mean_doc_tokens": round(self.mean_doc, 1), "mean_suffix_tokens": round(self.mean_suffix, 1),
            "mean_output_tokens": round(self.mean_output, 1), "prefix_shared": self.prefix_shared,
            "prefill_tokens_per_doc": round(self.prefill_tokens_per_doc, 1),
            "output_tokens_per_doc": round(self.output_tokens_per_doc, 1),
            "mean_decode_context": round(self.mean_decode_context, 1),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"n_docs": int(self.n_docs), "tasks_per_doc": int(self.tasks_per_doc),
                "doc_tokens": list(self.doc_tokens), "suffix_tokens": list(self.suffix_tokens),
                "output_tokens": list(self.output_tokens), "prefix_shared": self.prefix_shared}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Workload":
        return cls(n_docs=d["n_docs"], tasks_per_doc=d["tasks_per_doc"], doc_tokens=tuple(d["doc_tokens"]),
                   suffix_tokens=tuple(d["suffix_tokens"]), output_tokens=tuple(d["output_tokens"]),
                   prefix_shared=bool(d.get("prefix_shared", True)))

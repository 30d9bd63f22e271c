"""A tiny model, a workload and chips with given per-document times, for the solver tests
(tests/test_solver.py, tests/test_simulate.py)."""
from __future__ import annotations

from dlbatch.solver import ChipProfile, CostModel, ModelSpec, Workload

TINY = ModelSpec(name="tiny", n_params=1000, weight_bytes=1000, n_layers=1, kv_heads=1, head_dim=1,
                 kv_dtype_bytes=1)
# one task per doc, 1000 prefix tokens, 100 output tokens: P = 1000 tokens, K*O = 100 tokens
WL = Workload(n_docs=1000, tasks_per_doc=1, doc_tokens=(1000,), suffix_tokens=(0,), output_tokens=(100,))


def chip(name, tp=0.1, td=0.1, price=1.0, memory=1e9, link=1e12):
    """A chip whose per-doc prefill time is ``tp`` and decode time ``td`` on WL."""
    return ChipProfile(name=name, source="measured", memory_bytes=memory, mem_bw=1e12, kv_link_bw=link,
                       price_per_hour=price, prefill=CostModel(0.0, tp / 1000.0, 0.0),
                       decode=CostModel(0.0, td / 100.0, 0.0), model="tiny")

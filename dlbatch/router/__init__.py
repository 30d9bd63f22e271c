"""dlbatch.router: prefix-aware grouping, duplicate folding and worker assignment.

Pure Python (no Ray, no torch). Entry points: `Router` (streaming windows),
`group_requests` / `fold_duplicates` / `assign_prefill` (one-shot), `choose_decode`.
"""
from dlbatch.router.assign import DecodeWorkerState, assign_prefill, blocks_needed, choose_decode
from dlbatch.router.cache_model import BlockLRU
from dlbatch.router.grouping import Group, Request, fold_duplicates, group_requests, make_sampling_key
from dlbatch.router.metrics import RouterStats, estimate_assignment
from dlbatch.router.policy import DEFAULT_ALPHA, POLICIES, RouterConfig, attention_alpha, prefill_cost
from dlbatch.router.prefix_index import PrefixIndex, PrefixMatch, block_hashes
from dlbatch.router.streaming import Router, Routing

__all__ = [
    "BlockLRU", "DEFAULT_ALPHA", "DecodeWorkerState", "Group", "POLICIES", "PrefixIndex", "PrefixMatch",
    "Request", "Router", "RouterConfig", "RouterStats", "Routing", "assign_prefill", "attention_alpha",
    "block_hashes", "blocks_needed", "choose_decode", "estimate_assignment", "fold_duplicates",
    "group_requests", "make_sampling_key", "prefill_cost",
]

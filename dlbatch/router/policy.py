"""Router configuration: which policy, block size, cost model and cache model.

`RouterConfig` is a frozen dataclass validated on construction; a bad value raises
`ValueError`/`TypeError` naming the field and the value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

POLICIES = ("prefix_aware", "round_robin", "least_loaded")

# Attention cost per (new token x attended position) relative to the linear cost of one
# token. For a decoder with P non-embedding parameters, L layers and attention width d:
# alpha ~= 2 * L * d / P (see `attention_alpha`). 1e-4 sits between small (~2.6e-4 for
# SmolLM2-135M) and 7B-class models (~4e-5).
DEFAULT_ALPHA = 1e-4


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"RouterConfig.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"RouterConfig.{name} must be >= {minimum}, got {value!r}")


def _check_float(name: str, value: object, minimum: float, *, strict: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"RouterConfig.{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        op = ">" if strict else ">="
        raise ValueError(f"RouterConfig.{name} must be finite and {op} {minimum}, got {value!r}")


@dataclass(frozen=True)
class RouterConfig:
    """How the router groups and places prefill work.

    policy: "prefix_aware" (groups sharing a prefix stay on one worker, groups placed by
        cost-balanced greedy), "round_robin" (request i -> worker i mod n) or
        "least_loaded" (each request to the least loaded worker, no affinity).
    block_size: tokens per KV block; must match the engine's block size, since prefix
        sharing is counted in full blocks.
    alpha: attention weight of the prefill cost model,
        cost = n_new + alpha * n_new * (n_cached + (n_new + 1) / 2).
    window: how many requests the pipeline hands the router at a time (`Router.route_stream`).
    cache_blocks_per_worker: prefix-cache capacity assumed per prefill worker, in blocks
        (the engine's free KV blocks); 0 models no prefix cache.
    split_fraction: a prefix group costing more than split_fraction x the mean per-worker
        load is split into sub-groups at its trie branch points.
    affinity_weight: extra weight on work a placement adds (recomputing a prefix another
        worker still caches) versus the finishing time it achieves; 0 is pure earliest-finish.
    fold_duplicates: fold exact duplicates (same prompt, max_tokens, sampling_key, with a
        deterministic key) into one request.
    """

    policy: str = "prefix_aware"
    block_size: int = 16
    alpha: float = DEFAULT_ALPHA
    window: int = 256
    cache_blocks_per_worker: int = 8192
    split_fraction: float = 0.5
    affinity_weight: float = 1.0
    fold_duplicates: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ValueError(f"RouterConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        _check_int("block_size", self.block_size, 1)
        _check_float("alpha", self.alpha, 0.0)
        _check_int("window", self.window, 1)
        _check_int("cache_blocks_per_worker", self.cache_blocks_per_worker, 0)
        _check_float("split_fraction", self.split_fraction, 0.0, strict=True)
        _check_float("affinity_weight", self.affinity_weight, 0.0)
        if not isinstance(self.fold_duplicates, bool):
            raise TypeError(f"RouterConfig.fold_duplicates must be a bool, got {self.fold_duplicates!r}")


def attention_alpha(num_params: float, num_layers: int, attn_width: int) -> float:
    """alpha for `RouterConfig` from a model's shape: 2 * layers * attention width / params.

    Linear layers cost ~2*P FLOPs per token; QK^T and AV cost ~4*d FLOPs per layer per
    attended position, so the ratio per (token, position) is 4*L*d / (2*P).
    """
    if isinstance(num_params, bool) or not isinstance(num_params, (int, float)) or not num_params > 0:
        raise ValueError(f"num_params must be a positive number, got {num_params!r}")
    for name, v in (("num_layers", num_layers), ("attn_width", attn_width)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    return 2.0 * num_layers * attn_width / float(num_params)


def prefill_cost(n_new: int, n_cached: int, alpha: float) -> float:
    """Prefill cost of computing n_new tokens after n_cached cached ones.

    cost(n_new, ctx) = n_new + alpha * n_new * ctx, with ctx the mean context a new token
    attends to under causal attention: n_cached + (n_new + 1) / 2. Quadratic in length.
    """
    if n_new <= 0:
        return 0.0
    return n_new + alpha * n_new * (n_cached + (n_new + 1) / 2.0)

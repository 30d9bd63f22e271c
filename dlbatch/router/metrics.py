"""Router statistics: what the routing is predicted to save and how even it is.

All figures are estimates from the router's cache model (`BlockLRU` per worker, in
each worker's execution order): a prompt's leading blocks found in its worker's
modelled cache are counted as reused, everything else as computed. A prefix is thus
counted once per worker-cache residency.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from dlbatch.router.cache_model import BlockLRU
from dlbatch.router.grouping import Request
from dlbatch.router.policy import DEFAULT_ALPHA, prefill_cost


def _ratio_max_mean(values: Sequence[float]) -> float:
    if not values:
        return 1.0
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


@dataclass
class RouterStats:
    """Counters accumulated over everything routed.

    prompt_tokens: prompt tokens of every input request, duplicates included.
    routed_prompt_tokens: prompt tokens of the requests actually sent to workers.
    prefill_tokens_computed_estimate: of those, tokens predicted to be computed.
    duplicates_folded: requests answered by another request's output.
    worker_tokens / worker_cost: per-worker computed tokens and prefill cost.
    """

    n_workers: int
    requests: int = 0
    routed_requests: int = 0
    prompt_tokens: int = 0
    routed_prompt_tokens: int = 0
    prefill_tokens_computed_estimate: int = 0
    duplicates_folded: int = 0
    worker_tokens: list[int] = field(default_factory=list)
    worker_cost: list[float] = field(default_factory=list)
    worker_requests: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.n_workers, bool) or not isinstance(self.n_workers, int) or self.n_workers < 1:
            raise ValueError(f"n_workers must be an int >= 1, got {self.n_workers!r}")
        self.worker_tokens = self.worker_tokens or [0] * self.n_workers
        self.worker_cost = self.worker_cost or [0.0] * self.n_workers
        self.worker_requests = self.worker_requests or [0] * self.n_workers

    def record(self, worker: int, prompt_tokens: int, computed_tokens: int, cost: float) -> None:
        """One routed request: its prompt length, tokens computed and cost on `worker`."""
        self.routed_requests += 1
        self.routed_prompt_tokens += prompt_tokens
        self.prefill_tokens_computed_estimate += computed_tokens
        self.worker_tokens[worker] += computed_tokens
        self.worker_cost[worker] += cost
        self.worker_requests[worker] += 1

    @property
    def cached_tokens_estimate(self) -> int:
        return self.routed_prompt_tokens - self.prefill_tokens_computed_estimate

    @property
    def prefix_hit_rate(self) -> float:
        """Share of routed prompt tokens predicted to come from a worker's prefix cache."""
        return self.cached_tokens_estimate / self.routed_prompt_tokens if self.routed_prompt_tokens else 0.0

    @property
    def compute_fraction(self) -> float:
        """prefill_tokens_computed_estimate / prompt_tokens (duplicates included)."""
        return self.prefill_tokens_computed_estimate / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        """max / mean of per-worker prefill cost (1.0 is perfectly even)."""
        return _ratio_max_mean(self.worker_cost)

    @property
    def token_imbalance(self) -> float:
        """max / mean of per-worker computed tokens."""
        return _ratio_max_mean(self.worker_tokens)

    def to_dict(self) -> dict:
        return {
            "n_workers": self.n_workers,
            "requests": self.requests,
            "routed_requests": self.routed_requests,
            "prompt_tokens": self.prompt_tokens,
            "routed_prompt_tokens": self.routed_prompt_tokens,
            "prefill_tokens_computed_estimate": self.prefill_tokens_computed_estimate,
            "cached_tokens_estimate": self.cached_tokens_estimate,
            "duplicates_folded": self.duplicates_folded,
            "prefix_hit_rate": self.prefix_hit_rate,
            "compute_fraction": self.compute_fraction,
            "worker_tokens": list(self.worker_tokens),
            "worker_cost": list(self.worker_cost),
            "worker_requests": list(self.worker_requests),
            "imbalance": self.imbalance,
            "token_imbalance": self.token_imbalance,
        }


def simulate_worker(requests: Sequence[Request], worker: int, cache: BlockLRU, stats: RouterStats,
                    block_size: int, alpha: float) -> float:
    """Run `requests` in order through `worker`'s cache model, recording into `stats`.
    Returns the cost added to the worker."""
    added = 0.0
    for r in requests:
        chain = r.block_hashes(block_size)
        cached = min(cache.match(chain) * block_size, r.prompt_len - 1)
        computed = r.prompt_len - cached
        cost = prefill_cost(computed, cached, alpha)
        stats.record(worker, r.prompt_len, computed, cost)
        cache.touch(chain)
        added += cost
    return added


def estimate_assignment(per_worker: Sequence[Sequence[Request]], block_size: int = 16,
                        cache_blocks_per_worker: int = 8192, alpha: float = DEFAULT_ALPHA,
                        prompt_tokens: int | None = None, duplicates_folded: int = 0) -> RouterStats:
    """Stats of any per-worker assignment, each worker starting with a cold cache.

    prompt_tokens: input prompt tokens including folded duplicates (default: the routed ones).
    """
    stats = RouterStats(n_workers=len(per_worker))
    for w, reqs in enumerate(per_worker):
        simulate_worker(reqs, w, BlockLRU(cache_blocks_per_worker), stats, block_size, alpha)
    stats.duplicates_folded = duplicates_folded
    stats.requests = stats.routed_requests + duplicates_folded
    stats.prompt_tokens = stats.routed_prompt_tokens if prompt_tokens is None else prompt_tokens
    return stats

"""`Router`: routes windows of requests, keeping per-worker state across windows.

State per prefill worker: its cumulative load (prefill cost sent to it) and a model of
its prefix cache (`BlockLRU` of the blocks sent to it, bounded by
`cache_blocks_per_worker`). A later window whose requests share a prefix with
something a worker still caches goes back to that worker unless it is much more
loaded than the others (see `RouterConfig.affinity_weight`).
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence

from dlbatch.router.assign import _check_workers, assign_prefill
from dlbatch.router.cache_model import BlockLRU
from dlbatch.router.grouping import Request, fold_duplicates, group_requests
from dlbatch.router.metrics import RouterStats, simulate_worker
from dlbatch.router.policy import RouterConfig


class Routing(list):
    """Per-worker request lists in execution order (a list of lists), plus `fanout`:
    kept request id -> ids of the duplicates folded into it (they get its output)."""

    def __init__(self, per_worker: Sequence[list[Request]], fanout: dict[str, list[str]]) -> None:
        super().__init__(per_worker)
        self.fanout = fanout


class Router:
    """Streaming prefill router for `n_workers` prefill workers."""

    def __init__(self, n_workers: int, config: RouterConfig | None = None) -> None:
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be an int >= 1, got {n_workers!r}")
        if config is None:
            config = RouterConfig()
        if not isinstance(config, RouterConfig):
            raise TypeError(f"config must be a RouterConfig, got {config!r}")
        self.n_workers = n_workers
        self.config = config
        self._loads = [0.0] * n_workers
        self._caches = [BlockLRU(config.cache_blocks_per_worker) for _ in range(n_workers)]
        self._rr = 0
        self.stats = RouterStats(n_workers=n_workers)

    @property
    def loads(self) -> tuple[float, ...]:
        """Prefill cost sent to each worker so far (or as last set by `route`)."""
        return tuple(self._loads)

    def route(self, window: Iterable[Request], worker_loads: Sequence[float] | None = None) -> Routing:
        """Route one window: fold duplicates, group, place; update state and stats.

        worker_loads: optional current (e.g. outstanding) load per worker, replacing the
        router's own cumulative count before placement.
        """
        cfg = self.config
        window = list(window)
        for r in window:
            if not isinstance(r, Request):
                raise TypeError(f"expected a Request, got {r!r}")
        if worker_loads is not None:
            self._loads = _check_workers(self.n_workers, worker_loads, None)
        if cfg.fold_duplicates:
            unique, fanout = fold_duplicates(window)
        else:
            unique, fanout = list(window), {}
            fold_duplicates(window)  # still rejects duplicate request ids
        if cfg.policy == "prefix_aware":
            items = group_requests(unique, cfg.block_size)
        else:
            items = unique
        per_worker = assign_prefill(items, self.n_workers, cfg, self._loads, self._caches, rr_offset=self._rr)
        self._rr = (self._rr + len(unique)) % self.n_workers
        for w, reqs in enumerate(per_worker):
            self._loads[w] += simulate_worker(reqs, w, self._caches[w], self.stats, cfg.block_size, cfg.alpha)
        folded = len(window) - len(unique)
        self.stats.requests += len(window)
        self.stats.duplicates_folded += folded
        self.stats.prompt_tokens += sum(r.prompt_len for r in window)
        return Routing(per_worker, fanout)

    def route_stream(self, requests: Iterable[Request]) -> Iterator[Routing]:
        """Route an iterable in windows of `config.window` requests."""
        buf: list[Request] = []
        for r in requests:
            buf.append(r)
            if len(buf) == self.config.window:
                yield self.route(buf)
                buf = []
        if buf:
            yield self.route(buf)

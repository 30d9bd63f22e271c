"""Placing prefill work on workers, and choosing a decode worker.

prefix_aware: groups (requests sharing a prefix) are placed whole, largest cost first,
each on the worker where it finishes first counting what that worker already caches
(longest-processing-time-first with prefix affinity). A group costing more than
`split_fraction` x the window's mean per-worker load is first split at its trie branch
points; pieces that land on the same worker run next to each other, so the prefix is
computed once per worker that receives a piece.

Order on a worker: groups whose prefix it still caches first (before they are evicted),
then cheapest group first (shortest job first: the first token and the first finished
documents of a window come as early as they can, and long documents do not hold up
short ones; the total work is the same). Pieces of a split group keep their group's
place and their depth-first order, so they stay next to each other.

Guarantee (no sharing, or when affinity does not change a unit's cost): this is LPT, so
max load <= (4/3 - 1/(3n)) x the optimal max load for the same units, and
max load <= mean load + (1 - 1/n) x the largest unit's cost. The largest unit is a
single request or a group whose cost is at most split_fraction x the mean, unless it
cannot be split (one request).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Protocol, Sequence, Union

from dlbatch.router.grouping import Group, Request
from dlbatch.router.policy import RouterConfig, prefill_cost


class CacheView(Protocol):
    def match(self, hashes: Sequence[bytes]) -> int: ...


Item = Union[Group, Request]


def _config(policy: str | RouterConfig, alpha: float | None) -> RouterConfig:
    if isinstance(policy, RouterConfig):
        cfg = policy
    elif isinstance(policy, str):
        cfg = RouterConfig(policy=policy)
    else:
        raise TypeError(f"policy must be a policy name or a RouterConfig, got {policy!r}")
    if alpha is not None:
        cfg = RouterConfig(**{**cfg.__dict__, "alpha": alpha})
    return cfg


def _as_groups(items: Sequence[Item], block_size: int, strict: bool) -> list[Group]:
    groups: list[Group] = []
    for it in items:
        if isinstance(it, Group):
            if strict and it.block_size != block_size:
                raise ValueError(f"group block_size {it.block_size} differs from RouterConfig.block_size {block_size}")
            groups.append(it)
        elif isinstance(it, Request):
            groups.append(Group((it,), (0,), block_size))
        else:
            raise TypeError(f"expected a Group or Request, got {it!r}")
    sizes = {g.block_size for g in groups}
    if len(sizes) > 1:
        raise ValueError(f"groups mix block sizes {sorted(sizes)}")
    return groups


def _check_workers(n_workers: int, worker_loads: Sequence[float] | None, cached: Sequence[CacheView] | None) -> list[float]:
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
        raise ValueError(f"n_workers must be an int >= 1, got {n_workers!r}")
    if worker_loads is None:
        loads = [0.0] * n_workers
    else:
        loads = list(worker_loads)
        if len(loads) != n_workers:
            raise ValueError(f"worker_loads has {len(loads)} entries for n_workers={n_workers}")
        for v in loads:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"worker_loads must be finite numbers >= 0, got {v!r}")
        loads = [float(v) for v in loads]
    if cached is not None and len(cached) != n_workers:
        raise ValueError(f"cached has {len(cached)} entries for n_workers={n_workers}")
    return loads


def assign_prefill(groups: Sequence[Item], n_workers: int, policy: str | RouterConfig = "prefix_aware",
                   worker_loads: Sequence[float] | None = None, cached: Sequence[CacheView] | None = None,
                   *, alpha: float | None = None, rr_offset: int = 0) -> list[list[Request]]:
    """Per-worker request lists, each in execution order.

    groups: `Group`s (from `group_requests`) and/or plain `Request`s (groups of one).
    policy: a policy name or a `RouterConfig` (which also gives alpha, block size, ...).
    worker_loads: load (cost units) each worker already has; placement evens the totals.
    cached: per worker, anything with `match(hashes) -> leading cached blocks` (a
        `BlockLRU`); prefix_aware prefers a worker that still caches a group's prefix.
    rr_offset: round_robin starts at worker rr_offset mod n (to continue across windows).
    """
    cfg = _config(policy, alpha)
    loads = _check_workers(n_workers, worker_loads, cached)
    if isinstance(rr_offset, bool) or not isinstance(rr_offset, int):
        raise TypeError(f"rr_offset must be an int, got {rr_offset!r}")
    units = _as_groups(groups, cfg.block_size, strict=isinstance(policy, RouterConfig))
    out: list[list[Request]] = [[] for _ in range(n_workers)]
    if cfg.policy == "round_robin":
        i = 0
        for g in units:
            for r in g.requests:
                out[(rr_offset + i) % n_workers].append(r)
                i += 1
        return out
    if cfg.policy == "least_loaded":
        for g in units:
            for r in g.requests:
                w = min(range(n_workers), key=lambda k: (loads[k], k))
                loads[w] += prefill_cost(r.prompt_len, 0, cfg.alpha)
                out[w].append(r)
        return out
    return _prefix_aware(units, n_workers, cfg, loads, cached)


def _split_large(units: list[tuple[int, Group]], limit: float, alpha: float) -> list[tuple[int, Group]]:
    """Split (position, group) units costing more than `limit` at trie branch points."""
    done: list[tuple[int, Group]] = []
    stack = list(reversed(units))
    while stack:
        pos, g = stack.pop()
        if len(g) > 1 and g.cost(alpha) > limit:
            parts = g.split()
            offs = pos
            pieces = []
            for p in parts:
                pieces.append((offs, p))
                offs += len(p)
            stack.extend(reversed(pieces))
        else:
            done.append((pos, g))
    return done


def _prefix_aware(groups: list[Group], n: int, cfg: RouterConfig, loads: list[float],
                  cached: Sequence[CacheView] | None) -> list[list[Request]]:
    alpha, beta = cfg.alpha, cfg.affinity_weight
    units: list[tuple[int, Group]] = []
    pos = 0
    for g in groups:
        units.append((pos, g))
        pos += len(g)
    starts = [p for p, _ in units]  # a piece of a split group runs in its group's slot
    origin_cost = [g.cost(alpha) for g in groups]
    window_mean = sum(origin_cost) / n
    units = _split_large(units, cfg.split_fraction * window_mean, alpha)
    # largest first; ties by depth-first position (deterministic)
    order = sorted(units, key=lambda u: (-u[1].cost(alpha), u[0]))
    placed: list[list[tuple[int, int, Group]]] = [[] for _ in range(n)]
    sent: list[set[bytes]] = [set() for _ in range(n)]  # blocks sent to each worker this window

    def leading(w: int, chain: list[bytes]) -> tuple[int, int]:
        persistent = cached[w].match(chain) if cached is not None else 0
        k = persistent
        s = sent[w]
        while k < len(chain) and chain[k] in s:
            k += 1
        return k, persistent

    for p, g in order:
        chain = g.requests[0].block_hashes(g.block_size)
        best = None
        for w in range(n):
            hit, persistent = leading(w, chain)
            c = g.cost(alpha, hit)
            score = loads[w] + (1.0 + beta) * c
            if best is None or score < best[0]:
                best = (score, w, c, persistent)
        _, w, c, persistent = best  # type: ignore[misc]
        loads[w] += c
        for r in g.requests:
            sent[w].update(r.block_hashes(g.block_size))
        placed[w].append((0 if persistent else 1, origin_cost[bisect.bisect_right(starts, p) - 1], p, g))
    out: list[list[Request]] = []
    for lst in placed:
        lst.sort(key=lambda t: t[:3])
        out.append([r for *_, g in lst for r in g.requests])
    return out


@dataclass(frozen=True)
class DecodeWorkerState:
    """A decode worker's KV memory: free and total blocks, and sequences running."""

    free_blocks: int
    total_blocks: int
    running: int = 0

    def __post_init__(self) -> None:
        for name in ("free_blocks", "total_blocks", "running"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"DecodeWorkerState.{name} must be an int >= 0, got {v!r}")
        if self.free_blocks > self.total_blocks:
            raise ValueError(f"DecodeWorkerState.free_blocks {self.free_blocks} exceeds total_blocks {self.total_blocks}")


def blocks_needed(request: Request, block_size: int = 16) -> int:
    """KV blocks to reserve for prompt + max_tokens."""
    return -(-(request.prompt_len + request.max_tokens) // block_size)


def choose_decode(workers_state: Sequence[DecodeWorkerState], request: Request, block_size: int = 16) -> int:
    """Index of the decode worker for `request`.

    Among workers with room now for prompt + max_tokens, the one left with the most free
    blocks (ties: fewest running sequences, then lowest index). If none has room now, the
    worker that could hold it with the most free blocks (the request waits there for
    reservations to free). Raises ValueError when no worker could ever hold it.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(request, Request):
        raise TypeError(f"expected a Request, got {request!r}")
    states = list(workers_state)
    if not states:
        raise ValueError("workers_state is empty: no decode worker to choose")
    for s in states:
        if not isinstance(s, DecodeWorkerState):
            raise TypeError(f"expected DecodeWorkerState items, got {s!r}")
    need = blocks_needed(request, block_size)
    fits_now = [i for i, s in enumerate(states) if s.free_blocks >= need]
    pool = fits_now or [i for i, s in enumerate(states) if s.total_blocks >= need]
    if not pool:
        biggest = max(s.total_blocks for s in states)
        raise ValueError(
            f"request {request.request_id!r} needs {need} KV blocks (prompt {request.prompt_len} + "
            f"max_tokens {request.max_tokens} tokens) but the largest decode worker has {biggest}"
        )
    return min(pool, key=lambda i: (-states[i].free_blocks, states[i].running, i))

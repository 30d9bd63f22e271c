"""Requests, exact-duplicate folding and prefix groups.

A `Group` is a run of requests in depth-first (trie) order that share at least one
full KV block of prompt; a request sharing nothing is a group of one. Within a group,
`reuse_blocks[j]` is how many leading blocks member j shares with member j-1: in a
depth-first order that is also the most it shares with any earlier member, so running
the members in order on one worker computes each shared block once.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

from dlbatch.router.policy import prefill_cost
from dlbatch.router.prefix_index import PrefixIndex, chain_hashes, common_prefix_len


@dataclass(frozen=True)
class Request:
    """One prompt to prefill.

    sampling_key: None means deterministic (greedy) decoding. Otherwise a hashable that
    determines the output together with the prompt, e.g. (temperature, top_p, seed).
    Requests are folded as duplicates only when prompt, max_tokens, sampling_key and salt
    are equal and the key is deterministic; build keys with `make_sampling_key`, which makes
    unseeded random sampling unique per request so it is never folded.
    """

    request_id: str
    token_ids: tuple[int, ...]
    max_tokens: int
    sampling_key: Hashable | None = None
    salt: str | None = None  # what the prompt is computed under besides its ids: adapter, images (prefix_salt)
    _hashes: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"Request.request_id must be a non-empty str, got {self.request_id!r}")
        ids = self.token_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"Request {self.request_id!r}: token_ids must be a sequence of ints, got {ids!r}")
        try:
            packed = array("i", ids)
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"Request {self.request_id!r}: token_ids must be ints in [0, 2**31): {exc}") from None
        if packed and min(packed) < 0:
            raise ValueError(f"Request {self.request_id!r}: token ids must be >= 0, got {min(packed)}")
        ids = tuple(packed.tolist())
        object.__setattr__(self, "token_ids", ids)
        if not ids:
            raise ValueError(f"Request {self.request_id!r}: token_ids is empty")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"Request {self.request_id!r}: max_tokens must be an int >= 1, got {self.max_tokens!r}")
        try:
            hash(self.sampling_key)
        except TypeError:
            raise TypeError(f"Request {self.request_id!r}: sampling_key must be hashable, got {self.sampling_key!r}") from None

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)

    def block_hashes(self, block_size: int) -> list[bytes]:
        """Chained full-block hashes of the prompt (cached per block size)."""
        chain = self._hashes.get(block_size)
        if chain is None:
            if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
                raise ValueError(f"block_size must be a positive int, got {block_size!r}")
            chain = chain_hashes(array("i", self.token_ids), block_size, self.salt)
            self._hashes[block_size] = chain
        return chain


class _Unique:
    """A sampling key equal only to itself: never folded."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"unseeded({self.request_id!r})"


def make_sampling_key(request_id: str, temperature: float = 0.0, top_p: float = 1.0, top_k: int = -1,
                      seed: int | None = None, **extra: Hashable) -> Hashable | None:
    """sampling_key for `Request`: None for greedy, a tuple with the seed for seeded
    sampling (foldable), and a per-request unique key for unseeded random sampling."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if temperature == 0:
        return None if not extra else ("greedy", tuple(sorted(extra.items())))
    if seed is None:
        return _Unique(request_id)
    return (float(temperature), float(top_p), int(top_k), int(seed), tuple(sorted(extra.items())))


def _check_unique_ids(requests: Sequence[Request]) -> None:
    seen: set[str] = set()
    for r in requests:
        if not isinstance(r, Request):
            raise TypeError(f"expected a Request, got {r!r}")
        if r.request_id in seen:
            raise ValueError(f"duplicate request_id {r.request_id!r}")
        seen.add(r.request_id)


def fold_duplicates(requests: Iterable[Request]) -> tuple[list[Request], dict[str, list[str]]]:
    """Fold exact duplicates: same token_ids, max_tokens, sampling_key and salt.

    Returns (unique requests in first-seen order, fanout) where fanout maps the id of a
    kept request to the ids of the requests folded into it (only ids with duplicates).
    """
    requests = list(requests)
    _check_unique_ids(requests)
    first: dict[tuple, Request] = {}
    unique: list[Request] = []
    fanout: dict[str, list[str]] = {}
    for r in requests:
        key = (r.token_ids, r.max_tokens, r.sampling_key, r.salt)
        kept = first.get(key)
        if kept is None:
            first[key] = r
            unique.append(r)
        else:
            fanout.setdefault(kept.request_id, []).append(r.request_id)
    return unique, fanout


@dataclass(frozen=True)
class Group:
    """Requests in depth-first order sharing >= 1 full block (or a single request).

    reuse_blocks[j]: leading blocks member j shares with member j-1 (0 for j = 0).
    shared_prefix_tokens: tokens of full blocks common to every member (0 for one member).
    """

    requests: tuple[Request, ...]
    reuse_blocks: tuple[int, ...]
    block_size: int

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a Group needs at least one request")
        if len(self.reuse_blocks) != len(self.requests):
            raise ValueError(f"reuse_blocks has {len(self.reuse_blocks)} items for {len(self.requests)} requests")

    @classmethod
    def from_ordered(cls, requests: Sequence[Request], block_size: int) -> "Group":
        """Group of requests already in depth-first order (reuse computed from hashes)."""
        reuse = [0]
        for prev, cur in zip(requests, requests[1:]):
            reuse.append(common_prefix_len(prev.block_hashes(block_size), cur.block_hashes(block_size)))
        return cls(tuple(requests), tuple(reuse), block_size)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def shared_prefix_blocks(self) -> int:
        return min(self.reuse_blocks[1:]) if len(self.requests) > 1 else 0

    @property
    def shared_prefix_tokens(self) -> int:
        return self.shared_prefix_blocks * self.block_size

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    def cached_tokens(self, first_cached_blocks: int = 0) -> list[int]:
        """Per member, prompt tokens served from cache when the group runs in order on
        one worker whose cache already holds `first_cached_blocks` of the first member.
        At least one token per prompt is always computed (its logits are needed)."""
        bs = self.block_size
        carried = min(first_cached_blocks, self.shared_prefix_blocks) if len(self.requests) > 1 else 0
        out = []
        for j, r in enumerate(self.requests):
            blocks = first_cached_blocks if j == 0 else max(self.reuse_blocks[j], carried)
            out.append(min(blocks * bs, r.prompt_len - 1))
        return out

    def computed_tokens(self, first_cached_blocks: int = 0) -> int:
        return sum(r.prompt_len - c for r, c in zip(self.requests, self.cached_tokens(first_cached_blocks)))

    def cost(self, alpha: float, first_cached_blocks: int = 0) -> float:
        """Prefill cost of the group run in order on one worker (see `prefill_cost`)."""
        return sum(
            prefill_cost(r.prompt_len - c, c, alpha)
            for r, c in zip(self.requests, self.cached_tokens(first_cached_blocks))
        )

    def split(self) -> list["Group"]:
        """Split at the trie node holding the common prefix: one sub-group per child
        subtree, one per request ending at that node. Each sub-group's first member
        recomputes the prefix unless it runs next to a sibling on the same worker."""
        if len(self.requests) < 2:
            return [self]
        cut = self.shared_prefix_blocks
        parts: list[Group] = []
        start = 0
        for j in range(1, len(self.requests) + 1):
            if j == len(self.requests) or self.reuse_blocks[j] == cut:
                reuse = (0,) + self.reuse_blocks[start + 1 : j]
                parts.append(Group(self.requests[start:j], reuse, self.block_size))
                start = j
        return parts


def group_requests(requests: Iterable[Request], block_size: int = 16) -> list[Group]:
    """Group requests by shared prefix (>= 1 full block), in depth-first order.

    Every request lands in exactly one group; groups come longest-shared-prefix first,
    requests sharing nothing come as groups of one.
    """
    requests = list(requests)
    _check_unique_ids(requests)
    index = PrefixIndex(block_size)
    by_id = {}
    for r in requests:
        index.insert(r.request_id, hashes=r.block_hashes(block_size))
        by_id[r.request_id] = r
    ordered = [by_id[rid] for rid in index.iter_depth_first()]
    groups: list[Group] = []
    start = 0
    whole = Group.from_ordered(ordered, block_size) if ordered else None
    if whole is None:
        return groups
    for j in range(1, len(ordered) + 1):
        if j == len(ordered) or whole.reuse_blocks[j] == 0:
            reuse = (0,) + whole.reuse_blocks[start + 1 : j]
            groups.append(Group(ordered[start:j], reuse, block_size))
            start = j
    return groups

"""Chained block hashes over token ids and a radix tree over the hash chains.

The engine's prefix cache keys a full KV block by a hash chained over every block
before it: h[i] = H(h[i-1], tokens of block i). Two prompts therefore share blocks
0..k-1 of cache exactly when their first k hashes are equal, and the router can reason
about cache hits on hashes alone. The hash is BLAKE2b (16-byte digest) of the previous
digest followed by the block's token ids packed as native 4-byte ints (`array('i')`): it
is stable across processes and runs (unlike Python's salted `hash()` of bytes/str).
A trailing partial block is never hashed (it cannot be shared in a paged cache).
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Iterable, Iterator, NamedTuple, Sequence

DIGEST_SIZE = 16


def _pack(token_ids: Sequence[int] | Iterable[int]) -> array:
    try:
        packed = array("i", token_ids)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**31): {exc} (in {_preview(token_ids)})") from None
    if packed and min(packed) < 0:
        raise ValueError(f"token ids must be >= 0, got {min(packed)} (in {_preview(token_ids)})")
    return packed


def _preview(token_ids: object) -> str:
    try:
        seq = list(token_ids)  # type: ignore[call-overload]
    except TypeError:
        return repr(token_ids)
    return repr(seq[:8])[:-1] + (", ...]" if len(seq) > 8 else "]")


def block_hashes(token_ids: Sequence[int], block_size: int = 16) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids` (len(token_ids) // block_size items).

    Equal prefixes give equal hashes; a difference in block k changes hashes k, k+1, ...
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return chain_hashes(_pack(token_ids), block_size)


def chain_hashes(packed: array, block_size: int, salt: str | None = None) -> list[bytes]:
    """`block_hashes` of already validated token ids packed as `array('i')`. A ``salt`` (a
    request's adapter and images: `dlbatch.records.prefix_salt`) seeds the chain, so equal
    token ids under different salts share no block, as in the engine's cache."""
    view = memoryview(packed).cast("B")
    step = block_size * packed.itemsize
    out: list[bytes] = []
    blake = hashlib.blake2b
    prev = blake(salt.encode(), digest_size=DIGEST_SIZE).digest() if salt else b""
    for i in range(len(packed) // block_size):
        h = blake(prev, digest_size=DIGEST_SIZE)
        h.update(view[i * step : (i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def common_prefix_len(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """Number of leading equal items of two hash chains."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixMatch(NamedTuple):
    blocks: int
    tokens: int


class _Node:
    __slots__ = ("edge", "depth", "children", "terminals", "count", "seq")

    def __init__(self, edge: list[bytes], depth: int, seq: int) -> None:
        self.edge = edge  # block hashes on the edge from the parent to this node
        self.depth = depth  # blocks from the root to the end of `edge`
        self.children: dict[bytes, _Node] = {}
        self.terminals: list[str] = []  # requests whose full-block chain ends here
        self.count = 0  # requests in this subtree (terminals included)
        self.seq = seq  # creation order, for deterministic tie-breaks


class PrefixIndex:
    """Radix tree over chained block hashes; each request is a root-to-node path.

    insert(request_id, token_ids) adds a request; longest_prefix(token_ids) answers how
    much of a prompt is already present; shared_prefix(request_id) how much of a request
    some other request shares; iter_depth_first() yields request ids so that requests
    sharing the longest prefixes are adjacent (every subtree is contiguous), siblings
    ordered by the deepest sharing found in their subtree, then size, then insertion.
    """

    def __init__(self, block_size: int = 16) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self._root = _Node([], 0, 0)
        self._seq = 1
        self._paths: dict[str, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._paths

    def insert(self, request_id: str, token_ids: Sequence[int] | None = None, *, hashes: Sequence[bytes] | None = None) -> None:
        """Add a request by its token ids (or precomputed `block_hashes`)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        if request_id in self._paths:
            raise ValueError(f"request_id {request_id!r} is already in the index")
        if (token_ids is None) == (hashes is None):
            raise ValueError("give exactly one of token_ids or hashes")
        chain = list(hashes) if hashes is not None else block_hashes(token_ids, self.block_size)  # type: ignore[arg-type]
        node = self._root
        node.count += 1
        i = 0
        while i < len(chain):
            child = node.children.get(chain[i])
            if child is None:
                leaf = _Node(chain[i:], len(chain), self._seq)
                self._seq += 1
                node.children[chain[i]] = leaf
                node = leaf
                node.count += 1
                i = len(chain)
                break
            m = common_prefix_len(child.edge, chain[i : i + len(child.edge)])
            if m < len(child.edge):  # split the edge at the divergence point
                mid = _Node(child.edge[:m], child.depth - len(child.edge) + m, self._seq)
                self._seq += 1
                mid.count = child.count
                child.edge = child.edge[m:]
                mid.children[child.edge[0]] = child
                node.children[chain[i]] = mid
                child = mid
            node = child
            node.count += 1
            i += m
        node.terminals.append(request_id)
        self._paths[request_id] = chain

    def longest_prefix(self, token_ids: Sequence[int] | None = None, *, hashes: Sequence[bytes] | None = None) -> PrefixMatch:
        """Longest prefix of a prompt that some indexed request also starts with."""
        if (token_ids is None) == (hashes is None):
            raise ValueError("give exactly one of token_ids or hashes")
        chain = list(hashes) if hashes is not None else block_hashes(token_ids, self.block_size)  # type: ignore[arg-type]
        node, i = self._root, 0
        while i < len(chain):
            child = node.children.get(chain[i])
            if child is None:
                break
            m = common_prefix_len(child.edge, chain[i : i + len(child.edge)])
            i += m
            if m < len(child.edge):
                break
            node = child
        return PrefixMatch(i, i * self.block_size)

    def shared_prefix(self, request_id: str) -> PrefixMatch:
        """Longest prefix `request_id` shares with any other indexed request."""
        chain = self._paths.get(request_id)
        if chain is None:
            raise KeyError(f"request_id {request_id!r} is not in the index")
        node, i, best = self._root, 0, 0
        while i < len(chain):
            node = node.children[chain[i]]
            i = node.depth
            if node.count >= 2:
                best = node.depth
        return PrefixMatch(best, best * self.block_size)

    def hashes(self, request_id: str) -> list[bytes]:
        """The block-hash chain stored for a request."""
        chain = self._paths.get(request_id)
        if chain is None:
            raise KeyError(f"request_id {request_id!r} is not in the index")
        return chain

    def _sharing_depth(self) -> dict[int, int]:
        """Per node (by id): deepest node depth with >= 2 requests in its subtree."""
        best: dict[int, int] = {}
        order: list[_Node] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):  # children before parents
            b = node.depth if node.count >= 2 else 0
            for child in node.children.values():
                b = max(b, best[id(child)])
            best[id(node)] = b
        return best

    def iter_depth_first(self) -> Iterator[str]:
        """Request ids in depth-first order, longest-shared-prefix subtrees first.

        At each node its children come first (deepest sharing first), then the requests
        ending at the node, so consecutive ids share the longest prefix available.
        """
        best = self._sharing_depth()
        # stack of (node, expanded?) to emit terminals after the children
        stack: list[tuple[_Node, bool]] = [(self._root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                yield from node.terminals
                continue
            stack.append((node, True))
            kids = sorted(node.children.values(), key=lambda c: (-best[id(c)], -c.count, c.seq))
            for child in reversed(kids):
                stack.append((child, False))

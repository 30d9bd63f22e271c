"""A model of one worker's prefix cache: an LRU of block hashes bounded in blocks.

The router cannot see a worker's real cache; it predicts it from what it sent the
worker. `touch` records a prompt's blocks the way an engine frees them: tail block
first, so a prompt's first blocks are the most recently used and a shared prefix
outlives the suffixes hanging off it (as in vLLM's block freeing order).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class BlockLRU:
    """LRU set of block hashes with a capacity in blocks (0 = no cache)."""

    def __init__(self, capacity_blocks: int) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be an int >= 0, got {capacity_blocks!r}")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def match(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of a chain present in the cache (does not refresh them)."""
        blocks = self._blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Record that a prompt with these blocks ran: insert/refresh them, evict LRU."""
        if self.capacity == 0:
            return
        blocks = self._blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

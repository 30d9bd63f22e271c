"""Paged KV-cache bookkeeping: block tables, reference counts, reservations and the
prefix cache (full blocks keyed by chained hashes, token ids verified on a hit, LRU reuse).

Partial blocks (``share_partial_blocks``): after the full-block hits, the next block of a
new sequence may begin like a cached block with the same parent (two prompts of one chat
template share its 16-31-token head: one full block, then a block that holds the rest of
the head and the start of each prompt's own text). The sequence then gets a fresh block
whose first ``k`` rows are to be copied from the cached one (``seq.kv_copy = (src, dst,
k)``) and starts computing at token ``16 i + k``. The cached children of each parent are
kept sorted by their tokens, so the child with the longest common head is a neighbour of
the new block's insertion point (one bisect, two comparisons). Invariant: ``src`` is
pinned (a reference held) from `allocate` until `release_copy`, and the owner of the
manager copies the rows in between (the engine does it at admission, before the step
that computes the rest of the block).

Plain Python over lists and dicts: no torch, unit-testable without a model.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict, deque

from dlbatch.engine.sequence import Sequence


class NoFreeBlocks(RuntimeError):
    pass


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _common_head(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 share_partial_blocks: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.share_partial_blocks = share_partial_blocks and enable_prefix_caching
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but hashed: reusable as cache, LRU first
        self.block_key: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.block_hash: dict[int, int] = {}
        self.hash_to_block: dict[int, int] = {}
        # hashed blocks by parent hash, each list sorted by the block's tokens (partial matches)
        self.children: dict[int | None, list[tuple[tuple[int, ...], int]]] = {}
        self.reserved_total = 0
        # full prompt blocks being computed right now: hash -> owning sequence id. A new
        # sequence whose next block is among them waits a step and then hits the cache.
        self.pending: dict[int, str] = {}
        # counters
        self.prefix_queries = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be taken now (free or evictable cache), before reservations."""
        return len(self.free) + len(self.evictable)

    @property
    def num_available(self) -> int:
        return self.num_free - self.reserved_total

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    # ---- prefix cache ---------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of `token_ids` (full blocks only),
        leaving at least one token to compute so the last position yields logits."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        n_full = (len(token_ids) - 1) // bs
        hits: list[int] = []
        parent = None
        for i in range(n_full):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, toks)
            b = self.hash_to_block.get(h)
            if b is None or self.block_key.get(b) != (parent, toks):
                break
            hits.append(b)
            parent = h
        return hits

    def match_partial(self, token_ids: list[int], hits: list[int]) -> tuple[int, int] | None:
        """(cached block, k): the hashed block after ``hits``' last whose first ``k`` >= 1
        tokens are the next tokens of ``token_ids`` (the longest such head), leaving at
        least one token to compute; None when there is none or sharing is off."""
        if not self.share_partial_blocks:
            return None
        bs = self.block_size
        lo = len(hits) * bs
        want = tuple(token_ids[lo:min(lo + bs, len(token_ids) - 1)])
        kids = self.children.get(self.block_hash[hits[-1]] if hits else None)
        if not want or not kids:
            return None
        i = bisect_left(kids, (want,))
        best = None
        for j in (i - 1, i):
            if 0 <= j < len(kids):
                k = _common_head(kids[j][0], want)
                if k and (best is None or k > best[1]):
                    best = (kids[j][1], k)
        return best

    def _take(self) -> int:
        if self.free:
            b = self.free.popleft()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)
            self._unhash(b)
        else:
            raise NoFreeBlocks("no free KV blocks")
        self.ref[b] = 1
        return b

    def _unhash(self, b: int) -> None:
        h = self.block_hash.pop(b, None)
        if h is not None and self.hash_to_block.get(h) == b:
            del self.hash_to_block[h]
        key = self.block_key.pop(b, None)
        if key is not None and self.share_partial_blocks:
            parent, toks = key
            kids = self.children[parent]
            i = bisect_left(kids, (toks, b))
            del kids[i]  # present: registered with its key in commit_full_blocks
            if not kids:
                del self.children[parent]

    # ---- sequence lifecycle -----------------------------------------------------------
    def blocks_needed(self, seq: Sequence, reserve: bool) -> tuple[int, list[int], tuple[int, int] | None]:
        """-> (blocks to take, full-block hits, partial hit (block, tokens) or None)."""
        ids = seq.all_ids
        hits = self.match_prefix(ids)
        total = seq.max_total_tokens if reserve else len(seq) + 1
        return max(0, cdiv(total, self.block_size) - len(hits)), hits, self.match_partial(ids, hits)

    def _pinned_free(self, hits: list[int], partial: tuple[int, int] | None) -> int:
        """Free (evictable) blocks that admitting with these hits takes out of the pool."""
        n = sum(1 for b in hits if self.ref[b] == 0)
        return n + (1 if partial is not None and self.ref[partial[0]] == 0 else 0)

    def can_allocate(self, seq: Sequence, reserve: bool) -> bool:
        need, hits, partial = self.blocks_needed(seq, reserve)
        return need + self._pinned_free(hits, partial) <= self.num_available

    def allocate(self, seq: Sequence, reserve: bool) -> None:
        """Admit `seq`: reuse its cached prefix blocks, take blocks for the rest of its
        current tokens, and (reserve=True) reserve blocks for its remaining max_tokens."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already has blocks")
        need, hits, partial = self.blocks_needed(seq, reserve)
        if need + self._pinned_free(hits, partial) > self.num_available:
            raise NoFreeBlocks(f"sequence {seq.seq_id} needs {need} blocks, {self.num_available} available")
        parent = None
        for b in hits:
            self._pin(b)
            parent = self.block_hash[b]
            seq.block_hashes.append(parent)
        seq.block_table = list(hits)
        seq.num_computed = len(hits) * self.block_size
        now = cdiv(len(seq), self.block_size) - len(hits)
        if partial is not None:
            self._pin(partial[0])  # until release_copy: taking blocks below must not evict it
        for _ in range(now):
            seq.block_table.append(self._take())
        if partial is not None:
            seq.kv_copy = (partial[0], seq.block_table[len(hits)], partial[1])
            seq.num_computed += partial[1]
        seq.num_cached = seq.num_computed
        self.prefix_queries += 1
        self.prefix_hit_tokens += seq.num_cached
        self.prefix_query_tokens += len(seq)
        if self.enable_prefix_caching:
            bs = self.block_size
            ids = seq.all_ids
            h = parent
            for i in range(len(hits), len(ids) // bs):
                h = chain_hash(h, tuple(ids[i * bs:(i + 1) * bs]))
                self.pending.setdefault(h, seq.seq_id)
        if reserve:
            seq.reserved = need - now
            self.reserved_total += seq.reserved

    def _pin(self, b: int) -> None:
        if self.ref[b] == 0:
            self.evictable.pop(b, None)
        self.ref[b] += 1

    def _unpin(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.block_hash:
                self.evictable[b] = None  # most recently used at the end
            else:
                self.free.append(b)
        elif self.ref[b] < 0:  # pragma: no cover - bookkeeping bug
            raise RuntimeError(f"block {b} freed twice")

    def release_copy(self, seq: Sequence) -> None:
        """The rows of ``seq.kv_copy`` are copied: unpin its source block."""
        if seq.kv_copy is not None:
            src, seq.kv_copy = seq.kv_copy[0], None
            self._unpin(src)

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block table cover `num_tokens` tokens, taking from the sequence's
        reservation first. Raises NoFreeBlocks when neither reservation nor pool has one."""
        while len(seq.block_table) * self.block_size < num_tokens:
            if seq.reserved > 0:
                seq.reserved -= 1
                self.reserved_total -= 1
            elif self.num_available <= 0:
                raise NoFreeBlocks(f"sequence {seq.seq_id} needs a block for token {num_tokens}")
            seq.block_table.append(self._take())

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks whose KV is now fully computed (prefix cache)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        ids = None
        while len(seq.block_hashes) < seq.num_computed // bs:
            i = len(seq.block_hashes)
            if ids is None:
                ids = seq.all_ids
            toks = tuple(ids[i * bs:(i + 1) * bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = chain_hash(parent, toks)
            b = seq.block_table[i]
            seq.block_hashes.append(h)
            if self.pending.get(h) == seq.seq_id:
                del self.pending[h]
            if b not in self.block_hash and h not in self.hash_to_block:
                self.block_hash[b] = h
                self.hash_to_block[h] = b
                self.block_key[b] = (parent, toks)
                if self.share_partial_blocks:
                    insort(self.children.setdefault(parent, []), (toks, b))

    def prefix_pending(self, seq: Sequence) -> bool:
        """True when the block right after `seq`'s cached prefix is being computed by
        another running sequence: admitting `seq` now would compute it twice."""
        if not self.enable_prefix_caching or not self.pending:
            return False
        ids = seq.all_ids
        bs = self.block_size
        hits = self.match_prefix(ids)
        i = len(hits)
        if (i + 1) * bs > len(ids) - 1:
            return False
        parent = self.block_hash[hits[-1]] if hits else None
        owner = self.pending.get(chain_hash(parent, tuple(ids[i * bs:(i + 1) * bs])))
        return owner is not None and owner != seq.seq_id

    def free_seq(self, seq: Sequence) -> None:
        if self.pending:
            for h in [h for h, o in self.pending.items() if o == seq.seq_id]:
                del self.pending[h]
        self.release_copy(seq)
        for b in reversed(seq.block_table):
            self._unpin(b)
        seq.block_table = []
        seq.block_hashes = []
        self.reserved_total -= seq.reserved
        seq.reserved = 0

    def check_invariants(self) -> None:
        """Debug/test helper: every block is exactly one of free / evictable / referenced."""
        free = set(self.free)
        ev = set(self.evictable)
        if free & ev:
            raise AssertionError(f"blocks both free and evictable: {sorted(free & ev)[:5]}")
        for b in range(self.num_blocks):
            in_use = self.ref[b] > 0
            if in_use == (b in free or b in ev):
                raise AssertionError(f"block {b}: ref={self.ref[b]} free={b in free} evictable={b in ev}")
        if self.reserved_total < 0 or self.reserved_total > self.num_free:
            raise AssertionError(f"reserved_total {self.reserved_total} vs free {self.num_free}")

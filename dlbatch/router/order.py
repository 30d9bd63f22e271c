"""Prefix order across the input: documents held back and handed out so that requests sharing
a prompt prefix anywhere in the input arrive together, before they reach the router's window.

The router groups shared prefixes within a window of a few hundred requests; the prefix
cache keeps a prefix only while its blocks are not evicted. A shuffled input (few-shot
preambles, a system prompt, OpenAI batch lines sharing a long instruction, documents
asked several questions from different rows) spreads the requests of one prefix over the
whole input, so each prefix would be recomputed once per window it lands in whenever the
KV cache holds fewer prefixes than the input has. `PrefixOrder` sorts what it holds by the
prompt's prefix at block granularity, trie order (Liu et al., MLSys'25; BatchLLM, arXiv
2412.03594, do the same on the whole input ahead of time): documents whose first prompts
share k blocks are adjacent, for every k, so a prefix group reaches the workers in one run.

How. A document's key is the hash of its first request's prompt (under its prefix salt:
its adapter and images) over the first ``bs * d`` tokens, for d in ``depths`` (blocks; a prompt shorter than a depth keys that
depth by its whole length, so two short prompts match there only when equal). Documents
are sorted by these hashes, shallowest first, arrival order last: sharing the first d
blocks means sharing the first d' < d blocks, so the sort is a trie walk at those depths.
A document with no prompt (an input error row) sorts first and leaves at once.

Bounds. It holds at most ``max_bytes`` of request rows (Arrow, as they came from the
prompt stage): the sort covers the whole input when the input fits, else the part held at
a time. It never holds documents back from idle workers: `take` gives whatever is best
now, and the caller takes only while the dispatcher has room, so while the workers are
busy the buffer fills and sorts, and a document held arrives after at most the work
ahead of it. A document's rows stay together and in their order.

A plain object over pyarrow tables: no Ray, no engine.
"""
from __future__ import annotations

import hashlib

DEPTHS = (1, 2, 4, 8, 16, 32, 64, 128)  # blocks: shared prefixes of 16 tokens up to 2,048 tokens (block 16)
MAX_BYTES = 256 << 20


class PrefixOrder:
    def __init__(self, block_size: int = 16, depths=DEPTHS, max_bytes: int = MAX_BYTES):
        if block_size < 1 or not depths:
            raise ValueError(f"block_size must be >= 1 and depths non-empty, got {block_size}, {depths!r}")
        self.block_size, self.depths, self.max_bytes = block_size, tuple(sorted(depths)), max_bytes
        self._tables: list = []  # blocks held, each a pyarrow Table of request rows
        self._docs: list[tuple] = []  # (key tuple, arrival, table index, first row, end row)
        self._arrival = 0
        self._sorted = True
        self.nbytes = 0
        self._seen: list[set] = [set() for _ in self.depths]  # keys seen per depth (a sample)
        self._shared_at = [False] * len(self.depths)  # some key of that depth has two documents or more
        self.shares_partly = False  # see `_note_keys`

    def __len__(self) -> int:
        return len(self._docs)

    def full(self) -> bool:
        return self.nbytes >= self.max_bytes

    def add(self, table) -> int:
        """Hold a block of request rows (a document's rows consecutive); -> documents added."""
        if table.num_rows == 0:
            return 0
        t = len(self._tables)
        self._tables.append(table)
        self.nbytes += table.nbytes
        ids = table.column("doc_id").to_pylist()
        prompts = table.column("prompt_ids")
        salts = table.column("prefix_salt").to_pylist() if "prefix_salt" in table.column_names else None
        start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[start]:
                key = self._key(prompts[start], salts[start] if salts else None)
                self._docs.append((key, self._arrival, t, start, i))
                self._arrival += 1
                start = i
                if self._arrival <= self.SAMPLE_DOCS and not self.shares_partly:
                    self._note_keys(key)
        self._sorted = False
        return self._arrival

    SAMPLE_DOCS = 8192  # documents `shares_partly` looks at (the first ones held)

    def _note_keys(self, key: tuple) -> None:
        """``shares_partly``: at some depth a key is shared by two or more of the documents
        seen and not by all of them: groups of documents with a prefix of their own, which an
        input split into blocks spreads over several (a chat template's head, shared by every
        document, is not such a group; nor are documents that share nothing)."""
        for d, k in enumerate(key):
            seen = self._seen[d]
            self._shared_at[d] = self._shared_at[d] or k in seen
            seen.add(k)
            if self._shared_at[d] and len(seen) >= 2:
                self.shares_partly = True

    def _key(self, prompt, salt: str | None = None) -> tuple:
        """Hashes of the prompt's first ``bs * d`` tokens per depth d, under the request's
        ``salt`` (its adapter and images: prompts of two adapters never sort as one prefix);
        () without a prompt."""
        import numpy as np

        values = prompt.values if prompt.is_valid else None
        if values is None or len(values) == 0:
            return ()
        ids = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64)
        raw = memoryview(ids.tobytes())
        seed = salt.encode() if salt else b""
        out = []
        for d in self.depths:
            n = min(len(ids), d * self.block_size)
            h = hashlib.blake2b(seed, digest_size=8)
            h.update(raw[:n * 8])
            out.append(int.from_bytes(h.digest(), "little"))
            if n == len(ids):  # deeper depths are the whole prompt too
                out.extend([out[-1]] * (len(self.depths) - len(out)))
                break
        return tuple(out)

    def take(self, max_rows: int):
        """Whole documents in prefix order, at least one, until ``max_rows`` rows; None when
        nothing is held. Returns one pyarrow Table (the blocks' rows concatenated)."""
        import pyarrow as pa

        if not self._docs:
            return None
        if not self._sorted:
            self._docs.sort(key=lambda d: (len(d[0]) > 0, d[0], d[1]))  # no prompt first, then trie order
            self._sorted = True
        n, rows = 0, 0
        while n < len(self._docs) and (n == 0 or rows + self._docs[n][4] - self._docs[n][3] <= max_rows):
            rows += self._docs[n][4] - self._docs[n][3]
            n += 1
        taken, self._docs = self._docs[:n], self._docs[n:]
        parts = [self._tables[t].slice(a, b - a) for _, _, t, a, b in taken]
        self._release()
        return pa.concat_tables(parts, promote_options="default") if len(parts) > 1 else parts[0]

    def _release(self) -> None:
        """Drop the blocks no held document points into (their bytes are no longer held)."""
        live = {d[2] for d in self._docs}
        for t, table in enumerate(self._tables):
            if table is not None and t not in live:
                self.nbytes -= table.nbytes
                self._tables[t] = None
        if not live:
            self._tables = []

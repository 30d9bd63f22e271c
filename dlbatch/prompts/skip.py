"""The documents a run skips (already committed or dead-lettered), in 8 bytes each.

A resumed job hands every prompt actor the ids it must not redo. As Python strings in a set
that costs ~100 bytes per id in the driver and again in each actor, and grows with every
run of a scheduled job; `SkipSet` keeps the sorted 64-bit BLAKE2b hashes of the ids in one
numpy array (8 bytes per id, pickled as such) and answers membership by binary search.

A hash collision would skip a new document whose id hashes like a committed one: with N
committed ids the chance per new document is about N / 2**64 (5e-14 at a million).
"""
from __future__ import annotations

import hashlib


def _h(doc_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8", "surrogateescape"), digest_size=8).digest(),
                          "little")


class SkipSet:
    def __init__(self, ids=()):
        import numpy as np

        if hasattr(ids, "to_pylist"):  # an Arrow array or chunked array of ids
            ids = ids.to_pylist()
        self.hashes = np.unique(np.fromiter((_h(str(i)) for i in ids), dtype=np.uint64))

    def __contains__(self, doc_id) -> bool:
        import numpy as np

        h = np.uint64(_h(str(doc_id)))
        i = int(np.searchsorted(self.hashes, h))
        return i < len(self.hashes) and self.hashes[i] == h

    def __len__(self) -> int:
        return int(len(self.hashes))

    def __repr__(self) -> str:
        return f"SkipSet({len(self)} ids)"

"""Stand-ins for worker actor handles in tests of the pools' placement checks (no Ray):
`FakeWorker(node).ping.remote()` answers like a worker on ``node``."""
from __future__ import annotations


class Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeWorker:
    def __init__(self, node):
        self.ping = Remote(lambda: {"pid": 1, "node_id": node})
        self.cleaned = []
        self.shm_cleanup = Remote(lambda close: self.cleaned.append(close) or [])

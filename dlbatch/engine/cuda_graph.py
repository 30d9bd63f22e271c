"""Decode steps replayed from CUDA graphs.

A decode step's launches depend only on the batch size once its metadata lives in fixed
buffers: block tables padded to the longest possible context, lengths, slots. So each
bucket of batch sizes (1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``) is
captured once, at the engine's start-up (`capture_all`, largest first so smaller graphs
reuse its memory pool), and replayed after copying the step's inputs into the persistent
buffers. Rows past the real batch are
padding: length 0 (attention writes zeros), slot -1 (their KV is not stored), token 0.

Only pure-decode steps with no layer streaming take this path, and only when the
decode attention and the fused rotary/store op are the CUDA ones (the reference
``store_kv`` cannot skip padding slots); everything else runs the model eagerly.
``GraphedModel`` stands in for the Transformer (attributes delegate to it), so the
runner is unchanged. The logits it returns are a view of the graph's output buffer,
valid until the next forward.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("dlbatch.engine")

_SMALL = (1, 2, 4, 8)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Graph batch sizes: 1, 2, 4, 8, then multiples of 16, the last one max_num_seqs."""
    out = [b for b in _SMALL if b < max_num_seqs]
    out += list(range(16, max_num_seqs, 16))
    out.append(max_num_seqs)
    return sorted(set(out))


def pick_bucket(buckets: list[int], batch: int) -> int | None:
    """The smallest bucket holding ``batch``; None when it exceeds them all (run eager)."""
    return next((b for b in buckets if b >= batch), None)


def graphs_supported(ops) -> bool:
    return ops.chosen.get("paged_decode_attention") == "cuda" and ops.chosen.get("rotary_store_kv") == "cuda"


class GraphedModel:
    def __init__(self, model, block_size: int, max_model_len: int, max_num_seqs: int):
        from dlbatch.engine.model_runner import AttnMeta
        from dlbatch.engine.ops.triton_kernels import decode_partitions

        self.model = model
        self.block_size = block_size
        self.buckets = batch_buckets(max_num_seqs)
        c, dev, m = model.config, model.device, self.buckets[-1]
        width = -(-max_model_len // block_size)
        self.ids = torch.zeros(m, dtype=torch.long, device=dev)
        self.pos = torch.zeros(m, dtype=torch.long, device=dev)
        self.slots = torch.full((m,), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros((m, width), dtype=torch.int32, device=dev)
        self.lens = torch.zeros(m, dtype=torch.int32, device=dev)
        self.rows = torch.arange(m, device=dev)
        parts = decode_partitions(width, 16)
        n = m * c.num_heads * parts
        self.scratch = (torch.empty(n, device=dev), torch.empty(n, device=dev), torch.empty(n, c.head_dim, device=dev))
        self._meta_cls = AttnMeta
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, logits buffer)
        self.pool = None
        self.kv_cache = None
        self.replays = 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def _meta(self, b: int):
        meta = self._meta_cls(slots=self.slots[:b], num_prefill_tokens=0, decode_lens=self.lens[:b],
                              sliding_window=self.model.config.sliding_window)
        meta.decode_block_tables = self.tables[:b]  # the tensor forms the CUDA ops read (ops/cuda.py)
        meta.decode_scratch = self.scratch
        return meta

    def _capture(self, b: int, kv_cache: torch.Tensor):
        meta = self._meta(b)
        args = (self.ids[:b], self.pos[:b], kv_cache, meta, self.rows[:b])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: kernels compiled and autotuned outside the capture
            self.model.forward(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(*args)
        self.pool = graph.pool()
        log.info("captured a CUDA graph for decode batch %d", b)
        return graph, logits

    def capture_all(self, kv_cache: torch.Tensor) -> None:
        """Capture every bucket's graph now (largest first: the smaller ones fit in its pool)."""
        import time

        t0 = time.perf_counter()
        self.kv_cache = kv_cache
        for b in sorted(self.buckets, reverse=True):
            if b not in self.graphs:
                self.graphs[b] = self._capture(b, kv_cache)
        log.info("captured %d CUDA graphs (decode batches %s) in %.1f s", len(self.graphs), self.buckets,
                 time.perf_counter() - t0)

    def eligible(self, meta, batch: int, kv_cache) -> bool:
        return (meta.num_prefill_tokens == 0 and meta.on_layer is None and batch > 0
                and batch <= self.buckets[-1] and (self.kv_cache is None or kv_cache is self.kv_cache))

    def forward(self, input_ids, positions, kv_cache, meta, logits_indices):
        b = input_ids.shape[0]
        if not self.eligible(meta, b, kv_cache):
            return self.model.forward(input_ids, positions, kv_cache, meta, logits_indices)
        from dlbatch.engine.ops.cuda import decode_tables

        self.kv_cache = kv_cache
        bucket = pick_bucket(self.buckets, b)
        tables, lens = decode_tables(meta, self.block_size)
        self.ids[:b].copy_(input_ids, non_blocking=True)
        self.pos[:b].copy_(positions, non_blocking=True)
        self.slots[:b].copy_(meta.slots, non_blocking=True)
        self.tables[:b, :tables.shape[1]].copy_(tables, non_blocking=True)
        self.lens[:b].copy_(lens, non_blocking=True)
        self.ids[b:bucket].zero_()
        self.pos[b:bucket].zero_()
        self.slots[b:bucket].fill_(-1)
        self.lens[b:bucket].zero_()
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket, kv_cache)
        graph, logits = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return logits[:b]

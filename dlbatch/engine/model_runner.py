"""Turns a scheduled step into tensors, runs the model, samples. Owns the KV cache tensor
`(2, layers, blocks, block_size, kv_heads, head_dim)`."""
from __future__ import annotations

import torch

from dlbatch.engine.config import EngineConfig, ModelConfig
from dlbatch.engine.model import Transformer
from dlbatch.engine.scheduler import SchedulerOutput
from dlbatch.engine.step_meta import AttnMeta, StepMetaBuilder  # noqa: F401  (AttnMeta: re-exported)


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU the memory comes from calloc (numpy.zeros), whose pages the
    OS maps zeroed on first touch: a multi-GiB KV cache costs nothing until it is used,
    where torch.zeros writes every page up front (seconds per worker at start-up)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import math

    import numpy as np

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model: Transformer, mconf: ModelConfig, econf: EngineConfig, num_blocks: int,
                 kv_dtype: torch.dtype | None = None):
        self.model = model
        self.mconf = mconf
        self.econf = econf
        self.device = model.device
        self.block_size = econf.block_size
        # the reference decode attention needs a padded gather index; device ops may not
        self.need_gather = model.ops.chosen.get("paged_decode_attention") == "reference"
        # the KV cache may be stored narrower than the model computes (kv_cache_dtype): the
        # ops convert on store and on read; the native CPU kernel widens rows as it loads them
        kv_dtype = kv_dtype or model.dtype
        # the native CPU kernel (dlbatch/engine/ops/_paged_attn.c) computes in float32, from
        # queries of the model's dtype and a cache of float32, float16 or bfloat16
        self.use_native = False
        if model.ops.chosen.get("paged_decode_attention") == "cpu":
            from dlbatch.engine.ops import native

            self.use_native = (native.lib() is not None and kv_dtype in native.KV_KINDS
                               and model.dtype in native.KV_KINDS)
        self.masker = None  # engine/constraint.py ConstraintMasker, set by the engine
        self.kv_cache = _zeros(
            (2, mconf.num_layers, num_blocks, econf.block_size, mconf.num_kv_heads, mconf.head_dim),
            dtype=kv_dtype, device=model.device)
        chosen = model.ops.chosen
        self.meta_builder = StepMetaBuilder(
            econf.block_size, econf.max_model_len, econf.max_num_seqs, model.device, mconf.sliding_window,
            need_decode_gather=self.need_gather, need_prefill_gather=chosen.get("prefill_attention") in ("reference", "cpu"))

    @staticmethod
    def bytes_per_block(mconf: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * mconf.num_layers * block_size * mconf.num_kv_heads * mconf.head_dim * torch.empty((), dtype=dtype).element_size()

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of token positions [start, end) of a sequence with block table `table`."""
        bs = self.block_size
        bt = torch.tensor(table, dtype=torch.int64)
        p = torch.arange(start, end)
        return (bt[p // bs] * bs + p % bs).to(self.device)

    def prepare(self, out: SchedulerOutput):
        """-> (token ids, positions, AttnMeta, logits rows, sequences to sample): prefill
        chunks first, then decode tokens (see dlbatch/engine/step_meta.py)."""
        prefills = [s for s in out.scheduled if not (s.num_new == 1 and s.seq.num_computed > 0)]
        decodes = [s for s in out.scheduled if s.num_new == 1 and s.seq.num_computed > 0]
        ids, pos, meta, rows, seqs = self.meta_builder.build(prefills, decodes)
        meta.use_native = self.use_native
        return ids, pos, meta, rows, seqs

    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        """Run one step; returns {id(seq): sampled token} for sequences that reached a sample point."""
        if not out.scheduled:
            return {}
        ids, pos, meta, rows, seqs = self.prepare(out)
        streams = [(s.seq, self._export_index(s.seq, len(s.seq.prompt_ids))) for s in out.scheduled
                   if s.seq.kv_sink is not None and s.seq.prefill_only and s.needs_logits]
        if streams:
            meta.on_layer = lambda li: self._stream_layer(streams, li)
        # constrained rows' token masks fill (in llguidance's pool) while the forward runs
        masked = self.masker is not None and self.masker.start(seqs)
        logits = self.model.forward(ids, pos, self.kv_cache, meta, rows)
        for seq, _ in streams:
            seq.kv_streamed = True
        if not seqs:
            return {}
        if masked:
            self.masker.apply(logits)
        tokens = self.sample(logits, seqs)
        return {id(s): int(t) for s, t in zip(seqs, tokens)}

    def sample(self, logits: torch.Tensor, seqs) -> list[int]:
        params = [s.params for s in seqs]
        if any(p.has_extras for p in params):
            return self._sample_extras(logits, seqs)
        if all(p.greedy for p in params):
            from dlbatch.engine.ops.native import argmax_rows

            return argmax_rows(logits).tolist()
        temp, top_p, top_k = self._sampling_tensors(params, logits.device)
        return self.model.ops.sample(logits, temp, top_p, top_k, self._generators(seqs, logits.device), False).tolist()

    @staticmethod
    def _sampling_tensors(params, dev):
        temp = torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        return temp, top_p, top_k

    @staticmethod
    def _generators(seqs, dev) -> list:
        gens = []
        for s in seqs:
            if s.generator is None:
                g = torch.Generator(device=dev)
                if s.params.seed is not None:
                    g.manual_seed(s.params.seed)
                else:
                    g.seed()
                s.generator = g
            gens.append(s.generator)
        return gens

    @torch.inference_mode()
    def _sample_extras(self, logits: torch.Tensor, seqs) -> list[int]:
        """Sampling with min-p, penalties or logprobs asked by some row (ops' `SampleExtras`);
        the other rows sample exactly as without them."""
        from dlbatch.engine.ops.reference import SampleExtras

        params = [s.params for s in seqs]
        dev = logits.device
        all_greedy = all(p.greedy for p in params)
        ex = SampleExtras()
        if any(p.min_p > 0 and not p.greedy for p in params):
            ex.min_p = torch.tensor([p.min_p for p in params], device=dev)
        pen = [i for i, p in enumerate(params) if p.penalized]
        if pen:
            vocab = logits.shape[-1]
            rows = [self._token_counts(seqs[i], vocab, dev) for i in pen]
            ex.penalty_rows = torch.tensor(pen, dtype=torch.long, device=dev)
            ex.counts = torch.stack([c for c, _ in rows])
            ex.prompt_mask = torch.stack([m for _, m in rows])
            ex.repetition = torch.tensor([params[i].repetition_penalty for i in pen], device=dev)
            ex.presence = torch.tensor([params[i].presence_penalty for i in pen], device=dev)
            ex.frequency = torch.tensor([params[i].frequency_penalty for i in pen], device=dev)
        want = [p.logprobs for p in params if p.logprobs is not None]
        if want:
            ex.num_logprobs = max(want)
        temp, top_p, top_k = self._sampling_tensors(params, dev)
        gens = [] if all_greedy else self._generators(seqs, dev)
        tokens, lps = self.model.ops.sample(logits, temp, top_p, top_k, gens, all_greedy, ex)
        tokens = tokens.tolist()
        if lps is not None:
            chosen, top_ids, top_lp = (t.tolist() for t in lps)
            for i, s in enumerate(seqs):
                k = s.params.logprobs
                if k is None:
                    continue
                if s.logprobs is None:
                    s.logprobs = []
                s.logprobs.append((tokens[i], chosen[i], top_ids[i][:k], top_lp[i][:k]))
        return tokens

    @staticmethod
    def _token_counts(seq, vocab: int, dev):
        """(counts of the output's tokens, the prompt's tokens as a mask), both (V,), kept on the
        sequence: built at its first penalized sample, then the tokens it added since."""
        if seq.token_counts is None or seq.token_counts.shape[0] != vocab:
            seq.token_counts = torch.zeros(vocab, dtype=torch.float32, device=dev)
            seq.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=dev)
            seq.prompt_mask[torch.tensor(seq.prompt_ids, dtype=torch.long, device=dev)] = True
            seq.counted = 0
        new = seq.output_ids[seq.counted:]
        if new:
            idx = torch.tensor(new, dtype=torch.long, device=dev)
            seq.token_counts.index_add_(0, idx, torch.ones(len(new), dtype=torch.float32, device=dev))
            seq.counted = len(seq.output_ids)
        return seq.token_counts, seq.prompt_mask

    def prefault_kv_cache(self) -> int:
        """Write one byte of every 4 KiB page of a CPU cache, keeping its value: the pages the
        OS maps lazily (see _zeros) are backed now instead of by the first steps that reach
        them. For benchmarks beside engines that zero their whole cache at start-up (first
        touch of fresh memory is slow in some VMs, docs/benchmarks.md); an engine never calls
        it. Returns the bytes of the cache (0 on other devices: nothing done)."""
        if self.kv_cache.device.type != "cpu":
            return 0
        raw = self.kv_cache.view(-1).view(torch.uint8)
        raw[::4096].bitwise_or_(0)
        return raw.numel()

    # ---- KV export / import (prefill/decode disaggregation) ------------------------------
    def _export_index(self, seq, num_tokens: int) -> torch.Tensor:
        return self._slots(seq.block_table, 0, num_tokens)

    def export_layer(self, idx: torch.Tensor, li: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``li`` of the KV at cache slots ``idx``, token-major (2, len(idx), Hkv, D),
        gathered into ``out`` (same shape and dtype) or a new tensor."""
        hk, d = self.mconf.num_kv_heads, self.mconf.head_dim
        flat = self.kv_cache.view(2, self.mconf.num_layers, -1, hk, d)
        shape = (2, idx.numel(), hk, d)
        if out is None:
            out = torch.empty(shape, dtype=self.kv_cache.dtype, device=self.device)
        elif tuple(out.shape) != shape or out.dtype != self.kv_cache.dtype:
            raise ValueError(f"KV sink buffer for layer {li} is {tuple(out.shape)} {out.dtype}, "
                             f"expected {shape} {self.kv_cache.dtype}")
        elif out.device != self.kv_cache.device:  # index_select cannot write across devices
            out.copy_(self.export_layer(idx, li))
            return out
        # K and V of a layer are each contiguous (slots, Hkv, D); gathering from the strided
        # (2, slots, Hkv, D) view instead made torch copy the whole layer of the cache first
        # (~2 s per exported sequence with a 3 GiB cache)
        torch.index_select(flat[0, li], 0, idx, out=out[0])
        torch.index_select(flat[1, li], 0, idx, out=out[1])
        return out

    def export_kv(self, seq, num_tokens: int) -> list[torch.Tensor]:
        """Per layer, (2, num_tokens, Hkv, D) copies of the sequence's KV (token-major)."""
        idx = self._export_index(seq, num_tokens)
        return [self.export_layer(idx, li) for li in range(self.mconf.num_layers)]

    def _stream_layer(self, streams, li: int) -> None:
        for seq, idx in streams:
            sink = seq.kv_sink
            # a CUDA layer is gathered on the device and staged by the sink (transfer/sink.py)
            lend = hasattr(sink, "layer_buffer") and self.device.type == "cpu"
            buf = sink.layer_buffer(li) if lend else None
            sink.send_layer(li, self.export_layer(idx, li, buf))

    def copy_block_head(self, src: int, dst: int, rows: int) -> None:
        """KV of the first ``rows`` tokens of block ``src`` into block ``dst``, every layer
        (a partial prefix-cache hit: block_manager.py)."""
        self.kv_cache[:, :, dst, :rows] = self.kv_cache[:, :, src, :rows]

    def import_kv_layer(self, seq, layer: int, kv: torch.Tensor, start: int = 0) -> None:
        """Copy one layer's (2, n, Hkv, D) KV for token positions [start, n) into the
        sequence's blocks, converting dtype; the block size of the sender does not matter
        since the payload is token-major."""
        n = kv.shape[1]
        idx = self._slots(seq.block_table, start, n)
        hk, d = self.mconf.num_kv_heads, self.mconf.head_dim
        flat = self.kv_cache.view(2, self.mconf.num_layers, -1, hk, d)
        src = kv[:, start:n].to(device=self.device, dtype=self.kv_cache.dtype)
        flat[0, layer].index_copy_(0, idx, src[0])
        flat[1, layer].index_copy_(0, idx, src[1])

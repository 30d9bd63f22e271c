"""Turns a scheduled step into tensors, runs the model, samples. Owns the KV cache tensor
`(2, layers, blocks, block_size, kv_heads, head_dim)`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dlbatch.engine.config import EngineConfig, ModelConfig
from dlbatch.engine.model import Transformer
from dlbatch.engine.scheduler import SchedulerOutput


@dataclass
class AttnMeta:
    slots: torch.Tensor
    num_prefill_tokens: int
    prefill: list = field(default_factory=list)  # (q_start, n_new, ctx_start, gather|None)
    decode_gather: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_runs: list | None = None  # per sequence: [(first_slot, n_tokens), ...] contiguous in the cache
    native_runs: object | None = None  # decode_runs as flat tensors for the native CPU kernel
    sliding_window: int | None = None
    on_layer: object = None  # called with the layer index right after it stored its KV


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
    def __init__(self, model: Transformer, mconf: ModelConfig, econf: EngineConfig, num_blocks: int):
        self.model = model
        self.mconf = mconf
        self.econf = econf
        self.device = model.device
        self.block_size = econf.block_size
        # the reference decode attention needs a padded gather index; device ops may not
        self.need_gather = model.ops.chosen.get("paged_decode_attention") == "reference"
        # the native CPU kernel (dlbatch/engine/ops/_paged_attn.c) takes float32 caches
        self.use_native = False
        if model.ops.chosen.get("paged_decode_attention") == "cpu" and model.dtype == torch.float32:
            from dlbatch.engine.ops import native

            self.use_native = native.lib() is not None
        self.masker = None  # engine/constraint.py ConstraintMasker, set by the engine
        self.kv_cache = _zeros(
            (2, mconf.num_layers, num_blocks, econf.block_size, mconf.num_kv_heads, mconf.head_dim),
            dtype=model.dtype, device=model.device)

    @staticmethod
    def bytes_per_block(mconf: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * mconf.num_layers * block_size * mconf.num_kv_heads * mconf.head_dim * torch.empty((), dtype=dtype).element_size()

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, out: SchedulerOutput):
        prefills = [s for s in out.scheduled if not (s.num_new == 1 and s.seq.num_computed > 0)]
        decodes = [s for s in out.scheduled if s.num_new == 1 and s.seq.num_computed > 0]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        prefill_meta = []
        logits_rows: list[int] = []
        logits_seqs = []
        for s in prefills:
            seq, start, n = s.seq, s.seq.num_computed, s.num_new
            q_start = len(ids)
            npr = len(seq.prompt_ids)
            if start + n <= npr:
                ids.extend(seq.prompt_ids[start:start + n])
            else:
                ids.extend(seq.all_ids[start:start + n])
            pos.extend(range(start, start + n))
            slots.extend(self._slots(seq.block_table, start, start + n))
            gather = None
            if start > 0:
                gather = torch.tensor(self._slots(seq.block_table, 0, start + n), dtype=torch.long, device=self.device)
            prefill_meta.append((q_start, n, start, gather))
            if s.needs_logits:
                logits_rows.append(len(ids) - 1)
                logits_seqs.append(seq)
        num_prefill = len(ids)
        dg = dm = dl = None
        if decodes:
            lens = [s.seq.num_computed + 1 for s in decodes]
            lmax = max(lens)
            window = self.mconf.sliding_window
            bs = self.block_size
            gather_rows = []
            for s, L in zip(decodes, lens):
                seq = s.seq
                p = seq.num_computed
                npr = len(seq.prompt_ids)
                ids.append(seq.prompt_ids[p] if p < npr else seq.output_ids[p - npr])
                pos.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
                if self.need_gather:
                    gather_rows.append(self._slots(seq.block_table, 0, L) + [0] * (lmax - L))
                logits_rows.append(len(ids) - 1)
                logits_seqs.append(seq)
            dl = torch.tensor(lens, dtype=torch.long, device=self.device)
            if self.need_gather:
                dg = torch.tensor(gather_rows, dtype=torch.long, device=self.device)
                kpos = torch.arange(lmax, device=self.device).unsqueeze(0)
                mask = kpos < dl.unsqueeze(1)
                if window is not None:
                    mask &= kpos > (dl.unsqueeze(1) - 1 - window)
                dm = mask[:, None, None, :]
            runs_all = []
            bs = self.block_size
            for s, L in zip(decodes, lens):
                lo = 0 if window is None else max(0, L - window)
                table = s.seq.block_table
                runs = []
                p = lo
                while p < L:
                    blk = table[p // bs]
                    start = blk * bs + p % bs
                    n = min(bs - p % bs, L - p)
                    p += n
                    if runs and runs[-1][0] + runs[-1][1] == start:
                        runs[-1] = (runs[-1][0], runs[-1][1] + n)
                    else:
                        runs.append((start, n))
                runs_all.append(runs)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        native_runs = None
        if decodes and self.use_native:
            from dlbatch.engine.ops.native import Runs

            native_runs = Runs(runs_all)
        meta = AttnMeta(slots=t(slots), num_prefill_tokens=num_prefill, prefill=prefill_meta,
                        decode_gather=dg, decode_mask=dm, decode_lens=dl, sliding_window=self.mconf.sliding_window,
                        decode_runs=runs_all if decodes else None, native_runs=native_runs)
        return t(ids), t(pos), meta, t(logits_rows), logits_seqs

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
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist()
        dev = logits.device
        temp = torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
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
        return self.model.ops.sample(logits, temp, top_p, top_k, gens, False).tolist()

    # ---- KV export / import (prefill/decode disaggregation) ------------------------------
    def _export_index(self, seq, num_tokens: int) -> torch.Tensor:
        return torch.tensor(self._slots(seq.block_table, 0, num_tokens), dtype=torch.long, device=self.device)

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

    def import_kv_layer(self, seq, layer: int, kv: torch.Tensor, start: int = 0) -> None:
        """Copy one layer's (2, n, Hkv, D) KV for token positions [start, n) into the
        sequence's blocks, converting dtype; the block size of the sender does not matter
        since the payload is token-major."""
        n = kv.shape[1]
        idx = torch.tensor(self._slots(seq.block_table, start, n), dtype=torch.long, device=self.device)
        hk, d = self.mconf.num_kv_heads, self.mconf.head_dim
        flat = self.kv_cache.view(2, self.mconf.num_layers, -1, hk, d)
        src = kv[:, start:n].to(device=self.device, dtype=self.kv_cache.dtype)
        flat[0, layer].index_copy_(0, idx, src[0])
        flat[1, layer].index_copy_(0, idx, src[1])

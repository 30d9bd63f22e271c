"""Per-step attention metadata built from tensors.

Two pieces:

- `BlockTables`: one persistent int64 table (rows, max_blocks) on the host (pinned when
  the engine runs on CUDA) holding every running sequence's block table. A sequence
  keeps its row while it runs; each step only the blocks it gained since the last step
  are written (a sequence gains one block every `block_size` decode steps). Invariant
  relied on: a `Sequence.block_table` list only grows by `append` while that list object
  lives; the block manager replaces the list (a new object) when it frees or re-admits a
  sequence, which the table notices by identity and rewrites the row.
- `StepMetaBuilder.build`: a scheduled step -> token ids, positions and `AttnMeta`, with
  slots, positions and block tables computed by vectorised torch ops over the table rows
  (no per-token Python), then moved to the device in one `non_blocking` copy of one
  packed int64 buffer. Only what the chosen attention ops read is built: the padded
  gather + mask for the reference decode op, per-chunk gathers for the reference prefill
  op; device kernels read `decode_block_tables` / `decode_lens` and the prefill
  `prefill_cu_q`, `prefill_ctx` and `prefill_block_tables` directly.

Layout of the metadata a kernel can take (all int64, on the model's device):
  slots (T,)                    cache slot of every token of the step (store_kv)
  positions (T,)                position of every token
  decode_block_tables (B, nb)   block ids of each decoding sequence; entries past its
                                length are stale but valid block ids
  decode_lens (B,)              context length of each decoding sequence, new token included
  prefill_cu_q (P+1,)           prefill chunk boundaries in the flattened tokens
  prefill_ctx (P,)              tokens already in the cache before each chunk
  prefill_block_tables (P, nb)  block ids of each prefilling sequence
  prefill_max_new               the longest chunk (an int, for a kernel's grid)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttnMeta:
    slots: torch.Tensor
    num_prefill_tokens: int
    prefill: list = field(default_factory=list)  # (q_start, n_new, ctx_start, gather|None) per chunk
    prefill_cu_q: torch.Tensor | None = None
    prefill_ctx: torch.Tensor | None = None
    prefill_max_new: int = 0
    prefill_block_tables: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_gather: torch.Tensor | None = None  # reference decode op only: (B, Lmax) padded slots
    decode_mask: torch.Tensor | None = None  # reference decode op only: (B, 1, 1, Lmax)
    block_size: int = 16
    sliding_window: int | None = None
    use_native: bool = True  # CPU: the C decode kernel may run (tests turn it off to compare)
    on_layer: object = None  # called with the layer index right after it stored its KV


class _Row:
    __slots__ = ("seq", "table", "synced", "row")

    def __init__(self, seq, row: int):
        self.seq, self.table, self.synced, self.row = seq, None, 0, row


class BlockTables:
    """Persistent block tables of running sequences (see the module docstring)."""

    def __init__(self, rows: int, max_blocks: int, pin: bool = False):
        self.table = torch.zeros((rows, max_blocks), dtype=torch.int64, pin_memory=pin)
        self.max_blocks = max_blocks
        self._rows: dict[int, _Row] = {}
        self._free = list(range(rows - 1, -1, -1))

    def rows(self, seqs) -> list[int]:
        """Row index of each sequence, its row brought up to date with its block table."""
        out = []
        for seq in seqs:
            r = self._rows.get(id(seq))
            if r is None or r.seq is not seq:
                r = self._assign(seq, seqs)
            bt = seq.block_table
            if r.table is not bt or r.synced > len(bt):
                r.table, r.synced = bt, 0
            n = len(bt)
            if r.synced < n:
                if n > self.max_blocks:
                    raise ValueError(f"sequence {seq.seq_id} has {n} blocks; the block table holds {self.max_blocks}")
                self.table[r.row, r.synced:n] = torch.tensor(bt[r.synced:n], dtype=torch.int64)
                r.synced = n
            out.append(r.row)
        return out

    def _assign(self, seq, batch) -> _Row:
        if not self._free:  # rows of sequences outside this batch are reassigned (re-synced if they return)
            keep = {id(s) for s in batch}
            for k in [k for k in self._rows if k not in keep]:
                self._free.append(self._rows.pop(k).row)
            if not self._free:
                raise RuntimeError(f"more than {self.table.shape[0]} sequences in one step")
        r = _Row(seq, self._free.pop())
        self._rows[id(seq)] = r
        return r


class StepMetaBuilder:
    """Builds a step's inputs; `need_decode_gather` / `need_prefill_gather` say whether
    the chosen decode / prefill attention op is the reference (padded gathers)."""

    def __init__(self, block_size: int, max_model_len: int, max_seqs: int, device: torch.device,
                 sliding_window: int | None, need_decode_gather: bool, need_prefill_gather: bool):
        self.bs = block_size
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.tables = BlockTables(2 * max_seqs + 2, -(-max_model_len // block_size) + 1, pin=self.pin)
        self.window = sliding_window
        self.need_decode_gather = need_decode_gather
        self.need_prefill_gather = need_prefill_gather
        self._staging: torch.Tensor | None = None
        self._copied = None  # CUDA event: the last staging copy has completed

    def build(self, prefills, decodes):
        """prefills / decodes: lists of ScheduledSeq (decodes run exactly their next token).
        Returns (token ids, positions, AttnMeta, logits rows, sequences to sample)."""
        ids: list[int] = []
        starts, ns = [], []
        prefill_meta = []
        logits_rows: list[int] = []
        logits_seqs = []
        for s in prefills:
            seq, start, n = s.seq, s.seq.num_computed, s.num_new
            prefill_meta.append((len(ids), n, start, None))
            npr = len(seq.prompt_ids)
            ids.extend(seq.prompt_ids[start:start + n] if start + n <= npr else seq.all_ids[start:start + n])
            starts.append(start)
            ns.append(n)
            if s.needs_logits:
                logits_rows.append(len(ids) - 1)
                logits_seqs.append(seq)
        num_prefill = len(ids)
        for s in decodes:
            seq = s.seq
            p, npr = seq.num_computed, len(seq.prompt_ids)
            ids.append(seq.prompt_ids[p] if p < npr else seq.output_ids[p - npr])
            starts.append(p)
            logits_rows.append(len(ids) - 1)
            logits_seqs.append(seq)
        seqs = [s.seq for s in prefills] + [s.seq for s in decodes]
        rows = torch.tensor(self.tables.rows(seqs), dtype=torch.int64)
        starts_t = torch.tensor(starts, dtype=torch.int64)
        P, B = len(prefills), len(decodes)
        host = self._host_tensors(ids, starts_t, ns, rows, P, B, logits_rows)
        dev = self._to_device(host)
        meta = AttnMeta(slots=dev["slots"], num_prefill_tokens=num_prefill, block_size=self.bs,
                        sliding_window=self.window)
        if P:
            meta.prefill_cu_q, meta.prefill_ctx = dev["prefill_cu_q"], dev["prefill_ctx"]
            meta.prefill_block_tables = dev["prefill_block_tables"]
            meta.prefill_max_new = max(ns)
            meta.prefill = self._prefill_gathers(prefill_meta, host["prefill_block_tables"])
        if B:
            meta.decode_block_tables, meta.decode_lens = dev["decode_block_tables"], dev["decode_lens"]
            if self.need_decode_gather:
                meta.decode_gather, meta.decode_mask = self._decode_gather(meta.decode_block_tables, meta.decode_lens)
        return dev["ids"], dev["positions"], meta, dev["logits_rows"], logits_seqs

    def _host_tensors(self, ids, starts_t, ns, rows, P, B, logits_rows) -> dict:
        bs, table = self.bs, self.tables.table
        h = {"ids": torch.tensor(ids, dtype=torch.int64), "logits_rows": torch.tensor(logits_rows, dtype=torch.int64)}
        if P:
            ns_t = torch.tensor(ns, dtype=torch.int64)
            cu = torch.zeros(P + 1, dtype=torch.int64)
            torch.cumsum(ns_t, 0, out=cu[1:])
            seq_of = torch.repeat_interleave(torch.arange(P), ns_t)
            pos_p = torch.arange(int(cu[-1])) - cu[:-1][seq_of] + starts_t[:P][seq_of]
            pos = torch.cat([pos_p, starts_t[P:]]) if B else pos_p
            seq_of = torch.cat([seq_of, torch.arange(P, P + B)]) if B else seq_of
            tok_rows = rows[seq_of]
            nb_p = int(((starts_t[:P] + ns_t + bs - 1) // bs).max())
            h["prefill_cu_q"], h["prefill_ctx"] = cu, starts_t[:P]
            h["prefill_block_tables"] = table[:, :nb_p].index_select(0, rows[:P])
        else:
            pos, tok_rows = starts_t, rows
        h["positions"] = pos
        h["slots"] = table[tok_rows, pos // bs] * bs + pos % bs
        if B:
            lens = starts_t[P:] + 1
            nb = int((lens.max() + bs - 1) // bs)
            h["decode_block_tables"] = table[:, :nb].index_select(0, rows[P:])
            h["decode_lens"] = lens
        return h

    def _to_device(self, host: dict) -> dict:
        """CPU: the host tensors are the step's tensors. CUDA: packed into one pinned
        buffer, one non_blocking copy, views on the device. The staging buffer is reused
        once the previous step's copy has completed (an event; normally long done, since
        sampling synchronises every step that has logits)."""
        if self.device.type == "cpu":
            return host
        flat = [t.reshape(-1) for t in host.values()]
        n = sum(t.numel() for t in flat)
        if self._copied is not None:
            self._copied.synchronize()
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(max(n, 1 << 16), dtype=torch.int64, pin_memory=self.pin)
        buf = self._staging[:n]
        torch.cat(flat, out=buf)
        d = buf.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        out, off = {}, 0
        for k, t in host.items():
            out[k] = d[off:off + t.numel()].view(t.shape)
            off += t.numel()
        return out

    def _prefill_gathers(self, prefill_meta, tables: torch.Tensor) -> list:
        """(q_start, n, ctx_start, gather) per chunk; gather (cache slots of the whole
        context, for the reference prefill op) only when ctx_start > 0 and that op runs."""
        if not self.need_prefill_gather:
            return prefill_meta
        out = []
        for i, (qs, n, ctx, _) in enumerate(prefill_meta):
            gather = None
            if ctx > 0:
                k = torch.arange(ctx + n)
                gather = (tables[i, k // self.bs] * self.bs + k % self.bs).to(self.device, non_blocking=True)
            out.append((qs, n, ctx, gather))
        return out

    def _decode_gather(self, tables: torch.Tensor, lens: torch.Tensor):
        lmax = int(lens.max())
        k = torch.arange(lmax, device=tables.device)
        gather = tables[:, k // self.bs] * self.bs + k % self.bs
        mask = k.unsqueeze(0) < lens.unsqueeze(1)
        if self.window is not None:
            mask &= k.unsqueeze(0) > (lens.unsqueeze(1) - 1 - self.window)
        return gather, mask[:, None, None, :]

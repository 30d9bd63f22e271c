"""The engine's host time per step, without the model: the "step overhead" line of
`dlbatch bench engine`.

- metadata: `ModelRunner.prepare` for a decode step of `batch` sequences with `context`
  tokens each (block tables in sync, as in steady state);
- decode step: schedule -> prepare -> a no-op model (returns fixed logits) -> sample ->
  postprocess, the engine loop of `LLMEngine.step`, median over steps while every
  sequence grows by one token per step (so block tables gain blocks as in a real run).

A third figure is a real decode step on the tiny random model (`tiny_model_step`): 2
layers of hidden size 64, so its compute is negligible and the step is the engine's host
work plus reading every sequence's KV once, held against that read at the measured copy
bandwidth.

The step's host time is also given without sampling (`new_host_s`: the step minus the
median of `sample` alone), since the argmax over the logits is device work on an
accelerator and reads batch x vocab floats. Both are timed for the current code and for the previous implementation of `prepare`
(per-token Python lists and `torch.tensor(list)`, kept below as `legacy_prepare`, only
as this baseline), in the same run. The KV cache is a one-layer, one-head stand-in: the
no-op model never reads it, and the block tables are what a full cache would have.
"""
from __future__ import annotations

import dataclasses
import time

from dlbatch.bench.common import median


class NoOpModel:
    """Stands in for `Transformer`: same device, dtype and ops; logits of the real vocab
    size (fixed random values, up to 256 rows), so sampling costs what it costs with a model."""

    def __init__(self, model, vocab: int):
        import torch

        self.device, self.dtype, self.ops, self.config = model.device, model.dtype, model.ops, model.config
        g = torch.Generator().manual_seed(0)
        self._logits = torch.randn((256, vocab), generator=g).to(model.device)

    def forward(self, input_ids, positions, kv_cache, meta, logits_indices):
        return self._logits[:logits_indices.shape[0]]


def legacy_prepare(runner, out):
    """The list-based `prepare` this change replaced (per-token Python, both
    representations built), for the baseline only; its metadata feeds no op here."""
    import torch

    bs, dev = runner.block_size, runner.device

    def slots_of(table, start, end):
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    prefills = [s for s in out.scheduled if not (s.num_new == 1 and s.seq.num_computed > 0)]
    decodes = [s for s in out.scheduled if s.num_new == 1 and s.seq.num_computed > 0]
    ids, pos, slots, rows, seqs, extra = [], [], [], [], [], []
    for s in prefills:
        seq, start, n = s.seq, s.seq.num_computed, s.num_new
        ids.extend(seq.all_ids[start:start + n])
        pos.extend(range(start, start + n))
        slots.extend(slots_of(seq.block_table, start, start + n))
        if start > 0:
            extra.append(torch.tensor(slots_of(seq.block_table, 0, start + n), dtype=torch.long, device=dev))
        if s.needs_logits:
            rows.append(len(ids) - 1)
            seqs.append(seq)
    if decodes:
        lens = [s.seq.num_computed + 1 for s in decodes]
        lmax = max(lens)
        gather_rows, runs_all = [], []
        for s, L in zip(decodes, lens):
            seq, p = s.seq, s.seq.num_computed
            npr = len(seq.prompt_ids)
            ids.append(seq.prompt_ids[p] if p < npr else seq.output_ids[p - npr])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            if runner.need_gather:
                gather_rows.append(slots_of(seq.block_table, 0, L) + [0] * (lmax - L))
            rows.append(len(ids) - 1)
            seqs.append(seq)
            runs, q = [], 0
            while q < L:
                start = seq.block_table[q // bs] * bs + q % bs
                n = min(bs - q % bs, L - q)
                q += n
                if runs and runs[-1][0] + runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], runs[-1][1] + n)
                else:
                    runs.append((start, n))
            runs_all.append(runs)
        extra.append(torch.tensor(lens, dtype=torch.long, device=dev))
        if gather_rows:
            extra.append(torch.tensor(gather_rows, dtype=torch.long, device=dev))
        flat = [r for runs in runs_all for r in runs]
        extra += [torch.tensor([a for a, _ in flat]), torch.tensor([n for _, n in flat]),
                  torch.tensor([sum(n for _, n in runs) for runs in runs_all])]
    t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
    from dlbatch.engine.step_meta import AttnMeta

    meta = AttnMeta(slots=t(slots), num_prefill_tokens=len(ids) - len(decodes))
    return t(ids), t(pos), meta, t(rows), seqs


def _setup(model, mconf, batch: int, context: int, steps: int, block: int = 16):
    """A scheduler + runner (no-op model) with `batch` sequences decoding at `context`."""
    from dlbatch.engine.block_manager import BlockManager
    from dlbatch.engine.config import EngineConfig
    from dlbatch.engine.model_runner import ModelRunner
    from dlbatch.engine.sampling_params import SamplingParams
    from dlbatch.engine.scheduler import Scheduler
    from dlbatch.engine.sequence import Sequence, SeqStatus

    total = context + steps + 2
    econf = EngineConfig(dtype="float32", device=str(model.device), max_model_len=total + block, block_size=block,
                         max_num_seqs=batch, max_num_batched_tokens=max(2048, batch), enable_prefix_caching=False)
    small = dataclasses.replace(mconf, num_layers=1, num_kv_heads=1, head_dim=8)
    nblocks = batch * (-(-total // block) + 1)
    bm = BlockManager(nblocks, block, enable_prefix_caching=False)
    sched = Scheduler(econf, bm)
    runner = ModelRunner(NoOpModel(model, mconf.vocab_size), small, econf, nblocks)
    sp = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for b in range(batch):
        seq = Sequence(seq_id=f"s{b}", prompt_ids=[3 + (b + i) % 1000 for i in range(context - 1)], params=sp)
        seq.output_ids = [5]
        bm.allocate(seq, reserve=True)
        seq.num_computed = len(seq) - 1
        seq.status = SeqStatus.RUNNING
        sched.running.append(seq)
    return sched, runner


def _time_steps(sched, runner, steps: int) -> list[float]:
    stop = lambda s: "length" if len(s.output_ids) >= s.params.max_tokens else None  # noqa: E731
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sampled = runner.execute(out)
        sched.free_finished(sched.postprocess(out, sampled, stop))
        ts.append(time.perf_counter() - t0)
    return ts


def measure(model, mconf, batch: int = 64, context: int = 4096, steps: int = 40) -> dict:
    """Median seconds of `prepare` and of a whole no-op decode step, new and legacy."""
    res = {"batch": batch, "context": context}
    for name, prep in (("new", None), ("legacy", legacy_prepare)):
        sched, runner = _setup(model, mconf, batch, context, steps)
        if prep is not None:
            runner.prepare = lambda out, r=runner, f=prep: f(r, out)
        _time_steps(sched, runner, 2)  # warm-up; tables in sync
        out = sched.schedule()
        n_meta = max(5, steps // (20 if prep else 1))
        tm = []
        for _ in range(n_meta):
            t0 = time.perf_counter()
            runner.prepare(out)
            tm.append(time.perf_counter() - t0)
        ts = _time_steps(sched, runner, max(5, steps // (4 if prep else 1)))
        res[f"{name}_meta_s"], res[f"{name}_step_s"] = median(tm), median(ts)
    # sampling alone: the argmax reads batch x vocab fp32 logits (12.6 MB for 64 x 49152),
    # device work on an accelerator, part of the step on a CPU
    ids, pos, meta, rows, seqs = runner.prepare(sched.schedule())
    logits = runner.model.forward(ids, pos, runner.kv_cache, meta, rows)
    tsample = []
    for _ in range(max(5, steps // 2)):
        t0 = time.perf_counter()
        runner.sample(logits, seqs)
        tsample.append(time.perf_counter() - t0)
    res["sample_s"] = median(tsample)
    res["new_host_s"] = res["new_step_s"] - res["sample_s"]
    return res


def tiny_model_step(batch: int = 64, context: int = 4096, steps: int = 12, *, decode) -> dict:
    """Median decode step of `batch` sequences with `context` tokens of (random) KV each on the
    tiny random model (dlbatch/bench/tiny_model.py, float32, its KV cache written before
    timing), and the KV bytes one step reads (the limit is their read at the copy bandwidth,
    as the decode rows of the engine bench count it). ``decode``: the engine bench's decode
    timing (`dlbatch.bench.engine.ours_decode`)."""
    import os
    import tempfile

    from dlbatch.bench.tiny_model import SHAPE, make_tiny_model
    from dlbatch.engine.llm import LLM

    block = 16
    mml = context + steps + 2 * block
    with tempfile.TemporaryDirectory(prefix="dlbatch-tiny-") as tmp:
        path = make_tiny_model(os.path.join(tmp, "m"), max_position_embeddings=max(SHAPE["max_position_embeddings"], mml))
        llm = LLM(path, dtype="float32", max_model_len=mml, chat=False, max_num_seqs=batch, block_size=block,
                  num_kv_blocks=batch * (-(-mml // block)) + 8, enable_prefix_caching=False)
        llm.engine.runner.prefault_kv_cache()
        r = decode(llm, batch, context, steps, "random", seed=7, vocab_hi=SHAPE["vocab_size"] - 1)
        kv_token = llm.engine.runner.bytes_per_block(llm.engine.mconf, 1, llm.engine.kv_dtype)
    kv_bytes = batch * (context + steps / 2) * kv_token
    return {"batch": batch, "context": context, "step_s": r["step_s"], "steps": r["steps"], "kv_bytes": kv_bytes}

"""Engine vs transformers: the logits tolerance and our model's logits at every position
of one prompt (tests/engine/test_parity.py, tests/engine/test_rope_scaling.py)."""
from __future__ import annotations

import torch

ATOL = 2e-4  # fp32 logits, engine vs transformers


def full_logits(llm, ids: list[int]) -> torch.Tensor:
    """Our model's logits at every position of one prompt (one prefill step)."""
    from dlbatch.engine.sampling_params import SamplingParams
    from dlbatch.engine.scheduler import ScheduledSeq, SchedulerOutput

    eng = llm.engine
    seq = eng.make_sequence("logits", ids, SamplingParams(max_tokens=1))
    eng.block_manager.allocate(seq, reserve=True)
    try:
        seq.num_computed = 0
        eng.block_manager.ensure_slots(seq, len(ids))
        out = SchedulerOutput([ScheduledSeq(seq, len(ids))])
        t_ids, pos, meta, _, _ = eng.runner.prepare(out)
        rows = torch.arange(len(ids))
        return eng.model.forward(t_ids, pos, eng.runner.kv_cache, meta, rows)
    finally:
        eng.block_manager.free_seq(seq)

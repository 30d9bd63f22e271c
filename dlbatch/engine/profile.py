"""An engine's start-up forward on its device, before the KV cache is sized.

One prefill at the largest step the scheduler makes (``max_num_batched_tokens`` prompt
tokens, at most ``max_model_len - 1``), through a throwaway KV cache just big enough for it:

- it measures the activations' peak memory, which the KV budget then leaves free (as vLLM
  does: weights + this peak + KV = the engine's share of the device), so a step at the
  largest batch cannot run out of memory after the cache took the rest;
- it compiles every kernel a prefill uses (Triton compiles on first call). A device op that
  fails to compile or run raises `OpFailed` naming it (`dlbatch.engine.ops.resolve` wraps
  device ops so); `start_up_forward` then resolves that op to the reference implementation,
  logs one warning naming it, and tries again, so a kernel the device or Triton version
  cannot build costs speed, not the job.

Off CUDA the forward still runs (the same checks) and the peak reads 0: a CPU engine's KV
cache is sized from host memory (engine.py).
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

log = logging.getLogger("dlbatch.engine")


def profile_forward(model, mconf, config, kv_dtype) -> int:
    """Run one largest prefill; -> the bytes of device memory it allocated at its peak above
    what was allocated before (0 off CUDA). Leaves nothing allocated behind."""
    from dlbatch.engine.block_manager import BlockManager, cdiv
    from dlbatch.engine.model_runner import ModelRunner
    from dlbatch.engine.sampling_params import SamplingParams
    from dlbatch.engine.scheduler import Scheduler
    from dlbatch.engine.sequence import Sequence

    n = max(1, min(config.max_num_batched_tokens, config.max_model_len - 1))
    blocks = cdiv(n + 1, config.block_size) + 1
    cfg = replace(config, enable_prefix_caching=False)
    sched = Scheduler(cfg, BlockManager(blocks, cfg.block_size, False))
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(model.device)
        torch.cuda.reset_peak_memory_stats(model.device)
        base = torch.cuda.memory_allocated(model.device)
    runner = ModelRunner(model, mconf, cfg, blocks, kv_dtype)
    cache_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    ids = [i % mconf.vocab_size for i in range(1, n + 1)]
    sched.add(Sequence("profile", ids, SamplingParams(max_tokens=1, ignore_eos=True)))
    while True:  # one step when n fits the step budget (it does: n <= max_num_batched_tokens)
        out = sched.schedule()
        if not out.scheduled:
            raise RuntimeError(f"the start-up forward of {n} tokens could not be scheduled in {blocks} blocks")
        runner.execute(out)
        done = sched.postprocess(out, {id(s.seq): 0 for s in out.scheduled if s.needs_logits}, lambda s: "length")
        sched.free_finished(done)
        if done:
            break
    if not cuda:
        return 0
    torch.cuda.synchronize(model.device)
    peak = torch.cuda.max_memory_allocated(model.device) - base - cache_bytes
    del runner
    torch.cuda.empty_cache()
    return max(0, int(peak))


def start_up_forward(model, mconf, config, kv_dtype, device, overrides: dict | None):
    """`profile_forward`, replacing a failing device op by the reference one (one warning
    each) until it runs; -> (peak bytes, the Ops it ran with, the overrides that got there)."""
    from dlbatch.engine.ops.resolve import OpFailed, get_ops

    overrides = dict(overrides or {})
    while True:
        try:
            return profile_forward(model, mconf, config, kv_dtype), model.ops, overrides
        except OpFailed as e:
            if overrides.get(e.op) == "reference":  # the reference itself failed: a real error
                raise
            log.warning("the %s op of %s failed to compile or run (%s: %s); it runs as the reference op", e.op,
                        model.ops.device_type, type(e.__cause__).__name__, e.__cause__)
            overrides[e.op] = "reference"
            model.ops = get_ops(device, overrides)

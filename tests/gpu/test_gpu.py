"""On a CUDA device (skipped without one): every CUDA op against the reference op on the
same device, the whole model's greedy tokens against transformers in fp32 (identical) and
in bf16 (first-token logits close), CUDA graphs on/off identical, and PD on one device
through shm (KV staged by the sink) and the RDT path (device tensors straight into the
cache). Run in its own pytest process (`make gpu-check`): tests/engine/test_triton_ops.py
switches Triton to its interpreter for the whole process it runs in.

Tolerances: fp32 ops 2e-4 (kernels use IEEE fp32 dots; reductions are ordered
differently), bf16 ops 2e-2; whole model fp32: the same greedy tokens as transformers,
logits within 1e-3; bf16: first-step logits cosine similarity >= 0.995 to fp32.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from tests.helpers.gpu_checks import decode_and_prefill_parity, norm_and_rotary_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="Triton is in interpreter mode in this process; run tests/gpu on its own"),
]

DEV = "cuda"


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    from dlbatch.engine.ops import cuda, reference

    return cuda, reference


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("windowed", [False, True])
def test_decode_and_prefill_parity(kernels, dtype, tol, windowed):
    decode_and_prefill_parity(kernels, dtype, tol, windowed, dev=DEV)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 2e-2)])
def test_norm_and_rotary_parity(kernels, dtype, tol):
    norm_and_rotary_parity(kernels, dtype, tol, dev=DEV)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model

    path = str(tmp_path_factory.mktemp("mistral"))
    hf = make_tiny_model("mistral", path)  # sliding window 24, GQA
    hf.generation_config.eos_token_id = None
    return path, hf


def _prompts(n, lo, hi, seed=0):
    from tests.helpers.tiny_models import VOCAB

    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    return [shared + [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_whole_model_greedy_matches_transformers(kernels, tiny):
    from dlbatch import LLM, SamplingParams

    path, hf = tiny
    prompts = _prompts(6, 1, 80)
    llm = LLM(path, dtype="float32", device=DEV, max_model_len=256, chat=False, max_num_batched_tokens=64)
    assert llm.engine.ops.chosen["paged_decode_attention"] == "cuda"
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert o.token_ids == want[0, len(p):].tolist()
    with torch.no_grad():
        want = hf(torch.tensor([prompts[0]])).logits[0].float()
    torch.testing.assert_close(_logits(llm, prompts[0]), want, atol=1e-3, rtol=1e-3)
    bf = LLM(path, dtype="bfloat16", device=DEV, max_model_len=256, chat=False)
    got = _logits(bf, prompts[0])[-1]
    assert torch.nn.functional.cosine_similarity(got, want[-1], dim=0) >= 0.995


def _logits(llm, ids):
    """Our model's float32 logits at every position of one prompt (one prefill step)."""
    from dlbatch.engine.sampling_params import SamplingParams
    from dlbatch.engine.scheduler import ScheduledSeq, SchedulerOutput

    eng = llm.engine
    seq = eng.make_sequence("logits", ids, SamplingParams(max_tokens=1))
    eng.block_manager.allocate(seq, reserve=True)
    try:
        seq.num_computed = 0
        eng.block_manager.ensure_slots(seq, len(ids))
        t_ids, pos, meta, _, _ = eng.runner.prepare(SchedulerOutput([ScheduledSeq(seq, len(ids))]))
        rows = torch.arange(len(ids), device=DEV)
        return eng.model.forward(t_ids, pos, eng.runner.kv_cache, meta, rows).float().cpu()
    finally:
        eng.block_manager.free_seq(seq)


def test_cuda_graphs_on_and_off_identical(kernels, tiny):
    from dlbatch import LLM, SamplingParams

    path, _ = tiny
    prompts = _prompts(11, 1, 60, seed=2)  # 11 sequences: bucket 16, then smaller as they finish
    params = [SamplingParams(max_tokens=4 + 3 * (i % 4), ignore_eos=True) for i in range(len(prompts))]
    eager = LLM(path, dtype="bfloat16", device=DEV, max_model_len=256, chat=False, enforce_eager=True)
    graphed = LLM(path, dtype="bfloat16", device=DEV, max_model_len=256, chat=False, max_num_seqs=32)
    assert type(eager.engine.runner.model).__name__ == "Transformer"
    want = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    gm = graphed.engine.runner.model
    assert gm.replays > 0 and sorted(gm.graphs) == gm.buckets  # every bucket captured at start-up
    assert eager.engine.num_blocks > 0 and graphed.engine.num_blocks > 0  # two engines, each its share


def _pd_pair(path):
    from dlbatch import LLM

    a = LLM(path, dtype="bfloat16", device=DEV, max_model_len=256, chat=False, kv_cache_memory=0.05)
    b = LLM(path, dtype="bfloat16", device=DEV, max_model_len=256, chat=False, kv_cache_memory=0.05)
    return a, b


def test_pd_on_one_device_through_shm(kernels, tiny):
    """The prefill engine streams each CUDA layer through the sink's pinned staging into
    shm segments; the decode engine imports them into its device cache."""
    from dlbatch import SamplingParams
    from dlbatch.engine.pd import PrefillResult
    from dlbatch.transfer import payload as P
    from dlbatch.transfer.choose import get_transport
    from dlbatch.transfer.sink import TransportSink

    path, _ = tiny
    a, b = _pd_pair(path)
    prompts = _prompts(4, 5, 60, seed=3)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in a.generate(prompts, sp)]
    tr = get_transport("shm", same_node=True)
    c = a.engine.mconf
    sinks = {}

    def factory(i, n):
        meta = P.make_meta(a.fingerprint, "bfloat16", c.num_layers, n, c.num_kv_heads, c.head_dim)
        sinks[i] = TransportSink(tr.open_sender(meta))
        return sinks[i]

    res = a.prefill(prompts, sp, kv_sink_factory=factory)
    rebuilt = []
    for i, r in enumerate(res):
        rx = tr.open_receiver(sinks[i].finish(timeout=30))
        payload = P.KVPayload(rx.meta, [x for _, x in rx.receive_layers(timeout=30)])
        layers = [P.layer_to_torch(payload, li).clone() for li in range(c.num_layers)]
        rx.release()
        rebuilt.append(PrefillResult(request_id=r.request_id, prompt_ids=r.prompt_ids, first_token=r.first_token,
                                     params=r.params, fingerprint=r.fingerprint, kv=layers))
    assert [o.token_ids for o in b.decode(rebuilt)] == want


def test_pd_on_one_device_rdt_path_keeps_tensors_on_device(kernels, tiny):
    """What the RDT decode worker does after the collective: unpack (checks) and import the
    device tensors into the cache, with no host hop. (Two NCCL ranks cannot share one GPU,
    so the collective itself needs two GPUs; this covers both ends around it.)"""
    from dlbatch import SamplingParams
    from dlbatch.engine.pd import PrefillResult
    from dlbatch.transfer import rdt
    from dlbatch.transfer.payload import dtype_name, make_meta

    path, _ = tiny
    a, b = _pd_pair(path)
    prompts = _prompts(3, 5, 60, seed=4)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in a.generate(prompts, sp)]
    c = a.engine.mconf
    rebuilt = []
    for r in a.prefill(prompts, sp):
        assert r.kv[0].is_cuda
        meta = make_meta(a.fingerprint, dtype_name(r.kv[0].dtype), c.num_layers, r.kv[0].shape[1], c.num_kv_heads,
                         c.head_dim)
        _, tensors = rdt.unpack(rdt.pack(meta, r.kv), expected_fingerprint=b.fingerprint)
        assert all(t.is_cuda for t in tensors)
        rebuilt.append(PrefillResult(request_id=r.request_id, prompt_ids=r.prompt_ids, first_token=r.first_token,
                                     params=r.params, fingerprint=r.fingerprint, kv=tensors))
    assert [o.token_ids for o in b.decode(rebuilt)] == want


def test_kv_cache_fraction_and_device_resolution(kernels, tiny):
    from dlbatch import LLM
    from dlbatch.engine.device import resolve_device

    path, _ = tiny
    free, _ = torch.cuda.mem_get_info()
    llm = LLM(path, dtype="bfloat16", device=DEV, max_model_len=256, chat=False, kv_cache_memory=0.01)
    kv = llm.engine.runner.kv_cache
    assert kv.numel() * kv.element_size() <= free * 0.01
    n = torch.cuda.device_count()
    assert resolve_device(f"cuda:{n - 1}", os.environ.get("CUDA_VISIBLE_DEVICES"), n) == f"cuda:{n - 1}"

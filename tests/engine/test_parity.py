"""Engine vs transformers (fp32, CPU): logits and greedy tokens for every architecture,
including prefix-cache hits, chunked prefill and forced preemption."""
from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.parity import ATOL, full_logits
from tests.helpers.tiny_models import ARCHS, VOCAB, make_tiny_model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_tiny_model(request.param, path)
    hf.generation_config.eos_token_id = None  # compare raw greedy continuations (our ignore_eos)
    return request.param, path, hf


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_logits_match_transformers(tiny):
    from dlbatch import LLM

    arch, path, hf = tiny
    llm = LLM(path, dtype="float32", max_model_len=256, chat=False, enable_prefix_caching=False)
    for ids in _prompts(3, 5, 60, seed=1):
        ours = full_logits(llm, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4, msg=f"{arch}: logits differ")


def test_greedy_matches_transformers(tiny):
    from dlbatch import LLM, SamplingParams

    arch, path, hf = tiny
    llm = LLM(path, dtype="float32", max_model_len=256, chat=False)
    prompts = _prompts(4, 3, 50, seed=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for ids, o in zip(prompts, outs):
        assert o.token_ids == _hf_greedy(hf, ids, 12), arch
        assert o.finish_reason == "length"
    # the reference implementation of every op gives the same tokens as the device ones
    ref_ops = {name: "reference" for name in llm.engine.ops.chosen}
    ref = LLM(path, dtype="float32", max_model_len=256, chat=False, op_overrides=ref_ops)
    assert set(ref.engine.ops.chosen.values()) == {"reference"}
    assert [o.token_ids for o in ref.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))] == \
        [o.token_ids for o in outs]


def test_greedy_with_prefix_hits_chunking_and_preemption(tiny):
    from dlbatch import LLM, SamplingParams

    arch, path, hf = tiny
    base = _prompts(1, 70, 70, seed=3)[0]
    prompts = [base + p for p in _prompts(5, 4, 30, seed=4)]
    refs = [_hf_greedy(hf, ids, 10) for ids in prompts]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    # prefix cache: a first pass fills it, the second must hit and still be exact
    llm = LLM(path, dtype="float32", max_model_len=256, chat=False, block_size=16)
    llm.generate(prompts[:1], params)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs
    assert llm.stats()["prefix_hit_tokens"] >= 64 * 4
    assert any(o.cached_tokens >= 64 for o in outs)
    # chunked prefill: budget smaller than every prompt
    llm = LLM(path, dtype="float32", max_model_len=256, chat=False, block_size=16, max_num_batched_tokens=32)
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs
    # preemption: on-demand allocation with too few blocks for everyone at once
    llm = LLM(path, dtype="float32", max_model_len=128, chat=False, block_size=16, admission="greedy",
              num_kv_blocks=12, enable_prefix_caching=False)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs
    assert llm.stats()["preemptions"] > 0, "the test meant to force preemption"


def test_batched_equals_single(tiny):
    from dlbatch import LLM, SamplingParams

    arch, path, _ = tiny
    llm = LLM(path, dtype="float32", max_model_len=256, chat=False)
    prompts = _prompts(6, 2, 40, seed=5)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_greedy_with_partial_block_hits(tiny):
    """Prompts that share a 21-token head (one full block of 16, then 5 tokens of the next):
    the later ones copy the 5 rows from the first one's block and compute from token 21."""
    from dlbatch import LLM, SamplingParams

    arch, path, hf = tiny
    head = _prompts(1, 21, 21, seed=5)[0]
    prompts = [head + [t] + p for t, p in zip(range(3, 8), _prompts(5, 4, 30, seed=6))]
    refs = [_hf_greedy(hf, ids, 8) for ids in prompts]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm = LLM(path, dtype="float32", max_model_len=256, chat=False, block_size=16)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert [o.token_ids for o in first + rest] == refs, arch
    assert [o.cached_tokens for o in rest] == [21] * 4, arch

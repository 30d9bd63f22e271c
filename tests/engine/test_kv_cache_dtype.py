"""kv_cache_dtype: an fp32 model with its KV cache stored in float16 / bfloat16 (half the
KV bytes; the native CPU kernel widens rows as it reads them). Checked against the same
engine with an fp32 cache (itself checked against transformers in test_parity.py):
every decode step's logits within a tolerance set by the storage format's rounding
(float16: 11-bit significand, bfloat16: 8-bit), on prompts that hit the prefix cache
so the reference prefill op also reads the narrower cache."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_model

TOL = {"float16": 1e-2, "bfloat16": 4e-2}  # max |logit difference| / max |logit|


def _run(path, kv, prompts, native=True):
    from dlbatch.engine.llm import LLM
    from dlbatch.engine.sampling_params import SamplingParams

    llm = LLM(path, dtype="float32", max_model_len=256, chat=False, kv_cache_dtype=kv)
    runner = llm.engine.runner
    runner.use_native = runner.use_native and native
    seen = []
    sample = runner.sample

    def record(logits, seqs):
        seen.append(logits.clone())
        return sample(logits, seqs)

    runner.sample = record
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    return [o.token_ids for o in outs], seen, runner.kv_cache.dtype


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kvd"))
    make_tiny_model("qwen2", path)
    return path


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
@pytest.mark.parametrize("native", [True, False])
def test_half_kv_cache_within_tolerance(tiny, kv, native):
    head = [5, 6, 7, 8, 9, 10, 11, 12] * 5
    prompts = [head + [3, 4], [13, 14, 15] * 9, head + [20, 21, 22]]
    want_tokens, want, _ = _run(tiny, "auto", prompts, native)
    got_tokens, got, dtype = _run(tiny, kv, prompts, native)
    assert dtype == getattr(torch, kv)
    assert got_tokens == want_tokens  # greedy choices unchanged on this model
    assert len(got) == len(want)
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    scale = max(float(b.abs().max()) for b in want)
    assert 0 < diff <= TOL[kv] * scale, (diff, scale)  # 0 would mean the cache was not narrowed


def test_kv_cache_dtype_is_checked():
    from dlbatch.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")

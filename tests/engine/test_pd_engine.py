"""Prefill on one engine, decode on another: same tokens as one engine's generate."""
from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.tiny_models import VOCAB, make_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    make_tiny_model("qwen2", path)
    return path


def _prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_prefill_then_decode_equals_generate(tiny_path):
    from dlbatch import LLM, SamplingParams

    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = _prompts(5, 3, 60)
    a = LLM(tiny_path, dtype="float32", max_model_len=256, chat=False)
    ref = [o.token_ids for o in a.generate(prompts, params)]
    # same engine
    assert [o.token_ids for o in a.decode(a.prefill(prompts, params))] == ref
    # two engines, different block sizes on each side
    b = LLM(tiny_path, dtype="float32", max_model_len=256, chat=False, block_size=32)
    res = a.prefill(prompts, params)
    assert all(len(r.kv) == 2 and r.kv[0].shape[1] == len(p) for r, p in zip(res, prompts))
    assert [o.token_ids for o in b.decode(res)] == ref
    # prefix-cache hit on the prefill side still exports the whole KV
    res2 = a.prefill(prompts, params)
    assert a.stats()["prefix_hit_tokens"] > 0
    assert all(r.kv[0].shape[1] == len(p) for r, p in zip(res2, prompts))
    assert [o.token_ids for o in b.decode(res2)] == ref


def test_partial_block_hits_on_both_sides(tiny_path):
    """Prompts sharing a 21-token head (a full block of 16 + 5 rows of the next): the
    prefill engine and the decode engine each copy the 5 rows from their cache (the decode
    side imports from token 21 on) and the tokens are generate's."""
    from dlbatch import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    head = _prompts(1, 21, 21, seed=8)[0]
    prompts = [head + [t] + p for t, p in zip(range(3, 7), _prompts(4, 5, 30, seed=9))]
    ref = [o.token_ids for o in LLM(tiny_path, dtype="float32", max_model_len=256, chat=False,
                                    enable_prefix_caching=False).generate(prompts, params)]
    a = LLM(tiny_path, dtype="float32", max_model_len=256, chat=False)
    b = LLM(tiny_path, dtype="float32", max_model_len=256, chat=False)
    first = b.decode(a.prefill(prompts[:1], params))
    rest = b.decode(a.prefill(prompts[1:], params))
    assert [o.token_ids for o in first + rest] == ref
    assert a.stats()["prefix_hit_tokens"] == b.stats()["prefix_hit_tokens"] == 21 * 3


def test_seeded_sampling_survives_the_handoff(tiny_path):
    from dlbatch import LLM, SamplingParams

    a = LLM(tiny_path, dtype="float32", max_model_len=128, chat=False)
    b = LLM(tiny_path, dtype="float32", max_model_len=128, chat=False)
    sp = SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)
    p = _prompts(2, 5, 20, seed=3)
    ref = [o.token_ids for o in a.generate(p, sp)]
    assert [o.token_ids for o in b.decode(a.prefill(p, sp))] == ref


def test_bf16_prefill_to_fp32_decode(tiny_path):
    from dlbatch import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    p = _prompts(3, 10, 40, seed=4)
    pre = LLM(tiny_path, dtype="bfloat16", max_model_len=128, chat=False, allow_upcast=False)
    dec32 = LLM(tiny_path, dtype="float32", max_model_len=128, chat=False)
    dec16 = LLM(tiny_path, dtype="float16", max_model_len=128, chat=False, allow_upcast=False)
    res = pre.prefill(p, params)
    assert res[0].kv[0].dtype == torch.bfloat16
    out32 = dec32.decode(res)
    out16 = dec16.decode(pre.prefill(p, params))
    ref = pre.generate(p, params)  # the bf16-prefill reference
    # documented tolerance: the first token is the prefill engine's; later tokens may drift
    # where bf16 rounding changes a near-tie, so we require agreement on the first 2 tokens
    for o32, o16, r in zip(out32, out16, ref):
        assert o32.token_ids[0] == r.token_ids[0] == o16.token_ids[0]
        assert o32.token_ids[:2] == r.token_ids[:2]


def test_import_refuses_other_model(tiny_path, tmp_path):
    from dlbatch import LLM, SamplingParams
    from dlbatch.engine.pd import FingerprintMismatch

    other = str(tmp_path / "other")
    make_tiny_model("qwen2", other, seed=1)
    a = LLM(tiny_path, dtype="float32", max_model_len=128, chat=False)
    b = LLM(other, dtype="float32", max_model_len=128, chat=False)
    res = a.prefill(_prompts(1, 5, 5), SamplingParams(max_tokens=4))
    with pytest.raises(FingerprintMismatch, match="KV comes from model"):
        b.decode(res)


def test_first_token_finishing_needs_no_decode(tiny_path):
    from dlbatch import LLM, SamplingParams

    a = LLM(tiny_path, dtype="float32", max_model_len=128, chat=False)
    p = _prompts(2, 5, 9)
    res = a.prefill(p, SamplingParams(max_tokens=1))
    assert all(r.finish_reason == "length" for r in res)
    outs = a.decode(res)
    assert [len(o.token_ids) for o in outs] == [1, 1]
    assert [o.token_ids for o in outs] == [o.token_ids for o in a.generate(p, SamplingParams(max_tokens=1))]


class _RecordingSink:
    """A KVSink that records when each layer arrives (how many layers the model had
    finished by then) and what it held."""

    def __init__(self, engine, buffered: bool):
        self.engine = engine
        self.buffered = buffered
        self.layers: dict[int, torch.Tensor] = {}
        self.buffers: dict[int, torch.Tensor] = {}

    def layer_buffer(self, i):
        if not self.buffered:
            return None
        c = self.engine.mconf
        n = self.num_tokens
        self.buffers[i] = torch.full((2, n, c.num_kv_heads, c.head_dim), float("nan"),
                                     dtype=self.engine.runner.kv_cache.dtype)
        return self.buffers[i]

    def send_layer(self, i, kv):
        assert i == len(self.layers), "layers arrive in order"
        if self.buffered:
            assert kv is self.buffers[i], "gathered straight into the sink's buffer"
        self.layers[i] = kv.clone()


def test_kv_streamed_layer_by_layer_equals_export(tiny_path):
    """A KVSink gets every layer during the forward that finishes the prompt (chunked
    prefill and prefix-cache hits included), equal to the exported KV, and decoding it
    elsewhere gives generate's tokens."""
    from dlbatch import LLM, SamplingParams
    from dlbatch.engine.pd import PrefillResult

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = _prompts(4, 20, 90, seed=6)
    a = LLM(tiny_path, dtype="float32", max_model_len=256, chat=False, max_num_batched_tokens=64)  # chunked
    ref = [o.token_ids for o in a.generate(prompts, params)]
    exported = a.prefill(prompts, params)
    calls = []
    orig = a.engine.runner.model.forward

    def forward(*args, **kw):  # count forwards so we can tell when layers were sent
        calls.append(1)
        return orig(*args, **kw)

    a.engine.runner.model.forward = forward
    for buffered in (False, True):
        sinks = []

        def factory(k, n):
            s = _RecordingSink(a.engine, buffered)
            s.num_tokens = n
            sinks.append(s)
            return s

        calls.clear()
        res = a.prefill(prompts, params, kv_sink_factory=factory)  # prefix-cache hits on the 2nd pass
        assert all(r.kv is None and r.kv_streamed for r in res)
        for r, e, s, p in zip(res, exported, sinks, prompts):
            assert sorted(s.layers) == list(range(len(e.kv)))
            for i, layer in enumerate(e.kv):
                assert layer.shape[1] == len(p) and torch.equal(s.layers[i], layer)
            assert r.first_token == e.first_token
        b = LLM(tiny_path, dtype="float32", max_model_len=256, chat=False, block_size=32)
        rebuilt = [PrefillResult(request_id=r.request_id, prompt_ids=r.prompt_ids, first_token=r.first_token,
                                 params=r.params, fingerprint=r.fingerprint,
                                 kv=[s.layers[i] for i in range(len(s.layers))]) for r, s in zip(res, sinks)]
        assert [o.token_ids for o in b.decode(rebuilt)] == ref
    a.engine.runner.model.forward = orig


def test_kv_streaming_happens_inside_the_forward(tiny_path):
    """Layer i reaches the sink before layer i+1 is computed."""
    from dlbatch import LLM, SamplingParams

    a = LLM(tiny_path, dtype="float32", max_model_len=256, chat=False)
    events = []
    ops = a.engine.model.ops
    orig_norm = ops.rms_norm

    def rms_norm(*args, **kw):
        events.append("compute")
        return orig_norm(*args, **kw)

    class Sink:
        def send_layer(self, i, kv):
            events.append(i)

    import dataclasses

    a.engine.model.ops = dataclasses.replace(ops, rms_norm=rms_norm)
    try:
        a.prefill([_prompts(1, 30, 30, seed=9)[0]], SamplingParams(max_tokens=4), kv_sink_factory=lambda k, n: Sink())
    finally:
        a.engine.model.ops = ops
    sent = [e for e in events if e != "compute"]
    assert sent == list(range(a.engine.mconf.num_layers))
    # computation happens after layer 0 was sent (the later layers and the final norm)
    assert "compute" in events[events.index(0) + 1:]


def test_bf16_rows_do_not_depend_on_the_batch_on_a_bf16_cpu_without_amx(tiny_path):
    """Where the engine computes bf16 on a CPU with AVX512_BF16 and no AMX (packed oneDNN
    linears, attention in the C kernels over the bf16 cache), a row's greedy tokens are the
    same alone, in a batch, chunked, and prefilled on one engine then decoded on another."""
    from dlbatch import LLM, SamplingParams
    from dlbatch.engine.device import cpu_flags
    from dlbatch.engine.ops import native

    flags = cpu_flags()
    if "avx512_bf16" not in flags or "amx_bf16" in flags or not native.prefill_available(16):
        pytest.skip("the packed bf16 path runs on AVX512_BF16 CPUs without AMX")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = _prompts(6, 20, 90, seed=11)
    a = LLM(tiny_path, dtype="bfloat16", max_model_len=256, chat=False, allow_upcast=False)
    assert a.engine.compute_dtype == "bfloat16"
    batch = [o.token_ids for o in a.generate(prompts, params)]
    b = LLM(tiny_path, dtype="bfloat16", max_model_len=256, chat=False, allow_upcast=False, max_num_batched_tokens=32)
    assert [b.generate([p], params)[0].token_ids for p in prompts] == batch  # alone, chunked by 32
    assert [o.token_ids for o in b.decode(a.prefill(prompts, params))] == batch

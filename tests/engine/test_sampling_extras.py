"""Sampling extras (issue 29 point 3): min_p, repetition/presence/frequency penalties,
logprobs and n, each against an independent computation: crafted logits for the op's math,
transformers (fp32, CPU) for logprobs and penalized greedy decoding of a tiny model."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.tiny_models import VOCAB, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    hf = make_tiny_model("llama", path)
    hf.generation_config.eos_token_id = None
    return path, hf


@pytest.fixture(scope="module")
def llm(tiny):
    from dlbatch import LLM

    return LLM(tiny[0], dtype="float32", max_model_len=256, chat=False)


def _prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ------------------------------------------------------------------ parameters
def test_params_validate_naming_the_bad_value_and_fold_by_key():
    from dlbatch import SamplingParams

    for kw, word in [({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"repetition_penalty": 0.0}, "repetition"),
                     ({"presence_penalty": 2.5}, "presence"), ({"frequency_penalty": -3}, "frequency"),
                     ({"logprobs": -1}, "logprobs"), ({"logprobs": 1.5}, "logprobs"), ({"n": 0}, "n must"),
                     ({"n": True}, "n must"), ({"min_p": float("nan")}, "min_p")]:
        with pytest.raises(ValueError, match=word) as e:
            SamplingParams(**kw)
        assert repr(next(iter(kw.values()))) in str(e.value)
    base = SamplingParams(max_tokens=4)
    assert base.key() == (4, 0.0, 1.0, 0, None, (), (), False, False, None)  # unchanged without extras
    keys = {base.key(), SamplingParams(max_tokens=4, min_p=0.1).key(),
            SamplingParams(max_tokens=4, repetition_penalty=1.2).key(),
            SamplingParams(max_tokens=4, presence_penalty=0.5).key(),
            SamplingParams(max_tokens=4, frequency_penalty=0.5).key(),
            SamplingParams(max_tokens=4, logprobs=0).key(), SamplingParams(max_tokens=4, n=2).key()}
    assert len(keys) == 7
    assert not base.has_extras and SamplingParams(logprobs=0).has_extras


# ------------------------------------------------------------------ the op's math on crafted logits
def test_min_p_drops_exactly_the_tokens_below_the_threshold():
    from dlbatch.engine.ops.reference import apply_min_p, sample

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 1.9, -3.0, 0.0, 1.2],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    temp = torch.tensor([0.7, 1.0])
    min_p = torch.tensor([0.3, 0.5])
    x = logits / temp.unsqueeze(1)
    out = apply_min_p(x, min_p)
    for r in range(2):  # independent: probabilities in double precision, threshold by hand
        z = [math.exp(v) for v in x[r].double().tolist()]
        p = [v / sum(z) for v in z]
        keep = [pi >= min_p[r].item() * max(p) for pi in p]
        assert [math.isfinite(v) for v in out[r].tolist()] == keep
        assert torch.equal(out[r][torch.tensor(keep)], x[r][torch.tensor(keep)])
    assert torch.isfinite(out[1]).all()  # a flat row keeps everything
    assert torch.equal(apply_min_p(x, torch.zeros(2)), x)  # 0 = off
    # through the op: 400 seeded draws of row 0 land only on the kept tokens, and on each of them
    from dlbatch.engine.ops.reference import SampleExtras

    n = 400
    rows = logits[:1].repeat(n, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    toks, lp = sample(rows, torch.full((n,), 0.7), torch.ones(n), torch.zeros(n, dtype=torch.long), gens, False,
                      SampleExtras(min_p=torch.full((n,), 0.3)))
    assert lp is None
    z = torch.softmax(logits[0] / 0.7, -1)
    kept = set((z >= 0.3 * z.max()).nonzero().squeeze(1).tolist())
    assert set(toks.tolist()) == kept


def test_penalties_match_the_formula():
    from dlbatch.engine.ops.reference import SampleExtras, apply_penalties, sample

    g = torch.Generator().manual_seed(0)
    V = 16
    logits = torch.randn(3, V, generator=g) * 3
    prompt = [[1, 2, 3], [4], []]
    output = [[3, 3, 5, 7], [], [0, 0, 0, 9]]
    rep = [1.3, 0.8, 1.0]
    pres = [0.5, -0.4, 1.5]
    freq = [0.25, 0.0, -0.7]
    counts = torch.zeros(3, V)
    mask = torch.zeros(3, V, dtype=torch.bool)
    for r in range(3):
        for t in output[r]:
            counts[r, t] += 1
        for t in prompt[r]:
            mask[r, t] = True
    got = apply_penalties(logits, counts, mask, torch.tensor(rep), torch.tensor(pres), torch.tensor(freq))
    for r in range(3):
        for t in range(V):
            v = logits[r, t].item()
            c = output[r].count(t)
            if t in prompt[r] or c:
                v = v / rep[r] if v > 0 else v * rep[r]
            v -= pres[r] * (c > 0) + freq[r] * c
            assert got[r, t].item() == pytest.approx(v, rel=1e-6, abs=1e-6), (r, t)
    # through the op, greedy: the argmax of the penalized logits; row 1 without penalties is untouched
    ex = SampleExtras(penalty_rows=torch.tensor([0, 2]), counts=counts[[0, 2]], prompt_mask=mask[[0, 2]],
                      repetition=torch.tensor([rep[0], rep[2]]), presence=torch.tensor([pres[0], pres[2]]),
                      frequency=torch.tensor([freq[0], freq[2]]), num_logprobs=3)
    toks, (chosen, top_ids, top_lp) = sample(logits, torch.zeros(3), torch.ones(3), torch.zeros(3, dtype=torch.long),
                                             [], True, ex)
    assert toks.tolist() == [got[0].argmax().item(), logits[1].argmax().item(), got[2].argmax().item()]
    raw = logits.log_softmax(-1)  # logprobs are the raw distribution's (vLLM's raw_logprobs)
    assert torch.equal(chosen, raw.gather(1, toks.view(-1, 1)).squeeze(1))
    assert torch.equal(top_lp, raw.topk(3, dim=-1).values) and torch.equal(top_ids, raw.topk(3, dim=-1).indices)


# ------------------------------------------------------------------ the engine against transformers
def test_greedy_logprobs_equal_transformers_log_softmax(tiny, llm):
    from dlbatch import SamplingParams

    _, hf = tiny
    prompts = _prompts(3, 4, 40, seed=3)
    plain = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5))
    for ids, o, p in zip(prompts, outs, plain):
        assert o.token_ids == p.token_ids and p.logprobs is None  # asking for logprobs changes no token
        assert len(o.logprobs) == len(o.token_ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids + o.token_ids])).logits[0].float().log_softmax(-1)
        for j, e in enumerate(o.logprobs):
            row = ref[len(ids) - 1 + j]
            assert e["token_id"] == o.token_ids[j] and e["token"] == llm.tokenizer.decode([e["token_id"]],
                                                                                          skip_special_tokens=False)
            assert e["logprob"] == pytest.approx(row[e["token_id"]].item(), abs=2e-4)
            top = e["top"]
            assert len(top) == 5 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
            assert top[0]["token_id"] == e["token_id"] and top[0]["logprob"] == e["logprob"]  # greedy: the argmax
            ref_lp, ref_ids = row.topk(5)
            assert [t["token_id"] for t in top] == ref_ids.tolist()
            assert [t["logprob"] for t in top] == pytest.approx(ref_lp.tolist(), abs=2e-4)


def _hf_penalized_greedy(hf, ids, n, rep, pres, freq):
    """Greedy decoding of transformers' logits with the penalties applied by hand, per step."""
    out = []
    for _ in range(n):
        with torch.no_grad():
            row = hf(torch.tensor([ids + out])).logits[0, -1].double().tolist()
        for t in range(len(row)):
            c = out.count(t)
            if t in ids or c:
                row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
            row[t] -= pres * (c > 0) + freq * c
        out.append(max(range(len(row)), key=row.__getitem__))
    return out


def test_penalized_greedy_matches_transformers(tiny, llm):
    from dlbatch import SamplingParams

    _, hf = tiny
    prompts = _prompts(2, 5, 30, seed=4)
    for rep, pres, freq in [(1.5, 0.0, 0.0), (1.0, 1.0, 0.5), (1.2, -0.5, 1.0)]:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=rep,
                                                    presence_penalty=pres, frequency_penalty=freq))
        for ids, o in zip(prompts, outs):
            assert o.token_ids == _hf_penalized_greedy(hf, ids, 10, rep, pres, freq), (rep, pres, freq)
    # transformers' own repetition penalty (prompt + output, HF's definition) agrees too
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=10, do_sample=False, repetition_penalty=1.5,
                          pad_token_id=0)[0, len(prompts[0]):].tolist()
    assert llm.generate([prompts[0]], SamplingParams(max_tokens=10, ignore_eos=True,
                                                     repetition_penalty=1.5))[0].token_ids == ref


def test_extras_leave_other_rows_of_the_batch_alone(llm):
    from dlbatch import SamplingParams

    prompts = _prompts(3, 5, 30, seed=5)
    plain = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=11),
             SamplingParams(max_tokens=10, ignore_eos=True)]
    alone = llm.generate(prompts[:2], plain)
    mixed = llm.generate(prompts, plain + [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3,
                                                          min_p=0.2, frequency_penalty=0.5, logprobs=2)])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert len(mixed[2].logprobs) == 10 and all(len(e["top"]) == 2 for e in mixed[2].logprobs)


def test_n_samples_seeded_sample_zero_is_the_n1_output_and_reproducible(llm):
    from dlbatch import SamplingParams

    prompt = _prompts(1, 40, 40, seed=6)[0]  # > one 16-token block: the samples share it in the prefix cache
    one = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.5, seed=7,
                                                logprobs=1))[0]
    hits = llm.stats()["prefix_hit_tokens"]
    sp = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.5, seed=7, logprobs=1, n=3)
    a = llm.generate([prompt], sp)[0]
    assert llm.stats()["prefix_hit_tokens"] - hits >= 3 * 32  # every sample hit the prompt's two full blocks
    b = llm.generate([prompt], sp)[0]
    assert len(a.samples) == 3 and a.samples[0] is a
    assert a.token_ids == one.token_ids
    # the samples hit 39 of the 40 prompt tokens in the cache (two full blocks, 7 rows of
    # the third, which `one`'s output filled): the last one runs as a decode row, whose
    # attention sums in another order than the 40-row prefill's; the values agree to rounding
    assert [e["token_id"] for e in a.logprobs] == [e["token_id"] for e in one.logprobs]
    for x, y in zip(a.logprobs, one.logprobs):
        assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
        assert [t["token_id"] for t in x["top"]] == [t["token_id"] for t in y["top"]]
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]  # reproducible
    assert len({tuple(s.token_ids) for s in a.samples}) > 1  # independent samples
    # sample i is the request seeded seed + i
    s2 = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.5, seed=9))[0]
    assert a.samples[2].token_ids == s2.token_ids
    assert all(len(s.logprobs) == 12 for s in a.samples)
    with pytest.raises(ValueError, match="n > 1 runs on colocated workers"):
        llm.prefill([prompt], sp)


# ------------------------------------------------------------------ the native backend's rows
def test_native_backend_rows_carry_logprobs_and_samples(tiny):
    from dlbatch.backends.native import NativeBackend
    from dlbatch.engine.config import EngineConfig

    spec = SimpleNamespace(model=tiny[0], engine=EngineConfig(dtype="float32", max_model_len=256), chat=False,
                           storage_options=None, kv_transport="object_store", kv_timeout_s=30)
    be = NativeBackend(spec, "colocated", "cpu")
    ids = _prompts(1, 20, 20, seed=8)[0]
    base = {"token_ids": ids, "max_tokens": 6, "ignore_eos": True, "temperature": 1.0, "seed": 4}
    k_plain = be.add("generate", {**base, "request_id": "plain"})
    k_n = be.add("generate", {**base, "request_id": "many", "n": 3, "logprobs": 2, "min_p": 0.05,
                              "presence_penalty": 0.3, "repetition_penalty": 1.1, "frequency_penalty": 0.2})
    done = {}
    while be.has_unfinished():
        done.update(be.step())
    assert set(done) == {k_plain, k_n}
    plain, many = done[k_plain], done[k_n]
    assert "logprobs" not in plain and "samples" not in plain  # not asked: the row it always was
    assert len(many["samples"]) == 3 and len(many["logprobs"]) == many["output_tokens"] == 6
    assert many["samples"][0] == {"output": many["output"], "output_ids": many["output_ids"], "output_tokens": 6,
                                  "finish_reason": many["finish_reason"], "logprobs": many["logprobs"]}
    e = many["logprobs"][0]
    assert set(e) == {"token", "token_id", "logprob", "top"} and len(e["top"]) == 2
    assert set(e["top"][0]) == {"token", "token_id", "logprob"}
    with pytest.raises(ValueError, match="n > 1 runs on colocated workers"):
        be.add("prefill", {**base, "request_id": "pd", "n": 2})
    with pytest.raises(ValueError, match="min_p"):
        be.add("generate", {**base, "request_id": "bad", "min_p": 2})
    assert not be.has_unfinished()


def test_prefill_decode_rows_carry_the_first_tokens_logprobs(tiny):
    """PD (the prefill worker keeps the KV for an RDT pull): the decode row's logprobs start
    with the prefill worker's first token and equal the colocated row's; penalties count it."""
    from dlbatch.backends.native import NativeBackend
    from dlbatch.engine.config import EngineConfig

    spec = SimpleNamespace(model=tiny[0], engine=EngineConfig(dtype="float32", max_model_len=256), chat=False,
                           storage_options=None, kv_transport="rdt", kv_timeout_s=30)
    ids = _prompts(1, 25, 25, seed=9)[0]
    item = {"request_id": "r", "token_ids": ids, "max_tokens": 7, "ignore_eos": True, "logprobs": 3,
            "frequency_penalty": 0.8, "repetition_penalty": 1.2}

    def run(be, kind, it):
        k = be.add(kind, it)
        done = {}
        while be.has_unfinished():
            done.update(be.step())
        return done[k]

    colocated = run(NativeBackend(spec, "colocated", "cpu"), "generate", item)
    pre = NativeBackend(spec, "prefill", "cpu")
    p = run(pre, "prefill", item)
    assert len(p["first_logprobs"]) == 1 and p["first_logprobs"][0][0] == p["first_token"]
    layers = pre._rdt_kept.pop("r")
    dec = NativeBackend(spec, "decode", "cpu")
    d = run(dec, "decode", {**item, **p, "kv": None, "kv_layers": layers, "kv_release": None})
    assert d["output_ids"] == colocated["output_ids"]
    assert [e["token_id"] for e in d["logprobs"]] == d["output_ids"]
    for x, y in zip(d["logprobs"], colocated["logprobs"]):
        assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-5)
        assert [t["token_id"] for t in x["top"]] == [t["token_id"] for t in y["top"]]
    with pytest.raises(ValueError, match="n > 1 runs on colocated workers"):
        dec.add("decode", {**item, **p, "n": 2, "kv": None, "kv_layers": layers, "kv_release": None})

"""The CUDA ops' Triton kernels, run by Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1, set before triton is imported), against the reference ops: GQA,
sliding window, block sizes 16/32, ragged lengths, prefix hits and chunked prefill, and a
whole tiny model's greedy tokens against transformers. Shapes are tiny: the interpreter
runs each kernel program in Python."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dlbatch.engine.model_runner import AttnMeta  # noqa: E402
from dlbatch.engine.ops import cuda, reference  # noqa: E402
from dlbatch.engine.ops import triton_kernels as tk  # noqa: E402

ATOL = 1e-5


def _tables(lens: list[int], bs: int, seed: int) -> tuple[list[list[int]], int]:
    """Random, non-contiguous block tables covering each length; returns (tables, num_blocks)."""
    need = [-(-n // bs) for n in lens]
    total = sum(need) + 3
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, i = [], 0
    for k in need:
        tables.append(perm[i:i + k])
        i += k
    return tables, total


def _slots(table: list[int], bs: int, lo: int, hi: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(lo, hi)]


def _cache(num_blocks: int, bs: int, hk: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, bs, hk, d, generator=g), torch.randn(num_blocks, bs, hk, d, generator=g))


def _decode_meta(tables, lens, bs, window) -> AttnMeta:
    """The metadata the runner builds: the padded gather + mask of the reference op and
    the block tables the CUDA op reads."""
    lmax = max(lens)
    gather = torch.tensor([_slots(t, bs, 0, n) + [0] * (lmax - n) for t, n in zip(tables, lens)])
    dl = torch.tensor(lens)
    kpos = torch.arange(lmax).unsqueeze(0)
    mask = kpos < dl.unsqueeze(1)
    if window is not None:
        mask &= kpos > (dl.unsqueeze(1) - 1 - window)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)  # as step_meta keeps them
    return AttnMeta(slots=torch.zeros(0, dtype=torch.long), num_prefill_tokens=0, decode_gather=gather,
                    decode_mask=mask[:, None, None, :], decode_lens=dl, decode_block_tables=bt, sliding_window=window)


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_decode_matches_reference(bs, window):
    hq, hk, d = 4, 2, 32
    lens = [1, 17, 40, 70]
    tables, nb = _tables(lens, bs, seed=bs)
    kc, vc = _cache(nb, bs, hk, d, seed=1)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(2))
    meta = _decode_meta(tables, lens, bs, window)
    want = reference.paged_decode_attention(q, kc, vc, meta)
    got = cuda.paged_decode_attention(q, kc, vc, meta)  # the step's int64 block tables
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    # the same through explicit tensors, with partitions of 1 block (the split-K merge)
    bt = cuda._pad_rows([torch.tensor(t, dtype=torch.int32) for t in tables], "cpu")
    got1 = tk.paged_decode(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), window, part=1)
    torch.testing.assert_close(got1, want, atol=ATOL, rtol=1e-4)


def test_paged_decode_zero_length_rows_are_zero():
    """Padding rows of a CUDA-graph bucket (length 0) give zeros, never NaN."""
    kc, vc = _cache(4, 16, 1, 16, seed=3)
    q = torch.randn(2, 2, 16)
    bt = torch.tensor([[2, 0], [0, 0]], dtype=torch.int32)
    out = tk.paged_decode(q, kc, vc, bt, torch.tensor([5, 0], dtype=torch.int32), None)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    meta = _decode_meta([[2]], [5], 16, None)
    torch.testing.assert_close(out[:1], reference.paged_decode_attention(q[:1], kc, vc, meta), atol=ATOL, rtol=1e-4)


def _prefill_case(specs, bs, hq, hk, d, window, seed):
    """specs: (ctx, n_new) per sequence. KV of the whole context is in the cache already
    (the model stores the new tokens' KV before attention)."""
    lens = [c + n for c, n in specs]
    tables, nb = _tables(lens, bs, seed)
    kc, vc = _cache(nb, bs, hk, d, seed)
    g = torch.Generator().manual_seed(seed + 1)
    t = sum(n for _, n in specs)
    q = torch.randn(t, hq, d, generator=g)
    k = torch.empty(t, hk, d)
    v = torch.empty(t, hk, d)
    prefill, slots, qs = [], [], 0
    for (c, n), table in zip(specs, tables):
        new = torch.tensor(_slots(table, bs, c, c + n))
        k[qs:qs + n] = kc.view(-1, hk, d)[new]
        v[qs:qs + n] = vc.view(-1, hk, d)[new]
        gather = torch.tensor(_slots(table, bs, 0, c + n)) if c > 0 else None
        prefill.append((qs, n, c, gather))
        slots.extend(new.tolist())
        qs += n
    meta = AttnMeta(slots=torch.tensor(slots), num_prefill_tokens=t, prefill=prefill, sliding_window=window)
    return q, k, v, kc, vc, meta


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("window", [None, 24])
def test_paged_prefill_matches_reference(bs, window):
    """Fresh prompts, prefix hits and a chunk of a chunked prefill, ragged, in one step."""
    specs = [(0, 5), (0, 33), (40, 3), (16, 20), (32, 1)]
    q, k, v, kc, vc, meta = _prefill_case(specs, bs, hq=4, hk=2, d=32, window=window, seed=bs)
    want = reference.prefill_attention(q, k, v, kc, vc, meta)
    got = cuda.prefill_attention(q, k, v, kc, vc, meta)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_paged_prefill_query_tiles_and_head_dim_padding():
    """Several query tiles per sequence (block_m 16 < n_new) and a head dim (24) that is
    not a power of two."""
    specs = [(0, 37), (21, 18)]
    q, k, v, kc, vc, meta = _prefill_case(specs, 16, hq=2, hk=1, d=24, window=None, seed=5)
    tables, cu_q, ctx, max_new = cuda.prefill_tables(meta, 16)
    got = tk.paged_prefill(q, kc, vc, tables, cu_q, ctx, max_new, None, block_m=16, block_n=16)
    torch.testing.assert_close(got, reference.prefill_attention(q, k, v, kc, vc, meta), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 32), (2, 48)])
def test_rms_norm_and_fused_residual(shape):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(*shape, generator=g)
    res = torch.randn(*shape, generator=g)
    w = 1 + 0.2 * torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(cuda.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), atol=ATOL, rtol=1e-5)
    out, h = cuda.add_rms_norm(x, res, w, 1e-6)
    want_out, want_h = reference.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(out, want_out, atol=ATOL, rtol=1e-5)


def test_rotary_store_kv_matches_reference_and_skips_padding_slots():
    t, hq, hk, d, bs = 6, 4, 2, 16, 16
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)  # q, k, v are strided views, as in the model
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    ang = torch.randn(t, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    slots = torch.tensor([3, 17, 40, 9, -1, 33])
    kc_ref, vc_ref = torch.zeros(4, bs, hk, d), torch.zeros(4, bs, hk, d)
    keep = slots >= 0
    want_q, want_k = reference.rotary(q.clone(), k.clone(), cos, sin)
    reference.store_kv(kc_ref, vc_ref, want_k[keep], v[keep], slots[keep])
    kc, vc = torch.zeros_like(kc_ref), torch.zeros_like(vc_ref)
    got_q, got_k = cuda.rotary_store_kv(q, k, v, cos, sin, kc, vc, slots)
    torch.testing.assert_close(got_q, want_q, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(kc, kc_ref, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(vc, vc_ref)


# Half precision. Triton's interpreter (3.9) computes bfloat16 arithmetic on the raw 16-bit
# words (a bf16 add or tl.dot gives garbage; conversions to and from it are right), so the
# model dtype here is float16, which takes the kernels through the same 16-bit code; bf16
# models run in `pytest -m gpu` (tests/gpu/test_gpu.py). A bf16 *cache* only converts.
HALF = dict(atol=2e-3, rtol=1e-2)
DTYPES = [(torch.float16, torch.float16), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
          (torch.float16, torch.float32)]


@pytest.mark.parametrize("model_dtype,kv_dtype", DTYPES)
def test_attention_in_float16_and_with_a_cache_of_another_dtype(model_dtype, kv_dtype):
    """Both attention kernels with queries in the model's dtype and the cache stored in
    kv_cache_dtype, against the reference on the same cache contents. The prefill kernel
    once handed a bf16 K straight to tl.dot with fp32 queries: a compile error on a GPU."""
    tol = HALF if torch.float16 in (model_dtype, kv_dtype) else dict(atol=ATOL, rtol=1e-4)
    hq, hk, d, bs = 4, 2, 32, 16
    q, _, _, kc, vc, meta = _prefill_case([(0, 5), (0, 33), (40, 3), (16, 20)], bs, hq, hk, d, None, seed=9)
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    k = kc.view(-1, hk, d)[meta.slots].to(model_dtype)  # the new tokens' KV as the cache holds it
    v = vc.view(-1, hk, d)[meta.slots].to(model_dtype)
    q = q.to(model_dtype)
    got = cuda.prefill_attention(q, k, v, kc, vc, meta)
    assert got.dtype == model_dtype
    torch.testing.assert_close(got.float(), reference.prefill_attention(q, k, v, kc, vc, meta).float(), **tol)

    lens = [1, 17, 40, 70]
    tables, nb = _tables(lens, bs, seed=4)
    kc, vc = (c.to(kv_dtype) for c in _cache(nb, bs, hk, d, seed=5))
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(6)).to(model_dtype)
    meta = _decode_meta(tables, lens, bs, None)
    got = cuda.paged_decode_attention(q, kc, vc, meta)
    assert got.dtype == model_dtype
    torch.testing.assert_close(got.float(), reference.paged_decode_attention(q, kc, vc, meta).float(), **tol)


@pytest.mark.parametrize("model_dtype,kv_dtype", DTYPES)
def test_norm_and_rotary_store_in_float16_and_into_a_cache_of_another_dtype(model_dtype, kv_dtype):
    t, hq, hk, d, bs = 6, 4, 2, 16, 16
    g = torch.Generator().manual_seed(12)
    x, res = torch.randn(t, 64, generator=g).to(model_dtype), torch.randn(t, 64, generator=g).to(model_dtype)
    w = (1 + 0.2 * torch.randn(64, generator=g)).to(model_dtype)
    out, h = cuda.add_rms_norm(x, res, w, 1e-6)
    want_out, want_h = reference.add_rms_norm(x, res, w, 1e-6)
    assert out.dtype == h.dtype == model_dtype
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(out.float(), want_out.float(), **HALF)

    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(model_dtype)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    ang = torch.randn(t, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(model_dtype), torch.cat([ang.sin()] * 2, -1).to(model_dtype)
    slots = torch.tensor([3, 17, 40, 9, -1, 33])
    keep = slots >= 0
    kc_ref, vc_ref = torch.zeros(4, bs, hk, d, dtype=kv_dtype), torch.zeros(4, bs, hk, d, dtype=kv_dtype)
    want_q, want_k = reference.rotary(q.clone(), k.clone(), cos, sin)
    reference.store_kv(kc_ref, vc_ref, want_k[keep], v[keep], slots[keep])
    kc, vc = torch.zeros_like(kc_ref), torch.zeros_like(vc_ref)
    got_q, got_k = cuda.rotary_store_kv(q, k, v, cos, sin, kc, vc, slots)
    torch.testing.assert_close(got_q.float(), want_q.float(), **HALF)
    torch.testing.assert_close(got_k.float(), want_k.float(), **HALF)
    # one rounding into the cache's dtype (the interpreter may round a bf16 toward zero)
    torch.testing.assert_close(kc.float(), kc_ref.float(), atol=2e-3, rtol=2 ** -7)
    torch.testing.assert_close(vc, vc_ref)


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_whole_model_greedy_with_triton_ops(arch, tmp_path, monkeypatch):
    """A tiny model (sliding window: mistral; qk-norm: qwen3) with every CUDA op standing in
    for the CPU ones: greedy tokens equal transformers' over prefix hits, chunked prefill
    and batched decode."""
    from dlbatch import LLM, SamplingParams
    from dlbatch.engine.ops import registry, resolve
    from tests.helpers.tiny_models import VOCAB, make_tiny_model

    hf = make_tiny_model(arch, str(tmp_path))
    hf.generation_config.eos_token_id = None
    resolve._load_builtin()
    for name, fn in cuda.IMPLS.items():
        monkeypatch.setitem(registry._IMPLS, (name, "cpu"), fn)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, chat=False, max_num_batched_tokens=32)
    assert llm.engine.ops.chosen["paged_decode_attention"] == "cpu"
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 13, 30)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert o.token_ids == ref[0, len(p):].tolist()


def test_graph_runner_buffers_and_padding_with_emulated_replay(tmp_path, monkeypatch):
    """GraphedModel's bucketing, persistent buffers and padding rows (length 0, slot -1),
    with a stand-in for torch.cuda.CUDAGraph that re-runs the forward on the captured
    buffers (what a replay does): greedy tokens equal those of the plain model while the
    batch shrinks through several buckets."""
    from dlbatch import LLM, SamplingParams
    from dlbatch.engine.cuda_graph import GraphedModel
    from dlbatch.engine.ops import registry, resolve
    from tests.helpers.tiny_models import VOCAB, make_tiny_model

    class Replayed(GraphedModel):
        def _capture(self, b, kv_cache):
            args = (self.ids[:b], self.pos[:b], kv_cache, self._meta(b), self.rows[:b])
            out = self.model.forward(*args)
            model = self.model

            class Graph:
                def replay(self):
                    with torch.inference_mode():  # the captured output is an inference tensor
                        out.copy_(model.forward(*args))

            return Graph(), out

    make_tiny_model("mistral", str(tmp_path))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 3, 4, 6)]  # batch 4, 3, 2, 1
    plain = LLM(str(tmp_path), dtype="float32", max_model_len=64, chat=False, max_num_seqs=8)  # CPU ops
    want = [o.token_ids for o in plain.generate(prompts, params)]
    resolve._load_builtin()
    for name, fn in cuda.IMPLS.items():
        monkeypatch.setitem(registry._IMPLS, (name, "cpu"), fn)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, chat=False, max_num_seqs=8)
    gm = Replayed(llm.engine.model, llm.config.block_size, llm.config.max_model_len, llm.config.max_num_seqs)
    llm.engine.runner.model = gm
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert gm.replays > 0 and set(gm.graphs) == {1, 2, 4}


@pytest.mark.parametrize("windowed", [False, True])
def test_the_gpu_checks_op_parity_runs_here_in_float32(windowed):
    """tests/gpu/test_gpu.py runs only on a GPU, which CI does not have: its op-parity checks
    (tests/helpers/gpu_checks.py) run here on CPU tensors, in float32 (the interpreter's
    bf16 is wrong) and with small shapes, so that the metadata they hand the ops stays what
    the ops read (they once built an AttnMeta with a field it no longer had)."""
    from tests.helpers.gpu_checks import decode_and_prefill_parity, norm_and_rotary_parity

    small = dict(hq=4, hk=2, d=32, lens=[1, 17, 70], specs=[(0, 40), (50, 7), (16, 20)], window=24)
    decode_and_prefill_parity((cuda, reference), torch.float32, 2e-4, windowed, dev="cpu", shapes=small)
    if not windowed:
        norm_and_rotary_parity((cuda, reference), torch.float32, 2e-4, dev="cpu")

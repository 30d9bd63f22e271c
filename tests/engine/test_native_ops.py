"""The native CPU paged decode attention (dlbatch/engine/ops/_paged_attn.c) against the
torch reference, and its fallbacks."""
import pytest
import torch

from dlbatch.engine.ops import native
from dlbatch.engine.ops.cpu import paged_decode_attention as torch_loop
from dlbatch.engine.ops.reference import paged_decode_attention as reference

pytestmark = pytest.mark.skipif(native.lib() is None, reason="native kernel unavailable (no C compiler, or DLBATCH_NATIVE=0): the torch path is used")


class Meta:
    pass


def _case(hq, hk, d, lens, block=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = sum(lens) + 64
    blocks = (slots + block - 1) // block
    kc = torch.randn(blocks, block, hk, d, generator=g)
    vc = torch.randn(blocks, block, hk, d, generator=g)
    q = torch.randn(len(lens), hq, d, generator=g)
    runs_all, gather, pos = [], [], 0
    for i, n in enumerate(lens):
        # two runs per sequence: a shared head (slots [0, n//3)) and its own tail elsewhere
        head = n // 3
        runs = ([(0, head)] if head else []) + [(64 + pos, n - head)]
        pos += n - head
        runs_all.append(runs)
        gather.append([s + j for s, m in runs for j in range(m)])
    lmax = max(lens)
    meta = Meta()
    meta.decode_runs = runs_all
    meta.decode_gather = torch.tensor([r + [0] * (lmax - len(r)) for r in gather])
    meta.decode_mask = (torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    return q, kc, vc, meta


@pytest.mark.parametrize("hq,hk,d,lens", [(9, 3, 64, [1, 17, 300, 1024]), (4, 4, 32, [5]), (8, 2, 128, [33, 2, 70])])
def test_native_matches_reference(hq, hk, d, lens):
    q, kc, vc, meta = _case(hq, hk, d, lens)
    want = reference(q, kc, vc, meta)
    got = native.paged_decode_f32(q, kc, vc, native.Runs(meta.decode_runs))
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch_loop(q, kc, vc, meta), want, rtol=1e-5, atol=1e-5)


def test_native_declines_what_it_does_not_take():
    q, kc, vc, meta = _case(4, 2, 12, [7])  # head_dim not a multiple of 8
    assert native.paged_decode_f32(q, kc, vc, native.Runs(meta.decode_runs)) is None
    q, kc, vc, meta = _case(4, 2, 16, [7])
    runs = native.Runs(meta.decode_runs)
    assert native.paged_decode_f32(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), runs) is None


def test_engine_uses_native_kernel_and_stays_exact(tmp_path):
    from dlbatch.engine.llm import LLM
    from dlbatch.engine.sampling_params import SamplingParams
    from tests.tiny_models import make_tiny_model

    path = str(tmp_path / "m")
    make_tiny_model("llama", path)
    llm = LLM(path, dtype="float32", max_model_len=256, chat=False)
    assert llm.engine.runner.use_native
    prompts = [[5, 6, 7, 8, 9] * 8, [11, 12, 13] * 5, [5, 6, 7, 8, 9] * 8 + [4]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fast = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.runner.use_native = False
    slow = [o.token_ids for o in llm.generate(prompts, params)]
    assert fast == slow

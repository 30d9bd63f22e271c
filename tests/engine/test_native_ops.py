"""The native CPU paged decode attention (dlbatch/engine/ops/_paged_attn.c) against the
torch reference, and its fallbacks."""
import pytest
import torch

from dlbatch.engine.ops import native
from dlbatch.engine.ops.cpu import paged_decode_attention as torch_loop
from dlbatch.engine.ops.reference import paged_decode_attention as reference

pytestmark = pytest.mark.skipif(native.lib() is None, reason="native kernel unavailable (no C compiler, or DLBATCH_NATIVE=0): the torch path is used")


class Meta:
    sliding_window = None
    use_native = False


def _case(hq, hk, d, lens, block=16, seed=0, window=None):
    """Sequences sharing their first blocks (a common prefix) and each owning its tail
    blocks, scattered in the cache; block tables padded with stale ids."""
    g = torch.Generator().manual_seed(seed)
    nb = [(n + block - 1) // block for n in lens]
    shared = min(nb) // 2
    blocks = shared + sum(b - shared for b in nb) + 4
    kc = torch.randn(blocks, block, hk, d, generator=g)
    vc = torch.randn(blocks, block, hk, d, generator=g)
    q = torch.randn(len(lens), hq, d, generator=g)
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, nxt = [], shared
    for b in nb:
        own = perm[nxt:nxt + b - shared]
        nxt += b - shared
        tables.append(perm[:shared] + own + [perm[-1]] * (max(nb) - b))
    meta = Meta()
    meta.sliding_window = window
    meta.decode_block_tables = torch.tensor(tables, dtype=torch.int64)
    meta.decode_lens = torch.tensor(lens, dtype=torch.int64)
    lmax = max(lens)
    k = torch.arange(lmax)
    meta.decode_gather = meta.decode_block_tables[:, k // block] * block + k % block
    lens_t = meta.decode_lens
    mask = k[None, :] < lens_t[:, None]
    if window is not None:
        mask &= k[None, :] > lens_t[:, None] - 1 - window
    meta.decode_mask = mask[:, None, None, :]
    return q, kc, vc, meta


@pytest.mark.parametrize("hq,hk,d,lens,block,window", [
    (9, 3, 64, [1, 17, 300, 1024], 16, None), (4, 4, 32, [5], 16, None), (8, 2, 128, [33, 2, 70], 32, None),
    (8, 2, 64, [100, 7, 250], 16, 40),
    # register tiles of 3 query heads x 4 keys / 4 output vectors: remainders of 1 and 2
    # heads (7 and 2 per KV head) and of 1 and 2 vectors (head sizes 40 and 80)
    (14, 2, 40, [3, 129, 64], 16, None), (4, 2, 80, [31, 64, 6], 32, None)])
def test_native_matches_reference(hq, hk, d, lens, block, window):
    q, kc, vc, meta = _case(hq, hk, d, lens, block, window=window)
    want = reference(q, kc, vc, meta)
    got = native.paged_decode(q, kc, vc, meta.decode_block_tables, meta.decode_lens, window)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch_loop(q, kc, vc, meta), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_groups_shared_prefixes_bitwise_as_alone(threads, monkeypatch):
    """Papers x tasks: sequences sharing leading blocks (given in a shuffled order, with
    groups larger than the kernel's group size) are read together; every sequence's output
    is bitwise what the kernel gives for it alone, and matches the reference."""
    g = torch.Generator().manual_seed(3)
    block, hq, hk, d = 16, 9, 3, 64
    kc = torch.randn(400, block, hk, d, generator=g)
    vc = torch.randn(400, block, hk, d, generator=g)
    perm = iter(torch.randperm(400, generator=g).tolist())
    tables, lens = [], []
    for prefix_blocks, tasks in ((20, 3), (5, 2), (9, 11), (1, 2)):  # (1, 2): one block, too short to group
        prefix = [next(perm) for _ in range(prefix_blocks)]
        for t in range(tasks):
            tables.append(prefix + [next(perm) for _ in range(2)])
            lens.append(prefix_blocks * block + 5 + 7 * t)
    width = max(map(len, tables))
    tables = [t + [t[-1]] * (width - len(t)) for t in tables]  # padded with a stale id
    order = torch.randperm(len(lens), generator=g)
    bt = torch.tensor(tables, dtype=torch.int64)[order]
    lens_t = torch.tensor(lens, dtype=torch.int64)[order]
    q = torch.randn(len(lens), hq, d, generator=g)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    got = native.paged_decode(q, kc, vc, bt, lens_t)
    alone = torch.cat([native.paged_decode(q[i:i + 1], kc, vc, bt[i:i + 1], lens_t[i:i + 1]) for i in range(len(lens))])
    assert torch.equal(got, alone)
    meta = Meta()
    meta.decode_block_tables, meta.decode_lens = bt, lens_t
    k = torch.arange(int(lens_t.max()))
    meta.decode_gather = bt[:, k // block] * block + k % block
    meta.decode_mask = (k[None, :] < lens_t[:, None])[:, None, None, :]
    torch.testing.assert_close(got, reference(q, kc, vc, meta), rtol=1e-5, atol=1e-5)


def test_posix_thread_build_gives_the_openmp_build_bits(monkeypatch):
    """Both builds of the kernels (OpenMP: torch's workers take the parallel region; POSIX
    threads: the fallback when the compiler has no OpenMP) split the work the same way."""
    from dlbatch.cbuild import load

    q, kc, vc, meta = _case(9, 3, 64, [1, 17, 300, 1024, 70], 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    omp = native.paged_decode(q, kc, vc, meta.decode_block_tables, meta.decode_lens)
    posix = native.bind_decode(load(native.DECODE.src, native.POSIX_FLAGS))
    assert posix._name != native.lib()._name  # the default build is the OpenMP one
    monkeypatch.setattr(native.DECODE, "lib", posix)
    assert torch.equal(native.paged_decode(q, kc, vc, meta.decode_block_tables, meta.decode_lens), omp)
    x = torch.randn(37, 1003)
    assert native.ARGMAX.get() is not None  # loaded (and marked tried) before it is swapped
    monkeypatch.setattr(native.ARGMAX, "lib", native.bind_argmax(load(native.ARGMAX.src, native.POSIX_FLAGS)))
    assert native.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_native_reads_half_precision_cache(dtype):
    """A float16/bfloat16 cache is widened exactly inside the kernel: same result as the
    reference over the same (rounded) values in float32."""
    q, kc, vc, meta = _case(9, 3, 64, [3, 200, 513], 16)
    kh, vh = kc.to(dtype), vc.to(dtype)
    want = reference(q, kh.float(), vh.float(), meta)
    got = native.paged_decode(q, kh, vh, meta.decode_block_tables, meta.decode_lens)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch_loop(q, kh, vh, meta), want, rtol=1e-5, atol=1e-5)


def test_vector_width_follows_the_cpu_and_head_size():
    """16-float vectors (AVX-512) only where the compiler targets AVX-512 (the kernel is
    built with -march=native) and the head size is a multiple of 16; 8 otherwise. The
    reference cases above cover both widths on such a CPU (head sizes 64/32/128/80 and 40)."""
    with open("/proc/cpuinfo") as fh:
        flags = next((line.split() for line in fh if line.startswith("flags")), [])
    wide = 16 if "avx512f" in flags else 8
    width = native.lib().dl_paged_decode_width
    assert [width(d) for d in (64, 128, 80, 32, 40, 24, 8)] == [wide] * 4 + [8] * 3


def test_native_declines_what_it_does_not_take():
    q, kc, vc, meta = _case(4, 2, 12, [7])  # head_dim not a multiple of 8
    assert native.paged_decode(q, kc, vc, meta.decode_block_tables, meta.decode_lens) is None
    q, kc, vc, meta = _case(4, 2, 16, [7])
    assert native.paged_decode(q.double(), kc, vc, meta.decode_block_tables, meta.decode_lens) is None


def test_float16_queries_are_computed_in_float32():
    """A model computing in fp16: its queries are widened, the kernel runs in float32 over
    the cache, and the output is rounded once to fp16."""
    q, kc, vc, meta = _case(9, 3, 64, [3, 200, 513], 16)
    qh, kh, vh = q.half(), kc.half(), vc.half()
    got = native.paged_decode(qh, kh, vh, meta.decode_block_tables, meta.decode_lens)
    assert got is not None and got.dtype == torch.float16
    want = native.paged_decode(qh.float(), kh, vh, meta.decode_block_tables, meta.decode_lens)
    assert torch.equal(got, want.half())
    torch.testing.assert_close(got.float(), reference(qh.float(), kh.float(), vh.float(), meta), rtol=1e-2, atol=1e-2)


BF16_AS_IS = native.lib().dl_paged_decode_bf16(64) if native.lib() is not None else 0


@pytest.mark.parametrize("hq,hk,d,lens,block,window", [
    (9, 3, 64, [3, 200, 513], 16, None), (14, 2, 32, [1, 5, 129, 64], 16, None),  # 7 heads a KV head: 3 + 3 + 1
    (8, 2, 128, [33, 2, 70], 32, None), (8, 4, 64, [100, 7, 250], 16, 40), (4, 2, 64, [2, 3], 16, None)])
def test_bf16_queries_over_a_bf16_cache(hq, hk, d, lens, block, window):
    """A model computing in bf16 (a CPU with AVX512_BF16: the queries are taken as they are,
    the scores come from vdpbf16ps, whose bf16 x bf16 products are exact in float32; else
    widened): the output, rounded once to bf16, is the widened queries' result within a
    bf16 rounding, for head sizes of one, two and four 32-element vectors, grouped heads
    with remainders, sliding windows and context lengths that are not multiples of 4."""
    q, kc, vc, meta = _case(hq, hk, d, lens, block, window=window)
    qh, kh, vh = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    got = native.paged_decode(qh, kh, vh, meta.decode_block_tables, meta.decode_lens, window)
    assert got is not None and got.dtype == torch.bfloat16
    want = native.paged_decode(qh.float(), kh, vh, meta.decode_block_tables, meta.decode_lens, window)
    if not BF16_AS_IS:
        assert torch.equal(got, want.bfloat16())
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(got.float(), reference(qh.float(), kh.float(), vh.float(), meta), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not BF16_AS_IS, reason="bf16 queries are taken as they are only with AVX512_BF16")
def test_bf16_queries_shared_prefixes_bitwise_as_alone():
    g = torch.Generator().manual_seed(5)
    block, hq, hk, d = 16, 9, 3, 64
    kc = torch.randn(200, block, hk, d, generator=g).bfloat16()
    vc = torch.randn(200, block, hk, d, generator=g).bfloat16()
    perm = iter(torch.randperm(200, generator=g).tolist())
    tables, lens = [], []
    for prefix_blocks, tasks in ((12, 3), (4, 10)):
        prefix = [next(perm) for _ in range(prefix_blocks)]
        for t in range(tasks):
            tables.append(prefix + [next(perm) for _ in range(2)])
            lens.append(prefix_blocks * block + 3 + 5 * t)
    width = max(map(len, tables))
    bt = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables], dtype=torch.int64)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    q = torch.randn(len(lens), hq, d, generator=g).bfloat16()
    got = native.paged_decode(q, kc, vc, bt, lens_t)
    alone = torch.cat([native.paged_decode(q[i:i + 1], kc, vc, bt[i:i + 1], lens_t[i:i + 1]) for i in range(len(lens))])
    assert torch.equal(got, alone)


def test_engine_uses_native_kernel_and_stays_exact(tmp_path):
    from dlbatch.engine.llm import LLM
    from dlbatch.engine.sampling_params import SamplingParams
    from tests.helpers.tiny_models import make_tiny_model

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


def test_native_argmax_matches_torch():
    assert native.ARGMAX.get() is not None
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 1003, generator=g)
    x[5, 17] = x[5, 900] = 100.0  # ties: the first index wins
    x[6, :] = -float("inf")
    x[7, 40] = float("nan")  # a NaN is the maximum, as in torch
    x[8, :5] = 1e9
    for m in (x, x[:, :7], x[:, 1:]):
        assert native.argmax_rows(m).tolist() == m.argmax(dim=-1).tolist()

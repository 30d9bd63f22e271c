"""Block manager and scheduler without a model."""
from __future__ import annotations

import pytest

from dlbatch.engine.block_manager import BlockManager, NoFreeBlocks
from dlbatch.engine.config import EngineConfig
from dlbatch.engine.sampling_params import SamplingParams
from dlbatch.engine.scheduler import Scheduler
from dlbatch.engine.sequence import Sequence


def seq(sid, n, max_tokens=4, base=0):
    return Sequence(seq_id=str(sid), prompt_ids=[base + i for i in range(n)], params=SamplingParams(max_tokens=max_tokens))


def run_prefill(bm, s):
    s.num_computed = len(s)
    bm.commit_full_blocks(s)


def test_allocate_reserve_and_free():
    bm = BlockManager(10, 4)
    s = seq(1, 9, max_tokens=6)  # 15 tokens -> 4 blocks, 3 now (9 tokens), 1 reserved
    assert bm.can_allocate(s, reserve=True)
    bm.allocate(s, reserve=True)
    assert len(s.block_table) == 3 and s.reserved == 1
    assert bm.num_available == 10 - 3 - 1
    bm.ensure_slots(s, 13)
    assert len(s.block_table) == 4 and s.reserved == 0 and bm.reserved_total == 0
    bm.check_invariants()
    bm.free_seq(s)
    assert bm.num_free == 10 and bm.num_available == 10
    bm.check_invariants()


def test_reservation_blocks_admission():
    bm = BlockManager(6, 4)
    a = seq(1, 4, max_tokens=16)  # 20 tokens -> 5 blocks
    bm.allocate(a, reserve=True)
    b = seq(2, 3, max_tokens=4, base=100)  # reserve: 2 blocks; greedy: 1
    assert not bm.can_allocate(b, reserve=True)
    assert bm.can_allocate(b, reserve=False)  # greedy admission would take it
    with pytest.raises(NoFreeBlocks):
        bm.allocate(b, reserve=True)


def test_prefix_hash_reuse_verified_and_lru():
    bm = BlockManager(8, 4)
    a = seq(1, 10)
    bm.allocate(a, reserve=False)
    run_prefill(bm, a)
    assert len(a.block_hashes) == 2  # two full blocks hashed, partial third not
    bm.free_seq(a)
    assert len(bm.evictable) == 2
    b = seq(2, 10)  # same tokens -> hits two blocks
    bm.allocate(b, reserve=False)
    assert b.num_cached == 8 and b.num_computed == 8
    bm.check_invariants()
    c = Sequence("3", [0, 1, 2, 3, 9, 9, 9, 9, 9, 9], SamplingParams())  # first block same, second differs
    bm.allocate(c, reserve=False)
    assert c.num_cached == 4
    bm.free_seq(b)
    bm.free_seq(c)
    bm.check_invariants()


def test_full_prompt_hit_leaves_one_token():
    bm = BlockManager(8, 4)
    a = seq(1, 8)
    bm.allocate(a, reserve=False)
    run_prefill(bm, a)
    bm.free_seq(a)
    b = seq(2, 8)
    bm.allocate(b, reserve=False)
    assert b.num_computed == 4  # last block recomputed so logits exist
    bm.free_seq(b)


def test_evicted_blocks_lose_their_hash():
    bm = BlockManager(3, 4)
    a = seq(1, 8)
    bm.allocate(a, reserve=False)
    run_prefill(bm, a)
    bm.free_seq(a)
    other = seq(2, 11, base=50)
    bm.allocate(other, reserve=False)  # takes all 3 blocks, evicting a's
    assert not bm.hash_to_block
    bm.free_seq(other)
    again = seq(3, 8)
    bm.allocate(again, reserve=False)
    assert again.num_cached == 0
    bm.check_invariants()


def test_hash_collision_is_verified():
    bm = BlockManager(4, 4)
    a = seq(1, 5)
    bm.allocate(a, reserve=False)
    run_prefill(bm, a)
    blk = a.block_table[0]
    bm.free_seq(a)
    parent, toks = bm.block_key[blk]
    bm.block_key[blk] = (parent, (99, 99, 99, 99))  # simulate a hash hit whose tokens differ
    b = seq(2, 5)
    bm.allocate(b, reserve=False)
    assert b.num_cached == 0


def _partial_bm(num_blocks=16, block_size=4) -> BlockManager:
    return BlockManager(num_blocks, block_size, share_partial_blocks=True)


def test_a_block_that_begins_like_a_cached_one_copies_its_head():
    bm = _partial_bm()
    a = seq(1, 10)  # blocks [0-3] [4-7] committed, [8 9] partial
    bm.allocate(a, reserve=False)
    run_prefill(bm, a)
    src = a.block_table[1]
    b = Sequence("2", [0, 1, 2, 3, 4, 5, 50, 51, 52, 53], SamplingParams())  # shares 6 tokens: 4 + 2
    bm.allocate(b, reserve=False)
    assert b.block_table[0] == a.block_table[0]
    assert b.kv_copy == (src, b.block_table[1], 2) and b.block_table[1] != src
    assert b.num_computed == b.num_cached == 6
    assert bm.ref[src] == 2  # a's reference and the copy's pin
    bm.release_copy(b)
    assert b.kv_copy is None and bm.ref[src] == 1
    run_prefill(bm, b)  # b's second block, now full, is a cached block of its own
    assert len(bm.children[bm.block_hash[a.block_table[0]]]) == 2
    for s in (a, b):
        bm.free_seq(s)
    bm.check_invariants()


def test_the_longest_common_head_among_the_children_wins():
    bm = _partial_bm(num_blocks=32)
    heads = ([4, 5, 6, 7], [4, 9, 9, 9], [4, 5, 6, 1], [1, 1, 1, 1], [8, 8, 8, 8])
    seqs = []
    for i, h in enumerate(heads):
        s = Sequence(str(i), [0, 1, 2, 3] + h + [70 + i], SamplingParams())
        bm.allocate(s, reserve=False)
        run_prefill(bm, s)
        seqs.append(s)
    # (next tokens, the child expected (None: a tie), tokens shared)
    for want, src_seq, k in (([4, 9, 9, 0, 3], 1, 3), ([4, 5, 6, 2, 3], None, 3), ([1, 1, 0, 0, 0], 3, 2),
                             ([4, 0, 0, 0, 0], None, 1), ([8, 8, 8, 0, 0], 4, 3), ([5, 0, 0, 0, 0], None, 0)):
        q = Sequence("q", [0, 1, 2, 3] + want, SamplingParams())
        got = bm.match_partial(q.all_ids, bm.match_prefix(q.all_ids))
        if k == 0:
            assert got is None, want
            continue
        assert got[1] == k, want
        if src_seq is not None:
            assert got[0] == seqs[src_seq].block_table[1], want


def test_a_partial_hit_leaves_the_last_token_to_compute():
    bm = _partial_bm()
    a = seq(1, 8)
    bm.allocate(a, reserve=False)
    run_prefill(bm, a)
    b = seq(2, 7)  # a's first 7 tokens: one full block, then 3 of a's second block's 4 tokens
    bm.allocate(b, reserve=False)
    assert b.num_computed == 6 and b.kv_copy[2] == 2


def test_the_source_of_a_copy_is_not_evicted_before_it_is_copied():
    bm = _partial_bm(num_blocks=3)
    a = seq(1, 8)
    bm.allocate(a, reserve=False)
    run_prefill(bm, a)
    src = a.block_table[1]
    bm.free_seq(a)  # both blocks evictable, one block free
    b = Sequence("2", [0, 1, 2, 3, 4, 5, 60], SamplingParams())
    assert bm.can_allocate(b, reserve=False)  # block 0 hit, source pinned, 1 to take: the free one
    bm.allocate(b, reserve=False)
    assert src in bm.block_hash and src not in bm.evictable and b.kv_copy[0] == src
    c = seq(3, 3, base=90)
    assert not bm.can_allocate(c, reserve=False)  # the pinned source is not a free block
    bm.release_copy(b)
    assert src in bm.evictable
    bm.allocate(c, reserve=False)  # now it may be evicted, and loses its place among the children
    assert src not in bm.block_hash and not any(blk == src for kids in bm.children.values() for _, blk in kids)
    bm.check_invariants()


def test_partial_sharing_is_off_by_default_and_without_prefix_caching():
    for bm in (BlockManager(16, 4), BlockManager(16, 4, enable_prefix_caching=False, share_partial_blocks=True)):
        a = seq(1, 10)
        bm.allocate(a, reserve=False)
        run_prefill(bm, a)
        b = Sequence("2", [0, 1, 2, 3, 4, 5, 50, 51], SamplingParams())
        bm.allocate(b, reserve=False)
        assert b.kv_copy is None and b.num_computed == (4 if bm.enable_prefix_caching else 0)


def _sched(num_blocks=32, block_size=4, budget=16, admission="reserve", max_seqs=8, schedule="shortest_first"):
    cfg = EngineConfig(block_size=block_size, max_num_batched_tokens=budget, admission=admission,
                       max_num_seqs=max_seqs, max_model_len=64, schedule=schedule)
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(cfg, bm), bm


def _fake_step(sched, out, token=7):
    sampled = {id(s.seq): token for s in out.scheduled if s.needs_logits}
    fin = sched.postprocess(out, sampled, lambda q: "length" if len(q.output_ids) >= q.params.max_tokens else None)
    sched.free_finished(fin)
    return fin


def test_scheduler_budget_chunking_and_decode_first():
    sched, bm = _sched(budget=16)
    long = seq(1, 40, max_tokens=2)
    sched.add(long)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new) for s in out.scheduled] == [("1", 16)]
    assert not out.scheduled[0].needs_logits
    _fake_step(sched, out)
    short = seq(2, 3, max_tokens=3, base=500)
    sched.add(short)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new) for s in out.scheduled] == [("1", 16)]
    _fake_step(sched, out)
    out = sched.schedule()  # long's last 8 tokens + short admitted with 3
    assert [(s.seq.seq_id, s.num_new) for s in out.scheduled] == [("1", 8), ("2", 3)]
    _fake_step(sched, out)
    out = sched.schedule()  # both decoding now: one token each
    assert sorted((s.seq.seq_id, s.num_new) for s in out.scheduled) == [("1", 1), ("2", 1)]
    fin = _fake_step(sched, out)
    assert [s.seq_id for s in fin] == ["1"]  # max_tokens=2 reached
    bm.check_invariants()


def test_scheduler_max_num_seqs_and_reservation():
    sched, bm = _sched(num_blocks=8, block_size=4, budget=64, max_seqs=2)
    seqs = [seq(i, 4, max_tokens=4, base=10 * i) for i in range(4)]  # each needs 2 blocks
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert len(out.scheduled) == 2  # max_num_seqs
    assert bm.reserved_total == 2


def test_scheduler_preemption_recomputes():
    sched, bm = _sched(num_blocks=4, block_size=4, budget=64, admission="greedy")
    a, b = seq(1, 7, max_tokens=8), seq(2, 7, max_tokens=8, base=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert len(out.scheduled) == 2
    preempted = False
    for _ in range(20):
        out = sched.schedule()
        if out.preempted:
            preempted = True
            victim = out.preempted[0]
            assert victim.num_computed == 0 and victim.block_table == []
            assert victim is b  # the newest goes
        if not out.scheduled:
            break
        _fake_step(sched, out)
        bm.check_invariants()
    assert preempted
    assert sched.num_preemptions >= 1


def test_request_that_can_never_fit_is_refused():
    sched, bm = _sched(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(seq(1, 6, max_tokens=8))


def test_shared_prefix_waits_for_the_first_and_hits():
    sched, bm = _sched(num_blocks=64, block_size=4, budget=64)
    a = seq(1, 14, max_tokens=2)
    b = Sequence("2", a.prompt_ids[:12] + [900, 901], SamplingParams(max_tokens=2))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == ["1"]  # b waits: its prefix is being computed
    _fake_step(sched, out)
    out = sched.schedule()
    assert "2" in [s.seq.seq_id for s in out.scheduled]
    assert b.num_cached == 12
    bm.check_invariants()


def _admission_order(sched, seqs) -> list[str]:
    """Seq ids in the order the scheduler first runs them (budget: one admission per step)."""
    order: list[str] = []
    for _ in range(200):
        out = sched.schedule()
        if not out.scheduled:
            break
        order += [s.seq.seq_id for s in out.scheduled if s.seq.seq_id not in order]
        _fake_step(sched, out)
    return order


def test_shortest_prompt_is_admitted_first_fcfs_keeps_arrival_order():
    for schedule, want in (("shortest_first", ["2", "3", "1"]), ("fcfs", ["1", "2", "3"])):
        sched, bm = _sched(num_blocks=64, block_size=4, budget=16, max_seqs=1, schedule=schedule)
        seqs = [seq(1, 40, max_tokens=1), seq(2, 8, max_tokens=1, base=100), seq(3, 20, max_tokens=1, base=200)]
        for s in seqs:
            sched.add(s)
        assert _admission_order(sched, seqs) == want, schedule
        bm.check_invariants()
    with pytest.raises(ValueError, match="'sjf'"):
        EngineConfig(schedule="sjf")


def test_shortest_first_ages_a_long_prompt_in():
    """A long prompt passed over by a stream of short ones gets its turn once AGING x its
    length of prompts went ahead of it."""
    sched, bm = _sched(num_blocks=256, block_size=4, budget=64, max_seqs=1)
    long = seq("long", 40, max_tokens=1)
    sched.add(long)
    order = []
    for i in range(200):
        sched.add(seq(f"s{i}", 8, max_tokens=1, base=1000 + 10 * i))  # a short one arrives every step
        out = sched.schedule()
        order += [s.seq.seq_id for s in out.scheduled]
        _fake_step(sched, out)
        if "long" in order:
            break
    at = order.index("long")
    assert Scheduler.AGING * 40 // 8 <= at <= Scheduler.AGING * 40 // 8 + 2
    bm.check_invariants()

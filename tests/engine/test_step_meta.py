"""Step metadata built from persistent block tables, checked against the per-token
formula slot = table[p // bs] * bs + p % bs written out in Python."""
import torch

from dlbatch.engine.block_manager import BlockManager
from dlbatch.engine.sampling_params import SamplingParams
from dlbatch.engine.scheduler import ScheduledSeq
from dlbatch.engine.sequence import Sequence
from dlbatch.engine.step_meta import BlockTables, StepMetaBuilder

BS = 4


def _slots(table, start, end):
    return [table[p // BS] * BS + p % BS for p in range(start, end)]


def _seq(name, n_prompt, n_out=0):
    s = Sequence(seq_id=name, prompt_ids=list(range(3, 3 + n_prompt)), params=SamplingParams(max_tokens=8))
    s.output_ids = list(range(100, 100 + n_out))
    return s


def _builder(window=None, gathers=True):
    return StepMetaBuilder(BS, 64, 4, torch.device("cpu"), window, need_decode_gather=gathers,
                           need_prefill_gather=gathers)


def test_mixed_step_matches_per_token_formula():
    bm = BlockManager(64, BS, enable_prefix_caching=False)
    pre, chunk, dec1, dec2 = _seq("a", 10), _seq("b", 13), _seq("c", 9, 3), _seq("d", 2, 1)
    for s in (pre, chunk, dec1, dec2):
        bm.allocate(s, reserve=True)
        bm.ensure_slots(s, len(s) + 1)
    chunk.num_computed = 5  # second chunk of a chunked prefill: context in the cache
    dec1.num_computed, dec2.num_computed = len(dec1) - 1, len(dec2) - 1
    prefills = [ScheduledSeq(pre, 10), ScheduledSeq(chunk, 8)]
    decodes = [ScheduledSeq(dec1, 1), ScheduledSeq(dec2, 1)]
    ids, pos, meta, rows, seqs = _builder().build(prefills, decodes)
    want_ids = pre.prompt_ids + chunk.prompt_ids[5:13] + [dec1.output_ids[-1], dec2.output_ids[-1]]
    want_pos = list(range(10)) + list(range(5, 13)) + [len(dec1) - 1, len(dec2) - 1]
    want_slots = (_slots(pre.block_table, 0, 10) + _slots(chunk.block_table, 5, 13)
                  + [_slots(dec1.block_table, len(dec1) - 1, len(dec1))[0], _slots(dec2.block_table, 2, 3)[0]])
    assert ids.tolist() == want_ids and pos.tolist() == want_pos and meta.slots.tolist() == want_slots
    assert meta.num_prefill_tokens == 18 and rows.tolist() == [9, 17, 18, 19] and seqs == [pre, chunk, dec1, dec2]
    assert meta.prefill_cu_q.tolist() == [0, 10, 18] and meta.prefill_ctx.tolist() == [0, 5]
    assert meta.prefill_max_new == 10
    assert meta.prefill[0][3] is None and meta.prefill[1][3].tolist() == _slots(chunk.block_table, 0, 13)
    assert meta.decode_lens.tolist() == [len(dec1), len(dec2)]
    for r, s in enumerate((dec1, dec2)):
        n = -(-len(s) // BS)
        assert meta.decode_block_tables[r, :n].tolist() == s.block_table[:n]
        assert meta.decode_gather[r, :len(s)].tolist() == _slots(s.block_table, 0, len(s))
        assert meta.decode_mask[r, 0, 0].tolist() == [True] * len(s) + [False] * (len(dec1) - len(s))
    assert meta.prefill_block_tables[1, :4].tolist() == chunk.block_table[:4]


def test_only_the_chosen_ops_representation_is_built():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    s = _seq("a", 6, 1)
    bm.allocate(s, reserve=True)
    s.num_computed = len(s) - 1
    _, _, meta, _, _ = _builder(gathers=False).build([], [ScheduledSeq(s, 1)])
    assert meta.decode_gather is None and meta.decode_mask is None
    assert meta.decode_block_tables[0, :2].tolist() == s.block_table[:2]


def test_sliding_window_mask():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    s = _seq("a", 9, 1)
    bm.allocate(s, reserve=True)
    s.num_computed = len(s) - 1
    _, _, meta, _, _ = _builder(window=4).build([], [ScheduledSeq(s, 1)])
    assert meta.decode_mask[0, 0, 0].tolist() == [False] * 6 + [True] * 4


def test_tables_grow_incrementally_and_notice_a_replaced_list():
    bt = BlockTables(rows=2, max_blocks=8)
    a, b, c = _seq("a", 1), _seq("b", 1), _seq("c", 1)
    a.block_table, b.block_table = [5, 6], [7]
    ra, rb = bt.rows([a, b])
    a.block_table.append(9)  # grows by append: only the new entry is written
    bt.table[ra, 0] = -1  # (a stale entry stays stale: proves the first two are not rewritten)
    assert bt.rows([a]) == [ra] and bt.table[ra, :3].tolist() == [-1, 6, 9]
    a.block_table = [1, 2]  # freed and re-admitted: a new list object, the row is rewritten
    bt.rows([a])
    assert bt.table[ra, :2].tolist() == [1, 2]
    c.block_table = [3]
    (rc,) = bt.rows([c, a])[:1]  # no free row: b's (not in this batch) is reassigned
    assert rc == rb and bt.table[rc, 0].item() == 3

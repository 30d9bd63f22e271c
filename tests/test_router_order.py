"""Prefix order across the input (dlbatch/router/order.py) and the feed that uses it."""
from __future__ import annotations

import random

import pyarrow as pa
import pytest

from dlbatch.driver.feed import InputFeed
from dlbatch.router.order import PrefixOrder


def _table(rows):
    return pa.Table.from_pylist([{"doc_id": d, "task": t, "prompt_ids": p, "max_tokens": 8} for d, t, p in rows],
                                schema=pa.schema([("doc_id", pa.string()), ("task", pa.string()),
                                                  ("prompt_ids", pa.list_(pa.int64())), ("max_tokens", pa.int64())]))


def _shuffled_few_shot(n_pre=6, per=5, pre_len=300, seed=0):
    """Documents: one of n_pre preambles of pre_len tokens + a question of its own; shuffled."""
    rng = random.Random(seed)
    pres = [[rng.randrange(1000, 30000) for _ in range(pre_len)] for _ in range(n_pre)]
    docs = [(f"d{p}-{q}", "answer", pres[p] + [rng.randrange(1000, 30000) for _ in range(12)])
            for p in range(n_pre) for q in range(per)]
    rng.shuffle(docs)
    return docs


def _runs(doc_ids):
    """How many runs of equal preamble the order has (one per preamble when grouped)."""
    pre = [d.split("-")[0] for d in doc_ids]
    return 1 + sum(a != b for a, b in zip(pre, pre[1:]))


def test_a_shuffled_input_leaves_grouped_by_shared_prefix():
    docs = _shuffled_few_shot()
    assert _runs([d for d, _, _ in docs]) > 20  # the input itself interleaves the preambles
    order = PrefixOrder()
    for i in range(0, len(docs), 7):  # several blocks, as the stream delivers them
        order.add(_table(docs[i:i + 7]))
    out = []
    while (t := order.take(4)) is not None:
        out += t.column("doc_id").to_pylist()
    assert sorted(out) == sorted(d for d, _, _ in docs)
    assert _runs(out) == 6


def test_a_documents_rows_stay_together_in_their_order_and_rows_without_a_prompt_go_first():
    rows = [("b", "t1", [5] * 40), ("b", "t2", [5] * 40 + [1]), ("err", None, None), ("a", "t1", [7] * 40),
            ("a", "t2", [7] * 41)]
    order = PrefixOrder()
    order.add(_table(rows))
    first = order.take(1)
    assert first.column("doc_id").to_pylist() == ["err"]  # a dead letter leaves at once
    got = order.take(100)
    ids, tasks = got.column("doc_id").to_pylist(), got.column("task").to_pylist()
    assert sorted(set(ids)) == ["a", "b"] and ids in (["a", "a", "b", "b"], ["b", "b", "a", "a"])
    assert tasks == ["t1", "t2", "t1", "t2"]
    assert order.take(10) is None and len(order) == 0


def test_take_gives_whole_documents_at_least_one_and_frees_the_blocks():
    rows = [(f"d{i}", t, [i] * 20) for i in range(5) for t in ("x", "y", "z")]
    order = PrefixOrder(max_bytes=1)
    assert order.add(_table(rows)) == 5
    assert order.full() and order.nbytes > 0
    one = order.take(2)  # a document of 3 rows is never cut
    assert one.num_rows == 3 and len(set(one.column("doc_id").to_pylist())) == 1
    rest = order.take(1000)
    assert rest.num_rows == 12 and order.nbytes == 0 and not order.full()


def test_short_prompts_share_a_key_only_when_equal():
    order = PrefixOrder(block_size=4, depths=(1, 2, 4))
    order.add(_table([("a", "t", [1, 2, 3]), ("b", "t", [1, 2, 3, 4, 5]), ("c", "t", [1, 2, 3]),
                      ("d", "t", [1, 2, 3, 4, 9])]))
    out = order.take(10).column("doc_id").to_pylist()
    assert abs(out.index("a") - out.index("c")) == 1  # equal short prompts adjacent
    assert abs(out.index("b") - out.index("d")) == 1  # the same first block, then different


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        PrefixOrder(block_size=0)


class _Blocks:
    def __init__(self, tables):
        self.tables = list(tables)

    def get(self, timeout=0.0):
        if not self.tables:
            raise StopIteration
        return self.tables.pop(0)


class _Dispatcher:
    def __init__(self):
        self.rows = []

    def add_row(self, row):
        self.rows.append(row)
        return True


def test_the_feed_hands_over_prefix_order_while_there_is_room_and_ends_when_all_is_handed_over():
    docs = _shuffled_few_shot(n_pre=4, per=6)
    blocks = [_table(docs[i:i + 5]) for i in range(0, len(docs), 5)]
    feed, d = InputFeed(_Blocks(blocks), order=PrefixOrder()), _Dispatcher()
    feed.pull(d, room=lambda: False, idle=False)  # busy workers: blocks are held and sorted, nothing handed over
    assert not d.rows and not feed.exhausted
    while not feed.exhausted:
        feed.pull(d, room=lambda: len(d.rows) % 7 != 6, idle=False)
        d.rows.append({"doc_id": "-", "task": "pause"})  # the loop's other work between pulls
    got = [r["doc_id"] for r in d.rows if r["task"] != "pause"]
    assert sorted(got) == sorted(x for x, _, _ in docs) and _runs(got) == 4
    assert feed.docs_seen == len(docs)


def test_the_feed_in_input_order_keeps_the_input_order():
    docs = _shuffled_few_shot(n_pre=3, per=3)
    feed, d = InputFeed(_Blocks([_table(docs)])), _Dispatcher()
    while not feed.exhausted:
        feed.pull(d, room=lambda: True, idle=False)
    assert [r["doc_id"] for r in d.rows] == [x for x, _, _ in docs]


class _TimedBlocks:
    """A stream whose blocks become ready at given times of a fake clock."""

    def __init__(self, timed, clock):
        self.timed, self.clock = list(timed), clock

    def get(self, timeout=0.0):
        if not self.timed:
            raise StopIteration
        if self.timed[0][0] > self.clock.t:
            return None
        return self.timed.pop(0)[1]


class _Clock:
    t = 0.0

    def __call__(self):
        return self.t


def _pull_until(feed, d, clock, until):
    while clock.t < until and not feed.exhausted:
        feed.pull(d, room=lambda: True, idle=not d.rows)
        clock.t = round(clock.t + 0.25, 2)


def test_the_first_blocks_are_gathered_before_any_row_leaves():
    """Idle workers do not take the first block of a shuffled input alone: its rows wait
    (GATHER_S) for the next block, then every prefix leaves in one run."""
    docs = _shuffled_few_shot(n_pre=4, per=6)
    first, second = _table(docs[:12]), _table(docs[12:])
    for gather, runs in ((InputFeed.GATHER_S, 4), (0.0, None)):
        clock = _Clock()
        feed, d = InputFeed(_TimedBlocks([(0.0, first), (1.0, second)], clock), order=PrefixOrder(), clock=clock), \
            _Dispatcher()
        feed.GATHER_S = gather
        _pull_until(feed, d, clock, 0.75)
        assert (not d.rows) == (gather > 0)  # gathering: nothing handed over before the second block
        _pull_until(feed, d, clock, 10.0)
        got = [r["doc_id"] for r in d.rows]
        assert sorted(got) == sorted(x for x, _, _ in docs)
        if runs:
            assert _runs(got) == runs
        else:  # without gathering the first block leaves alone, its prefixes again with the second's
            assert _runs(got) > 4


def test_gathering_ends_after_gather_s_while_the_stream_goes_on():
    docs = _shuffled_few_shot(n_pre=3, per=4)
    clock = _Clock()
    feed, d = InputFeed(_TimedBlocks([(0.0, _table(docs[:6])), (60.0, _table(docs[6:]))], clock),
                        order=PrefixOrder(), clock=clock), _Dispatcher()
    _pull_until(feed, d, clock, InputFeed.GATHER_S - 0.25)
    assert not d.rows and feed.gathering()
    _pull_until(feed, d, clock, InputFeed.GATHER_S + 0.5)  # a slow stream: the workers do not wait for it
    assert len(d.rows) == 6 and not feed.gathering()


def test_only_inputs_with_prefix_groups_are_gathered():
    rng = random.Random(3)
    head = [rng.randrange(1000, 30000) for _ in range(20)]  # a chat template's head: every document has it
    distinct = [(f"p{i}", "answer", head + [rng.randrange(1000, 30000) for _ in range(40)]) for i in range(30)]
    order = PrefixOrder()
    order.add(_table(distinct))
    assert not order.shares_partly
    order = PrefixOrder()
    order.add(_table(_shuffled_few_shot(n_pre=4, per=3)))
    assert order.shares_partly
    # without groups the feed hands the first block over at once
    clock = _Clock()
    feed, d = InputFeed(_TimedBlocks([(0.0, _table(distinct)), (60.0, _table(distinct[:1]))], clock),
                        order=PrefixOrder(), clock=clock), _Dispatcher()
    feed.pull(d, room=lambda: True, idle=True)
    assert len(d.rows) == 30 and not feed.gathering()

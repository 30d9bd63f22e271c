"""The per-process transfer buffer pool (dlbatch/transfer/buffer_pool.py), alone and as
the dlslime sender's pool (its buffer life cycle driven through the control slots, no
dlslime endpoint needed: the shm pool is covered by tests/test_transfer.py)."""
from __future__ import annotations

import os

import pytest

from dlbatch.transfer.buffer_pool import BufferPool, PerProcess, size_class


class Item:
    def __init__(self, size):
        self.size, self.busy, self.done, self.gone, self.disposed = size, True, False, False, False


class Pool(BufferPool[Item]):
    def _create(self, size):
        return Item(size)

    def _returned(self, it):
        return "drop" if it.gone else ("idle" if it.done else None)

    def _dispose(self, it):
        it.disposed = True


def test_reuse_only_after_the_receiver_is_done_and_same_class():
    p = Pool(max_items=2, max_bytes=1 << 40)
    a = p.acquire(size_class(10))
    a.busy = False
    b = p.acquire(size_class(10))
    assert b is not a  # a is closed but its receiver is not done
    a.done = True
    c = p.acquire(size_class(10))
    assert c is a and c.busy and p.reused == 1 and p.created == 2
    d = p.acquire(size_class(5 << 20))
    assert d.size == size_class(5 << 20) and d is not a
    b.busy, b.gone = False, True  # a receiver unlinked it: forgotten, not reused
    assert p.stats() == {"idle": 0, "idle_bytes": 0, "outstanding": 2, "created": 3, "reused": 1}


def test_trim_oldest_first_and_drain():
    p = Pool(max_items=2, max_bytes=1 << 40)
    items = [p.acquire(1 << 20) for _ in range(3)]
    for it in items:
        it.busy, it.done = False, True
    big = p.acquire(2 << 20)  # no idle of its class: room is made, oldest idle disposed first
    assert items[0].disposed and not items[1].disposed and big.size == 2 << 20
    assert p.drain() == items[1:] and all(it.disposed for it in items)
    assert p.stats()["idle"] == 0


def test_per_process_gives_a_forked_child_its_own():
    holder = PerProcess(lambda: Pool(1, 1))
    mine = holder.get()
    assert holder.get() is mine and holder.peek() is mine
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        ok = holder.peek() is None and holder.get() is not mine and holder.get().pid == os.getpid()
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"


def test_dlslime_sender_pool_life_cycle(monkeypatch):
    D = pytest.importorskip("dlbatch.transfer.dlslime_transport")
    st = D._SenderState()
    a = st.acquire(1000)
    gen = a.gen
    assert st.slots[a.slot, 0] == gen and st.owns(a, gen)
    st.closed(a, gen)
    assert st.acquire(1000) is not a  # no ack yet: not reused
    st.slots[a.slot, 2] = gen  # the receiver acknowledged
    c = st.acquire(1000)
    assert c is a and c.gen != gen and st.results[gen] == "received" and not st.owns(a, gen)
    st.closed(c, c.gen)
    st.slots[c.slot, 2] = c.gen ^ D._MASK64  # the receiver gave up
    assert st.poll(c, c.gen) == "abandoned"
    e = st.acquire(1000)
    st.abort(e, e.gen)
    assert st.results[e.gen] == "aborted"
    f = st.acquire(1000)
    st.closed(f, f.gen)
    monkeypatch.setattr(D, "LEASE_S", 0.0)
    with st.lock:
        st.reclaim_locked()
    assert st.results[f.gen] == "lease"
    with st.lock:
        s = {**st.stats_locked(), **st.returns}
    assert s["received"] == s["abandoned"] == s["aborted"] == s["lease"] == 1
    assert a is c is e is f  # one buffer went round four times; the other is still open
    assert s["outstanding"] == 1 and s["idle"] == 1 and s["created"] == 2 and s["reused"] == 3
    assert st.drain() == [a] and a.arr is None

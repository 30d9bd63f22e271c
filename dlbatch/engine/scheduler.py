"""Continuous batching under a per-step token budget.

Each step: running sequences that need one token (decode) go first, then chunks of
prompts still being prefilled, then new sequences are admitted while blocks and budget
last. Admission reserves `prompt + max_tokens` blocks (batch jobs know max_tokens), so a
running sequence never runs out; with admission="greedy" blocks are taken on demand and
the newest running sequence is preempted (freed, recomputed later) when they run out.

Admission order (`schedule`): fcfs, or shortest_first (the default): the waiting prompt
with the fewest tokens to compute goes first, so a worker handed a long paper and a short
one returns the short one first: the first token, and the first finished documents, come
after the shortest prefill instead of behind the longest. Total work is unchanged. Aging
bounds the wait of a long prompt (see `_next_waiting`), and a preempted sequence goes first.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from dlbatch.engine.block_manager import BlockManager, NoFreeBlocks, cdiv
from dlbatch.engine.config import EngineConfig
from dlbatch.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens run this step, starting at seq.num_computed

    @property
    def needs_logits(self) -> bool:
        return self.seq.num_computed + self.num_new == len(self.seq)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    AGING = 4  # shortest_first: a prompt waits at most ~AGING x its length of shorter ones
    LOOKAHEAD = 256  # shortest_first picks among the oldest LOOKAHEAD waiting (bounded cost per admission)

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.reserve = config.admission == "reserve"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.admitted_tokens = 0  # prompt tokens of every sequence admitted so far (aging clock)
        self.on_admit = None  # engine hook: runs after a sequence gets its blocks (KV import)

    # ---- queue ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        need = cdiv(seq.max_total_tokens if self.reserve else len(seq) + 1, self.bm.block_size)
        if need > self.bm.num_blocks:
            raise ValueError(
                f"request {seq.seq_id}: prompt {len(seq.prompt_ids)} + max_tokens {seq.params.max_tokens} tokens "
                f"needs {need} KV blocks but the cache has {self.bm.num_blocks} "
                f"({self.bm.num_blocks * self.bm.block_size} tokens); raise kv_cache_memory"
            )
        seq.status = SeqStatus.WAITING
        seq.wait_mark = self.admitted_tokens
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        decodes = [s for s in self.running if s.remaining == 1]
        prefills = [s for s in self.running if s.remaining > 1]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.remaining, budget)
            if not self._grow(seq, n, scheduled_ids, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n

        # admit new sequences (never while someone was just preempted: they go first)
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            seq = self._next_waiting()
            if self.bm.prefix_pending(seq):  # its prefix is being computed: hit it next step
                deferred.append(self._take(seq))
                continue
            if not self.bm.can_allocate(seq, self.reserve):
                break
            self._take(seq)
            self.admitted_tokens += len(seq.prompt_ids)
            self.bm.allocate(seq, self.reserve)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if self.on_admit is not None:
                self.on_admit(seq)
            self.bm.release_copy(seq)  # the engine copied a partial hit's rows in on_admit
            n = min(seq.remaining, budget)
            self.bm.ensure_slots(seq, seq.num_computed + n)
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n
        for seq in reversed(deferred):
            self.waiting.appendleft(seq)
        return out

    def _take(self, seq: Sequence) -> Sequence:
        if self.waiting[0] is seq:
            return self.waiting.popleft()
        del self.waiting[next(i for i, s in enumerate(self.waiting) if s is seq)]
        return seq

    def _next_waiting(self) -> Sequence:
        """The waiting sequence to admit next: the head (fcfs), or the one with the fewest
        tokens to compute among the oldest LOOKAHEAD (shortest_first). A sequence preempted
        earlier, or one that has seen more than `AGING` times its own prompt length admitted
        since it started waiting, is overdue: overdue ones go first, in arrival order, so
        nothing starves."""
        if self.config.schedule == "fcfs" or len(self.waiting) == 1:
            return self.waiting[0]
        best, best_key = None, None
        for pos, seq in enumerate(itertools.islice(self.waiting, self.LOOKAHEAD)):
            overdue = seq.num_preemptions > 0 or \
                self.admitted_tokens - seq.wait_mark > self.AGING * len(seq.prompt_ids)
            key = (0, pos) if overdue else (1, len(seq.prompt_ids) - seq.num_computed, pos)
            if best_key is None or key < best_key:
                best, best_key = seq, key
                if overdue:
                    break
        return best

    def _grow(self, seq: Sequence, n: int, scheduled_ids: set[int], out: SchedulerOutput) -> bool:
        """Ensure blocks for `n` more tokens of `seq`, preempting newer unscheduled
        sequences if needed. Returns False if `seq` itself had to be preempted."""
        while True:
            try:
                self.bm.ensure_slots(seq, seq.num_computed + n)
                return True
            except NoFreeBlocks:
                victim = next((s for s in reversed(self.running)
                               if s is not seq and id(s) not in scheduled_ids), None)
                if victim is None:
                    if len(self.running) == 1:
                        raise RuntimeError(
                            f"KV cache of {self.bm.num_blocks} blocks cannot hold sequence {seq.seq_id} "
                            f"of {len(seq)} tokens"
                        ) from None
                    victim = seq
                self._preempt(victim, out)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.bm.free_seq(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    # ---- after the model ran --------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: dict[int, int], is_stopped) -> list[Sequence]:
        """Advance every scheduled sequence; append sampled tokens; return the sequences
        that finished (still holding their blocks: call `free_finished`)."""
        finished = []
        for s in out.scheduled:
            seq = s.seq
            needs = s.needs_logits
            seq.num_computed += s.num_new
            self.bm.commit_full_blocks(seq)
            if not needs:
                continue
            seq.output_ids.append(sampled[id(seq)])
            reason = is_stopped(seq)
            if reason is not None:
                seq.finish_reason = reason
                seq.status = SeqStatus.FINISHED
                finished.append(seq)
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]
        return finished

    def free_finished(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.bm.free_seq(seq)

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop these sequences (waiting or running); a running one's blocks are freed."""
        ids = {id(s) for s in seqs}
        for s in self.running:
            if id(s) in ids:
                self.bm.free_seq(s)
        self.running = [s for s in self.running if id(s) not in ids]
        self.waiting = type(self.waiting)(s for s in self.waiting if id(s) not in ids)

    def abort_all(self) -> list[Sequence]:
        seqs = list(self.running) + list(self.waiting)
        for s in self.running:
            self.bm.free_seq(s)
        self.running.clear()
        self.waiting.clear()
        return seqs

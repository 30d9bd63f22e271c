"""Continuous batching under a per-step token budget.

Each step: running sequences that need one token (decode) go first, then chunks of
prompts still being prefilled, then new sequences are admitted while blocks and budget
last. Admission reserves `prompt + max_tokens` blocks (batch jobs know max_tokens), so a
running sequence never runs out; with admission="greedy" blocks are taken on demand and
the newest running sequence is preempted (freed, recomputed later) when they run out.
"""
from __future__ import annotations

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
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.reserve = config.admission == "reserve"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
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
            seq = self.waiting[0]
            if self.bm.prefix_pending(seq):  # its prefix is being computed: hit it next step
                deferred.append(self.waiting.popleft())
                continue
            if not self.bm.can_allocate(seq, self.reserve):
                break
            self.waiting.popleft()
            self.bm.allocate(seq, self.reserve)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if self.on_admit is not None:
                self.on_admit(seq)
            n = min(seq.remaining, budget)
            self.bm.ensure_slots(seq, seq.num_computed + n)
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n
        for seq in reversed(deferred):
            self.waiting.appendleft(seq)
        return out

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

    def abort_all(self) -> list[Sequence]:
        seqs = list(self.running) + list(self.waiting)
        for s in self.running:
            self.bm.free_seq(s)
        self.running.clear()
        self.waiting.clear()
        return seqs

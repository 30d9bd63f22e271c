"""A request inside the engine: its tokens, its blocks, its progress."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from dlbatch.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached: int = 0  # prompt tokens served from the prefix cache (last admission)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of committed full blocks
    kv_copy: tuple[int, int, int] | None = None  # (cached block, own block, rows) to copy at admission
    reserved: int = 0  # blocks reserved for this sequence and not yet taken
    finish_reason: str | None = None
    truncated: bool = False
    prefill_only: bool = False  # prefill-only mode: stop after the first token, export the KV
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    wait_mark: int = 0  # the scheduler's admitted-token count when this sequence started waiting
    generator: object = None  # torch.Generator for seeded sampling
    stop_text_len: int = 0  # characters of decoded text already checked for stop strings
    text: str | None = None
    kv_import: object = None  # decode-only: per-layer KV waiting to be copied in at admission
    kv_export: object = None  # prefill-only: per-layer KV taken out before the blocks are freed
    kv_sink: object = None  # prefill-only: streams each layer's KV as it is computed (engine/pd.py KVSink)
    kv_streamed: bool = False  # every layer went to kv_sink (kv_export stays None)
    kv_imported: object = None  # decode-only: called once the imported KV is in our blocks (frees its source)
    generator_state: object = None
    pd_finish: str | None = None  # prefill-only: finish reason if the first token ended the request
    matcher: object = None  # constrained: llguidance matcher that has consumed output_ids (engine/constraint.py)
    # sampling extras (SamplingParams.min_p, penalties, logprobs, n)
    group: list | None = None  # n > 1: the request's n sequences (shared list; [0] is the one reported)
    sample_index: int = 0  # this sequence's place in `group`
    token_counts: object = None  # penalties: (V,) float32 count of each token in output_ids[:counted]
    prompt_mask: object = None  # repetition penalty: (V,) bool, the prompt's tokens
    counted: int = 0  # output tokens already in token_counts
    logprobs: list | None = None  # logprobs asked: per output token (token, logprob, top ids, top logprobs)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self) - self.num_computed

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

"""What `LLM.generate` returns."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    truncated: bool = False
    cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # ttft_s, latency_s, ...
    # SamplingParams.logprobs set: per output token {"token", "token_id", "logprob", "top": [...]}
    logprobs: list | None = None
    # SamplingParams.n > 1: every sample (this output is sample 0's), each a RequestOutput
    samples: list | None = None

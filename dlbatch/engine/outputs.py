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

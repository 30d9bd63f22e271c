"""What a prefill-only engine hands to a decode-only engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dlbatch.engine.sampling_params import SamplingParams


class FingerprintMismatch(ValueError):
    pass


@dataclass
class PrefillResult:
    request_id: str
    prompt_ids: list[int]
    first_token: int
    params: SamplingParams
    fingerprint: str  # model identity: import refuses KV from another model
    kv: Any  # list of per-layer (2, n, kv_heads, head_dim) tensors/arrays, or a transfer payload
    dtype: str = "float32"
    finish_reason: str | None = None  # set when the first token already ended the request
    truncated: bool = False
    generator_state: Any = None
    metrics: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

"""What a prefill-only engine hands to a decode-only engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from dlbatch.engine.sampling_params import SamplingParams


class FingerprintMismatch(ValueError):
    pass


class KVSink(Protocol):
    """Where a prefill-only sequence's KV goes, layer by layer, while the prefill still runs.

    Set ``seq.kv_sink`` (or pass ``kv_sink_factory`` to ``LLM.prefill``). In the step that
    computes the last prompt tokens, right after layer ``i`` has stored its KV (layers
    ``i+1..`` still to compute), the engine gathers the sequence's whole layer ``i``,
    token-major ``(2, num_prompt_tokens, kv_heads, head_dim)`` in the cache dtype, and
    calls ``send_layer(i, kv)``. A sink may offer ``layer_buffer(i) -> Tensor | None``: the
    engine then gathers straight into it (e.g. a shared-memory segment) and passes that
    same tensor to ``send_layer``. The engine never touches ``kv`` again; ``send_layer``
    should hand the work to another thread and return quickly.
    """

    def send_layer(self, i: int, kv) -> None: ...


@dataclass
class PrefillResult:
    request_id: str
    prompt_ids: list[int]
    first_token: int
    params: SamplingParams
    fingerprint: str  # model identity: import refuses KV from another model
    kv: Any  # list of per-layer (2, n, kv_heads, head_dim) tensors/arrays, or a transfer payload; None if streamed
    dtype: str = "float32"
    finish_reason: str | None = None  # set when the first token already ended the request
    truncated: bool = False
    generator_state: Any = None
    metrics: dict = field(default_factory=dict)
    kv_streamed: bool = False  # the KV went layer by layer to a KVSink instead of `kv`

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

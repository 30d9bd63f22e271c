"""Per-request sampling parameters (the user-facing `SamplingParams`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] | list[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    truncate_prompt: bool = False
    # output must match it: a `Constraint` or {"kind": json_schema|regex|choices|grammar, "spec": ...}
    constraint: Any = None

    def __post_init__(self) -> None:
        from dlbatch.engine.constraint import Constraint

        object.__setattr__(self, "constraint", Constraint.from_dict(self.constraint))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def key(self) -> tuple:
        """What makes two requests with the same prompt produce the same output (duplicate folding)."""
        return (self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed if not self.greedy else None,
                self.stop, self.stop_token_ids, self.ignore_eos, self.truncate_prompt,
                self.constraint.key() if self.constraint is not None else None)

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
    # the extras (issue 29): each at its default is off, and sampling is then exactly what it was
    min_p: float = 0.0  # drop tokens whose probability < min_p x the top one's (after temperature)
    repetition_penalty: float = 1.0  # HF/vLLM: logits of tokens seen in prompt + output / it (> 0) or x it (< 0)
    presence_penalty: float = 0.0  # OpenAI, over the output: logit -= presence x [count > 0]
    frequency_penalty: float = 0.0  # OpenAI, over the output: logit -= frequency x count
    logprobs: int | None = None  # per output token: its logprob and the top-k alternatives (raw model distribution)
    n: int = 1  # independent samples of the prompt; sample i is seeded seed + i

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
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or not (0.0 < self.repetition_penalty < float("inf")):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0 (top alternatives per token) or None, "
                             f"got {self.logprobs!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """A penalty is set: sampling needs the sequence's token counts."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_extras(self) -> bool:
        """min_p, a penalty or logprobs is set: sampling takes the extras path (the op's ``extras``)."""
        return self.penalized or self.logprobs is not None or (self.min_p > 0.0 and not self.greedy)

    def key(self) -> tuple:
        """What makes two requests with the same prompt produce the same output (duplicate folding)."""
        base = (self.max_tokens, self.temperature, self.top_p, self.top_k,
                self.seed if not self.greedy else None,
                self.stop, self.stop_token_ids, self.ignore_eos, self.truncate_prompt,
                self.constraint.key() if self.constraint is not None else None)
        extras = (self.min_p, self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
                  self.logprobs, self.n)
        if extras == (0.0, 1.0, 0.0, 0.0, None, 1):
            return base  # no extras: the key it always was
        return base + (extras,)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)

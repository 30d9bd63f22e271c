"""Constrained decoding: a request's output must match a JSON schema, a regex, one of a list
of strings, or a Lark grammar.

The grammar engine is llguidance (docs/structured.md says why). Per engine there is one
`ConstraintCompiler`: it builds the llguidance tokenizer once from our `tokenizers` object
(no hub access) and compiles each distinct constraint once, keeping a template matcher that
every request of that constraint copies (`deep_copy` is cheap; compiling is not).

Per step, `ConstraintMasker` fills one token bitmask row per constrained sequence (in
llguidance's thread pool, which releases the GIL, so it runs while the forward runs) and
applies it to the logits: disallowed tokens get -inf before greedy or sampled selection.
Each sampled token is then consumed by the sequence's matcher (`advance`); when the matcher
stops (grammar complete and EOS taken, or nothing else can follow) the request finishes
with reason "stop".

Invariant: a sequence's matcher has consumed exactly its `output_ids`. A decode-only
engine (PD) rebuilds the matcher from the constraint and replays the first token that the
prefill engine sampled under the same constraint.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "regex", "choices", "grammar")


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (bad schema, regex or grammar)."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. ``spec`` is a JSON Schema dict (or a pydantic
    model class, converted to its schema), a regex string, a list of strings, or a Lark
    grammar string. Serialisable with `to_dict` / `from_dict` (plain JSON types)."""

    kind: str
    spec: Any

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        spec = self.spec
        if self.kind == "json_schema":
            if hasattr(spec, "model_json_schema"):
                spec = spec.model_json_schema()
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except json.JSONDecodeError as e:
                    raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(spec, dict):
                raise ValueError(f"json_schema must be a JSON Schema object, got {type(spec).__name__}")
        elif self.kind in ("regex", "grammar"):
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"{self.kind} must be a non-empty string, got {spec!r}")
        else:
            if isinstance(spec, (str, bytes)) or not hasattr(spec, "__iter__"):
                raise ValueError(f"choices must be a list of strings, got {spec!r}")
            spec = tuple(spec)
            if not spec or any(not isinstance(c, str) or not c for c in spec):
                raise ValueError(f"choices must be a non-empty list of non-empty strings, got {list(spec)!r}")
        object.__setattr__(self, "spec", spec)

    def key(self) -> str:
        """Canonical text: equal constraints share one compiled grammar."""
        spec = list(self.spec) if self.kind == "choices" else self.spec
        return json.dumps([self.kind, spec], sort_keys=True, separators=(",", ":"))

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Constraint) and self.key() == other.key()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "spec": list(self.spec) if self.kind == "choices" else self.spec}

    @classmethod
    def from_dict(cls, d: dict | None) -> "Constraint | None":
        if d is None:
            return None
        if isinstance(d, Constraint):
            return d
        if not isinstance(d, dict) or set(d) != {"kind", "spec"}:
            raise ValueError(f"a constraint is {{'kind': ..., 'spec': ...}}, got {d!r}")
        return cls(d["kind"], d["spec"])


def _grammar(c: Constraint) -> str:
    """The llguidance grammar (JSON text) for a constraint."""
    from llguidance import LLMatcher

    if c.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(c.spec, defaults={"whitespace_flexible": False})
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "choices":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in c.spec))
    return LLMatcher.grammar_from_lark(c.spec)


def ll_tokenizer(tokenizer, vocab_size: int):
    """An llguidance tokenizer for our `Tokenizer` (dlbatch/engine/tokenizer.py): from its
    `tokenizers` JSON when llguidance knows the decoder (byte-level BPE, sentencepiece);
    otherwise from each token's decoded bytes (e.g. word-level vocabularies without a
    decoder). ``vocab_size`` is the model's (logits) width."""
    import llguidance

    n = max(vocab_size, tokenizer.vocab_size)
    eos = list(tokenizer.eos_token_ids) or None
    try:
        return llguidance.LLTokenizer(tokenizer.tk.to_str(), n_vocab=n, eos_token=eos)
    except Exception as e:
        first = e
    try:
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(tokenizer, n)), n_vocab=n, eos_token=eos)
    except Exception as e:
        raise ConstraintError(f"the grammar engine cannot use this tokenizer: {first}; {e}") from None


class _TokenBytes:
    """What llguidance's TokenizerWrapper needs: every token's bytes and an encoder."""

    def __init__(self, tokenizer, n: int):
        tk = tokenizer.tk
        special = {i for i, t in tk.get_added_tokens_decoder().items() if t.special}
        self.tokens = []
        for i in range(n):
            piece = tk.id_to_token(i)
            if piece is None:
                self.tokens.append(b"")
            else:
                self.tokens.append(piece.encode() if i in special else tk.decode([i], skip_special_tokens=False).encode())
        self.special_token_ids = sorted(special)
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self._tk = tk

    def __call__(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids


class ConstraintCompiler:
    """One per engine: the llguidance tokenizer (built on first use) and a cache of compiled
    constraints (template matchers), keyed by `Constraint.key()`."""

    def __init__(self, tokenizer, vocab_size: int, max_cached: int = 1024):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self._lltok = None
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.compiles = 0
        self.compile_s = 0.0

    @property
    def lltok(self):
        if self._lltok is None:
            self._lltok = ll_tokenizer(self.tokenizer, self.vocab_size)
        return self._lltok

    def compile(self, c: Constraint):
        """The template matcher of ``c`` (compiled once); raises ConstraintError."""
        import time

        from llguidance import LLMatcher

        k = c.key()
        with self._lock:
            m = self._cache.get(k)
            if m is not None:
                return m
            t0 = time.perf_counter()
            try:
                m = LLMatcher(self.lltok, _grammar(c), log_level=0)
            except ValueError as e:
                raise ConstraintError(f"{c.kind} constraint cannot be compiled: {e}") from None
            if m.is_error():
                raise ConstraintError(f"{c.kind} constraint cannot be compiled: {m.get_error()}")
            self.compile_s += time.perf_counter() - t0
            self.compiles += 1
            if len(self._cache) >= self.max_cached:
                self._cache.pop(next(iter(self._cache)))
            self._cache[k] = m
            return m

    def matcher(self, c: Constraint):
        """A fresh matcher (state at the start of the output) for one request."""
        return self.compile(c).deep_copy()


def advance(seq) -> bool:
    """Feed the sequence's newest output token to its matcher; True when the matcher has
    stopped (the constrained output is complete)."""
    m = seq.matcher
    tok = seq.output_ids[-1]
    if not m.consume_token(tok):
        raise ConstraintError(f"request {seq.seq_id}: token {tok} violates its constraint: {m.get_error()}")
    return m.is_stopped()


class ConstraintMasker:
    """Per-step token bitmasks for the constrained sequences of a batch.

    ``start(seqs)`` fills the masks in llguidance's thread pool (GIL released) and returns at
    once, so the forward pass runs meanwhile; ``apply(logits, seqs)`` waits for them and sets
    every token a sequence's constraint forbids to -inf."""

    def __init__(self, vocab_size: int, num_threads: int = 2):
        self.vocab_size = vocab_size
        self.num_threads = num_threads
        self._executor = None
        self._thread: threading.Thread | None = None
        self._mask = None
        self._rows: list[int] = []
        self._error: BaseException | None = None

    def _fill(self, pairs, mask) -> None:
        from llguidance.torch import fill_next_token_bitmask_par

        try:
            fill_next_token_bitmask_par(self._executor, pairs, mask)
        except BaseException as e:  # surfaced by apply() on the engine thread
            self._error = e

    def start(self, seqs) -> bool:
        """Begin filling masks for ``seqs`` (the logits rows, in order); False if none is
        constrained."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        self._rows = rows
        if not rows:
            return False
        import torch
        from llguidance import LLExecutor

        if self._executor is None:
            self._executor = LLExecutor(num_threads=self.num_threads)
        self._mask = torch.empty((len(rows), (self.vocab_size + 31) // 32), dtype=torch.int32)
        pairs = [(seqs[i].matcher, k) for k, i in enumerate(rows)]
        self._error = None
        self._thread = threading.Thread(target=self._fill, args=(pairs, self._mask), daemon=True)
        self._thread.start()
        return True

    def apply(self, logits) -> None:
        """Wait for the masks started by `start` and apply them to ``logits`` in place."""
        if not self._rows:
            return
        self._thread.join()
        self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        apply_bitmask(logits, self._mask, self._rows)
        self._rows = []


def apply_bitmask(logits, mask, rows: list[int]) -> None:
    """logits[rows[k], t] = -inf wherever bit t of mask[k] is 0 (bit t of word t // 32,
    least significant first); tokens past the mask's width are disallowed."""
    import numpy as np
    import torch

    v = logits.shape[1]
    bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :v]
    allowed = torch.from_numpy(bits.astype(bool))
    if allowed.shape[1] < v:
        allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]), value=False)
    with torch.inference_mode():  # the model's logits are inference tensors
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, idx)
        sub.masked_fill_(~allowed.to(logits.device), float("-inf"))
        logits.index_copy_(0, idx, sub)

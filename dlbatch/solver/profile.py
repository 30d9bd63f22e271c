"""Chip profiles and the model description the solver reasons with.

A :class:`ChipProfile` says how fast one worker (one chip, one engine) runs a given
model, through two fitted cost models:

* **prefill** — seconds to prefill a chunk of ``tokens`` new tokens on top of
  ``cached`` tokens already in the KV cache::

      t = a + b * tokens + c * tokens * (cached + tokens / 2)

  ``cached + tokens / 2`` is the mean attention context seen by the new tokens
  (each new token attends to everything cached plus, causally, half the chunk on
  average), so ``c`` is the attention cost per (token x context token) and ``b`` the
  per-token cost of the dense layers; ``a`` is the fixed cost of one forward pass
  (launches, reading the weights once).
* **decode** — seconds for one decode step of a running batch::

      t = a + b * batch + c * sum_context

  where ``sum_context`` is the sum over the batch of each sequence's context length
  (tokens whose KV is read by attention). ``a`` is mostly the weight read, ``c`` the
  KV read per context token.

Both fits are non-negative least squares (``scipy.optimize.nnls``), so every
coefficient is >= 0 and times grow with work.

Profiles are YAML files (``save_profile`` / ``load_profile``; ``yaml.safe_load``
only). The raw measured points are stored with the fit so a profile can be refitted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

SOURCES = ("measured", "catalog")


class ProfileError(ValueError):
    """A profile file or value is invalid; the message names the file/key/value."""


@dataclass(frozen=True)
class ModelSpec:
    """What the solver needs to know about a model (dense decoder-only transformer).

    ``n_heads`` is the number of query heads (used for the attention FLOPs); it
    defaults to ``kv_heads`` when 0.
    """

    name: str
    n_params: int
    weight_bytes: int
    n_layers: int
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: int = 2
    n_heads: int = 0

    def __post_init__(self) -> None:
        for key in ("n_params", "weight_bytes", "n_layers", "kv_heads", "head_dim", "kv_dtype_bytes"):
            value = getattr(self, key)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelSpec {self.name!r}: {key} must be a positive integer, got {value!r}")
        if not isinstance(self.n_heads, (int, np.integer)) or self.n_heads < 0:
            raise ValueError(f"ModelSpec {self.name!r}: n_heads must be an integer >= 0, got {self.n_heads!r}")

    @property
    def query_heads(self) -> int:
        return self.n_heads or self.kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer: ``2 * n_layers * kv_heads * head_dim * kv_dtype_bytes``."""
        return 2 * self.n_layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def dense_flops_per_token(self) -> float:
        """Matmul FLOPs of the weights for one token: ``2 * n_params``."""
        return 2.0 * self.n_params

    @property
    def attn_flops_per_token_ctx(self) -> float:
        """Attention FLOPs per token per context token: ``4 * layers * heads * head_dim``
        (QK^T and AV, 2 FLOPs per multiply-add each)."""
        return 4.0 * self.n_layers * self.query_heads * self.head_dim

    def flops_per_token(self, context: float = 0.0) -> float:
        """``2 * n_params + 4 * layers * heads * head_dim * context``."""
        return self.dense_flops_per_token + self.attn_flops_per_token_ctx * float(context)

    @classmethod
    def smollm2_135m(cls) -> "ModelSpec":
        """SmolLM2-135M (config.json of HuggingFaceTB/SmolLM2-135M-Instruct), bf16 weights."""
        return cls(name="smollm2-135m", n_params=134_515_008, weight_bytes=2 * 134_515_008,
                   n_layers=30, kv_heads=3, head_dim=64, kv_dtype_bytes=2, n_heads=9)

    @classmethod
    def llama3_8b(cls) -> "ModelSpec":
        """Llama-3-8B (32 layers, 32 query / 8 KV heads, head_dim 128), bf16 weights."""
        return cls(name="llama-3-8b", n_params=8_030_261_248, weight_bytes=2 * 8_030_261_248,
                   n_layers=32, kv_heads=8, head_dim=128, kv_dtype_bytes=2, n_heads=32)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        return cls(**d)


@dataclass(frozen=True)
class CostModel:
    """``t = a + b * x1 + c * x2`` (x1, x2 are defined by the prefill/decode model)."""

    a: float
    b: float
    c: float

    def __post_init__(self) -> None:
        for key in ("a", "b", "c"):
            v = getattr(self, key)
            if not isinstance(v, (int, float, np.floating, np.integer)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"cost model coefficient {key} must be a finite number >= 0, got {v!r}")

    def as_tuple(self) -> tuple[float, float, float]:
        return (float(self.a), float(self.b), float(self.c))


@dataclass(frozen=True)
class ChipProfile:
    """How one worker of one chip type runs one model.

    ``memory_bytes`` is usable device memory (after runtime reserve);
    ``kv_link_bw`` is bytes/s a worker can send or receive KV at (the scale-out
    link between pools); ``price_per_hour`` in USD per chip.
    ``prefill_points`` are ``(tokens, cached, seconds)``; ``decode_points`` are
    ``(batch, sum_context, seconds)``.
    """

    name: str
    source: str
    memory_bytes: float
    mem_bw: float
    kv_link_bw: float
    price_per_hour: float
    prefill: CostModel
    decode: CostModel
    peak_flops: float | None = None
    model: str = ""
    prefill_points: tuple[tuple[float, float, float], ...] = field(default=())
    decode_points: tuple[tuple[float, float, float], ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ChipProfile name must be a non-empty string, got {self.name!r}")
        if self.source not in SOURCES:
            raise ValueError(f"ChipProfile {self.name!r}: source must be one of {SOURCES}, got {self.source!r}")
        for key in ("memory_bytes", "mem_bw", "kv_link_bw"):
            v = getattr(self, key)
            if not _is_num(v) or v <= 0:
                raise ValueError(f"ChipProfile {self.name!r}: {key} must be a number > 0, got {v!r}")
        if not _is_num(self.price_per_hour) or self.price_per_hour < 0:
            raise ValueError(f"ChipProfile {self.name!r}: price_per_hour must be >= 0, got {self.price_per_hour!r}")
        if self.peak_flops is not None and (not _is_num(self.peak_flops) or self.peak_flops <= 0):
            raise ValueError(f"ChipProfile {self.name!r}: peak_flops must be > 0 or None, got {self.peak_flops!r}")
        if not isinstance(self.prefill, CostModel) or not isinstance(self.decode, CostModel):
            raise ValueError(f"ChipProfile {self.name!r}: prefill/decode must be CostModel instances")

    # -- cost models -------------------------------------------------------------
    def prefill_time(self, tokens: float, cached: float = 0.0) -> float:
        """Seconds to prefill ``tokens`` new tokens with ``cached`` tokens in cache."""
        a, b, c = self.prefill.as_tuple()
        return a + b * tokens + c * tokens * (cached + tokens / 2.0)

    def decode_step_time(self, batch: float, sum_context: float) -> float:
        """Seconds for one decode step of ``batch`` sequences with total context ``sum_context``."""
        a, b, c = self.decode.as_tuple()
        return a + b * batch + c * sum_context

    def replace(self, **changes: Any) -> "ChipProfile":
        from dataclasses import replace as _replace

        return _replace(self, **changes)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


# -- fitting ----------------------------------------------------------------------
def _points_array(points: Iterable[Sequence[float]], what: str) -> np.ndarray:
    arr = np.asarray([tuple(p) for p in points], dtype=float)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"{what} points must be (x1, x2, seconds) triples, got shape {arr.shape}")
    if arr.shape[0] < 3:
        raise ValueError(f"{what} fit needs at least 3 points, got {arr.shape[0]}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        bad = arr[~np.all(np.isfinite(arr) & (arr >= 0), axis=1)][0]
        raise ValueError(f"{what} points must be finite and >= 0, got {tuple(bad)}")
    return arr


def _nnls_fit(X: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    from scipy.optimize import nnls

    # Column scaling keeps nnls well conditioned when columns span many decades.
    scale = np.maximum(np.abs(X).max(axis=0), 1e-300)
    coef, _ = nnls(X / scale, y)
    coef = coef / scale
    return float(coef[0]), float(coef[1]), float(coef[2])


def fit_prefill(points: Iterable[Sequence[float]]) -> CostModel:
    """Fit ``t = a + b*tokens + c*tokens*(cached + tokens/2)`` from
    ``(tokens, cached, seconds)`` points by non-negative least squares."""
    arr = _points_array(points, "prefill")
    tok, cached, t = arr[:, 0], arr[:, 1], arr[:, 2]
    X = np.column_stack([np.ones_like(tok), tok, tok * (cached + tok / 2.0)])
    return CostModel(*_nnls_fit(X, t))


def fit_decode(points: Iterable[Sequence[float]]) -> CostModel:
    """Fit ``t = a + b*batch + c*sum_context`` from ``(batch, sum_context, seconds)``
    points by non-negative least squares."""
    arr = _points_array(points, "decode")
    batch, ctx, t = arr[:, 0], arr[:, 1], arr[:, 2]
    X = np.column_stack([np.ones_like(batch), batch, ctx])
    return CostModel(*_nnls_fit(X, t))


# -- YAML I/O -------------------------------------------------------------------
_REQUIRED = ("name", "source", "memory_bytes", "mem_bw", "kv_link_bw", "price_per_hour", "prefill", "decode")


def profile_to_dict(profile: ChipProfile) -> dict[str, Any]:
    return {
        "name": profile.name,
        "source": profile.source,
        "model": profile.model,
        "memory_bytes": float(profile.memory_bytes),
        "peak_flops": None if profile.peak_flops is None else float(profile.peak_flops),
        "mem_bw": float(profile.mem_bw),
        "kv_link_bw": float(profile.kv_link_bw),
        "price_per_hour": float(profile.price_per_hour),
        "prefill": dict(zip("abc", profile.prefill.as_tuple())),
        "decode": dict(zip("abc", profile.decode.as_tuple())),
        "prefill_points": [list(map(float, p)) for p in profile.prefill_points],
        "decode_points": [list(map(float, p)) for p in profile.decode_points],
    }


def profile_from_dict(d: Any, where: str = "<dict>") -> ChipProfile:
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: a profile must be a mapping, got {type(d).__name__}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ProfileError(f"{where}: missing key(s) {missing}")

    def num(key: str, allow_none: bool = False) -> float | None:
        v = d.get(key)
        if v is None and allow_none:
            return None
        if not _is_num(v):
            raise ProfileError(f"{where}: key {key!r} must be a number, got {v!r}")
        return float(v)

    def cost(key: str) -> CostModel:
        v = d[key]
        if not isinstance(v, dict) or any(k not in v for k in "abc"):
            raise ProfileError(f"{where}: key {key!r} must be a mapping with a, b, c, got {v!r}")
        for k in "abc":
            if not _is_num(v[k]) or v[k] < 0:
                raise ProfileError(f"{where}: key {key}.{k} must be a number >= 0, got {v[k]!r}")
        return CostModel(float(v["a"]), float(v["b"]), float(v["c"]))

    def pts(key: str) -> tuple[tuple[float, float, float], ...]:
        v = d.get(key) or []
        if not isinstance(v, list):
            raise ProfileError(f"{where}: key {key!r} must be a list of [x1, x2, seconds], got {v!r}")
        out = []
        for i, p in enumerate(v):
            if not isinstance(p, (list, tuple)) or len(p) != 3 or not all(_is_num(x) for x in p):
                raise ProfileError(f"{where}: key {key}[{i}] must be [x1, x2, seconds], got {p!r}")
            out.append(tuple(float(x) for x in p))
        return tuple(out)

    try:
        return ChipProfile(
            name=str(d["name"]),
            source=d["source"],
            memory_bytes=num("memory_bytes"),
            mem_bw=num("mem_bw"),
            kv_link_bw=num("kv_link_bw"),
            price_per_hour=num("price_per_hour"),
            prefill=cost("prefill"),
            decode=cost("decode"),
            peak_flops=num("peak_flops", allow_none=True),
            model=str(d.get("model") or ""),
            prefill_points=pts("prefill_points"),
            decode_points=pts("decode_points"),
        )
    except ProfileError:
        raise
    except ValueError as e:
        raise ProfileError(f"{where}: {e}") from e


def save_profile(profile: ChipProfile, path: str | Path) -> None:
    """Write ``profile`` as YAML."""
    import yaml

    Path(path).write_text(yaml.safe_dump(profile_to_dict(profile), sort_keys=False))


def load_profile(path: str | Path) -> ChipProfile:
    """Read a profile written by :func:`save_profile`; errors name the file and key."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"profile file not found: {str(p)!r}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ProfileError(f"{p}: not valid YAML: {e}") from e
    return profile_from_dict(data, where=str(p))

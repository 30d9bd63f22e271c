"""Frozen configuration objects of the engine: the model's shape and the engine's knobs."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_DTYPES = ("float32", "bfloat16", "float16")


class ModelConfigError(ValueError):
    """A model's config.json (or GGUF metadata) describes something we cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn | dynamic
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn (transformers' _compute_yarn_parameters): ramp bounds and the cos/sin scale
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: from factor (and mscale / mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def context_limit(self) -> int:
        """The longest sequence the model takes: max_position_embeddings, times the
        factor for dynamic NTK (which extends past it at run time)."""
        if self.rope.kind == "dynamic":
            return int(self.max_position_embeddings * self.rope.factor)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_params(self) -> int:
        """Weights of the layers' linears (QKV, output, gate/up, down): what a token multiplies
        through, the LM head apart."""
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        return self.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size)

    def num_params(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.linear_params() + 2 * h * self.num_layers + emb + h

    @staticmethod
    def from_hf(cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        mt = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"{source}: model_type {mt!r} (architectures {archs}) is not run by dlbatch's engine "
                f"(it runs {', '.join(SUPPORTED_MODEL_TYPES)}); model.backend: vllm runs it if vLLM does "
                "(docs/backends.md)"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise ModelConfigError(f"{source}: {key} must be a positive integer, got {cfg.get(key)!r}")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if cfg.get("mlp_bias"):
            raise ModelConfigError(f"{source}: mlp_bias=true is not supported")
        rope = _parse_rope(cfg, source)
        sliding = None
        if mt == "mistral":
            sliding = cfg.get("sliding_window")
        elif mt in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: use_sliding_window=true is not supported for {mt}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        attn_bias = bool(cfg.get("attention_bias", False))
        return ModelConfig(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=(mt == "qwen2") or attn_bias,
            o_bias=attn_bias and mt in ("llama", "qwen3"),
            qk_norm=(mt == "qwen3"),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _parse_rope(cfg: dict[str, Any], source: str) -> RopeConfig:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind not in ("default", "linear", "llama3", "yarn", "dynamic"):
        raise ModelConfigError(f"{source}: rope type {kind!r} is not supported (default, linear, llama3, yarn, dynamic)")
    max_pos = int(cfg.get("max_position_embeddings", 8192))
    original = int(merged.get("original_max_position_embeddings") or (8192 if kind == "llama3" else max_pos))
    factor = merged.get("factor")
    if factor is None:  # transformers (yarn): the ratio of the extended to the original context
        factor = max_pos / original if kind == "yarn" else 1.0
    if kind in ("yarn", "dynamic", "linear") and float(factor) < 1.0:
        raise ModelConfigError(f"{source}: rope_scaling factor must be >= 1 for {kind}, got {factor!r}")
    opt = lambda key: None if merged.get(key) is None else float(merged[key])  # noqa: E731
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(factor),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=original,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        attention_factor=opt("attention_factor"),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(merged.get("truncate", True)),
    )


def parse_memory(value: int | float | str | None, what: str = "kv_cache_memory") -> int | None:
    """'2GiB' / '512MB' / 1e9 -> bytes."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{what} must be positive, got {value!r}")
        return int(value)
    s = str(value).strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
    for u, mult in units.items():
        if s.endswith(u):
            try:
                num = float(s[: -len(u)])
            except ValueError:
                break
            if num <= 0 or not math.isfinite(num):
                break
            return int(num * mult)
    raise ValueError(f"{what}: cannot parse {value!r} (use bytes or e.g. '2GiB', '512MB')")


def parse_kv_memory(value: int | float | str | None) -> int | float | None:
    """kv_cache_memory: bytes (int, or '2GiB'), or a fraction of the free device memory
    (a float in (0, 1], '0.5' or '50%'), returned as a float."""
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory: cannot parse {value!r}")
    if isinstance(value, float) and value <= 1.0:
        if value <= 0:
            raise ValueError(f"kv_cache_memory fraction must be in (0, 1], got {value!r}")
        return value
    if isinstance(value, str):
        s = value.strip()
        frac = None
        try:
            frac = float(s[:-1]) / 100 if s.endswith("%") else (float(s) if "." in s else None)
        except ValueError:
            frac = None
        if frac is not None:
            if not 0.0 < frac <= 1.0:
                raise ValueError(f"kv_cache_memory fraction must be in (0, 1], got {value!r}")
            return frac
    return parse_memory(value)


DEFAULT_MAX_MODEL_LEN = 8192  # the longest context an engine takes when none is asked for
# sequences an engine runs at once: a decode step's batch. A step reads every weight once
# whatever its rows, so more rows amortise that read (docs/benchmarks.md, "Measurements behind
# design choices"); vLLM-CPU's own default is 256. The solver plans with the job's figure
# (`driver/layout.py` max_num_seqs; `solver/layout.py` DEFAULT_MAX_BATCH equals this one).
DEFAULT_MAX_NUM_SEQS = 128


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of one engine, with its one default. `LLM(model, config, **fields)`, the
    job's workers (`dlbatch.workers.pools.engine_config`) and the CLI build engines from it;
    ``for_model`` resolves what depends on the model (``max_model_len``)."""

    dtype: str = "bfloat16"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's context, at most DEFAULT_MAX_MODEL_LEN
    block_size: int = 16
    # bytes (int) or a fraction of free device memory (float in (0, 1]); None: CPU: sized from
    # max_num_seqs * max_model_len (capped), CUDA: engine/device.py kv_cache_bytes
    kv_cache_memory: int | float | None = None
    device_share: float = 1.0  # this worker's share of its device (a pool's num_gpus < 1)
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    enable_prefix_caching: bool = True
    admission: str = "reserve"  # reserve (prompt+max_tokens blocks up front) | greedy (recompute-preemption)
    schedule: str = "shortest_first"  # admission order: shortest_first (with aging) | fcfs (engine/scheduler.py)
    allow_upcast: bool = True  # CPU without native bf16/fp16 matmul: compute in fp32 (see engine/device.py)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (engine/cuda_graph.py)
    kv_cache_dtype: str = "auto"  # auto: the compute dtype; float16/bfloat16 halve the KV bytes of an fp32 model

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_memory", parse_kv_memory(self.kv_cache_memory))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(_DTYPES)}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} < block_size {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        if self.schedule not in ("shortest_first", "fcfs"):
            raise ValueError(f"schedule {self.schedule!r} is not one of shortest_first, fcfs")
        if self.admission not in ("reserve", "greedy"):
            raise ValueError(f"admission {self.admission!r} is not one of reserve, greedy")

    def for_model(self, model: ModelConfig) -> "EngineConfig":
        """This config with ``max_model_len`` resolved for ``model``: the model's context (at
        most DEFAULT_MAX_MODEL_LEN) when None; an explicit value past the context is an error."""
        mml = self.max_model_len or min(model.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if mml > model.context_limit:
            raise ValueError(f"max_model_len {mml} exceeds the model's max_position_embeddings "
                             f"{model.max_position_embeddings}"
                             + (f" x dynamic rope factor {model.rope.factor:g}" if model.rope.kind == "dynamic" else ""))
        return replace(self, max_model_len=mml)

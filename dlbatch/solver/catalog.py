"""Chip catalog: public datasheet figures turned into cost models by a scaled roofline.

For a model with ``N`` parameters, ``W`` weight bytes and ``kv`` KV bytes per token,
a catalog chip with peak ``F`` FLOP/s and memory bandwidth ``BW`` becomes a
:class:`~dlbatch.solver.profile.ChipProfile` with

* prefill (per chunk): ``a = prefill_overhead_s + W / (BW * bw_eff)`` (one weight read),
  ``b = 2N / (F * mfu_eff)``, ``c = 4 * layers * heads * head_dim / (F * mfu_eff)``
  — i.e. time per token = flops_per_token / (F * mfu_eff);
* decode (per step): ``a = W / (BW * bw_eff) + decode_overhead_s`` (weight read),
  ``b = 2N / (F * mfu_eff)`` (the batch's dense compute, added rather than overlapped:
  a conservative choice that only matters where decode turns compute-bound, e.g.
  CPUs or very large batches), ``c = kv / (BW * bw_eff)`` (KV read per context token).

The efficiencies default to the values in the catalog's ``defaults`` section and can
be replaced by those achieved on a measured chip (:func:`calibrate`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dlbatch.solver.profile import ChipProfile, CostModel, ModelSpec, ProfileError

DEFAULT_CATALOG = Path(__file__).resolve().parents[2] / "configs" / "chips" / "catalog.yaml"

_NUM_FIELDS = ("bf16_tflops", "memory_gb", "memory_gbps", "interconnect_gbps", "kv_link_gbps", "price_per_hour")
_EFF_FIELDS = ("mfu_eff", "bw_eff", "decode_overhead_s", "prefill_overhead_s", "mem_util")


@dataclass(frozen=True)
class CatalogEntry:
    """One chip's datasheet figures (units as in ``configs/chips/catalog.yaml``)."""

    name: str
    bf16_tflops: float
    memory_gb: float
    memory_gbps: float
    interconnect_gbps: float
    kv_link_gbps: float
    price_per_hour: float
    source: str
    price_source: str = ""
    mfu_eff: float = 0.5
    bw_eff: float = 0.7
    decode_overhead_s: float = 0.002
    prefill_overhead_s: float = 0.005
    mem_util: float = 0.9
    calibrated_from: str = ""
    device: str = "cuda"  # the torch device kind its workers run on (a pool's `device`)

    def __post_init__(self) -> None:
        for key in _NUM_FIELDS:
            v = getattr(self, key)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or v < 0 or (key != "price_per_hour" and v == 0):
                raise ValueError(f"catalog chip {self.name!r}: {key} must be a positive number, got {v!r}")
        for key in ("mfu_eff", "bw_eff", "mem_util"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not (0 < v <= 1):
                raise ValueError(f"catalog chip {self.name!r}: {key} must be in (0, 1], got {v!r}")
        for key in ("decode_overhead_s", "prefill_overhead_s"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"catalog chip {self.name!r}: {key} must be >= 0, got {v!r}")
        if not isinstance(self.device, str) or not self.device.isidentifier():
            raise ValueError(f"catalog chip {self.name!r}: device must be a device kind such as cuda or cpu, "
                             f"got {self.device!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"catalog chip {self.name!r}: a non-empty 'source' is required")

    @property
    def peak_flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def mem_bw(self) -> float:
        return self.memory_gbps * 1e9

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def kv_link_bw(self) -> float:
        return self.kv_link_gbps * 1e9


def load_catalog(path: str | Path | None = None) -> dict[str, CatalogEntry]:
    """Read a catalog YAML file (default: ``configs/chips/catalog.yaml``)."""
    import yaml

    p = Path(path) if path is not None else DEFAULT_CATALOG
    if not p.is_file():
        raise ProfileError(f"catalog file not found: {str(p)!r}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ProfileError(f"{p}: not valid YAML: {e}") from e
    if not is_catalog_document(data):
        raise ProfileError(f"{p}: a catalog needs a 'chips' mapping at top level")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ProfileError(f"{p}: key 'defaults' must be a mapping, got {defaults!r}")
    unknown = set(defaults) - set(_EFF_FIELDS)
    if unknown:
        raise ProfileError(f"{p}: unknown key(s) in 'defaults': {sorted(unknown)}")
    out: dict[str, CatalogEntry] = {}
    for name, raw in data["chips"].items():
        where = f"{p}: chips.{name}"
        if not isinstance(raw, dict):
            raise ProfileError(f"{where} must be a mapping, got {raw!r}")
        allowed = set(_NUM_FIELDS) | set(_EFF_FIELDS) | {"source", "price_source", "device"}
        unknown = set(raw) - allowed
        if unknown:
            raise ProfileError(f"{where}: unknown key(s) {sorted(unknown)}")
        missing = [k for k in (*_NUM_FIELDS, "source") if k not in raw]
        if missing:
            raise ProfileError(f"{where}: missing key(s) {missing}")
        kw: dict[str, Any] = {**defaults, **raw}
        try:
            out[str(name)] = CatalogEntry(name=str(name), **kw)
        except (TypeError, ValueError) as e:
            raise ProfileError(f"{where}: {e}") from e
    return out


def is_catalog_document(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("chips"), dict)


def to_profile(entry: CatalogEntry, model: ModelSpec) -> ChipProfile:
    """The roofline cost model of ``entry`` running ``model`` (see module docstring)."""
    F = entry.peak_flops * entry.mfu_eff
    BW = entry.mem_bw * entry.bw_eff
    weight_read = model.weight_bytes / BW
    prefill = CostModel(
        a=entry.prefill_overhead_s + weight_read,
        b=model.dense_flops_per_token / F,
        c=model.attn_flops_per_token_ctx / F,
    )
    decode = CostModel(
        a=weight_read + entry.decode_overhead_s,
        b=model.dense_flops_per_token / F,
        c=model.kv_bytes_per_token / BW,
    )
    return ChipProfile(
        name=entry.name,
        source="catalog",
        memory_bytes=entry.memory_bytes * entry.mem_util,
        mem_bw=entry.mem_bw,
        kv_link_bw=entry.kv_link_bw,
        price_per_hour=entry.price_per_hour,
        prefill=prefill,
        decode=decode,
        peak_flops=entry.peak_flops,
        model=model.name,
    )


def measured_efficiencies(measured: ChipProfile, model: ModelSpec) -> dict[str, float]:
    """Achieved MFU and bandwidth efficiency of a measured profile for ``model``.

    * MFU: the prefill per-token coefficient ``b`` is the dense time per token, so the
      achieved FLOP/s is ``2N / b`` and ``mfu = 2N / (b * peak_flops)``.
    * bandwidth efficiency: the decode constant ``a`` is the time of a step whose work
      is one weight read, so ``bw_eff = W / (a * mem_bw)``. Per-step overhead is folded
      in (a calibrated entry therefore gets ``decode_overhead_s = 0``).
    Both are clipped to (0, 1].
    """
    if measured.peak_flops is None:
        raise ValueError(f"calibrate: measured profile {measured.name!r} has no peak_flops; "
                         "measure the matmul peak (dlbatch profile does) or set peak_flops")
    _, b_pre, _ = measured.prefill.as_tuple()
    a_dec, _, _ = measured.decode.as_tuple()
    if b_pre <= 0:
        raise ValueError(f"calibrate: measured profile {measured.name!r} has prefill b = {b_pre!r}; "
                         "need a positive per-token prefill cost to infer MFU")
    if a_dec <= 0:
        raise ValueError(f"calibrate: measured profile {measured.name!r} has decode a = {a_dec!r}; "
                         "need a positive per-step decode cost to infer bandwidth efficiency")
    mfu = model.dense_flops_per_token / (b_pre * measured.peak_flops)
    bw_eff = model.weight_bytes / (a_dec * measured.mem_bw)
    return {"mfu_eff": float(min(1.0, max(mfu, 1e-6))), "bw_eff": float(min(1.0, max(bw_eff, 1e-6)))}


def calibrate(entry: CatalogEntry, measured: ChipProfile, model: ModelSpec) -> ChipProfile:
    """Apply the efficiencies achieved by ``measured`` (a profiled chip running ``model``)
    to the catalog chip ``entry`` and return its profile for ``model``.

    The assumption is that the software stack that reached a given fraction of peak on
    the measured chip reaches the same fraction on the catalog chip.
    """
    eff = measured_efficiencies(measured, model)
    calibrated = replace(entry, mfu_eff=eff["mfu_eff"], bw_eff=eff["bw_eff"],
                         decode_overhead_s=0.0, calibrated_from=measured.name)
    return to_profile(calibrated, model)


def catalog_profiles(model: ModelSpec, path: str | Path | None = None,
                     names: list[str] | None = None) -> dict[str, ChipProfile]:
    """Profiles of every (or the named) catalog chip for ``model``."""
    cat = load_catalog(path)
    if names is not None:
        unknown = [n for n in names if n not in cat]
        if unknown:
            raise ValueError(f"unknown catalog chip(s) {unknown}; known: {sorted(cat)}")
        cat = {n: cat[n] for n in names}
    return {n: to_profile(e, model) for n, e in cat.items()}

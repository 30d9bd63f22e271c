"""``router:``, ``batching:``, ``retries:``, ``cluster:`` — how the job runs (not what it outputs)."""
from __future__ import annotations

import re
from typing import Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from dlbatch.jobspec.inputs import STRICT


class RouterSpec(BaseModel):
    model_config = STRICT

    policy: Literal["prefix_aware", "round_robin", "least_loaded"] = "prefix_aware"
    window: int = Field(256, ge=1)
    # prefix: documents reach the router grouped by shared prompt prefix across all the driver
    # holds of the input (dlbatch/router/order.py); input: in input order
    order: Literal["prefix", "input"] = "prefix"


class BatchingSpec(BaseModel):
    model_config = STRICT

    max_batch_tokens: int = Field(8192, ge=1)
    max_inflight_batches: int = Field(16, ge=1)
    # a batch (its wait behind others on its worker included) not back after this long is
    # failed and its worker restarted: one hung batch cannot stall the job
    batch_timeout_s: float = Field(900.0, gt=0)


class RetriesSpec(BaseModel):
    model_config = STRICT

    max_attempts: int = Field(3, ge=1)


class PoolSpec(BaseModel):
    model_config = STRICT

    chip: str = Field(min_length=1)
    replicas: int = Field(1, ge=1)
    device: str = Field("cpu", pattern=r"^[a-z][a-z0-9_]*(:[0-9]+)?$")
    num_cpus: float = Field(1.0, ge=0.0)
    num_gpus: float = Field(0.0, ge=0.0)
    # per worker: bytes ('8GiB', 8e9) or a fraction of the device's free memory (0.4, '40%');
    # null: the engine's default (on CUDA: num_gpus' share of the device, see accelerators.md)
    kv_cache_memory: Optional[Union[int, float, str]] = None

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_kv_memory(cls, value):
        if value is not None:
            from dlbatch.engine.config import parse_kv_memory

            parse_kv_memory(value)  # raises naming the value
        return value

    @model_validator(mode="after")
    def _check_device(self):
        check_pool_device(self.device, self.num_gpus)
        return self


class PrefillPoolSpec(PoolSpec):
    """The prefill pool of a job naming prefill/decode pools (its chip defaults to ``fast``)."""

    chip: str = Field("fast", min_length=1)


class DecodePoolSpec(PoolSpec):
    """The decode pool of a job naming prefill/decode pools (its chip defaults to ``cheap``)."""

    chip: str = Field("cheap", min_length=1)


def check_pool_device(device: str, num_gpus: float) -> None:
    """A CUDA pool must ask Ray for GPUs (Ray then sets each worker's CUDA_VISIBLE_DEVICES,
    renumbering its GPUs from 0): ``cuda:N`` must index the worker's own GPUs."""
    if not device.startswith("cuda"):
        return
    if num_gpus <= 0:
        raise ValueError(f"device {device!r} needs num_gpus > 0 (Ray reserves GPUs only for pools that ask; "
                         "e.g. num_gpus: 1, or 0.5 for two workers on one GPU)")
    idx = device.partition(":")[2]
    have = max(1, int(num_gpus))
    if idx and int(idx) >= have:
        raise ValueError(f"device {device!r} with num_gpus={num_gpus:g}: each worker sees its own GPU(s) as "
                         f"cuda:0..cuda:{have - 1} (Ray sets CUDA_VISIBLE_DEVICES); use 'cuda'")


_HOST_PORT_RE = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$")


class ClusterSpec(BaseModel):
    """Where the workers run. The pools are the job's own when it names them (``colocated``,
    or ``prefill`` with ``decode``: exactly those), a plan file's (``plan: <path>``, a
    named pool of a role lending its device and resources to the plan's pool of that role),
    or else the layout the solver picks from the cluster's chips (`dlbatch.driver.layout`):
    `pools()` is then empty and `mode` ``"auto"``."""

    model_config = STRICT

    address: Optional[str] = None
    plan: Optional[str] = None
    prefill: Optional[PrefillPoolSpec] = None
    decode: Optional[DecodePoolSpec] = None
    colocated: Optional[PoolSpec] = None
    # what the solver's layout optimises: documents/s per dollar-hour (cost) or documents/s
    objective: Literal["cost", "throughput"] = "cost"
    # a document's first token within this many seconds of its prefill starting (the layout's
    # estimate, docs/solver.md); null: no latency target
    ttft_target_s: Optional[float] = Field(None, gt=0)
    kv_transport: Literal["auto", "object_store", "shm", "rdt", "dlslime"] = "auto"
    # dlslime endpoints may listen off loopback (DLBATCH_DLSLIME_IP): whoever reaches one can
    # read and write the worker's memory (docs/transfer.md); off by default
    dlslime_allow_network: bool = False

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: Optional[str]) -> Optional[str]:
        if value is None or value == "auto" or value.startswith("ray://") or _HOST_PORT_RE.match(value):
            return value
        raise ValueError(
            f"{value!r} is not a Ray address; use null (embedded local Ray), 'auto', "
            "'ray://host:port' or 'host:port'"
        )

    @field_validator("plan")
    @classmethod
    def _check_plan(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not value.strip():
            raise ValueError("must be null, 'auto' or the path to a plan JSON, got ''")
        return value

    @model_validator(mode="after")
    def _check_pools(self):
        if self.colocated is None and (self.prefill is None) != (self.decode is None):
            named, other = ("prefill", "decode") if self.decode is None else ("decode", "prefill")
            raise ValueError(f"cluster.{named} is named without cluster.{other}: prefill and decode pools come as a "
                             f"pair (name both, or cluster.colocated, or no pool at all: the solver picks)")
        if self.plan == "auto" and self.pools():
            raise ValueError(f"cluster.plan 'auto' lets the solver pick the pools, but the job names "
                             f"{'/'.join(self.pools())} pools: drop cluster.plan (the named pools run) or the pools")
        return self

    @property
    def mode(self) -> str:
        """``"colocated"`` when ``colocated`` is set (it replaces prefill/decode),
        ``"disaggregated"`` for prefill/decode pools, ``"auto"`` when the job names none."""
        if self.colocated is not None:
            return "colocated"
        return "disaggregated" if self.prefill is not None else "auto"

    @property
    def layout_source(self) -> str:
        """Who decides the pools: ``"job"`` (named pools), ``"plan"`` (a plan file) or ``"solver"``."""
        if self.plan not in (None, "auto"):
            return "plan"
        return "job" if self.pools() else "solver"

    def pools(self) -> dict[str, PoolSpec]:
        """The worker pools this cluster section names, by role ({} when the solver picks)."""
        if self.colocated is not None:
            return {"colocated": self.colocated}
        if self.prefill is not None:
            return {"prefill": self.prefill, "decode": self.decode}
        return {}

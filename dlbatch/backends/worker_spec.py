"""What a worker needs to build its engine (`WorkerSpec`), and the engine configuration a
backend derives from a job's model section and one pool of the run (`engine_config`).

A `WorkerSpec` is made on the driver, once per pool, by the backend class the job names
(`EngineBackend.worker_spec`), and is shipped to every worker of that pool; the worker
builds its backend from it (`dlbatch.backends.make_backend`). It is frozen: what a worker
runs with is decided before it starts. Its ``engine.max_model_len`` is always the run's
resolved context length (`dlbatch.driver.config.RunConfig`), never left to an engine's
own default.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dlbatch.engine.config import EngineConfig


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its engine: the model, the engine configuration (one
    object, `EngineConfig`, with the engine's defaults), and how it talks to the others."""

    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    backend: str = "dlbatch"  # the registry name of the backend class that runs the model (dlbatch/backends)
    engine_args: dict = field(default_factory=dict)  # the backend's own engine arguments (vLLM's EngineArgs)
    chat: bool | None = None
    num_threads: int = 1
    storage_options: dict | None = None
    kv_transport: str = "object_store"  # how prefill workers hand KV to decode workers
    kv_timeout_s: float = 120.0  # longest wait for a KV transfer (put, receive) before it fails
    # LoRA adapters (dlbatch/backends/lora.py): (name, folder or Hub id) pairs, resolved by the
    # worker; the engine mixes up to max_loras of them, of rank up to max_lora_rank
    adapters: tuple = ()
    max_loras: int = 0
    max_lora_rank: int = 0


def engine_config(model, pool, max_model_len: int, max_batch_tokens: int, own: dict | None = None) -> EngineConfig:
    """The engine configuration of a worker of ``pool`` (a job's pool section) for the job's
    ``model`` section: the job's values where it sets them, ``own`` (engine_args that are
    `EngineConfig` fields) over them, the engine's defaults (`EngineConfig`) everywhere else.
    The engine's prefill chunk follows the router's batch size (``max_batch_tokens``): one
    batch's prompts in a few steps, at least 512 and at most 4096 tokens a step."""
    base = dict(kv_cache_memory=pool.kv_cache_memory, max_num_batched_tokens=max(512, min(max_batch_tokens, 4096)))
    return EngineConfig(dtype=model.dtype, device=pool.device, max_model_len=max_model_len,
                        device_share=pool.num_gpus if 0 < pool.num_gpus < 1 else 1.0, **{**base, **(own or {})})

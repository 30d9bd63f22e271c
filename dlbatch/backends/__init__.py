"""Engine backends behind one interface (base.py): dlbatch's own engine (native.py, every
role, prefill/decode disaggregation included) and vLLM (vllm_backend.py, colocated). A
job picks one with ``model.backend``; workers build it with `make_backend`."""
from __future__ import annotations

from dlbatch.backends.base import BackendUnavailable, EngineBackend

BACKENDS = ("dlbatch", "vllm")
ROLES = {"dlbatch": ("colocated", "prefill", "decode"), "vllm": ("colocated",)}

__all__ = ["BACKENDS", "ROLES", "BackendUnavailable", "EngineBackend", "check_job", "make_backend",
           "unavailable_reason"]


def unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run in this environment, or None."""
    if name == "dlbatch":
        return None
    if name == "vllm":
        from dlbatch.backends.vllm_backend import unavailable_reason as why

        return why()
    return f"unknown backend {name!r}; backends: {', '.join(BACKENDS)}"


def check_job(spec) -> None:
    """Before a job runs: its backend is installed, its engine_args are the backend's own and
    the backend runs the model's architecture; else a ValueError that names the problem."""
    m = spec.model
    why = unavailable_reason(m.backend)
    if why:
        raise BackendUnavailable(why)
    if m.backend == "vllm":
        from dlbatch.backends.vllm_backend import check_engine_args
        from dlbatch.engine.loader import context_length, load_hf_config

        check_engine_args(dict(m.engine_args))
        limit = context_length(load_hf_config(m.ref))
        if m.max_model_len and m.max_model_len > limit:
            raise ValueError(f"model.max_model_len {m.max_model_len} exceeds the context of {m.ref!r} ({limit} "
                             "tokens, its config.json)")
    else:
        from dlbatch.engine.loader import load_model_config

        load_model_config(m.ref)  # an architecture our engine does not run is refused, naming vLLM


def make_backend(spec, role: str, device: str) -> EngineBackend:
    """The backend ``spec.backend`` for a worker of ``role`` on ``device``."""
    if spec.backend == "dlbatch":
        from dlbatch.backends.native import NativeBackend

        return NativeBackend(spec, role, device)
    if spec.backend == "vllm":
        from dlbatch.backends.vllm_backend import VllmBackend

        return VllmBackend(spec, role, device)
    raise BackendUnavailable(unavailable_reason(spec.backend) or spec.backend)

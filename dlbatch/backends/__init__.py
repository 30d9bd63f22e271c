"""Engine backends behind one interface (base.py) and their registry.

`REGISTRY` maps a job's ``model.backend`` to the class that runs it: dlbatch's own engine
(native.py: every role, prefill/decode disaggregation included) and vLLM (vllm_backend.py:
colocated). The job schema's backend names are the registry's keys, and everything that
depends on the backend (its checks, its context length, its worker configuration, which
roles it fills) is asked of the class, so no other package names a backend. Importing this
package imports no engine: vLLM and torch are imported inside the methods that need them.
Workers build their backend with `make_backend`.
"""
from __future__ import annotations

from dlbatch.backends.base import BackendUnavailable, DisaggregatedBackend, EngineBackend, ModelLimits
from dlbatch.backends.native import NativeBackend
from dlbatch.backends.vllm_backend import VllmBackend
from dlbatch.backends.worker_spec import WorkerSpec

REGISTRY: dict[str, type[EngineBackend]] = {cls.name: cls for cls in (NativeBackend, VllmBackend)}
DEFAULT_BACKEND = NativeBackend.name  # what a job without model.backend runs

__all__ = ["DEFAULT_BACKEND", "REGISTRY", "BackendUnavailable", "DisaggregatedBackend", "EngineBackend",
           "ModelLimits", "WorkerSpec", "backend_class", "make_backend"]


def backend_class(name: str) -> type[EngineBackend]:
    """The registered backend class called ``name``; an unknown name is an error naming the
    known ones."""
    cls = REGISTRY.get(name)
    if cls is None:
        raise BackendUnavailable(f"unknown backend {name!r}; backends: {', '.join(REGISTRY)}")
    return cls


def make_backend(spec: WorkerSpec, role: str, device: str) -> EngineBackend:
    """The backend ``spec.backend`` for a worker of ``role`` on ``device``."""
    return backend_class(spec.backend)(spec, role, device)

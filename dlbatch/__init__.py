"""dlbatch: batch LLM inference for long documents.

Two entries: jobs (`run`, `load`, `RunResult`: dlbatch/api.py) and the engine alone (`LLM`,
`SamplingParams`, `RequestOutput`). Heavy modules (torch, ray) are imported lazily so that
`dlbatch --help` is instant.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["run", "load", "RunResult", "LLM", "SamplingParams", "RequestOutput", "__version__"]


def __getattr__(name: str):
    if name in ("run", "load", "RunResult"):
        from dlbatch import api

        return getattr(api, name)
    if name == "LLM":
        from dlbatch.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dlbatch.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from dlbatch.engine.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'dlbatch' has no attribute {name!r}")

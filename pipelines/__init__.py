"""Named pipelines, selected by `pipeline:` in a job file. A job file can only choose one
of these registered names: it never supplies code."""
from __future__ import annotations

import importlib

REGISTRY = {
    "papers": "pipelines.papers",
    "jsonl_prompts": "pipelines.papers",
}


def get_pipeline(name: str):
    if name not in REGISTRY:
        raise ValueError(f"pipeline {name!r} is not registered; choose one of {', '.join(sorted(REGISTRY))}")
    return importlib.import_module(REGISTRY[name])

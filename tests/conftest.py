"""Shared fixtures: one local Ray for the whole test session, bound to 127.0.0.1, with the
chip resources the sample jobs name."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")


@pytest.fixture(scope="session")
def ray_local():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, resources={"chip:fast": 4, "chip:cheap": 4},
                 include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def sample_model():
    """Make sure the bundled GGUF is converted once (cache) before workers start."""
    from dlbatch.engine.loader import model_dir

    model_dir("smollm2-135m-instruct")
    return "smollm2-135m-instruct"

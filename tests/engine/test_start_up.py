"""The engine's start-up on a device, run here on the CPU with the CUDA memory calls mocked:
the KV budget of each engine from its own share (two engines in one process), the start-up
forward (engine/profile.py) and the fallback from a device op that fails to compile."""
from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dlbatch.engine.config import EngineConfig, ModelConfig
from dlbatch.engine.device import DEFAULT_CUDA_KV_FRACTION, kv_cache_bytes
from dlbatch.engine.engine import LLMEngine
from dlbatch.engine.model_runner import ModelRunner

GB = 1 << 30
MCONF = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 1000, "hidden_size": 2048, "intermediate_size": 8192,
                             "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                             "max_position_embeddings": 8192})


class FakeDevice:
    """torch.cuda's memory calls over one simulated 80 GB device shared by engines."""

    def __init__(self, total=80 * GB):
        self.total, self.allocated = total, 0

    def mem_get_info(self, device=None):
        return self.total - self.allocated, self.total

    def memory_allocated(self, device=None):
        return self.allocated


def _start_engine(dev: FakeDevice, weights: int, activations: int, share: float = 1.0,
                  kv_cache_memory=None) -> int:
    """What LLMEngine.__init__ does on CUDA, with the device simulated: weights loaded,
    start-up forward (its peak is freed again), KV blocks sized and allocated. -> bytes of KV."""
    before = dev.memory_allocated()
    dev.allocated += weights
    own = dev.memory_allocated() - before + activations
    fake = SimpleNamespace(config=EngineConfig(device="cuda", device_share=share, kv_cache_memory=kv_cache_memory,
                                               max_model_len=4096), mconf=MCONF)
    blocks = LLMEngine._num_blocks(fake, torch.bfloat16, torch.device("cuda"), own)
    kv = blocks * ModelRunner.bytes_per_block(MCONF, 16, torch.bfloat16)
    dev.allocated += kv
    return kv


@pytest.fixture
def device(monkeypatch):
    dev = FakeDevice()
    monkeypatch.setattr(torch.cuda, "mem_get_info", dev.mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_allocated", dev.memory_allocated)
    return dev


def test_two_engines_in_one_process_each_get_their_share(device):
    a = _start_engine(device, weights=2 * GB, activations=3 * GB, share=0.5)
    b = _start_engine(device, weights=2 * GB, activations=3 * GB, share=0.5)
    want = 0.5 * DEFAULT_CUDA_KV_FRACTION * 80 * GB - 5 * GB
    assert abs(a - want) < 64 << 20 and abs(b - want) < 64 << 20  # each its half, less its own
    assert device.allocated + 3 * GB <= 0.86 * device.total  # both fit, with the activations' peak


def test_a_second_full_share_engine_gets_what_is_left_not_zero(device):
    a = _start_engine(device, weights=2 * GB, activations=3 * GB)
    b = _start_engine(device, weights=2 * GB, activations=3 * GB)
    assert a > 50 * GB
    assert 0 < b <= 0.95 * (80 * GB - a - 4 * GB)  # the free memory, not the first engine's holdings subtracted


def test_the_activation_peak_is_left_free(device):
    small = _start_engine(FakeDevice(), weights=2 * GB, activations=0)
    big = _start_engine(device, weights=2 * GB, activations=10 * GB)
    assert abs((small - big) - 10 * GB) < 64 << 20


def test_kv_cache_memory_settings_still_rule():
    assert kv_cache_bytes(5 * GB, free=40 * GB, total=80 * GB, own=9 * GB) == 5 * GB
    assert kv_cache_bytes(0.5, free=40 * GB, total=80 * GB, own=9 * GB) == 20 * GB
    assert kv_cache_bytes(None, free=1 * GB, total=80 * GB, own=9 * GB) == int(0.95 * GB)


def test_too_little_memory_names_the_numbers(device):
    device.allocated = int(79.6 * GB)  # another process holds the device
    with pytest.raises(ValueError, match=r"holds \d+ blocks .* needs 256; raise kv_cache_memory"):
        _start_engine(device, weights=int(0.3 * GB), activations=0)


# ------------------------------------------------------------- the start-up forward
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny") / "m")
    make_tiny_model("llama", path)
    return path


def _model(path, config):
    from dlbatch.engine.loader import load_model
    from dlbatch.engine.model import Transformer
    from dlbatch.engine.ops import get_ops

    loaded = load_model(path)
    config = config.for_model(loaded.config)
    return Transformer(loaded.config, loaded.weights, get_ops("cpu"), torch.float32, torch.device("cpu"),
                       config.max_model_len), loaded.config, config


def test_start_up_forward_runs_the_largest_step_and_leaves_nothing(tiny):
    from dlbatch.engine.profile import profile_forward

    model, mconf, config = _model(tiny, EngineConfig(dtype="float32", max_model_len=256, max_num_batched_tokens=64))
    calls = []
    real = model.forward
    model.forward = lambda ids, *a, **k: calls.append(ids.shape[0]) or real(ids, *a, **k)
    assert profile_forward(model, mconf, config, torch.float32) == 0  # CPU: no device memory to measure
    assert calls == [64]  # one forward of max_num_batched_tokens tokens


def test_a_device_op_that_fails_to_compile_falls_back_with_one_warning(tiny, caplog):
    from dlbatch.engine.ops.resolve import OpFailed, guarded
    from dlbatch.engine.profile import start_up_forward

    model, mconf, config = _model(tiny, EngineConfig(dtype="float32", max_model_len=256, max_num_batched_tokens=32))

    class CompilationError(Exception):  # what Triton raises for a kernel it cannot build
        pass

    def broken(*a, **k):
        raise CompilationError("at 12:4: unsupported layout")

    model.ops = replace(model.ops, rms_norm=guarded("rms_norm", broken), chosen={**model.ops.chosen, "rms_norm": "cuda"})
    with pytest.raises(OpFailed, match="op rms_norm failed: CompilationError"):
        model.ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
    with caplog.at_level(logging.WARNING, logger="dlbatch.engine"):
        peak, ops, overrides = start_up_forward(model, mconf, config, torch.float32, "cpu", None)
    assert overrides == {"rms_norm": "reference"} and ops.chosen["rms_norm"] == "reference" and model.ops is ops
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "rms_norm" in warned[0] and "CompilationError" in warned[0]


def test_running_out_of_memory_is_not_a_kernel_failure():
    from dlbatch.engine.ops.resolve import guarded

    def oom(*a):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        guarded("prefill_attention", oom)()

"""The accelerator path's plain functions, without a GPU: KV memory sizing, device strings
under Ray's CUDA_VISIBLE_DEVICES renumbering, pool validation, kv_transport=auto from the
workers' reports, CUDA-graph buckets, and block tables derived from a step's metadata."""
from __future__ import annotations

import pytest
import torch

from dlbatch.engine.config import parse_kv_memory
from dlbatch.engine.device import DEFAULT_CUDA_KV_FRACTION, kv_cache_bytes, resolve_device

GiB = 1 << 30


def test_parse_kv_memory_bytes_and_fractions():
    assert parse_kv_memory("2GiB") == 2 * GiB
    assert parse_kv_memory(8_000_000_000) == 8_000_000_000
    assert parse_kv_memory(0.4) == 0.4 and isinstance(parse_kv_memory(0.4), float)
    assert parse_kv_memory("40%") == pytest.approx(0.4)
    assert parse_kv_memory("0.25") == 0.25
    assert parse_kv_memory(None) is None
    for bad in ("150%", "1.5", -0.5, "lots", True):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            parse_kv_memory(bad)


def test_kv_cache_bytes_default_leaves_room_for_a_second_worker():
    total, free = 140 * GiB, 120 * GiB
    one = kv_cache_bytes(None, free, total, own=3 * GiB, share=1.0)
    assert one == min(int(free * 0.95), int(total * DEFAULT_CUDA_KV_FRACTION) - 3 * GiB)
    half = kv_cache_bytes(None, free, total, own=3 * GiB, share=0.5)
    assert half == int(total * DEFAULT_CUDA_KV_FRACTION * 0.5) - 3 * GiB
    # the second worker, started after the first took its half (+ its weights), still fits
    free2 = free - half - 3 * GiB
    second = kv_cache_bytes(None, free2, total, own=3 * GiB, share=0.5)
    assert second == half and second + 3 * GiB < free2
    assert kv_cache_bytes(0.5, free, total) == free // 2  # a fraction is of the free memory
    assert kv_cache_bytes(4 * GiB, free, total) == 4 * GiB
    with pytest.raises(ValueError, match="fraction"):
        kv_cache_bytes(1.5, free, total)


def test_resolve_device_under_ray_renumbering():
    assert resolve_device("cpu", None, 0) == "cpu"
    assert resolve_device("cuda", "3", 1) == "cuda:0"
    assert resolve_device("cuda:0", "3", 1) == "cuda:0"
    # cuda:1 in a job file, Ray gave this actor physical GPU 1 only: it is local cuda:0
    assert resolve_device("cuda:1", "1", 1) == "cuda:0"
    assert resolve_device("cuda:1", "0,1", 2) == "cuda:1"
    with pytest.raises(ValueError, match=r"'cuda:2'.*sees 1 CUDA device"):
        resolve_device("cuda:2", "1", 1)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        resolve_device("cuda", "", 0)


def test_pool_spec_checks_device_against_num_gpus():
    from pydantic import ValidationError

    from dlbatch.jobspec import PoolSpec

    assert PoolSpec(chip="g", device="cuda", num_gpus=0.5, kv_cache_memory="40%").kv_cache_memory == "40%"
    assert PoolSpec(chip="g", device="cuda:1", num_gpus=2).device == "cuda:1"
    with pytest.raises(ValidationError, match="needs num_gpus > 0"):
        PoolSpec(chip="g", device="cuda:0")
    with pytest.raises(ValidationError, match=r"'cuda:1' with num_gpus=1.*cuda:0..cuda:0"):
        PoolSpec(chip="g", device="cuda:1", num_gpus=1)
    with pytest.raises(ValidationError, match="kv_cache_memory"):
        PoolSpec(chip="g", kv_cache_memory="2 bananas")


def test_auto_transport_is_decided_from_the_workers():
    from dlbatch.transfer.choose import auto_from_workers

    gpu = {"device": "cuda:0", "cuda": True, "rdt": None}
    assert auto_from_workers([gpu, gpu])[0] == "rdt"
    assert auto_from_workers([gpu, {"device": "cpu", "cuda": False, "rdt": "a CPU worker"}])[0] == "object_store"
    name, why = auto_from_workers([gpu, {"device": "cuda:0", "cuda": True, "rdt": "nccl missing"}])
    assert name == "object_store" and "nccl missing" in why
    assert auto_from_workers([])[0] == "object_store"


def test_probe_reports_a_cpu_worker():
    from dlbatch.workers.actors import probe_device

    info = probe_device("cpu")
    assert info["device"] == "cpu" and info["rdt"]


def test_graph_buckets():
    from dlbatch.engine.cuda_graph import batch_buckets, pick_bucket

    b = batch_buckets(64)
    assert b == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(3) == [1, 2, 3]
    assert pick_bucket(b, 5) == 8 and pick_bucket(b, 64) == 64 and pick_bucket(b, 65) is None


def test_fused_reference_ops_equal_the_unfused_math():
    """add_rms_norm / rotary_store_kv (reference) are the old two-op sequences exactly, so
    the CPU path is unchanged by the model using them."""
    from dlbatch.engine.ops import reference as R

    g = torch.Generator().manual_seed(0)
    x, h, w = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(8, generator=g)
    out, h2 = R.add_rms_norm(x, h, w, 1e-6)
    assert torch.equal(h2, h + x) and torch.equal(out, R.rms_norm(h + x, w, 1e-6))
    q, k, v = torch.randn(2, 2, 4, generator=g), torch.randn(2, 1, 4, generator=g), torch.randn(2, 1, 4, generator=g)
    cos, sin = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    kc, vc = torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4)
    q2, k2 = R.rotary_store_kv(q, k, v, cos, sin, kc, vc, torch.tensor([3, 0]))
    wq, wk = R.rotary(q, k, cos, sin)
    assert torch.equal(q2, wq) and torch.equal(k2, wk)
    assert torch.equal(kc.view(-1, 1, 4)[3], wk[0]) and torch.equal(vc.view(-1, 1, 4)[0], v[1])


def test_cuda_ops_register_only_with_triton():
    from dlbatch.engine.ops import cuda, registry, resolve

    resolve._load_builtin()
    registered = {n for (n, dev) in registry._IMPLS if dev == "cuda"}
    assert registered == (set(cuda.IMPLS) if cuda.AVAILABLE else set())
    assert set(resolve.get_ops("cpu").chosen.values()) <= {"reference", "cpu"}  # CUDA kernels stay on CUDA



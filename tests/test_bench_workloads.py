"""The steady-state workload bench's arithmetic (dlbatch/bench/workloads.py): a side's
generation floor from its token counts and the measured limits, the medians of interleaved
runs. The bench itself runs in tests/test_bench.py (slow)."""
import pytest

from dlbatch.bench.workloads import generation_floor, median_side, model_counts

LIMITS = {"matmul": {"float32": {"flops": 1e9}, "bfloat16": {"flops": 2e9}}, "copy": {"copy_GBps": 1.0}}


def test_floor_counts_the_matmuls_of_what_the_side_computed_and_its_decode_kv_reads():
    counts = {"linear_params": 1000, "lm_head_params": 100, "kv_bytes_per_token": 8, "compute_dtype": "bfloat16"}
    side = {"prompt_tokens": 10_000, "cached_tokens": 2_000, "output_tokens": 500}
    f = generation_floor(counts, side, rows=100, limits=LIMITS)
    # 8,000 prompt tokens computed + 400 generated tokens fed back, the LM head for all 500
    assert f["flops"] == 2 * 1000 * (8_000 + 400) + 2 * 100 * 500
    assert f["matmul_s"] == pytest.approx(f["flops"] / 2e9)  # the compute dtype's peak
    # 400 decode rows, each reading its context: 100 prompt tokens + half the 5 outputs
    assert f["kv_bytes"] == pytest.approx(400 * 102.5 * 8)
    assert f["kv_s"] == pytest.approx(f["kv_bytes"] / 1e9)
    assert f["floor_s"] == pytest.approx(f["matmul_s"] + f["kv_s"])
    more_cached = generation_floor(counts, {**side, "cached_tokens": 6_000}, rows=100, limits=LIMITS)
    assert more_cached["matmul_s"] < f["matmul_s"]
    assert generation_floor(counts, {"wall_s": 3.0}, rows=100, limits=LIMITS) is None  # the peer: no counts


def test_model_counts_from_the_bundled_models_config(sample_model):
    c = model_counts(sample_model, "float32")
    # SmolLM2-135M: 30 layers of hidden 576, 9 query and 3 KV heads of 64, MLP 1536; vocabulary 49,152
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    assert c["linear_params"] == 30 * per_layer and c["lm_head_params"] == 49_152 * 576
    assert c["kv_bytes_per_token"] == 2 * 30 * 192 * 4 and c["compute_dtype"] == "float32"


def test_median_side_takes_the_median_run_and_keeps_every_run():
    runs = [{"wall_s": 3.0, "generation_s": 2.0, "prompt_tokens": 7}, {"wall_s": 1.0, "generation_s": 1.0},
            {"error": "boom"}, {"wall_s": 2.0, "generation_s": 5.0, "prompt_tokens": 9}]
    s = median_side(runs)
    assert s["wall_s"] == 2.0 and s["prompt_tokens"] == 9  # the run of median wall time
    assert s["generation_s"] == 2.0  # the median of the generation phases, not that run's
    assert [r["wall_s"] for r in s["runs"]] == [3.0, 1.0, None, 2.0] and s["runs"][2]["error"] == "boom"
    two = median_side([{"wall_s": 4.0, "generation_s": 3.0}, {"wall_s": 2.0, "generation_s": 1.0}])
    assert two["wall_s"] == 3.0 and two["generation_s"] == 2.0
    assert median_side([{"error": "x"}, {"error": "y"}]) == {"error": "x"}
    assert "runs" not in median_side([{"wall_s": 1.0}])

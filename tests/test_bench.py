"""Smoke runs of the benchmarks with tiny settings: every figure is in the JSON and the
ratios are computed from the measured numbers. (Speed targets are checked by the
benchmarks themselves, never as timed tests.)"""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from dlbatch.bench import run_bench


def _bench(name: str, argv: list[str], tmp_path) -> dict:
    out = tmp_path / f"{name}.json"
    rc = run_bench(SimpleNamespace(name=name, rest=argv + ["--json", str(out)]))
    assert rc == 0
    return json.loads(out.read_text())


def _close(a, b, rel=1e-9):
    return a is not None and b is not None and math.isclose(a, b, rel_tol=rel)


def _check_limits(lim: dict, dtypes):
    for d in dtypes:
        m = lim["matmul"][d]
        assert m["flops"] > 0 and _close(m["flops"], 2.0 * m["n"] ** 3 / m["seconds"])
    c = lim["copy"]
    assert c["copy_GBps"] > 0 and _close(c["copy_GBps"], 2 * c["bytes"] / c["seconds"] / 1e9)


def test_common_helpers():
    from dlbatch.bench.common import fmt, median, ratio, table

    assert median([3, 1, 2]) == 2 and median([1, 2, 3, 4]) == 2.5
    assert ratio(6, 3) == 2 and ratio(1, 0) is None and ratio(None, 1) is None
    t = table(["a", "b"], [["x", 1.5], ["yy", None]])
    assert "x" in t and "1.5" in t and "-" in t
    assert fmt(True) == "yes" and fmt(2.0e9) == "2e+09"


def test_flop_and_byte_counts():
    from dlbatch.bench.roofline import decode_bytes, prefill_flops

    cnt = {"linear_params": 100, "lm_head_params": 10, "layers": 2, "heads": 3, "head_dim": 4,
           "weight_bytes": 1000, "kv_bytes_per_token": 8}
    assert prefill_flops(cnt, 5) == 2 * 100 * 5 + 2 * 10 + 4 * 2 * 3 * 4 * 25 / 2
    assert decode_bytes(cnt, 3, 10) == 1000 + 3 * 10 * 8


def test_random_llama_helper_tiny_shape(tmp_path):
    """The llama-1b-random helper, at a tiny shape: our engine and transformers both load it."""
    import torch
    from transformers import AutoModelForCausalLM

    from dlbatch.bench.engine import RANDOM_MODELS, make_random_llama
    from dlbatch.engine.llm import LLM
    from dlbatch.engine.sampling_params import SamplingParams

    shape = RANDOM_MODELS["llama-1b-random"]
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"],
            shape["num_key_value_heads"], shape["intermediate_size"], shape["vocab_size"]) == \
        (2048, 16, 32, 8, 8192, 128256) and shape["tie_word_embeddings"]
    d = make_random_llama(str(tmp_path / "m"), dtype="float32", hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                          head_dim=16, max_position_embeddings=256)
    llm = LLM(d, dtype="float32", max_model_len=128, chat=False)
    ours = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                             pad_token_id=0)[0, 4:].tolist()
    assert ours == theirs


def test_engine_bench_smoke(tmp_path):
    from tests.helpers.tiny_models import make_tiny_model

    path = str(tmp_path / "tiny")
    make_tiny_model("llama", path)
    r = _bench("engine", ["--model", path, "--dtype", "float32", "--quick", "--repeats", "2",
                          "--prefill-lens", "64,128", "--decode-batches", "1,2", "--decode-context", "64",
                          "--decode-tokens", "4"], tmp_path)
    assert r["model"]["ours_compute_dtype"] == "float32" and r["baseline"]["dtype"] == "float32"
    assert r["model"]["kv_cache_prefault"]["bytes"] > 0  # written before timing, as transformers' memory is
    _check_limits(r["limits"], ["float32"])
    peak = r["limits"]["matmul"]["float32"]["flops"]
    bw = r["limits"]["copy"]["copy_GBps"] * 1e9
    assert [p["tokens"] for p in r["prefill"]] == [64, 128]
    for p in r["prefill"]:
        assert p["ours_tokens_per_s"] > 0 and p["theirs_tokens_per_s"] > 0
        assert _close(p["ours_tokens_per_s"], p["tokens"] / p["ours_s"])
        assert _close(p["ratio"], p["ours_tokens_per_s"] / p["theirs_tokens_per_s"])
        assert _close(p["ours_frac_peak"], p["flops"] / p["ours_s"] / peak)
    assert [d["batch"] for d in r["decode"]] == [1, 2]
    for d in r["decode"]:
        assert d["ours_tokens_per_s"] > 0 and d["theirs_tokens_per_s"] > 0 and d["ours_steps"] >= 1
        assert _close(d["ours_tokens_per_s"], d["batch"] / d["ours_step_s"])
        assert _close(d["ratio"], d["ours_tokens_per_s"] / d["theirs_tokens_per_s"])
        assert _close(d["ours_frac_bw"], d["bytes_per_step"] / d["ours_step_s"] / bw)
    assert {t["target"] for t in r["targets"]} and all("met" in t for t in r["targets"])
    so = r["step_overhead"]
    assert so["batch"] == 64 and so["context"] == 4096
    assert min(so["new_meta_s"], so["new_step_s"], so["legacy_meta_s"], so["legacy_step_s"]) > 0
    (t,) = [t for t in r["targets"] if t["target"].startswith("step metadata")]
    assert _close(t["value"], so["new_meta_s"] * 1e3)
    tiny = so["tiny_model"]  # --quick: 4 sequences x 256 tokens on the tiny random model
    assert (tiny["batch"], tiny["context"]) == (4, 256) and tiny["step_s"] > 0 and tiny["steps"] >= 1
    assert _close(tiny["limit_s"], tiny["kv_bytes"] / bw) and tiny["kv_bytes"] > 4 * 256 * 2 * 2 * 16 * 4
    (t,) = [t for t in r["targets"] if t["target"].startswith("tiny-model decode step")]
    assert _close(t["value"], tiny["step_s"] * 1e3) and t["met"] == (tiny["step_s"] <= 10e-3)


def test_step_overhead_legacy_prepare_agrees():
    """The baseline of the step-overhead line computes the same ids, positions and slots."""
    import torch

    from dlbatch.bench.step_overhead import _setup, legacy_prepare

    class M:
        device, dtype, config = torch.device("cpu"), torch.float32, None

        class ops:
            chosen = {"paged_decode_attention": "cpu", "prefill_attention": "reference"}

    from dlbatch.engine.config import ModelConfig

    mconf = ModelConfig("llama", 50, 16, 32, 1, 2, 1, 8)
    sched, runner = _setup(M, mconf, batch=5, context=70, steps=3)
    out = sched.schedule()
    new, old = runner.prepare(out), legacy_prepare(runner, out)
    for a, b in ((new[0], old[0]), (new[1], old[1]), (new[2].slots, old[2].slots), (new[3], old[3])):
        assert a.tolist() == b.tolist()


def test_dtype_linear_figures_come_from_the_timings(tmp_path, capsys):
    """The dtype table's bench: one row per row count, each path's GFLOP/s its summed
    FLOPs over its summed median times, and the JSON holding the same figures."""
    from dlbatch.bench import dtype_linear

    out = tmp_path / "dt.json"
    res = dtype_linear.main(["--rows", "1,3", "--min-s", "0", "--json", str(out)])
    assert [r["m"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        assert r["flops"] == 2 * r["m"] * sum(n * k for n, k in dtype_linear.SHAPES)
        assert set(r["gflops"]) == set(dtype_linear.PATHS)
        for p in dtype_linear.PATHS:
            assert r["seconds"][p] > 0 and _close(r["gflops"][p], r["flops"] / r["seconds"][p] / 1e9)
    assert set(res["square_2048_gflops"]) == {"float32", "bfloat16"}
    assert json.loads(out.read_text())["rows"][1]["gflops"] == res["rows"][1]["gflops"]
    assert "bfloat16 oneDNN packed" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--rows"):
        dtype_linear.main(["--rows", "0"])


@pytest.mark.slow
@pytest.mark.ray
def test_pipeline_bench_smoke(tmp_path, sample_model):
    r = _bench("pipeline", ["--quick", "--set", "model.dtype=float32"], tmp_path)
    o, b = r["ours"], r["baseline"]
    assert o["docs"] == 1 and b["docs"] == 1 and o["rows"] == 3 and b["rows"] == 3
    for side in (o, b):
        assert side["wall_s"] > 0 and side["tokens_per_s"] > 0
    assert _close(r["ratio"]["tokens_per_s"], o["tokens_per_s"] / b["tokens_per_s"])
    assert _close(r["ratio"]["docs_per_s"], o["docs_per_s"] / b["docs_per_s"])
    assert b["prompt_tokens"] == o["prompt_tokens"]  # the same rendered prompts on both sides
    a = r["agreement_fp32"]
    assert a["requests"] == 3 and a["all_identical"], a["pairs"]
    _check_limits(r["limits"], ["float32"])


@pytest.mark.slow
@pytest.mark.ray
def test_pipeline_shared_prefix_workload_smoke(tmp_path, sample_model):
    """--workload shared-prefix --quick: every row answered on both layouts of our engine; the
    prefill tokens computed are counted against the ideal, the peer column is skipped, saying why."""
    r = _bench("pipeline", ["--workload", "shared-prefix", "--quick", "--set", "model.dtype=float32"], tmp_path)
    assert r["rows"] == 12 and r["ideal_prefill_tokens"] > 0
    for k in ("ours", "ours_pd"):
        s = r["sides"][k]
        assert s["wall_s"] > 0 and s["prompt_tokens"] >= r["ideal_prefill_tokens"], s
        assert s["prompt_tokens"] - s["cached_tokens"] >= r["ideal_prefill_tokens"] * 0.9  # nothing computed twice is free
        assert 0 < s["floor"]["floor_s"] < s["generation_s"], s  # the floor is a bound, below what was measured
    assert "skipped" in r["sides"]["peer"] and "skipped" in r["sides"]["ours_vllm"]
    _check_limits(r["limits"], ["float32"])


@pytest.mark.slow
@pytest.mark.ray
def test_pipeline_long_bench_smoke(tmp_path, sample_model):
    """chunk vs truncate on the shortest long sample paper: chunk reaches all of it."""
    r = _bench("pipeline", ["--long", "--quick", "--set", "model.dtype=float32"], tmp_path)
    t, c = r["truncate"], r["chunk"]
    assert t["rows"] == c["rows"] == 3
    (paper,) = t["share_reached"]
    assert t["share_reached"][paper] < 0.5 and c["share_reached"][paper] == 1.0
    assert c["chunks"] >= 4 and c["prefill_tokens_computed"] > t["prefill_tokens_computed"]
    assert _close(r["ratio"]["wall"], c["wall_s"] / t["wall_s"])
    assert c["long_inputs"]["documents"] == {"chunk": 1} and t["long_inputs"]["documents"] == {"truncate": 1}
    _check_limits(r["limits"], ["float32"])


@pytest.mark.slow
@pytest.mark.ray
def test_router_bench_smoke(tmp_path, sample_model):
    r = _bench("router", ["--quick", "--set", "model.dtype=float32"], tmp_path)
    s = r["summary"]
    for pol in ("prefix_aware", "round_robin"):
        x = s[pol]
        assert x["docs_ok"] == 2 and x["prompt_tokens"] > 0
        assert _close(x["compute_fraction"], x["prefill_tokens_computed"] / x["prompt_tokens"])
    assert _close(r["tokens_per_s_ratio"], s["prefix_aware"]["tokens_per_s"] / s["round_robin"]["tokens_per_s"])
    assert r["outputs"]["identical"] == r["outputs"]["compared"] == 6
    assert s["prefix_aware"]["compute_fraction"] <= s["round_robin"]["compute_fraction"]
    assert len(r["targets"]) == 4


@pytest.mark.ray
def test_bench_kv_small(ray_local, tmp_path):
    """bench kv end to end on small sizes and a tiny model's streamed prefill: ratios are
    the measured figures divided by the memcpy measured in the same run."""
    from tests.helpers.tiny_models import make_tiny_model

    model = str(tmp_path / "tiny")
    make_tiny_model("llama", model)
    res = _bench("kv", ["--sizes-mb", "8", "--repeats", "1", "--overlap-tokens", "200", "--overlap-model", model],
                 tmp_path)
    row = res["sizes"][str(8 << 20)]
    base = row["memcpy_gbps"]["numpy_copyto"]
    for name in ("shm", "object_store"):
        r = row["transports"][name]
        assert r["median_gbps"] > 0 and _close(r["ratio_to_memcpy"], r["median_gbps"] / base)
        assert len(r["times_s"]) == 2
    assert row["ray_put_alone_gbps"] > 0 and row["receive_alone_gbps"] > 0
    o = res["overlap"]
    assert o["tokens"] == 200 and o["kv_bytes"] > 0
    for name in ("shm", "object_store"):
        t = o["transports"][name]
        assert 0.0 <= t["hidden_fraction"] <= 1.0 and t["transfer_alone_s"] > 0
        assert _close(t["hidden_fraction"], max(0.0, 1 - t["exposed_s"] / t["transfer_alone_s"]))
    assert {t["transport"] for t in res["targets"] if "transport" in t} == {"shm", "object_store"}
    (os_t,) = [t for t in res["targets"] if t.get("transport") == "object_store"]
    assert _close(os_t["ceiling_ray_put_alone"], row["ray_put_alone_gbps"] / base)
    assert os_t["ceiling_below_target"] == (os_t["ceiling_ray_put_alone"] < 0.7)


@pytest.mark.slow
@pytest.mark.ray
def test_scale_bench_quick(tmp_path, capsys):
    """`dlbatch bench scale --quick`: 200 documents through `dlbatch run` (and 20 for the RSS
    growth), the no-op rerun, status, the Ray Data baseline and the pyarrow limit; every figure
    printed and in the JSON."""
    r = _bench("scale", ["--quick"], tmp_path)
    printed = capsys.readouterr().out
    o, small, b, lim = r["ours"], r["ours_small"], r["baseline"], r["limit"]
    assert r["docs"] == o["docs"] == 200 and small["docs"] == 20
    for side in (o, small):  # (20 documents can come back in one batch: no generation phase to time)
        assert side["peak_rss_bytes"] > 0 and side["docs_per_s_e2e"] > 0
        assert _close(side["docs_per_s_e2e"], side["docs"] / side["wall_s"])
    assert _close(o["docs_per_s_generation"], 200 / o["generation_s"])
    assert r["noop_s"] > 0 and r["status_s"] > 0
    assert _close(b["docs_per_s_pipeline"], 200 / b["pipeline_s"]) and b["docs_per_s_e2e"] > 0
    assert _close(lim["docs_per_s"], 200 / lim["wall_s"])
    assert [t["met"] is not None for t in r["targets_met"]] == [True] * 7
    assert r["files"] == 1 and 0 < o["first_batch_s"] < o["wall_s"]
    assert o["prompt_rss_bytes"] > 0 and o["runs"][0]["prompt_actors"] >= 1  # the prompt actors were found
    for line in ("generation phase", "end to end", "baseline Ray Data", "limit (pyarrow", "driver peak RSS",
                 "no-op rerun", "dlbatch status", "RSS growth", "first batch", "prompt-actor peak RSS", "PASS"):
        assert line in printed, line

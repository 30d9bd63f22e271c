"""The paper workload against peer engines (dlbatch/bench/peers.py, peer_runner.py): the
prompts, the peer runner's JSON protocol, skipping a peer that cannot run, the F32 GGUF
export, and the comparison figures. CI has no peer installed: a real vLLM / llama.cpp
run is the benchmark's business (docs/benchmarks.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from dlbatch.bench import peers
from dlbatch.bench.peer_runner import check_request


@pytest.fixture
def bare_python(tmp_path):
    """An executable python that cannot import site-packages (so neither vllm nor llama_cpp)."""
    p = tmp_path / "python"
    p.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    p.chmod(0o755)
    return str(p)


def test_peer_skipped_when_path_missing(tmp_path):
    found, reason = peers.detect_peer(str(tmp_path / "no-venv" / "bin" / "python"))
    assert found == [] and "is not an executable file" in reason and "no-venv" in reason


def test_peer_skipped_when_it_cannot_import_a_backend(bare_python):
    found, reason = peers.detect_peer(bare_python)
    assert found == []
    assert "cannot import vllm or llama_cpp" in reason and "No module named 'vllm'" in reason


def test_runner_detect_reports_each_backend(bare_python):
    p = subprocess.run([bare_python, peers.RUNNER, "--detect"], capture_output=True, text=True, timeout=60)
    info = json.loads(p.stdout)
    assert info["backends"] == {"vllm": None, "llama_cpp": None}
    assert set(info["errors"]) == {"vllm", "llama_cpp"}


def test_runner_protocol_round_trip(bare_python, tmp_path):
    """Request file in, result file out, read back by the bench: a backend that does not
    import and a bad request both come back as errors naming the cause."""
    req = {"backend": "llama_cpp", "model": "/m.gguf", "prompts": [[1, 2, 3], [1, 2, 4]], "max_tokens": 4,
           "threads": 2, "max_model_len": 64, "warmup": [5, 6]}
    for request, expect in ((req, "No module named 'llama_cpp'"),
                            ({**req, "backend": "tgi"}, "backend must be one of"),
                            ({**req, "prompts": [[1, -2]]}, "prompt 0 must be")):
        rq, rs = tmp_path / "req.json", tmp_path / "res.json"
        rq.write_text(json.dumps(request))
        p = subprocess.run([bare_python, peers.RUNNER, str(rq), str(rs)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 1
        res = peers.read_result(str(rs), p.returncode, p.stderr, request["backend"])
        assert expect in res["error"] and res["backend"] == request["backend"]
    res = peers.read_result(str(tmp_path / "missing.json"), 137, "Killed", "vllm")
    assert "exited 137 without a result" in res["error"] and "Killed" in res["error"]


def test_read_result_accepts_outputs_and_rejects_malformed(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"backend": "vllm", "version": "x", "outputs": [[1, 2]], "wall_s": 1.5,
                                "load_s": 2.0}))
    assert peers.read_result(str(good), 0, "", "vllm")["outputs"] == [[1, 2]]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"backend": "vllm", "outputs": "oops"}))
    assert "malformed result" in peers.read_result(str(bad), 0, "", "vllm")["error"]


def test_check_request_names_the_bad_field():
    ok = {"backend": "vllm", "model": "/d", "prompts": [[1]], "max_tokens": 1, "threads": 1, "max_model_len": 8}
    check_request(ok)
    for bad, name in (({"max_tokens": 0}, "max_tokens"), ({"threads": True}, "threads"), ({"prompts": []}, "prompts"),
                      ({"model": ""}, "model")):
        with pytest.raises(ValueError, match=name):
            check_request({**ok, **bad})


def test_agreement_counts():
    a = peers.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 9, 7, 8]])
    assert a["identical_seqs"] == 1 and a["tokens_equal"] == 7 and a["tokens"] == 8
    assert a["tokens_equal_frac"] == 7 / 8
    with pytest.raises(ValueError, match="1 outputs for 2 prompts"):
        peers.agreement([[1], [2]], [[1]])


def test_paper_prompts_share_each_paper_and_are_distinct(sample_model):
    reqs = peers.paper_prompts("jobs/papers.yaml", prefix_tokens=384, max_tokens=8, limit=3)
    assert len(reqs) == 9 and [r["task"] for r in reqs[:3]] == ["summary", "keywords", "question"]
    ids = [tuple(r["ids"]) for r in reqs]
    assert len(set(ids)) == 9 and all(len(i) <= 384 for i in ids)
    shared = peers.shared_prefixes(reqs)
    assert len(shared) == 3
    for i in range(0, 9, 3):
        # the paper (cut to fit) is the shared prefix; only the instruction differs
        assert shared[reqs[i]["paper"]] >= min(len(x) for x in ids[i:i + 3]) - 24
    # different papers share only the chat template's opening (its default system message)
    cross = peers.common_prefix(ids[0], ids[3])
    assert cross < 64 and cross < shared[reqs[0]["paper"]] // 4


def test_lower_bound_arithmetic():
    cnt = {"linear_params": 100, "lm_head_params": 10, "layers": 1, "heads": 1, "head_dim": 1,
           "weight_bytes": 1000, "kv_bytes_per_token": 10}
    lim = {"matmul": {"float32": {"flops": 1e3}}, "copy": {"copy_GBps": 1e-6}}  # 1,000 B/s
    lb = peers.lower_bound(cnt, [[1, 2, 3, 4], [1, 2, 3, 5]], max_tokens=3, lim=lim)
    # prompt 1: 4 tokens from 0; prompt 2: shares 3 -> 1 token at position 3
    flops = (2 * 100 * 4 + 2 * 10 + 4 * 4 * 2) + (2 * 100 * 1 + 2 * 10 + 4 * 1 * 3.5)
    assert lb["prefill_flops"] == flops and lb["prefill_s"] == flops / 1e3
    step = max((1000 + 2 * (4 + 1.5) * 10) / 1000, 2 * 110 * 2 / 1e3)
    assert lb["decode_step_s"] == pytest.approx(step) and lb["decode_s"] == pytest.approx(2 * step)


def test_f32_gguf_keeps_metadata_and_dequantises_every_tensor(tmp_path):
    np = pytest.importorskip("numpy")
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import dequantize, quantize

    src, dst = str(tmp_path / "q.gguf"), str(tmp_path / "f32.gguf")
    rng = np.random.default_rng(0)
    w = GGUFWriter(src, "llama")
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c"])
    w.add_token_scores([0.0, -1.0, -2.0])
    w.add_file_type(3)  # MOSTLY_Q4_1
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("blk.0.attn_q.weight", quantize(q, GGMLQuantizationType.Q4_1), raw_dtype=GGMLQuantizationType.Q4_1)
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    peers._write_f32_gguf(src, dst)
    a, b = GGUFReader(src), GGUFReader(dst)
    assert b.fields["general.file_type"].contents() == 0
    for key in ("general.architecture", "llama.block_count", "tokenizer.ggml.model", "tokenizer.ggml.tokens",
                "tokenizer.ggml.scores"):
        assert b.fields[key].contents() == a.fields[key].contents()
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert set(ta) == set(tb)
    for name, t in tb.items():
        assert t.tensor_type == GGMLQuantizationType.F32 and list(t.shape) == list(ta[name].shape)
        ref = np.asarray(dequantize(ta[name].data, ta[name].tensor_type), dtype=np.float32).reshape(-1)
        np.testing.assert_array_equal(np.asarray(t.data).reshape(-1), ref)


def test_papers_bench_quick_with_a_missing_peer(tmp_path, sample_model):
    """Ours runs the (tiny) paper workload; the missing peer is a skipped column, the bench
    goes on, and the target says no peer ran."""
    from dlbatch.bench import run_bench

    out = tmp_path / "p.json"
    missing = str(tmp_path / "nowhere" / "python")
    rc = run_bench(SimpleNamespace(name="engine", rest=["--quick", "--peer-python", missing, "--json", str(out)]))
    assert rc == 0
    r = json.loads(out.read_text())
    (col,) = r["peers"]
    assert "not an executable file" in col["skipped"]
    ours = r["ours"]
    n = len(r["workload"]["prompts"])
    assert n == 6 and len(ours["outputs"]) == n and all(len(o) == 4 for o in ours["outputs"])
    assert ours["output_tokens_per_s"] == pytest.approx(n * 4 / ours["wall_s"])
    # 4 tokens: the first from the prefill, then at most 3 steps in which all 6 decode
    assert 1 <= ours["decode_steps"] <= 3 and 0 < ours["decode_step_s"] < ours["wall_s"]
    assert ours["kv_cache_bytes_prefaulted"] > 0  # its cache written before timing, as the peers' at start-up
    assert r["target"]["value"] is None and r["target"]["met"] is None
    assert 0 < r["lower_bound"]["total_s"] and r["ours_frac_of_lower_bound"] > 0
    assert os.path.exists(peers.RUNNER)

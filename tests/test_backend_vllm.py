"""The vLLM backend (`model.backend: vllm`, dlbatch/backends/vllm_backend.py) under the whole
pipeline: the same rows as our engine, map-reduce, structured columns, dead letters, a driver
and a worker killed, and an architecture our engine does not run. Needs vLLM in this
environment (`make setup-vllm`; CI installs it): skipped, with the reason, without it.

vLLM's CPU start-up (its import and engine set-up) costs ~35 s per worker, so the jobs here
are few and small; they run eager (``enforce_eager``) as the README's CPU notes advise for
short jobs, the bench measures the default.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dlbatch.backends import REGISTRY
from dlbatch.jobspec import load_job
from tests.helpers.jobs import (REPO, SEQ, canon, check_committed, cli_sets, committed_parts, kill_group_and_ray,
                                output_rows, ray_env, run_until_inflight, start_run)

WHY = REGISTRY["vllm"].unavailable_reason()
pytestmark = [pytest.mark.ray, pytest.mark.skipif(WHY is not None, reason=WHY or "")]

# the sample job reduced: 3 papers, fp32 (the exactness claims are fp32 ones), a 2k context,
# every task's max_tokens set (the CLI helpers' SHORT settings come first and are replaced)
REDUCED = ["input.limit=3", "model.dtype=float32", "model.max_model_len=2048", "tasks.0.max_tokens=64",
           "tasks.1.max_tokens=32", "tasks.2.max_tokens=48"]
VLLM = ["model.backend=vllm", "cluster.colocated.chip=fast", "cluster.colocated.num_cpus=1",
        "model.engine_args.enforce_eager=true"]


def _run(job, out, sets, **kw):
    from dlbatch.driver.runner import JobRunner

    spec = load_job(job, [f"output.path={out}", *sets])
    return JobRunner(spec, progress=False, **kw).run()


@pytest.fixture(scope="module")
def ours(ray_local, sample_model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ours") / "out")
    _run("jobs/papers.yaml", out, REDUCED)
    return canon(output_rows(out))


@pytest.fixture(scope="module")
def theirs(ray_local, sample_model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("vllm") / "out")
    rep = _run("jobs/papers.yaml", out, [*REDUCED, *VLLM])
    return rep, output_rows(out)


def test_sample_job_rows_token_identical_to_our_engine(ours, theirs):
    rep, rows = theirs
    assert len(ours) == 9 and rep["docs_ok"] == 3 and rep["docs_failed"] == 0
    assert canon(rows) == ours  # text, prompt/output token counts, finish reasons
    assert {r["model"] for r in rows} == {"smollm2-135m-instruct"}
    assert rep["backend"] == "vllm" and rep["prefix_cache_hit_tokens"] > 0  # the tasks shared each paper


# ------------------------------------------- map-reduce, a JSON-schema column, dead letters
@pytest.fixture(scope="module")
def features(ray_local, sample_model, tmp_path_factory):
    """One vLLM job over a long sample paper and a broken and an empty PDF, with a free-text
    task chunked (map-reduce), a JSON-schema task and a choices task (both truncating)."""
    import yaml

    d = tmp_path_factory.mktemp("features")
    inp = d / "in"
    inp.mkdir()
    shutil.copy(os.path.join(REPO, "samples/papers/long_context_batch_serving.pdf"), inp / "long.pdf")
    (inp / "broken.pdf").write_bytes(b"%PDF-1.7\nthis is not a PDF body at all\n")
    (inp / "empty.pdf").write_bytes(b"")
    record = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["title", "year"]}
    job = {"name": "vllm_features", "pipeline": "papers", "input": {"format": "pdf", "path": str(inp)},
           "output": {"path": str(d / "out")},
           "model": {"name": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 768},
           "tasks": [{"name": "summary", "prompt": "{{ text }}\n\nSummarize this paper in one sentence.",
                      "max_tokens": 16, "long_inputs": "chunk"},
                     {"name": "record", "prompt": "{{ text }}\n\nGive the paper's title and year as JSON.",
                      "max_tokens": 48, "output": {"json_schema": record}},
                     {"name": "kind", "prompt": "{{ text }}\n\nIs this paper theoretical, empirical or a survey?",
                      "max_tokens": 8, "output": {"choices": ["theoretical", "empirical", "survey"]}}],
           "long_inputs": "truncate", "chunking": {"map_max_tokens": 24, "overlap_tokens": 16}}
    path = d / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    rep = _run(str(path), str(d / "out"), [*VLLM, "max_dead_letter_fraction=1"])  # 2 of 3 inputs bad on purpose
    from dlbatch.output.parquet_store import ParquetStore

    store = ParquetStore(str(d / "out"))
    return rep, store.results(), store.errors().to_pylist()


def test_long_paper_is_chunked_mapped_and_reduced(features):
    rep, table, _ = features
    rows = {r["task"]: r for r in table.to_pylist() if r["source"].endswith("long.pdf")}
    assert sorted(rows) == ["kind", "record", "summary"]
    s = rows["summary"]
    assert s["long_input_policy"] == "chunk" and s["chunks"] >= 3 and s["output"], s
    assert rows["record"]["long_input_policy"] == "truncate" and rows["record"]["truncated"]


def test_json_schema_task_fills_its_typed_column(features):
    import pyarrow as pa

    _, table, _ = features
    t = table.schema.field("record_json").type
    assert pa.types.is_struct(t) and "title" in [f.name for f in t]
    rec = next(r for r in table.to_pylist() if r["task"] == "record")
    kind = next(r for r in table.to_pylist() if r["task"] == "kind")
    assert kind["valid"] and kind["output"] in ("theoretical", "empirical", "survey")
    if rec["finish_reason"] == "stop":  # complete: the constraint held, the column is typed
        assert rec["valid"] and isinstance(rec["record_json"]["title"], str)
    else:  # cut by max_tokens: not valid, said so
        assert rec["valid"] is False and "max_tokens" in rec["output_error"]


def test_broken_files_are_dead_letters_and_the_job_goes_on(features):
    rep, table, errors = features
    bad = {os.path.basename(e["source"]): e for e in errors}
    assert set(bad) == {"broken.pdf", "empty.pdf"}, errors
    assert all(e["stage"] == "parse" and e["error"] for e in bad.values())
    assert rep["docs_ok"] == 1 and rep["docs_failed"] == 2


# ------------------------------------------------------------------------- faults
@pytest.mark.slow
def test_driver_kill9_then_resume_exactly_once(ours, tmp_path, raytmp):
    job, extra = "jobs/papers.yaml", [*REDUCED, *VLLM, *SEQ]
    out = str(tmp_path / "out")
    with open(tmp_path / "run1.log", "wb") as logf:
        proc = start_run(job, out, extra, raytmp, logf)
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not committed_parts(out):
            time.sleep(0.1)
        finished = proc.poll() == 0
        kill_group_and_ray(proc, raytmp)
    rows, _ = check_committed(out, job, extra, raytmp)
    assert finished or 0 < len(rows) < 9, (tmp_path / "run1.log").read_text()[-3000:]
    with open(tmp_path / "run2.log", "wb") as logf:
        rc = start_run(job, out, extra, raytmp, logf).wait(timeout=900)
    assert rc == 0, (tmp_path / "run2.log").read_text()[-3000:]
    rows, st = check_committed(out, job, extra, raytmp)
    assert canon(rows) == ours and st["complete"]  # every (paper, task) once, as our engine wrote it
    r = subprocess.run([sys.executable, "-m", "dlbatch.cli", "run", job, "--no-progress", *cli_sets(out, extra)],
                       cwd=REPO, env=ray_env(raytmp), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr[-2000:]


def test_worker_kill9_mid_batch_job_completes(ray_local, ours, tmp_path):
    out = str(tmp_path / "out")
    runner, t, box = run_until_inflight(load_job("jobs/papers.yaml", [f"output.path={out}", *REDUCED, *VLLM]))
    pid = ray_local.get(runner.workers["colocated"][0].ping.remote(), timeout=120)["pid"]
    time.sleep(0.5)  # inside its first batch
    os.kill(pid, signal.SIGKILL)
    t.join(timeout=900)
    assert not t.is_alive() and "error" not in box, box
    rep = box["report"]
    assert rep["retries"]["worker"] >= 1 and rep["docs_ok"] == 3 and rep["docs_failed"] == 0
    assert canon(output_rows(out)) == ours  # the restarted worker's rows equal an uninterrupted run's


# ----------------------------------------------------- an architecture our engine does not run
@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model

    path = str(tmp_path_factory.mktemp("gemma2") / "model")
    model = make_tiny_model("gemma2", path)
    return path, model


def test_gemma2_runs_a_job_end_to_end_and_matches_transformers(ray_local, gemma, tmp_path):
    import json

    import torch

    from dlbatch.engine.loader import load_tokenizer

    path, model = gemma
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": f"note {i}: " + "tide fog wind " * (3 + i)}) + "\n"
                           for i in range(3)))
    out = str(tmp_path / "out")
    sets = [f"input.path={src}", "input.id_field=id", f"model.name={path}", "model.dtype=float32", "model.chat=false",
            "model.max_model_len=512",
            "tasks.0.max_tokens=6", "tasks.1.max_tokens=6", "tasks.2.max_tokens=6", *VLLM]
    rep = _run("jobs/papers_jsonl.yaml", out, sets)
    rows = output_rows(out)
    assert rep["docs_ok"] == 3 and len(rows) == 9
    # the request our prompt stage makes for d0's first task, and transformers' greedy answer to it
    from tests.helpers.stage import prompt_stage

    spec = load_job("jobs/papers_jsonl.yaml", [f"output.path={out}", *sets])
    req = next(q for q in prompt_stage(spec).process({"doc_id": "d0", "source": str(src), "text": "note 0: "
                                                      + "tide fog wind " * 3}) if q["task"] == "summary")
    ids = list(req["prompt_ids"])
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    tok = load_tokenizer(path)
    r = next(r for r in rows if r["doc_id"] == "d0" and r["task"] == "summary")
    assert r["prompt_tokens"] == len(ids)
    assert r["output"] == tok.decode([t for t in ref if t not in tok.eos_token_ids])


def test_our_engine_refuses_gemma2_naming_the_vllm_backend(gemma, tmp_path):
    from dlbatch.driver.config import RunConfig

    spec = load_job("jobs/papers_jsonl.yaml", [f"output.path={tmp_path / 'o'}", f"model.name={gemma[0]}"])
    with pytest.raises(ValueError, match=r"gemma2.*model.backend: vllm"):
        RunConfig.resolve(spec)


# ------------------------------------------------------------ a model by Hub id, offline
def test_hub_id_from_an_offline_cache_runs_a_job(tmp_path, raytmp):
    """`dlbatch run` (its own local Ray, whose workers inherit HF_HOME) with a Hub id that
    resolves from a cache laid out on disk; the manifest records the commit."""
    import json

    from tests.helpers.hub import add_to_hub_cache
    from tests.helpers.tiny_models import make_tiny_model

    make_tiny_model("llama", str(tmp_path / "m"), overrides={"head_dim": 32})  # a head size vLLM-CPU runs
    home = str(tmp_path / "hf")
    snap = add_to_hub_cache(home, "acme/tiny-llama", str(tmp_path / "m"))
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": "tide fog wind " * (4 + i)}) + "\n" for i in range(2)))
    out = str(tmp_path / "out")
    sets = [f"input.path={src}", "input.id_field=id", "model.name=acme/tiny-llama", "model.revision=main",
            "model.dtype=float32", "model.chat=false", "model.max_model_len=512", *VLLM]
    env = {**ray_env(raytmp), "HF_HOME": home, "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run([sys.executable, "-m", "dlbatch.cli", "run", "jobs/papers_jsonl.yaml", "--no-progress",
                        *cli_sets(out, sets)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = output_rows(out)
    assert len(rows) == 6 and {x["model"] for x in rows} == {"acme/tiny-llama"}
    with open(os.path.join(out, "_manifest.json")) as f:
        fields = json.load(f)["fields"]
    assert fields["model.identity"] == f"hub:acme/tiny-llama@{os.path.basename(snap)}"


# ------------------------------------------------ sampling extras: the same as our engine's
def test_sampling_extras_agree_with_our_engine(tmp_path, monkeypatch):
    """Both backends, in this process, on one tiny fp32 model: the same greedy tokens and
    logprobs (measured: at most 3e-5 apart; the bound is the engines' logits tolerance), the same
    penalized greedy tokens, and the same result structure for n and logprobs; vLLM's sample 0
    of n is its n = 1 output (children seeded seed + i, as ours)."""
    import random
    from types import SimpleNamespace

    import torch

    from dlbatch.backends.native import NativeBackend
    from dlbatch.backends.vllm_backend import VllmBackend
    from dlbatch.engine.config import EngineConfig
    from tests.helpers.tiny_models import VOCAB, make_tiny_model

    path = str(tmp_path / "m")
    make_tiny_model("llama", path, overrides={"head_dim": 32})  # a head size vLLM-CPU runs
    for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
              "OMP_NUM_THREADS"):  # what the backend sets for its process goes back afterwards
        monkeypatch.setenv(k, os.environ.get(k, ""))
        monkeypatch.delenv(k)
    threads = torch.get_num_threads()
    spec = SimpleNamespace(model=path, engine=EngineConfig(dtype="float32", max_model_len=256, max_num_seqs=8),
                           chat=False, storage_options=None, kv_transport="object_store", kv_timeout_s=30,
                           num_threads=2, engine_args={"enforce_eager": True}, adapters={})
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 40))] for _ in range(3)]
    items = [{"request_id": f"g{i}", "token_ids": p, "max_tokens": 8, "ignore_eos": True, "logprobs": 5}
             for i, p in enumerate(prompts)]
    sampled = {"token_ids": prompts[0], "max_tokens": 6, "ignore_eos": True, "temperature": 1.0, "seed": 3,
               "logprobs": 2}
    items += [{**sampled, "request_id": "n3", "n": 3}, {**sampled, "request_id": "n1"},
              {"request_id": "pen", "token_ids": prompts[1], "max_tokens": 10, "ignore_eos": True,
               "repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.7}]

    def run(be):
        keys = {be.add("generate", it): it["request_id"] for it in items}
        done = {}
        while be.has_unfinished():
            done.update((keys[k], r) for k, r in be.step())
        return done

    ours = run(NativeBackend(spec, "colocated", "cpu"))
    try:
        vb = VllmBackend(spec, "colocated", "cpu")
        theirs = run(vb)
        vb.close()
        del vb
    finally:
        torch.set_num_threads(threads)
    for i in range(3):
        a, b = ours[f"g{i}"], theirs[f"g{i}"]
        assert a["output_ids"] == b["output_ids"] and len(a["logprobs"]) == len(b["logprobs"]) == 8
        for x, y in zip(a["logprobs"], b["logprobs"]):
            assert x["token_id"] == y["token_id"] and x["token"] == y["token"]
            assert abs(x["logprob"] - y["logprob"]) < 2e-4
            assert [t["token_id"] for t in x["top"]] == [t["token_id"] for t in y["top"]]
            assert all(abs(p["logprob"] - q["logprob"]) < 2e-4 for p, q in zip(x["top"], y["top"]))
    assert ours["pen"]["output_ids"] == theirs["pen"]["output_ids"]
    for r in (ours, theirs):
        n3, n1 = r["n3"], r["n1"]
        assert set(n3) == set(n1) | {"samples"} and "samples" not in n1 and "logprobs" not in r["pen"]
        assert len(n3["samples"]) == 3 and n3["output_ids"] == n1["output_ids"] == n3["samples"][0]["output_ids"]
        assert all(set(s) == {"output", "output_ids", "output_tokens", "finish_reason", "logprobs"}
                   and len(s["logprobs"]) == s["output_tokens"] == 6 and all(len(e["top"]) == 2 for e in s["logprobs"])
                   for s in n3["samples"])


def test_engine_arg_names_are_read_from_vllms_source_without_importing_it():
    """The driver checks engine_args before workers start: from EngineArgs' source (ms), the
    same names as the dataclass's fields, and vLLM is not imported to get them."""
    code = ("import json, sys; from dlbatch.backends.vllm_backend import engine_arg_names; n = engine_arg_names(); "
            "assert 'vllm.engine.arg_utils' not in sys.modules, 'imported'; print(json.dumps(sorted(n)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    names = json.loads(out.stdout)
    assert names == sorted(f.name for f in dataclasses.fields(EngineArgs))
    assert {"num_gpu_blocks_override", "enforce_eager", "enable_prefix_caching"} <= set(names)

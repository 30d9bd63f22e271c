"""The backend registry and the run's configuration resolved once (`RunConfig`), as plain
objects: no Ray, no engine built (a tiny model's config.json and tokenizer are read)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlbatch.backends import (DEFAULT_BACKEND, REGISTRY, BackendUnavailable, DisaggregatedBackend, EngineBackend,
                              backend_class)
from dlbatch.backends.native import NativeBackend
from dlbatch.backends.vllm_backend import VllmBackend
from dlbatch.driver.config import RunConfig
from dlbatch.engine.config import DEFAULT_MAX_NUM_SEQS
from dlbatch.jobspec import JobSpecError, load_job
from dlbatch.workers.pools import JobFailed

JOB = "jobs/papers_jsonl.yaml"
VLLM = ["model.backend=vllm", "cluster.colocated.chip=fast"]
PD_POOLS = ["cluster.prefill.chip=fast", "cluster.decode.chip=cheap"]


@pytest.fixture(scope="module")
def model_2048(tmp_path_factory):
    """A tiny model whose context (config.json max_position_embeddings) is 2048."""
    from tests.helpers.tiny_models import make_tiny_model

    path = str(tmp_path_factory.mktemp("ctx2048"))
    make_tiny_model("llama", path, overrides={"max_position_embeddings": 2048})
    return path


@pytest.fixture
def job(model_2048, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": "tide fog wind " * 2000}) + "\n" for i in range(2)))

    def load(*sets):
        return load_job(JOB, [f"input.path={src}", "input.id_field=id", f"output.path={tmp_path / 'out'}",
                              f"model.name={model_2048}", "model.max_model_len=null", "model.chat=false",
                              "tasks.0.max_tokens=8", "tasks.1.max_tokens=8", "tasks.2.max_tokens=8", *sets])
    return load


@pytest.fixture
def vllm_installed(monkeypatch):
    """The vLLM class as if vLLM were installed: resolving never imports it (no engine_args)."""
    monkeypatch.setattr(VllmBackend, "unavailable_reason", classmethod(lambda cls: None))


# ------------------------------------------------------------------------------- the registry
def test_the_registry_maps_names_to_backend_classes():
    assert REGISTRY == {"dlbatch": NativeBackend, "vllm": VllmBackend} and DEFAULT_BACKEND == "dlbatch"
    assert all(issubclass(c, EngineBackend) and c.name == n for n, c in REGISTRY.items())
    # a backend that fills the prefill/decode roles implements the declared KV half of the contract
    for cls in REGISTRY.values():
        assert issubclass(cls, DisaggregatedBackend) == ("decode" in cls.roles)
    assert {"rdt_export", "receive_kv", "first_token_result"} <= DisaggregatedBackend.__abstractmethods__
    assert VllmBackend.roles == ("colocated",) and NativeBackend.roles == ("colocated", "prefill", "decode")
    with pytest.raises(BackendUnavailable, match=r"unknown backend 'sglang'; backends: dlbatch, vllm"):
        backend_class("sglang")


def test_the_job_schema_takes_the_registrys_names():
    assert load_job(JOB, ["model.backend=vllm", "cluster.colocated.chip=fast"]).model.backend == "vllm"
    with pytest.raises(JobSpecError, match=r"model.backend: 'sglang' is not one of dlbatch, vllm"):
        load_job(JOB, ["model.backend=sglang"])


def test_importing_the_registry_imports_no_engine():
    code = ("import sys, dlbatch.backends, dlbatch.jobspec; "
            "print(sorted(m for m in ('vllm', 'torch', 'ray', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_engine_args_are_checked_by_the_backend_class():
    with pytest.raises(JobSpecError, match=r"unknown argument\(s\) warp of the dlbatch engine"):
        load_job(JOB, ["model.engine_args.warp=1"])
    # vLLM's own names are vLLM's to check (before a run); the context is never one of them
    with pytest.raises(ValueError, match=r"max_model_len comes from model.max_model_len, not engine_args"):
        from dlbatch.backends.vllm_backend import check_engine_args

        check_engine_args({"max_model_len": 4096})


# ------------------------------------------------------------------ max_model_len, resolved once
def test_the_models_context_reaches_the_stage_the_checks_and_both_backends(job, vllm_installed):
    from tests.helpers.stage import prompt_stage

    for sets in ([], VLLM):
        spec = job(*sets)
        config = RunConfig.resolve(spec)
        assert config.max_model_len == 2048 and "config.json" in config.context_source
        assert config.backend is REGISTRY[spec.model.backend]
        assert {p.worker.engine.max_model_len for p in config.pools.values()} == {2048}
        assert {p.worker.backend for p in config.pools.values()} == {spec.model.backend}
        stage = prompt_stage(spec)
        assert stage.max_model_len == 2048
        rows = stage.process({"doc_id": "d0", "source": "s", "text": "tide fog wind " * 2000})
        assert all(r["truncated"] and len(r["prompt_ids"]) + r["max_tokens"] <= 2048 for r in rows)
        # the checks: at load (the config.json at hand) and at resolve, the same number
        with pytest.raises(JobSpecError, match=r"tasks.0.max_tokens: 2048 leaves no room for a prompt in "
                                               r"max_model_len 2048 \(the model's context"):
            job(*sets, "tasks.0.max_tokens=2048")


def test_the_resolve_checks_budgets_against_the_context_it_reads(job, monkeypatch):
    """A model not at hand at load (its config unread) is checked once the run reads it."""
    import dlbatch.jobspec.load as load

    monkeypatch.setattr(load, "_config_at_hand", lambda model: None)
    spec = job("tasks.1.max_tokens=4000")  # below the cap: loads
    with pytest.raises(JobSpecError, match=r"tasks.1.max_tokens: 4000 leaves no room .* max_model_len 2048"):
        RunConfig.resolve(spec)


def test_an_explicit_context_past_the_models_is_refused_before_the_run(job, vllm_installed):
    for sets in ([], VLLM):
        assert RunConfig.resolve(job(*sets, "model.max_model_len=1024")).max_model_len == 1024
        with pytest.raises(ValueError, match=r"model.max_model_len 4096 exceeds the context of .* \(2048 tokens"):
            RunConfig.resolve(job(*sets, "model.max_model_len=4096"))


def test_worker_specs_carry_each_backends_engine_args(job, vllm_installed, monkeypatch):
    from dlbatch.backends import vllm_backend

    native = RunConfig.resolve(job("model.engine_args.max_num_seqs=8", *PD_POOLS))
    assert set(native.pools) == {"prefill", "decode"} and native.pd
    w = native.pools["decode"].worker
    assert w.engine.max_num_seqs == 8 and w.engine_args == {} and w.model == native.job.model.ref
    monkeypatch.setattr(vllm_backend, "engine_arg_names", lambda: {"enforce_eager"})  # vLLM's names, not imported
    theirs = RunConfig.resolve(job(*VLLM, "model.engine_args.enforce_eager=true"))
    w = theirs.pools["colocated"].worker
    assert w.engine_args == {"enforce_eager": True} and w.engine.max_num_seqs == DEFAULT_MAX_NUM_SEQS and not theirs.pd
    assert w.engine.max_model_len == 2048  # vLLM is always given the run's context


def test_vllm_is_never_left_to_its_own_default_context():
    from dlbatch.backends import WorkerSpec

    with pytest.raises(ValueError, match=r"vLLM backend is given its max_model_len .* is None"):
        VllmBackend(WorkerSpec(model="m", backend="vllm"), "colocated", "cpu")


# ----------------------------------------------------------------------------------- the pools
def test_a_colocated_backend_is_refused_pd_pools_at_resolve(job, vllm_installed):
    plan = {"pools": [{"role": "prefill", "replicas": 1, "chip_resource": "a"},
                      {"role": "decode", "replicas": 2, "chip_resource": "b"}]}
    with pytest.raises(JobFailed, match=r"plan .* has prefill/decode pools, which model.backend vllm cannot run "
                                        r"\(colocated only; docs/backends.md\)"):
        RunConfig.resolve(job(*VLLM), plan)
    config = RunConfig.resolve(job(), plan)  # our engine: the plan's pools on its chips
    assert {r: (p.chip, p.replicas) for r, p in config.pools.items()} == {"prefill": ("a", 1), "decode": ("b", 2)}


def test_an_uninstalled_backend_is_named_before_the_model_is_read(job, monkeypatch):
    monkeypatch.setattr(VllmBackend, "unavailable_reason", classmethod(lambda cls: "vLLM is not installed here"))
    spec = job(*VLLM, "model.name=/nowhere")
    with pytest.raises(BackendUnavailable, match="vLLM is not installed here"):
        RunConfig.resolve(spec)


def test_a_resume_in_half_precision_warns_that_its_rows_may_differ(caplog):
    """Rows generated in bf16 depend on the batch a prompt lands in; a resumed run says so
    (a float32 run does not: it reproduces the tokens)."""
    import logging
    from types import SimpleNamespace

    from dlbatch.driver.runner import _warn_if_not_reproducible

    def config(dtype, device):
        worker = SimpleNamespace(engine=SimpleNamespace(dtype=dtype))
        return SimpleNamespace(pools={"colocated": SimpleNamespace(worker=worker, device=device)})

    with caplog.at_level(logging.WARNING, logger="dlbatch.run"):
        _warn_if_not_reproducible(config("float32", "cpu"), 3)
        assert not caplog.records
        _warn_if_not_reproducible(config("bfloat16", "cuda"), 3)
    assert len(caplog.records) == 1 and "bfloat16" in caplog.text and "float32 reproduces" in caplog.text

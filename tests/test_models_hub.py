"""Models by Hub id (offline, from a Hub cache laid out on disk), a model's identity by content
in the job fingerprint, and the checks of `model.backend` / `model.engine_args` /
`model.revision` (dlbatch/engine/hub.py, dlbatch/backends/__init__.py, dlbatch/jobspec.py)."""
from __future__ import annotations

import os

import pytest

from dlbatch.jobspec import (JobSpecError, ResumeMismatchError, check_resume_compatible, content_fields,
                             fingerprint_fields, load_job)
from tests.helpers.hub import add_to_hub_cache
from tests.helpers.tiny_models import make_tiny_model

REPO_ID = "acme/tiny-llama"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    return path, make_tiny_model("llama", path)


@pytest.fixture
def hub(tmp_path, tiny, monkeypatch):
    """HF_HOME with acme/tiny-llama in its cache; offline."""
    home = str(tmp_path / "hf")
    snap = add_to_hub_cache(home, REPO_ID, tiny[0])
    monkeypatch.setenv("HF_HOME", home)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home, snap


def test_hub_id_loads_offline_and_matches_transformers(hub, tiny):
    import torch

    from dlbatch import LLM, SamplingParams

    llm = LLM(REPO_ID, dtype="float32", max_model_len=256)
    ids = [1] + list(range(40, 60))
    out = llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    with torch.no_grad():
        ref = tiny[1].generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert out.token_ids == ref


def test_hub_revision_pins_a_commit_and_names_a_missing_one(hub):
    from dlbatch.engine.loader import ModelNotFoundError, resolve_model

    home, snap = hub
    commit = os.path.basename(snap)
    assert resolve_model(f"{REPO_ID}@{commit}") == snap
    assert resolve_model(REPO_ID) == snap  # refs/main
    with pytest.raises(ModelNotFoundError, match=r"acme/tiny-llama@v9.*HF_HUB_OFFLINE"):
        resolve_model(f"{REPO_ID}@v9")
    with pytest.raises(ModelNotFoundError, match=r"acme/absent.*not in the Hugging Face cache"):
        resolve_model("acme/absent")


def test_job_revision_becomes_part_of_the_model_ref(hub, tmp_path):
    spec = load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}", f"model.name={REPO_ID}",
                                         "model.revision=main"])
    assert spec.model.ref == f"{REPO_ID}@main"
    assert fingerprint_fields(spec)["model.revision"] == "main"
    with pytest.raises(JobSpecError, match="revision 'main' applies to a Hub id"):
        load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}", "model.revision=main"])


def test_hub_identity_follows_the_commit(hub, tiny, tmp_path):
    home, snap = hub
    spec = load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}", f"model.name={REPO_ID}"])
    first = content_fields(spec)
    assert first["model.identity"] == f"hub:{REPO_ID}@{os.path.basename(snap)}"
    other = str(tmp_path / "retrained")
    make_tiny_model("llama", other, seed=1)
    add_to_hub_cache(home, REPO_ID, other)  # a new commit on main
    assert content_fields(spec)["model.identity"] != first["model.identity"]


def test_changed_weights_under_the_same_name_refuse_the_resume(tmp_path):
    path = str(tmp_path / "model")
    make_tiny_model("llama", path, seed=0)
    spec = load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}", f"model.name={path}"])
    before = content_fields(spec)
    stored = {**fingerprint_fields(spec), **before}
    check_resume_compatible(stored, spec, content=content_fields(spec))  # unchanged: resumes
    make_tiny_model("llama", path, seed=1)  # retrained in place: same name, same sizes
    after = content_fields(spec)
    assert after["model.identity"] != before["model.identity"]
    with pytest.raises(ResumeMismatchError, match=r"model\.identity: 'dir:"):
        check_resume_compatible(stored, spec, content=after)
    # an output written before identities were recorded resumes as before
    check_resume_compatible(fingerprint_fields(spec), spec, content=after)


def test_chat_template_content_is_in_the_fingerprint(tmp_path):
    tpl = tmp_path / "chat.jinja"
    tpl.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    spec = load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}", f"model.chat_template={tpl}"])
    before = content_fields(spec)
    tpl.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    with pytest.raises(ResumeMismatchError, match="model.chat_template_sha256"):
        check_resume_compatible({**fingerprint_fields(spec), **before}, spec, content=content_fields(spec))


def test_gguf_identity_is_its_header(sample_model, tmp_path):
    from dlbatch.engine.loader import model_identity, resolve_model

    ident = model_identity(sample_model)
    assert ident.startswith("gguf:") and model_identity(sample_model) == ident
    copy = tmp_path / "copy.gguf"
    data = bytearray(open(resolve_model(sample_model), "rb").read())
    data[200] ^= 0xFF  # a byte of its metadata
    copy.write_bytes(bytes(data))
    assert model_identity(str(copy)) != ident


# ------------------------------------------------------------ backend and engine_args checks
def test_unknown_engine_args_of_our_engine_are_named(tmp_path):
    with pytest.raises(JobSpecError, match=r"unknown argument\(s\) max_num_seq, warp of the dlbatch engine"):
        load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}", "model.engine_args.max_num_seq=8",
                                      "model.engine_args.warp=1"])
    spec = load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}", "model.engine_args.max_num_seqs=8"])
    from dlbatch.driver.config import RunConfig

    assert RunConfig.resolve(spec).pools["colocated"].worker.engine.max_num_seqs == 8


def test_vllm_backend_with_pd_pools_is_refused_with_the_fix(tmp_path):
    with pytest.raises(JobSpecError, match=r"colocated workers only: set cluster.colocated.*GPUs only"):
        load_job("jobs/papers_pd.yaml", [f"output.path={tmp_path / 'o'}", "model.backend=vllm"])
    spec = load_job("jobs/papers_pd.yaml", [f"output.path={tmp_path / 'o'}", "model.backend=vllm",
                                         "cluster.colocated.chip=fast"])
    assert spec.cluster.mode == "colocated" and fingerprint_fields(spec)["model.backend"] == "vllm"


def test_a_backend_that_is_not_installed_is_a_clear_error(tmp_path, monkeypatch):
    from dlbatch.backends import BackendUnavailable, vllm_backend
    from dlbatch.driver.config import RunConfig

    monkeypatch.setattr(vllm_backend.importlib.util, "find_spec", lambda name: None)
    spec = load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}", "model.backend=vllm",
                                         "cluster.colocated.chip=fast"])
    with pytest.raises(BackendUnavailable, match=r"needs vLLM in this environment: pip install -e '.\[vllm\]'"):
        RunConfig.resolve(spec)


def test_our_engine_refuses_an_architecture_naming_the_backend_that_runs_it(tmp_path):
    import json

    d = tmp_path / "phi"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}))
    from dlbatch.driver.config import RunConfig

    spec = load_job("jobs/papers.yaml", [f"output.path={tmp_path / 'o'}", f"model.name={d}"])
    with pytest.raises(ValueError, match=r"phi3.*not run by dlbatch's engine.*model.backend: vllm"):
        RunConfig.resolve(spec)

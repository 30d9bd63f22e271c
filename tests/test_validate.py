"""`dlbatch validate` on every shipped job and on broken ones; CLI errors are one line, exit 2."""
from __future__ import annotations

import glob
import os
import shutil

import pytest

from dlbatch.cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "jobs", "*.yaml")))


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # job files name their sample data relative to the repository


# shipped jobs that name a Hub model not bundled: validated offline against a Hub cache laid out
# on disk holding a tiny random model of the same architecture under that id (no network)
HUB_MODELS = {"jobs/papers_figures.yaml": "HuggingFaceTB/SmolVLM-256M-Instruct"}


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """An HF_HOME whose Hub cache holds the tiny vision-language model under each HUB_MODELS id."""
    from tests.helpers.hub import add_to_hub_cache
    from tests.helpers.tiny_vlm import make_tiny_vlm

    root = tmp_path_factory.mktemp("hub")
    make_tiny_vlm(str(root / "vlm"))
    for repo in set(HUB_MODELS.values()):
        add_to_hub_cache(str(root / "hf"), repo, str(root / "vlm"))
    return str(root / "hf")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> str:
    """A tiny random Qwen2 whose config allows the GPU job's 16k context (positions are rotary:
    no weight depends on their number)."""
    from tests.helpers.tiny_models import make_tiny_model

    path = str(tmp_path_factory.mktemp("models") / "tiny-qwen2")
    make_tiny_model("qwen2", path, overrides={"max_position_embeddings": 32768})
    return path


def needs_vllm() -> None:
    """The GPU job runs on the vLLM backend: validating it needs vLLM importable (CI installs
    it; a machine without it skips, naming how to install it)."""
    from dlbatch.backends import REGISTRY

    why = REGISTRY["vllm"].unavailable_reason()
    if why:
        pytest.skip(why)


def offline(job: str, request, monkeypatch) -> list[str]:
    """The --set overrides that let ``job`` validate here, every other key as shipped: the GPU
    job's 7B Hub model, S3 paths and credentials become a tiny local Qwen2, the sample papers
    and dummy AWS variables (its ``${env:...}`` references must resolve)."""
    if job != "jobs/gpu_vllm.yaml":
        return []
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "dummy-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "dummy-secret")
    return ["--set", f"model.name={request.getfixturevalue('tiny_qwen2')}", "--set", "input.path=samples/papers"]


@pytest.mark.parametrize("job", JOBS)
def test_every_shipped_job_validates(job, tmp_path, capsys, request, monkeypatch):
    if job in HUB_MODELS or job == "jobs/gpu_vllm.yaml":
        needs_vllm()
    if job in HUB_MODELS:
        monkeypatch.setenv("HF_HOME", request.getfixturevalue("hub_home"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    rc = main(["validate", job, "--docs", "2", *offline(job, request, monkeypatch),
               "--set", f"output.path={tmp_path / 'out'}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "is valid" in out and "inputs: " in out and "prompt tokens" in out and "estimate: " in out
    if job not in HUB_MODELS:  # (a figure task over a paper without that figure is its dead letter)
        assert "would be a dead letter" not in out  # a `chunk` document is map-reduced, as the run does
    assert not (tmp_path / "out").exists()  # validate writes nothing: no probe, no folder


def test_the_gpu_job_is_checked_as_shipped(request, monkeypatch, tmp_path, capsys):
    """Its pools and backend as written: 4 vLLM replicas of 2 GPUs, tensor parallel 2."""
    needs_vllm()
    rc = main(["validate", "jobs/gpu_vllm.yaml", "--docs", "2", *offline("jobs/gpu_vllm.yaml", request, monkeypatch),
               "--set", f"output.path={tmp_path / 'out'}"])
    out = capsys.readouterr().out
    assert rc == 0 and "backend vllm, max_model_len 16,384" in out and "colocated a100 x4 (cuda)" in out
    assert "-> chunk" in out  # the 80k-token paper is map-reduced


@pytest.mark.parametrize("cmd", ["validate", "run"])
@pytest.mark.parametrize("sets,words", [
    (["cluster.colocated.num_gpus=1"],
     "cluster.colocated.num_gpus 1 must equal model.engine_args tensor_parallel_size 2 x pipeline_parallel_size 1 = 2"),
    (["model.engine_args.pipeline_parallel_size=2"],
     "cluster.colocated.num_gpus 2 must equal model.engine_args tensor_parallel_size 2 x pipeline_parallel_size 2 = 4"),
    (["model.backend=dlbatch", "model.engine_args={}"],
     "cluster.colocated.num_gpus 2: a model.backend dlbatch engine drives 1 device per replica (num_gpus <= 1"),
])
def test_a_replica_asks_for_the_gpus_it_drives(cmd, sets, words, request, monkeypatch, tmp_path, capsys):
    """vLLM: num_gpus = tensor_parallel_size x pipeline_parallel_size; ours: at most 1. Refused
    by validate and by run, before anything starts (exit 2), naming both values."""
    args = [cmd, "jobs/gpu_vllm.yaml", *offline("jobs/gpu_vllm.yaml", request, monkeypatch),
            "--set", f"output.path={tmp_path / 'out'}", *sum((["--set", s] for s in sets), [])]
    capsys.readouterr()  # what making the tiny model printed, when this test made it
    rc = main(args)
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and words in line, line
    assert not (tmp_path / "out").exists()


def test_the_pools_a_run_resolves_are_checked_too(tiny_qwen2):
    """A plan's or the solver's pools go through the same check when the run resolves them."""
    needs_vllm()
    from dlbatch.driver.config import RunConfig
    from dlbatch.driver.layout import Layout
    from dlbatch.jobspec import PoolSpec, load_job

    spec = load_job("jobs/papers_jsonl.yaml", [f"model.name={tiny_qwen2}", "model.backend=vllm",
                                               "model.engine_args.tensor_parallel_size=2"])
    config = RunConfig.resolve(spec)  # the solver's pools on this machine's CPU: no GPU asked
    assert [p.num_gpus for p in config.pools.values()] == [0.0]
    good = PoolSpec(chip="a100", device="cuda", num_gpus=2)
    assert config.with_layout(Layout(pools={"colocated": good}, source="plan", reason="a plan")).pools
    bad = PoolSpec(chip="a100", device="cuda", num_gpus=1)
    with pytest.raises(ValueError, match=r"num_gpus 1 must equal .*tensor_parallel_size 2 x pipeline_parallel_size "
                                         r"1 = 2"):
        config.with_layout(Layout(pools={"colocated": bad}, source="plan", reason="a plan"))


def test_validate_shows_each_image_tasks_images_and_their_tokens(tmp_path, capsys, request, monkeypatch):
    """The figures job over two long sample papers: every figure task has one image (its crop)
    and its image tokens in each document, as the model's processor counts them."""
    from dlbatch.backends import REGISTRY

    why = REGISTRY["vllm"].unavailable_reason()
    if why:
        pytest.skip(why)
    monkeypatch.setenv("HF_HOME", request.getfixturevalue("hub_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    src = tmp_path / "in"
    src.mkdir()
    for name in ("rainfed_wheat_soil_moisture", "tidal_array_wakes"):
        shutil.copy(os.path.join(REPO, "samples", "papers", f"{name}.pdf"), src / f"{name}.pdf")
    rc = main(["validate", "jobs/papers_figures.yaml", "--docs", "2", "--set", f"output.path={tmp_path / 'out'}",
               "--set", f"input.path={src}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "images per task in the 2 sampled documents (count, tokens):" in out
    lines = [x for x in out.splitlines() if x.strip().startswith(str(src)) and "figure_1" in x]
    assert len(lines) == 2
    for line in lines:  # e.g. "figure_1 1 (21), figure_2 1 (21), ..."
        for t in ("figure_1", "figure_2", "figure_3", "figure_4"):
            assert f"{t} 1 (" in line, line
    assert "task figure_1: " in out and "1 images (" in out


def _one_line_error(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if not x.startswith(("20", "WARNING", "INFO"))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_missing_input_is_one_line_and_exit_2(tmp_path, capsys):
    rc = main(["validate", "jobs/papers.yaml", "--set", f"input.path={tmp_path / 'nowhere'}",
               "--set", f"output.path={tmp_path / 'out'}"])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and "nowhere" in line and line.startswith("error: ")


def test_an_unwritable_output_is_named(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    rc = main(["validate", "jobs/papers.yaml", "--docs", "1", "--set", f"output.path={tmp_path / 'a_file' / 'out'}"])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and "output.path" in line and "a_file" in line


def test_a_job_whose_documents_give_no_prompts_is_invalid(tmp_path, capsys):
    src = tmp_path / "empty.jsonl"
    src.write_text('{"text": ""}\n')
    rc = main(["validate", "jobs/papers_jsonl.yaml", "--set", f"input.path={src}",
               "--set", f"output.path={tmp_path / 'out'}"])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and "gives prompts" in line


def test_status_of_a_job_whose_input_is_missing_is_one_line_exit_2(tmp_path, capsys):
    rc = main(["status", "jobs/papers_jsonl.yaml", "--set", f"input.path={tmp_path / 'missing.jsonl'}",
               "--set", f"output.path={tmp_path / 'out'}"])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 2 and "missing.jsonl" in line


def test_relative_paths_follow_one_rule_and_validate_prints_them(tmp_path, capsys, monkeypatch):
    """Data from the current directory, the job's own files from the job file's folder: a job
    in one folder with its schema beside it, run from another folder holding the data."""
    import json

    jobdir, datadir = tmp_path / "jobs", tmp_path / "work"
    (jobdir / "schemas").mkdir(parents=True)
    (datadir / "in").mkdir(parents=True)
    (jobdir / "schemas" / "kw.json").write_text(json.dumps({"type": "object", "properties": {
        "keywords": {"type": "array", "items": {"type": "string"}}}, "required": ["keywords"]}))
    (datadir / "in" / "a.jsonl").write_text(json.dumps({"id": "a", "text": "A short passage about rivers."}) + "\n")
    (jobdir / "job.yaml").write_text(
        "name: paths\npipeline: papers\ninput: {format: jsonl, path: in, id_field: id}\noutput: {path: out}\n"
        "model: {name: smollm2-135m-instruct, dtype: float32, max_model_len: 1024}\n"
        "tasks:\n  - {name: kw, prompt: \"{{ text }} Keywords?\", max_tokens: 8, output: {json_schema: schemas/kw.json}}\n")
    monkeypatch.chdir(datadir)
    assert main(["validate", str(jobdir / "job.yaml"), "--docs", "1"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("paths "))
    assert f"relative ones from {datadir}" in line
    assert f"input {datadir / 'in'}, output {datadir / 'out'}, model /" in line
    assert not (datadir / "out").exists() and not (jobdir / "in").exists()

"""Job file validation, overrides, safe YAML, path rules and the job fingerprint."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from dlbatch.jobspec import (
    JobSpecError,
    ResumeMismatchError,
    apply_overrides,
    check_resume_compatible,
    fingerprint_diff,
    fingerprint_fields,
    job_fingerprint,
    load_job,
    parse_job,
)

REPO = Path(__file__).resolve().parents[1]
MINIMAL = {"name": "t", "pipeline": "papers"}


def write_job(tmp_path: Path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def job(**extra):
    data = dict(MINIMAL)
    data.update(extra)
    return data


def error_of(data, source="jobs/x.yaml") -> str:
    with pytest.raises(JobSpecError) as info:
        parse_job(data, source=source)
    return str(info.value)


# ----------------------------------------------------------------------------- shipped job files


@pytest.mark.parametrize("name", ["papers", "papers_jsonl", "daily_incremental"])
def test_shipped_job_files_load(name, monkeypatch):
    monkeypatch.chdir(REPO)
    spec = load_job(f"jobs/{name}.yaml")
    assert spec.name == name
    assert spec.pipeline == "papers"
    assert spec.tasks[0].name == "summary"
    assert os.path.isabs(spec.input.path) and os.path.isabs(spec.output.path)


def test_papers_yaml_contents(monkeypatch):
    monkeypatch.chdir(REPO)
    spec = load_job("jobs/papers.yaml")
    assert [(t.name, t.max_tokens) for t in spec.tasks] == [("summary", 128), ("keywords", 32), ("question", 48)]
    assert spec.tasks[2].prompt == "{{ text }}\n\nWrite one question this paper answers."
    assert spec.model.dtype == "bfloat16" and spec.model.max_model_len == 4096
    assert spec.model.name == "smollm2-135m-instruct"
    assert spec.input.format == "pdf" and spec.input.path == str(REPO / "samples" / "papers")
    assert spec.output.path == str(REPO / "out" / "papers")
    assert spec.cluster.mode == "auto" and spec.cluster.pools() == {} and spec.cluster.layout_source == "solver"
    pd = load_job("jobs/papers_pd.yaml")  # the same job on named prefill/decode pools
    assert (pd.cluster.prefill.chip, pd.cluster.decode.chip) == ("fast", "cheap")
    assert pd.cluster.prefill.num_cpus == 0.5 and pd.cluster.decode.num_cpus == 0.5
    assert pd.cluster.prefill.replicas == pd.cluster.decode.replicas == 1
    assert pd.cluster.mode == "disaggregated" and set(pd.cluster.pools()) == {"prefill", "decode"}
    assert pd.cluster.layout_source == "job" and pd.tasks == spec.tasks and pd.model == spec.model


def test_jsonl_and_daily_job_inputs(monkeypatch):
    monkeypatch.chdir(REPO)
    jl = load_job("jobs/papers_jsonl.yaml")
    assert jl.input.format == "jsonl" and jl.input.path == str(REPO / "samples" / "papers.jsonl")
    assert [t.name for t in jl.tasks] == ["summary", "keywords", "question"]
    daily = load_job("jobs/daily_incremental.yaml")
    assert daily.input.path == str(REPO / "incoming")
    assert daily.output.path == str(REPO / "out" / "daily")
    assert "skip" in (REPO / "jobs" / "daily_incremental.yaml").read_text()


# ----------------------------------------------------------------------------- defaults


def test_defaults_match_the_documented_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = parse_job(MINIMAL)
    assert spec.input.format == "pdf" and spec.input.text_field == "text"
    assert spec.input.id_field is None and spec.input.limit is None and spec.input.storage_options == {}
    assert spec.output.path == str(tmp_path / "out" / "papers") and spec.output.include_text is False
    assert (spec.model.name, spec.model.dtype, spec.model.max_model_len, spec.model.chat) == (
        "smollm2-135m-instruct", "bfloat16", None, None)
    assert [(t.name, t.max_tokens) for t in spec.tasks] == [("summary", 128), ("keywords", 32)]
    assert spec.sampling.model_dump(exclude_none=True) == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0,
                                                           "stop": []}  # the extras: off
    assert spec.long_inputs == "truncate"
    assert (spec.router.policy, spec.router.window) == ("prefix_aware", 256)
    assert (spec.batching.max_batch_tokens, spec.batching.max_inflight_batches) == (8192, 16)
    assert spec.retries.max_attempts == 3
    c = spec.cluster
    assert c.address is None and c.plan is None and c.colocated is None and c.kv_transport == "auto"
    assert c.prefill is None and c.decode is None and c.mode == "auto"  # the solver picks the pools
    assert (c.objective, c.ttft_target_s) == ("cost", None)
    from dlbatch.jobspec.cluster import DecodePoolSpec, PrefillPoolSpec

    assert PrefillPoolSpec().model_dump() == {"chip": "fast", "replicas": 1, "device": "cpu", "num_cpus": 1.0,
                                              "num_gpus": 0.0, "kv_cache_memory": None}
    assert DecodePoolSpec().chip == "cheap"


def test_to_dict_round_trips():
    spec = parse_job(job(model={"dtype": "float16"}, cluster={"colocated": {"chip": "fast", "replicas": 2}}))
    data = spec.to_dict()
    assert isinstance(data, dict) and data["model"]["dtype"] == "float16"
    assert yaml.safe_load(yaml.safe_dump(data)) == data
    assert parse_job(data) == spec
    assert spec.cluster.mode == "colocated" and list(spec.cluster.pools()) == ["colocated"]


# ----------------------------------------------------------------------------- validation messages


def test_bad_enum_names_file_key_and_value():
    msg = error_of(job(model={"dtype": "fp8"}))
    assert "jobs/x.yaml: model.dtype: 'fp8' is not one of float32, bfloat16, float16" in msg


@pytest.mark.parametrize(
    "data, key, fragment",
    [
        (job(input={"format": "csv"}), "input.format", "'csv' is not one of pdf, jsonl, parquet, text, hf"),
        (job(long_inputs="drop"), "long_inputs", "'drop' is not one of truncate, middle, skip, chunk"),
        (job(router={"policy": "random"}), "router.policy", "'random' is not one of prefix_aware"),
        (job(cluster={"kv_transport": "nccl"}), "cluster.kv_transport", "'nccl' is not one of auto, object_store"),
    ],
)
def test_other_enums(data, key, fragment):
    msg = error_of(data)
    assert f"jobs/x.yaml: {key}: {fragment}" in msg


def test_unknown_key_is_an_error_with_suggestion():
    msg = error_of(job(model={"dtpye": "float32"}))
    assert "jobs/x.yaml: model.dtpye: unknown key" in msg
    assert "did you mean 'dtype'" in msg


@pytest.mark.parametrize(
    "data, key",
    [
        (job(colour="red"), "colour"),
        (job(input={"paht": "x"}), "input.paht"),
        (job(tasks=[{"name": "a", "prompt": "{{ text }}", "temperature": 1}]), "tasks.0.temperature"),
        (job(cluster={"prefill": {"chip": "a", "gpus": 1}}), "cluster.prefill.gpus"),
        (job(sampling={"beam": 2}), "sampling.beam"),
    ],
)
def test_unknown_keys_everywhere(data, key):
    assert f"jobs/x.yaml: {key}: unknown key" in error_of(data)


@pytest.mark.parametrize(
    "data, key, value",
    [
        (job(input={"limit": "3"}), "input.limit", "'3'"),
        (job(input={"limit": 0}), "input.limit", "0"),
        (job(tasks=[{"name": "a", "prompt": "{{ text }}", "max_tokens": 0}]), "tasks.0.max_tokens", "0"),
        (job(tasks=[{"name": "a", "prompt": "{{ text }}", "max_tokens": 1.5}]), "tasks.0.max_tokens", "1.5"),
        (job(output={"include_text": "yes"}), "output.include_text", "'yes'"),
        (job(model={"max_model_len": -1}), "model.max_model_len", "-1"),
        (job(sampling={"top_p": 1.5}), "sampling.top_p", "1.5"),
        (job(cluster={"decode": {"chip": "x", "replicas": 0}}), "cluster.decode.replicas", "0"),
        (job(pipeline="Papers-2"), "pipeline", "'Papers-2'"),
        (job(tasks=[{"name": "bad name", "prompt": "{{ text }}"}]), "tasks.0.name", "'bad name'"),
    ],
)
def test_bad_types_and_ranges_name_key_and_value(data, key, value):
    msg = error_of(data)
    line = next(line for line in msg.splitlines() if line.startswith(f"jobs/x.yaml: {key}: "))
    assert value in line


def test_wrong_shape_sections():
    assert "jobs/x.yaml: model: expected a mapping, got 'smollm2'" in error_of(job(model="smollm2"))
    assert "jobs/x.yaml: tasks: expected a list" in error_of(job(tasks={"name": "a"}))
    assert "must be a mapping at the top level, got list" in error_of(["a", "b"])


def test_missing_required_keys():
    msg = error_of({"pipeline": "papers"})
    assert "jobs/x.yaml: name: required key is missing" in msg
    msg = error_of(job(tasks=[{"name": "a"}]))
    assert "jobs/x.yaml: tasks.0: task 'a': give exactly one of prompt (a template) and messages" in msg
    msg = error_of(job(cluster={"colocated": {"replicas": 2}}))
    assert "jobs/x.yaml: cluster.colocated.chip: required key is missing" in msg


def test_tasks_at_least_one_and_unique():
    assert "jobs/x.yaml: tasks: needs at least 1 item(s), got 0" in error_of(job(tasks=[]))
    dup = [{"name": "a", "prompt": "{{ text }} x"}, {"name": "a", "prompt": "{{ text }} y"}]
    assert "jobs/x.yaml: tasks: duplicate task name 'a'" in error_of(job(tasks=dup))


def test_template_errors_at_load_time_name_the_task():
    msg = error_of(job(tasks=[{"name": "summary", "prompt": "{{ text }"}]))
    assert "jobs/x.yaml: tasks.0.prompt: task 'summary': prompt template syntax error at line 1" in msg
    msg = error_of(job(tasks=[{"name": "kw", "prompt": "{{ txt }}"}]))
    assert "tasks.0.prompt: task 'kw'" in msg and "'txt'" in msg


def test_several_problems_are_all_reported():
    msg = error_of(job(model={"dtype": "fp8"}, input={"limit": 0}, extra=1))
    assert len(msg.splitlines()) == 3
    assert all(line.startswith("jobs/x.yaml: ") for line in msg.splitlines())


def test_cluster_address_forms():
    for ok in (None, "auto", "ray://head:10001", "10.0.0.1:6379"):
        assert parse_job(job(cluster={"address": ok})).cluster.address == ok
    msg = error_of(job(cluster={"address": "somewhere"}))
    assert "jobs/x.yaml: cluster.address: 'somewhere' is not a Ray address" in msg


# ----------------------------------------------------------------------------- YAML files


def test_malformed_yaml_reports_line(tmp_path):
    path = write_job(tmp_path, "name: x\npipeline: papers\nmodel:\n  dtype: [bfloat16\ntasks: []\n")
    with pytest.raises(JobSpecError) as info:
        load_job(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: line 5") and "invalid YAML" in msg


def test_python_tags_are_rejected_and_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = write_job(
        tmp_path,
        f"name: x\npipeline: papers\nmodel: !!python/object/apply:os.makedirs [{str(marker)!r}]\n",
    )
    with pytest.raises(JobSpecError) as info:
        load_job(path)
    assert "line 3" in str(info.value) and "python/object/apply:os.makedirs" in str(info.value)
    assert not marker.exists()
    path = write_job(tmp_path, "name: x\npipeline: papers\ninput: !!python/object:collections.OrderedDict {}\n")
    with pytest.raises(JobSpecError, match="could not determine a constructor"):
        load_job(path)


def test_missing_empty_and_non_mapping_files(tmp_path):
    with pytest.raises(JobSpecError, match="nope.yaml: job file not found"):
        load_job(tmp_path / "nope.yaml")
    with pytest.raises(JobSpecError, match="the job file is empty"):
        load_job(write_job(tmp_path, "# nothing\n"))
    with pytest.raises(JobSpecError, match="must be a mapping at the top level, got list"):
        load_job(write_job(tmp_path, "- a\n- b\n"))


def test_validation_errors_from_a_file_name_the_file(tmp_path):
    path = write_job(tmp_path, "name: x\npipeline: papers\nmodel: {dtype: fp8}\n")
    with pytest.raises(JobSpecError) as info:
        load_job(path)
    assert str(info.value) == f"{path}: model.dtype: 'fp8' is not one of float32, bfloat16, float16"
    assert info.value.problems == [("model.dtype", "'fp8' is not one of float32, bfloat16, float16")]


def test_load_from_fsspec_url(tmp_path, monkeypatch):
    import fsspec

    monkeypatch.chdir(tmp_path)
    with fsspec.open("memory://jobs/j.yaml", "w") as f:
        f.write("name: mem\npipeline: papers\ninput: {path: 's3://bucket/papers/*.pdf'}\n")
    try:
        spec = load_job("memory://jobs/j.yaml")
    finally:
        fsspec.filesystem("memory").rm("/jobs", recursive=True)
    assert spec.name == "mem" and spec.source == "memory://jobs/j.yaml"
    assert spec.input.path == "s3://bucket/papers/*.pdf"
    assert parse_job(spec.to_dict()) == spec  # equality ignores where it was loaded from
    assert parse_job(spec.to_dict()).source == "<dict>"


# ----------------------------------------------------------------------------- overrides


def test_overrides_parse_values_with_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    spec = load_job(
        "jobs/papers.yaml",
        [
            "model.dtype=float32",
            "input.limit=3",
            "cluster.address=null",
            "tasks.0.max_tokens=16",
            "tasks.2.prompt='{{ text }} Q?'",
            "sampling.temperature=0.7",
            "output.include_text=true",
            "input.storage_options.endpoint_url=http://127.0.0.1:9000",
        ],
    )
    assert spec.model.dtype == "float32"
    assert spec.input.limit == 3 and spec.cluster.address is None
    assert spec.tasks[0].max_tokens == 16 and spec.tasks[1].max_tokens == 32
    assert spec.tasks[2].prompt == "{{ text }} Q?"
    assert spec.sampling.temperature == 0.7 and spec.output.include_text is True
    assert spec.input.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}


def test_overrides_of_keys_left_at_default():
    data = apply_overrides(MINIMAL, ["cluster.decode.replicas=2", "tasks.1.max_tokens=8", "cluster.colocated.chip=big"])
    spec = parse_job(data)
    assert spec.cluster.decode.replicas == 2 and spec.cluster.decode.chip == "cheap"
    assert spec.tasks[1].max_tokens == 8 and spec.tasks[0].name == "summary"
    assert spec.cluster.colocated is not None and spec.cluster.colocated.chip == "big"
    assert "cluster" not in MINIMAL  # the input dict is not modified


def test_override_whole_mapping_and_bad_value_is_validated():
    spec = parse_job(apply_overrides(MINIMAL, ["cluster.colocated={chip: fast, replicas: 2}"]))
    assert spec.cluster.colocated.replicas == 2
    with pytest.raises(JobSpecError, match=r"cli: model\.dtype: 'fp8' is not one of"):
        parse_job(apply_overrides(MINIMAL, ["model.dtype=fp8"]), source="cli")


@pytest.mark.parametrize(
    "item, fragment",
    [
        ("model.dtype", "expected KEY.PATH=VALUE"),
        ("=3", "empty key path"),
        ("model.dtpye=float32", "unknown key 'dtpye' in model (did you mean 'dtype'?"),
        ("modle.dtype=float32", "unknown key 'modle' in the job"),
        ("tasks.7.max_tokens=1", "index 7 is out of range for tasks (2 items)"),
        ("tasks.first.max_tokens=1", "'first' is not an index"),
        ("model.dtype.bits=8", "model.dtype is a single value"),
        ("name=[oops", "is not valid YAML"),
        ("tasks.0.prompt={{ text }} Q?", "quote it"),
    ],
)
def test_bad_overrides(item, fragment):
    with pytest.raises(JobSpecError) as info:
        apply_overrides(MINIMAL, [item], source="jobs/x.yaml")
    msg = str(info.value)
    assert msg.startswith(f"jobs/x.yaml: --set {item!r}: ")
    assert fragment in msg


def test_bad_override_through_load_job_names_the_file(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(JobSpecError, match=r"^jobs/papers\.yaml: --set 'input\.limt=3': unknown key 'limt'"):
        load_job("jobs/papers.yaml", ["input.limt=3"])


# ----------------------------------------------------------------------------- paths


def test_relative_paths_resolve_against_cwd_urls_untouched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = parse_job(job(input={"path": "data/*.pdf"}, output={"path": "results/run1"}))
    assert spec.input.path == str(tmp_path / "data" / "*.pdf")
    assert spec.output.path == str(tmp_path / "results" / "run1")
    for url in ("s3://bucket/in", "gs://b/x/*.jsonl", "memory://in", "file:///data/in"):
        assert parse_job(job(input={"path": url})).input.path == url
    for url in ("s3://bucket/out/run", "memory://out", "file:///tmp/dlbatch-out"):
        assert parse_job(job(output={"path": url})).output.path == url


def test_empty_input_path():
    assert "jobs/x.yaml: input.path: must not be empty" in error_of(job(input={"path": ""}))


def test_hf_dataset_names_are_not_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = parse_job(job(input={"format": "hf", "path": "org/dataset"}))
    assert spec.input.path == "hf-dataset://org/dataset?split=train"  # a Hub id (connectors/hf_hub.py)
    (tmp_path / "local_ds").mkdir()
    assert parse_job(job(input={"format": "hf", "path": "local_ds"})).input.path == str(tmp_path / "local_ds")


@pytest.mark.parametrize("bad", ["", "  ", "/", "~", ".", "./", "..", "../..", "s3://", "s3://bucket", "s3://bucket/", "file:///"])
def test_output_path_confinement(bad, tmp_path, monkeypatch):
    work = tmp_path / "home" / "proj"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    msg = error_of(job(output={"path": bad}))
    assert msg.startswith("jobs/x.yaml: output.path: ")
    if bad.strip():
        assert repr(bad) in msg
    assert "--fresh" in msg


def test_output_path_home_and_cwd_by_absolute_path(tmp_path, monkeypatch):
    home = tmp_path / "home"
    work = home / "proj"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    assert "the home directory" in error_of(job(output={"path": str(home)}))
    assert "the current directory" in error_of(job(output={"path": str(work)}))
    assert "'~/' is not allowed" in error_of(job(output={"path": "~/"}))
    assert "the home directory" in error_of(job(output={"path": "~/../home"}))
    assert "contains the home directory" in error_of(job(output={"path": str(tmp_path)}))
    assert parse_job(job(output={"path": "~/elsewhere"})).output.path == str(home / "elsewhere")
    assert parse_job(job(output={"path": "out"})).output.path == str(work / "out")


# ----------------------------------------------------------------------------- fingerprint


def test_fingerprint_stable_and_sensitive(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = parse_job(MINIMAL)
    assert job_fingerprint(base) == job_fingerprint(parse_job(MINIMAL))
    assert len(job_fingerprint(base)) == 64
    # throughput knobs do not change the outputs
    same = parse_job(job(input={"limit": 5}, batching={"max_batch_tokens": 1024}, cluster={"address": "auto"},
                         router={"policy": "round_robin"}, retries={"max_attempts": 9}))
    assert job_fingerprint(same) == job_fingerprint(base)
    for changed in (
        job(model={"dtype": "float32"}),
        job(model={"name": "other"}),
        job(model={"max_model_len": 4096}),
        job(sampling={"temperature": 0.5}),
        job(long_inputs="skip"),
        job(long_inputs="chunk"),
        job(tasks=[{"name": "summary", "prompt": "{{ text }}\n\nSummarize this paper in three sentences.",
                    "max_tokens": 128, "long_inputs": "middle"},
                   {"name": "keywords", "prompt": "{{ text }}\n\nList five keywords of this paper.", "max_tokens": 32}]),
        job(input={"path": "other"}),
        job(input={"format": "jsonl"}),
        job(tasks=[{"name": "summary", "prompt": "{{ text }} TL;DR", "max_tokens": 128}]),
        job(tasks=[{"name": "summary", "prompt": "{{ text }}\n\nSummarize this paper in three sentences.", "max_tokens": 64}]),
    ):
        assert job_fingerprint(parse_job(changed)) != job_fingerprint(base), changed


def test_resume_mismatch_names_what_changed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = parse_job(MINIMAL)
    stored = fingerprint_fields(old)
    check_resume_compatible(stored, parse_job(job(input={"limit": 2})))  # compatible: no error
    new = parse_job(job(model={"dtype": "float32"}, tasks=[{"name": "summary", "prompt": "{{ text }} S", "max_tokens": 128}]),
                    source="jobs/p.yaml")
    diff = fingerprint_diff(stored, fingerprint_fields(new))
    assert "model.dtype: 'bfloat16' -> 'float32'" in diff
    assert any(d.startswith("tasks.keywords.prompt: '{{ text }}") and d.endswith("-> (absent)") for d in diff)
    with pytest.raises(ResumeMismatchError) as info:
        check_resume_compatible(stored, new)
    msg = str(info.value)
    assert msg.startswith("jobs/p.yaml: cannot resume into ")
    assert str(tmp_path / "out" / "papers") in msg
    assert "model.dtype: 'bfloat16' -> 'float32'" in msg and "tasks.summary.prompt" in msg
    assert isinstance(info.value, JobSpecError)



def test_output_path_above_cwd(tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    (tmp_path / "h").mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    msg = error_of(job(output={"path": ".."}))
    assert f"'..' resolves to {str(tmp_path / 'a')!r}, which contains the current directory" in msg
    assert parse_job(job(output={"path": "../sibling"})).output.path == str(tmp_path / "a" / "sibling")


def test_long_input_policies_per_job_and_task(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = parse_job(job(long_inputs="chunk", chunking={"chunk_tokens": 2000, "overlap_tokens": 100},
                         tasks=[{"name": "a", "prompt": "{{ text }} A"},
                                {"name": "b", "prompt": "{{ abstract }} B", "long_inputs": "middle"}]))
    assert spec.long_inputs == "chunk" and [t.long_inputs for t in spec.tasks] == [None, "middle"]
    assert spec.chunking.chunk_tokens == 2000 and "{{ text }}" in spec.chunking.map_prompt
    assert parse_job(MINIMAL).chunking.chunk_tokens is None
    with pytest.raises(JobSpecError, match="overlap_tokens 600 must be at most chunk_tokens / 4"):
        parse_job(job(chunking={"chunk_tokens": 2000, "overlap_tokens": 600}))
    with pytest.raises(JobSpecError, match="reduce_prompt.*'text'"):
        parse_job(job(chunking={"reduce_prompt": "{{ text }}"}))
    with pytest.raises(JobSpecError, match="'cut' is not one of truncate, middle, skip, chunk"):
        parse_job(job(tasks=[{"name": "a", "prompt": "{{ text }}", "long_inputs": "cut"}]))


def test_set_creates_an_optional_sub_mapping_the_file_leaves_out():
    """`--set tasks.N.sampling.n=3` on a task without its own `sampling:` mapping (and on one
    with it): the override makes the mapping, as for any other optional section. In a fresh
    interpreter: a schema class used before it is defined resolves only once pydantic has
    validated a job, which earlier tests in this process would have done."""
    import subprocess
    import sys

    code = ("from dlbatch.jobspec import load_job\n"
            "s = load_job('jobs/synthetic_qa.yaml', ['tasks.0.sampling.n=3', 'tasks.1.sampling.n=2'])\n"
            "print(s.tasks[0].sampling.n, s.tasks[0].sampling.temperature, s.tasks[1].sampling.n,"
            " s.tasks[1].sampling.temperature)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["3", "0.8", "2", "None"]  # the file's keys stay beside the override


def test_every_schema_field_annotation_is_resolved_on_import():
    """`--set` and the error messages walk the schema by its annotations: a forward reference
    left unresolved (a section class defined after its user) hides every key below it.
    Checked in a fresh interpreter, before any job is validated."""
    import subprocess
    import sys

    code = """
import typing
from pydantic import BaseModel
from dlbatch.jobspec import JobSpec
seen, todo, bad = set(), [JobSpec], []
while todo:
    model = todo.pop()
    if model in seen:
        continue
    seen.add(model)
    for name, f in model.model_fields.items():
        if isinstance(f.annotation, (str, typing.ForwardRef)):
            bad.append(f"{model.__name__}.{name}: {f.annotation!r}")
        for arg in (f.annotation, *typing.get_args(f.annotation)):
            for a in (arg, *typing.get_args(arg)):
                if isinstance(a, type) and issubclass(a, BaseModel):
                    todo.append(a)
print(bad)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout

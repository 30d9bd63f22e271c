"""Credentials in storage_options stay on the machines that use them: `dlbatch submit` refuses
a literal credential (the job file is uploaded), `${env:NAME}` references are resolved where
a filesystem is opened, and inside a run no storage option is among a Ray task's or actor's
arguments (the parse stage gets them sealed in an ObjectRef, the prompt actors not at all)."""
from __future__ import annotations

import json
import os

import pytest

from connectors.secrets import (MissingCredential, ReferenceNotAllowed, is_secret_key, literal_secrets,
                                reference_problems, resolve_options, seal, without_storage_options)
from dlbatch.jobspec import JobSpecError, load_job

SECRET = "s3cr3t-DO-NOT-LEAK-7f3a"
REF = "${env:DLB_TEST_SECRET}"


# --------------------------------------------------------------------------- what counts as a credential
def test_secret_looking_keys():
    for k in ("key", "secret", "token", "password", "aws_secret_access_key", "sessionToken", "SAS_TOKEN",
              "account_key", "apikey", "credentials", "connection_string", "session"):
        assert is_secret_key(k), k
    for k in ("anon", "endpoint_url", "region_name", "client_kwargs", "use_ssl", "profile", "signature_version",
              "default_block_size", "requester_pays"):
        assert not is_secret_key(k), k


def test_literal_secrets_names_the_key_paths_never_the_values():
    opts = {"key": "AKIAEXAMPLE", "secret": REF, "anon": False, "token": None, "password": "",
            "client_kwargs": {"endpoint_url": "http://x", "aws_session_token": SECRET},
            "credentials": {"private_key": SECRET, "client_email": "a@b"}, "region_name": "us-east-1"}
    found = literal_secrets(opts, "input.storage_options")
    assert found == ["input.storage_options.key", "input.storage_options.client_kwargs.aws_session_token",
                     "input.storage_options.credentials.private_key",
                     "input.storage_options.credentials.client_email"]  # under a credential: a credential
    assert not any(SECRET in f for f in found)
    assert literal_secrets({"key": REF, "secret": " ${env:OTHER} "}) == []


# --------------------------------------------------------------------------- dlbatch submit
def _submit(monkeypatch, capsys, *sets):
    from dlbatch.cli import cluster
    from dlbatch.cli.main import main

    seen = {}

    class Client:
        def submit_job(self, entrypoint, runtime_env, **kw):
            wd = runtime_env["working_dir"]
            seen["files"] = {os.path.relpath(os.path.join(d, f), wd): open(os.path.join(d, f), "rb").read()
                             for d, _, fs in os.walk(wd) for f in fs}
            seen["env"] = json.dumps(runtime_env)
            return "raysubmit_test"

    def connect(address, timeout=10.0):
        seen["connected"] = address
        return Client()

    monkeypatch.setattr(cluster, "connect", connect)
    argv = ["submit", "jobs/papers_jsonl.yaml", "--address", "http://127.0.0.1:1", "--no-preflight"]
    for s in sets:
        argv += ["--set", s]
    rc = main(argv)
    return rc, capsys.readouterr(), seen


def test_submit_refuses_a_literal_credential_before_contacting_the_cluster(monkeypatch, capsys):
    rc, out, seen = _submit(monkeypatch, capsys,
                            f'input.storage_options={{key: AKIAEXAMPLE, secret: "{SECRET}", anon: false}}',
                            f"output.storage_options.client_kwargs={{aws_session_token: {SECRET}}}")
    assert rc == 2 and "connected" not in seen
    err = out.err.strip()
    assert len(err.splitlines()) == 1
    assert "input.storage_options.key, input.storage_options.secret" in err
    assert "output.storage_options.client_kwargs.aws_session_token" in err and "${env:NAME}" in err
    assert SECRET not in out.err + out.out


def test_uploaded_job_holds_references_not_secrets(monkeypatch, capsys):
    monkeypatch.setenv("DLB_TEST_SECRET", SECRET)  # set here too: nothing on this side may resolve it
    rc, out, seen = _submit(monkeypatch, capsys, f'input.storage_options={{key: "{REF}", secret: "{REF}"}}',
                            f'output.storage_options={{token: "{REF}"}}')
    assert rc == 0, out.err
    job = seen["files"]["_dlbatch_job.yaml"].decode()
    assert job.count(REF) == 3
    assert not [name for name, data in seen["files"].items() if SECRET.encode() in data]
    assert SECRET not in seen["env"] and SECRET not in out.err + out.out


def test_build_upload_refuses_a_literal_credential(tmp_path):
    from dlbatch.cli.cluster import build_upload

    spec = load_job("jobs/papers_jsonl.yaml", [f"output.storage_options={{password: {SECRET}}}"])
    with pytest.raises(ValueError, match=r"output\.storage_options\.password: a literal credential") as e:
        build_upload(spec, str(tmp_path))
    assert SECRET not in str(e.value) and not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- resolution where it is used
def test_env_references_resolve_where_the_filesystem_is_opened(monkeypatch):
    from connectors import listing, sink, text_sources

    monkeypatch.setenv("DLB_TEST_SECRET", SECRET)
    opts = {"token": REF, "client_kwargs": {"session": [REF, "plain"]}, "anon": False}
    want = {"token": SECRET, "client_kwargs": {"session": [SECRET, "plain"]}, "anon": False}
    assert resolve_options(opts) == want and opts["token"] == REF  # a copy: the job keeps its reference
    for to_fs in (listing._url_to_fs, sink._url_to_fs):
        fs, _ = to_fs("memory://creds/x", opts)
        assert fs.storage_options == want
    assert text_sources._fs_for("memory://creds/x", None, opts).storage_options == want


def test_reading_a_document_resolves_for_every_reader(monkeypatch):
    import fsspec

    from connectors.listing import read_document_file

    monkeypatch.setenv("DLB_TEST_SECRET", SECRET)
    fsspec.filesystem("memory").pipe_file("/creds/docs.jsonl", b'{"id": "a", "text": "hello"}\n')
    seen = []
    real = fsspec.core.url_to_fs
    monkeypatch.setattr(fsspec.core, "url_to_fs", lambda url, **kw: seen.append(kw) or real(url, **kw))
    rows = list(read_document_file("memory://creds/docs.jsonl", "jsonl", id_field="id", storage_options={"token": REF}))
    assert [r["doc_id"] for r in rows] == ["a"]
    assert seen and all(kw == {"token": SECRET} for kw in seen)


def test_a_missing_variable_names_key_and_variable(monkeypatch):
    from connectors.listing import list_inputs

    monkeypatch.delenv("DLB_TEST_MISSING", raising=False)
    with pytest.raises(MissingCredential, match=r"input\.storage_options\.client_kwargs\.token is "
                                                r"\$\{env:DLB_TEST_MISSING\}, but DLB_TEST_MISSING is not set"):
        resolve_options({"client_kwargs": {"token": "${env:DLB_TEST_MISSING}"}}, "input.storage_options")
    with pytest.raises(MissingCredential, match="DLB_TEST_MISSING is not set"):
        list_inputs("memory://creds/", "jsonl", {"token": "${env:DLB_TEST_MISSING}"})


# --------------------------------------------------------------------------- which references resolve
def test_a_reference_outside_the_credential_and_connection_keys_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setenv("DLB_TEST_SECRET", SECRET)
    with pytest.raises(JobSpecError) as e:
        load_job("jobs/papers_jsonl.yaml", ['input.storage_options={anon: "${env:DLB_TEST_SECRET}"}',
                                            'output.storage_options={client_kwargs: {verify: "${env:HOME}"}}'])
    msg = str(e.value)
    assert "input.storage_options.anon: ${env:DLB_TEST_SECRET} is not read here" in msg
    assert "output.storage_options.client_kwargs.verify: ${env:HOME} is not read here" in msg
    assert SECRET not in msg
    with pytest.raises(ReferenceNotAllowed, match=r"storage_options\.default_cache_type: \$\{env:HOME\}"):
        resolve_options({"default_cache_type": "${env:HOME}"})
    # credentials, anything nested under one, and the documented connection settings resolve
    ok = {"key": REF, "credentials": {"client_email": REF}, "profile": REF,
          "client_kwargs": {"endpoint_url": REF, "region_name": REF}}
    assert reference_problems(ok) == []
    assert resolve_options(ok)["client_kwargs"]["endpoint_url"] == SECRET


SECRET_ENDPOINT = "sk-live-7f3a9c0d-NOT-A-URL"  # a secret-looking value that is no endpoint: botocore echoes it
ENDPOINT_OPTS = '{anon: true, client_kwargs: {endpoint_url: "${env:DLB_TEST_ENDPOINT}"}}'


def test_errors_of_a_filesystem_opened_with_a_resolved_value_mask_it(monkeypatch):
    """The error as raised (what a dead letter, a report or a Ray task error would carry)."""
    from connectors.listing import list_inputs

    monkeypatch.setenv("DLB_TEST_ENDPOINT", SECRET_ENDPOINT)
    with pytest.raises(ValueError) as e:
        list_inputs("s3://bucket/in/", "jsonl", {"anon": True, "client_kwargs": {"endpoint_url": "${env:DLB_TEST_ENDPOINT}"}})
    assert "Invalid endpoint: ${env:DLB_TEST_ENDPOINT}" in str(e.value) and SECRET_ENDPOINT not in str(e.value)


@pytest.mark.parametrize("command,where", [("validate", "input"), ("run", "input"), ("validate", "output")])
def test_a_job_whose_endpoint_is_a_reference_fails_without_printing_its_value(monkeypatch, capsys, caplog, tmp_path,
                                                                             command, where):
    from dlbatch.cli.main import main

    monkeypatch.setenv("DLB_TEST_ENDPOINT", SECRET_ENDPOINT)
    docs = tmp_path / "in"
    docs.mkdir()
    (docs / "a.jsonl").write_text('{"text": "hello"}\n')
    sets = {"input": ["input.path=s3://bucket/in/", f"input.storage_options={ENDPOINT_OPTS}",
                      f"output.path={tmp_path / 'out'}"],
            "output": [f"input.path={docs}", "output.path=s3://bucket/out/", f"output.storage_options={ENDPOINT_OPTS}"]}
    argv = [command, "jobs/papers_jsonl.yaml"]
    for s in sets[where]:
        argv += ["--set", s]
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 2, out.err
    assert "Invalid endpoint: ${env:DLB_TEST_ENDPOINT}" in out.err
    assert SECRET_ENDPOINT not in out.out + out.err + caplog.text


# --------------------------------------------------------------------------- inside a run
def test_prompt_stage_gets_the_job_without_storage_options():
    spec = load_job("jobs/papers_jsonl.yaml", [f'input.storage_options={{key: "{SECRET}"}}',
                                               f'output.storage_options={{token: "{SECRET}"}}'])
    bare = without_storage_options(spec)
    assert bare.input.storage_options == {} and bare.output.storage_options == {}
    assert bare.tasks == spec.tasks and bare.input.path == spec.input.path
    assert spec.input.storage_options == {"key": SECRET}  # the driver's own job is unchanged


@pytest.mark.ray
def test_no_storage_option_among_the_pipelines_task_and_actor_arguments(ray_local, tmp_path, monkeypatch):
    """The papers pipeline as built for a run: the parse task's kwargs and the prompt actors'
    constructor kwargs, pickled as Ray ships them, hold no credential (the driver, which
    lists the inputs and cuts them into read tasks, resolves the options on its side)."""
    from ray import cloudpickle

    from pipelines.papers import build

    monkeypatch.setenv("DLB_TEST_SECRET", SECRET)

    doc = tmp_path / "docs.jsonl"
    doc.write_text('{"id": "a", "text": "hello"}\n')
    spec = load_job("jobs/papers_jsonl.yaml", [f"input.path={doc}", "input.format=jsonl",
                                               f'input.storage_options={{key: "{SECRET}", token: "{REF}"}}',
                                               f'output.storage_options={{password: "{SECRET}"}}'])
    ds = build(spec, [str(doc)], set(), max_model_len=2048)
    args = []
    op = ds._logical_plan.dag
    while op is not None:
        for name in ("fn_kwargs", "fn_constructor_kwargs"):  # Ray Data's logical map operators
            args.append(getattr(op, name, None) or getattr(op, "_" + name, None))
        op = op.input_dependencies[0] if op.input_dependencies else None
    args = [a for a in args if a]
    assert len(args) == 2  # the parse stage's kwargs, the prompt actors' constructor kwargs
    assert all(SECRET.encode() not in cloudpickle.dumps(a) for a in args)
    parse_kwargs = next(a for a in args if "storage_options" in a)
    assert isinstance(parse_kwargs["storage_options"], ray_local.ObjectRef)
    assert ray_local.get(parse_kwargs["storage_options"]) == {"key": SECRET, "token": REF}


@pytest.mark.ray
def test_a_sealed_reference_resolves_in_the_parse_task_from_its_own_environment(ray_local, tmp_path, monkeypatch):
    """Through Ray Data, as the pipeline runs it: the ObjectRef nested in the stage's kwargs
    is read on the worker, and ``${env:NAME}`` takes the worker's value, not the driver's."""
    import fsspec

    from connectors.parse import parse_file

    monkeypatch.setenv("DLB_TEST_SECRET", "the-drivers-value")
    doc = tmp_path / "docs.jsonl"
    doc.write_text('{"id": "a", "text": "hello"}\n')
    real = fsspec.core.url_to_fs

    def spy(row):
        fs, _ = real(row["url"], **resolve_options(row_opts))
        return [{"token": fs.storage_options.get("token")}]

    row_opts = seal({"token": REF})
    ds = ray_local.data.from_items([{"url": str(doc)}])
    got = ds.flat_map(parse_file, fn_kwargs=dict(fmt="jsonl", text_field="text", id_field="id",
                                                 storage_options=row_opts, max_pages=None),
                      runtime_env={"env_vars": {"DLB_TEST_SECRET": "the-nodes-value"}}).take_all()
    assert [r["doc_id"] for r in got] == ["a"] and not got[0]["error"]
    tokens = ds.flat_map(spy, runtime_env={"env_vars": {"DLB_TEST_SECRET": "the-nodes-value"}}).take_all()
    assert tokens == [{"token": "the-nodes-value"}]

"""``input.format: hf`` by Hub id (connectors/hf_hub.py) on an offline machine whose
``datasets`` cache holds the dataset: read by id with config and split, streaming or not,
clear errors for an unknown id/config/split, versions, validate/status, one `dlbatch run`.

The cache is laid out as ``load_dataset("org/name", name=cfg)`` leaves it after a download
(``$HF_HOME/datasets/org___name/<config>/<version>/<hash>/`` with ``dataset_info.json`` and
``name-<split>.arrow``): the fixture builds a local dataset repo as the Hub would serve it
(Parquet files, two configs declared in README.md, two splits each), prepares each config
with ``datasets`` itself, and moves the prepared folder under the Hub id's name.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from connectors import list_inputs, read_document_file
from connectors.hf_hub import HubDatasetError, hub_url
from dlbatch.jobspec import JobSpecError, load_job

ROWS = {(cfg, split): [f"{cfg} {split} paper {i}: graph networks learn molecular properties from atoms and "
                       f"bonds, tested on {i + 3} data sets." for i in range(3 if split == "train" else 2)]
        for cfg in ("en", "fr") for split in ("train", "test")}
README = "---\nconfigs:\n" + "".join(
    f"- config_name: {cfg}\n  data_files:\n" + "".join(f"  - split: {s}\n    path: {cfg}/{s}.parquet\n"
                                                        for s in ("train", "test"))
    for cfg in ("en", "fr")) + "---\n"
HF_ENV = ("HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT")


def _prepare_cache(root) -> dict:
    """Build the repo and the prepared cache under ``root``; returns the HF environment."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = root / "repo" / "name"
    for (cfg, split), texts in ROWS.items():
        (repo / cfg).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": texts, "label": list(range(len(texts)))}), repo / cfg / f"{split}.parquet")
    (repo / "README.md").write_text(README)
    cache = root / "home" / "datasets"
    for cfg in ("en", "fr"):
        datasets.load_dataset_builder(str(repo), name=cfg, cache_dir=str(cache)).download_and_prepare()
    os.rename(cache / "name", cache / "org___name")  # as a download of org/name names it
    return {"HF_HOME": str(root / "home"), "HF_HUB_CACHE": str(root / "home" / "hub"),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    return _prepare_cache(tmp_path_factory.mktemp("hfhub"))


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    for k in HF_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in hub_cache.items():
        monkeypatch.setenv(k, v)
    return hub_cache


def _texts(url, **kw):
    return [(r["source"].rsplit("#", 1)[1], r["text"], r["doc_id"], r["error"])
            for r in read_document_file(url, "hf", **kw)]


def test_read_by_id_with_config_and_split(offline_hub):
    url = hub_url("org/name", config="fr", split="test")
    assert list_inputs(url, "hf") == [url]
    rows = list(read_document_file(url, "hf"))
    assert [r["text"] for r in rows] == ROWS[("fr", "test")]
    assert [r["source"] for r in rows] == [f"{url}#test/row0", f"{url}#test/row1"]
    assert all(r["error"] is None for r in rows)
    # the default split is train; input.limit's cut takes the first rows in stored order
    train = hub_url("org/name", config="en")
    assert [t for _, t, _, _ in _texts(train)] == ROWS[("en", "train")]
    assert [t for _, t, _, _ in _texts(train, max_rows=2)] == ROWS[("en", "train")][:2]
    from connectors.listing import count_rows, limited_reads

    assert count_rows(train, "hf", 1 << 62) == 3 and limited_reads([train], "hf", 2) == [(train, 2)]


def test_streaming_gives_the_same_rows(offline_hub):
    for cfg, split in (("en", "train"), ("fr", "test")):
        plain = _texts(hub_url("org/name", config=cfg, split=split))
        streamed = _texts(hub_url("org/name", config=cfg, split=split, streaming=True))
        assert plain == streamed and [t for _, t, _, _ in plain] == ROWS[(cfg, split)]
    import datasets

    from connectors.hf_hub import cache_dir

    ds = datasets.load_dataset("org/name", name="en", split="train", streaming=True, cache_dir=cache_dir())
    assert isinstance(ds, datasets.IterableDataset)  # what streaming reads: lazily, never whole


def test_a_hub_split_is_read_in_row_parts(offline_hub):
    """Read tasks of a Hub dataset (connectors/read_tasks.py): its split cut by rows from the
    sizes the dataset states, each part's rows numbered as in the whole split; a streamed
    dataset is one task, and a part of it reads the same rows."""
    from connectors.part import WHOLE, Part
    from connectors.parse import parse_file
    from connectors.read_tasks import plan_read_tasks
    from connectors.splits import TaskSizes

    url = hub_url("org/name", config="en")
    whole = _texts(url)
    tasks = plan_read_tasks([(url, None)], "hf", sizes=TaskSizes(target=1), first_bytes=1)
    assert [(t.part.start, t.part.stop) for t in tasks] == [(0, 1), (1, 2), (2, None)]
    rows = [r for t in tasks for r in parse_file(t.row(), "hf", "text", None, None, None)]
    assert [(r["source"].rsplit("#", 1)[1], r["text"], r["doc_id"], r["error"]) for r in rows] == whole
    capped = plan_read_tasks([(url, 2)], "hf", sizes=TaskSizes(target=1), first_bytes=1)
    assert [(t.part.start, t.part.stop, t.max_rows) for t in capped] == [(0, 1, None), (1, 2, None)]
    streamed = hub_url("org/name", config="en", streaming=True)
    (one,) = plan_read_tasks([(streamed, None)], "hf", sizes=TaskSizes(target=1), first_bytes=1)
    assert one.part == WHOLE
    assert _texts(streamed, part=Part(1, 3)) == whole[1:3]


def test_unknown_id_config_split_are_one_clear_error(offline_hub):
    with pytest.raises(HubDatasetError, match=r"'org/name' config 'de': no such config .*en, fr"):
        list_inputs(hub_url("org/name", config="de"), "hf")
    with pytest.raises(HubDatasetError, match=r"'org/name' config 'fr': no split 'nope' \(splits: \['test', 'train'\]\)"):
        list_inputs(hub_url("org/name", config="fr", split="nope"), "hf")
    with pytest.raises(HubDatasetError, match=r"'org/missing'.*datasets cache .* not there.*offline mode"):
        list_inputs(hub_url("org/missing"), "hf")
    with pytest.raises(HubDatasetError, match=r"several configs \(en, fr\): name one in input.config"):
        list_inputs(hub_url("org/name"), "hf")
    with pytest.raises(HubDatasetError, match="no split 'nope'"):  # the reader says the same
        list(read_document_file(hub_url("org/name", config="fr", split="nope"), "hf"))


def test_unreachable_hub_gives_up_fast(offline_hub, monkeypatch):
    """Online mode with a Hub that does not answer: read from the cache, or fail at once."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: the connection is refused at once
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t = time.time()
    assert [t for _, t, _, _ in _texts(hub_url("org/name", config="fr", split="test"))] == ROWS[("fr", "test")]
    with pytest.raises(HubDatasetError, match=r"'org/missing'.*does not answer"):
        list_inputs(hub_url("org/missing"), "hf")
    assert time.time() - t < 30


def test_version_changes_with_the_dataset(offline_hub):
    import shutil
    from pathlib import Path

    from connectors.versions import input_versions, source_file

    url = hub_url("org/name", config="fr", split="test")
    v1 = input_versions([url])[url]
    assert v1[0] is None and v1[1].startswith("hf:") and input_versions([url]) == {url: v1}
    assert source_file(f"{url}#test/row1") == url
    # a newer revision prepared next to the old one (another hash folder, more rows): a changed input
    old = next((Path(offline_hub["HF_HOME"]) / "datasets" / "org___name" / "fr" / "0.0.0").glob("*[!k]"))
    new = old.with_name("0123456789abcdef")
    shutil.copytree(old, new)
    try:
        os.utime(new, (time.time() + 10, time.time() + 10))
        assert input_versions([url])[url][1] != v1[1]
    finally:
        shutil.rmtree(new)


def test_jobspec_folds_the_settings_into_the_input(offline_hub, tmp_path):
    spec = load_job("jobs/papers_jsonl.yaml", ["input.format=hf", "input.path=org/name", "input.config=fr",
                                               "input.split=test", "input.streaming=true",
                                               f"output.path={tmp_path / 'out'}"])
    assert spec.input.path == "hf-dataset://org/name?config=fr&split=test&streaming=1"
    assert (spec.input.config, spec.input.split, spec.input.streaming) == ("fr", "test", True)
    again = type(spec.input).model_validate(spec.input.model_dump())
    assert again.path == spec.input.path
    assert load_job("jobs/papers_jsonl.yaml", ["input.format=hf", "input.path=org/name"]).input.path == \
        "hf-dataset://org/name?split=train"
    with pytest.raises(JobSpecError, match="input.split applies to input.format hf"):
        load_job("jobs/papers_jsonl.yaml", ["input.split=test"])
    with pytest.raises(JobSpecError, match="input.config applies to a Hub dataset id"):
        load_job("jobs/papers_jsonl.yaml", ["input.format=hf", f"input.path={tmp_path}", "input.config=fr"])


def test_validate_and_status(offline_hub, tmp_path, capsys):
    from dlbatch.cli.main import main
    from dlbatch.output.status import job_status

    sets = ["input.format=hf", "input.path=org/name", "input.config=en", f"output.path={tmp_path / 'out'}",
            "cluster.colocated={chip: fast, replicas: 1, num_cpus: 0.5}"]
    args = [a for s in sets for a in ("--set", s)]
    assert main(["validate", "jobs/papers.yaml", "--docs", "1", *args]) == 0
    out = capsys.readouterr().out
    assert "inputs: Hub dataset hf-dataset://org/name?config=en&split=train, 3 rows" in out
    assert ROWS[("en", "train")][0][:30] in out or "en train paper 0" in out
    st = job_status(load_job("jobs/papers.yaml", sets))
    assert (st["docs_total"], st["docs_done"], st["docs_pending"]) == (3, 0, 3)
    bad = [a for s in [*sets, "input.config=de"] for a in ("--set", s)]
    assert main(["validate", "jobs/papers.yaml", *bad]) == 2
    assert "no such config" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.ray
def test_dlbatch_run_over_a_hub_dataset(offline_hub, sample_model, raytmp, tmp_path):
    """`dlbatch run` in a subprocess (its own Ray, whose workers read the same cache), then
    status, then a second run that finds nothing to do."""
    from tests.helpers.jobs import REPO, output_rows, ray_env

    out = tmp_path / "out"
    sets = ["input.format=hf", "input.path=org/name", "input.config=fr", "input.split=test", "input.streaming=true",
            f"output.path={out}", "tasks.0.max_tokens=2", "tasks.1.max_tokens=2", "tasks.2.max_tokens=2",
            "model.max_model_len=1024", "model.dtype=float32", "cluster.colocated={chip: fast, replicas: 1, num_cpus: 0.5}"]
    env = {**ray_env(raytmp), **offline_hub}
    cmd = [sys.executable, "-m", "dlbatch.cli", "run", "jobs/papers.yaml", "--no-progress",
           *[a for s in sets for a in ("--set", s)]]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = output_rows(str(out))
    url = "hf-dataset://org/name?config=fr&split=test&streaming=1"
    assert sorted({r["source"] for r in rows}) == [f"{url}#test/row0", f"{url}#test/row1"]
    assert len(rows) == 6 and {r["task"] for r in rows} == {"summary", "keywords", "question"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "dlbatch.cli", "status", "jobs/papers.yaml",
                        *[a for s in sets for a in ("--set", s)]], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

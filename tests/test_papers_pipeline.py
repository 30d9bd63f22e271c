"""The papers pipeline's Ray Data plan: parse fused into the prompt actors, one block per
input file streamed out, the same request rows as the stages give without Ray."""
from __future__ import annotations

import glob
import os

import pytest

from dlbatch.jobspec import load_job
from pipelines.papers import data_plane_cores, prompt_actors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_prompt_actors_use_the_cores_the_engine_leaves():
    assert prompt_actors(2, 2) == (1, 1)  # 2 cores, one CPU worker with 2 threads: the engine keeps them
    assert prompt_actors(32, 4) == (1, 28)  # a cluster's CPUs less what its workers reserve
    assert prompt_actors(32, 4, blocks=5) == (1, 5)  # never more actors than blocks
    assert prompt_actors(16, 15.5) == (1, 1)
    assert prompt_actors(1, 0, parse_concurrency=3) == (1, 3)
    assert prompt_actors(0, 0) == (1, 1)


def test_data_plane_cores_count_the_workers_threads_on_the_embedded_local_ray(monkeypatch):
    import os

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    one = load_job(os.path.join(ROOT, "jobs/papers.yaml"),
                   ["cluster.colocated={chip: fast, replicas: 1, num_cpus: 1}"])
    assert data_plane_cores(one) == (16.0, 2.0)  # a run's only CPU pool takes 2 threads
    assert prompt_actors(*data_plane_cores(one)) == (1, 14)
    pd = load_job(os.path.join(ROOT, "jobs/papers.yaml"),
                  ["cluster.prefill={chip: fast, replicas: 2, num_cpus: 3}",
                   "cluster.decode={chip: cheap, replicas: 1, num_cpus: 0.5}"])
    assert data_plane_cores(pd) == (16.0, 2 * 3 + 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert prompt_actors(*data_plane_cores(one)) == (1, 1)


@pytest.mark.ray
def test_parse_fused_into_prompt_stage_streams_one_file_per_block(ray_local, sample_model, capsys):
    from pipelines.papers import build

    from connectors.parse import parse_file
    from tests.helpers.stage import prompt_stage

    spec = load_job(os.path.join(ROOT, "jobs/papers.yaml"), ["input.limit=3"])
    files = sorted(glob.glob(os.path.join(ROOT, "samples/papers/*.pdf")))[:3]
    ds = build(spec, files, set(), max_model_len=spec.model.max_model_len)
    ds.explain()
    plan = capsys.readouterr().out.split("Physical Plan (Optimized)")[-1]
    assert "ActorPoolMapOperator[FlatMap(parse_file)->MapBatches(PromptStage)]" in plan, plan
    batches = [b.to_pylist() for b in ds.iter_batches(batch_size=None, batch_format="pyarrow")]
    assert len(batches) == len(files)  # every file is its own block: the first one is not held for the others
    assert all(len({r["doc_id"] for r in b}) == 1 for b in batches)
    stage = prompt_stage(spec, [], map_reduce=True)
    expect = {}
    for f in files:
        for doc in parse_file({"url": f}, fmt="pdf", text_field="text", id_field=None, storage_options={},
                              max_pages=None):
            for r in stage.process(doc):
                expect[(r["doc_id"], r["task"])] = r["prompt_ids"]
    got = {(r["doc_id"], r["task"]): r["prompt_ids"] for b in batches for r in b}
    assert got == expect and len(got) == 3 * len(files)


@pytest.mark.ray
def test_one_jsonl_file_streams_in_parts_with_its_own_line_numbers(ray_local, sample_model, tmp_path, monkeypatch):
    """One JSONL file cut into read tasks (connectors/read_tasks.py): every part is a block of
    its own, so the first documents come out before the file is parsed, and the request rows
    are the whole file's (sources with the file's line numbers)."""
    import json

    import connectors.read_tasks as read_tasks
    from connectors.parse import parse_file
    from dlbatch.prompts.stage import PromptStage
    from pipelines.papers import build

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Paper {i} studies coastal fog at night. " * 3})
                           + ("\n\n" if i % 7 == 0 else "\n") for i in range(60)))
    monkeypatch.setattr(read_tasks, "READ_TASK_BYTES", 1500)
    monkeypatch.setattr(read_tasks, "FIRST_TASK_BYTES", 400)
    tasks = read_tasks.plan_read_tasks([(str(src), None)], "jsonl")
    assert len(tasks) > 4 and tasks[0].part.stop <= 600
    spec = load_job(os.path.join(ROOT, "jobs/papers_jsonl.yaml"), [f"input.path={src}", "input.id_field=id"])
    ds = build(spec, [str(src)], set(), max_model_len=spec.model.max_model_len, parse_concurrency=2)
    batches = [b.to_pylist() for b in ds.iter_batches(batch_size=None, batch_format="pyarrow")]
    assert len(batches) == len(tasks)  # one block per part
    stage = PromptStage(spec, [], map_reduce=True, max_model_len=spec.model.max_model_len)
    expect = {(r["doc_id"], r["task"]): (r["source"], r["prompt_ids"])
              for doc in parse_file({"url": str(src)}, "jsonl", "text", "id", {}, None) for r in stage.process(doc)}
    got = {(r["doc_id"], r["task"]): (r["source"], r["prompt_ids"]) for b in batches for r in b}
    assert got == expect and len(got) == 60 * len(spec.tasks)
    assert got[("d8", "summary")][0] == f"{src}#line{8 + 3}"  # after d0 and d7 a blank line

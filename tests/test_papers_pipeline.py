"""The papers pipeline's Ray Data plan: parse fused into the prompt actors, one block per
input file streamed out, the same request rows as the stages give without Ray."""
from __future__ import annotations

import glob
import os

import pytest

from dlbatch.jobspec import load_job
from pipelines.papers import CPUS_PER_PROMPT_ACTOR, prompt_actors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_prompt_actors_one_locally_more_on_a_cluster():
    assert prompt_actors(8) == (1, 1)  # the embedded local Ray on 2 cores declares 8 logical CPUs
    assert prompt_actors(4 * 32) == (1, 4 * 32 // CPUS_PER_PROMPT_ACTOR)
    assert prompt_actors(1, parse_concurrency=3) == (1, 3)
    assert prompt_actors(0) == (1, 1)


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

"""`long_inputs: chunk` end to end in the driver's plain objects: the real PromptStage plans
the chunks of a document too long for the context, the Dispatcher runs its map requests,
MapReduce adds the reduce requests once the maps are done (recursively when the notes do
not fit), and the document commits one row per task with the final answer. No Ray, no
model: fake workers answer each request with a note naming it."""
from __future__ import annotations

import pytest

from dlbatch.driver.dispatch import Dispatcher
from dlbatch.jobspec import load_job
from dlbatch.prompts.map_reduce import MapReduce
from dlbatch.driver.retry_policy import RetryPolicy
from dlbatch.router import Router, RouterConfig
from dlbatch.records import PART_SEP, request_id
from tests.helpers.stage import prompt_stage

PARA = ("Paragraph {i} of the long paper reports that perovskite absorbers lose efficiency under heat, "
        "humidity and light, and that encapsulation slows the loss by a factor the authors measure. ")


def _spec(tmp_path, extra=()):
    sets = ["long_inputs=chunk", "model.max_model_len=768", "chunking.map_max_tokens=24",
            "chunking.overlap_tokens=16", "tasks.0.max_tokens=16", "tasks.1.max_tokens=8", "tasks.2.max_tokens=8",
            f"output.path={tmp_path / 'out'}", *extra]
    return load_job("jobs/papers.yaml", sets)


def _doc(n_paras: int):
    text = "\n\n".join(PARA.format(i=i) * 2 for i in range(n_paras))
    return {"doc_id": "long1", "source": "long1.pdf", "title": "Stability of perovskite cells", "pages": 12,
            "text": text}


def _run(spec, rows, notes=lambda rid: f"note on {rid}", fail_once=()):
    """Drive a Dispatcher over `rows` with fake workers; returns (committed rows, submitted
    rounds as lists of request names)."""
    mr = MapReduce(spec, prompt_stage(spec, map_reduce=True).tok)
    d = Dispatcher({"colocated": 2}, Router(2, RouterConfig(window=64)), RetryPolicy(max_attempts=3),
                   max_batch_tokens=4096, inflight_cap=8, window=64, more_requests=mr.more_requests)
    for r in rows:
        d.add_row(MapReduce.request_row(r))
    rounds, failed = [], set(fail_once)
    while not d.finished():
        bs = d.next_batches()
        assert bs, "the dispatcher stalled"
        rounds.append([r["task"] for b in bs for r in b.rows])
        for b in bs:
            if any(r["task"] in failed for r in b.rows):  # the worker died under this batch
                failed.clear()
                d.batch_failed(b.id, "ActorDiedError: killed")
                d.worker_back(b.front)
                continue
            d.batch_done(b.id, [{"request_id": request_id(r), "output": notes(request_id(r)), "output_tokens": 5,
                                 "finish_reason": "stop"} for r in b.rows])
    out = []
    for doc in d.take_completed():
        out += mr.output_rows(doc, "m")
    return out, rounds


def test_chunked_document_maps_then_reduces_one_row_per_task(tmp_path):
    spec = _spec(tmp_path)
    rows = prompt_stage(spec, map_reduce=True).process(_doc(24))
    assert rows and all(r["long_input_policy"] == "chunk" and not r["error"] for r in rows)
    n_chunks = rows[0]["chunk_count"]
    assert n_chunks >= 3 and len(rows) == 3 * n_chunks
    assert all(len(r["prompt_ids"]) + r["max_tokens"] <= 768 for r in rows)
    out, rounds = _run(spec, rows)
    # every map of the document ran before any reduce was submitted
    first_reduce = next(i for i, rd in enumerate(rounds) if any("reduce:" in t for t in rd))
    maps_before = [t for rd in rounds[:first_reduce] for t in rd]
    assert len(maps_before) == 3 * n_chunks and all("#map:" in t for t in maps_before)
    assert sorted(r["task"] for r in out) == ["keywords", "question", "summary"]
    for r in out:
        assert r["chunks"] == n_chunks and r["truncated"] is False and r["long_input_policy"] == "chunk"
        # the answer is the output of the task's final reduce request
        assert r["output"].startswith(f"note on long1::{r['task']}{PART_SEP}reduce:{r['task']}:")
        assert r["doc_tokens"] > 768 and r["prompt_tokens"] > r["doc_tokens"]  # all its requests together


def test_recursive_reduce_when_notes_do_not_fit(tmp_path):
    spec = _spec(tmp_path, ["chunking.map_max_tokens=120"])
    rows = prompt_stage(spec, map_reduce=True).process(_doc(60))
    n_chunks = rows[0]["chunk_count"]
    long_note = " ".join(["finding"] * 110)  # about map_max_tokens tokens per note: 9+ of them do not fit
    out, rounds = _run(spec, rows, notes=lambda rid: f"{rid} {long_note}")
    levels = {t.split(":")[2] for rd in rounds for t in rd if "reduce:" in t}
    assert len(levels) >= 2, f"{n_chunks} chunks of notes must need more than one reduce level: {levels}"
    assert sorted(r["task"] for r in out) == ["keywords", "question", "summary"]


def test_a_lost_map_batch_is_redone_and_the_document_still_completes_once(tmp_path):
    spec = _spec(tmp_path)
    rows = prompt_stage(spec, map_reduce=True).process(_doc(24))
    victim = MapReduce.request_row(rows[1])["task"]
    out, rounds = _run(spec, rows, fail_once={victim})
    assert sum(t == victim for rd in rounds for t in rd) == 2
    assert sorted(r["task"] for r in out) == ["keywords", "question", "summary"]


def test_chunk_without_the_driver_is_a_clear_dead_letter(tmp_path):
    spec = _spec(tmp_path)
    rows = prompt_stage(spec, map_reduce=False).process(_doc(24))
    assert len(rows) == 1 and rows[0]["error_type"] == "LongInput" and "map-reduce" in rows[0]["error"]


@pytest.mark.parametrize("policy", ["truncate", "middle"])
def test_cut_policies_mark_rows(tmp_path, policy):
    spec = _spec(tmp_path, [f"long_inputs={policy}"])
    rows = prompt_stage(spec, map_reduce=True).process(_doc(24))
    assert len(rows) == 3 and all(r["truncated"] and r["long_input_policy"] == policy for r in rows)
    assert all(r["kept_tokens"] < r["doc_tokens"] for r in rows)

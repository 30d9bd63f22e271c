"""Sampling per task: a task's own temperature/top_p/top_k/seed/stop over the job's."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from dlbatch.jobspec import JobSpecError, job_fingerprint, load_job
from dlbatch.prompts.sampling import task_sampling

OWN = 'tasks.1.sampling={temperature: 0.8, top_k: 40, seed: 7, stop: [","]}'


def test_a_tasks_own_fields_replace_the_jobs():
    spec = load_job("jobs/papers.yaml", [OWN, "sampling.top_p=0.9"])
    kw = task_sampling(spec, "keywords")
    assert (kw.temperature, kw.top_p, kw.top_k, kw.seed, kw.stop) == (0.8, 0.9, 40, 7, [","])
    s = task_sampling(spec, "summary")
    assert (s.temperature, s.top_p, s.seed, s.stop) == (0.0, 0.9, 0, [])
    assert task_sampling(spec, "keywords#c3").seed == 7  # a chunked task's notes sample like the task


def test_the_fingerprint_sees_task_sampling_and_stop_and_old_jobs_keep_theirs():
    base = load_job("jobs/papers.yaml")
    assert job_fingerprint(load_job("jobs/papers.yaml", ["sampling.stop=[]"])) == job_fingerprint(base)
    assert job_fingerprint(load_job("jobs/papers.yaml", [OWN])) != job_fingerprint(base)
    assert job_fingerprint(load_job("jobs/papers.yaml", ['sampling.stop=["END"]'])) != job_fingerprint(base)


def test_bad_task_sampling_is_refused_naming_the_field():
    with pytest.raises(JobSpecError, match="tasks.0.sampling.top_p"):
        load_job("jobs/papers.yaml", ["tasks.0.sampling={top_p: 1.5}"])
    with pytest.raises(JobSpecError, match="stop"):
        load_job("jobs/papers.yaml", ['tasks.0.sampling={stop: [""]}'])


def test_each_request_carries_its_tasks_sampling():
    from dlbatch.driver.loop import DispatchLoop

    spec = load_job("jobs/papers.yaml", [OWN])
    rows = [{"doc_id": "d", "task": t, "prompt_ids": [1, 2], "max_tokens": 4, "seed": 11}
            for t in ("summary", "keywords", "keywords#c0")]
    items = DispatchLoop._items_for(SimpleNamespace(spec=spec, constraints={}), rows)
    assert [(i["temperature"], i["top_k"], i["seed"], i.get("stop")) for i in items] == [
        (0.0, 0, None, None), (0.8, 40, 11, [","]), (0.8, 40, 11, [","])]


def test_extras_reach_the_request_and_a_rows_own_sampling_wins():
    from dlbatch.driver.loop import DispatchLoop

    spec = load_job("jobs/papers.yaml", ["tasks.1.sampling={temperature: 0.7, n: 3, logprobs: 2, min_p: 0.1, "
                                         "presence_penalty: 0.5}", "sampling.repetition_penalty=1.1"])
    rows = [{"doc_id": "d", "task": t, "prompt_ids": [1], "max_tokens": 4, "seed": 5}
            for t in ("summary", "keywords", "keywords#c0")]
    rows.append({**rows[1], "doc_id": "e", "sampling": '{"n": 1, "temperature": 0.0, "max_tokens": 2}'})
    items = DispatchLoop._items_for(SimpleNamespace(spec=spec, constraints={}), rows)
    keys = ("temperature", "n", "logprobs", "min_p", "presence_penalty", "repetition_penalty", "seed")
    assert [tuple(i.get(k) for k in keys) for i in items] == [
        (0.0, None, None, None, None, 1.1, None),
        (0.7, None, 2, 0.1, 0.5, 1.1, 5),  # n samples are n rows (expand_samples), not an item key
        (0.7, None, None, 0.1, 0.5, 1.1, 5),  # a chunked task's notes: one sample, no logprobs
        (0.0, None, 2, 0.1, 0.5, 1.1, None)]      # the row's own (an OpenAI batch line's body)


def test_n_samples_are_n_rows_seeded_seed_plus_i():
    from dlbatch.prompts.sampling import expand_samples
    from dlbatch.records import base_task

    spec = load_job("jobs/papers.yaml", ["tasks.1.sampling={n: 3}"])
    rows = [{"doc_id": "d", "task": t, "seed": 40} for t in ("summary", "keywords", "keywords#c0")]
    rows.append({"doc_id": "e", "task": "summary", "seed": 9, "sampling": '{"n": 2}'})
    got = [(r["doc_id"], r["task"], r["seed"]) for r in expand_samples(spec, rows)]
    assert got == [("d", "summary", 40), ("d", "keywords", 40), ("d", "keywords~1", 41), ("d", "keywords~2", 42),
                   ("d", "keywords#c0", 40), ("e", "summary", 9), ("e", "summary~1", 10)]
    assert base_task("keywords~2") == base_task("keywords#c1") == "keywords"


def test_extras_are_validated_and_in_the_fingerprint_only_when_set():
    base = load_job("jobs/papers.yaml")
    assert job_fingerprint(load_job("jobs/papers.yaml", ["sampling.n=2"])) != job_fingerprint(base)
    assert job_fingerprint(load_job("jobs/papers.yaml", ["sampling.logprobs=null"])) == job_fingerprint(base)
    with pytest.raises(JobSpecError, match="tasks.0.sampling.min_p"):
        load_job("jobs/papers.yaml", ["tasks.0.sampling={min_p: 2}"])
    with pytest.raises(JobSpecError, match="sampling.n"):
        load_job("jobs/papers.yaml", ["sampling.n=0"])

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

"""The sampling each request runs with.

A job's ``sampling`` applies to every task; a task's own ``sampling`` replaces the fields it
sets (temperature, top_p, top_k, seed, stop) for that task only. Each (document, task) then
draws with its own seed, `dlbatch.prompts.stage.derive_seed(task seed, doc_id, task)`, so
reruns and retries sample the same tokens whatever the batching.
"""
from __future__ import annotations


def task_sampling(spec, task: str):
    """The job's ``sampling`` with the task's own fields over it. ``task`` may be a
    map-reduce request's ``<task>#<key>``: its notes sample like the task."""
    base = spec.sampling
    t = next((t for t in spec.tasks if t.name == task.split("#", 1)[0]), None)
    own = getattr(t, "sampling", None)
    if own is None:
        return base
    return base.model_copy(update={k: v for k, v in own.model_dump().items() if v is not None})

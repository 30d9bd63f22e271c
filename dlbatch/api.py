"""The Python API: build or load a job, run it over files or a `ray.data.Dataset`, and read
what it committed. The CLI's `dlbatch run` is a thin layer over `run` (argument parsing,
messages, exit codes).

    import dlbatch
    result = dlbatch.run("jobs/papers.yaml", input={"limit": 2}, model={"dtype": "float32"})
    result.docs_ok, result.output          # what the run did, where it wrote
    table = result.rows()                   # every committed row (pyarrow.Table)
    ds = result.dataset()                   # ... as a ray.data.Dataset

    ds = ray.data.read_parquet("s3://bucket/questions/")
    job = {"name": "qa", "pipeline": "papers", "input": {"id_field": "qid", "text_field": "passage"},
           "output": {"path": "out/qa", "keep_columns": ["qid"]},
           "tasks": [{"name": "answer", "prompt": "{{ text }}\\n\\nQ: {{ row.question }}\\nA:", "max_tokens": 64}]}
    result = dlbatch.run(job, dataset=ds)

``job`` is a path (or fsspec URL) of a job file, a dict shaped like one, or a validated
`dlbatch.jobspec.JobSpec`. Keyword sections (``input={...}``, ``model={...}``, ``tasks=[...]``)
are merged into it (mappings key by key, lists replaced); ``overrides`` takes ``--set`` style
``"key.path=value"`` strings (or a ``{key.path: value}`` dict) after that. The job is then
validated exactly as a job file is.

A dataset input: the job's rows come from ``dataset`` (``input.format: dataset``, set for you
when the job names no format). Exactly once and resume work as for files: ``input.id_field``
names each row (recommended: a stable id column; without it, the content id of the text, as
for files), a rerun skips every committed or dead-lettered id, and a killed run's rerun
commits each row once. Python logic around the prompts goes in a pipeline of one's own,
registered from an installed package (pipelines/__init__.py: ``preprocess``, ``postprocess``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

SECTIONS = ("name", "pipeline", "input", "output", "model", "tasks", "sampling", "long_inputs", "chunking", "router",
            "batching", "retries", "cluster")


@dataclass(frozen=True)
class RunResult:
    """What a run did and where its rows are. ``report``: the run report (``_report.json``'s
    figures; for a no-op rerun, the counts of what the output already held)."""

    job: str
    output: str
    docs_ok: int
    docs_failed: int
    rows_written: int
    noop: bool
    spec: Any = field(repr=False)
    report: dict = field(repr=False, default_factory=dict)

    def rows(self, columns: list[str] | None = None):
        """Every committed result row of the job's output, as a pyarrow Table."""
        from dlbatch.output import open_store

        return open_store(self.spec.output).results(columns)

    def errors(self):
        """Every dead letter (document or task that failed, with the reason), as a pyarrow Table."""
        from dlbatch.output import open_store

        return open_store(self.spec.output).errors()

    def dataset(self):
        """The committed rows as a ray.data.Dataset (in the current Ray session)."""
        import ray.data

        return ray.data.from_arrow(self.rows())


def load(job, overrides=None, **sections):
    """A validated `JobSpec` from a job file path, a dict or a JobSpec, with ``sections``
    merged in and ``overrides`` (``key.path=value``) applied."""
    from dlbatch.jobspec import JobSpec, apply_overrides, inline_schema_files, load_job, parse_job

    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise TypeError(f"unknown job section(s) {', '.join(unknown)}; sections: {', '.join(SECTIONS)}")
    sets = _set_strings(overrides)
    if isinstance(job, JobSpec) and not sections and not sets:
        return job
    if isinstance(job, str) and not sections:
        return load_job(job, sets)
    if isinstance(job, str):
        data, source = load_job(job).to_dict(), job
    elif isinstance(job, JobSpec):
        data, source = job.to_dict(), job.source
    elif isinstance(job, Mapping):
        data, source = copy.deepcopy(dict(job)), "<dict>"
    else:
        raise TypeError(f"job must be a job file path, a dict or a JobSpec, got {type(job).__name__}")
    data = apply_overrides(_merge(data, sections), sets, source=source)
    return parse_job(inline_schema_files(data, source), source=source)


def run(job, dataset=None, *, overrides=None, fresh: bool = False, plan: dict | None = None,
        progress: bool | None = False, options: Mapping[str, Any] | None = None, **sections) -> RunResult:
    """Run ``job`` (see `load`) to completion, over ``dataset`` when given; -> `RunResult`.
    ``options``: the runner's own settings (`dlbatch.driver.runner.JobRunner`: flush_docs,
    flush_seconds, resource_timeout_s, stall_timeout_s, input_timeout_s, compact_min_parts).
    Raises what a failed run raises (`dlbatch.driver.runner.JobFailed`, `LeaseHeld` when
    another process writes the output, `ValueError` for a bad job)."""
    from dlbatch.driver.runner import JobRunner

    if dataset is not None and "format" not in (sections.get("input") or {}):  # the rows come from the dataset
        sections = {**sections, "input": {**(sections.get("input") or {}), "format": "dataset", "path": "dataset://"}}
    spec = load(job, overrides, **sections)
    report = JobRunner(spec, fresh=fresh, plan=plan, progress=progress, dataset=dataset, **dict(options or {})).run()
    return RunResult(job=spec.name, output=spec.output.path, docs_ok=int(report.get("docs_ok", 0)),
                     docs_failed=int(report.get("docs_failed", 0)), rows_written=int(report.get("rows_written", 0)),
                     noop=bool(report.get("noop")), spec=spec, report=dict(report))


def _merge(base: dict, sections: Mapping[str, Any]) -> dict:
    """``base`` with ``sections`` merged in: mappings key by key (recursively), anything else replaced."""
    out = copy.deepcopy(base)
    for k, v in sections.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _set_strings(overrides) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return [overrides]
    if isinstance(overrides, Mapping):
        import json

        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    return [str(o) for o in overrides]

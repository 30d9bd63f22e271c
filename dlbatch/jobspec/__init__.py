"""The job file: a YAML document validated into a :class:`JobSpec`.

This is the user boundary, so every model forbids unknown keys and is strict
about types (``max_tokens: "16"`` is an error, not a silent cast). Every
problem is reported as a :class:`JobSpecError` whose message names the file,
the key path and the offending value, one line per problem::

    jobs/x.yaml: model.dtype: 'fp8' is not one of float32, bfloat16, float16

Usage::

    spec = load_job("jobs/papers.yaml", ["model.dtype=float32", "input.limit=3"])
    spec.model.dtype            # 'float32'
    spec.to_dict()              # plain, JSON-able dict (parse_job(spec.to_dict()) == spec)
    job_fingerprint(spec)       # hash of what determines the outputs

Paths: a relative ``input.path`` / ``output.path`` is resolved against the
current working directory at load time (``~`` is expanded); URLs
(``s3://``, ``gs://``, ``memory://``, ``file://`` ...) are left as written.
For ``input.format: hf`` the path is a dataset name unless it exists locally.
``output.path`` must not be a directory whose deletion (``--fresh``) would be
a disaster: empty, ``/``, ``~``, the home directory, the working directory or
any directory above them, or the root of a bucket. It must not be an existing
file, nor the input folder or a folder inside it (its parts would be read back
as inputs).

Checks across sections run after the models validate (:func:`parse_job`): the
output folder against the input folder, and every task's ``max_tokens`` below
the job's ``max_model_len``, by the rule of the job's backend (`dlbatch.backends`).
:func:`load_job` also reads the model's own context from its ``config.json`` when
``model.max_model_len`` is not set (:func:`model_context`); a run checks the budgets again
against the context it resolves (:func:`token_budget_problems`). Prompt templates are
compiled and rendered once against a sample document (`dlbatch.prompts.templates.check_template`).

The package, one module per section of the job file: `inputs`, `outputs`, `model`,
`tasks` (tasks, sampling, chunking), `cluster` (router, batching, retries, cluster); `spec`
(JobSpec and its cross-section checks), `load` (YAML -> JobSpec), `overrides` (``--set``),
`fingerprint` (what a resume compares), `errors`, `paths`, `keys` (schema key paths).
"""
from __future__ import annotations

from dlbatch.jobspec.cluster import BatchingSpec, ClusterSpec, PoolSpec, RetriesSpec, RouterSpec, check_pool_device
from dlbatch.jobspec.errors import JobSpecError, ResumeMismatchError
from dlbatch.jobspec.fingerprint import (CONTENT_KEYS, check_resume_compatible, content_fields, fingerprint_diff,
                                         fingerprint_fields, job_fingerprint)
from dlbatch.jobspec.inputs import InputSpec
from dlbatch.jobspec.load import inline_schema_files, load_job, model_context, parse_job, token_budget_problems
from dlbatch.jobspec.model import ModelSpec
from dlbatch.jobspec.outputs import OutputSpec
from dlbatch.jobspec.overrides import apply_overrides
from dlbatch.jobspec.paths import is_url
from dlbatch.jobspec.spec import JobSpec
from dlbatch.jobspec.tasks import (EXTRAS, OPENAI_KEEP, ChunkingSpec, SamplingSpec, TaskOutputSpec, TaskSamplingSpec,
                                   TaskSpec, openai_batch_tasks)

__all__ = ["JobSpecError", "ResumeMismatchError", "InputSpec", "OutputSpec", "ModelSpec", "TaskSpec", "TaskOutputSpec",
           "SamplingSpec", "TaskSamplingSpec", "ChunkingSpec", "RouterSpec", "BatchingSpec", "RetriesSpec", "PoolSpec",
           "ClusterSpec", "JobSpec", "load_job", "parse_job", "apply_overrides", "inline_schema_files",
           "model_context", "token_budget_problems", "fingerprint_fields", "content_fields", "job_fingerprint",
           "fingerprint_diff", "check_resume_compatible", "check_pool_device", "is_url", "CONTENT_KEYS", "EXTRAS", "OPENAI_KEEP",
           "openai_batch_tasks"]

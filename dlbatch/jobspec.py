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
the job's ``max_model_len``. :func:`load_job` also reads the model's own context
from its ``config.json`` when ``model.max_model_len`` is not set
(:func:`model_context`). Prompt templates are compiled and rendered once against
a sample document (`dlbatch.prompts.templates.check_template`).
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import re
import types
import typing
from typing import Any, Iterable, Literal, Mapping, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dlbatch.prompts.templates import TemplateError, check_template

__all__ = [
    "JobSpecError",
    "ResumeMismatchError",
    "InputSpec",
    "OutputSpec",
    "ModelSpec",
    "TaskSpec",
    "SamplingSpec",
    "RouterSpec",
    "BatchingSpec",
    "RetriesSpec",
    "PoolSpec",
    "ClusterSpec",
    "JobSpec",
    "load_job",
    "parse_job",
    "apply_overrides",
    "fingerprint_fields",
    "job_fingerprint",
    "fingerprint_diff",
    "check_resume_compatible",
    "is_url",
]


# --------------------------------------------------------------------------- errors


class JobSpecError(ValueError):
    """An invalid job file or override. ``problems`` holds ``(key_path, message)``."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = list(problems)
        lines = []
        for key, msg in self.problems:
            lines.append(f"{source}: {key}: {msg}" if key else f"{source}: {msg}")
        super().__init__("\n".join(lines))


class ResumeMismatchError(JobSpecError):
    """The output directory was written by a job with a different configuration."""


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- paths

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_BUCKET_SCHEMES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}


def is_url(path: str) -> bool:
    """True for ``scheme://...`` (fsspec URLs, including ``file://``)."""
    return bool(_URL_RE.match(path))


def _resolve_local(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _is_same_or_ancestor(candidate: str, of: str) -> bool:
    candidate = os.path.realpath(candidate)
    of = os.path.realpath(of)
    if candidate == of:
        return True
    return of.startswith(candidate.rstrip(os.sep) + os.sep)


def _check_local_output(raw: str, resolved: str) -> None:
    real = os.path.realpath(resolved)
    if real == os.path.realpath(os.sep) or os.path.dirname(real) == real:
        raise ValueError(f"{raw!r} is the filesystem root; {_OUT_HINT}")
    home = os.path.expanduser("~")
    cwd = os.getcwd()
    for what, where in (("the home directory", home), ("the current directory", cwd)):
        if _is_same_or_ancestor(real, where):
            rel = "is" if os.path.realpath(where) == real else "contains"
            raise ValueError(f"{raw!r} resolves to {real!r}, which {rel} {what}; {_OUT_HINT}")


def _local_path(path: str) -> Optional[str]:
    """The local filesystem path of a plain path or ``file://`` URL; None for other URLs."""
    if not is_url(path):
        return path
    scheme, rest = path.split("://", 1)
    return _resolve_local(rest or "/") if scheme.lower() in ("file", "local") else None


def _is_inside(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or below it (local paths by their real path, URLs by text)."""
    a, b = _local_path(path), _local_path(folder)
    if a is not None and b is not None:
        return _is_same_or_ancestor(b, a)
    if a is not None or b is not None:
        return False
    a, b = path.rstrip("/"), folder.rstrip("/")
    return a == b or a.startswith(b + "/")


def _input_folder(spec: "JobSpec") -> Optional[str]:
    """The folder input.path lists: the path itself when it is a folder (or a URL prefix),
    the part before the first glob character for a glob; None for one file."""
    path = spec.input.path
    if re.search(r"[*?\[]", path):
        return path[: re.search(r"[*?\[]", path).start()].rsplit("/", 1)[0] or "/"
    local = _local_path(path)
    if local is not None:
        return None if os.path.isfile(local) else local  # a folder, or one that does not exist yet
    return path if spec.input.format != "hf" or "://" in path else None


_OUT_HINT = "the output directory is deleted by --fresh, so use a dedicated subdirectory such as 'out/<job>'"


def _normalize_output_path(raw: str) -> str:
    if not raw or not raw.strip():
        raise ValueError(f"must not be empty; {_OUT_HINT}")
    if raw.strip() in ("/", "~", "~/", ".", "./"):
        raise ValueError(f"{raw!r} is not allowed as output path; {_OUT_HINT}")
    if is_url(raw):
        scheme, rest = raw.split("://", 1)
        scheme = scheme.lower()
        if scheme in ("file", "local"):
            local = rest or "/"
            _check_local_output(raw, _resolve_local(local))
            return raw
        if not rest.strip("/"):
            raise ValueError(f"{raw!r} has no path after the scheme; {_OUT_HINT}")
        if scheme in _BUCKET_SCHEMES and "/" not in rest.strip("/"):
            raise ValueError(f"{raw!r} is the root of a bucket; {_OUT_HINT}")
        return raw
    resolved = _resolve_local(raw)
    _check_local_output(raw, resolved)
    return resolved


# --------------------------------------------------------------------------- models

_STRICT = ConfigDict(extra="forbid", strict=True, validate_default=True)


class InputSpec(BaseModel):
    model_config = _STRICT

    # openai_batch: OpenAI Batch API request files, one request a line (connectors/openai_batch.py)
    format: Literal["pdf", "jsonl", "parquet", "text", "hf", "openai_batch"] = "pdf"
    path: str = "samples/papers"
    text_field: str = Field("text", min_length=1)
    id_field: Optional[str] = None
    limit: Optional[int] = Field(None, ge=1)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    # Caps on one file's parse (connectors/parse.py): none stops the job; what goes past one is
    # that file's dead letter, naming the cap. The same defaults are connectors.parse's.
    max_pages: Optional[int] = Field(1000, ge=1)  # a PDF's first N pages are read; null: every page
    max_file_bytes: Optional[int] = Field(256 << 20, ge=1)  # larger PDF/text files: FileTooLarge; null: no cap
    parse_timeout_s: float = Field(300.0, gt=0)  # wall time of one PDF's parse: ParseTimeout
    parse_memory_mb: Optional[int] = Field(4096, ge=512)  # the PDF parser process's address space; null: no cap
    # format hf, a Hub dataset id (path: org/name; connectors/hf_hub.py): folded into path, the
    # input's URL hf-dataset://org/name?config=..&split=..
    split: Optional[str] = Field(None, min_length=1)  # null: "train"
    config: Optional[str] = Field(None, min_length=1)  # the dataset's config (subset) name
    revision: Optional[str] = Field(None, min_length=1)  # a branch, tag or commit of the dataset repo
    streaming: bool = False  # read rows lazily instead of preparing the dataset in the cache first

    @field_validator("path")
    @classmethod
    def _resolve_path(cls, value: str, info: ValidationInfo) -> str:
        if not value or not value.strip():
            raise ValueError("must not be empty")
        if is_url(value):
            return value
        if info.data.get("format") == "hf" and not os.path.exists(os.path.expanduser(value)):
            return value  # a dataset name such as "org/name"
        return _resolve_local(value)

    @model_validator(mode="after")
    def _hub_dataset(self) -> "InputSpec":
        from connectors.hf_hub import hub_url, is_hub_id, is_hub_url, parse_hub_url

        given = [k for k in ("split", "config", "revision", "streaming") if getattr(self, k) not in (None, False)]
        if self.format != "hf":
            if given:
                raise ValueError(f"input.{given[0]} applies to input.format hf (a Hub dataset id) only, "
                                 f"not to format {self.format}")
            return self
        if is_hub_url(self.path) or is_hub_id(self.path):  # a folded path (validated again): ours over its
            ref = parse_hub_url(self.path if is_hub_url(self.path) else hub_url(self.path))
            ref = parse_hub_url(hub_url(ref.id, self.config or ref.config, self.split or ref.split,
                                        self.revision or ref.revision, self.streaming or ref.streaming))
            self.__dict__.update(path=ref.url, config=ref.config, split=ref.split, revision=ref.revision,
                                 streaming=ref.streaming)
        elif given:
            raise ValueError(f"input.{given[0]} applies to a Hub dataset id (path: org/name) only; {self.path!r} is "
                             "a local path or URL (a saved dataset directory is read whole, every split)")
        return self


class OutputSpec(BaseModel):
    model_config = _STRICT

    path: str = "out/papers"
    include_text: bool = False
    # input columns copied into every result row of their document, with their Arrow types:
    # a list of names, or "all" (every column but the text and those named like a result column)
    keep_columns: Union[list[str], Literal["all"]] = Field(default_factory=list)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    # parquet: one Parquet part per commit (default); delta: a Delta Lake table (dlbatch/driver/delta_store.py);
    # openai_batch (openai_batch input only): the Parquet parts, and results.jsonl / errors.jsonl in the
    # Batch API's output format written from them when a run completes (dlbatch/driver/openai_export.py)
    format: Literal["parquet", "delta", "openai_batch"] = "parquet"

    @field_validator("path")
    @classmethod
    def _confine(cls, value: str) -> str:
        path = _normalize_output_path(value)
        local = _local_path(path)
        if local is not None and os.path.exists(local) and not os.path.isdir(local):
            raise ValueError(f"{value!r} is an existing file; the output is a directory of Parquet parts: "
                             "name a directory (new or existing)")
        return path


class ModelSpec(BaseModel):
    model_config = _STRICT

    name: str = Field("smollm2-135m-instruct", min_length=1)  # alias, folder, GGUF, URL or Hub id org/name
    revision: Optional[str] = Field(None, min_length=1)  # a Hub id's branch, tag or commit
    backend: Literal["dlbatch", "vllm"] = "dlbatch"  # which engine runs the model (dlbatch/backends)
    engine_args: dict[str, Any] = Field(default_factory=dict)  # the backend's own engine arguments
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    max_model_len: Optional[int] = Field(None, ge=1)  # null: the engine's default (EngineConfig)
    chat: Optional[bool] = None
    system: Optional[str] = None  # system prompt of every task (a task's own `system` wins)
    chat_template: Optional[str] = None  # path to a Jinja chat template file, instead of the model's
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)  # extra template variables

    @model_validator(mode="after")
    def _check_engine(self) -> "ModelSpec":
        if self.revision is not None:
            from dlbatch.engine.hub import is_hub_id

            if not is_hub_id(self.name) or "@" in self.name:
                raise ValueError(f"revision {self.revision!r} applies to a Hub id (org/name) only, "
                                 f"not to {self.name!r}")
        if self.backend == "dlbatch" and self.engine_args:
            from dataclasses import fields

            from dlbatch.engine.config import EngineConfig

            own = {"dtype", "device", "max_model_len", "device_share"}  # set by model.* and cluster.*
            names = {f.name for f in fields(EngineConfig)} - own
            bad = sorted(set(self.engine_args) - names)
            if bad:
                raise ValueError(f"engine_args: unknown argument(s) {', '.join(bad)} of the dlbatch engine; "
                                 f"it takes {', '.join(sorted(names))}")
        return self

    @property
    def ref(self) -> str:
        """What the engines load: the name, with ``@revision`` for a pinned Hub id."""
        from dlbatch.engine.hub import ref

        return ref(self.name, self.revision)


class TaskOutputSpec(BaseModel):
    """What a task's output must be (exactly one key): the engine constrains the generation
    to it and the rows carry the parsed, typed value (dlbatch/prompts/structured.py)."""

    model_config = _STRICT

    json_schema: Optional[dict[str, Any]] = None  # inline, or a .json file next to the job (inlined at load)
    regex: Optional[str] = Field(None, min_length=1)
    choices: Optional[list[str]] = Field(None, min_length=1)
    grammar: Optional[str] = Field(None, min_length=1)  # Lark (llguidance dialect)

    @model_validator(mode="after")
    def _one(self) -> "TaskOutputSpec":
        given = [k for k in ("json_schema", "regex", "choices", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, regex, choices, grammar (got {given or 'none'})")
        if self.json_schema is not None:
            import jsonschema

            try:
                jsonschema.validators.validator_for(self.json_schema).check_schema(self.json_schema)
            except jsonschema.SchemaError as e:
                raise ValueError(f"json_schema is not a valid JSON Schema: {e.message}") from None
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ValueError(f"regex {self.regex!r} does not compile: {e}") from None
        if self.choices is not None and any(not c for c in self.choices):
            raise ValueError("choices must be non-empty strings")
        return self


LongInputPolicy = Literal["truncate", "middle", "skip", "chunk"]


class TaskSpec(BaseModel):
    model_config = _STRICT

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")
    prompt: Optional[str] = Field(None, min_length=1)  # a template (dlbatch/prompts/templates.py)
    messages: Optional[str] = Field(None, min_length=1)  # or a chat: one {{ expression }}, e.g. {{ row.messages }}
    max_tokens: int = Field(128, ge=1)
    output: Optional[TaskOutputSpec] = None
    system: Optional[str] = None  # this task's system prompt (overrides model.system)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)  # merged over model.chat_template_kwargs
    raw: bool = False  # the prompt goes to the model as is, without the chat template
    long_inputs: Optional[LongInputPolicy] = None   # None: the job's long_inputs
    sampling: Optional[TaskSamplingSpec] = None     # None: the job's sampling

    @model_validator(mode="after")
    def _check_template(self) -> "TaskSpec":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"task {self.name!r}: give exactly one of prompt (a template) and messages "
                             "(a chat expression such as '{{ row.messages }}')")
        if self.prompt is not None:
            check_template(self.name, self.prompt, columns=True)
        else:
            from dlbatch.prompts.templates import compile_messages

            compile_messages(self.name, self.messages)
        return self

    @property
    def source(self) -> str:
        """The template text: its prompt, or its messages expression."""
        return self.prompt if self.prompt is not None else self.messages


def openai_batch_tasks() -> list[TaskSpec]:
    """The implicit task of an ``input.format: openai_batch`` job: each request line is one
    request row of it, its prompt and sampling the line's body (dlbatch/prompts/stage.py);
    ``max_tokens`` here is the /v1/completions default, a chat's is CHAT_DEFAULT_MAX_TOKENS."""
    from connectors.openai_batch import COMPLETIONS_DEFAULT_MAX_TOKENS, TASK

    return [TaskSpec(name=TASK, prompt="{{ text }}", max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)]


OPENAI_KEEP = ["custom_id", "url"]  # output.format openai_batch: what the exporter reads from each result row


def _default_tasks() -> list[TaskSpec]:
    return [
        TaskSpec(name="summary", prompt="{{ text }}\n\nSummarize this paper in three sentences.", max_tokens=128),
        TaskSpec(name="keywords", prompt="{{ text }}\n\nList five keywords of this paper.", max_tokens=32),
    ]


class ChunkingSpec(BaseModel):
    """``long_inputs: chunk`` settings (dlbatch/prompts/longdoc.py)."""
    model_config = _STRICT

    chunk_tokens: Optional[int] = Field(None, ge=64)   # None: as large as max_model_len allows
    overlap_tokens: int = Field(128, ge=0)
    map_max_tokens: int = Field(256, ge=1)
    map_prompt: str = Field(default_factory=lambda: _longdoc_defaults()[0], min_length=1)
    reduce_prompt: str = Field(default_factory=lambda: _longdoc_defaults()[1], min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "ChunkingSpec":
        from dlbatch.prompts.longdoc import MAP_VARIABLES, REDUCE_VARIABLES

        check_template("map_prompt", self.map_prompt, MAP_VARIABLES)
        check_template("reduce_prompt", self.reduce_prompt, REDUCE_VARIABLES)
        if self.chunk_tokens is not None and self.overlap_tokens > self.chunk_tokens // 4:
            raise ValueError(f"overlap_tokens {self.overlap_tokens} must be at most chunk_tokens / 4 "
                             f"({self.chunk_tokens // 4})")
        return self


def _longdoc_defaults() -> tuple[str, str]:
    from dlbatch.prompts.longdoc import DEFAULT_MAP_PROMPT, DEFAULT_REDUCE_PROMPT

    return DEFAULT_MAP_PROMPT, DEFAULT_REDUCE_PROMPT


EXTRAS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "n", "logprobs")


class SamplingSpec(BaseModel):
    model_config = _STRICT

    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)  # generation ends at the first of these (not in the output)
    # the extras (dlbatch/backends/base.py): null is off, and a row is what it was without them
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    n: Optional[int] = Field(None, ge=1, le=128)  # samples per prompt: the row's `samples` column
    logprobs: Optional[int] = Field(None, ge=0, le=20)  # top-k alternatives per token: the `logprobs` column

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: list[str]) -> list[str]:
        bad = [x for x in v if not x]
        if bad:
            raise ValueError(f"stop strings must be non-empty, got {v!r}")
        return v


class TaskSamplingSpec(BaseModel):
    """A task's own sampling: each field set here replaces the job's ``sampling`` for it."""
    model_config = _STRICT

    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    seed: Optional[int] = Field(None, ge=0)
    stop: Optional[list[str]] = None
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    n: Optional[int] = Field(None, ge=1, le=128)
    logprobs: Optional[int] = Field(None, ge=0, le=20)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if v is not None and any(not x for x in v):
            raise ValueError(f"stop strings must be non-empty, got {v!r}")
        return v


class RouterSpec(BaseModel):
    model_config = _STRICT

    policy: Literal["prefix_aware", "round_robin", "least_loaded"] = "prefix_aware"
    window: int = Field(256, ge=1)


class BatchingSpec(BaseModel):
    model_config = _STRICT

    max_batch_tokens: int = Field(8192, ge=1)
    max_inflight_batches: int = Field(16, ge=1)
    # a batch (its wait behind others on its worker included) not back after this long is
    # failed and its worker restarted: one hung batch cannot stall the job
    batch_timeout_s: float = Field(900.0, gt=0)


class RetriesSpec(BaseModel):
    model_config = _STRICT

    max_attempts: int = Field(3, ge=1)


class PoolSpec(BaseModel):
    model_config = _STRICT

    chip: str = Field(min_length=1)
    replicas: int = Field(1, ge=1)
    device: str = Field("cpu", pattern=r"^[a-z][a-z0-9_]*(:[0-9]+)?$")
    num_cpus: float = Field(1.0, ge=0.0)
    num_gpus: float = Field(0.0, ge=0.0)
    # per worker: bytes ('8GiB', 8e9) or a fraction of the device's free memory (0.4, '40%');
    # null: the engine's default (on CUDA: num_gpus' share of the device, see accelerators.md)
    kv_cache_memory: Optional[Union[int, float, str]] = None

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_kv_memory(cls, value):
        if value is not None:
            from dlbatch.engine.config import parse_kv_memory

            parse_kv_memory(value)  # raises naming the value
        return value

    @model_validator(mode="after")
    def _check_device(self):
        check_pool_device(self.device, self.num_gpus)
        return self


def check_pool_device(device: str, num_gpus: float) -> None:
    """A CUDA pool must ask Ray for GPUs (Ray then sets each worker's CUDA_VISIBLE_DEVICES,
    renumbering its GPUs from 0): ``cuda:N`` must index the worker's own GPUs."""
    if not device.startswith("cuda"):
        return
    if num_gpus <= 0:
        raise ValueError(f"device {device!r} needs num_gpus > 0 (Ray reserves GPUs only for pools that ask; "
                         "e.g. num_gpus: 1, or 0.5 for two workers on one GPU)")
    idx = device.partition(":")[2]
    have = max(1, int(num_gpus))
    if idx and int(idx) >= have:
        raise ValueError(f"device {device!r} with num_gpus={num_gpus:g}: each worker sees its own GPU(s) as "
                         f"cuda:0..cuda:{have - 1} (Ray sets CUDA_VISIBLE_DEVICES); use 'cuda'")


_HOST_PORT_RE = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$")


class ClusterSpec(BaseModel):
    model_config = _STRICT

    address: Optional[str] = None
    plan: Optional[str] = None
    prefill: PoolSpec = Field(default_factory=lambda: PoolSpec(chip="fast"))
    decode: PoolSpec = Field(default_factory=lambda: PoolSpec(chip="cheap"))
    colocated: Optional[PoolSpec] = None
    kv_transport: Literal["auto", "object_store", "shm", "rdt", "dlslime"] = "auto"
    # dlslime endpoints may listen off loopback (DLBATCH_DLSLIME_IP): whoever reaches one can
    # read and write the worker's memory (docs/transfer.md); off by default
    dlslime_allow_network: bool = False

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: Optional[str]) -> Optional[str]:
        if value is None or value == "auto" or value.startswith("ray://") or _HOST_PORT_RE.match(value):
            return value
        raise ValueError(
            f"{value!r} is not a Ray address; use null (embedded local Ray), 'auto', "
            "'ray://host:port' or 'host:port'"
        )

    @field_validator("plan")
    @classmethod
    def _check_plan(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not value.strip():
            raise ValueError("must be null, 'auto' or the path to a plan JSON, got ''")
        return value

    @property
    def mode(self) -> str:
        """``"colocated"`` when ``colocated`` is set (it replaces prefill/decode), else ``"disaggregated"``."""
        return "colocated" if self.colocated is not None else "disaggregated"

    def pools(self) -> dict[str, PoolSpec]:
        """The worker pools this cluster section asks for, by role."""
        if self.colocated is not None:
            return {"colocated": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}


class JobSpec(BaseModel):
    model_config = _STRICT

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    pipeline: str = Field(pattern=r"^[a-z_][a-z0-9_]*$")
    input: InputSpec = Field(default_factory=InputSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)
    model: ModelSpec = Field(default_factory=ModelSpec)
    tasks: list[TaskSpec] = Field(default_factory=_default_tasks, min_length=1)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    long_inputs: LongInputPolicy = "truncate"
    chunking: ChunkingSpec = Field(default_factory=ChunkingSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    retries: RetriesSpec = Field(default_factory=RetriesSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)

    _source: str = PrivateAttr(default="<dict>")

    @field_validator("tasks")
    @classmethod
    def _unique_task_names(cls, tasks: list[TaskSpec]) -> list[TaskSpec]:
        seen: set[str] = set()
        for task in tasks:
            if task.name in seen:
                raise ValueError(f"duplicate task name {task.name!r}; task names must be unique")
            seen.add(task.name)
        return tasks

    @model_validator(mode="before")
    @classmethod
    def _implicit_tasks(cls, data: Any) -> Any:
        """An openai_batch job leaves ``tasks`` out: its lines are the requests."""
        if isinstance(data, Mapping) and "tasks" not in data:
            inp = data.get("input")
            fmt = inp.get("format") if isinstance(inp, Mapping) else getattr(inp, "format", None)
            if fmt == "openai_batch":
                data = {**data, "tasks": openai_batch_tasks()}
        return data

    @model_validator(mode="after")
    def _check_openai_batch(self) -> "JobSpec":
        batch_in, batch_out = self.input.format == "openai_batch", self.output.format == "openai_batch"
        if batch_out and not batch_in:
            raise ValueError(f"output.format openai_batch writes the responses to OpenAI batch request lines: it needs "
                             f"input.format openai_batch (got {self.input.format})")
        if not batch_in:
            return self
        if [t.model_dump() for t in self.tasks] != [t.model_dump() for t in openai_batch_tasks()]:
            raise ValueError("tasks: an openai_batch input has no tasks (each line's body is its request, answered "
                             "by one response line); leave tasks out")
        if self.input.id_field is not None:
            raise ValueError(f"input.id_field {self.input.id_field!r}: an openai_batch line's id is its custom_id; "
                             "leave id_field out")
        keep = self.output.keep_columns
        if batch_out and keep != "all" and any(c not in keep for c in OPENAI_KEEP):
            self.output.__dict__["keep_columns"] = list(keep) + [c for c in OPENAI_KEEP if c not in keep]
        return self

    @model_validator(mode="after")
    def _check_columns(self) -> "JobSpec":
        from dlbatch.prompts.templates import column_references

        if self.input.format in ("pdf", "text"):
            for i, t in enumerate(self.tasks):
                used = sorted(column_references(t.source))
                if used:
                    from dlbatch.prompts.templates import TEMPLATE_VARIABLES

                    raise ValueError(f"tasks.{i}.{'prompt' if t.prompt is not None else 'messages'}: "
                                     f"task {t.name!r} uses {', '.join(map(repr, used))}, which {self.input.format} "
                                     f"inputs do not have (variables: {', '.join(TEMPLATE_VARIABLES)}); input "
                                     "columns exist for jsonl, parquet and hf inputs")
            if self.output.keep_columns:
                raise ValueError(f"output.keep_columns: {self.input.format} inputs have no columns to keep")
        if isinstance(self.output.keep_columns, list):
            from dlbatch.prompts.columns import RESULT_COLUMNS

            clash = [c for c in self.output.keep_columns if c in RESULT_COLUMNS or c == "text"]
            if clash:
                raise ValueError(f"output.keep_columns: {', '.join(map(repr, clash))} is the name of a result "
                                 "column; rename the input column")
        return self

    @model_validator(mode="after")
    def _check_backend_pools(self) -> "JobSpec":
        if self.model.backend == "vllm" and self.cluster.colocated is None:
            raise ValueError(
                "model.backend vllm runs colocated workers only: set cluster.colocated (e.g. --set "
                "cluster.colocated.chip=fast). Prefill/decode pools need vLLM's KV connectors (NIXL, P2P NCCL), "
                "which run on GPUs only and not on its CPU build (docs/backends.md); dlbatch's own engine "
                "runs PD pools on any chip")
        return self

    def __eq__(self, other: object) -> bool:
        # settings only: the same job loaded from two places is the same job
        if isinstance(other, JobSpec):
            return self.model_dump() == other.model_dump()
        return NotImplemented

    __hash__ = None  # mutable, like every pydantic model

    @property
    def source(self) -> str:
        """The file (or ``"<dict>"``) this spec was loaded from."""
        return self._source

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able dict; ``parse_job(spec.to_dict())`` gives an equal spec."""
        return self.model_dump(mode="json")


# --------------------------------------------------------------------------- model walking


def _unwrap_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _annotation_at(loc: Iterable[Any]) -> Any:
    """The type annotation at a key path of JobSpec (None when it cannot be followed)."""
    current: Any = JobSpec
    for part in loc:
        current = _unwrap_optional(current)
        if _is_model(current):
            field = current.model_fields.get(str(part))
            if field is None:
                return None
            current = field.annotation
        elif typing.get_origin(current) is list and isinstance(part, int):
            current = typing.get_args(current)[0]
        else:
            return None
    return _unwrap_optional(current)


def _known_keys_message(model: Any, bad_key: str) -> str:
    if not _is_model(model):
        return ""
    keys = list(model.model_fields)
    hint = ""
    close = difflib.get_close_matches(bad_key, keys, n=1)
    if close:
        hint = f"did you mean {close[0]!r}? "
    return f" ({hint}known keys: {', '.join(keys)})"


# --------------------------------------------------------------------------- validation


def _problem_from_error(err: Mapping[str, Any]) -> tuple[str, str]:
    loc = tuple(err.get("loc", ()))
    key = ".".join(str(p) for p in loc)
    kind = err.get("type", "")
    value = err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        parent = _annotation_at(loc[:-1])
        return key, f"unknown key{_known_keys_message(parent, str(loc[-1]) if loc else '')}"
    if kind == "missing":
        return key, "required key is missing"
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        return key, f"{_short(value)} is not one of {', '.join(options)}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return key, f"expected a mapping, got {_short(value)}"
    if kind == "string_pattern_mismatch":
        return key, f"{_short(value)} does not match the pattern {ctx.get('pattern')}"
    if kind == "too_short" and isinstance(value, list):
        return key, f"needs at least {ctx.get('min_length', 1)} item(s), got {len(value)}"
    if kind == "list_type":
        return key, f"expected a list, got {_short(value)}"
    if kind == "value_error":
        cause = ctx.get("error")
        if isinstance(cause, TemplateError) and loc and not key.endswith(".prompt"):
            key += ".prompt"
        return key, str(cause) if cause is not None else err.get("msg", "")
    msg = str(err.get("msg", "invalid value"))
    msg = msg[:1].lower() + msg[1:]
    return key, f"{msg}, got {_short(value)}"


def parse_job(data: Mapping[str, Any], source: str = "<dict>") -> JobSpec:
    """Validate a job dict; raise :class:`JobSpecError` naming ``source``, key path and value."""
    if not isinstance(data, Mapping):
        raise JobSpecError(source, [("", f"a job file must be a mapping at the top level, got {type(data).__name__}")])
    try:
        spec = JobSpec.model_validate(dict(data))
    except ValidationError as e:
        raise JobSpecError(source, [_problem_from_error(err) for err in e.errors()]) from None
    problems = _cross_problems(spec, _declared_context(spec.model))
    if problems:
        raise JobSpecError(source, problems)
    spec._source = source
    return spec


def _declared_context(model: ModelSpec) -> tuple[int, str]:
    """The job's max_model_len as the job file says it, without the model: model.max_model_len,
    else the engines' cap on a model's own context (DEFAULT_MAX_MODEL_LEN)."""
    if model.max_model_len:
        return model.max_model_len, "model.max_model_len"
    from dlbatch.engine.config import DEFAULT_MAX_MODEL_LEN

    return DEFAULT_MAX_MODEL_LEN, "the engines' default max_model_len"


def model_context(model: ModelSpec) -> tuple[int, str]:
    """The max_model_len the workers will use, known without loading weights where that is
    cheap: model.max_model_len; else the model's context from its config.json (a folder or a
    Hub snapshot in the cache), at most DEFAULT_MAX_MODEL_LEN; else (a GGUF not converted
    yet, a remote model, a model not found here) that cap, an upper bound."""
    declared = _declared_context(model)
    if model.max_model_len or is_url(model.name):
        return declared
    try:
        from dlbatch.engine.loader import context_length, resolve_model

        folder = resolve_model(model.ref)
        if not os.path.isdir(folder):
            return declared
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            context = context_length(json.load(f))
    except Exception:  # the run reports a model it cannot find or read, naming it
        return declared
    if context < declared[0]:
        return context, f"the model's context ({model.name!r} config.json)"
    return declared


def _cross_problems(spec: JobSpec, context: tuple[int, str]) -> list[tuple[str, str]]:
    """Problems between sections: an output folder inside the input folder (its parts would
    be read back as inputs), a task's max_tokens that leaves no room for a prompt in the
    model's context (every document would be a dead letter)."""
    problems = []
    folder = _input_folder(spec)
    if folder is not None and _is_inside(spec.output.path, folder):
        problems.append(("output.path", f"{spec.output.path!r} is inside input.path {spec.input.path!r}: "
                                        "the outputs would be read back as inputs; write them elsewhere"))
    limit, what = context
    budgets = [(f"tasks.{i}.max_tokens", t.max_tokens) for i, t in enumerate(spec.tasks)]
    if "chunk" in {spec.long_inputs, *(t.long_inputs for t in spec.tasks)}:
        budgets.append(("chunking.map_max_tokens", spec.chunking.map_max_tokens))
    for key, n in budgets:
        if n >= limit:
            problems.append((key, f"{n} leaves no room for a prompt in max_model_len {limit} ({what}); "
                                  f"max_tokens must be below it, with room for the document"))
    return problems


def _read_text(source: str, storage_options: Optional[Mapping[str, Any]] = None) -> str:
    try:
        if is_url(source):
            import fsspec

            with fsspec.open(source, "rt", encoding="utf-8", **dict(storage_options or {})) as f:
                return f.read()
        with open(source, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise JobSpecError(source, [("", "job file not found")]) from None
    except IsADirectoryError:
        raise JobSpecError(source, [("", "is a directory, not a job file")]) from None
    except UnicodeDecodeError as e:
        raise JobSpecError(source, [("", f"job file is not UTF-8 text ({e.reason} at byte {e.start})")]) from None


def load_job(
    path_or_url: Union[str, os.PathLike],
    overrides: Iterable[str] = (),
    storage_options: Optional[Mapping[str, Any]] = None,
) -> JobSpec:
    """Read a YAML job file (local path or fsspec URL), apply ``--set`` overrides, validate.

    Only ``yaml.safe_load`` is used: tags such as ``!!python/object`` are errors. Besides the
    checks of :func:`parse_job`, a task's max_tokens is checked against the model's own
    context (:func:`model_context`) when model.max_model_len is not set.
    """
    source = os.fspath(path_or_url)
    text = _read_text(source, storage_options)
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = " ".join(p for p in (e.context, e.problem) if p)
        raise JobSpecError(source, [("", f"{where}invalid YAML: {problem}")]) from None
    except yaml.YAMLError as e:
        raise JobSpecError(source, [("", f"invalid YAML: {e}")]) from None
    if data is None:
        raise JobSpecError(source, [("", "the job file is empty")])
    if not isinstance(data, dict):
        raise JobSpecError(source, [("", f"a job file must be a mapping at the top level, got {type(data).__name__}")])
    data = apply_overrides(data, overrides, source=source)
    try:
        data = inline_schema_files(data, source)
    except ValueError as e:
        raise JobSpecError(source, [("tasks", str(e))]) from None
    spec = parse_job(data, source=source)
    if not spec.model.max_model_len:  # the model's own context, where its config.json says it
        problems = _cross_problems(spec, model_context(spec.model))
        if problems:
            raise JobSpecError(source, problems)
    return spec


def inline_schema_files(data: dict, job_source: str) -> dict:
    """Replace every task's ``output.json_schema: "file.json"`` by the file's JSON, and make
    ``model.chat_template`` absolute (both relative to the job file's directory), so the job
    dict is self-contained."""
    if not isinstance(data, dict):
        return data
    base = os.path.dirname(os.path.abspath(job_source)) if "://" not in job_source else None
    model = data.get("model")
    tpl = model.get("chat_template") if isinstance(model, dict) else None
    if isinstance(tpl, str) and base is not None and not os.path.isabs(tpl) and "://" not in tpl:
        data = {**data, "model": {**model, "chat_template": os.path.join(base, tpl)}}
    tasks = data.get("tasks")
    if not isinstance(tasks, list):
        return data
    new_tasks = []
    for t in tasks:
        out = t.get("output") if isinstance(t, dict) else None
        path = out.get("json_schema") if isinstance(out, dict) else None
        if isinstance(path, str) and path.strip().endswith(".json"):
            full = path if os.path.isabs(path) or base is None else os.path.join(base, path)
            try:
                with open(full, encoding="utf-8") as f:
                    schema = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"task {t.get('name')!r}: output.json_schema file {path!r}: {e}") from None
            t = {**t, "output": {**out, "json_schema": schema}}
        new_tasks.append(t)
    return {**data, "tasks": new_tasks}


# --------------------------------------------------------------------------- overrides


def _default_as_data(field: Any) -> Any:
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        return default.model_dump(mode="json", exclude_unset=True)
    if isinstance(default, list):
        return [d.model_dump(mode="json", exclude_unset=True) if isinstance(d, BaseModel) else copy.deepcopy(d) for d in default]
    if default is None:
        return None
    return copy.deepcopy(default)


def apply_overrides(
    data: Mapping[str, Any], overrides: Iterable[str], source: str = "<overrides>"
) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``"key.path=value"`` applied.

    ``value`` is parsed with ``yaml.safe_load`` (``3`` is an int, ``null`` is
    None, ``{chip: fast}`` a mapping). Key paths follow the JobSpec schema, so
    a key the job file leaves at its default can still be set; list items are
    addressed by index (``tasks.0.max_tokens=16``). An item without ``=`` or a
    key path the schema does not have raises :class:`JobSpecError`.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    result: dict[str, Any] = copy.deepcopy(dict(data))
    for item in overrides:
        _apply_one(result, item, source)
    return result


def _apply_one(root: dict, item: str, source: str) -> None:
    def fail(msg: str) -> JobSpecError:
        return JobSpecError(source, [("", f"--set {item!r}: {msg}")])

    if "=" not in item:
        raise fail("expected KEY.PATH=VALUE, e.g. model.dtype=float32")
    key, raw_value = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise fail(f"empty key path {key!r}")
    try:
        value = yaml.safe_load(raw_value)
    except yaml.YAMLError as e:
        raise fail(
            f"value {raw_value!r} is not valid YAML ({str(e).splitlines()[0]}); "
            f"to pass it as a string, quote it: {key}='\"...\"'"
        ) from None

    parts = key.split(".")
    node: Any = root
    annotation: Any = JobSpec
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = ".".join(parts[:i]) or "the job"
        annotation = _unwrap_optional(annotation)
        if _is_model(annotation):
            if part not in annotation.model_fields:
                raise fail(f"unknown key {part!r} in {here}{_known_keys_message(annotation, part)}")
            if not isinstance(node, dict):
                raise fail(f"{here} is not a mapping in the job file (it is {_short(node)})")
            field = annotation.model_fields[part]
            if last:
                node[part] = value
                return
            child = node.get(part)
            if child is None:
                child = _default_as_data(field)
                if child is None:
                    child = {}
                node[part] = child
            node = child
            annotation = field.annotation
        elif typing.get_origin(annotation) is list:
            if not isinstance(node, list):
                raise fail(f"{here} is not a list in the job file (it is {_short(node)})")
            if not re.fullmatch(r"-?[0-9]+", part):
                raise fail(f"{here} is a list; {part!r} is not an index")
            index = int(part)
            if not -len(node) <= index < len(node):
                raise fail(f"index {index} is out of range for {here} ({len(node)} items)")
            if last:
                node[index] = value
                return
            node = node[index]
            annotation = typing.get_args(annotation)[0]
        elif typing.get_origin(annotation) is dict or annotation is Any:
            if not isinstance(node, dict):
                raise fail(f"{here} is not a mapping in the job file (it is {_short(node)})")
            if last:
                node[part] = value
                return
            node = node.setdefault(part, {})
            annotation = Any
        else:
            raise fail(f"{here} is a single value, it has no key {part!r}")


# --------------------------------------------------------------------------- fingerprint


def fingerprint_fields(spec: JobSpec) -> dict[str, Any]:
    """The settings that determine a job's outputs, as a flat ``{key.path: value}`` dict.

    Throughput knobs (cluster, router, batching, retries, input.limit) are
    left out: changing them and resuming gives the same rows.
    """
    fields: dict[str, Any] = {
        "model.name": spec.model.name,
        "model.dtype": spec.model.dtype,
        **({"model.revision": spec.model.revision} if spec.model.revision else {}),
        # set only off the default: older outputs keep their fingerprint
        **({"model.backend": spec.model.backend} if spec.model.backend != "dlbatch" else {}),
        "model.max_model_len": spec.model.max_model_len,
        "model.chat": spec.model.chat,
        "model.system": spec.model.system,
        "model.chat_template": spec.model.chat_template,
        "model.chat_template_kwargs": spec.model.chat_template_kwargs,
        "sampling.temperature": spec.sampling.temperature,
        "sampling.top_p": spec.sampling.top_p,
        "sampling.top_k": spec.sampling.top_k,
        "sampling.seed": spec.sampling.seed,
        **({"sampling.stop": list(spec.sampling.stop)} if spec.sampling.stop else {}),  # older outputs resume
        **{f"sampling.{k}": v for k, v in spec.sampling.model_dump().items() if k in EXTRAS and v is not None},
        "long_inputs": spec.long_inputs,
        "input.format": spec.input.format,
        "input.path": spec.input.path,
        "input.text_field": spec.input.text_field,
        "input.id_field": spec.input.id_field,
        # the default page cap counts as no cap: they differ only on PDFs over 1000 pages, and
        # outputs written when no cap was the default keep resuming. The other parse caps only
        # decide which files are dead letters, never a row's content: left out.
        "input.max_pages": None if spec.input.max_pages == InputSpec.model_fields["max_pages"].default
        else spec.input.max_pages,
        "output.include_text": spec.output.include_text,
        **({"output.format": spec.output.format} if spec.output.format != "parquet" else {}),  # older outputs resume
        "tasks": [t.name for t in spec.tasks],
    }
    if spec.output.keep_columns:  # only when set: older outputs keep their fingerprint
        fields["output.keep_columns"] = spec.output.keep_columns
    for task in spec.tasks:
        fields[f"tasks.{task.name}.prompt"] = task.source
        fields[f"tasks.{task.name}.max_tokens"] = task.max_tokens
        if task.output is not None or task.system is not None or task.chat_template_kwargs or task.raw:
            fields[f"tasks.{task.name}.output"] = task.output.model_dump() if task.output is not None else None
            fields[f"tasks.{task.name}.chat"] = [task.system, task.chat_template_kwargs, task.raw]
        if task.sampling is not None:  # only when set: older jobs keep their fingerprint
            fields[f"tasks.{task.name}.sampling"] = task.sampling.model_dump(exclude_none=True)
        if task.long_inputs is not None:  # only when set: older jobs keep their fingerprint
            fields[f"tasks.{task.name}.long_inputs"] = task.long_inputs
    if "chunk" in {spec.long_inputs, *(t.long_inputs for t in spec.tasks)}:
        for key, value in spec.chunking.model_dump().items():
            fields[f"chunking.{key}"] = value
    return fields


# what the job's files hold (not its text): recorded by a run, compared on resume when the
# stored output has them (outputs written before they were recorded resume as before)
CONTENT_KEYS = ("model.identity", "model.chat_template_sha256")


def content_fields(spec: JobSpec) -> dict[str, Any]:
    """The model's identity by content (`dlbatch.engine.hub.identity`: a Hub commit, a
    folder's config/tokenizer/weight headers, a GGUF's header) and the chat template file's
    sha256: the same names over other weights or another template are another job."""
    from dlbatch.engine.loader import model_identity

    out: dict[str, Any] = {"model.identity": model_identity(spec.model.ref)}
    if spec.model.chat_template:
        with open(spec.model.chat_template, "rb") as f:
            out["model.chat_template_sha256"] = hashlib.sha256(f.read()).hexdigest()
    return out


def job_fingerprint(spec: JobSpec, content: Optional[Mapping[str, Any]] = None) -> str:
    """sha256 (hex) of :func:`fingerprint_fields` (and the `content_fields` when given);
    equal specs over equal files give equal fingerprints."""
    canonical = json.dumps({**fingerprint_fields(spec), **(content or {})}, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


_ABSENT = object()


def fingerprint_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Human-readable changes between two :func:`fingerprint_fields` dicts."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if a == b:
            continue
        left = "(absent)" if a is _ABSENT else _short(a, 60)
        right = "(absent)" if b is _ABSENT else _short(b, 60)
        changes.append(f"{key}: {left} -> {right}")
    return changes


def check_resume_compatible(stored_fields: Mapping[str, Any], spec: JobSpec, output: Optional[str] = None,
                            content: Optional[Mapping[str, Any]] = None) -> None:
    """Raise :class:`ResumeMismatchError` when ``spec`` differs from the job that wrote the output.

    ``stored_fields`` is the :func:`fingerprint_fields` dict saved with the output (with the
    `content_fields` of its run); ``content`` is this run's, compared where both have a key.
    """
    now = {**fingerprint_fields(spec), **{k: v for k, v in (content or {}).items() if k in stored_fields}}
    changes = fingerprint_diff(stored_fields, now)
    if changes:
        where = output or spec.output.path
        raise ResumeMismatchError(
            spec.source,
            [("", f"cannot resume into {where!r}: it was written by a different job configuration "
                  "(rerun with --fresh to start over, or choose another output.path); changed: "
                  + "; ".join(changes))],
        )

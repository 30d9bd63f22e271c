"""`JobSpec`: the whole job file, its sections (one module each) and the checks that span them."""
from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from dlbatch.jobspec.cluster import BatchingSpec, ClusterSpec, RetriesSpec, RouterSpec
from dlbatch.jobspec.inputs import STRICT, InputSpec
from dlbatch.jobspec.model import ModelSpec
from dlbatch.jobspec.outputs import OutputSpec
from dlbatch.jobspec.tasks import (OPENAI_KEEP, ChunkingSpec, LongInputPolicy, SamplingSpec, TaskSpec, _default_tasks,
                                   openai_batch_tasks)


class JobSpec(BaseModel):
    model_config = STRICT

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
    # a run whose dead-lettered share of documents passes this stops non-zero, its output not
    # complete (judged from 20 finished documents on, and at the end); 1: never
    max_dead_letter_fraction: float = Field(0.5, ge=0.0, le=1.0)

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
        if batch_in and self.output.samples == "rows":
            raise ValueError("output.samples rows: an OpenAI batch line's n samples are the choices of one response; "
                             "leave output.samples at list")
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
        from connectors.formats import input_format
        from dlbatch.prompts.templates import column_references

        if not input_format(self.input.format).has_columns:
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
            from dlbatch.prompts.columns import result_column_names

            names = set(result_column_names(self.tasks))
            clash = [c for c in self.output.keep_columns if c in names]
            if clash:
                raise ValueError(f"output.keep_columns: {', '.join(map(repr, clash))} is the name of a result "
                                 "column; rename the input column")
        return self

    @model_validator(mode="after")
    def _check_backend_pools(self) -> "JobSpec":
        from dlbatch.backends import backend_class

        backend = backend_class(self.model.backend)
        if any(role not in backend.roles for role in self.cluster.pools()):
            raise ValueError(
                f"model.backend {backend.name} runs {'/'.join(backend.roles)} workers only: set cluster.colocated "
                f"(e.g. --set cluster.colocated.chip=fast). {backend.pd_note}")
        for role, pool in self.cluster.pools().items():
            backend.check_pool(self.model, role, pool)  # its num_gpus: the devices a replica drives
        return self

    @model_validator(mode="after")
    def _check_adapters(self) -> "JobSpec":
        """A task's adapter is one of model.adapters (the backend runs adapters: its
        `validate_model`)."""
        for i, t in enumerate(self.tasks):
            if t.adapter is not None and t.adapter not in self.model.adapters:
                known = ", ".join(self.model.adapters) or "none: the job has no model.adapters"
                raise ValueError(f"tasks.{i}.adapter: {t.adapter!r} is not a name of model.adapters ({known})")
        return self

    @model_validator(mode="after")
    def _check_images(self) -> "JobSpec":
        """Tasks with images: a PDF's pages and figures from PDF inputs, a row's image column
        from inputs whose rows have columns; not map-reduced; on a backend that runs images."""
        from connectors.formats import input_format
        from dlbatch.backends import backend_class

        fmt = self.input.format
        rows = input_format(fmt).has_columns and input_format(fmt).id_field is None  # not openai_batch lines
        for i, t in enumerate(self.tasks):
            if t.images is None:
                continue
            if t.images.column is not None and not rows:
                raise ValueError(f"tasks.{i}.images.column: task {t.name!r} takes its images from the column "
                                 f"{t.images.column!r} of a row, and {fmt} inputs have no such rows (jsonl, parquet, "
                                 "hf, dataset do); a PDF's images are images: {pages: ..., figures: true}")
            if t.images.column is None and fmt != "pdf":
                raise ValueError(f"tasks.{i}.images: task {t.name!r}: page images and figure crops come from PDF "
                                 f"inputs, not {fmt}; a row's images come from a column: images: {{column: <name>}} "
                                 "(docs/multimodal.md)")
            if (t.long_inputs or self.long_inputs) == "chunk":
                raise ValueError(f"tasks.{i}.images: long_inputs chunk does not map images over chunks; give the "
                                 "task long_inputs truncate, middle or skip")
            backend_class(self.model.backend).check_features(images=True)
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

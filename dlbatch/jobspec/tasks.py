"""``tasks:``, ``sampling:``, ``chunking:`` — what is asked of every document and how it is sampled."""
from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from dlbatch.jobspec.inputs import STRICT
from dlbatch.prompts.templates import check_template


class TaskOutputSpec(BaseModel):
    """What a task's output must be (exactly one key): the engine constrains the generation
    to it and the rows carry the parsed, typed value (dlbatch/prompts/structured.py)."""

    model_config = STRICT

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


EXTRAS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "n", "logprobs")


class SamplingSpec(BaseModel):
    model_config = STRICT

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
    model_config = STRICT

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


LongInputPolicy = Literal["truncate", "middle", "skip", "chunk"]


class TaskImagesSpec(BaseModel):
    """A task's images (docs/multimodal.md): of a PDF, its page images and figure crops,
    rendered in the parse process (scanned pages, with no text layer, always come with
    them); of a table input's row, the images its ``column`` holds or names, read in the
    parse process."""
    model_config = STRICT

    column: Optional[str] = Field(None, min_length=1)  # a JSONL/Parquet/hf row's image column (not with pages/figures)
    pages: Optional[Union[list[int], str]] = None  # [1, 2], "all" or "first:N"; null: none (scanned pages still)
    figures: bool = False  # the figure and table crops, each with its caption
    dpi: int = Field(144, ge=36, le=600)
    format: Literal["png", "jpeg", "webp"] = "png"

    @field_validator("pages")
    @classmethod
    def _pages(cls, v):
        if isinstance(v, str) and not re.fullmatch(r"all|first:[1-9][0-9]*", v):
            raise ValueError(f"pages {v!r}: give a list of page numbers, 'all' or 'first:N'")
        if isinstance(v, list) and (not v or any(p < 1 for p in v)):
            raise ValueError(f"pages {v!r}: page numbers start at 1 (a list of at least one)")
        return v


class TaskSpec(BaseModel):
    model_config = STRICT

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
    adapter: Optional[str] = Field(None, min_length=1)  # a name of model.adapters (LoRA); None: the base model
    images: Optional[TaskImagesSpec] = None  # a PDF's pages / figure crops, or a row's image column, for a VLM

    @model_validator(mode="after")
    def _check_images(self) -> "TaskSpec":
        from dlbatch.prompts.multimodal import image_references

        used = image_references(self.source)
        if used and self.images is None:
            raise ValueError(f"task {self.name!r} uses {', '.join(used)} but asks for no images: give it images: "
                             "(e.g. {pages: 'first:2', figures: true})")
        if self.images is not None and self.messages is not None:
            raise ValueError(f"task {self.name!r}: images: place images in a prompt template, not in messages")
        if self.images is not None and self.long_inputs == "chunk":
            raise ValueError(f"task {self.name!r}: long_inputs chunk does not map images over chunks; use "
                             "truncate, middle or skip")
        if self.images is not None and self.images.column is not None:
            im = self.images  # the PDF keys at their defaults (a dumped spec spells them) are not asked for
            pdf = [k for k, off in (("pages", None), ("figures", False), ("dpi", 144), ("format", "png"))
                   if getattr(im, k) != off]
            if pdf:
                raise ValueError(f"task {self.name!r}: images.column takes the row's images; {', '.join(pdf)} "
                                 "are how a PDF's pages and figures are rendered: give one or the other")
            pdf_vars = [v for v in used if v in ("page_images", "page_image", "figures", "figure")]
            if pdf_vars:
                raise ValueError(f"task {self.name!r} uses {', '.join(pdf_vars)}, a PDF's images, but takes its "
                                 f"images from column {self.images.column!r}: place them with {{{{ images }}}} "
                                 "or {{ image(1) }}")
        return self

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
    model_config = STRICT

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

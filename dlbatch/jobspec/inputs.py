"""``input:`` — where the documents come from and the caps on reading one."""
from __future__ import annotations

import os
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from dlbatch.jobspec.paths import _resolve_local, is_url

STRICT = ConfigDict(extra="forbid", strict=True, validate_default=True)  # every section: unknown keys and loose types are errors


class InputSpec(BaseModel):
    model_config = STRICT

    # openai_batch: OpenAI Batch API request files, one request a line (connectors/openai_batch.py)
    format: Literal["pdf", "jsonl", "parquet", "text", "hf", "openai_batch", "dataset"] = "pdf"
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
    # Bounds on what one document may cost downstream (connectors/records.py, text_sources.py); the
    # same defaults are connectors' MAX_LINE_BYTES and MAX_TEXT_CHARS
    max_line_bytes: Optional[int] = Field(16 << 20, ge=1)  # a longer JSONL/batch line: LineTooLong, never held
    max_text_chars: Optional[int] = Field(2_000_000, ge=1)  # a longer text is cut to it (text_truncated_chars)
    # the images of one PDF its tasks ask for (docs/multimodal.md): past either, ImageBudgetExceeded
    max_images: int = Field(64, ge=1)
    max_image_pixels: int = Field(64_000_000, ge=1)
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

"""``output:`` — where the rows land and in which format."""
from __future__ import annotations

import os
from typing import Any, Literal, Union

from pydantic import BaseModel, Field, field_validator

from dlbatch.jobspec.inputs import STRICT
from dlbatch.jobspec.paths import _local_path, _normalize_output_path


class OutputSpec(BaseModel):
    model_config = STRICT

    path: str = "out/papers"
    include_text: bool = False
    # input columns copied into every result row of their document, with their Arrow types:
    # a list of names, or "all" (every column but the text and those named like a result column)
    keep_columns: Union[list[str], Literal["all"]] = Field(default_factory=list)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    # parquet: one Parquet part per commit (default); delta: a Delta Lake table (dlbatch/output/delta_store.py);
    # openai_batch (openai_batch input only): the Parquet parts, and results.jsonl / errors.jsonl in the
    # Batch API's output format written from them when a run completes (dlbatch/output/openai_export.py)
    format: Literal["parquet", "delta", "openai_batch"] = "parquet"
    # n samples of a task: "list" keeps sample 0 in `output` and every sample in a `samples` list
    # column; "rows" writes one row per sample, numbered by `sample_index` (dlbatch/prompts/sampling.py)
    samples: Literal["list", "rows"] = "list"

    @field_validator("path")
    @classmethod
    def _confine(cls, value: str) -> str:
        path = _normalize_output_path(value)
        local = _local_path(path)
        if local is not None and os.path.exists(local) and not os.path.isdir(local):
            raise ValueError(f"{value!r} is an existing file; the output is a directory of Parquet parts: "
                             "name a directory (new or existing)")
        return path

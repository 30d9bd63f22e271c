"""``model:`` — which weights, which engine backend, which chat template."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, Field, model_validator

from dlbatch.jobspec.inputs import STRICT


class ModelSpec(BaseModel):
    model_config = STRICT

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

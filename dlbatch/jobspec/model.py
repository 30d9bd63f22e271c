"""``model:`` — which weights, which engine backend, which chat template.

The backend names are the registry's (`dlbatch.backends.REGISTRY`), and the checks of the
section that depend on the backend are its class's (`EngineBackend.validate_model`)."""
from __future__ import annotations

import os
import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field, field_validator, model_validator

from dlbatch.backends import DEFAULT_BACKEND, REGISTRY, backend_class
from dlbatch.jobspec.inputs import STRICT

_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class ModelSpec(BaseModel):
    model_config = STRICT

    name: str = Field("smollm2-135m-instruct", min_length=1)  # alias, folder, GGUF, URL or Hub id org/name
    revision: Optional[str] = Field(None, min_length=1)  # a Hub id's branch, tag or commit
    backend: str = DEFAULT_BACKEND  # which engine runs the model: a name of dlbatch.backends.REGISTRY
    engine_args: dict[str, Any] = Field(default_factory=dict)  # the backend's own engine arguments
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    max_model_len: Optional[int] = Field(None, ge=1)  # null: the model's context, at most 8192 (backend limits)
    chat: Optional[bool] = None
    system: Optional[str] = None  # system prompt of every task (a task's own `system` wins)
    chat_template: Optional[str] = None  # path to a Jinja chat template file, instead of the model's
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)  # extra template variables
    # other names a request may give for this model (an OpenAI batch body's "model"), as vLLM's
    # --served-model-name: bodies written for another deployment run unchanged
    served_model_name: list[str] = Field(default_factory=list)
    # LoRA adapters (docs/adapters.md): name -> a local folder or a Hub id (org/name[@revision]);
    # a task runs one with `adapter: name`, an OpenAI batch line by naming it in body.model
    adapters: dict[str, str] = Field(default_factory=dict)
    max_loras: Optional[int] = Field(None, ge=1)  # adapters one engine batch mixes; null: all of them
    max_lora_rank: Optional[int] = Field(None, ge=1)  # null: the largest rank of the adapters

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: str) -> str:
        if value not in REGISTRY:
            raise ValueError(f"{value!r} is not one of {', '.join(REGISTRY)}")
        return value

    @field_validator("adapters")
    @classmethod
    def _check_adapters(cls, value: dict[str, str]) -> dict[str, str]:
        """Names are request names (``[A-Za-z0-9_.-]``); a local folder is made absolute, so
        workers started elsewhere find it; anything else must be a Hub id."""
        from dlbatch.engine.hub import is_hub_id
        from dlbatch.jobspec.paths import _resolve_local

        out = {}
        for name, where in value.items():
            if not _ADAPTER_NAME.match(name):
                raise ValueError(f"adapter name {name!r} must be letters, digits, '_', '.' or '-'")
            if not where or not where.strip():
                raise ValueError(f"adapter {name!r}: give a local folder or a Hub id (org/name)")
            local = _resolve_local(where)
            if os.path.isdir(local):
                out[name] = local
            elif is_hub_id(where):
                out[name] = where
            else:
                raise ValueError(f"adapter {name!r}: {where!r} is neither a local folder nor a Hub id (org/name)")
        return out

    @model_validator(mode="after")
    def _check_engine(self) -> "ModelSpec":
        if self.revision is not None:
            from dlbatch.engine.hub import is_hub_id

            if not is_hub_id(self.name) or "@" in self.name:
                raise ValueError(f"revision {self.revision!r} applies to a Hub id (org/name) only, "
                                 f"not to {self.name!r}")
        if self.name in self.adapters:
            raise ValueError(f"adapter name {self.name!r} is the base model's name: a request naming it runs the "
                             "base model; rename the adapter")
        if (self.max_loras is not None or self.max_lora_rank is not None) and not self.adapters:
            raise ValueError("max_loras / max_lora_rank apply to model.adapters, and the job has none")
        backend_class(self.backend).validate_model(self)  # e.g. engine_args the backend does not take
        return self

    def check_features(self, adapters: bool = False, images: bool = False) -> None:
        """ValueError naming why this model's backend cannot run requests with ``adapters`` or
        ``images`` (`EngineBackend.check_features`)."""
        backend_class(self.backend).check_features(adapters=adapters, images=images)

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names a request may give for this model: ``name``, then ``served_model_name``."""
        return (self.name, *self.served_model_name)

    @property
    def ref(self) -> str:
        """What the engines load: the name, with ``@revision`` for a pinned Hub id."""
        from dlbatch.engine.hub import ref

        return ref(self.name, self.revision)

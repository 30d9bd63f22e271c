"""Key paths of the job schema: the annotation at a path, and the known keys near a bad one
(both the validation messages and ``--set`` walk the schema with these)."""
from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Iterable, Union

from pydantic import BaseModel

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
    from dlbatch.jobspec.spec import JobSpec

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

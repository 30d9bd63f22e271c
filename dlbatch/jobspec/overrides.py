"""``--set key.path=value``: a job dict with overrides applied, following the schema so a key
the file leaves at its default can still be set."""
from __future__ import annotations

import copy
import re
import typing
from typing import Any, Iterable, Mapping

import yaml
from pydantic import BaseModel

from dlbatch.jobspec.errors import JobSpecError, _short
from dlbatch.jobspec.keys import _is_model, _known_keys_message, _unwrap_optional


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
    from dlbatch.jobspec.spec import JobSpec

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

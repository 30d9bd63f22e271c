"""Reading a job: YAML (safe loader only) -> overrides -> schema files inlined -> `JobSpec`,
then the checks across sections (the output folder against the input folder, every
``max_tokens`` against the context). The context is the job's backend's (`EngineBackend.limits`,
the rule the run resolves with, `dlbatch.driver.config.RunConfig`): known at load from
the job file and, where it is at hand, the model's config.json."""
from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Mapping, Optional, Union

import yaml
from pydantic import ValidationError

from dlbatch.backends import ModelLimits, backend_class
from dlbatch.jobspec.errors import JobSpecError, _short
from dlbatch.jobspec.keys import _annotation_at, _known_keys_message
from dlbatch.jobspec.model import ModelSpec
from dlbatch.jobspec.overrides import apply_overrides
from dlbatch.jobspec.paths import _input_folder, _is_inside, is_url
from dlbatch.jobspec.spec import JobSpec
from dlbatch.prompts.templates import TemplateError


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
    problems = _cross_problems(spec, backend_class(spec.model.backend).limits(spec.model, None))
    if problems:
        raise JobSpecError(source, problems)
    spec._source = source
    return spec


def model_context(model: ModelSpec) -> ModelLimits:
    """The backend's limits for the model (`EngineBackend.limits`, the rule the run resolves
    with), known without loading weights where that is cheap: its config.json when the model
    is a folder at hand (a local folder, a Hub snapshot in the cache); otherwise (a GGUF not
    converted yet, a remote model, a model not found here) the backend's cap, an upper bound."""
    return backend_class(model.backend).limits(model, None if model.max_model_len else _config_at_hand(model))


def _config_at_hand(model: ModelSpec) -> dict | None:
    """The model's config.json when it is a local folder (or a cached Hub snapshot), else None."""
    if is_url(model.name):
        return None
    try:
        from dlbatch.engine.loader import resolve_model

        folder = resolve_model(model.ref)
        if not os.path.isdir(folder):
            return None
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except Exception:  # the run reports a model it cannot find or read, naming it
        return None


def token_budget_problems(spec: JobSpec, limits: ModelLimits) -> list[tuple[str, str]]:
    """A task's max_tokens (and the chunk map requests' budget) that leaves no room for a
    prompt in the context ``limits.max_model_len`` (every document would be a dead letter)."""
    budgets = [(f"tasks.{i}.max_tokens", t.max_tokens) for i, t in enumerate(spec.tasks)]
    if "chunk" in {spec.long_inputs, *(t.long_inputs for t in spec.tasks)}:
        budgets.append(("chunking.map_max_tokens", spec.chunking.map_max_tokens))
    return [(key, f"{n} leaves no room for a prompt in max_model_len {limits.max_model_len} ({limits.source}); "
                  f"max_tokens must be below it, with room for the document")
            for key, n in budgets if n >= limits.max_model_len]


def _cross_problems(spec: JobSpec, limits: ModelLimits) -> list[tuple[str, str]]:
    """Problems between sections: an output folder inside the input folder (its parts would
    be read back as inputs), a task's max_tokens that leaves no room for a prompt in the
    model's context (`token_budget_problems`); and a ``${env:NAME}`` in storage
    options outside the keys that may read the environment (`connectors.secrets`)."""
    from connectors.secrets import reference_problems

    problems = reference_problems(spec.input.storage_options, "input.storage_options")
    problems += reference_problems(spec.output.storage_options, "output.storage_options")
    folder = _input_folder(spec)
    if folder is not None and _is_inside(spec.output.path, folder):
        problems.append(("output.path", f"{spec.output.path!r} is inside input.path {spec.input.path!r}: "
                                        "the outputs would be read back as inputs; write them elsewhere"))
    return problems + token_budget_problems(spec, limits)


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

"""What determines a job's outputs: the fingerprint a resume compares."""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Optional

from dlbatch.backends import DEFAULT_BACKEND
from dlbatch.jobspec.errors import ResumeMismatchError, _short
from dlbatch.jobspec.inputs import InputSpec
from dlbatch.jobspec.spec import JobSpec
from dlbatch.jobspec.tasks import EXTRAS


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
        **({"model.backend": spec.model.backend} if spec.model.backend != DEFAULT_BACKEND else {}),
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
        # the text cap changes the rows of longer documents only: set off its default (or null) it
        # counts, the default and no cap alike do not (outputs written before it existed resume)
        **({"input.max_text_chars": spec.input.max_text_chars} if spec.input.max_text_chars not in (
            None, InputSpec.model_fields["max_text_chars"].default) else {}),
        "output.include_text": spec.output.include_text,
        **({"output.format": spec.output.format} if spec.output.format != "parquet" else {}),  # older outputs resume
        "tasks": [t.name for t in spec.tasks],
    }
    if spec.output.keep_columns:  # only when set: older outputs keep their fingerprint
        fields["output.keep_columns"] = spec.output.keep_columns
    if spec.model.adapters:  # only when set (their content: `content_fields`)
        fields["model.adapters"] = dict(spec.model.adapters)
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
        if task.adapter is not None:
            fields[f"tasks.{task.name}.adapter"] = task.adapter
        if task.images is not None:
            dump = task.images.model_dump()
            if dump["column"] is None:  # a PDF task: its render settings (pages, figures, dpi, format)
                del dump["column"]
            fields[f"tasks.{task.name}.images"] = dump
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
    sha256, and each LoRA adapter's sha256 (`dlbatch.backends.lora.adapter_identity`): the
    same names over other weights, another template or another adapter are another job."""
    from dlbatch.engine.loader import model_identity

    out: dict[str, Any] = {"model.identity": model_identity(spec.model.ref)}
    if spec.model.adapters:  # each adapter's content: a changed adapter is another job
        from dlbatch.backends.lora import adapter_identity

        out.update({f"model.adapters.{n}.identity": adapter_identity(n, r) for n, r in sorted(spec.model.adapters.items())})
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

"""A pipeline's Python hooks around the prompts (pipelines/__init__.py says what a pipeline
module may define): ``preprocess(doc)`` on each document's template context before its
prompts are rendered, ``postprocess(row)`` on each result row before it is committed.

A hook that raises fails its document alone: the document becomes a dead letter naming the
hook and the error, the job goes on. `Skip` is how a preprocess hook leaves a document out on
purpose: its dead letter says ``Skipped`` and the reason, so the job still completes and a
rerun does not try it again.
"""
from __future__ import annotations

from typing import Callable


class Skip(Exception):
    """Raised by a preprocess hook: leave this document out (a ``Skipped`` dead letter)."""


def apply_preprocess(hook: Callable[[dict], dict], ctx: dict) -> dict:
    """The context the templates see: ``hook(ctx)``, which must return a mapping."""
    out = hook(dict(ctx))
    if not isinstance(out, dict):
        raise TypeError(f"preprocess returned {type(out).__name__}, not the document's context (a dict)")
    return out


def postprocess_fields(module) -> list:
    """The pyarrow fields a pipeline's ``POSTPROCESS_FIELDS`` declares (``[(name, type name)]``,
    type names as pyarrow spells them: ``int64``, ``string``, ``float64``, ``bool``, ...)."""
    import pyarrow as pa

    fields = []
    for name, type_name in getattr(module, "POSTPROCESS_FIELDS", ()) or ():
        try:
            fields.append(pa.field(str(name), pa.type_for_alias(str(type_name))))
        except (ValueError, KeyError):
            raise ValueError(f"POSTPROCESS_FIELDS: {name!r} has type {type_name!r}, which pyarrow does not "
                             "name (int64, string, float64, bool, ...)") from None
    return fields

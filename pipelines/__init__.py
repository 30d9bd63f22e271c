"""Named pipelines, selected by `pipeline:` in a job file. A job file can only choose one
of these registered names: it never supplies code.

Two kinds of names: the ones shipped here (`REGISTRY`), and pipelines of one's own,
registered by an installed package under the entry-point group ``dlbatch.pipelines``
(``[project.entry-points."dlbatch.pipelines"] mine = "mypkg.pipeline"``), so Python logic
lives in the user's package and the job file stays data. A shipped name wins over an
entry point of the same name.

A pipeline is a module with:

- ``build(spec, files, skip_doc_ids, *, max_model_len, dataset=None, preprocess=None)`` ->
  the Ray Data dataset of request rows (`pipelines.papers.build` is the one every pipeline
  here uses; a pipeline of one's own usually re-exports it: ``build = papers.build``);
- optionally ``preprocess(doc) -> doc``: called on each document before its prompts are
  rendered, with the template context (``text``, ``title``, ``doc_id``, ``source``,
  ``pages``, ``row``: the input row's columns); it returns the context the templates see.
  Raising fails that document alone (a dead letter naming the error); raise
  `dlbatch.prompts.hooks.Skip` to leave a document out on purpose (a ``Skipped`` dead letter,
  so the job still completes);
- optionally ``postprocess(row) -> row`` and ``POSTPROCESS_FIELDS`` (``[(name, arrow type
  name)]``): called on each result row before it is committed; the fields it adds are
  committed as typed columns.
"""
from __future__ import annotations

import importlib

REGISTRY = {
    "papers": "pipelines.papers",
    "jsonl_prompts": "pipelines.papers",
}
ENTRY_POINT_GROUP = "dlbatch.pipelines"


def _entry_points() -> dict[str, str]:
    """{name: module} of installed packages' pipelines (entry-point group ``dlbatch.pipelines``)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
    return sorted({*REGISTRY, *_entry_points()})


def get_pipeline(name: str):
    target = REGISTRY.get(name) or _entry_points().get(name)
    if target is None:
        raise ValueError(f"pipeline {name!r} is not registered; choose one of {', '.join(names())} (a package "
                         f"of one's own registers more under the entry-point group {ENTRY_POINT_GROUP!r})")
    module = importlib.import_module(target.split(":", 1)[0])
    if not callable(getattr(module, "build", None)):
        raise ValueError(f"pipeline {name!r} ({target}) has no build(spec, files, skip_doc_ids, ...) function")
    return module

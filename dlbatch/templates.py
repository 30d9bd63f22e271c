"""Prompt templates: one Jinja template per task, rendered in a sandbox.

Job files are user input, so templates are rendered with Jinja's
``ImmutableSandboxedEnvironment``: no access to dunder attributes (the classic
``{{ ''.__class__.__mro__ }}`` injection raises), no mutation of values, and
``StrictUndefined`` so that a misspelt variable is an error that names it
instead of silently rendering as an empty string.

The variables a template may use are :data:`TEMPLATE_VARIABLES`::

    text     the document text
    title    the document title (may be empty)
    doc_id   the stable document id
    source   where the document came from (path or URL)
    pages    number of pages (PDF) or None

Usage::

    render = compile_task_templates(spec.tasks)
    prompts = render({"text": ..., "title": ..., "doc_id": ..., "source": ..., "pages": 3})
    # -> one prompt per task, in task order

Tasks of one document should start with the document (``{{ text }}`` first)
so that the K prompts of a document share it as a prefix and the router /
prefix cache compute the document's KV once: :func:`check_shared_prefix`.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import jinja2
from jinja2 import StrictUndefined, meta
from jinja2.exceptions import SecurityError, TemplateSyntaxError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "TEMPLATE_VARIABLES",
    "TemplateError",
    "validate_template",
    "compile_task_templates",
    "split_prefix",
    "check_shared_prefix",
]

TEMPLATE_VARIABLES: tuple[str, ...] = ("text", "title", "doc_id", "source", "pages")


class TemplateError(ValueError):
    """A prompt template is invalid or failed to render; the message names the task."""

    def __init__(self, task: str, message: str):
        self.task = task
        super().__init__(f"task {task!r}: {message}")


def _environment() -> ImmutableSandboxedEnvironment:
    # keep_trailing_newline: a prompt is rendered exactly as written.
    # autoescape off: prompts are plain text, not HTML.
    return ImmutableSandboxedEnvironment(
        undefined=StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )


_ENV = _environment()


def _task_fields(task: Any) -> tuple[str, str]:
    if isinstance(task, Mapping):
        name, prompt = task.get("name"), task.get("prompt")
    else:
        name, prompt = getattr(task, "name", None), getattr(task, "prompt", None)
    if not isinstance(name, str) or not isinstance(prompt, str):
        raise TypeError(f"a task needs a str 'name' and 'prompt', got {task!r}")
    return name, prompt


def validate_template(
    name: str, prompt: str, allowed: Iterable[str] = TEMPLATE_VARIABLES
) -> jinja2.Template:
    """Compile ``prompt`` and check it only uses ``allowed`` variables.

    Raises :class:`TemplateError` naming the task for a syntax error (with its
    line) or a variable that no document provides.
    """
    try:
        ast = _ENV.parse(prompt)
    except TemplateSyntaxError as e:
        raise TemplateError(name, f"prompt template syntax error at line {e.lineno}: {e.message}") from None
    allowed = set(allowed)
    unknown = sorted(meta.find_undeclared_variables(ast) - allowed)
    if unknown:
        raise TemplateError(
            name,
            "prompt template uses undefined variable(s) "
            + ", ".join(repr(v) for v in unknown)
            + " (available: " + ", ".join(sorted(allowed)) + ")",
        )
    return _ENV.from_string(prompt)


def _render(name: str, template: jinja2.Template, context: dict) -> str:
    try:
        return template.render(context)
    except SecurityError as e:
        raise TemplateError(name, f"prompt template is not allowed to do this: {e}") from None
    except UndefinedError as e:
        raise TemplateError(name, f"prompt template uses an undefined value: {e}") from None
    except jinja2.TemplateError as e:
        raise TemplateError(name, f"prompt template failed to render: {e}") from None
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as e:
        raise TemplateError(name, f"prompt template failed to render: {type(e).__name__}: {e}") from None


def compile_task_templates(tasks: Sequence[Any]) -> Callable[[Mapping[str, Any]], list[str]]:
    """Compile every task's prompt; return ``render(doc) -> [prompt per task]``.

    ``tasks`` are ``TaskSpec`` objects or dicts with ``name`` and ``prompt``.
    ``doc`` is a mapping; only the keys in :data:`TEMPLATE_VARIABLES` are
    visible to templates. A variable a template uses but the document lacks
    raises :class:`TemplateError` naming the task and the variable.
    """
    compiled = []
    for task in tasks:
        name, prompt = _task_fields(task)
        compiled.append((name, validate_template(name, prompt)))
    if not compiled:
        raise ValueError("compile_task_templates needs at least one task")

    def render(doc: Mapping[str, Any]) -> list[str]:
        context = {k: doc[k] for k in TEMPLATE_VARIABLES if k in doc}
        return [_render(name, tpl, context) for name, tpl in compiled]

    return render


def split_prefix(rendered_prompts: Sequence[str]) -> int:
    """Length in characters of the prefix common to all ``rendered_prompts``."""
    if not rendered_prompts:
        return 0
    first = min(rendered_prompts, key=len)
    n = len(first)
    for other in rendered_prompts:
        i = 0
        # compare in chunks first (fast on long documents), then by character
        step = 4096
        while i + step <= n and other[i:i + step] == first[i:i + step]:
            i += step
        while i < n and other[i] == first[i]:
            i += 1
        n = i
        if n == 0:
            break
    return n


_SENTINEL_TEXT = "\u241fdlbatch-document-text\u241f"


def check_shared_prefix(tasks: Sequence[Any]) -> bool:
    """True when the tasks' prompts share the whole document as a prefix.

    Renders every template against a placeholder document and checks that the
    prefix common to all prompts reaches the end of the document text. When it
    does not (e.g. an instruction is placed before ``{{ text }}``), warns with a
    ``UserWarning`` and returns False: the job still runs, but each task
    recomputes the document's prefill instead of sharing it.
    """
    render = compile_task_templates(tasks)
    probe = {"text": _SENTINEL_TEXT, "title": "Title", "doc_id": "doc-0", "source": "source", "pages": 1}
    prompts = render(probe)
    names = [_task_fields(t)[0] for t in tasks]
    common = split_prefix(prompts)
    pos = prompts[0].find(_SENTINEL_TEXT)
    if pos >= 0 and common >= pos + len(_SENTINEL_TEXT):
        return True
    bad = [n for n, p in zip(names, prompts) if not p.startswith(_SENTINEL_TEXT)] or names
    warnings.warn(
        "prompt templates of tasks " + ", ".join(repr(n) for n in bad)
        + " do not start with the document ({{ text }} first), so the tasks of a document "
        "cannot share its prefill; put {{ text }} at the start of every prompt",
        UserWarning,
        stacklevel=2,
    )
    return False

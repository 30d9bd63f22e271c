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
    abstract the abstract ("" when none was found or the format has none)
    references               the reference list's text ("" when none)
    text_without_references  the text less the references part (heading included)
    section(name)            a section's text, its subsections included (see below)

``section("Methods")`` matches headings case-insensitively and ignores numbering:
"3 Methods", "III. METHODS" and "3.1. Methods" all match "methods". An exact match wins,
else the first heading that starts with the name ("Methods and Materials"), else "" (the
empty string: a template can test ``{% if section("Appendix") %}``). The text of a match
includes its subsections (deeper-numbered headings that follow), with their headings.
Structure comes from the PDF connector (connectors/sections.py); other formats have no
sections, so there ``section(...)`` is "" and ``text_without_references`` is the text.

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
    "document_context",
    "find_section",
]

TEMPLATE_VARIABLES: tuple[str, ...] = ("text", "title", "doc_id", "source", "pages", "abstract", "references",
                                        "text_without_references", "section")


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
        context = document_context(doc)
        return [_render(name, tpl, context) for name, tpl in compiled]

    return render


def find_section(sections: Sequence[Mapping[str, Any]], name: str) -> str:
    """The text of the section called ``name`` with its subsections; "" when absent."""
    from connectors.sections import normalize_heading

    want = normalize_heading(str(name))
    if not want or not sections:
        return ""
    keys = [normalize_heading(str(s.get("heading", ""))) for s in sections]
    hit = next((i for i, k in enumerate(keys) if k == want), None)
    if hit is None:
        hit = next((i for i, k in enumerate(keys) if k.startswith(want)), None)
    if hit is None:
        return ""
    level = int(sections[hit].get("level") or 1)
    pieces = [str(sections[hit].get("text") or "")]
    for sub in sections[hit + 1:]:
        if int(sub.get("level") or 1) <= level:
            break
        pieces.append(f"{sub.get('heading', '')}\n\n{sub.get('text') or ''}")
    return "\n\n".join(p for p in pieces if p)


def document_context(doc: Mapping[str, Any]) -> dict:
    """What templates see for one document: the plain fields as given, the structure
    fields with their defaults (no structure -> "" / the whole text), ``section``."""
    context = {k: doc[k] for k in ("text", "title", "doc_id", "source", "pages") if k in doc}
    text = doc.get("text") or ""
    sections = list(doc.get("sections") or ())
    context["abstract"] = doc.get("abstract") or ""
    context["references"] = doc.get("references") or ""
    if "text_without_references" in doc:
        context["text_without_references"] = doc["text_without_references"]
    else:
        span = doc.get("references_span")
        context["text_without_references"] = (
            (text[:span[0]] + text[span[1]:]).strip("\n") if span else text)
    context["section"] = lambda name: find_section(sections, name)
    return context


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

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
    page_images, page_image(n), figures, figure("Figure 3"), images, image(n)
                             a task's images (its ``images:``; docs/multimodal.md)
    row      the input row's columns (JSONL, Parquet, datasets): ``{{ row.question }}``,
             ``{{ row["a b"] }}``; the text column is the document's text

Any other name is a column of the input row (``{{ question }}`` is ``{{ row.question }}``);
the names above win over a column of the same name (``row`` reaches it). Such names pass
the template's own checks; the job's checks refuse them for inputs without columns (PDF,
text) and, before a run starts, when the input's columns lack them (`column_references`).

A task may give ``messages`` instead of ``prompt``: one expression in ``{{ }}`` whose value
is an OpenAI-style chat (a list of {"role", "content"}), usually a column
(``{{ row.messages }}``); it goes through the model's chat template as it is
(:func:`compile_messages`).

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

Bounds. A template runs once per (document, task), so no template may hang or
exhaust memory: it renders in the sandbox of dlbatch/prompts/sandbox.py, whose budget
bounds loop steps and wall time, the size of every value the template builds
(concatenation, ``+``, ``*``, formats, ``replace``/``join``/``indent``, every filter
and call) and the characters it writes, in proportion to what the render is given.
A bound that is hit, or a MemoryError, is the task's :class:`TemplateError`.
:func:`check_template` (what the job file's validation calls) refuses attributes and
items whose name starts with ``_`` (the sandbox refuses them at render time anyway),
and renders the template once against a sample document, so a template that breaks
a bound or reaches an undefined value is refused at load, not on every document.
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import jinja2
from jinja2 import StrictUndefined, meta, nodes
from jinja2.exceptions import SecurityError, TemplateSyntaxError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dlbatch.prompts.sandbox import RenderLimit, Sandbox, bounded, budget_for

__all__ = [
    "TEMPLATE_VARIABLES",
    "TemplateError",
    "validate_template",
    "check_template",
    "compile_task_templates",
    "split_prefix",
    "check_shared_prefix",
    "document_context",
    "find_section",
]

# a task's images (docs/multimodal.md, dlbatch/prompts/multimodal.py): markers the prompt stage
# turns into the chat message's image parts; without the task's ``images:`` none is rendered
IMAGE_VARIABLES: tuple[str, ...] = ("page_images", "page_image", "figures", "figure", "images", "image")
TEMPLATE_VARIABLES: tuple[str, ...] = ("text", "title", "doc_id", "source", "pages", "abstract", "references",
                                        "text_without_references", "section", "row") + IMAGE_VARIABLES
ROLES = ("system", "user", "assistant", "developer", "tool")


class TemplateError(ValueError):
    """A prompt template is invalid or failed to render; the message names the task."""

    def __init__(self, task: str, message: str):
        self.task = task
        super().__init__(f"task {task!r}: {message}")


def _environment() -> ImmutableSandboxedEnvironment:
    # keep_trailing_newline: a prompt is rendered exactly as written.
    # autoescape off: prompts are plain text, not HTML.
    return Sandbox(
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
    name: str, prompt: str, allowed: Iterable[str] = TEMPLATE_VARIABLES, columns: bool = False
) -> jinja2.Template:
    """Compile ``prompt`` and check it only uses ``allowed`` variables (``columns``: other
    names are the input row's columns, checked against the input later).

    Raises :class:`TemplateError` naming the task for a syntax error (with its
    line) or a variable that no document provides.
    """
    try:
        ast = _ENV.parse(prompt)
    except TemplateSyntaxError as e:
        raise TemplateError(name, f"prompt template syntax error at line {e.lineno}: {e.message}") from None
    allowed = set(allowed)
    unknown = sorted(meta.find_undeclared_variables(ast) - allowed)
    if unknown and not columns:
        raise TemplateError(
            name,
            "prompt template uses undefined variable(s) "
            + ", ".join(repr(v) for v in unknown)
            + " (available: " + ", ".join(sorted(allowed)) + ")",
        )
    return _ENV.from_string(prompt)


def column_references(source: str) -> set[str]:
    """The input columns a template (or a ``messages`` expression) reads: names that are
    not template variables, and ``row.X`` / ``row["X"]``."""
    ast = _ENV.parse(source)
    names = set(meta.find_undeclared_variables(ast)) - set(TEMPLATE_VARIABLES)
    for n in ast.find_all(nodes.Getattr):
        if isinstance(n.node, nodes.Name) and n.node.name == "row":
            names.add(n.attr)
    for n in ast.find_all(nodes.Getitem):
        if isinstance(n.node, nodes.Name) and n.node.name == "row" and isinstance(n.arg, nodes.Const) \
                and isinstance(n.arg.value, str):
            names.add(n.arg.value)
    return names


def reads_row(source: str) -> bool:
    """Whether a template reads the input row at all (``row`` or a column by its name)."""
    return "row" in meta.find_undeclared_variables(_ENV.parse(source)) or bool(column_references(source))


class _SampleRow(dict):
    """The row of the sample document: any column reads as a sample string."""

    def __missing__(self, key):
        return "sample"


_MESSAGES_FORM = re.compile(r"^\s*\{\{(.+)\}\}\s*$", re.S)


def compile_messages(name: str, source: str) -> Callable[[Mapping[str, Any]], list[dict]]:
    """A task's ``messages``: one ``{{ expression }}`` -> ``render(doc)`` giving the chat as a
    list of {"role", "content"} (content parts as their text joined). The expression runs in
    the sandbox; a value that is not such a list is a TemplateError naming the task."""
    m = _MESSAGES_FORM.match(source)
    if not m or "{{" in m.group(1) or "{%" in source:
        raise TemplateError(name, f"messages must be one expression in {{{{ }}}}, such as "
                                  f"'{{{{ row.messages }}}}', got {source[:60]!r}")
    try:
        expr = _ENV.compile_expression(m.group(1), undefined_to_none=False)
    except TemplateSyntaxError as e:
        raise TemplateError(name, f"messages expression syntax error: {e.message}") from None

    def render(doc: Mapping[str, Any]) -> list[dict]:
        context = document_context(doc)
        try:
            with bounded(budget_for(context)):
                value = expr(**context)
        except UndefinedError as e:
            raise TemplateError(name, f"messages uses an undefined value: {e}") from None
        except (SecurityError, RenderLimit, jinja2.TemplateError, TypeError, ValueError, LookupError) as e:
            raise TemplateError(name, f"messages failed: {type(e).__name__}: {e}") from None
        except MemoryError:
            raise TemplateError(name, "messages ran out of memory (MemoryError)") from None
        if isinstance(value, jinja2.Undefined):
            raise TemplateError(name, f"messages uses an undefined value: {m.group(1).strip()!r}")
        return chat_messages(name, value)

    return render


def chat_messages(name: str, value: Any) -> list[dict]:
    """``value`` as a chat: a non-empty list of {"role": one of ROLES, "content": str};
    a content given as parts keeps their text, joined."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except ValueError:
            pass
    if not isinstance(value, (list, tuple)) or not value:
        raise TemplateError(name, f"messages must be a non-empty list of {{role, content}}, got "
                                  f"{type(value).__name__}")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping) or msg.get("role") not in ROLES:
            raise TemplateError(name, f"message {i} must be a mapping with role one of {', '.join(ROLES)}, "
                                      f"got {str(msg)[:80]!r}")
        content = msg.get("content")
        if isinstance(content, (list, tuple)):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        if content is not None and not isinstance(content, str):
            raise TemplateError(name, f"message {i}: content must be text, got {type(content).__name__}")
        out.append({"role": msg["role"], "content": content or ""})
    return out


def _private_names(ast: nodes.Template) -> list[str]:
    """Attribute and item names starting with ``_`` that the template reads
    (``x.__class__``, ``x["_y"]``, ``x|attr("__dict__")``)."""
    found = [n.attr for n in ast.find_all(nodes.Getattr) if n.attr.startswith("_")]
    found += [n.arg.value for n in ast.find_all(nodes.Getitem)
              if isinstance(n.arg, nodes.Const) and isinstance(n.arg.value, str) and n.arg.value.startswith("_")]
    for f in ast.find_all(nodes.Filter):
        if f.name == "attr" and f.args and isinstance(f.args[0], nodes.Const) and str(f.args[0].value).startswith("_"):
            found.append(str(f.args[0].value))
    return found


def _render_bounded(template: jinja2.Template, context: Mapping[str, Any]) -> str:
    """Render under a fresh budget sized from the context (`dlbatch.prompts.sandbox.budget_for`)."""
    with bounded(budget_for(context)) as budget:
        out, size = [], 0
        for piece in template.generate(context):
            size += len(piece)
            budget.check_size(size)
            out.append(piece)
        return "".join(out)


def _render(name: str, template: jinja2.Template, context: dict) -> str:
    try:
        return _render_bounded(template, context)
    except RenderLimit as e:
        raise TemplateError(name, f"prompt template goes past a render bound: {e}") from None
    except RecursionError:
        raise TemplateError(name, "prompt template recursed too deeply") from None
    except MemoryError:
        raise TemplateError(name, "prompt template ran out of memory (MemoryError) past the render bounds") from None
    except SecurityError as e:
        raise TemplateError(name, f"prompt template is not allowed to do this: {e}") from None
    except UndefinedError as e:
        raise TemplateError(name, f"prompt template uses an undefined value: {e}") from None
    except jinja2.TemplateError as e:
        raise TemplateError(name, f"prompt template failed to render: {e}") from None
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as e:
        raise TemplateError(name, f"prompt template failed to render: {type(e).__name__}: {e}") from None


_SAMPLE_TEXT = ("Abstract\n\nWe study a sample problem and report a sample result.\n\n1 Introduction\n\n"
                + "This paragraph stands for the body of a document. " * 40
                + "\n\n2 Methods\n\nWe measured things.\n\nReferences\n\n[1] A. Author. A paper. 2020.\n")
SAMPLE_CONTEXT: dict[str, Any] = {
    "text": _SAMPLE_TEXT, "title": "A sample title", "doc_id": "sample-0", "source": "samples/sample.pdf",
    "pages": 3, "abstract": "We study a sample problem and report a sample result.",
    "references": "[1] A. Author. A paper. 2020.",
    "sections": [{"heading": "1 Introduction", "level": 1, "text": "This paragraph stands for the body."},
                 {"heading": "2 Methods", "level": 1, "text": "We measured things."}],
    # map / reduce prompts (dlbatch/prompts/longdoc.py)
    "task": "summary", "instruction": "Summarize this paper in three sentences.", "chunk_index": 1,
    "chunk_count": 2, "notes": "Part 1:\nA first note.\n\nPart 2:\nA second note.", "count": 2, "level": 1,
    "final": True,
}


def check_template(name: str, prompt: str, allowed: Iterable[str] = TEMPLATE_VARIABLES,
                   columns: bool = False) -> jinja2.Template:
    """:func:`validate_template`, then one render against :data:`SAMPLE_CONTEXT` (the
    ``allowed`` names of it): a template that reaches an undefined or unsafe value or goes
    past a render bound there is refused with a :class:`TemplateError` naming it, and so is
one that reads an attribute or item whose name starts with ``_``, or that runs out of
    memory (MemoryError). Other failures depend on the document and are that document's
    task error at run time."""
    allowed = tuple(allowed)
    template = validate_template(name, prompt, allowed, columns)
    private = sorted(_private_names(_ENV.parse(prompt)), key=prompt.find)
    if private:  # the sandbox refuses them at render time too; here the job file is refused at once
        raise TemplateError(name, f"prompt template is not allowed to read {private[0]!r}: attributes and items "
                                  "whose name starts with '_' are unsafe")
    sample = document_context(SAMPLE_CONTEXT) if "section" in allowed else {}
    context = {k: sample.get(k, SAMPLE_CONTEXT.get(k)) for k in allowed}
    if columns:
        context.update({c: "sample" for c in column_references(prompt) if c not in context})
        context["row"] = _SampleRow()
    try:
        _render_bounded(template, context)
    except RenderLimit as e:
        raise TemplateError(name, f"prompt template goes past a render bound on a sample document: {e}") from None
    except MemoryError:
        raise TemplateError(name, "prompt template ran out of memory (MemoryError) on a sample document, within "
                                  "the render bounds (dlbatch/prompts/sandbox.py)") from None
    except RecursionError:
        raise TemplateError(name, "prompt template recursed too deeply on a sample document") from None
    except (SecurityError, UndefinedError) as e:
        raise TemplateError(name, f"prompt template fails on a sample document: {e}") from None
    except Exception:  # noqa: BLE001 - depends on the document (a type, a missing key): its task error at run time
        pass
    return template


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
        compiled.append((name, validate_template(name, prompt, columns=True)))
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


def _no_image(*args):
    raise ValueError("this task renders no images: give it images: (docs/multimodal.md)")


_NO_IMAGES = {"page_images": "", "figures": "", "page_image": _no_image, "figure": _no_image, "images": "",
              "image": _no_image}


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
    for k in IMAGE_VARIABLES:  # the task's images when it asks for them (dlbatch/prompts/multimodal.py)
        context[k] = doc[k] if k in doc else _NO_IMAGES[k]
    row = doc.get("row") or {}
    context["row"] = row
    for k, v in row.items():  # columns by their plain names, where no variable has the name
        if isinstance(k, str) and k not in context and k not in TEMPLATE_VARIABLES:
            context[k] = v
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

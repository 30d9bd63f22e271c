"""Sandboxed prompt templates."""
from __future__ import annotations

import warnings

import pytest

from dlbatch.prompts.templates import (
    TEMPLATE_VARIABLES,
    TemplateError,
    check_shared_prefix,
    compile_task_templates,
    split_prefix,
    validate_template,
)

DOC = {"text": "Attention is all you need.", "title": "Transformers", "doc_id": "d1", "source": "s3://b/p.pdf", "pages": 11}


def tasks(*prompts):
    return [{"name": f"t{i}", "prompt": p} for i, p in enumerate(prompts)]


def test_renders_every_task_in_order_with_all_variables():
    render = compile_task_templates(
        tasks(
            "{{ text }}\n\nSummarize.",
            "{{ text }}\nTitle: {{ title }} ({{ pages }} pages, {{ doc_id }}, {{ source }})",
        )
    )
    assert render(DOC) == [
        "Attention is all you need.\n\nSummarize.",
        "Attention is all you need.\nTitle: Transformers (11 pages, d1, s3://b/p.pdf)",
    ]
    assert set(TEMPLATE_VARIABLES) == {"text", "title", "doc_id", "source", "pages", "abstract", "references",
                                       "text_without_references", "section", "row",
                                       "page_images", "page_image", "figures", "figure", "images",
                                       "image"}  # docs/multimodal.md


def test_rendering_is_verbatim_no_html_escaping_and_trailing_newline_kept():
    doc = dict(DOC, text="a < b & c > d")
    assert compile_task_templates(tasks("{{ text }}\n"))(doc) == ["a < b & c > d\n"]


def test_accepts_task_objects():
    class Task:
        def __init__(self, name, prompt):
            self.name, self.prompt = name, prompt

    assert compile_task_templates([Task("x", "[{{ doc_id }}]")])(DOC) == ["[d1]"]


def test_syntax_error_names_the_task_and_line():
    with pytest.raises(TemplateError) as info:
        compile_task_templates(tasks("{{ text }}", "{{ text }}\n{% if %}"))
    assert str(info.value).startswith("task 't1': prompt template syntax error at line 2")
    assert info.value.task == "t1"
    assert isinstance(info.value, ValueError)


def test_unknown_variable_is_caught_at_compile_time():
    with pytest.raises(TemplateError, match=r"task 'kw': .*undefined variable\(s\) 'txt'"):
        validate_template("kw", "{{ txt }}")
    validate_template("kw", "{% set n = 3 %}{{ text[:n] }}")  # locals are fine


def test_missing_document_field_raises_strict_undefined_naming_variable():
    render = compile_task_templates(tasks("{{ text }} by {{ title }}"))
    with pytest.raises(TemplateError) as info:
        render({"text": "x"})
    assert "task 't0'" in str(info.value) and "'title' is undefined" in str(info.value)


def test_strict_undefined_on_attributes():
    render = compile_task_templates(tasks("{{ text.nonexistent }}"))
    with pytest.raises(TemplateError, match="task 't0': .*nonexistent"):
        render(DOC)


@pytest.mark.parametrize(
    "payload",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ text.__class__ }}",
        "{{ title.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.makedirs(MARKER) }}",
        "{{ lipsum.__globals__['os'].makedirs(MARKER) }}",
        "{% for c in ''.__class__.__base__.__subclasses__() %}{% if c.__name__ == 'Popen' %}"
        "{{ c(['mkdir', MARKER]) }}{% endif %}{% endfor %}",
    ],
)
def test_ssti_payloads_are_blocked(payload, tmp_path):
    marker = tmp_path / "pwned"
    payload = payload.replace("MARKER", repr(str(marker)))
    with pytest.raises(TemplateError) as info:
        render = compile_task_templates([{"name": "evil", "prompt": payload}])
        render(DOC)
    msg = str(info.value)
    assert msg.startswith("task 'evil': ")
    assert "<class" not in msg  # nothing of the object graph leaks into the message
    assert not marker.exists()


def test_ssti_message_says_unsafe():
    render = compile_task_templates([{"name": "evil", "prompt": "{{ ''.__class__.__mro__ }}"}])
    with pytest.raises(TemplateError, match=r"task 'evil': prompt template is not allowed.*__class__.*unsafe"):
        render(DOC)


def test_immutable_sandbox_blocks_mutation():
    render = compile_task_templates([{"name": "m", "prompt": "{% set l = [1] %}{{ l.append(2) }}{{ l }}"}])
    with pytest.raises(TemplateError, match="task 'm'"):
        render(DOC)


def test_split_prefix():
    assert split_prefix([]) == 0
    assert split_prefix(["abc"]) == 3
    assert split_prefix(["abcX", "abcY", "abZ"]) == 2
    assert split_prefix(["", "abc"]) == 0
    long = "x" * 10000
    assert split_prefix([long + "1", long + "2", long + "12"]) == 10000
    assert split_prefix([long, long]) == 10000


def test_check_shared_prefix_true_when_document_first():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_shared_prefix(tasks("{{ text }}\n\nA", "{{ text }}\n\nB")) is True
        # a shared header before the document still shares the whole document
        assert check_shared_prefix(tasks("Paper:\n{{ text }}\nA", "Paper:\n{{ text }}\nB")) is True


def test_check_shared_prefix_warns_when_not():
    with pytest.warns(UserWarning, match=r"'t1'.*do not start with the document"):
        assert check_shared_prefix(tasks("{{ text }}\nA", "Summarize: {{ text }}")) is False
    with pytest.warns(UserWarning):
        assert check_shared_prefix(tasks("{{ title }}: summarize")) is False


# ------------------------------------------------------------------ document structure

PAPER = {
    "text": "T\n\nAbstract\n\nWe did X.\n\n1 Introduction\n\nIntro.\n\n3 Methods\n\nM.\n\n3.1 Sites\n\nS."
            "\n\n4 Results\n\nR.\n\nReferences\n\n[1] A. B. C, 2001.",
    "title": "T", "doc_id": "d", "source": "s", "pages": 9, "abstract": "We did X.",
    "sections": [{"heading": "1 Introduction", "level": 1, "text": "Intro."},
                 {"heading": "3 Methods", "level": 1, "text": "M."},
                 {"heading": "3.1 Sites", "level": 2, "text": "S."},
                 {"heading": "4 Results", "level": 1, "text": "R."}],
    "references": "[1] A. B. C, 2001.",
}
PAPER["references_span"] = [PAPER["text"].index("References"), len(PAPER["text"])]


def test_structure_variables():
    render = compile_task_templates(tasks(
        "{{ abstract }}|{{ references }}",
        "{{ section('Methods') }}",
        "{{ section('METHODS') }}/{{ section('3 methods') }}/{{ section('iii. methods') }}",
        "{{ section('intro') }}|{{ section('Sites') }}",
        "[{{ section('Appendix') }}]{% if not section('Appendix') %}none{% endif %}",
        "{{ text_without_references }}",
    ))
    out = render(PAPER)
    assert out[0] == "We did X.|[1] A. B. C, 2001."
    assert out[1] == "M.\n\n3.1 Sites\n\nS."  # subsections included, the next level-1 section not
    assert out[2] == "/".join([out[1]] * 3)    # case and numbering do not matter
    assert out[3] == "Intro.|S."                # prefix match
    assert out[4] == "[]none"
    assert out[5] == PAPER["text"][:PAPER["text"].index("\n\nReferences")]
    assert "[1]" not in out[5] and out[5].endswith("R.")


def test_structure_defaults_without_sections():
    """Formats without structure (jsonl, text): abstract/references empty, no sections,
    text_without_references is the text."""
    render = compile_task_templates(tasks("{{ abstract }}|{{ section('Methods') }}|{{ text_without_references }}"))
    assert render(DOC) == ["||Attention is all you need."]


def test_section_cannot_escape_the_sandbox():
    render = compile_task_templates(tasks("{{ section.__globals__ }}"))
    with pytest.raises(TemplateError, match="t0"):
        render(PAPER)

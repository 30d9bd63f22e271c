"""A document's structure from its paragraphs: title, abstract, headed sections, references.

The PDF connector hands over every paragraph of the extracted text with its style (font
size and boldness of the characters, number of lines). ``split_sections`` assigns each
paragraph to exactly one part, in order::

    front       everything before the first section heading (title, authors, abstract)
    section     a heading paragraph and the body paragraphs up to the next heading
    references  a section whose heading is References / Bibliography / Works Cited ...

Invariant (tested): joining the parts' paragraphs in order gives back the text's
paragraphs, so no text is lost or duplicated.

A paragraph is a heading when it is short (at most 3 lines, 16 words, 120 characters),
does not end like a sentence, and either stands out in style (bold, or larger than the
body text but not the title) or is numbered ("3", "3.1", "IV.", "A.") with a capital
after the number, or is a well-known section name set in capitals (INTRODUCTION).
Captions ("Figure 3: ...", "Table 2. ...") never are. The level of a heading is its
numbering depth ("3" -> 1, "3.1" -> 2), else 1.

The abstract is the paragraph(s) after a paragraph reading "Abstract" up to the first
section heading, or the rest of a paragraph that starts with "Abstract" followed by a
dash, colon or full stop.
"""
from __future__ import annotations

import dataclasses
import re

REFERENCE_HEADINGS = ("references", "bibliography", "works cited", "literature cited", "reference list",
                      "literature")
_KNOWN = ("abstract", "introduction", "background", "related work", "methods", "materials and methods",
          "method", "results", "discussion", "conclusion", "conclusions", "acknowledgments",
          "acknowledgements", "appendix", "references", "bibliography", "summary", "evaluation")
_NUMBERED_RE = re.compile(r"^(?:(\d{1,2}(?:\.\d{1,2}){0,3})\.?|([IVX]{1,5})\.|([A-Z])\.?)\s+([A-Z][^\n]*)$")
_CAPTION_RE = re.compile(r"^(fig\.|figure|table|listing|algorithm)\s*\d+[.:]", re.IGNORECASE)
_ABSTRACT_INLINE_RE = re.compile(r"^abstract\s*(?:[.:\u2014\u2013\-]\s*)(\S.*)$", re.IGNORECASE | re.DOTALL)
_NUMBER_PREFIX_RE = re.compile(r"^(?:\d{1,2}(?:\.\d{1,2}){0,3}\.?|[IVX]{1,5}\.|[A-Z]\.)\s+", re.IGNORECASE)


@dataclasses.dataclass
class Para:
    """One paragraph of the extracted text with the style of most of its characters."""
    text: str
    size: float = 0.0
    bold: bool = False
    lines: int = 1


@dataclasses.dataclass
class Part:
    kind: str                    # "front" | "section" | "references"
    heading: str                 # "" for the front matter
    level: int
    paragraphs: list[str]        # body paragraphs (the heading not included)

    @property
    def text(self) -> str:
        return "\n\n".join(self.paragraphs)


def normalize_heading(heading: str) -> str:
    """'3.1 Field Sites' -> 'field sites'; 'IV. RESULTS' -> 'results'."""
    h = _NUMBER_PREFIX_RE.sub("", heading.strip())
    return re.sub(r"\s+", " ", h).strip(" .:").lower()


def _heading_level(text: str) -> int:
    m = _NUMBERED_RE.match(text)
    if m and m.group(1):
        return m.group(1).count(".") + 1
    return 1


def is_heading(p: Para, body_size: float, title_size: float | None) -> bool:
    text = p.text.strip()
    words = text.split()
    if not text or len(text) > 120 or len(words) > 16 or p.lines > 3:
        return False
    if text[-1] in ".,;:!?" or _CAPTION_RE.match(text) or not re.search(r"[^\W\d_]{3}", text):
        return False  # a sentence, a caption or a figure's axis label, not a heading
    styled = p.bold or (p.size >= body_size + 0.5 and (title_size is None or p.size < title_size - 0.1))
    known_caps = text.isupper() and normalize_heading(text) in _KNOWN
    m = _NUMBERED_RE.match(text)
    plain_numbered = m is not None and not m.group(3) and len(words) <= 8 and p.lines == 1
    return styled or known_caps or plain_numbered


def _is_abstract_heading(text: str) -> bool:
    return normalize_heading(text) == "abstract"


def split_sections(paras: list[Para], title: str | None = None) -> list[Part]:
    """Assign every paragraph to the front matter, a section or the references (in order)."""
    if not paras:
        return []
    chars: dict[float, int] = {}
    for p in paras:
        chars[p.size] = chars.get(p.size, 0) + len(p.text)
    body_size = max(chars, key=chars.get)
    top_size = max(p.size for p in paras)
    title_size = top_size if top_size > body_size + 0.5 else None
    # author names are often set bold above the abstract: nothing before it is a heading
    abstract_at = next((i for i, p in enumerate(paras[:40]) if _is_abstract_heading(p.text)
                        or _ABSTRACT_INLINE_RE.match(p.text.strip())), -1)
    parts = [Part("front", "", 0, [])]
    for i, p in enumerate(paras):
        if i <= abstract_at:
            parts[0].paragraphs.append(p.text)
            continue
        in_front = len(parts) == 1
        # the title: the metadata title's paragraph, or the largest type before any heading
        is_title = in_front and ((title is not None and p.text.strip() == title.strip())
                                 or (title_size is not None and p.size >= title_size - 0.1))
        if not is_title and not _is_abstract_heading(p.text) and is_heading(p, body_size, title_size):
            kind = "references" if normalize_heading(p.text) in REFERENCE_HEADINGS else "section"
            parts.append(Part(kind, p.text.strip(), _heading_level(p.text.strip()), []))
        else:
            parts[-1].paragraphs.append(p.text)
    return parts


def find_abstract(front: Part) -> str:
    paras = front.paragraphs
    for i, text in enumerate(paras):
        if _is_abstract_heading(text):
            return "\n\n".join(paras[i + 1:])
        m = _ABSTRACT_INLINE_RE.match(text.strip())
        if m:
            return "\n\n".join([m.group(1)] + paras[i + 1:])
    return ""


def structure(paras: list[Para], title: str | None) -> dict:
    """The row fields: abstract, sections [{heading, level, text}], references, and the
    character span of the references part (heading included) in ``"\\n\\n".join(texts)``."""
    parts = split_sections(paras, title)
    sections, refs, span = [], [], None
    offset = 0
    for part in parts:
        pieces = ([part.heading] if part.heading else []) + part.paragraphs
        length = sum(len(x) for x in pieces) + 2 * max(0, len(pieces) - 1)
        start = offset
        offset += length + (2 if pieces else 0)
        if part.kind == "section":
            sections.append({"heading": part.heading, "level": part.level, "text": part.text})
        elif part.kind == "references":
            refs.append(part.text)
            span = span or [start, start + length]
    return {"abstract": find_abstract(parts[0]) if parts else "", "sections": sections,
            "references": "\n\n".join(refs), "references_span": span}

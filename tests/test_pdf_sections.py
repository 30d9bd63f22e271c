"""connectors/sections.py through the PDF connector: title, abstract, headed sections and
references, with no text lost or duplicated compared with the plain text.

PDFs not written for this project: set DLBATCH_EXTERNAL_PDFS to a folder of them (for
example the vignettes of Debian's r-cran-zoo / r-cran-sandwich, extracted with
``apt-get download r-cran-zoo && dpkg -x r-cran-zoo_*.deb x``); they are not shipped
(GPL), see docs/long_documents.md for a run over them.
"""
from __future__ import annotations

import os
import pathlib

import pytest

from connectors.pdf import extract_pdf, styled_paragraphs
from connectors.sections import Para, normalize_heading, split_sections
from tests.helpers.pdfs import PAPERS_DIR, SAMPLES


def _row(paper):
    data = (PAPERS_DIR / f"{paper.slug}.pdf").read_bytes()
    return data, extract_pdf(data, paper.slug)


def _check_lossless(data: bytes, row: dict) -> list:
    """Every paragraph of the text belongs to exactly one part, in order; the row's fields
    are those parts."""
    paras = styled_paragraphs(data)
    assert "\n\n".join(p.text for p in paras) == row["text"]
    parts = split_sections(paras, row["title"])
    flat = [x for part in parts for x in ([part.heading] if part.heading else []) + part.paragraphs]
    assert flat == [p.text for p in paras]
    sections = [p for p in parts if p.kind == "section"]
    assert [s["heading"] for s in row["sections"]] == [p.heading for p in sections]
    assert [s["text"] for s in row["sections"]] == [p.text for p in sections]
    refs = [p for p in parts if p.kind == "references"]
    if refs:
        a, b = row["references_span"]
        assert row["text"][a:b] == refs[0].heading + "\n\n" + refs[0].text
        assert row["references"].startswith(refs[0].text)
    else:
        assert row["references"] == "" and row["references_span"] is None
    return parts


@pytest.mark.parametrize("paper", SAMPLES.PAPERS, ids=lambda p: p.slug)
def test_sample_structure_matches_source(paper):
    data, row = _row(paper)
    _check_lossless(data, row)
    assert row["title"] == paper.title
    assert row["abstract"] == paper.abstract
    assert [s["heading"] for s in row["sections"]] == [h for h, _ in paper.sections]
    for sec, (_, body) in zip(row["sections"], paper.sections):
        source = " ".join(p.caption if isinstance(p, SAMPLES.Figure) else p for p in body)
        assert sec["text"].split() == source.split()
        assert sec["level"] == (2 if "." in sec["heading"].split()[0] else 1)
    assert row["references"].split() == " ".join(paper.references).split()


def test_heading_rules():
    body = 10.0
    para = lambda text, size=body, bold=False, lines=1: Para(text, size, bold, lines)  # noqa: E731
    parts = split_sections([
        para("A Title In Large Type", size=18), para("J. Doe, Example Lab"), para("Abstract", bold=True),
        para("We study things. " * 5, lines=4),
        para("1 Introduction"),                                   # numbered, plain style
        para("Body text of the introduction. " * 6, lines=5),
        para("Figure 1: A caption that is short", size=9),        # a caption, never a heading
        para("2 The reason we wrote this paper is clear."),       # ends like a sentence
        para("Methods", bold=True),                               # unnumbered, bold
        para("Body text of the methods. " * 6, lines=5),
        para("Z", size=14),                                       # an axis label
        para("REFERENCES"),                                       # known name in capitals
        para("[1] A. Author. A title. A venue, 2001.", size=9),
    ], title="A Title In Large Type")
    assert [(p.kind, p.heading) for p in parts] == [("front", ""), ("section", "1 Introduction"),
                                                    ("section", "Methods"), ("references", "REFERENCES")]
    assert parts[0].paragraphs[:2] == ["A Title In Large Type", "J. Doe, Example Lab"]
    assert len(parts[1].paragraphs) == 3 and parts[2].paragraphs[-1] == "Z"


def test_normalize_heading():
    assert normalize_heading("3.1 Field Sites") == "field sites"
    assert normalize_heading("IV. RESULTS") == "results"
    assert normalize_heading("2.1. Creation of objects") == "creation of objects"
    assert normalize_heading("Methods:") == "methods"


def _external_pdfs() -> list[pathlib.Path]:
    folder = os.environ.get("DLBATCH_EXTERNAL_PDFS")
    return sorted(pathlib.Path(folder).rglob("*.pdf")) if folder else []


@pytest.mark.skipif(not _external_pdfs(), reason="set DLBATCH_EXTERNAL_PDFS to a folder of third-party PDFs")
@pytest.mark.parametrize("path", _external_pdfs(), ids=lambda p: p.name)
def test_external_pdf_structure_is_lossless(path):
    data = path.read_bytes()
    row = extract_pdf(data, str(path))
    if row["error"]:
        pytest.skip(f"{path.name}: {row['error']}")
    parts = _check_lossless(data, row)
    if row["pages"] >= 3:
        assert len([p for p in parts if p.kind == "section"]) >= 2, f"{path.name}: no headings found"

"""connectors.pdf: the sample papers come out clean and in reading order; bad PDFs -> error rows."""

from __future__ import annotations

import re

import pymupdf
import pytest

from connectors.pdf import (extract_pdf, is_page_number, join_lines, normalize_ligatures, tidy_line)
from tests.helpers.bad_inputs import (blank_pdf, corrupt_pdf, encrypted_pdf, good_pdf, image_only_pdf,
                                      oversized_pdf, truncated_pdf)
from tests.helpers.pdfs import PAPERS_DIR, SAMPLES

PAPER_IDS = [p.slug for p in SAMPLES.PAPERS]
SHORT_IDS = [p.slug for p in SAMPLES.SHORT_PAPERS]
LONG_IDS = [p.slug for p in SAMPLES.LONG_PAPERS]


@pytest.fixture(scope="module")
def extracted():
    out = {}
    for paper in SAMPLES.PAPERS:
        path = PAPERS_DIR / f"{paper.slug}.pdf"
        out[paper.slug] = (paper, path.read_bytes(), extract_pdf(path.read_bytes(), str(path)))
    return out


def _raw_lines(data: bytes) -> list[str]:
    doc = pymupdf.open(stream=data, filetype="pdf")
    return [line for page in doc for line in page.get_text().splitlines()]


# ------------------------------------------------------------------ sample papers


def test_samples_are_small_multi_page_and_have_the_features_we_undo(extracted):
    two_column = 0
    for paper, data, _ in (extracted[slug] for slug in SHORT_IDS):
        assert len(data) < 100 * 1024
        doc = pymupdf.open(stream=data, filetype="pdf")
        assert 2 <= doc.page_count <= 4
        assert 790 <= SAMPLES.word_count(paper) <= 2000
        lines = _raw_lines(data)
        # raw text still has what extraction must remove
        assert sum(l.strip() == paper.header for l in lines) == doc.page_count
        assert any(re.fullmatch(r"(Page )?1( of \d)?", l.strip()) for l in lines)
        assert any(l.rstrip().endswith("-") and l.rstrip()[-2].isalpha() for l in lines)
        if paper.ligatures:
            assert any(ch in l for l in lines for ch in "\ufb00\ufb01\ufb02\ufb03\ufb04")
        two_column += paper.columns == 2
    assert two_column >= 2


def test_long_samples_have_real_length_and_structure(extracted):
    """>= 8K tokens and 8-20 pages each, two columns, captions and references; the
    repository stays small."""
    from dlbatch.engine.loader import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    assert len(LONG_IDS) >= 4
    for slug in LONG_IDS:
        paper, data, row = extracted[slug]
        assert len(data) < 160 * 1024
        assert 8 <= row["pages"] <= 20
        assert len(tok.encode(row["text"], add_special_tokens=False)) >= 8000
        assert paper.columns == 2 and paper.references
        assert any(isinstance(p, SAMPLES.Figure) for _, paras in paper.sections for p in paras)
        lines = _raw_lines(data)
        assert sum(l.strip() == paper.header for l in lines) == row["pages"]
        assert any(l.startswith("Figure 1:") for l in lines) and "References" in lines
    assert sum(p.stat().st_size for p in PAPERS_DIR.glob("*.pdf")) < 2 * 1024 * 1024


@pytest.mark.parametrize("slug", LONG_IDS)
def test_long_sample_text_has_every_word_in_order(extracted, slug):
    """Every word of the source, in order, nothing else. Paragraph boundaries are not
    compared: a paragraph that a column break splits right after a full stop cannot be
    told from two paragraphs without indentation, so the extractor may split it."""
    paper, _, row = extracted[slug]
    assert row["error"] is None
    assert row["text"].split() == " ".join(paper.paragraphs()).split()
    paragraphs = row["text"].split("\n\n")
    assert set(paper.paragraphs()[:4]) <= set(paragraphs)  # title, authors, Abstract, abstract
    headings = [h for h, _ in paper.sections] + ["References"]
    assert [p for p in paragraphs if p in headings] == headings


@pytest.mark.parametrize("slug", SHORT_IDS)
def test_sample_paper_text_matches_source_exactly(extracted, slug):
    """Same paragraphs, same order: columns read left then right, headers/footers/page
    numbers gone, hyphenated words joined, ligatures expanded."""
    paper, _, row = extracted[slug]
    assert row["error"] is None and row["error_type"] is None
    paragraphs = row["text"].split("\n\n")
    assert paragraphs == paper.paragraphs()


@pytest.mark.parametrize("slug", PAPER_IDS)
def test_sample_paper_metadata(extracted, slug):
    paper, data, row = extracted[slug]
    # title from metadata where set, else from the largest font on page 1
    assert pymupdf.open(stream=data, filetype="pdf").metadata["title"] == (paper.title if paper.metadata_title else "")
    assert row["title"] == paper.title
    assert row["pages"] == pymupdf.open(stream=data, filetype="pdf").page_count
    assert row["doc_id"] == extract_pdf(data, "elsewhere.pdf")["doc_id"]  # content id, not path
    assert re.fullmatch(r"[0-9a-f]{16}", row["doc_id"])


def test_headers_footers_and_hyphen_fragments_absent(extracted):
    for paper, data, row in extracted.values():
        text = row["text"]
        assert paper.header not in text
        assert not re.search(r"Page \d+ of \d+", text)
        assert not re.search(r"(^|\n)\d+(\n|$)", text)
        assert not any(ch in text for ch in "\ufb00\ufb01\ufb02\ufb03\ufb04\ufb05\ufb06")
        source_words = {w for p in paper.paragraphs() for w in p.split()}
        broken = [l.split()[-1] for l in _raw_lines(data)
                  if l.rstrip().endswith("-") and l.split()[-1] not in source_words]
        assert broken, "the sample should contain line-end hyphenation"
        for fragment in broken:
            assert f" {fragment} " not in f" {text} "
            assert SAMPLES.ligate(fragment) not in text


def test_two_column_reading_order(extracted):
    paper, data, row = extracted["paged_attention_batch"]
    doc = pymupdf.open(stream=data, filetype="pdf")
    blocks = [b for b in doc[0].get_text("blocks") if b[6] == 0]
    mid = doc[0].rect.width / 2
    left = [b for b in blocks if b[2] < mid and b[1] > 200]
    right = [b for b in blocks if b[0] > mid and b[3] < 740]
    assert left and right
    # the last left-column block on page 1 ends mid-paragraph; the right column continues it
    left_tail = max(left, key=lambda b: b[3])[4].split()[-3:]
    right_head = min(right, key=lambda b: b[1])[4].split()[:3]
    text = row["text"]
    assert text.index(" ".join(left_tail)) < text.index(" ".join(right_head))
    # pymupdf's plain top-to-bottom sort would interleave the columns; ours does not
    naive = doc[0].get_text("text", sort=True)
    assert naive.index(right_head[0] + " " + right_head[1]) < naive.index(" ".join(left_tail[-2:]))


@pytest.mark.parametrize("index", [1, 4])
def test_generator_is_deterministic(index):
    paper = SAMPLES.PAPERS[index]
    assert SAMPLES.build_pdf(paper) == (PAPERS_DIR / f"{paper.slug}.pdf").read_bytes()
    if paper.references:  # the generated text too, not only the drawing
        assert SAMPLES.long_paper(SAMPLES.LONG_TOPICS[index - 4]) == paper


# ------------------------------------------------------------------ string-level helpers


def test_ligature_normalisation_all_code_points():
    assert normalize_ligatures("\ufb00 \ufb01 \ufb02 \ufb03 \ufb04 \ufb05 \ufb06") == "ff fi fl ffi ffl st st"
    assert normalize_ligatures("e\ufb03cient \ufb02ow") == "efficient flow"
    assert tidy_line("  a\u00a0\u00a0b\tc  ") == "a b c"


def test_join_lines_hyphenation_rules():
    assert join_lines(["the compu-", "tation ends"]) == "the computation ends"
    assert join_lines(["a non-", "English text"]) == "a non-English text"
    assert join_lines(["soft\u00ad", "ware"]) == "software"
    assert join_lines(["pages 3-", "5"]) == "pages 3- 5"
    assert join_lines(["key-", "value pairs"], vocabulary={"key-value"}) == "key-value pairs"
    assert join_lines(["key-", "value pairs"], vocabulary={"key-value", "keyvalue"}) == "keyvalue pairs"
    assert join_lines(["one", "", " two "]) == "one two"


def test_page_number_patterns():
    for s in ["7", "Page 7", "page 7 of 12", "7 of 12", "- 7 -", "\u2013 12 \u2013", "vii", "3/10"]:
        assert is_page_number(s), s
    for s in ["7 apples", "Figure 3", "Page seven", "2024 results", ""]:
        assert not is_page_number(s), s


# ------------------------------------------------------------------ synthetic layouts


def test_single_page_number_footer_dropped_but_body_kept():
    doc = pymupdf.open()
    page = doc.new_page()
    page.insert_text((72, 100), "Only one page of body text here.", fontsize=11)
    page.insert_text((300, 780), "1", fontsize=9)
    row = extract_pdf(doc.tobytes(), "one.pdf")
    assert row["text"] == "Only one page of body text here."
    assert row["title"] is None  # one font size, no metadata title: no title
    assert row["pages"] == 1


def test_full_width_block_between_columns_keeps_its_place():
    doc = pymupdf.open()
    page = doc.new_page()
    page.insert_text((72, 90), "Top full width heading line that spans the page width clearly", fontsize=12)
    page.insert_text((72, 140), "alpha left one", fontsize=10)
    page.insert_text((330, 140), "beta right one", fontsize=10)
    page.insert_text((72, 300), "Middle full width figure caption that crosses the whole page", fontsize=10)
    page.insert_text((72, 360), "gamma left two", fontsize=10)
    page.insert_text((330, 360), "delta right two", fontsize=10)
    text = extract_pdf(doc.tobytes(), "x.pdf")["text"]
    order = ["Top full", "alpha", "beta", "Middle full", "gamma", "delta"]
    positions = [text.index(s) for s in order]
    assert positions == sorted(positions)


# ------------------------------------------------------------------ bad PDFs


@pytest.mark.parametrize("make, error_type, needle", [
    (corrupt_pdf, "CorruptPDF", "cannot open"),
    (truncated_pdf, "CorruptPDF", "truncated"),
    (encrypted_pdf, "EncryptedPDF", "password"),
    (blank_pdf, "EmptyDocument", "no text"),
    (image_only_pdf, "ImageOnlyPDF", "image"),
    (lambda: b"", "EmptyDocument", "empty"),
    (lambda: b"hello, not a pdf", "CorruptPDF", "not a PDF"),
])
def test_bad_pdf_becomes_error_row(make, error_type, needle):
    data = make()
    row = extract_pdf(data, "bad.pdf")
    assert row["error_type"] == error_type
    assert needle in row["error"]
    assert row["text"] == ""
    assert row["source"] == "bad.pdf"
    assert row["doc_id"] == extract_pdf(data, "other.pdf")["doc_id"]  # hash of the raw bytes


def test_encrypted_with_empty_user_password_is_readable():
    doc = pymupdf.open()
    doc.new_page().insert_text((72, 100), "Readable although encrypted.", fontsize=11)
    data = doc.tobytes(encryption=pymupdf.PDF_ENCRYPT_AES_256, owner_pw="owner-only", user_pw="")
    row = extract_pdf(data, "owner.pdf")
    assert row["error"] is None and row["text"] == "Readable although encrypted."


def test_max_pages_caps_pages_read():
    data = oversized_pdf(40)
    full = extract_pdf(data, "big.pdf")
    capped = extract_pdf(data, "big.pdf", max_pages=5)
    assert full["pages"] == capped["pages"] == 40
    assert "marker-040" in full["text"] and "marker-005" in capped["text"]
    assert "marker-006" not in capped["text"]
    with pytest.raises(ValueError, match="max_pages"):
        extract_pdf(data, "big.pdf", max_pages=0)


def test_good_pdf_row_shape():
    row = extract_pdf(good_pdf(), "good.pdf")
    assert set(row) == {"doc_id", "source", "text", "title", "pages", "error", "error_type",
                        "abstract", "sections", "references", "references_span"}
    assert row["text"].startswith("A good paper about coastal fog.")
